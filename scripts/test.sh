#!/usr/bin/env bash
# Every test of ksearch, with what they need installed first. Needs only the Rust toolchain,
# a C++ compiler and Python 3 with pip; no GPU (GPU tests live in scripts/gpu-tests.sh).
# Python packages go into a virtual environment under target/, never into the system's Python;
# system packages (Debian's chromium, slurm-wlm, munge) are installed with apt-get when missing
# and this runs as root, otherwise it stops with a line saying what to install. A test whose
# prerequisite is missing fails here instead of skipping (KSEARCH_REQUIRE_*).
#
# One build profile for everything: release, the profile of the README's `cargo run --release`,
# so the tests and the main job share one build and the workers the tests start are the
# binary a user runs. The downloads (apt, pip) run while Rust compiles.
#   1. NVRTC compile check of every shipped CUDA kernel (pip's nvidia-cuda-nvrtc, no GPU), beside 2.;
#   2. the Rust tests: unit, property, snapshot and integration tests (the real binary, real
#      compiler, real workers, real SQLite, local HTTP servers for the LLM paths, the HTML
#      report in a headless Chromium; the `export --torch` modules compiled with that NVRTC),
#      through cargo-nextest where it is installed (every test binary at once), else cargo test;
#   3. the Slurm launcher on a one-node Slurm started here (scripts/slurm-test.sh);
#   4. the Linux-side check of every Metal kernel source (rules + syntax with a shim header);
#   5. the MLX worker's own tests (python/tests, on MLX's CPU back-end).
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TERM_COLOR=never INSTA_UPDATE=no
T0=$SECONDS
say() { printf '== [%dm%02ds] %s ==\n' $(((SECONDS - T0) / 60)) $(((SECONDS - T0) % 60)) "$*"; }
LOGS=target/test-setup
mkdir -p "$LOGS"

# --- downloads, in the background -------------------------------------------------------------
apt_pkgs=()
[[ -x /usr/bin/chromium ]] || apt_pkgs+=(chromium)
{ command -v slurmctld && command -v slurmd && command -v munged; } >/dev/null 2>&1 || apt_pkgs+=(slurm-wlm munge)
apt_pid=
if ((${#apt_pkgs[@]})); then
    if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
        echo "error: missing system packages: ${apt_pkgs[*]} (Debian: sudo apt-get install ${apt_pkgs[*]}), then run this again" >&2
        exit 2
    fi
    say "installing ${apt_pkgs[*]} (apt-get, in the background; log $LOGS/apt.log)"
    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${apt_pkgs[@]}") \
        >"$LOGS/apt.log" 2>&1 &
    apt_pid=$!
fi
# The test environment: MLX (CPU back-end) with mlx-lm and pytest (scripts/mlx-venv.sh), pip's
# NVRTC and CUDA headers (scripts/nvrtc-env.sh), Playwright for the browser check (it drives
# Debian's Chromium; its own browser download is not used), pip's cuobjdump and nvdisasm.
say "test environment: MLX, NVRTC, Playwright (in the background; log $LOGS/python.log)"
(
    set -e
    py=$(bash scripts/mlx-venv.sh)
    cu13=$(PYTHON=$py bash scripts/nvrtc-env.sh)
    "$py" -m pip install -q --disable-pip-version-check playwright==1.65.2
    # cuobjdump and nvdisasm for bench/sass_census.py's test (the machine code of an NVRTC build)
    "$py" -m pip install -q --disable-pip-version-check nvidia-cuda-cuobjdump==13.5.37 nvidia-cuda-nvdisasm==13.5.37
    printf '%s\n%s\n' "$py" "$cu13" >"$LOGS/python.env"
) >"$LOGS/python.log" 2>&1 &
py_pid=$!

# --- the build ------------------------------------------------------------------------------------
say "build (release) of ksearch and every test"
# This also builds target/release/ksearch, the binary the integration tests run (a separate
# `cargo build -p ksearch` would compile it once more: cargo tells the two builds apart).
cargo test --release --workspace --no-run -q
export KSEARCH_BIN=$PWD/target/release/ksearch
[[ -x $KSEARCH_BIN ]] || { echo "error: the build did not produce $KSEARCH_BIN" >&2; exit 1; }

wait_for() { # pid what log
    if ! wait "$1"; then
        echo "error: $2 failed; the last lines of $3:" >&2
        tail -n 30 "$3" >&2
        exit 1
    fi
}
wait_for "$py_pid" "setting up the test environment" "$LOGS/python.log"
[[ -n $apt_pid ]] && wait_for "$apt_pid" "apt-get install ${apt_pkgs[*]}" "$LOGS/apt.log"
{ read -r KSEARCH_PYTHON; read -r CU13; } <"$LOGS/python.env"
say "test environment ready ($KSEARCH_PYTHON)"
export KSEARCH_PYTHON KSEARCH_REQUIRE_MLX=1
# Every test that compiles CUDA finds NVRTC through these variables and fails, rather than
# skips, without it; the browser check and the Slurm test likewise.
export LD_LIBRARY_PATH="$CU13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" KSEARCH_CUDA_INCLUDE="$CU13/include"
export KSEARCH_REQUIRE_NVRTC=1 KSEARCH_REQUIRE_BROWSER=1 KSEARCH_REQUIRE_SLURM=1

# The NVRTC checks run beside the Rust tests: those wait on processes, servers and clocks for
# part of their time, and the compiles fill it.
say "NVRTC compile check of the CUDA kernels and of the hostile CUDA fixtures (in the background; log $LOGS/nvrtc.log)"
(
    set -e
    # Every shipped kernel in its default configuration and an even sample of 20 others.
    PYTHON=$KSEARCH_PYTHON bash scripts/nvrtc-check.sh --max-configs 20
    # The hostile fixtures run on the GPU through scripts/hostile-suite.py.
    PYTHON=$KSEARCH_PYTHON bash scripts/nvrtc-check.sh --tasks-dir crates/cli/tests/fixtures --task hostile
) >"$LOGS/nvrtc.log" 2>&1 &
nvrtc_pid=$!

if cargo nextest --version >/dev/null 2>&1; then
    say "Rust tests (cargo nextest, release)"
    cargo nextest run --release --workspace --no-fail-fast --status-level fail --final-status-level slow
    # nextest does not run documentation tests; cargo does.
    cargo test --release --workspace --doc -q
else
    say "Rust tests (cargo test, release)"
    cargo test --release --workspace --no-fail-fast
fi

wait_for "$nvrtc_pid" "the NVRTC compile check" "$LOGS/nvrtc.log"
say "NVRTC: $(grep -h '^nvrtc-check:' "$LOGS/nvrtc.log" | tr '\n' ' ')"
say "Slurm launcher on a one-node Slurm (slurm-wlm, munge)"
bash scripts/slurm-test.sh
say "Metal sources: rules and syntax"
bash scripts/check-metal.sh
say "MLX worker tests (pytest, MLX CPU back-end)"
(cd python && "$KSEARCH_PYTHON" -m pytest -q tests)

say "all checks passed"
