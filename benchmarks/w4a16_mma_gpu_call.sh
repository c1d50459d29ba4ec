#!/usr/bin/env bash
# The GPU calls for lmd's CUDA W4A16 kernels (issue 18: the mma.sync GEMV and GEMM, the wgmma GEMM), one step a call
# (each well inside the 10-minute limit):
#   probe:  benchmarks/w4a16_mma_probe.py: the three kernels' checks (any failure: exit 1, nothing timed),
#           then µs per config beside today's plan and fp16 cuBLAS, M = 1..1024, on the Llama-2-7B int4 shapes
#           (about 6 minutes on an H200);
#   decode: decode ms/token at batch 1 / 16 / 64, lmd alone, one run per argument: fp16 weights, or int4 with
#           LMD_W4A16_CUDA=0 (the Triton plans), default (unset: the GEMV to 16 rows) or 1 (all the CUDA kernels);
#           no arguments: 0 then 1 (about 1.5-2.5 minutes a run);
#   serve:  the 1000 real-length requests (benchmarks/serving_workloads.py, workload real): lmd fp16, then lmd int4
#           with the default kernels and LMDeploy 0.18 PT serving the same codes as AWQ; lmd each time with float
#           and with int8 KV (about 6 minutes on an H100 with its shipped plan table; carry .peers, with
#           .peers/serving_lengths.json written here by
#           `serving_workloads.py --prepare`);
#   steps:  the int4 decode step by kernel (benchmarks/decode_step_kernels.py: graph replay, eager kernel times, each
#           linear's W4A16 kernel in the step, the tuner's timings) at batch 1 and 16 with the default CUDA kernels
#           (the GEMV to 16 rows) and with none (LMD_W4A16_CUDA=0) (about 3-4 minutes);
#   layout: the GEMV at M = 1 on the engine layout against tiled copies of the weights
#           (benchmarks/w4a16_gemv_layout.py), then ncu on 22016x4096 with and without the register double
#           buffer (about 3 minutes).
#   wgmma:  what bounds the wgmma GEMM from 256 rows (benchmarks/w4a16_wgmma_bound.py: the kernel as built beside
#           copies without the decode, the raw-word loads or both, and fp16 cuBLAS), then ncu on the RS and bare
#           RS kernel at 1024 rows of 12288x4096, with stall samples by SASS line (about 4 minutes).
#   table:  the plan table lmd ships for this GPU (benchmarks/w4a16_tune.py with the default kernels: about 4-5
#           minutes on an H100), as $OUT/table/<gpu>.json, to commit under lmd/turbomind/kernels/w4a16_plans/ (then
#           a first engine start there, `serve` included, does not tune).
#   timer:  the tuner's two timers (lmd/turbomind/kernels/w4a16_timer.py) judged by the decode step. `timer tune`: a
#           table tuned with LMD_W4A16_TIMER=graph for every bucket (about 6-7 minutes on an H100) into
#           $OUT/timer and the tree's w4a16_plans/ (copy it there here as well before `timer steps` if the machine
#           was not kept); `timer steps`: the int4 step at batch 1 / 16 / 64 with each timer's table (about 4
#           minutes).
#   kv8:    int8 KV on the CUDA-core MHA decode kernel (RoPE and the quantized write folded in), parts in the order
#           given (default: checks serve steps, about 9 minutes; carry .peers): `checks` its GPU checks
#           (benchmarks/gpu_attention_tests.py --mha-int8; a failure stops the call), `sweep` decode attention at
#           batch 64 / 128 on float and int8 KV beside the dot kernel (attention_int8_sweep.py --mha-grid), `serve`
#           the 1000 requests on lmd alone, fp16 and int4, each with float and int8 KV, `steps` the int4 step at
#           batch 128, context 256 with float and int8 KV (decode_step_kernels.py) while time is left, `blocks`
#           the int4 1000 requests with float and int8 KV for each of four int8 MHA decode blocks
#           (LMD_MHA_DECODE_INT8; about a minute each; KV8_BLOCKS="bn,w,st ..." picks others, none starts after
#           KV8_DEADLINE_S, default 420).
#   narrow: the one launch of RoPE, the KV write and the CUDA-core MHA decode on narrow batches (AttentionConfig.
#           mha_decode_narrow): its GPU checks at 1 and 8 sequences (gpu_attention_tests.py --narrow; a failure stops
#           the call), then the int4 step (decode_step_kernels.py, graph replay) for each NARROW_RUNS entry
#           batch:context:blocks, blocks `none` (LMD_MHA_DECODE_NARROW unset: the rotary kernel, then the dot
#           kernel) or block_n,warps,stages; context 900 makes the batch-1 launch split in 4 (about 6 minutes).
#   prefetch: benchmarks/l2_prefetch_probe.py: the int4 step at batch 1 and 16 with each layer's next weights asked
#           into L2 from a side stream while its attention runs (about 2-3 minutes).
#   batch1: `narrow` with NARROW_RUNS="1:128:none 1:128:64,4,1 1:128:64,2,1 1:900:none 1:900:64,4,1" (unless set),
#           then `prefetch` (about 7 minutes).
#     bash benchmarks/w4a16_mma_gpu_call.sh probe [flags] | decode [fp16|0|default|1 ...] | serve | steps
#                                           | layout [flags] | wgmma [flags] | table | timer tune|steps
#                                           | kv8 [checks|sweep|serve|steps|blocks ...] | narrow
#                                           | prefetch [flags] | batch1
# Full results in folders under $OUT, one a step or variant; the last lines printed are the tables.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT="${OUT:-$PWD/out}"
step="${1:?usage: w4a16_mma_gpu_call.sh probe | decode [variants] | serve | steps | layout | wgmma | table | timer | kv8 | narrow | prefetch | batch1}"
shift
case "$step" in
probe)
    mkdir -p "$OUT/probe"
    OUT="$OUT/probe" python3 benchmarks/w4a16_mma_probe.py "$@" 2>&1 | tee "$OUT/probe/log.txt"
    ;;
decode)
    variants=("$@")
    [ $# -eq 0 ] && variants=(0 1)
    for variant in "${variants[@]}"; do
        mkdir -p "$OUT/decode_$variant"
        if [ "$variant" = fp16 ]; then
            echo "== fp16 decode"
            OUT="$OUT/decode_$variant" python3 benchmarks/decode_vs_lmdeploy.py --weights fp16 --no-peer --no-gpt-fast \
                --batch-sizes 1,16,64 2>&1 | tee "$OUT/decode_$variant/log.txt" | tail -12
            continue
        fi
        echo "== int4 decode, LMD_W4A16_CUDA=$variant"
        [ "$variant" = default ] && variant=""
        LMD_W4A16_CUDA=$variant OUT="$OUT/decode_${variant:-default}" python3 benchmarks/decode_vs_lmdeploy.py \
            --weights int4 --no-peer --no-gpt-fast --batch-sizes 1,16,64 2>&1 \
            | tee "$OUT/decode_${variant:-default}/log.txt" | tail -12
    done
    ;;
serve)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .peers/lmdeploy-pt-0.18/wheels/*.whl
    export PYTHONPATH=/tmp/site
    mkdir -p "$OUT/fp16" "$OUT/int4"
    echo "== fp16, lmd"
    python3 benchmarks/serving_workloads.py --workloads real --models llama2-7b --no-peer --hf-requests 0 \
        --lengths .peers/serving_lengths.json --real-kv-int8 --budget-s 170 --out "$OUT/fp16" 2>&1 \
        | tee "$OUT/fp16/log.txt" | tail -9
    echo "== int4, lmd (default kernels: the GEMV to 16 rows), and LMDeploy AWQ"
    python3 benchmarks/serving_workloads.py --workloads real --models llama2-7b-int4 \
        --hf-requests 0 --lengths .peers/serving_lengths.json --peers .peers --real-kv-int8 --budget-s 380 \
        --peer-timeout 250 --out "$OUT/int4" 2>&1 | tee "$OUT/int4/log.txt" | tail -13
    ;;
steps)
    for run in "1 default" "1 0" "16 default" "16 0"; do
        read -r batch cuda <<<"$run"
        name="b${batch}_cuda${cuda}"
        mkdir -p "$OUT/$name"
        echo "== batch $batch, LMD_W4A16_CUDA=$cuda"
        [ "$cuda" = default ] && cuda=""
        LMD_W4A16_CUDA=$cuda OUT="$OUT/$name" python3 benchmarks/decode_step_kernels.py --weights int4 \
            --batch "$batch" --contexts 128 --steps 10 > "$OUT/$name/log.txt" 2>&1 || tail -20 "$OUT/$name/log.txt"
        grep -E "graph replay|^  GEMM|^  attention|^  fused|  w4a16 |^  [0-9]+ rows [0-9]+x" "$OUT/$name/log.txt"
    done
    ;;
layout)
    mkdir -p "$OUT/layout"
    OUT="$OUT/layout" python3 benchmarks/w4a16_gemv_layout.py "$@" 2>&1 | tee "$OUT/layout/log.txt" | tail -8
    for cfg in "m8 w8 g4 pf1" "m8 w8 g4 pf0"; do
        ncu --clock-control none -k regex:w4a16_mma_gemv --launch-skip 2 --launch-count 1 --section SpeedOfLight \
            --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats \
            python3 benchmarks/w4a16_gemv_layout.py --ncu 22016x4096 --config "$cfg" \
            > "$OUT/layout/ncu_${cfg// /_}.txt" 2>&1 || tail -5 "$OUT/layout/ncu_${cfg// /_}.txt"
        echo "== ncu, 22016x4096, $cfg, engine layout"
        grep -E "DRAM Throughput|Memory Throughput|Duration|L2 Hit Rate|Achieved Occupancy|Registers Per|Waves Per" \
            "$OUT/layout/ncu_${cfg// /_}.txt" | head -12
    done
    ;;
wgmma)
    mkdir -p "$OUT/wgmma"
    OUT="$OUT/wgmma" python3 benchmarks/w4a16_wgmma_bound.py "$@" 2>&1 | tee "$OUT/wgmma/log.txt" | tail -8
    export PATH=$PATH:/usr/local/cuda/bin
    for variant in rs rs-bare; do
        rep="$OUT/wgmma/ncu_$variant"
        ncu --clock-control none -k regex:w4a16_wgmma --launch-skip 2 --launch-count 1 --import-source no \
            --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
            --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
            --section SourceCounters -o "$rep" -f \
            python3 benchmarks/w4a16_wgmma_bound.py --ncu 12288x4096 --m 1024 --variant "$variant" \
            > "$rep.log" 2>&1 || tail -5 "$rep.log"
        ncu --import "$rep.ncu-rep" > "$rep.txt" 2>&1 || true
        ncu --import "$rep.ncu-rep" --page source --print-source sass --csv > "$rep.sass.csv" 2>&1 || true
        echo "== ncu, 12288x4096, M 1024, wgmma n256 t128 s6 k1 rs, variant $variant"
        grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|DRAM Through|Issue Slots Busy|Issued Warp|No Eligible|Registers Per|Shared Memory Conf|Bank" \
            "$rep.txt" | head -14
    done
    ;;
table)
    mkdir -p "$OUT/table"
    OUT="$OUT/table" python3 benchmarks/w4a16_tune.py 2>&1 | tee "$OUT/table/log.txt" | tail -12
    ;;
timer)
    case "${1:?timer tune | timer steps}" in
    tune)
        mkdir -p "$OUT/timer"
        LMD_W4A16_TIMER=graph OUT="$OUT/timer" python3 benchmarks/w4a16_tune.py 2>&1 \
            | tee "$OUT/timer/log.txt" | tail -12
        cp "$OUT"/timer/*.graph.json lmd/turbomind/kernels/w4a16_plans/
        ;;
    steps)
        # this GPU's graph table must be in the tree (copied here from $OUT/timer of `timer tune`): without it the
        # graph runs would tune while the engine starts, and time another table than the one tuned
        python3 -c 'import sys, torch; from lmd.turbomind.kernels.w4a16_shipped_plans import table_file
p = table_file(torch.cuda.get_device_name(), "graph"); sys.exit(0 if p.is_file() else f"no {p}: copy it from timer tune")'
        for run in "cold 1" "graph 1" "cold 16" "graph 16" "cold 64" "graph 64"; do
            read -r timer batch <<<"$run"
            name="timer_${timer}_b$batch"
            mkdir -p "$OUT/$name"
            LMD_W4A16_TIMER=$timer OUT="$OUT/$name" python3 benchmarks/decode_step_kernels.py --weights int4 \
                --batch "$batch" --contexts 128 --steps 10 > "$OUT/$name/log.txt" 2>&1 || tail -20 "$OUT/$name/log.txt"
            echo "$timer timer, batch $batch: $(grep -o 'graph replay [0-9.]* ms/step' "$OUT/$name/log.txt")"
            grep -E "^  w4a16 " "$OUT/$name/log.txt" || true
        done
        ;;
    *) echo "timer tune | timer steps" >&2; exit 2 ;;
    esac
    ;;
kv8)
    parts=("$@")
    [ $# -eq 0 ] && parts=(checks serve steps)
    mkdir -p "$OUT/kv8"
    for part in "${parts[@]}"; do
        case "$part" in
        checks)  # any failure: nothing timed
            if ! python3 benchmarks/gpu_attention_tests.py --mha-int8 > "$OUT/kv8/checks.txt" 2>&1; then
                tail -30 "$OUT/kv8/checks.txt"
                exit 1
            fi
            tail -8 "$OUT/kv8/checks.txt"
            ;;
        sweep)
            OUT="$OUT/kv8" python3 benchmarks/attention_int8_sweep.py --grid-kv none --mha-grid --batches 64,128 \
                --contexts 256,1024 > "$OUT/kv8/sweep.txt" 2>&1 || tail -20 "$OUT/kv8/sweep.txt"
            grep -A8 "^batch" "$OUT/kv8/sweep.txt" || true
            ;;
        serve)  # lmd alone (LMDeploy ran beside it in the twenty-seventh session): fp16 and int4, float and int8 KV
            for model in llama2-7b llama2-7b-int4; do
                mkdir -p "$OUT/kv8/$model"
                echo "== $model, lmd, float and int8 KV"
                python3 benchmarks/serving_workloads.py --workloads real --models $model --no-peer --hf-requests 0 \
                    --lengths .peers/serving_lengths.json --real-kv-int8 --budget-s 200 --out "$OUT/kv8/$model" 2>&1 \
                    | tee "$OUT/kv8/$model/log.txt" | tail -9
            done
            ;;
        steps)  # the int4 step at batch 128, context 256, float and int8 KV (about a minute each)
            for qp in 0 4; do
                [ "$SECONDS" -gt 480 ] && { echo "steps: out of time"; break; }
                name="step_int4_b128_qp$qp"
                mkdir -p "$OUT/kv8/$name"
                OUT="$OUT/kv8/$name" python3 benchmarks/decode_step_kernels.py --weights int4 --batch 128 \
                    --contexts 256 --steps 10 --quant-policy $qp > "$OUT/kv8/$name/log.txt" 2>&1 \
                    || tail -20 "$OUT/kv8/$name/log.txt"
                echo "== int4, batch 128, context 256, quant_policy $qp"
                grep -E "graph replay|^  attention|^  GEMM|^  fused" "$OUT/kv8/$name/log.txt" | head -6
            done
            ;;
        blocks)  # the int4 1000 requests with float and int8 KV, the int8 MHA decode blocks varied
            for blocks in ${KV8_BLOCKS:-32,1,1 64,1,1 64,2,1 128,2,1}; do
                [ "$SECONDS" -gt "${KV8_DEADLINE_S:-420}" ] && { echo "blocks: out of time"; break; }
                dir="$OUT/kv8/int4_blocks_${blocks//,/_}"
                mkdir -p "$dir"
                LMD_MHA_DECODE_INT8=$blocks python3 benchmarks/serving_workloads.py --workloads real \
                    --models llama2-7b-int4 --no-peer --hf-requests 0 --lengths .peers/serving_lengths.json \
                    --real-kv-int8 --budget-s 100 --out "$dir" > "$dir/log.txt" 2>&1 || tail -5 "$dir/log.txt"
                echo "int8 MHA blocks $blocks: $(grep -oE 'lmd( KV int8)? +│ +1000 │ +112,761 │ +[0-9.]+ │ +[0-9.]+ │ +[0-9,.]+' \
                    "$dir/log.txt" | tr -s ' ' | tr '\n' ';')"
                grep -oE "lmd( KV int8)?: steps: .{0,140}" "$dir/log.txt" || true
            done
            ;;
        *) echo "kv8 parts: checks, sweep, serve, steps, blocks" >&2; exit 2 ;;
        esac
    done
    ;;
narrow)
    mkdir -p "$OUT/narrow"
    if ! python3 benchmarks/gpu_attention_tests.py --narrow > "$OUT/narrow/checks.txt" 2>&1; then
        tail -30 "$OUT/narrow/checks.txt"
        exit 1
    fi
    tail -3 "$OUT/narrow/checks.txt"
    for run in ${NARROW_RUNS:-1:128:none 1:128:64,4,1 1:128:32,1,1 1:128:64,2,1 1:900:none 1:900:64,4,1 4:128:none 4:128:64,4,1}; do
        IFS=: read -r batch ctx blocks <<<"$run"
        [ "$SECONDS" -gt "${NARROW_DEADLINE_S:-480}" ] && { echo "narrow: out of time"; break; }
        name="b${batch}_c${ctx}_${blocks//,/_}"
        mkdir -p "$OUT/narrow/$name"
        env_blocks=$blocks; [ "$blocks" = none ] && env_blocks=""
        LMD_MHA_DECODE_NARROW=$env_blocks OUT="$OUT/narrow/$name" python3 benchmarks/decode_step_kernels.py \
            --weights int4 --batch "$batch" --contexts "$ctx" --steps 10 > "$OUT/narrow/$name/log.txt" 2>&1 \
            || tail -20 "$OUT/narrow/$name/log.txt"
        echo "batch $batch, context $ctx, narrow blocks $blocks: $(grep -o 'graph replay [0-9.]* ms/step' \
            "$OUT/narrow/$name/log.txt")"
        grep -E "^  attention|^  fused" "$OUT/narrow/$name/log.txt" | head -3
    done
    ;;
prefetch)
    mkdir -p "$OUT/prefetch"
    OUT="$OUT/prefetch" python3 benchmarks/l2_prefetch_probe.py "$@" 2>&1 | tee "$OUT/prefetch/log.txt" | tail -14
    ;;
batch1)
    NARROW_RUNS="${NARROW_RUNS:-1:128:none 1:128:64,4,1 1:128:64,2,1 1:900:none 1:900:64,4,1}" NARROW_DEADLINE_S=300 \
        bash "$0" narrow || echo "narrow: exit $?"
    bash "$0" prefetch
    ;;
*)
    echo "unknown step $step: probe, decode, serve, steps, layout, wgmma, table, timer, kv8, narrow, prefetch or batch1" >&2
    exit 2
    ;;
esac
