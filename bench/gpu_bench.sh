#!/usr/bin/env bash
# On the GPU machine: offline-planner searches of attention, mamba_scan and mamba_step on the
# CUDA back-end (TASKS="attention mamba_scan" picks some; *_ROUNDS / *_BUDGET size them), then
# their peers (PyTorch SDPA, the sequential PyTorch scan, the copy roofline) measured in the same
# call; a short table last. Fits a 10-minute call.
#
# Here:      cargo build --release && mkdir -p .gpu && cp target/release/ksearch .gpu/
# There:     bash bench/gpu_bench.sh        (carry .gpu)
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
    if "$BIN" --store "$STORE" best "$id" --json > "$OUTDIR/report$id.json" 2>/dev/null; then reports+=("$OUTDIR/report$id.json"); fi
    "$BIN" --store "$STORE" tree "$id" >> "$OUTDIR/trees.txt" 2>&1 || true
done
[[ -n "${KEEP_STORE:-}" ]] && cp "$STORE" "$OUTDIR/store.db" 2>/dev/null || true
python3 bench/peers.py "${reports[@]}" | tee "$OUTDIR/table.txt"
