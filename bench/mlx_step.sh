#!/usr/bin/env bash
# On the GPU machine (MLX CUDA back-end): a search of the tiny decode-step kernel (mamba_step, a
# few microseconds per call) through the MLX worker, whose judge times small calls in batches over
# rotated inputs so that MLX's per-evaluation cost (~80-100 us) does not decide the ranking, and
# whose final phase re-times the best against the seed back to back: a best that is not faster
# once re-timed is reported as "no result", never as a speed-up. Prints the run's summary, the
# tree and the judge's notes on batching.
#
# Here:   cargo build --release; cp target/release/ksearch .gpu/   (and stage MLX: bench/mlx_gpu.sh's header)
# There:  bash bench/mlx_step.sh           (MLX importable in python3; carry .gpu)
# STEP_ROUNDS (10), STEP_BUDGET (90s), BIN (.gpu/ksearch).
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.gpu/ksearch}
OUTDIR=${OUT:-/tmp/ksearch-mlx-step}
mkdir -p "$OUTDIR"
export KSEARCH_PYTHON=${KSEARCH_PYTHON:-python3} PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
d=$(mktemp -d)
date -u +"%F %T UTC"
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())'
"$BIN" --store "$d/store.db" run mamba_step --backend mlx --rounds "${STEP_ROUNDS:-10}" \
    --time-budget "${STEP_BUDGET:-90s}" --patience "${STEP_ROUNDS:-10}" > "$OUTDIR/mlx_step_run.txt" 2>&1
echo "run: exit $? (0: a verified speed-up; 1: no result)"
cat "$OUTDIR/mlx_step_run.txt"
"$BIN" --store "$d/store.db" tree 1 2>&1 | head -n 40
python3 - "$d/store.db" <<'PY'
import json, sqlite3, sys
db = sqlite3.connect(sys.argv[1])
# how the judge timed each workload (calls per timed sample), from the stored resources
seen = set()
for purpose, res in db.execute("select purpose, resources from evaluations order by id"):
    try:
        raw = json.loads(res).get("raw", "")
    except Exception:
        continue
    for line in str(raw).splitlines():
        if "calls per timed sample" in line and (purpose, line) not in seen:
            seen.add((purpose, line))
            print(purpose, line)
PY
