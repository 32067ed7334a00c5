#!/usr/bin/env bash
# One-command device check (make gpu-check): the spatial op grids on the device, a training
# step in bf16 with channels-last activations (plain and FSDP), the conv / step benchmarks
# timed with CUDA events, the local kernels in fp32 / bf16 x NCHW / channels-last and (CUDA)
# the parallelized model on one rank beside the plain one; every table goes to
# OUT/gpu_check.md.
#
#   scripts/gpu_check.sh                      # CUDA: about 5-8 minutes on one GPU
#   scripts/gpu_check.sh --device cpu         # small and fast, sections at once (CI runs it:
#                                             # tests/test_gpu_check.py)
#   scripts/gpu_check.sh --out DIR            # where the tables and logs go (default gpu_check)
#   scripts/gpu_check.sh --skip-grids         # no op grids (the test suite runs them already)
#
# Multi-rank cases need one GPU per rank (NCCL refuses two ranks on one GPU): with G GPUs
# the op grids and the benchmarks run at most G ranks (the others are skipped and counted
# in the log); the table notes the GPU count. On CPU the ranks use gloo.
# Exit code: 0 when every section passed, 1 otherwise (each section still runs).
set -uo pipefail

DEVICE=cuda
OUT=gpu_check
SKIP_GRIDS=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --device) DEVICE="$2"; shift 2 ;;
        --out) OUT="$2"; shift 2 ;;
        --skip-grids) SKIP_GRIDS=1; shift ;;
        -h|--help) sed -n '2,15p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (--device cuda|cpu, --out DIR, --skip-grids)" >&2
           exit 2 ;;
    esac
done
if [[ "$DEVICE" != cuda && "$DEVICE" != cpu ]]; then
    echo "gpu_check.sh: --device must be cuda or cpu, got $DEVICE" >&2
    exit 2
fi

cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export SPCONV_TEST_DEVICE="$DEVICE"
mkdir -p "$OUT"
REPORT="$OUT/gpu_check.md"

if [[ "$DEVICE" == cuda ]]; then
    GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())")
    if [[ "$GPUS" -lt 1 ]]; then
        echo "gpu_check.sh: no CUDA device visible to torch; use --device cpu" >&2
        exit 2
    fi
    RANKS=$(( GPUS < 2 ? 1 : 2 ))
    # the op grids of every spatial op family (tests that build their tensors on the
    # harness device: tests/dist_harness.py, SPCONV_TEST_DEVICE)
    GRIDS=(tests/test_conv_grid.py tests/test_conv.py tests/test_pool.py tests/test_norm.py tests/test_upsample.py
           tests/test_ops_reduce.py tests/test_ops_channels.py tests/test_ops_rechunk.py
           tests/test_pointwise.py tests/test_halo_conv.py tests/test_conv3d.py
           tests/test_ops3d.py tests/test_fsdp.py tests/test_norm_fused.py)
    GRID_FILTER=()
    STEP=(--worlds 1 $([[ $RANKS -gt 1 ]] && echo 2) --height 512 --width 1024 --iters 5)
    CONV=(--channels 64 --height 1024 --width 4096 --worlds 1 $([[ $RANKS -gt 1 ]] && echo 2)
          --iters 10 --rounds 1 --variants "one process" "halo (spconv)" "halo window"
          "dtensor gather" "floor (no comm)")
    BENCH=(--models unet lraspp_mobilenet_v3_large --height 512 --width 2048 --iters 10
           --worlds 1 $([[ $RANKS -gt 1 ]] && echo 2) --checkpointing off on)
    KERNELS=(--height 1024 --width 4096)
else
    GPUS=0
    # the ranks fork from the script's process instead of importing torch again (~3.5 s of
    # CPU each; scripts/bench_conv.py spawn_ranks): CUDA keeps spawn
    export SPCONV_BENCH_START_METHOD=fork
    GRIDS=(tests/test_conv_grid.py)
    GRID_FILTER=(-k "test_conv_grid_matches_single_device and 2")
    STEP=(--worlds 2 --height 32 --width 128 --iters 2)
    CONV=(--channels 8 --height 32 --width 256 --worlds 2 --iters 2 --rounds 1 --warmup 0
          --variants "one process" "halo (spconv)")
    BENCH=(--models unet --depth 2 --base-width 8 --height 32 --width 128 --iters 2
           --worlds 2 --checkpointing off)
    KERNELS=(--height 32 --width 64 --channels 8 --depth 2 --base-width 8 --iters 1 --warmup 0)
fi

FAILED_LIST="$OUT/failed_sections"
: > "$FAILED_LIST"
section() {  # section NAME TIMEOUT_S COMMAND...: run, log, keep going on failure
    local name="$1" limit="$2"; shift 2
    local log="$OUT/${name// /_}.log" start=$SECONDS
    echo "== $name" >&2
    if timeout "$limit" "$@" > "$log" 2>&1; then
        echo "   ok: $name ($(( SECONDS - start )) s)" >&2
    else
        echo "   FAILED: $name ($(( SECONDS - start )) s): see $log" >&2
        tail -n 20 "$log" >&2
        echo "$name" >> "$FAILED_LIST"  # a file: a section may run in a background job
    fi
}
# On CPU the sections run at once (their start-ups overlap; CPU timings are a smoke test,
# not a measurement); on CUDA one after the other, so that the timings are undisturbed.
step_section() {
    if [[ "$DEVICE" == cpu ]]; then section "$@" & else section "$@"; fi
}

{
    echo "# gpu_check ($DEVICE)"
    echo
    echo "$(date -u +%Y-%m-%dT%H:%MZ), $(uname -m), $(nproc) cores, GPUs: $GPUS"
    if [[ "$DEVICE" == cuda ]]; then
        "$PY" -c "import torch; print('torch', torch.__version__, '|', torch.cuda.get_device_name(0))"
    else  # the version without importing torch (seconds of CPU)
        "$PY" -c "from importlib.metadata import version; print('torch', version('torch'), '| CPU')"
    fi
} > "$REPORT"

if [[ $SKIP_GRIDS -eq 1 ]]; then
    echo "skipped (--skip-grids)" > "$OUT/op_grids.log"
else
    section "op grids" 300 "$PY" -m pytest -q -p no:cacheprovider "${GRIDS[@]}" "${GRID_FILTER[@]}"
fi
step_section "training step" 180 "$PY" scripts/gpu_check.py --device "$DEVICE" --out "$OUT/step.md" "${STEP[@]}"
step_section "bench conv" 180 "$PY" scripts/bench_conv.py --device "$DEVICE" --markdown "${CONV[@]}"
step_section "bench step" 180 "$PY" scripts/bench_step.py --device "$DEVICE" --markdown "${BENCH[@]}"
step_section "bench kernels" 120 "$PY" scripts/bench_kernels.py --device "$DEVICE" --markdown "${KERNELS[@]}"
wait  # the CPU sections
if [[ "$DEVICE" == cuda ]]; then
    # the parallelized model on a one-rank mesh beside the plain model (eager and inductor):
    # what the parallel layer itself costs where kernels are fast
    section "plain vs parallelized" 300 bash -c 'for mode in plain default; do
        "$0" scripts/bench_compile.py --device cuda --models unet smp_unet --worlds 1 \
            --height 512 --width 1024 --rounds 5 --no-kernels --markdown --bf16 \
            --channels-last --compile-mode "$mode" || exit 1
    done' "$PY"
fi

{
    echo
    echo "## op grids"
    echo
    tail -n 1 "$OUT/op_grids.log"
    echo
    echo "## training step (bf16, channels-last; distances from the fp32 one-device step)"
    echo
    cat "$OUT/step.md" 2>/dev/null || echo "(no table: see $OUT/training_step.log)"
    echo
    echo "## bench_conv (GPU: CUDA events; CPU: host timer)"
    echo
    grep '^|' "$OUT/bench_conv.log" || echo "(no table: see $OUT/bench_conv.log)"
    echo
    echo "## bench_step (GPU: CUDA events; CPU: host timer)"
    echo
    grep '^|' "$OUT/bench_step.log" || echo "(no table: see $OUT/bench_step.log)"
    echo
    echo "## bench_kernels (one device: fp32 / bf16 x NCHW / channels-last)"
    echo
    grep '^|' "$OUT/bench_kernels.log" || echo "(no table: see $OUT/bench_kernels.log)"
    if [[ "$DEVICE" == cuda ]]; then
        echo
        echo "## plain vs parallelized on one rank (bf16, channels-last; eager and compiled)"
        echo
        grep '^|' "$OUT/plain_vs_parallelized.log" || echo "(no table: see $OUT/plain_vs_parallelized.log)"
    fi
    echo
    if [[ ! -s "$FAILED_LIST" ]]; then
        echo "verdict: PASS"
    else
        echo "verdict: FAIL ($(paste -sd ' ' "$FAILED_LIST"))"
    fi
} >> "$REPORT"
cat "$REPORT"
[[ ! -s "$FAILED_LIST" ]]
