#!/usr/bin/env bash
# The GPU calls for lmd's CUDA W4A16 kernels (issue 18: the mma.sync GEMV and GEMM, the wgmma GEMM), one step a call
# (each well inside the 10-minute limit):
#   probe:  benchmarks/w4a16_mma_probe.py: the three kernels' checks (any failure: exit 1, nothing timed),
#           then µs per config beside today's plan and fp16 cuBLAS, M = 1..1024, on the Llama-2-7B int4 shapes
#           (about 6 minutes on an H200);
#   decode: int4 decode ms/token at batch 1 / 16 / 64, lmd alone, with the Triton plans and then with all the CUDA
#           kernels offered to the tuner (LMD_W4A16_CUDA=0, then 1), in the same call (about 3-5 minutes);
#   serve:  the 1000 real-length requests (benchmarks/serving_workloads.py, workload real): lmd fp16, then lmd int4
#           with all the CUDA kernels offered (LMD_W4A16_CUDA=1) and LMDeploy 0.18 PT serving the same codes as AWQ
#           (about 9 minutes; carry .peers, with .peers/serving_lengths.json written here by
#           `serving_workloads.py --prepare`);
#   steps:  the int4 decode step by kernel (benchmarks/decode_step_kernels.py: graph replay, eager kernel times) at
#           batch 1 and 16 with the default CUDA kernels (the GEMV to 16 rows) and with none (LMD_W4A16_CUDA=0),
#           programmatic dependent launch on at batch 16 and off at batch 1 (about 2-3 minutes).
#     bash benchmarks/w4a16_mma_gpu_call.sh probe [probe flags] | decode | serve | steps
# Full results in folders under $OUT, one a step or variant; the last lines printed are the tables.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/out}"
step="${1:?usage: w4a16_mma_gpu_call.sh probe [flags] | decode | serve | steps}"
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
serve)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .peers/lmdeploy-pt-0.18/wheels/*.whl
    export PYTHONPATH=/tmp/site
    mkdir -p "$OUT/fp16" "$OUT/int4"
    echo "== fp16, lmd"
    python3 benchmarks/serving_workloads.py --workloads real --models llama2-7b --no-peer --hf-requests 0 \
        --lengths .peers/serving_lengths.json --budget-s 130 --out "$OUT/fp16" 2>&1 | tee "$OUT/fp16/log.txt" | tail -8
    echo "== int4, lmd with LMD_W4A16_CUDA=1, and LMDeploy AWQ"
    LMD_W4A16_CUDA=1 python3 benchmarks/serving_workloads.py --workloads real --models llama2-7b-int4 \
        --hf-requests 0 --lengths .peers/serving_lengths.json --peers .peers --budget-s 380 --peer-timeout 250 \
        --out "$OUT/int4" 2>&1 | tee "$OUT/int4/log.txt" | tail -12
    ;;
steps)
    for run in "16 default 1" "16 0 1" "1 default 0" "1 0 0"; do
        read -r batch cuda pdl <<<"$run"
        name="b${batch}_cuda${cuda}_pdl${pdl}"
        mkdir -p "$OUT/$name"
        echo "== batch $batch, LMD_W4A16_CUDA=$cuda, LMD_PDL=$pdl"
        [ "$cuda" = default ] && cuda=""
        LMD_W4A16_CUDA=$cuda LMD_PDL=$pdl OUT="$OUT/$name" python3 benchmarks/decode_step_kernels.py --weights int4 \
            --batch "$batch" --contexts 128 --steps 10 2>&1 | grep -E "graph replay|^  GEMM|w4a16|_gemv|wt_|gemm" | head -8
    done
    ;;
*)
    echo "unknown step $step: probe, decode, serve or steps" >&2
    exit 2
    ;;
esac
