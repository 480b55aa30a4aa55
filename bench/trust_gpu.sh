#!/usr/bin/env bash
# The evaluation's trust boundary on the GPU machine, in one call:
#   1. the adversarial suite for CUDA (scripts/hostile-suite.py: every hostile kernel through
#      `ksearch bench` and one `ksearch run`, each against crates/cli/tests/fixtures/hostile/expect.toml);
#   2. the CUDA back-end's fault tests (crash, time-out, launch, out-of-bounds, unwritten,
#      compile) and device references, with the supervisor recovering;
#   3. shipped kernels' speed-ups through the binary before the change and the one after,
#      interleaved (bench/judge_compare.sh), to show honest kernels are not slowed.
# Prepare here (no Rust on the GPU machine):
#   scripts/gpu-tests.sh --build; cp target/release/ksearch .gpu/
#   cp OLD_RELEASE_BINARY .gpu/ksearch-old; cp -r OLD_CHECKOUT/tasks .gpu/tasks-old
# then on the device (carry [".gpu"]):  bash bench/trust_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
date -u
echo "== 1. hostile suite (cuda)"
python3 scripts/hostile-suite.py --backend cuda --ksearch .gpu/ksearch
echo "== 2. CUDA fault tests"
.gpu/cuda_gpu --include-ignored --skip worker_main --test-threads=1 --nocapture \
    bad_kernels_are_classified self_started_worker device_references_match 2>&1 | grep -vE "^\s*$" | tail -25
if [[ -x .gpu/ksearch-old && -d .gpu/tasks-old ]]; then
    echo "== 3. before / after (same tasks, interleaved)"
    bash bench/judge_compare.sh .gpu/ksearch-old .gpu/ksearch cuda .gpu/tasks-old "${ROUNDS:-2}"
fi
