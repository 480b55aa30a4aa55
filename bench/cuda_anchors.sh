#!/usr/bin/env bash
# On the GPU machine, one call: the CUDA back-end's default attention kernel (flash_ws) against
# cuDNN's SDPA on the anchor, held-out and `long` shapes (ROUNDS passes, every element of every run
# checked, CUDA events with L2 flushed, medians), then the scan's default kernel (tw_scan) against
# mamba_ssm's selective-scan forward on the five anchor shapes (built from its sources here),
# held-out and stress shapes checked (bench/scan_gpu.sh). Logs in $OUT; a short table last.
# SKIP_SCAN=1: the attention part only; ROUNDS (default 2): attention passes; ATT_SUITES (default anchor,heldout,long).
# Here:   ANCHORS_PREPARE=1 bash bench/cuda_anchors.sh   (NVRTC into .att-cubins and .scan-cubins-tw)
# There:  bash bench/cuda_anchors.sh                      (carry .att-cubins, .scan-cubins-tw, .peer)
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-/tmp/cuda-anchors}
mkdir -p "$OUTDIR"
ROUNDS=${ROUNDS:-2}
ATT_FIX=${ATT_FIX:-BLOCK_N=128,STAGES=3,KVS=0,WIDE=1,SMALL_L=1,EMU=0,DA=0,TMA_MIN=0,OV=1,MC=0}
C="HS=1,XR=1,CV=1,YP=1,YS=1,YD=1,MB=0,HO=0,A1=0,CF=1"
SCAN_FIX=${SCAN_FIX:-$C,LM=1,G=4,K=16,W=8,DW=0,SL=3,YL=0,AO=1}
att() {  # att prepare|run [timeout seconds]
    KS_CUBIN_DIR=$PWD/.att-cubins KS_BACKENDS=cuda KS_KERNELS=flash_ws KS_MAXCFG=1 \
        KS_SUITES=${ATT_SUITES:-anchor,heldout,long} KS_TIME=1 KS_FIX=$ATT_FIX \
        timeout "${2:-600}" python3 bench/cuda_dev.py "$1" attention
}
scan() {
    KS_CUBIN_DIR=$PWD/.scan-cubins-tw SWEEP_KERNELS=tw_scan OTHERS=warp_scan=1 FIX=$SCAN_FIX CHECK_FIX=$SCAN_FIX \
        MEMCHECK_FIX=$SCAN_FIX OUT=$OUTDIR bash bench/scan_gpu.sh
}
if [ "${ANCHORS_PREPARE:-0}" = 1 ]; then
    att prepare | grep -E "^prepare"
    SCAN_PREPARE=1 scan
    exit 0
fi
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,power.limit --format=csv,noheader
date -u +"%F %H:%M UTC"
# The SM clock and the board's power every 50 ms during the attention passes (a kernel held below its
# clock by the power cap shows here, not in its time alone).
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv,noheader -lms 50 \
    > "$OUTDIR/attention-clocks.csv" 2>&1 &
SMI=$!
for r in $(seq 1 "$ROUNDS"); do
    PYTHONUNBUFFERED=1 att run 200 > "$OUTDIR/attention-$r.log" 2>&1
    echo "attention pass $r: exit $? $(grep -E '^==== checked' "$OUTDIR/attention-$r.log" || echo 'no summary')"
done
kill $SMI 2>/dev/null
python3 - "$OUTDIR/attention-clocks.csv" <<'PY'
import sys
rows = []
for line in open(sys.argv[1]):
    f = [x.strip() for x in line.split(",")]
    try:
        rows.append((float(f[1].split()[0]), float(f[2].split()[0])))
    except (IndexError, ValueError):
        pass
busy = [r for r in rows if r[1] > 300]  # samples while a kernel drew real power
if busy:
    cl = sorted(r[0] for r in busy); pw = sorted(r[1] for r in busy)
    print(f"clocks while drawing > 300 W: {len(busy)} samples, SM clock min {cl[0]:.0f} median {cl[len(cl)//2]:.0f} "
          f"max {cl[-1]:.0f} MHz, power median {pw[len(pw)//2]:.0f} max {pw[-1]:.0f} W")
else:
    print(f"clocks: {len(rows)} samples, none above 300 W")
PY
python3 - "$OUTDIR" "$ROUNDS" <<'PY'
import re, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
rx = re.compile(r"attention\s+(\w) (\{.*?\})\s+(?:peer (cuDNN SDPA|torch SDPA)|(\S+))\s+([\d.]+|nan) us")
t = {}
for r in range(1, rounds + 1):
    try:
        lines = open(f"{out}/attention-{r}.log").read().splitlines()
    except OSError:
        continue
    for line in lines:
        m = rx.match(line)
        if m and m.group(5) != "nan":
            t.setdefault((m.group(1), m.group(2)), {}).setdefault(m.group(3) or "flash_ws", []).append(float(m.group(5)))
print(f"{'suite shape':<80} {'flash_ws':>9} {'peer':>9} {'ratio':>7}  (medians over passes; ratio = peer / flash_ws)")
for (s, shape), v in t.items():
    med = {k: statistics.median(x) for k, x in v.items()}
    peer = med.get("cuDNN SDPA") or med.get("torch SDPA")
    a = med.get("flash_ws")
    if a and peer:
        print(f"{s} {shape:<78} {a:9.2f} {peer:9.2f} {peer / a:6.3f}x")
PY
grep -h "^FAILED" "$OUTDIR"/attention-*.log | head -20
[ "${SKIP_SCAN:-0}" = 1 ] || scan
