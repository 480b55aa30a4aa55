#!/usr/bin/env bash
# On the GPU machine, with MLX's CUDA back-end: offline-planner searches of mamba_scan,
# mamba_step and attention on `--backend mlx`, each run's best exported with
# `ksearch export <run> --mlx`, then bench/mlx_e2e.py on the exported modules (mlx-lm's Mamba
# stock vs patched, the attention kernel vs MLX's SDPA). Logs and results land in $OUT; a short
# summary last. Every step runs even when an earlier one failed, and says what it skipped.
#
# Here:   ../shared/tools/stage-mlx-cuda        (stages .mlx-a/ and .mlx-b/)
#         cargo build --release && mkdir -p .gpu && cp target/release/ksearch .gpu/
# There, two calls back to back (the machine keeps its files only while it stays warm):
#   call 1, carry [".mlx-a"]:          mkdir -p /tmp/mlx && cp .mlx-a/* /tmp/mlx/
#   call 2, carry [".mlx-b", ".gpu"]:  bash bench/mlx_gpu.sh
#           (it copies .mlx-b/* to /tmp/mlx and runs /tmp/mlx/install.sh when MLX is not yet
#           importable; `cp .mlx-b/* /tmp/mlx/ && bash /tmp/mlx/install.sh && bash bench/mlx_gpu.sh`
#           does the same)
#
# Environment (defaults sum to 220 s of search; with start-up, final re-timings and the e2e
# bench the call takes about 6-8 minutes):
#   SCAN_BUDGET=75s STEP_BUDGET=35s ATT_BUDGET=110s   time budgets of the three searches
#   SCAN_ROUNDS=16 STEP_ROUNDS=10 ATT_ROUNDS=16 PATIENCE=10
#   TASKS="mamba_scan mamba_step attention"           which searches to run
#   KSEARCH=.gpu/ksearch                              the binary
#   TOTAL_BUDGET=560                                  seconds for the whole script: the e2e bench
#                                                     drops L=4096 when too little is left
#   E2E_ARGS=                                         extra arguments of mlx_e2e.py (e.g. --tiny)
# A search or export that fails falls back to a module exported beforehand, .gpu/<task>_mlx.py,
# when one was carried.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BIN=${KSEARCH:-.gpu/ksearch}
OUTDIR=${OUT:-/tmp/ksearch-mlx}
mkdir -p "$OUTDIR"
WORK=$(mktemp -d)
TOTAL_BUDGET=${TOTAL_BUDGET:-560}
export KSEARCH_TASKS=$ROOT/tasks KSEARCH_KB=$ROOT/kb PYTHONUNBUFFERED=1
export PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}
export KSEARCH_PYTHON=${KSEARCH_PYTHON:-python3}
LOG=$OUTDIR/mlx_gpu.log
SUMMARY=()

say() { echo "[mlx_gpu ${SECONDS}s] $*" | tee -a "$LOG"; }
note() { SUMMARY+=("$*"); say "$*"; }
secs() { # "75s" | "2m" | "90" -> seconds
    local v=$1
    case "$v" in
        *m) echo $(( ${v%m} * 60 )) ;;
        *s) echo "${v%s}" ;;
        *) echo "$v" ;;
    esac
}

# ---- MLX --------------------------------------------------------------------------------------------
mlx_ok() { python3 -c 'import mlx.core as mx, mlx_lm' >/dev/null 2>&1; }
if ! mlx_ok; then
    if [ -d .mlx-b ] && [ -d /tmp/mlx ] && ls /tmp/mlx/part_aa >/dev/null 2>&1; then
        say "installing MLX from /tmp/mlx + .mlx-b"
        cp .mlx-b/* /tmp/mlx/ && bash /tmp/mlx/install.sh 2>&1 | tee -a "$LOG"
    else
        say "MLX is not importable and /tmp/mlx/part_aa or .mlx-b is missing (call 1 carries .mlx-a, call 2 .mlx-b)"
    fi
fi
if mlx_ok; then
    python3 - <<'EOF' 2>&1 | tee -a "$LOG"
import mlx.core as mx, mlx_lm
print("mlx", mx.__version__, "device", mx.default_device(), "mlx-lm", mlx_lm.__version__,
      "cuda_kernel", hasattr(mx.fast, "cuda_kernel"))
EOF
    note "mlx: ok"
else
    note "mlx: NOT importable: searches and the e2e bench will fail"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader 2>&1 | tee -a "$LOG" || true

# ---- searches and exports -----------------------------------------------------------------------------
have_bin=1
if [ ! -x "$BIN" ]; then
    have_bin=0
    note "ksearch: $BIN missing or not executable: searches and exports skipped"
fi

search_export() { # task rounds budget
    local task=$1 rounds=$2 budget=$3
    local store=$WORK/$task.db mod=$OUTDIR/${task}_mlx.py
    if [ "$have_bin" = 1 ]; then
        local limit=$(( $(secs "$budget") + 180 ))
        say "search $task: --rounds $rounds --time-budget $budget (hard limit ${limit}s)"
        timeout "$limit" "$BIN" --store "$store" run "$task" --backend mlx --rounds "$rounds" \
            --time-budget "$budget" --patience "${PATIENCE:-10}" > "$OUTDIR/${task}_run.log" 2>&1
        local rc=$?
        tail -n 25 "$OUTDIR/${task}_run.log" | tee -a "$LOG"
        note "search $task: exit $rc (log ${task}_run.log)"
        # a fresh store per task: its run is run 1
        "$BIN" --store "$store" runs > "$OUTDIR/${task}_runs.txt" 2>&1 || true
        "$BIN" --store "$store" best 1 --json > "$OUTDIR/${task}_report.json" 2> "$OUTDIR/${task}_best.err" || true
        "$BIN" --store "$store" tree 1 > "$OUTDIR/${task}_tree.txt" 2>&1 || true
        cp "$store" "$OUTDIR/${task}_store.db" 2>/dev/null || true
        if "$BIN" --store "$store" export 1 --mlx -o "$mod" > "$OUTDIR/${task}_export.log" 2>&1 && [ -s "$mod" ]; then
            note "export $task: ok -> ${task}_mlx.py"
            MODULES+=("$mod")
            return
        fi
        note "export $task: FAILED ($(tail -n 1 "$OUTDIR/${task}_export.log" 2>/dev/null))"
    fi
    if [ -s ".gpu/${task}_mlx.py" ]; then
        cp ".gpu/${task}_mlx.py" "$mod"
        note "export $task: using the carried .gpu/${task}_mlx.py instead"
        MODULES+=("$mod")
    else
        note "export $task: no module: skipped in the e2e bench"
    fi
}

MODULES=()
for task in ${TASKS:-mamba_scan mamba_step attention}; do
    case "$task" in
        mamba_scan) search_export mamba_scan "${SCAN_ROUNDS:-16}" "${SCAN_BUDGET:-75s}" ;;
        mamba_step) search_export mamba_step "${STEP_ROUNDS:-10}" "${STEP_BUDGET:-35s}" ;;
        attention) search_export attention "${ATT_ROUNDS:-16}" "${ATT_BUDGET:-110s}" ;;
        *) note "task $task: unknown here, skipped" ;;
    esac
done

# ---- end to end ----------------------------------------------------------------------------------------
left=$(( TOTAL_BUDGET - SECONDS ))
lengths=512,4096
if [ "$left" -lt 150 ]; then
    lengths=512
    note "e2e: only ${left}s left: prefill at L=512 only (L=4096 skipped)"
fi
if mlx_ok; then
    say "e2e: python3 bench/mlx_e2e.py ${MODULES[*]:-(no modules: stock only)}"
    OUT=$OUTDIR timeout $(( left > 60 ? left : 60 )) python3 bench/mlx_e2e.py "${MODULES[@]}" \
        --lengths "$lengths" --budget $(( left > 90 ? left - 30 : 60 )) ${E2E_ARGS:-} > "$OUTDIR/e2e.log" 2>&1
    rc=$?
    note "e2e: exit $rc (log e2e.log, results mlx_e2e.json)"
else
    note "e2e: skipped (MLX not importable)"
fi

echo
echo "== mlx_gpu.sh steps ($(date -u +%FT%TZ), ${SECONDS}s) ==" | tee -a "$LOG"
for s in "${SUMMARY[@]}"; do echo "  $s" | tee -a "$LOG"; done
if [ -s "$OUTDIR/mlx_e2e_table.txt" ]; then
    cat "$OUTDIR/mlx_e2e_table.txt" | tee -a "$LOG"
else
    tail -n 30 "$OUTDIR/e2e.log" 2>/dev/null | tee -a "$LOG"
fi
