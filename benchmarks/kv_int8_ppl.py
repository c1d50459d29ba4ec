"""KV int8 quality: engine perplexity of one workspace with float KV, online int8 and static int8 (per head and per
channel, asymmetric and symmetric) from one `lmd calibrate` work dir. CPU or GPU; the workspace is not modified.

    python benchmarks/kv_int8_ppl.py WORKSPACE CALIB_WORK_DIR [--windows 8] [--seqlen 2048] [--device cpu]
        [--symmetric] [--out F]

Prints a table of ppl and the delta against float KV last; `--out` writes the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

from lmd.calib_data import load_eval_text
from lmd.calib_data.tokenization import encode
from lmd.eval.ppl import perplexity
from lmd.lite.kv_qparams import KVQParamsConfig, export_kv_qparams
from lmd.turbomind.window_scorer import engine_window_scorer, scoring_engine

VARIANTS = (  # name, quant_policy, kv-qparams options (None: no static params file -> online int8)
    ("float KV", 0, None),
    ("int8 online (per token, head)", 4, None),
    ("int8 static per head, asym", 4, {"symmetric": False, "granularity": "head"}),
    ("int8 static per channel, asym", 4, {"symmetric": False, "granularity": "channel"}),
)
SYMMETRIC = (
    ("int8 static per head, sym", 4, {"symmetric": True, "granularity": "head"}),
    ("int8 static per channel, sym", 4, {"symmetric": True, "granularity": "channel"}),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workspace")
    parser.add_argument("calib_work_dir")
    parser.add_argument("--dataset", default="wikitext2")
    parser.add_argument("--split", default="test")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=2048)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--symmetric", action="store_true", help="also the symmetric (--kv-sym) static variants")
    parser.add_argument("--out")
    args = parser.parse_args()

    text = load_eval_text(args.dataset, args.split)
    ids = None  # every variant runs the same workspace, hence the same tokenizer: encode once
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ws = Path(tmp) / "ws"
        shutil.copytree(args.workspace, ws)
        weights = ws / "triton_models" / "weights"
        for name, policy, options in VARIANTS + (SYMMETRIC if args.symmetric else ()):
            for old in weights.glob("kv_qparams.rank*.safetensors"):
                old.unlink()
            if options is not None:
                export_kv_qparams(KVQParamsConfig(args.calib_work_dir, str(weights), **options))
            start = time.perf_counter()
            engine = scoring_engine(str(ws), args.seqlen, device=args.device, dtype=args.dtype, quant_policy=policy)
            if ids is None:
                ids = encode(engine.tokenizer, text.text)
            result = perplexity(engine_window_scorer(engine), ids, seqlen=args.seqlen, max_windows=args.windows,
                                progress=False, dataset=text.dataset, split=text.split)
            rows.append({"kv": name, "quant_policy": policy, "ppl": result.ppl, "windows": result.windows,
                         "tokens": result.tokens, "blocks": engine.runner.num_blocks,
                         "seconds": round(time.perf_counter() - start, 1)})
            engine.close()
            print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["ppl"]
    for row in rows:
        row["delta_pct"] = 100 * (row["ppl"] / base - 1)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"\n{args.workspace}, {text.dataset} {text.split}, {rows[0]['windows']} x {args.seqlen} tokens, "
          f"{args.device} {args.dtype}, calibration {args.calib_work_dir}")
    print(f"{'KV cache':34} {'ppl':>9} {'delta':>8}")
    for row in rows:
        print(f"{row['kv']:34} {row['ppl']:9.4f} {row['delta_pct']:+7.2f}%")


if __name__ == "__main__":
    main()
