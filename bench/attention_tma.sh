#!/usr/bin/env bash
# On the GPU machine: flash_ws with its loads on the tensor-memory accelerator (TMA=1: tensor maps
# built on the device, tasks/attention/cuda/flash_ws.cu's header), with and without its conditional
# rescale (RS=1), against the same kernel's cp.async build and cuDNN's SDPA, one call, through bench/cuda_dev.py (every element checked
# against the float32 SDPA reference, NaN-poisoned outputs in NaN guard zones, CUDA events with L2
# flushed, medians; the peer timed in the same process):
#   1. correctness first, no timing, for each new build: one checked launch at the first anchor
#      shape under a 60 s timeout (a map the hardware refuses or a barrier that never completes
#      costs a minute, not the call), then the stress suite (ragged L 1..1500, grouped- and
#      multi-query heads, D 64 / 96 / 128, shapes with more items than blocks); a build failing
#      either is not timed;
#   2. timing, ROUNDS (1) times alternating the builds (BUILDS): the anchor shapes (4,32,32,2048,128 with
#      and without the causal mask, the Llama shapes), the task's search and held-out workloads,
#      at FIX (default: the task's defaults and STAGES 2).
# Here:   ATT_PREPARE=1 bash bench/attention_tma.sh   (NVRTC into .att-cubins, every build)
# There:  bash bench/attention_tma.sh                 (carry .att-cubins)
# MLX (the same builds inside MLX against mx.fast.scaled_dot_product_attention), after the MLX
# staging call of bench/mlx_attention.sh's header:
#   KS_ATT_KERNEL=flash_ws VARIANTS="default;TMA=1;TMA=1,RS=1" ATT_BUDGET=0 SKIP_RUST_BENCH=1 bash bench/mlx_attention.sh
# Logs land in $OUT; every build's summary (times, ratios to cuDNN) last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-/tmp/attention-tma}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 KS_CUBIN_DIR=${KS_CUBIN_DIR:-$PWD/.att-cubins} KS_BACKENDS=cuda KS_KERNELS=flash_ws
FIX=${FIX:-"STAGES=2|3,BLOCK_N=128,PP=1,CTAS=132"}
mode=run
[ "${ATT_PREPARE:-0}" = 1 ] && mode=prepare

# $1: label, $2: KS_DEFS, $3: suites, $4: KS_TIME, $5: KS_FIX, $6: timeout (s)
pass() {
    local log="$OUTDIR/$1.log"
    if [ "$mode" = prepare ]; then
        KS_DEFS=$2 KS_SUITES=$3 KS_TIME=$4 KS_FIX=$5 python3 bench/cuda_dev.py prepare attention | grep -E "^prepare"
        return
    fi
    KS_DEFS=$2 KS_SUITES=$3 KS_TIME=$4 KS_FIX=$5 timeout "$6" python3 bench/cuda_dev.py run attention > "$log" 2>&1
    local rc=$?
    echo "$1: exit $rc ($log): $(grep -E '^==== checked' "$log" || echo 'no summary: cut off or crashed')"
    return $rc
}

# BUILDS: the builds compared, `;`-separated KS_DEFS ("" the plain kernel); RS=1 is the kernel's
# conditional rescale (its header), also not yet a tunable.
BUILDS=${BUILDS:-";TMA=1;RS=1;TMA=1,RS=1"}
IFS=';' read -r -a builds <<< "$BUILDS"
[ "${BUILDS: -1}" = ";" ] && builds+=("")
label() { [ -n "$1" ] && echo "${1//[=,]/-}" || echo plain; }
# 1. correctness of the new builds first: one checked launch at the first anchor shape (a map the
# hardware refuses or a barrier that never completes shows here, cut off after 60 s), then the
# stress suite; a build that fails either is left out of the timing
ok=()
for b in "${builds[@]}"; do
    if [ -z "$b" ]; then ok+=(""); continue; fi
    KS_MAXCFG=1 KS_HELDOUT=0 pass "$(label "$b")-smoke" "$b" anchor 0 "CTAS=132,STAGES=3" 60 &&
        pass "$(label "$b")-stress" "$b" stress 0 "CTAS=132|1048576" 180 && ok+=("$b")
done
[ "$mode" = prepare ] || builds=("${ok[@]}")
# 2. timing, the builds alternating
for r in $(seq "${ROUNDS:-1}"); do
    for b in "${builds[@]}"; do
        pass "$(label "$b")-time-$r" "$b" anchor,search,heldout 1 "$FIX" 180
    done
    [ "$mode" = prepare ] && break
done
[ "$mode" = prepare ] && exit 0

echo "== summaries (bench/cuda_dev.py's: the best correct configuration per workload, the peers of the same process) =="
for f in "$OUTDIR"/*-time-*.log; do
    echo "-- $(basename "$f" .log)"
    sed -n '/^==== summary/,$p' "$f" | tail -n +2
done
grep -h "^FAILED" "$OUTDIR"/*.log | head -20
