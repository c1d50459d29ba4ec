"""`triton_models/weights/config.ini`: the `[llama]` section every workspace reader and writer shares.

The field list is the key list of docs/workspace.md, in order. A user may edit the file by hand, so reading validates
each value and names the key on error.
"""

from __future__ import annotations

import configparser
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from lmd.errors import LmdError
from lmd.workspace_format.rank_layout import RankShape

SECTION = "llama"
WEIGHT_TYPES = ("fp16", "bf16", "fp32", "int4", "int8", "fp8")
ROPE_TYPES = ("none", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class WorkspaceConfig:
    model_name: str
    model_arch: str
    tensor_para_size: int
    head_num: int
    kv_head_num: int
    size_per_head: int
    hidden_units: int
    vocab_size: int
    num_layer: int
    inter_size: int
    norm_eps: float
    attn_bias: int
    start_id: int
    end_id: tuple[int, ...]
    session_len: int
    weight_type: str
    group_size: int
    compute_dtype: str
    rotary_embedding: int
    rope_theta: float
    rope_scaling_type: str
    rope_scaling_factor: float
    rope_low_freq_factor: float
    rope_high_freq_factor: float
    original_max_position_embeddings: int
    max_position_embeddings: int
    max_batch_size: int = 64
    max_context_token_num: int = 8192
    step_length: int = 16
    cache_max_entry_count: float = 0.5
    cache_block_seq_len: int = 64
    cache_chunk_size: int = -1
    use_context_fmha: int = 1
    quant_policy: int = 0
    tie_word_embeddings: int = 0
    qk_norm: int = 0
    rope_short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors up to original_max_position_embeddings
    rope_long_factor: tuple[float, ...] = ()  # longrope: the ones for sequences longer than that
    rope_attention_factor: float = 1.0  # longrope: cos and sin are scaled by it

    def __post_init__(self) -> None:
        if self.weight_type not in WEIGHT_TYPES:
            raise LmdError(f"config.ini: weight_type={self.weight_type} is not one of {', '.join(WEIGHT_TYPES)}")
        if self.rope_scaling_type not in ROPE_TYPES:
            raise LmdError(f"config.ini: rope_scaling_type={self.rope_scaling_type} is not one of "
                           f"{', '.join(ROPE_TYPES)}")
        if self.quant_policy not in (0, 4):
            raise LmdError(f"config.ini: quant_policy={self.quant_policy}; use 0 (KV in compute dtype) or 4 (KV int8)")
        if self.weight_type == "int4" and self.group_size not in (32, 64, 128):
            raise LmdError(f"config.ini: group_size={self.group_size} for int4 weights; use 32, 64 or 128")
        for key in ("head_num", "kv_head_num", "inter_size"):
            if getattr(self, key) % self.tensor_para_size:
                raise LmdError(f"config.ini: {key}={getattr(self, key)} is not divisible by "
                               f"tensor_para_size={self.tensor_para_size}")
        if self.head_num % self.kv_head_num:
            raise LmdError(f"config.ini: head_num={self.head_num} is not a multiple of kv_head_num={self.kv_head_num}")
        if self.rope_scaling_type == "longrope":
            for key in ("rope_short_factor", "rope_long_factor"):
                if len(getattr(self, key)) != self.rotary_embedding // 2:
                    raise LmdError(f"config.ini: {key} has {len(getattr(self, key))} values; longrope needs one per "
                                   f"rotary frequency ({self.rotary_embedding // 2}); fix the model's rope "
                                   "parameters or config.ini")

    @property
    def rank_shape(self) -> RankShape:
        return RankShape.of(self)

    @property
    def padded_vocab_size(self) -> int:
        """Rows of tok_embeddings / output: vocab_size rounded up to a multiple of tensor_para_size."""
        tp = self.tensor_para_size
        return (self.vocab_size + tp - 1) // tp * tp

    def to_ini_text(self) -> str:
        parser = configparser.ConfigParser()
        parser[SECTION] = {f.name: _format_value(getattr(self, f.name)) for f in dataclasses.fields(self)}
        lines = [f"{key} = {value}" for key, value in parser[SECTION].items()]
        return f"[{SECTION}]\n" + "\n".join(lines) + "\n"

    def replace(self, **changes: object) -> WorkspaceConfig:
        return dataclasses.replace(self, **changes)


def _format_value(value: object) -> str:
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    return str(value)


def _parse_value(key: str, kind: str, text: str, path: Path) -> object:
    try:
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
        if kind == "tuple[int, ...]":
            return tuple(int(v) for v in text.split(",") if v.strip())
        if kind == "tuple[float, ...]":
            return tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise LmdError(f"{path}: {key} = {text!r} is not a valid {kind}; fix the value or re-run lmd deploy") from None
    return text.strip()


def weights_dir(workspace: str | Path) -> Path:
    return Path(workspace) / "triton_models" / "weights"


def tokenizer_dir(workspace: str | Path) -> Path:
    return Path(workspace) / "triton_models" / "tokenizer"


def config_path(workspace: str | Path) -> Path:
    return weights_dir(workspace) / "config.ini"


def rank_weights_path(workspace: str | Path, rank: int) -> Path:
    return weights_dir(workspace) / f"model.rank{rank}.safetensors"


def write_workspace_config(workspace: str | Path, config: WorkspaceConfig) -> Path:
    path = config_path(workspace)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(config.to_ini_text())
    return path


def read_workspace_config(workspace: str | Path) -> WorkspaceConfig:
    """Parse and validate config.ini of a workspace directory (the one holding `triton_models/`)."""
    path = config_path(workspace)
    if not path.is_file():
        raise LmdError(f"{path} does not exist; {workspace} is not a workspace (create one with lmd deploy)")
    parser = configparser.ConfigParser()
    try:
        parser.read(path)
    except configparser.Error as exc:
        raise LmdError(f"{path} is not a valid ini file ({str(exc).splitlines()[0]}); re-run lmd deploy") from None
    if SECTION not in parser:
        raise LmdError(f"{path} has no [{SECTION}] section; re-run lmd deploy")
    section = parser[SECTION]
    values: dict[str, object] = {}
    for field in dataclasses.fields(WorkspaceConfig):
        if field.name not in section:
            if field.default is dataclasses.MISSING:
                raise LmdError(f"{path}: key {field.name} is missing; re-run lmd deploy")
            continue
        values[field.name] = _parse_value(field.name, str(field.type), section[field.name], path)
    return WorkspaceConfig(**values)  # type: ignore[arg-type]
