"""Shared fixtures: tiny random Llama-family models (fast, deterministic) and the real SmolLM2 model."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
os.environ.setdefault("LMD_DATA_DIR", str(SHARED / "data"))
os.environ.setdefault("LMD_MODELS_DIR", str(SHARED / "models"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def build_tiny_model(path: Path, model_type: str = "llama", dtype: str = "float32", **overrides) -> Path:
    """Save a tiny random model of `model_type` (llama, mistral, qwen2, qwen3, phi3) with a real tokenizer when one is at
    hand."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=49152, max_position_embeddings=512, rms_norm_eps=1e-5,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(getattr(torch, dtype))
    for name, param in model.named_parameters():  # HF starts q/k norms (Qwen3) at ones: a swap would pass unseen
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            param.data.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    tok = smollm2_tokenizer()
    if tok is not None:
        tok.save_pretrained(path)
    return path


_TOKENIZER = None


def smollm2_tokenizer():
    """SmolLM2's tokenizer (vocab 49152, ChatML template) read from the GGUF once per session, or None."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from lmd.default_model import default_model_path
        from lmd.errors import LmdError
        from lmd.model_source import load_tokenizer, resolve_model

        try:
            _TOKENIZER = load_tokenizer(resolve_model(default_model_path(download=False)))
        except LmdError:
            return None
    return _TOKENIZER


@pytest.fixture(scope="session")
def tokenizer():
    """SmolLM2's tokenizer; tests that need it skip where the model file is absent."""
    tok = smollm2_tokenizer()
    if tok is None:
        pytest.skip("SmolLM2 tokenizer not available")
    return tok


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def smollm2_gguf() -> Path:
    from lmd.default_model import default_model_path
    from lmd.errors import LmdError

    try:
        return default_model_path(download=False)
    except LmdError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_gguf, tmp_path_factory) -> Path:
    """SmolLM2 converted once per session to an HF directory (fp32 safetensors): loads in ~1 s instead of ~20 s."""
    from lmd.model_source import load_causal_lm, load_tokenizer, resolve_model

    out = tmp_path_factory.mktemp("smollm2-hf")
    source = resolve_model(smollm2_gguf)
    load_causal_lm(source).save_pretrained(out)
    load_tokenizer(source).save_pretrained(out)
    return out


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
    """(HF dir, workspace) of a tiny random Llama deployed with MODEL_NAME `hf` (SmolLM2 tokenizer, ChatML); shared,
    never modified: copy it first to change files."""
    return deploy_tiny(tmp_path_factory.mktemp("tiny-llama-ws"), "llama", model_name="hf")
