"""The engine a benchmark runs on: a workspace, or a model deployed into a temporary one (as `lmd.pipeline` does),
with the serving keys the user overrode; plus the facts about it that every report records."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lmd.errors import LmdError

if TYPE_CHECKING:
    from lmd.api import Pipeline
    from lmd.turbomind.engine import Engine

DTYPES = ("auto", "fp32", "fp16", "bf16")
_SPECULATIVE_FIELDS = ("speculative_method", "speculative_model", "num_speculative_tokens", "speculative_tree")


@dataclass(frozen=True)
class EngineOverrides:
    """Serving keys of config.ini to replace for this run; None keeps the workspace's value."""

    device: str = "auto"
    dtype: str = "auto"
    max_batch_size: int | None = None
    session_len: int | None = None
    max_context_token_num: int | None = None
    cache_max_entry_count: float | None = None
    cache_block_seq_len: int | None = None
    quant_policy: int | None = None
    tp: int | None = None  # tensor-parallel processes (docs/engine.md); None: 1, all ranks merged in one process
    pp: int | None = None  # pipeline stages (docs/engine.md); None: 1
    enforce_eager: bool = False  # decode steps without CUDA graphs
    offload_weights_gb: float | None = None  # GiB of layer weights kept in host memory (docs/engine.md)
    speculative_method: str | None = None  # the --speculative-* flags (lmd.engine_options.speculative_overrides)
    speculative_model: str | None = None
    num_speculative_tokens: int | None = None
    speculative_tree: str | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise LmdError(f"--dtype {self.dtype!r} is unknown; use {', '.join(DTYPES)}")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise LmdError(f"--device {self.device!r} is unknown; use auto, cpu or cuda[:N]")
        if self.quant_policy not in (None, 0, 4):
            raise LmdError(f"--quant-policy {self.quant_policy} is unknown; use 0 (KV in compute dtype) or 4 (KV int8)")

    def as_kwargs(self) -> dict[str, Any]:
        from lmd.engine_options import eager_overrides, speculative_overrides

        kwargs = {k: v for k, v in asdict(self).items() if v is not None and k != "enforce_eager"
                  and not k.endswith(_SPECULATIVE_FIELDS)}
        speculative = speculative_overrides(self.speculative_method, self.speculative_model,
                                            self.num_speculative_tokens, self.speculative_tree)
        return kwargs | eager_overrides(self.enforce_eager) | speculative


def open_engine(model: str, model_name: str, overrides: EngineOverrides) -> Pipeline:
    """A Pipeline whose `.engine` runs MODEL; close it when done (it deletes a temporary workspace)."""
    if not Path(model).expanduser().exists():
        raise LmdError(f"{model} does not exist; give a workspace (lmd deploy), an HF model directory or a .gguf file")
    from lmd.api import Pipeline

    return Pipeline(model, model_name, **overrides.as_kwargs())


def engine_facts(engine: Engine, model: str) -> dict[str, Any]:
    """What the numbers depend on: the model, its weight type, the device, and the engine configuration in force."""
    runner = engine.runner
    return {
        "model": model,
        "weight_type": engine.workspace.model.weight_type,
        "device": str(runner.device),
        "compute_dtype": str(runner.dtype).removeprefix("torch."),
        "kv_blocks": runner.num_blocks,
        "decode_graphs": runner.graphs is not None,
        "max_len": engine.max_len,
        "engine_config": asdict(engine.workspace.engine),
        "speculative": None if engine.speculative is None else asdict(engine.speculative),
    }
