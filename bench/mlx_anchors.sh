#!/usr/bin/env bash
# On the GPU machine, with MLX's CUDA back-end: issue #13's MLX comparisons at the shipped defaults in
# one call (the MLX twin of bench/cuda_anchors.sh), each step time-boxed, a summary last.
#   attention  flash_ws ([backends.mlx-cuda] defaults) against mx.fast.scaled_dot_product_attention at
#              4,32,2048,128 causal and not and on the task's mlx-cuda search and held-out shapes, on the
#              host clock and through the MLX worker's judge (its GPU clock): bench/mlx_attention.py
#   scan       tw_scan inside MLX against the same file on the CUDA back-end, five anchor shapes, one
#              process (bench/mlx_scan.py; the CUDA side's CUBINs come from .scan-cubins-tw)
#   mamba      mlx-lm Mamba-370m decode, stock against the export tail's fused decode, sync loop and
#              generate_step, medians of 3 (bench/mlx_e2e.py --tail)
#   llama      the 1.0 B random-weight mlx-lm Llama stock against patch_mlx_lm_llama with flash_ws:
#              prefill at L 2048 / 4096, decode, logits (bench/mlx_llama.py)
#   decode     that model's decode, stock against the patch with and without fuse_decode (and two
#              variants of it), interleaved rounds in one process (bench/mlx_llama_decode.py)
# STEPS (default "attention scan mamba llama decode") picks steps; REPS (default 20) the attention repetitions;
# ATT_VARIANTS (default "default") and ATT_SHAPE_VARIANTS, bench/mlx_attention.py's --variants / --shape-variants
# (e.g. ATT_SHAPE_VARIANTS="PM=1": a tunable variant beside the defaults on every shape and through the judge;
# ATT_SECS, the step's time box, 170 s by default);
# DECODE_ARGS, arguments of the decode step (e.g. "--builds fused,replan --rounds 9").
# Each step has its own time box (170 + 100 + 120 + 190 + 150 s); on an H100 (2026-12-07) they took 89, 13, 73,
# 34 and 51 s, and MLX's install 20, so one 600 s call does all five. Logs in $OUT.
#
# Here:   ../shared/tools/stage-mlx-cuda                 (stages .mlx-a/ and .mlx-b/)
#         ANCHORS_PREPARE=1 bash bench/cuda_anchors.sh   (NVRTC into .scan-cubins-tw, among others)
# There, two calls back to back (the machine keeps its files only while it stays warm):
#   call 1, carry [".mlx-a"]:                     mkdir -p /tmp/mlx && cp .mlx-a/* /tmp/mlx/
#   call 2, carry [".mlx-b", ".scan-cubins-tw"]:  bash bench/mlx_anchors.sh
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUTDIR=${OUT:-/tmp/mlx-anchors}
mkdir -p "$OUTDIR"
export OUT=$OUTDIR PYTHONUNBUFFERED=1 KSEARCH_TASKS=$ROOT/tasks KSEARCH_KB=$ROOT/kb
export PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}
STEPS=${STEPS:-attention scan mamba llama decode}
say() { echo "[mlx_anchors ${SECONDS}s] $*"; }
FAILED=()

if ! python3 -c 'import mlx.core, mlx_lm' >/dev/null 2>&1; then
    if [ -d .mlx-b ] && ls /tmp/mlx/part_aa >/dev/null 2>&1; then
        say "installing MLX from /tmp/mlx + .mlx-b"
        cp .mlx-b/* /tmp/mlx/ && bash /tmp/mlx/install.sh > "$OUTDIR/mlx_install.log" 2>&1 ||
            { tail -5 "$OUTDIR/mlx_install.log"; exit 1; }
    else
        say "MLX is not importable and /tmp/mlx/part_aa or .mlx-b is missing (call 1 carries .mlx-a, call 2 .mlx-b)"
        exit 1
    fi
fi
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader
date -u +"%F %H:%M UTC"
say "mlx $(python3 -c 'import mlx.core as mx; print(mx.__version__)'), mlx-lm $(python3 -c 'import mlx_lm; print(mlx_lm.__version__)')"

step() {  # step NAME SECONDS COMMAND...: the command's output in $OUTDIR/NAME.log, its exit status said
    local name=$1 secs=$2
    shift 2
    case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
    say "$name: $*"
    timeout "$secs" "$@" > "$OUTDIR/$name.log" 2>&1
    local rc=$?
    say "$name: exit $rc$([ $rc = 124 ] && echo " (cut off at $secs s)")"
    [ $rc = 0 ] || FAILED+=("$name")
}
step attention "${ATT_SECS:-170}" env KS_ATT_KERNEL=flash_ws python3 bench/mlx_attention.py --variants "${ATT_VARIANTS:-default}" \
    ${ATT_SHAPE_VARIANTS:+--shape-variants "$ATT_SHAPE_VARIANTS"} --reps "${REPS:-20}"
step scan 100 env KS_CUBIN_DIR="$ROOT/.scan-cubins-tw" python3 bench/mlx_scan.py --kernel tw_scan --configs default --top 0
step mamba 120 python3 bench/mlx_e2e.py --tail --lengths 512 --decode-steps 128 --budget 100
step llama 190 env KS_ATT_KERNEL=flash_ws python3 bench/mlx_llama.py --no-f32 --budget 170 --reps 3
step decode 150 env KS_ATT_KERNEL=flash_ws python3 bench/mlx_llama_decode.py ${DECODE_ARGS:-}

echo
echo "==== summary (ratio = stock or peer time / ours: > 1 is faster) ===="
[ -f "$OUTDIR/attention.log" ] && sed -n '/^== wgmma kernel in MLX/,$p' "$OUTDIR/attention.log"
[ -f "$OUTDIR/scan.log" ] && sed -n '/^==== tw_scan/,/^$/p' "$OUTDIR/scan.log"
[ -f "$OUTDIR/mamba.log" ] && grep -E "^decode|^  runs|^prefill" "$OUTDIR/mamba.log" | tail -8
[ -f "$OUTDIR/llama.log" ] && grep -E "^attention alone|^ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+$|^prefill|^decode|^logits|^measured" "$OUTDIR/llama.log"
[ -f "$OUTDIR/decode.log" ] && sed -n '/^== mlx-lm Llama decode/,$p' "$OUTDIR/decode.log"
# Exit status: 1 when a step failed or was cut off (its log in $OUT says why), else 0.
if [ ${#FAILED[@]} -gt 0 ]; then
    echo "failed or cut off: ${FAILED[*]} (logs in $OUTDIR)"
    exit 1
fi
