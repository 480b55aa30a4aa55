#!/usr/bin/env bash
# Compile-check every shipped CUDA kernel (tasks/*/task.toml [backends.cuda] seeds and kernels,
# every tunable combination the constraints admit for the search workloads, or a sample of 40)
# and the CUDA back-end's device references with NVRTC for sm_90. Needs no GPU: only
# libnvrtc.so.13 (pip: nvidia-cuda-nvrtc) and the CUDA headers (pip: nvidia-cuda-runtime).
# Used by CI. Extra arguments go to `ksearch nvrtc-check` (e.g. --task attention).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
site() { "$PY" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13"))' 2>/dev/null || true; }
CU13=$(site)
if [[ -z "$CU13" || ! -e "$CU13/lib/libnvrtc.so.13" || ! -e "$CU13/include/cuda_fp16.h" ]]; then
    echo "nvrtc-check: installing nvidia-cuda-nvrtc and nvidia-cuda-runtime 13.0 with pip" >&2
    "$PY" -m pip install -q "nvidia-cuda-nvrtc==13.0.*" "nvidia-cuda-runtime==13.0.*" >&2
    CU13=$(site)
fi
if [[ -z "$CU13" || ! -e "$CU13/lib/libnvrtc.so.13" ]]; then
    echo "nvrtc-check: libnvrtc.so.13 not found after pip install" >&2
    exit 2
fi
export LD_LIBRARY_PATH="$CU13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export KSEARCH_CUDA_INCLUDE="${KSEARCH_CUDA_INCLUDE:-$CU13/include}"
exec cargo run -q -- nvrtc-check "$@"
