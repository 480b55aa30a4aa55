#!/usr/bin/env bash
# On the GPU machine, one call: seg_scan (tasks/mamba_scan/cuda/seg_scan.cu) against mamba_ssm's
# selective-scan forward on the five anchor shapes (bench/cuda_dev.py's anchor suite: every
# configuration FIX admits, pipe_scan's PIPE_CFG configurations nearest its defaults, the peer built
# and timed in the same process), and its held-out / ragged / stress shapes checked on every element
# near the defaults. The peer is built in the background while the checks run. PEER=0: no peer
# (read the anchor sweep's pipe_scan times against an earlier call's pipe_scan / mamba_ssm table).
#
# Here:   SCAN_PREPARE=1 PIPE_CFG=8 bash bench/scan_seg_gpu.sh   (NVRTC into .scan-cubins-seg, no GPU)
# There:  PIPE_CFG=8 bash bench/scan_seg_gpu.sh                   (carry .peer and .scan-cubins-seg)
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-/tmp/scan-seg}
mkdir -p "$OUTDIR"
export OUT=$OUTDIR PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} KS_CUBIN_DIR=${KS_CUBIN_DIR:-$PWD/.scan-cubins-seg}
MODE=run
[ "${SCAN_PREPARE:-0}" = 1 ] && { MODE=prepare; PEER=0; }
FIX=${FIX:-CB=16,POLY=0,PACK=1,MINSEG=128,BLK=256|512|1024,FSL=4}
echo "start $(date -u '+%F %T') UTC; FIX=$FIX"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader || true
if [ "${PEER:-1}" = 1 ]; then
    (cd .peer/mamba_ssm && python3 -c 'import time, peer; t = time.time(); peer.build(); print(f"peer built in {time.time() - t:.0f} s")') \
        > "$OUTDIR/peer_build.log" 2>&1 &
    PEER_PID=$!
else
    export KS_MAMBA_PEER=/nonexistent
fi
# The held-out, ragged and stress shapes near the defaults (no peer needed).
run_check() {
    KS_SUITES=heldout,stress KS_KERNELS=seg_scan KS_MAXCFG=${CHECK_CFG:-2} KS_STRESS_DIST=${CHECK_DIST:-1} \
        python3 bench/cuda_dev.py $MODE mamba_scan > "$OUTDIR/scan_check.log" 2>&1
    echo "check: exit $?"; grep -A3 "^==== checked" "$OUTDIR/scan_check.log"; grep -A8 "==== summary" "$OUTDIR/scan_check.log"
}
run_anchor() {
    KS_FIX=$FIX KS_SUITES=anchor KS_KERNELS=seg_scan,pipe_scan KS_MAXCFG=pipe_scan=${PIPE_CFG:-1} \
        python3 bench/cuda_dev.py $MODE mamba_scan > "$OUTDIR/scan_anchor.log" 2>&1
    echo "anchor: exit $?"; grep -E "peer ready|^==== checked|^FAILED" "$OUTDIR/scan_anchor.log"
    grep -A16 "==== summary" "$OUTDIR/scan_anchor.log"; grep -A8 "^==== one configuration" "$OUTDIR/scan_anchor.log"
}
if [ -n "${PEER_PID:-}" ]; then  # the checks while the peer builds
    run_check
    wait $PEER_PID; tail -n 2 "$OUTDIR/peer_build.log"
    run_anchor
else
    run_anchor
    run_check
fi
echo "end $(date -u '+%F %T') UTC"
