#!/usr/bin/env bash
# GPU tests of the CUDA back-end: device references against the host f64 references, their
# speed at scale, bad kernels (crash / timeout / launch / out-of-bounds / unwritten / compile)
# classified with the supervisor recovering, and the shipped CUDA kernels on their search
# workloads. Run it on the GPU machine from the repository root.
#
# With Rust there:     scripts/gpu-tests.sh
# Without Rust there (the lent machine): build here and carry the test binaries:
#     echo /.gpu/ >> .git/info/exclude; scripts/gpu-tests.sh --build   # fills .gpu/
#     then on the device (carry [".gpu"]):  scripts/gpu-tests.sh
# Without a CUDA device (or NVRTC) the tests fail: this script is for the GPU machine
# (KSEARCH_REQUIRE_CUDA=0 KSEARCH_REQUIRE_NVRTC=0 lets them skip instead).
set -euo pipefail
cd "$(dirname "$0")/.."
export KSEARCH_REQUIRE_CUDA=${KSEARCH_REQUIRE_CUDA:-1} KSEARCH_REQUIRE_NVRTC=${KSEARCH_REQUIRE_NVRTC:-1}
TESTS=(cuda_gpu cuda_nvrtc)

if [[ "${1:-}" == "--build" ]]; then
    mkdir -p .gpu
    for t in "${TESTS[@]}"; do
        exe=$(cargo test --release -p ksearch-eval --test "$t" --no-run --message-format=json 2>/dev/null |
            sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
        [[ -n "$exe" ]] || { echo "cannot build test $t" >&2; exit 1; }
        cp "$exe" ".gpu/$t"
    done
    if [[ -x target/release/ksearch ]]; then cp target/release/ksearch .gpu/; fi
    ls -la .gpu
    exit 0
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
status=0
if [[ -x .gpu/cuda_gpu ]]; then
    for t in "${TESTS[@]}"; do
        echo "== $t"
        ".gpu/$t" --include-ignored --skip worker_main --test-threads=1 --nocapture "$@" || status=1
    done
else
    cargo test --release -p ksearch-eval --test cuda_gpu --test cuda_nvrtc -- \
        --include-ignored --skip worker_main --test-threads=1 --nocapture "$@" || status=1
fi
exit $status
