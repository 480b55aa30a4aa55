#!/usr/bin/env bash
# On the GPU machine: offline-planner searches of attention, mamba_scan and mamba_step on the
# CUDA back-end (TASKS="attention mamba_scan" picks some; *_ROUNDS / *_BUDGET size them), then
# their peers (PyTorch SDPA, the sequential PyTorch scan, the copy roofline) measured in the same
# call; a short table last. Fits a 10-minute call.
#
# Here:      cargo build --release && mkdir -p .gpu && cp target/release/ksearch .gpu/
# There:     bash bench/gpu_bench.sh        (carry .gpu)
#            SWEEP="attention:flash_wgmma" TASKS=attention bash bench/gpu_bench.sh   (sweep first)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${KSEARCH:-.gpu/ksearch}
OUTDIR=${OUT:-/tmp/ksearch-bench}
mkdir -p "$OUTDIR"
STORE=$(mktemp -d)/store.db
export KSEARCH_TASKS=$PWD/tasks KSEARCH_KB=$PWD/kb PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader || true
run() { # task rounds budget
    "$BIN" --store "$STORE" run "$1" --backend cuda --rounds "$2" --time-budget "$3" --patience 10 2>&1 | tee -a "$OUTDIR/runs.log" || true
}
# SWEEP="attention:flash_wgmma mamba_scan:seq_scan" first measures every admitted configuration
# of those kernels (bench/cuda_dev.py, search workloads) and makes the best one correct on all of
# them the kernel's defaults in tasks/<task>/task.toml (bench/set_defaults.py), so the search
# starts from it. The logs land in $OUTDIR/sweep_<task>_<kernel>.log; the file changes stay in
# the working tree of this machine (commit the same change to keep it).
for tk in ${SWEEP:-}; do
    t=${tk%%:*} k=${tk#*:}
    log="$OUTDIR/sweep_${t}_${k}.log"
    KS_KERNELS=$k KS_HELDOUT=0 timeout "${SWEEP_LIMIT:-150}" python3 bench/cuda_dev.py run "$t" > "$log" 2>&1 || echo "sweep $t/$k: exit $? (log $log)"
    grep -A8 "==== summary" "$log" || tail -n 5 "$log"
    python3 bench/set_defaults.py "$log" "$t" "$k" | tee -a "$OUTDIR/runs.log"
done
# TASKS picks the searches (default all three), in this order; run ids follow it.
n=0
for t in ${TASKS:-attention mamba_scan mamba_step}; do
    case "$t" in
        attention) run attention "${ATT_ROUNDS:-16}" "${ATT_BUDGET:-170s}" ;;
        mamba_scan) run mamba_scan "${SCAN_ROUNDS:-16}" "${SCAN_BUDGET:-120s}" ;;
        mamba_step) run mamba_step "${STEP_ROUNDS:-10}" "${STEP_BUDGET:-60s}" ;;
        *) echo "unknown task $t" >&2; continue ;;
    esac
    n=$((n + 1))
done
"$BIN" --store "$STORE" runs 2>&1 | tee -a "$OUTDIR/runs.log" || true
reports=()
for id in $(seq 1 "$n"); do
    # Exit 1 is a finished run without a result: its report (with `no_result`) is kept too.
    "$BIN" --store "$STORE" best "$id" --json > "$OUTDIR/report$id.json" 2>/dev/null || true
    if [ -s "$OUTDIR/report$id.json" ]; then reports+=("$OUTDIR/report$id.json"); fi
    "$BIN" --store "$STORE" tree "$id" >> "$OUTDIR/trees.txt" 2>&1 || true
done
[[ -n "${KEEP_STORE:-}" ]] && cp "$STORE" "$OUTDIR/store.db" 2>/dev/null || true
python3 bench/peers.py "${reports[@]}" | tee "$OUTDIR/table.txt"
