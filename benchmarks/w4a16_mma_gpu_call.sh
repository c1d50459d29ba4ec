#!/usr/bin/env bash
# One GPU call for the mma.sync W4A16 kernel (issue 18; about 8-10 minutes on an H200):
#   1. benchmarks/w4a16_mma_gemv_probe.py: its checks (any failure stops here, exit 1), then µs per config beside
#      today's plan and fp16 cuBLAS, M = 1..128, on the Llama-2-7B int4 shapes;
#   2. int4 decode ms/token at batch 1 / 16 / 64, lmd alone, with today's plans and then with the kernel offered
#      to the tuner (LMD_W4A16_MMA_GEMV=1), in the same call.
# Full results under $OUT/probe, $OUT/triton and $OUT/mma; the last lines printed are the two decode tables.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT/probe" "$OUT/triton" "$OUT/mma"
OUT="$OUT/probe" python3 benchmarks/w4a16_mma_gemv_probe.py "$@" 2>&1 | tee "$OUT/probe/log.txt"
for variant in triton mma; do
    flag=0
    [ "$variant" = mma ] && flag=1
    echo "== int4 decode, $variant (LMD_W4A16_MMA_GEMV=$flag)"
    LMD_W4A16_MMA_GEMV=$flag OUT="$OUT/$variant" python3 benchmarks/decode_vs_lmdeploy.py --weights int4 --no-peer \
        --no-gpt-fast --batch-sizes 1,16,64 2>&1 | tee "$OUT/$variant/log.txt" | tail -12
done
