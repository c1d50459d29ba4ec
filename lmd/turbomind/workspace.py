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
        """This rank's tensors, as written by `lmd deploy`."""
        from safetensors.torch import load_file

        path = self.weights_file()
        if not path.is_file():
            raise LmdError(f"{path} not found; redeploy the workspace (`lmd deploy ... --tp "
                           f"{self.model.tensor_para_size}`)")
        return load_file(str(path), device=device)

    def load_merged_weights(self, device: str) -> dict[str, torch.Tensor]:
        """Whole-model tensors (tensor_para_size = 1 layout) from every rank file, to run all ranks in one process."""
        from safetensors.torch import load_file

        from lmd.turbomind.rank_merge import merge_ranks
        from lmd.turbomind.weights import check_weights

        ranks = []
        for rank in range(self.model.tensor_para_size):
            path = self.weights_dir / f"model.rank{rank}.safetensors"
            if not path.is_file():
                raise LmdError(f"{path} not found; the workspace was deployed with --tp "
                               f"{self.model.tensor_para_size}, redeploy it")
            ranks.append(load_file(str(path), device=device))
            check_weights(self.model, ranks[-1], str(path))
        return ranks[0] if len(ranks) == 1 else merge_ranks(self.model, ranks)

    def load_kv_qparams(self, device: str, rank: int | None = None) -> dict[str, torch.Tensor] | None:
        """Static KV int8 parameters of all ranks, one value per KV head of the whole model, or of `rank` only (its KV
        heads, flattened); None when absent."""
        import torch
        from safetensors.torch import load_file

        paths = [self.weights_dir / f"kv_qparams.rank{r}.safetensors" for r in range(self.model.tensor_para_size)]
        present = [p for p in paths if p.is_file()]
        if not present:
            return None
        if len(present) != len(paths):
            raise LmdError(f"{self.weights_dir}: kv_qparams files exist for some ranks only; rerun `lmd kv-qparams`")
        if rank is not None:
            return {name: t.reshape(-1) for name, t in load_file(str(paths[rank]), device=device).items()}
        ranks = [load_file(str(p), device=device) for p in paths]
        return {name: torch.cat([rank[name].reshape(-1) for rank in ranks]) for name in ranks[0]}

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        from transformers import AutoTokenizer

        if not (self.tokenizer_dir / "tokenizer_config.json").is_file():
            raise LmdError(f"{self.tokenizer_dir} holds no tokenizer; redeploy the workspace with `lmd deploy`")
        return AutoTokenizer.from_pretrained(str(self.tokenizer_dir))

    def chat_template(self) -> ChatTemplate:
        from lmd.chat.templates import get_chat_template

        return get_chat_template(self.model.model_name)


def is_workspace(path: str | Path) -> bool:
    """Does `path` look like an `lmd deploy` output (cheap: no torch, no file reads)?"""
    return (Path(path).expanduser() / "triton_models" / "weights" / "config.ini").is_file()


def open_workspace(path: str | Path, **overrides: Any) -> Workspace:
    """Read and validate a workspace; `overrides` are EngineConfig fields that replace config.ini's serving keys."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise LmdError(f"workspace {root} does not exist; create it with `lmd deploy MODEL {root}`")
    model, engine = read_config_ini(root / "triton_models" / "weights" / "config.ini", overrides)
    if engine.tp_rank >= model.tensor_para_size:
        raise LmdError(f"tp_rank={engine.tp_rank} but the workspace has tensor_para_size={model.tensor_para_size}")
    if engine.tp > 1 and engine.tp != model.tensor_para_size:
        raise LmdError(f"tp={engine.tp} but {root} was deployed with tensor_para_size={model.tensor_para_size}; "
                       f"use tp={model.tensor_para_size} (or tp=1: all ranks in one process), "
                       f"or redeploy with `lmd deploy ... --tp {engine.tp}`")
    return Workspace(root, model, engine)
