#!/usr/bin/env bash
# Compile-check every shipped CUDA kernel (tasks/*/task.toml [backends.cuda] seeds and kernels,
# every tunable combination the constraints admit for the search workloads, or a sample of 40)
# and the CUDA back-end's device references with NVRTC for sm_90. Needs no GPU: only
# libnvrtc.so.13 (pip: nvidia-cuda-nvrtc) and the CUDA headers (pip: nvidia-cuda-runtime), which
# scripts/nvrtc-env.sh installs under target/.
# Used by CI. Extra arguments go to `ksearch nvrtc-check` (e.g. --task attention).
set -euo pipefail
cd "$(dirname "$0")/.."

# NVRTC from pip, under target/ (or in $PYTHON's environment): never in the system's Python.
CU13=$(bash scripts/nvrtc-env.sh)
export LD_LIBRARY_PATH="$CU13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KSEARCH_CUDA_INCLUDE="${KSEARCH_CUDA_INCLUDE:-$CU13/include}"
# The binary scripts/test.sh built ($KSEARCH_BIN), else the release build (the main job's).
if [[ -n ${KSEARCH_BIN:-} ]]; then
    exec "$KSEARCH_BIN" nvrtc-check "$@"
fi
exec cargo run -q --release -- nvrtc-check "$@"
