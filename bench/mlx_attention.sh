#!/usr/bin/env bash
# On the GPU machine, with MLX's CUDA back-end: the attention task's wgmma kernel inside MLX
# (tasks/attention/cuda/flash_wgmma.cu as an mlx-cuda whole translation unit) against
# mx.fast.scaled_dot_product_attention (bench/mlx_attention.py: tunable variants at 4,32,2048,128,
# then every search and held-out shape of [backends.mlx-cuda], and the same through the MLX worker),
# then, when the ksearch binary is carried, `ksearch bench ... --like flash_wgmma` on the shipped
# task and a short `ksearch run attention --backend mlx-cuda` on a copy with small search shapes,
# its best exported with `ksearch export <run> --mlx` and that module checked and timed.
# Logs and results land in $OUT; the ratio table last.
#
# Here:   ../shared/tools/stage-mlx-cuda        (stages .mlx-a/ and .mlx-b/)
#         cargo build --release && mkdir -p .gpu && cp target/release/ksearch .gpu/   (for the search)
# There, two calls back to back (the machine keeps its files only while it stays warm):
#   call 1, carry [".mlx-a"]:          mkdir -p /tmp/mlx && cp .mlx-a/* /tmp/mlx/
#   call 2, carry [".mlx-b", ".gpu"]:  bash bench/mlx_attention.sh
# Environment: ATT_BUDGET=150s ATT_ROUNDS=3 (the search; ATT_BUDGET=0 skips it), SKIP_BENCH=1, SKIP_RUST_BENCH=1,
#              VARIANTS="default;MBAR=0;..." (bench/mlx_attention.py --variants), SHAPE_VARIANTS="..." (every
#              shape and the judge also with these; --shape-variants), BENCH_TIMEOUT=300, KSEARCH=.gpu/ksearch
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BIN=${KSEARCH:-.gpu/ksearch}
OUTDIR=${OUT:-/tmp/ksearch-mlx-attention}
mkdir -p "$OUTDIR"
export OUT=$OUTDIR KSEARCH_TASKS=$ROOT/tasks KSEARCH_KB=$ROOT/kb PYTHONUNBUFFERED=1
export PYTHONPATH=$ROOT/python${PYTHONPATH:+:$PYTHONPATH}
export KSEARCH_PYTHON=${KSEARCH_PYTHON:-python3}
LOG=$OUTDIR/mlx_attention.log
say() { echo "[mlx_attention ${SECONDS}s] $*" | tee -a "$LOG"; }

mlx_ok() { python3 -c 'import mlx.core as mx' >/dev/null 2>&1; }
if ! mlx_ok; then
    if [ -d .mlx-b ] && ls /tmp/mlx/part_aa >/dev/null 2>&1; then
        say "installing MLX from /tmp/mlx + .mlx-b"
        cp .mlx-b/* /tmp/mlx/ && bash /tmp/mlx/install.sh >> "$LOG" 2>&1
    else
        say "MLX is not importable and /tmp/mlx/part_aa or .mlx-b is missing (call 1 carries .mlx-a, call 2 .mlx-b)"
        exit 1
    fi
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader 2>&1 | tee -a "$LOG" || true

if [ "${SKIP_BENCH:-0}" != 1 ]; then
    say "bench/mlx_attention.py"
    timeout ${BENCH_TIMEOUT:-300} python3 bench/mlx_attention.py ${VARIANTS:+--variants "$VARIANTS"} \
        ${SHAPE_VARIANTS:+--shape-variants "$SHAPE_VARIANTS"} > "$OUTDIR/bench.log" 2>&1
    say "bench: exit $? (log bench.log)"
fi

budget=${ATT_BUDGET:-150s}
if [ -x "$BIN" ] && [ "$budget" != "0" ]; then
    # The Rust path on the task as shipped: the loader's options (form, file), the worker, the judge.
    if [ "${SKIP_RUST_BENCH:-0}" != 1 ]; then
        say "ksearch bench attention cuda/flash_wgmma.cu --backend mlx-cuda --like flash_wgmma"
        timeout 150 "$BIN" --store "$(mktemp -d)/bench.db" bench attention tasks/attention/cuda/flash_wgmma.cu \
            --backend mlx-cuda --like flash_wgmma > "$OUTDIR/search.log" 2>&1
        say "bench: exit $?"
    fi
    # A short search whose best is the wgmma kernel, on a copy of the task with small search shapes
    # (the naive seed takes ~20 s at the shipped ones, ~9 s at these) and the wgmma kernel as the only
    # one to adopt; one held-out shape at D = 64, so the final phase builds HD = 64. The budget covers
    # the final phase: at 45 s the rounds never started (2026-12-03), hence 150 s.
    small=$(mktemp -d)
    cp -r tasks/attention "$small/attention"
    python3 - "$small/attention/task.toml" <<'PY'
import re, sys
p = sys.argv[1]
s = open(p).read()
a = s.index("[backends.mlx-cuda]\nsearch = [")
b = s.index("[backends.mlx-cuda.seed]")
s = s[:a] + ("[backends.mlx-cuda]\nsearch = [\n    { B = 1, H = 8, Hkv = 8, L = 512, D = 128, causal = 1 },\n"
             "    { B = 1, H = 8, Hkv = 2, L = 384, D = 128, causal = 0 },\n]\n"
             "heldout = [\n    { B = 1, H = 8, Hkv = 2, L = 300, D = 64, causal = 1 },\n]\n\n") + s[b:]
a = s.index('[[backends.mlx-cuda.kernels]]\nname = "flash"\n')
b = s.index("# ---- MLX, Metal dialect")
s = s[:a] + s[b:]
open(p, "w").write(s)
PY
    store=$(mktemp -d)/attention.db
    say "search: run attention --backend mlx-cuda --rounds ${ATT_ROUNDS:-3} --time-budget $budget (small shapes)"
    timeout 200 "$BIN" --store "$store" --tasks-dir "$small" run attention --backend mlx-cuda \
        --rounds "${ATT_ROUNDS:-3}" --time-budget "$budget" --patience 12 >> "$OUTDIR/search.log" 2>&1
    say "search: exit $? (log search.log)"
    "$BIN" --store "$store" tree 1 >> "$OUTDIR/search.log" 2>&1 || true
    tail -n 40 "$OUTDIR/search.log" | tee -a "$LOG"
    if "$BIN" --store "$store" --tasks-dir "$small" export 1 --mlx -o "$OUTDIR/attention_mlx.py" >> "$LOG" 2>&1; then
        say "export: ok; checking the module at the main shape"
        timeout 120 python3 bench/mlx_attention.py --module-only --reps 10 --module "$OUTDIR/attention_mlx.py" \
            > "$OUTDIR/module.log" 2>&1
        say "module: exit $? (log module.log)"
        grep -E "^exported|^== " "$OUTDIR/module.log" | tee -a "$LOG"
    else
        say "export: FAILED"
    fi
else
    say "search skipped ($BIN missing or ATT_BUDGET=0)"
fi
echo
if [ -s "$OUTDIR/mlx_attention_table.txt" ]; then
    tee -a "$LOG" < "$OUTDIR/mlx_attention_table.txt"
elif [ -s "$OUTDIR/bench.log" ]; then
    tail -n 40 "$OUTDIR/bench.log"
fi
