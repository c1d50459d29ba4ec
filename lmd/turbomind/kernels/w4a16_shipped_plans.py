"""W4A16 plans measured on a named GPU and shipped with lmd, so that a first engine start there does not tune.

Tuning the four int4 linears of a 7B model for every row bucket a step can have takes ~260 s on an H200, most of it
compiling the ~200-300 candidates of the buckets up to 64 rows (docs/benchmarks.md, seventeenth session). The winners
of such a run (`benchmarks/w4a16_tune.py`, which writes this format) live in `w4a16_plans/<gpu>.json`, or
`<gpu>.graph.json` when tuned with `LMD_W4A16_TIMER=graph` (`w4a16_timer`; each timer reads its own tables):

    {"gpu": "NVIDIA H200", "triton": "3.6", "source": "...", "timer": "cold",
     "opt_in": ["mma-gemm", "mma-gemv", "wgmma"], "plans": {"m<bucket> n<N> k<K> g<group> <dtype>": "<plan>", ...}}

(a table without "timer" was tuned by the cold timer.)

A shipped plan is used where the on-disk cache of plans tuned on this machine (`w4a16_plan_cache`) has none and only
if its name is still one of the candidates lmd would tune (a changed candidate list or kernel then tunes again), on
a GPU of that exact name and a Triton of the same minor version, and only as the winner of the families its tuning
offered: candidates of an opt-in family the table's tuning did not offer (`opt_in`) are tuned against that winner
alone. Shapes, dtypes or group sizes the table lacks tune as before. `LMD_W4A16_PLAN_CACHE=0` (always tune) ignores
the tables too.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lmd.turbomind.kernels.w4a16_timer import timer_suffix

TABLES = Path(__file__).with_name("w4a16_plans")
# the CUDA C++ families, offered or not by LMD_W4A16_CUDA (w4a16_mma_gemv.cuda_kernels): a table records which of them
# its tuning offered
OPT_IN_FAMILIES = ("mma-gemv", "mma-gemm", "wgmma")


def table_file(gpu: str, timer: str = "cold") -> Path:
    """The table of plans tuned on `gpu` by `timer` (w4a16_timer): `nvidia_h200.json`, `nvidia_h200.graph.json`."""
    return TABLES / (re.sub(r"[^a-z0-9]+", "_", gpu.lower()).strip("_") + timer_suffix(timer) + ".json")


def entry_key(bucket: int, n: int, k: int, group: int, dtype: str) -> str:
    return f"m{bucket} n{n} k{k} g{group} {dtype}"


def minor_version(version: str) -> str:
    return ".".join(version.split(".")[:2])


def family(plan_name: str) -> str:
    return plan_name.split(" ")[0]


@functools.cache
def _table(gpu: str, timer: str, triton_version: str) -> tuple[dict[str, str], frozenset[str]]:
    """(entry_key -> plan name, the opt-in families its tuning offered) of the table for this GPU, tuner timer and
    Triton."""
    try:
        table = json.loads(table_file(gpu, timer).read_text())
    except (OSError, ValueError):
        return {}, frozenset()
    if (table.get("gpu") != gpu or table.get("triton") != minor_version(triton_version)
            or table.get("timer", "cold") != timer):
        return {}, frozenset()
    return dict(table.get("plans", {})), frozenset(table.get("opt_in", ()))


def lookup(gpu: str, timer: str, bucket: int, n: int, k: int, group: int, dtype: str,
           candidates: Sequence[Any]) -> Any | None:
    """The candidate whose name the table holds for this shape on this GPU, or None. The table's winner among the
    families it was tuned over: see `unjudged` for the opt-in families among the candidates it never saw."""
    import triton

    name = _table(gpu, timer, triton.__version__)[0].get(entry_key(bucket, n, k, group, dtype))
    return next((plan for plan in candidates if plan.name() == name), None) if name else None


def unjudged(gpu: str, timer: str, candidates: Sequence[Any]) -> list[Any]:
    """The candidates of opt-in families the table's tuning did not offer (the table cannot have chosen them)."""
    import triton

    offered = _table(gpu, timer, triton.__version__)[1]
    return [p for p in candidates if family(p.name()) in OPT_IN_FAMILIES and family(p.name()) not in offered]


def table_json(gpu: str, triton_version: str, source: str, plans: dict[str, str],
               opt_in: Sequence[str] = (), timer: str = "cold") -> str:
    """The file `lookup` reads, from entry_key -> plan name, the opt-in families the tuning offered and its timer."""
    return json.dumps({"gpu": gpu, "triton": minor_version(triton_version), "source": source, "timer": timer,
                       "opt_in": sorted(opt_in), "plans": dict(sorted(plans.items()))}, indent=1) + "\n"
