"""A deployed workspace on disk (docs/workspace.md): config, this rank's weights, tokenizer, chat template."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmd.errors import LmdError
from lmd.turbomind.config import EngineConfig, ModelConfig, read_config_ini

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from lmd.chat.templates import ChatTemplate


@dataclass(frozen=True)
class Workspace:
    root: Path
    model: ModelConfig
    engine: EngineConfig

    @property
    def weights_dir(self) -> Path:
        return self.root / "triton_models" / "weights"

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / "triton_models" / "tokenizer"

    def weights_file(self) -> Path:
        return self.weights_dir / f"model.rank{self.engine.tp_rank}.safetensors"

    def kv_qparams_file(self) -> Path:
        return self.weights_dir / f"kv_qparams.rank{self.engine.tp_rank}.safetensors"

    def load_weights(self, device: str) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        path = self.weights_file()
        if not path.is_file():
            raise LmdError(f"{path} not found; redeploy the workspace (`lmd deploy ... --tp "
                           f"{self.model.tensor_para_size}`)")
        return load_file(str(path), device=device)

    def load_kv_qparams(self, device: str) -> dict[str, torch.Tensor] | None:
        from safetensors.torch import load_file

        path = self.kv_qparams_file()
        return load_file(str(path), device=device) if path.is_file() else None

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        from transformers import AutoTokenizer

        if not (self.tokenizer_dir / "tokenizer_config.json").is_file():
            raise LmdError(f"{self.tokenizer_dir} holds no tokenizer; redeploy the workspace with `lmd deploy`")
        return AutoTokenizer.from_pretrained(str(self.tokenizer_dir))

    def chat_template(self) -> ChatTemplate:
        from lmd.chat.templates import get_chat_template

        return get_chat_template(self.model.model_name)


def open_workspace(path: str | Path, **overrides: Any) -> Workspace:
    """Read and validate a workspace; `overrides` are EngineConfig fields that replace config.ini's serving keys."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise LmdError(f"workspace {root} does not exist; create it with `lmd deploy MODEL {root}`")
    model, engine = read_config_ini(root / "triton_models" / "weights" / "config.ini", overrides)
    if engine.tp_rank >= model.tensor_para_size:
        raise LmdError(f"tp_rank={engine.tp_rank} but the workspace has tensor_para_size={model.tensor_para_size}")
    return Workspace(root, model, engine)
