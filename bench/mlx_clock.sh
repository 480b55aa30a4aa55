#!/usr/bin/env bash
# On the GPU machine (MLX CUDA back-end): the MLX worker's GPU clock (python/ksearch_mlx/gpuclock.py)
# against the host clock it replaced and against the CUDA back-end's events, on the same kernels,
# in one call:
#   1. the clock's GPU test (calls run one after the other, never side by side);
#   2. `ksearch bench` of mamba_step's vec_step (a few-microsecond decode step) and attention's
#      flash_ws against their seeds: --backend cuda (CUDA events), --backend mlx (GPU clock) and
#      --backend mlx with KSEARCH_MLX_CLOCK=host (the host clock, CUDA graphs on);
#   3. a search of mamba_step on --backend mlx (bench/mlx_step.sh), ranked on the GPU clock;
#   4. flash_ws against mx.fast.scaled_dot_product_attention through the MLX worker
#      (bench/mlx_attention.py's judge lines: both timed by the worker's judge);
#   5. the MLX GPU tests (python/tests/test_gpu.py), with the worker's CUDA graphs off.
#
# Here:   cargo build --release && mkdir -p .gpu && strip -o .gpu/ksearch target/release/ksearch
#         pip download -d .gpu/wheels pytest --python-version 3.12 --only-binary=:all:   (pytest, if absent there)
#         (and stage MLX: bench/mlx_gpu.sh's header)
# There:  call 1, carry [".mlx-a"]:          mkdir -p /tmp/mlx && cp .mlx-a/* /tmp/mlx/
#         call 2, carry [".mlx-b", ".gpu"]:  cp .mlx-b/* /tmp/mlx/ && bash /tmp/mlx/install.sh && bash bench/mlx_clock.sh
# Environment: BIN (.gpu/ksearch), STEP_BUDGET (60s), SKIP_CUDA=1, SKIP_HOST=1, SKIP_ATT_JUDGE=1, SKIP_GPU_TESTS=1,
#              GPU_TESTS_K (a pytest -k expression for step 5).
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.gpu/ksearch}
export KSEARCH_PYTHON=${KSEARCH_PYTHON:-python3} PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
say() { echo; echo "######## [${SECONDS}s] $*"; }
date -u +"%F %T UTC"
nvidia-smi --query-gpu=name,clocks.sm,driver_version --format=csv,noheader
python3 -c 'import mlx.core as mx; print("mlx", mx.__version__, mx.default_device())'

python3 -c 'import pytest' 2>/dev/null || { [ -d .gpu/wheels ] && python3 -m pip install -q --no-index .gpu/wheels/*.whl; }

say "1. the GPU clock's test"
timeout 120 python3 -m pytest -q -p no:cacheprovider python/tests/test_gpuclock.py -k gpu_clock 2>&1 | tail -4

bench() {  # task kernel-file like backend [env...]
    local task=$1 file=$2 like=$3 backend=$4
    shift 4
    say "bench $task $like on $backend ${*:-}"
    env "$@" timeout 150 "$BIN" bench "$task" "$file" --backend "$backend" --like "$like" 2>&1 | tail -n 12
}
[ "${SKIP_CUDA:-0}" = 1 ] || bench mamba_step tasks/mamba_step/cuda/vec_step.cu vec_step cuda
bench mamba_step tasks/mamba_step/mlx/vec_step.cu vec_step mlx
[ "${SKIP_HOST:-0}" = 1 ] || bench mamba_step tasks/mamba_step/mlx/vec_step.cu vec_step mlx KSEARCH_MLX_CLOCK=host
[ "${SKIP_CUDA:-0}" = 1 ] || bench attention tasks/attention/cuda/flash_ws.cu flash_ws cuda
bench attention tasks/attention/cuda/flash_ws.cu flash_ws mlx
[ "${SKIP_HOST:-0}" = 1 ] || bench attention tasks/attention/cuda/flash_ws.cu flash_ws mlx KSEARCH_MLX_CLOCK=host

say "3. mamba_step search on --backend mlx (GPU clock)"
STEP_BUDGET=${STEP_BUDGET:-60s} BIN=$BIN timeout 200 bash bench/mlx_step.sh 2>&1 | tail -n 45

if [ "${SKIP_ATT_JUDGE:-0}" != 1 ]; then
    say "4. flash_ws vs MLX SDPA through the MLX worker (GPU clock)"
    KS_ATT_KERNEL=flash_ws timeout 150 python3 bench/mlx_attention.py --variants default 2>&1 | grep -E "^judge|^kernel|^default|^==|^--" | tail -n 30
fi

if [ "${SKIP_GPU_TESTS:-0}" != 1 ]; then
    say "5. MLX GPU tests"
    KSEARCH_BIN=$BIN timeout 200 python3 -m pytest -q -p no:cacheprovider python/tests/test_gpu.py ${GPU_TESTS_K:+-k "$GPU_TESTS_K"} 2>&1 | tail -n 8
fi
say "done"
