#!/usr/bin/env bash
# On the GPU machine: `ksearch export --torch` end to end. A short offline CUDA search per task
# (attention, mamba_scan), the export of its best kernel, then bench/torch_export.py on the
# module: element checks on >= 24 shapes against a float32 reference, times against the peer
# (torch SDPA; mamba_ssm where importable) and against the run's own measurements of the same
# builds, fall-backs, torch.compile. Logs under $OUT (default /tmp/ksearch-bench).
#
# Here:   cargo build --release && mkdir -p .gpu && cp target/release/ksearch .gpu/
# There:  bash bench/torch_export.sh                      (carry .gpu)
#         TASKS=attention ROUNDS=4 BUDGET=60s bash bench/torch_export.sh
#         STORE=path/store.db RUN=3 bash bench/torch_export.sh   (export a run already searched)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=$PWD/${KSEARCH:-.gpu/ksearch}
OUTDIR=${OUT:-/tmp/ksearch-bench}
mkdir -p "$OUTDIR"
T=$(mktemp -d)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
status=0
check() { # module
    python3 bench/torch_export.py "$1" --shapes "${SHAPES:-24}" --reps "${REPS:-30}" ${NO_COMPILE:+--no-compile} 2>&1 \
        | tee -a "$OUTDIR/torch_export.txt" || status=1
}
if [[ -n "${STORE:-}" ]]; then
    "$BIN" --store "$STORE" export "${RUN:?RUN=<run id> with STORE}" --torch -o "$T/exported.py" | tee -a "$OUTDIR/torch_export.txt"
    check "$T/exported.py"
    exit $status
fi
id=0
for task in ${TASKS:-attention mamba_scan}; do
    id=$((id + 1))
    echo "== $task: search ==" | tee -a "$OUTDIR/torch_export.txt"
    "$BIN" --store "$T/s.db" run "$task" --backend cuda --rounds "${ROUNDS:-4}" --time-budget "${BUDGET:-60s}" \
        --patience 10 2>&1 | tail -n 14 | tee -a "$OUTDIR/torch_export.txt"
    "$BIN" --store "$T/s.db" export "$id" --torch -o "$T/$task.py" | tee -a "$OUTDIR/torch_export.txt"
    cp "$T/$task.py" "$OUTDIR/${task}_export.py"
    check "$T/$task.py"
done
exit $status
