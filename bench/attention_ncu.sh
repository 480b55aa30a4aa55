#!/usr/bin/env bash
# On the GPU machine: Nsight Compute on an attention kernel of tasks/attention ([backends.cuda]) and
# on cuDNN's SDPA at the anchor shapes (bench/cuda_dev.py's KS_SUITES=anchor: 4,32,32,2048,128 without
# and with the causal mask first): throughput, pipe utilisation, scheduler and warp-state (stall)
# statistics of the first COUNT launches of each, with the cycles per issued instruction by stall
# reason, to compare what binds the two.
# Here:   ATT_PREPARE=1 KERNEL=flash_ws FIX=... bash bench/attention_ncu.sh  (NVRTC into .att-cubins)
# There:  KERNEL=flash_ws FIX=... bash bench/attention_ncu.sh                 (carry .att-cubins)
# FIX as bench/cuda_dev.py's KS_FIX (default: the task.toml defaults); SECTIONS (ncu sections), STALLS=0 (without
# the stall reasons), METRICS (more metrics by name, comma-separated). Text reports land in $OUT.
# SOURCE=1 (the kernel only, cuDNN skipped) adds the SourceCounters section and writes the report
# (ncu_kernel.ncu-rep) and its source page as CSV (ncu_kernel_sass.csv: executed instructions and stall
# samples by reason per SASS instruction), for bench/ncu_source.py: where the consumers' warps wait.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-/tmp/attention-ncu}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 KS_CUBIN_DIR=${KS_CUBIN_DIR:-$PWD/.att-cubins}
export KS_SUITES=anchor KS_MAXCFG=1 KS_HELDOUT=0 KS_BACKENDS=cuda KS_KERNELS=${KERNEL:-flash_ws} KS_FIX=${FIX:-}
if [ "${ATT_PREPARE:-0}" = 1 ]; then
    python3 bench/cuda_dev.py prepare attention | grep -E "^prepare"
    exit 0
fi
SECTIONS=${SECTIONS:-SpeedOfLight ComputeWorkloadAnalysis MemoryWorkloadAnalysis SchedulerStats WarpStateStats InstructionStats Occupancy LaunchStats}
args=()
for s in $SECTIONS; do args+=(--section "$s"); done
# where the warps wait: cycles per issued instruction by stall reason (STALLS=0 leaves them out)
if [ "${STALLS:-1}" = 1 ]; then
    m=
    for r in barrier branch_resolving dispatch_stall drain imc_miss lg_throttle long_scoreboard math_pipe_throttle \
             membar mio_throttle misc no_instruction not_selected selected short_scoreboard sleeping tex_throttle wait; do
        m+=${m:+,}smsp__average_warp_latency_issue_stalled_${r}.ratio
    done
    args+=(--metrics "$m")
fi
# METRICS: more metrics by name (comma-separated), e.g. L2 sectors and requests by source and operation
[ -n "${METRICS:-}" ] && args+=(--metrics "$METRICS")
KEYS="stalled|Duration|SM Frequency|Compute \(SM\) Throughput|Memory Throughput|Issue Slots Busy|Issued Ipc Active|No Eligible|Active Warps Per Scheduler|Eligible Warps Per Scheduler|Registers Per Thread|Achieved Occupancy|Stall|Tensor"
# the kernel alone (checked launches, no timing, no peer)
src=()
[ "${SOURCE:-0}" = 1 ] && src=(--section SourceCounters --import-source no -f -o "$OUTDIR/ncu_kernel")
KS_TIME=0 ncu -k regex:attention -c "${COUNT:-2}" "${args[@]}" "${src[@]}" python3 bench/cuda_dev.py run attention \
    > "$OUTDIR/ncu_kernel.txt" 2>&1
echo "kernel: exit $? ($OUTDIR/ncu_kernel.txt)"
if [ "${SOURCE:-0}" = 1 ]; then
    ncu -i "$OUTDIR/ncu_kernel.ncu-rep" --page details >> "$OUTDIR/ncu_kernel.txt" 2>&1
    ncu -i "$OUTDIR/ncu_kernel.ncu-rep" --page source --csv --print-source sass > "$OUTDIR/ncu_kernel_sass.csv" 2>&1
    echo "  source page: exit $? ($(wc -l < "$OUTDIR/ncu_kernel_sass.csv") lines)"
    rm -f "$OUTDIR/ncu_kernel.ncu-rep"
fi
grep -E "$KEYS" "$OUTDIR/ncu_kernel.txt" | head -80
[ "${SOURCE:-0}" = 1 ] && exit 0
# cuDNN's SDPA, the peer bench/cuda_dev.py times (its first launches: the first anchor shape)
ncu -k regex:sdpa -c "${COUNT:-2}" "${args[@]}" python3 bench/cuda_dev.py run attention \
    > "$OUTDIR/ncu_cudnn.txt" 2>&1
echo "cudnn: exit $? ($OUTDIR/ncu_cudnn.txt)"
grep -E "$KEYS" "$OUTDIR/ncu_cudnn.txt" | head -80
