"""A deployed workspace on disk (docs/workspace.md): config, this rank's weights, tokenizer, chat template."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmd.errors import LmdError
from lmd.turbomind.config import EngineConfig, ModelConfig, read_config_ini
from lmd.workspace_format.rank_layout import check_tp, merge_ranks, split_ranks

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from lmd.chat_templates import ChatTemplate


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

    @property
    def rank_model(self) -> ModelConfig:
        """The model as this process runs it: the shapes of one of `engine.tp` ranks (the whole model at tp 1)."""
        return dataclasses.replace(self.model, tensor_para_size=self.engine.tp)

    def weights_file(self, rank: int | None = None) -> Path:
        return self.weights_dir / f"model.rank{self.engine.tp_rank if rank is None else rank}.safetensors"

    def kv_qparams_file(self) -> Path:
        return self.weights_dir / f"kv_qparams.rank{self.engine.tp_rank}.safetensors"

    def load_weights(self, device: str) -> dict[str, torch.Tensor]:
        """Rank `engine.tp_rank` of `engine.tp`'s tensors (checked against `rank_model`). The fast path reads that
        rank's file as written by `lmd deploy`; a TP other than the deployed one merges every rank file on the host
        and cuts this rank's part (docs/workspace.md, rank layout)."""
        from safetensors.torch import load_file

        from lmd.turbomind.weights import check_weights

        deployed, tp, rank = self.model.tensor_para_size, self.engine.tp, self.engine.tp_rank
        if tp == deployed:
            weights = load_file(str(self._rank_file(rank)), device=device)
        else:
            ranks = []
            for r in range(deployed):
                path = self._rank_file(r)
                ranks.append(load_file(str(path), device="cpu" if tp > 1 else device))
                check_weights(self.model, ranks[-1], str(path))
            whole = merge_ranks(ranks, self.model.rank_shape)
            del ranks
            weights = {name: t.contiguous().to(device) for name, t in
                       split_ranks(whole, self.model.rank_shape, tp, rank).items()}
        check_weights(self.rank_model, weights, str(self._rank_file(rank) if tp == deployed else self.weights_dir))
        return weights

    def load_kv_qparams(self, device: str) -> dict[str, torch.Tensor] | None:
        """Static KV int8 parameters of this process's KV heads (all of them at tp 1), flattened per tensor in head
        order; None when absent."""
        import torch
        from safetensors.torch import load_file

        deployed, tp, rank = self.model.tensor_para_size, self.engine.tp, self.engine.tp_rank
        paths = [self.weights_dir / f"kv_qparams.rank{r}.safetensors" for r in range(deployed)]
        present = [p for p in paths if p.is_file()]
        if not present:
            return None
        if len(present) != len(paths):
            raise LmdError(f"{self.weights_dir}: kv_qparams files exist for some ranks only; rerun `lmd kv-qparams`")
        if tp == deployed:
            return {name: t.reshape(-1) for name, t in load_file(str(paths[rank]), device=device).items()}
        files = [load_file(str(p), device=device) for p in paths]
        whole = {name: torch.cat([f[name].reshape(-1) for f in files]) for name in files[0]}
        heads = self.model.kv_head_num
        return {name: t.reshape(heads, -1).chunk(tp)[rank].reshape(-1) for name, t in whole.items()}

    def _rank_file(self, rank: int) -> Path:
        path = self.weights_file(rank)
        if not path.is_file():
            raise LmdError(f"{path} not found; the workspace was deployed with --tp {self.model.tensor_para_size}, "
                           "redeploy it")
        return path

    def load_tokenizer(self) -> PreTrainedTokenizerBase:
        from transformers import AutoTokenizer

        if not (self.tokenizer_dir / "tokenizer_config.json").is_file():
            raise LmdError(f"{self.tokenizer_dir} holds no tokenizer; redeploy the workspace with `lmd deploy`")
        return AutoTokenizer.from_pretrained(str(self.tokenizer_dir))

    def chat_template(self) -> ChatTemplate:
        from lmd.chat_templates import get_chat_template

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
    if engine.tp_rank >= engine.tp:
        raise LmdError(f"tp_rank={engine.tp_rank} but tp={engine.tp}")
    check_tp(engine.tp, model.rank_shape, flag="tp")
    return Workspace(root, model, engine)
