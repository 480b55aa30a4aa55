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
# FIX_C / DEFS_C and FIX_D / DEFS_D add builds C and D, timed in the same alternation (STRESS_FIX_C / _D: their stress suites).
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
SIDES="A B"
for x in C D; do
    v=FIX_$x dv=DEFS_$x
    if [ -n "${!v:-}${!dv:-}" ]; then SIDES="$SIDES $x"; fi
done
side_fix() {  # the configuration and defines of a build: "FIX DEFS"
    case $1 in
        A) echo "$FIX ${DEFS_A:-}" ;;
        B) echo "$FIX_B ${DEFS_B:-}" ;;
        *) local v=FIX_$1 dv=DEFS_$1; echo "${!v:-$FIX} ${!dv:-}" ;;
    esac
}
stress_fix() {  # a build's stress configuration, empty where its stress suite is not run
    if [ "$1" = A ]; then echo "$STRESS_FIX"; else local v=STRESS_FIX_$1; echo "${!v:-}"; fi
}
stress_log() { if [ "$1" = A ]; then echo stress.log; else echo "stress-${1,,}.log"; fi; }
if [ "${PREPARE:-0}" = 1 ]; then
    for x in $SIDES; do
        read -r f d <<< "$(side_fix $x)"
        KS_DEFS=$d KS_SUITES=$SUITES KS_TIME=1 KS_FIX=$f python3 bench/cuda_dev.py prepare $TASK | grep -E "^prepare"
        sf=$(stress_fix $x)
        if [ -n "$sf" ]; then
            KS_DEFS=$d KS_SUITES=stress KS_TIME=0 KS_STRESS_DIST=1 KS_FIX=$sf python3 bench/cuda_dev.py prepare $TASK |
                grep -E "^prepare"
        fi
    done
    exit 0
fi
for x in $SIDES; do
    read -r f d <<< "$(side_fix $x)"
    sf=$(stress_fix $x)
    [ -n "$sf" ] || continue
    log="$OUTDIR/$(stress_log $x)"
    KS_DEFS=$d KS_SUITES=stress KS_TIME=0 KS_STRESS_DIST=1 KS_FIX=$sf timeout 240 python3 bench/cuda_dev.py run $TASK > "$log" 2>&1
    echo "stress ($x): exit $? $(grep -E '^==== checked' "$log" || echo 'no summary: cut off or crashed')"
done
for r in $(seq 1 "$ROUNDS"); do
    for x in $SIDES; do
        read -r f d <<< "$(side_fix $x)"
        log="$OUTDIR/time-$x-$r.log"
        KS_DEFS=$d KS_SUITES=$SUITES KS_TIME=1 KS_FIX=$f timeout 200 python3 bench/cuda_dev.py run $TASK > "$log" 2>&1
        echo "time $x round $r (KS_DEFS=$d KS_FIX=$f): exit $? $(grep -E '^==== checked' "$log" || echo 'no summary: cut off or crashed')"
    done
done
python3 - "$OUTDIR" "$ROUNDS" "$TASK" <<'EOF'
import re, statistics, sys
out, rounds, task = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rx = re.compile(task + r"\s+(\w) (\{.*?\})\s+(?:peer (cuDNN SDPA|torch SDPA|mamba_ssm)|(\S+))\s+([\d.]+|nan) us")
t = {}
for side in "ABCD":
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
sides = "AB" + "".join(x for x in "CD" if any(x in v for v in t.values()))
head = " ".join(f"{x + ' us':>8}" for x in sides) + f" {'peer':>8} " + " ".join(f"{x + '/peer':>8}" for x in sides)
print(f"{'suite shape':<80} {head}  (medians over passes; ratio = peer / build; peer: cuDNN SDPA, torch SDPA where cuDNN has no kernel, or mamba_ssm)")
for (s, shape), v in t.items():
    med = {k: statistics.median(x) for k, x in v.items()}
    peer = med.get("cuDNN SDPA") or med.get("torch SDPA") or med.get("mamba_ssm")
    f = lambda x: f"{x:8.2f}" if x else f"{'-':>8}"
    r = lambda x: f"{peer / x:7.3f}x" if x and peer else f"{'-':>8}"
    times = " ".join(f(med.get(x)) for x in sides)
    ratios = " ".join(r(med.get(x)) for x in sides)
    print(f"{s} {shape:<78} {times} {f(peer)} {ratios}")
EOF
grep -h "^FAILED" "$OUTDIR"/*.log | head -20
