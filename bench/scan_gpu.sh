#!/usr/bin/env bash
# On the GPU machine: the selective scan's CUDA kernels against mamba_ssm's selective-scan forward
# on the five shapes of ANCHORS.md (bench/cuda_dev.py's `anchor` suite: every admitted
# configuration of SWEEP_KERNELS, the defaults of the others, the peer built and timed in the same
# process), then every element of the held-out and stress shapes (ragged L, L = 1, odd D, N = 8)
# checked near the defaults, then the stress shapes at the defaults under compute-sanitizer.
# Logs land in $OUT; a short table last. Fits a 10-minute call with the CUBINs prepared here:
#
# Here:   cp -r <mamba_ssm peer sources> .peer/mamba_ssm   (ignored; see bench/README.md)
#         SCAN_PREPARE=1 bash bench/scan_gpu.sh             (NVRTC into .scan-cubins, no GPU)
# There:  bash bench/scan_gpu.sh                            (carry .peer and .scan-cubins)
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-/tmp/scan-gpu}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 MAX_JOBS=${MAX_JOBS:-16} KS_CUBIN_DIR=${KS_CUBIN_DIR:-$PWD/.scan-cubins}
# FIX=NAME=a|b,... limits the sweep to those tunable values (";" between alternatives); CHECK_FIX
# does the same for the held-out and stress checks, MEMCHECK_FIX for compute-sanitizer's run (the
# defaults otherwise); CHECK_DIST, the stress configurations checked.
# SKIP_MEMCHECK=1 skips compute-sanitizer. seg_scan's one-call comparison: bench/scan_seg_gpu.sh;
# the MLX twin (pipe_scan as a whole CUDA unit) against this back-end: bench/scan_mlx.sh.
SWEEP_KERNELS=${SWEEP_KERNELS:-pipe_scan}
OTHERS=${OTHERS:-seq_scan=1,chunked_scan=1}
CHECK_CFG=${CHECK_CFG:-4}
mode=run
[ "${SCAN_PREPARE:-0}" = 1 ] && mode=prepare
KS_FIX=${FIX:-} KS_SUITES=anchor KS_KERNELS=$SWEEP_KERNELS,${OTHERS//=1/} KS_MAXCFG="$OTHERS" \
    python3 bench/cuda_dev.py $mode mamba_scan > "$OUTDIR/scan_anchor.log" 2>&1
echo "anchor: exit $?"; grep -E "^prepare|peer ready|^==== checked|^FAILED" "$OUTDIR/scan_anchor.log"
grep -A16 "==== summary" "$OUTDIR/scan_anchor.log" | grep -v chunked_scan; grep -A14 "^==== one configuration" "$OUTDIR/scan_anchor.log"
KS_FIX=${CHECK_FIX:-} KS_SUITES=heldout,stress KS_KERNELS=$SWEEP_KERNELS KS_MAXCFG=$CHECK_CFG KS_STRESS_DIST=${CHECK_DIST:-1} \
    python3 bench/cuda_dev.py $mode mamba_scan > "$OUTDIR/scan_check.log" 2>&1
echo "check: exit $?"; grep -A3 "^==== checked" "$OUTDIR/scan_check.log"; grep -A12 "==== summary" "$OUTDIR/scan_check.log"
if [ $mode = run ] && [ "${SKIP_MEMCHECK:-0}" != 1 ] && command -v compute-sanitizer >/dev/null; then
    KS_SUITES=stress KS_TIME=0 KS_STRESS_DIST=0 KS_KERNELS=$SWEEP_KERNELS \
        KS_FIX=${MEMCHECK_FIX:-} compute-sanitizer --tool memcheck python3 bench/cuda_dev.py run mamba_scan > "$OUTDIR/scan_memcheck.log" 2>&1
    echo "memcheck: exit $?"; grep -E "ERROR SUMMARY|^==== checked" "$OUTDIR/scan_memcheck.log" | tail -n 3
fi
