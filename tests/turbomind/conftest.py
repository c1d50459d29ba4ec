"""Workspaces for engine tests: tiny random models deployed with lmd.deploy (fp32 unless told otherwise)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import build_tiny_model


def deploy_tiny(root: Path, model_type: str = "llama", model_name: str = "base", randomize_bias: bool = False,
                **overrides) -> tuple[Path, Path]:
    """(HF source dir, workspace dir) of a tiny random model."""
    from lmd.deploy.converter import deploy

    src = build_tiny_model(root / "hf", model_type, **overrides)
    if randomize_bias:  # HF initialises biases to zero, which would hide a bias that is dropped
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        torch.manual_seed(1)
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.data.normal_(0, 0.5)
        model.save_pretrained(src)
    ws = deploy(model_name, str(src), str(root / "ws"), dtype="float32", progress=False)
    return src, ws


@pytest.fixture(scope="session")
def tiny_llama_ws(tmp_path_factory) -> tuple[Path, Path]:
    return deploy_tiny(tmp_path_factory.mktemp("tiny-llama-ws"), "llama", model_name="hf")
