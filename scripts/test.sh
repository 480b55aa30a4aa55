#!/usr/bin/env bash
# Every test of ksearch, with what they need installed first. Needs only the Rust toolchain,
# a C++ compiler and Python 3 with pip; no GPU (GPU tests live in scripts/gpu-tests.sh and
# skip themselves here). Python packages go into a virtual environment under target/, never
# into the system's Python; a test whose prerequisite is missing fails here instead of skipping
# (KSEARCH_REQUIRE_MLX, KSEARCH_REQUIRE_NVRTC).
#   1. NVRTC compile check of every shipped CUDA kernel (pip's nvidia-cuda-nvrtc, no GPU);
#   2. cargo test: unit, property, snapshot and integration tests (the real binary, real
#      compiler, real workers, real SQLite, local HTTP servers for the LLM paths; the
#      `export --torch` modules compiled with that NVRTC);
#   3. the Linux-side check of every Metal kernel source (rules + syntax with a shim header);
#   4. the MLX worker's own tests (python/tests, on MLX's CPU back-end).
# The MLX worker runs from a virtual environment made by scripts/mlx-venv.sh (MLX's CPU
# back-end); the Rust tests that drive it use it through KSEARCH_PYTHON.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never INSTA_UPDATE=no

echo "== MLX environment (CPU back-end) =="
KSEARCH_PYTHON=$(bash scripts/mlx-venv.sh)
export KSEARCH_PYTHON KSEARCH_REQUIRE_MLX=1

# pip's NVRTC in the same environment (never the system's Python); every test that compiles
# CUDA finds it through these variables and fails, rather than skips, without it.
echo "== NVRTC (pip, in the test environment) =="
CU13=$(PYTHON=$KSEARCH_PYTHON bash scripts/nvrtc-env.sh)
export LD_LIBRARY_PATH="$CU13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" KSEARCH_CUDA_INCLUDE="$CU13/include"
export KSEARCH_REQUIRE_NVRTC=1
echo "== NVRTC compile check of the CUDA kernels =="
PYTHON=$KSEARCH_PYTHON bash scripts/nvrtc-check.sh
echo "== NVRTC compile check of the hostile CUDA fixtures (run on the GPU by scripts/hostile-suite.py) =="
PYTHON=$KSEARCH_PYTHON bash scripts/nvrtc-check.sh --tasks-dir crates/cli/tests/fixtures --task hostile

# The report's browser check (crates/cli/tests/report.rs, scripts/browser-check.py): Playwright
# in the test environment, driving Debian's Chromium (Playwright's own browser download is not used).
echo "== Browser check: Playwright and Chromium =="
"$KSEARCH_PYTHON" -m pip install -q playwright==1.65.2
if [[ ! -x /usr/bin/chromium ]]; then
    if [[ $(id -u) -eq 0 ]]; then
        apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium
    else
        echo "error: /usr/bin/chromium is missing: install Debian's chromium package (sudo apt-get install chromium), then run this again" >&2
        exit 2
    fi
fi
export KSEARCH_REQUIRE_BROWSER=1

echo "== cargo test =="
cargo test --workspace --no-fail-fast
echo "== Slurm launcher on a one-node Slurm (slurm-wlm, munge) =="
KSEARCH_REQUIRE_SLURM=1 bash scripts/slurm-test.sh

if [[ -x scripts/check-metal.sh ]] || [[ -f scripts/check-metal.sh ]]; then
    echo "== Metal sources: rules and syntax =="
    bash scripts/check-metal.sh
fi
echo "== MLX worker tests (pytest, MLX CPU back-end) =="
(cd python && "$KSEARCH_PYTHON" -m pytest -q tests)

echo "all checks passed"
