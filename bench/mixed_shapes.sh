#!/usr/bin/env bash
# On the GPU machine: one offline attention search whose search workloads mix head sizes (128
# and 64), a prefill and a decode-like shape, grouped-query heads and a ragged length, so each
# workload needs its own build of the head-size specialisation; then PyTorch SDPA (cuDNN) on the
# same workloads in the same call (bench/peers.py). Carry .gpu (the release binary). The store is
# kept as $OUT/mixed.db, so the result can be exported (STORE=$OUT/mixed.db RUN=1 bash
# bench/torch_export.sh).
#   bash bench/mixed_shapes.sh        (BUDGET=150s by default)
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=$PWD/${KSEARCH:-.gpu/ksearch}
OUTDIR=${OUT:-/tmp/ksearch-bench}
mkdir -p "$OUTDIR"
T=$(mktemp -d)
cp -r tasks "$T/tasks"
python3 - "$T/tasks/attention/task.toml" <<'PY'
import sys
p = sys.argv[1]
s = open(p).read()
i = s.index("[backends.cuda]")
j = s.index("search = [", i)
k = s.index("\n]\n", j) + 2
s = s[:j] + """search = [
    { B = 2, H = 16, Hkv = 16, L = 3072, D = 128, causal = 1 },
    { B = 16, H = 8, Hkv = 8, L = 512, D = 64, causal = 0 },
    { B = 1, H = 32, Hkv = 8, L = 1000, D = 128, causal = 1 },
    { B = 2, H = 32, Hkv = 8, L = 777, D = 64, causal = 1 },
    { B = 4, H = 32, Hkv = 8, L = 2048, D = 128, causal = 0 },
]""" + s[k:]
open(p, "w").write(s)
PY
rm -f "$OUTDIR/mixed.db"
"$BIN" --tasks-dir "$T/tasks" --store "$OUTDIR/mixed.db" run attention --backend cuda --rounds "${ROUNDS:-10}" \
    --time-budget "${BUDGET:-150s}" --patience 10 2>&1 | tail -n 30 | tee "$OUTDIR/mixed_run.txt"
"$BIN" --store "$OUTDIR/mixed.db" tree 1 > "$OUTDIR/mixed_tree.txt" 2>&1 || true
"$BIN" --store "$OUTDIR/mixed.db" best 1 --json > "$OUTDIR/mixed.json"
python3 bench/peers.py "$OUTDIR/mixed.json" | tee "$OUTDIR/mixed_table.txt"
