"""What `lmd awq --method` names: which steps of lmd/lite/awq.py each method runs (torch-free, read by the CLI)."""

from __future__ import annotations

from dataclasses import dataclass

from lmd.errors import LmdError


@dataclass(frozen=True)
class MethodFields:
    """What `--method` sets; the other flags (--no-clip, --refine-scale, ...) still apply on top."""

    search_scale: bool
    clip: bool
    gptq: bool = False
    sign_round: bool = False


METHODS = {
    "awq": MethodFields(search_scale=True, clip=True),
    "awq-gptq": MethodFields(search_scale=True, clip=True, gptq=True),
    "autoround": MethodFields(search_scale=True, clip=False, sign_round=True),
    "rtn": MethodFields(search_scale=False, clip=False),
}


def method_fields(method: str) -> MethodFields:
    if method not in METHODS:
        raise LmdError(f"--method {method!r} is not valid; use one of {', '.join(METHODS)}")
    return METHODS[method]


# What `lmd awq` runs without --method: the best of METHODS on SmolLM2's zero-shot accuracy and perplexity whose
# wall time stays within 3x plain AWQ's on a 2-core CPU (docs/quantization.md, "Choosing the default"). AwqConfig's
# own field defaults stay the AWQ algorithm.
DEFAULT_METHOD = "awq-gptq"
