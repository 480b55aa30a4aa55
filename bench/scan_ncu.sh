#!/usr/bin/env bash
# On the GPU machine: Nsight Compute on scan kernels at the five anchor shapes (one checked launch
# per shape, no timing, no peer): throughput, pipe utilisation, shared-memory wavefronts, scheduler
# and warp-state statistics with the cycles per issued instruction by stall reason, to see what
# binds a kernel rather than guess it. Text reports land in $OUT.
#
# PROFILE is a ';'-separated list of kernel:FIX, FIX as bench/cuda_dev.py's KS_FIX (one
# configuration each, the one nearest the defaults that FIX admits), e.g.
#   PROFILE="mma_scan:PK=1;pipe_scan:SPT=1,CHUNK=128,PACK=1,SWZ=0"
# SOURCE=1 adds the SourceCounters section and writes, per item, the report (ncu_<item>.ncu-rep) and its
# source page as CSV (ncu_<item>_sass.csv: executed instructions, stall samples and shared-memory
# wavefronts per SASS instruction), to see where in the code the issue slots and the stalls go
# (bench/ncu_source.py cuts it into regions and sums them).
# Here:   SCAN_PREPARE=1 PROFILE=... bash bench/scan_ncu.sh   (NVRTC into .scan-cubins, no GPU)
# There:  PROFILE=... bash bench/scan_ncu.sh                  (carry .scan-cubins)
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-/tmp/scan-ncu}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 KS_CUBIN_DIR=${KS_CUBIN_DIR:-$PWD/.scan-cubins} KS_MAMBA_PEER=/nonexistent
export KS_TIME=0 KS_SUITES=${SUITES:-anchor} KS_MAXCFG=1 KS_HELDOUT=0
SECTIONS=${SECTIONS:-SpeedOfLight ComputeWorkloadAnalysis MemoryWorkloadAnalysis MemoryWorkloadAnalysis_Tables SchedulerStats WarpStateStats InstructionStats Occupancy LaunchStats}
# where the warps wait: cycles per issued instruction by stall reason (STALLS=0 leaves them out)
STALL_METRICS=
if [ "${STALLS:-1}" = 1 ]; then
    for r in barrier branch_resolving dispatch_stall drain imc_miss lg_throttle long_scoreboard math_pipe_throttle \
             membar mio_throttle misc no_instruction not_selected selected short_scoreboard sleeping tex_throttle wait; do
        STALL_METRICS+=${STALL_METRICS:+,}smsp__average_warp_latency_issue_stalled_${r}.ratio
    done
fi
IFS=';' read -ra ITEMS <<< "${PROFILE:?PROFILE=kernel:FIX;...}"
for item in "${ITEMS[@]}"; do
    kern=${item%%:*}
    fix=${item#*:}
    [ "$fix" = "$item" ] && fix=
    tag=$(echo "$item" | tr -c 'A-Za-z0-9_\n' '_')
    if [ "${SCAN_PREPARE:-0}" = 1 ]; then
        KS_KERNELS=$kern KS_FIX=$fix python3 bench/cuda_dev.py prepare mamba_scan | grep -E "^prepare"
        continue
    fi
    args=()
    for s in $SECTIONS; do args+=(--section "$s"); done
    [ -n "$STALL_METRICS" ] && args+=(--metrics "$STALL_METRICS")
    [ "${SOURCE:-0}" = 1 ] && args+=(--section SourceCounters --import-source no -f -o "$OUTDIR/ncu_$tag")
    KS_KERNELS=$kern KS_FIX=$fix ncu -k regex:mamba_scan -c "${COUNT:-5}" "${args[@]}" \
        python3 bench/cuda_dev.py run mamba_scan > "$OUTDIR/ncu_$tag.txt" 2>&1
    echo "$item: exit $? ($OUTDIR/ncu_$tag.txt)"
    if [ "${SOURCE:-0}" = 1 ]; then
        ncu -i "$OUTDIR/ncu_$tag.ncu-rep" --page details >> "$OUTDIR/ncu_$tag.txt" 2>&1
        ncu -i "$OUTDIR/ncu_$tag.ncu-rep" --page source --csv --print-source sass > "$OUTDIR/ncu_${tag}_sass.csv" 2>&1
        echo "  source page: exit $? ($(wc -l < "$OUTDIR/ncu_${tag}_sass.csv") lines)"
    fi
    grep -E "^==== checked|Duration|Issue Slots Busy|No Eligible|Active Warps Per Scheduler|Eligible Warps Per Scheduler|stalled|Shared|Executed Instructions" "$OUTDIR/ncu_$tag.txt" | head -60
done
