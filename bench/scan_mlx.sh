#!/usr/bin/env bash
# On the GPU machine, with MLX's CUDA back-end: the scan's MLX twin, tasks/mamba_scan/cuda/pipe_scan.cu as
# [backends.mlx-cuda] registers it (a whole CUDA unit, -DKS_AXIS=int, mx.fast.precompiled_cuda_kernel),
# against the same file and configuration on the CUDA back-end, both timed in one process on the five
# anchor shapes (bench/mlx_scan.py; KERNEL names another whole-unit kernel), then the module
# `ksearch export --mlx` would write for it (runtime + tail): its scan and its mlx-lm Mamba prefill
# patch against stock. Configurations: the TOP fastest per shape in SCAN_LOG (a bench/scan_gpu.sh
# anchor log) plus CONFIGS (';'-separated NAME=v,..., over the defaults; "default" = the defaults).
# MLX is staged in two halves, so two calls back to back (the machine keeps /tmp only while warm):
#   call 1, carry [".mlx-a", ".peer", ".scan-cubins"]:  mkdir -p /tmp/mlx && cp .mlx-a/* /tmp/mlx/ &&
#           bash bench/scan_gpu.sh && cp $OUT/scan_anchor.log /tmp/
#   call 2, carry [".mlx-b"]:  SCAN_LOG=/tmp/scan_anchor.log bash bench/scan_mlx.sh
# (On a machine where MLX is already importable, one call does.) First run: bench/h200-2026-12-04-mlx-scan-llama.txt.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-/tmp/scan-mlx}
mkdir -p "$OUTDIR"
export OUT=$OUTDIR PYTHONUNBUFFERED=1 PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
export KS_CUBIN_DIR=${KS_CUBIN_DIR:-$PWD/.scan-cubins}
if ! python3 -c 'import mlx.core' >/dev/null 2>&1; then
    if [ -d .mlx-b ] && ls /tmp/mlx/part_aa >/dev/null 2>&1; then
        cp .mlx-b/* /tmp/mlx/ && bash /tmp/mlx/install.sh > "$OUTDIR/mlx_install.log" 2>&1 || { tail -5 "$OUTDIR/mlx_install.log"; exit 1; }
    else
        echo "MLX is not importable and /tmp/mlx/part_aa or .mlx-b is missing (call 1 carries .mlx-a, call 2 .mlx-b)"; exit 1
    fi
fi
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader || true
python3 bench/mlx_scan.py --kernel "${KERNEL:-pipe_scan}" --pick "${SCAN_LOG:-/tmp/scan_anchor.log}" --top "${TOP:-2}" --configs "${CONFIGS:-default}" \
    ${EXPORT_CHECK:---export-check} 2>&1 | tee "$OUTDIR/mlx_scan.log" | grep -v "^\[" ; echo "mlx_scan: exit ${PIPESTATUS[0]}"
grep -E "export|ERROR|Traceback" "$OUTDIR/mlx_scan.log" | tail -n 6
