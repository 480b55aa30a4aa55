#!/usr/bin/env bash
# On the GPU machine: two builds of one attention kernel configuration that differ only in extra
# defines (bench/cuda_dev.py's KS_DEFS: A = DEFS_A, B = DEFS_B, empty = the source as shipped), or
# two configurations (A = FIX, B = FIX_B), against cuDNN's SDPA, in one call: the stress suite of
# build A (and of B with STRESS_FIX_B) first (every element checked, TMA
# and cp.async loads, persistent and not, under a timeout); then A and B timed alternately ROUNDS
# times each on SUITES (every element of every run checked, CUDA events with L2 flushed, medians;
# the peers timed again in every pass), and a table of each shape's median per build over its passes
# with its ratio to cuDNN.
# Here:   PREPARE=1 FIX=... DEFS_B=... bash bench/attention_ab.sh   (NVRTC into .att-cubins)
# There:  FIX=... DEFS_B=... bash bench/attention_ab.sh             (carry .att-cubins)
# FIX as bench/cuda_dev.py's KS_FIX (one configuration); FIX_B (default FIX) B's configuration;
# STRESS_FIX_B: B's stress suite too (a KS_FIX, as STRESS_FIX for A); KERNEL (default flash_ws); SUITES (default
# anchor,heldout,ragged); ROUNDS (default 2). TASK=mamba_scan (with KERNEL, KS_CUBIN_DIR and
# SUITES=anchor) does the same for a scan kernel against mamba_ssm's selective-scan forward (carry .peer).
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-/tmp/attention-ab}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 KS_CUBIN_DIR=${KS_CUBIN_DIR:-$PWD/.att-cubins} KS_BACKENDS=cuda KS_KERNELS=${KERNEL:-flash_ws}
TASK=${TASK:-attention}
FIX=${FIX:?FIX: one configuration, e.g. BLOCK_N=128,STAGES=3,...}
SUITES=${SUITES:-anchor,heldout,ragged}
ROUNDS=${ROUNDS:-2}
FIX_B=${FIX_B:-$FIX}
STRESS_FIX=${STRESS_FIX:-$FIX}
if [ "${PREPARE:-0}" = 1 ]; then
    KS_DEFS=${DEFS_A:-} KS_SUITES=$SUITES KS_TIME=1 KS_FIX=$FIX python3 bench/cuda_dev.py prepare $TASK | grep -E "^prepare"
    KS_DEFS=${DEFS_B:-} KS_SUITES=$SUITES KS_TIME=1 KS_FIX=$FIX_B python3 bench/cuda_dev.py prepare $TASK | grep -E "^prepare"
    KS_DEFS=${DEFS_A:-} KS_SUITES=stress KS_TIME=0 KS_STRESS_DIST=1 KS_FIX=$STRESS_FIX python3 bench/cuda_dev.py prepare $TASK |
        grep -E "^prepare"
    if [ -n "${STRESS_FIX_B:-}" ]; then
        KS_DEFS=${DEFS_B:-} KS_SUITES=stress KS_TIME=0 KS_STRESS_DIST=1 KS_FIX=$STRESS_FIX_B python3 bench/cuda_dev.py prepare $TASK |
            grep -E "^prepare"
    fi
    exit 0
fi
KS_DEFS=${DEFS_A:-} KS_SUITES=stress KS_TIME=0 KS_STRESS_DIST=1 KS_FIX=$STRESS_FIX timeout 240 \
    python3 bench/cuda_dev.py run $TASK > "$OUTDIR/stress.log" 2>&1
echo "stress (A): exit $? $(grep -E '^==== checked' "$OUTDIR/stress.log" || echo 'no summary: cut off or crashed')"
if [ -n "${STRESS_FIX_B:-}" ]; then
    KS_DEFS=${DEFS_B:-} KS_SUITES=stress KS_TIME=0 KS_STRESS_DIST=1 KS_FIX=$STRESS_FIX_B timeout 240 \
        python3 bench/cuda_dev.py run $TASK > "$OUTDIR/stress-b.log" 2>&1
    echo "stress (B): exit $? $(grep -E '^==== checked' "$OUTDIR/stress-b.log" || echo 'no summary: cut off or crashed')"
fi
for r in $(seq 1 "$ROUNDS"); do
    for side in A B; do
        if [ $side = A ]; then d=${DEFS_A:-} f=$FIX; else d=${DEFS_B:-} f=$FIX_B; fi
        log="$OUTDIR/time-$side-$r.log"
        KS_DEFS=$d KS_SUITES=$SUITES KS_TIME=1 KS_FIX=$f timeout 200 python3 bench/cuda_dev.py run $TASK > "$log" 2>&1
        echo "time $side round $r (KS_DEFS=$d KS_FIX=$f): exit $? $(grep -E '^==== checked' "$log" || echo 'no summary: cut off or crashed')"
    done
done
python3 - "$OUTDIR" "$ROUNDS" "$TASK" <<'EOF'
import re, statistics, sys
out, rounds, task = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rx = re.compile(task + r"\s+(\w) (\{.*?\})\s+(?:peer (cuDNN SDPA|torch SDPA|mamba_ssm)|(\S+))\s+([\d.]+|nan) us")
t = {}
for side in "AB":
    for r in range(1, rounds + 1):
        try:
            lines = open(f"{out}/time-{side}-{r}.log").read().splitlines()
        except OSError:
            continue
        for line in lines:
            m = rx.match(line)
            if not m or m.group(5) == "nan":
                continue
            who = m.group(3) or side
            t.setdefault((m.group(1), m.group(2)), {}).setdefault(who, []).append(float(m.group(5)))
print(f"{'suite shape':<80} {'A us':>8} {'B us':>8} {'peer':>8} {'A/peer':>8} {'B/peer':>8}  (medians over passes; ratio = peer / build; peer: cuDNN SDPA, torch SDPA where cuDNN has no kernel, or mamba_ssm)")
for (s, shape), v in t.items():
    med = {k: statistics.median(x) for k, x in v.items()}
    peer = med.get("cuDNN SDPA") or med.get("torch SDPA") or med.get("mamba_ssm")
    a, b = med.get("A"), med.get("B")
    f = lambda x: f"{x:8.2f}" if x else f"{'-':>8}"
    r = lambda x: f"{peer / x:7.3f}x" if x and peer else f"{'-':>8}"
    print(f"{s} {shape:<78} {f(a)} {f(b)} {f(peer)} {r(a)} {r(b)}")
EOF
grep -h "^FAILED" "$OUTDIR"/*.log | head -20
