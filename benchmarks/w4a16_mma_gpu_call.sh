#!/usr/bin/env bash
# The GPU calls for lmd's CUDA W4A16 kernels (issue 18: the mma.sync GEMV and GEMM, the wgmma GEMM), one step a call
# (each well inside the 10-minute limit):
#   probe:  benchmarks/w4a16_mma_probe.py: the three kernels' checks (any failure: exit 1, nothing timed),
#           then µs per config beside today's plan and fp16 cuBLAS, M = 1..1024, on the Llama-2-7B int4 shapes
#           (about 6 minutes on an H200);
#   decode: int4 decode ms/token at batch 1 / 16 / 64, lmd alone, with today's plans and then with the kernels
#           offered to the tuner (LMD_W4A16_CUDA=1), in the same call (about 5 minutes).
#     bash benchmarks/w4a16_mma_gpu_call.sh probe [probe flags] | decode
# Full results under $OUT/probe, $OUT/triton and $OUT/mma; the last lines printed are the tables.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/out}"
step="${1:?usage: w4a16_mma_gpu_call.sh probe [flags] | decode}"
shift
case "$step" in
probe)
    mkdir -p "$OUT/probe"
    OUT="$OUT/probe" python3 benchmarks/w4a16_mma_probe.py "$@" 2>&1 | tee "$OUT/probe/log.txt"
    ;;
decode)
    for variant in triton mma; do
        flag=0
        [ "$variant" = mma ] && flag=1
        mkdir -p "$OUT/$variant"
        echo "== int4 decode, $variant (LMD_W4A16_CUDA=$flag)"
        LMD_W4A16_CUDA=$flag OUT="$OUT/$variant" python3 benchmarks/decode_vs_lmdeploy.py --weights int4 \
            --no-peer --no-gpt-fast --batch-sizes 1,16,64 2>&1 | tee "$OUT/$variant/log.txt" | tail -12
    done
    ;;
*)
    echo "unknown step $step: probe or decode" >&2
    exit 2
    ;;
esac
