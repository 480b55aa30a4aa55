#!/usr/bin/env bash
# On the GPU machine: evaluations per minute and overhead of the attention search on the CUDA
# back-end, for each binary and worker count given, each under the same time budget, then where
# an evaluation's time goes (the store's compile, kernel and judge seconds per evaluation, and
# the judge's own steps from KSEARCH_JUDGE_PROFILE).
#
# Here:      cargo build --release && mkdir -p .gpu && cp target/release/ksearch .gpu/
#            (optionally an older build as .gpu/ksearch-before, for a before/after comparison)
# There:     bash bench/eval_rate.sh                 (carry .gpu)
#            RUNS=".gpu/ksearch-before: .gpu/ksearch:3 .gpu/ksearch:1" BUDGET=70s bash bench/eval_rate.sh
# RUNS is a list of binary:workers (workers empty: the binary's default). Fits a 10-minute call
# with three runs of 70 s.
set -u
cd "$(dirname "$0")/.."
export KSEARCH_TASKS=${KSEARCH_TASKS:-$PWD/tasks} KSEARCH_KB=${KSEARCH_KB:-$PWD/kb}
OUTDIR=${OUT:-/tmp/ksearch-eval-rate}
mkdir -p "$OUTDIR"
B=${BUDGET:-70s}
TASK=${TASK:-attention}
nvidia-smi --query-gpu=name,driver_version,compute_mode --format=csv,noheader || true
n=0
for spec in ${RUNS:-.gpu/ksearch:}; do
    bin=${spec%%:*} w=${spec#*:}
    n=$((n + 1))
    d=$(mktemp -d)
    extra=()
    [[ -n "$w" ]] && extra=(--workers "$w")
    rm -f "$OUTDIR/profile$n.txt"
    t0=$(date +%s.%N)
    CUDA_CACHE_PATH="$d/nv-cache" KSEARCH_JUDGE_PROFILE="$OUTDIR/profile$n.txt" "$bin" --store "$d/store.db" run "$TASK" --backend cuda --rounds 500 --patience 500 --time-budget "$B" "${extra[@]}" > "$OUTDIR/run$n.txt" 2>&1
    rc=$?
    t1=$(date +%s.%N)
    echo "== $bin workers=${w:-default}: exit $rc, wall $(python3 -c "print(round($t1 - $t0, 1))") s"
    grep -E "^[0-9]+ rounds|^evaluations:" "$OUTDIR/run$n.txt"
    python3 - "$d/store.db" <<'PY'
import sqlite3, sys
rows = sqlite3.connect(sys.argv[1]).execute(
    "select purpose, compile_s, kernel_s, overhead_s, wall_s from evaluations order by id").fetchall()
if rows:
    k = len(rows)
    s = [sum(r[i] for r in rows) for i in range(1, 5)]
    print(f"per evaluation ({k}): compiler {s[0]/k:.3f} s, candidate runs {s[1]/k:.3f} s, "
          f"judge work outside the runs {s[2]/k:.3f} s, wall {s[3]/k:.3f} s")
PY
    # Where the judge's time went, summed over every workload of every evaluation (builds
    # without KSEARCH_JUDGE_PROFILE support write nothing).
    python3 - "$OUTDIR/profile$n.txt" <<'PY'
import collections, os, sys
p = sys.argv[1]
if os.path.exists(p):
    tot, n = collections.Counter(), 0
    for line in open(p):
        n += 1
        for kv in line.split()[3:]:
            k, v = kv.split("=")
            tot[k] += float(v)
    print(f"judge steps over {n} workloads (s): " + ", ".join(f"{k} {v:.1f}" for k, v in tot.most_common()))
PY
done
