"""On a machine where MLX has its CUDA back-end: real kernels, real JIT, real launches.
Skipped elsewhere (the rest of the suite covers the logic on the CPU)."""

import json
import os
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np
import pytest
from conftest import PYTHON_DIR, REPO, load_task, task_candidate

from ksearch_mlx import baselines, reference
from ksearch_mlx.data import as_f32, check_outputs, draw_inputs, poison_value
from ksearch_mlx.runtime import CompiledCandidate, tensor_dtype

pytestmark = pytest.mark.skipif(
    not (hasattr(mx, "cuda") and mx.cuda.is_available()), reason="needs MLX's CUDA back-end"
)

SOFTMAX = """
int row = blockIdx.x;
int lane = threadIdx.x;
const float* xr = x + (size_t)row * cols;
float m = -INFINITY;
for (int c = lane; c < cols; c += 32) m = fmaxf(m, xr[c]);
for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
float s = 0.0f;
for (int c = lane; c < cols; c += 32) s += expf(xr[c] - m);
for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffff, s, o);
for (int c = lane; c < cols; c += 32) y[(size_t)row * cols + c] = expf(xr[c] - m) / s;
"""

# Two launches through a scratch buffer, a header helper, the task constant and dynamic
# shared memory: per-row 1/rms into `inv`, then y = x * inv * w.
RMSNORM = """
__device__ inline float sq(float v) { return v * v; }
// @kernel row_inv
extern __shared__ float part[];
int row = blockIdx.x;
float acc = 0.0f;
for (int c = threadIdx.x; c < cols; c += blockDim.x) acc += sq(__half2float(x[(size_t)row * cols + c]));
part[threadIdx.x] = acc;
__syncthreads();
for (int k = blockDim.x / 2; k > 0; k >>= 1) {
  if (threadIdx.x < k) part[threadIdx.x] += part[threadIdx.x + k];
  __syncthreads();
}
if (threadIdx.x == 0) inv[row] = rsqrtf(part[0] / cols + KS_EPS);
// @kernel apply
size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
if (i < (size_t)rows * cols) {
  int row = i / cols, c = i % cols;
  y[i] = __float2half(__half2float(x[i]) * inv[row] * __half2float(w[c]));
}
"""


def softmax_candidate(body=SOFTMAX, block="32", shared="0"):
    return {
        "lang": "mlx_cuda",
        "source": body,
        "launches": [{"entry": "softmax", "grid": ["rows * 32", "1", "1"], "block": [block, "1", "1"], "shared": shared}],
        "scratch": [],
        "defines": {},
        "options": {},
    }


def rmsnorm_candidate():
    return {
        "lang": "mlx_cuda",
        "source": RMSNORM,
        "launches": [
            {"entry": "row_inv", "grid": ["rows * THREADS", "1", "1"], "block": ["THREADS", "1", "1"], "shared": "THREADS * 4", "inputs": ["x"], "outputs": ["inv"]},
            {"entry": "apply", "grid": ["rows * cols", "1", "1"], "block": ["256", "1", "1"], "shared": "0", "inputs": ["x", "w", "inv"]},
        ],
        "scratch": [{"name": "inv", "bytes": "rows * 4"}],
        "defines": {"THREADS": 128},
        "options": {},
    }


def run_and_check(task, candidate, axes, backend="mlx-cuda", seed=5):
    inputs = draw_inputs(task, backend, axes, seed)
    refs = reference.compute(task, as_f32(inputs), axes)
    cc = CompiledCandidate(candidate, task, backend)
    poison = poison_value([tensor_dtype(task, backend, t) for t in task["outputs"]])
    outs = cc(inputs, axes, init_value=poison)
    mx.eval(list(outs.values()))
    return check_outputs(task, backend, outs, refs, poison)


def test_softmax_kernel_runs_and_checks():
    check, failure = run_and_check(load_task("softmax"), softmax_candidate(), {"rows": 64, "cols": 1000})
    assert failure is None, failure
    assert check["elements"] == 64000


def test_two_launches_scratch_shared_memory_and_constants():
    check, failure = run_and_check(load_task("rmsnorm"), rmsnorm_candidate(), {"rows": 33, "cols": 777})
    assert failure is None, failure


def test_a_kernel_that_skips_rows_is_unwritten():
    body = SOFTMAX.replace("int row = blockIdx.x;", "int row = blockIdx.x;\nif (row % 2) return;")
    check, failure = run_and_check(load_task("softmax"), softmax_candidate(body), {"rows": 8, "cols": 64})
    assert failure["class"] == "unwritten" and check["unwritten"] == 4 * 64


def kernels_of(task_name):
    task = load_task(task_name)
    b = task.get("backends", {}).get("mlx-cuda")
    if not b:
        return []
    return [(task_name, "seed")] + [(task_name, k["name"]) for k in b.get("kernels", [])]


TASK_KERNELS = [c for t in ("softmax", "rmsnorm", "attention", "mamba_scan", "mamba_step") for c in kernels_of(t)]


@pytest.mark.parametrize("task_name, kernel", TASK_KERNELS)
def test_task_kernels_pass_on_their_first_search_workload(task_name, kernel):
    task = load_task(task_name)
    axes = task["backends"]["mlx-cuda"]["search"][0]
    check, failure = run_and_check(task, task_candidate(task, "mlx-cuda", kernel), axes)
    assert failure is None, failure


def test_references_and_baselines_are_fast_enough_at_search_sizes():
    report = {}
    for name in ("mamba_scan", "mamba_step", "attention", "softmax", "rmsnorm"):
        task = load_task(name)
        workloads = (task["backends"].get("mlx-cuda") or task["backends"]["cuda"])["search"]
        for axes in workloads:
            inputs = draw_inputs(task, "mlx-cuda", axes, 1)
            t = time.perf_counter()
            refs = reference.compute(task, as_f32(inputs), axes)
            t_ref = time.perf_counter() - t
            t = time.perf_counter()
            outs = baselines.BASELINES[name](inputs, axes, task.get("constants") or {})
            named = {s["name"]: o.astype(mx.float32) for s, o in zip(task["outputs"], outs)}
            mx.eval(list(named.values()))
            t_base = time.perf_counter() - t
            relaxed = json.loads(json.dumps(task))
            relaxed["tolerance"]["f32"] = relaxed["tolerance"]["f16"]
            _, failure = check_outputs(relaxed, "mlx-cuda", named, refs, None)
            report[f"{name} {axes}"] = (round(t_ref, 3), round(t_base, 3), failure)
            assert t_ref < 30, (name, axes, t_ref)
    print(json.dumps(report, indent=1))


def worker_proc():
    return subprocess.Popen(
        [sys.executable, "-m", "ksearch_mlx.worker", "--backend", "mlx-cuda"],
        cwd=PYTHON_DIR,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def ask(p, req):
    p.stdin.write(json.dumps(req) + "\n")
    p.stdin.flush()
    events = []
    while True:
        line = p.stdout.readline()
        assert line, p.stderr.read()
        m = json.loads(line)
        if m["reply"] != "progress":
            return events, m
        events.append(m["stage"])


TIMING = {"warmup": 2, "min_reps": 5, "max_reps": 30, "target_ms": 50.0, "flush": True}


def test_worker_end_to_end():
    p = worker_proc()
    hello = json.loads(p.stdout.readline())
    assert hello["kernels"] is True and "cuda" in hello["device"], hello
    task = load_task("softmax")
    ws = [{"label": "a", "axes": {"rows": 512, "cols": 4096}, "seed": 3}, {"label": "b", "axes": {"rows": 2048, "cols": 1024}, "seed": 4}]
    base = {"op": "eval", "task": task, "backend": "mlx-cuda", "workloads": ws, "timing": TIMING, "check_only": False}
    events, r = ask(p, {**base, "id": 1, "candidate": softmax_candidate()})
    assert events == ["compiled", "workload 1/2", "workload 2/2"], r
    assert r["failure"] is None and all(w["failure"] is None for w in r["workloads"]), r
    assert all(w["timing"]["reps"] >= 5 for w in r["workloads"])
    print("softmax eval", json.dumps(r["workloads"], indent=1), r["compile"])
    _, again = ask(p, {**base, "id": 2, "candidate": softmax_candidate()})
    assert again["compile"]["cached"] is True
    # Compile error: the log comes back.
    events, r = ask(p, {**base, "id": 3, "candidate": softmax_candidate("y[0] = ;")})
    assert r["failure"]["class"] == "compile" and "error" in r["compile"]["log"], r
    # More dynamic shared memory than the device has: the launch is refused.
    big = "extern __shared__ float big_smem[];\nbig_smem[threadIdx.x] = 0.0f;\n" + SOFTMAX
    _, r = ask(p, {**base, "id": 4, "candidate": softmax_candidate(big, shared="1000000")})
    print("too much shared memory:", json.dumps(r)[:2000])
    assert r["failure"] is None and r["workloads"][0]["failure"]["class"] == "launch", r
    # The worker still works afterwards.
    _, r = ask(p, {**base, "id": 5, "candidate": softmax_candidate(), "check_only": True})
    assert r["failure"] is None and all(w["failure"] is None for w in r["workloads"]), r
    # The baseline.
    events, r = ask(p, {"op": "baseline", "id": 6, "task": task, "backend": "mlx-cuda", "workloads": ws, "timing": TIMING})
    assert r["failure"] is None and all(w["timing"] for w in r["workloads"]), r
    print("softmax baseline", [w["timing"] for w in r["workloads"]])
    p.stdin.write('{"op":"shutdown"}\n')
    p.stdin.flush()
    assert p.wait(timeout=60) == 0


def test_a_faulting_kernel_ends_the_worker():
    p = worker_proc()
    json.loads(p.stdout.readline())
    task = load_task("softmax")
    body = "y[(size_t)1 << 40] = 1.0f;"
    req = {"op": "eval", "id": 1, "task": task, "backend": "mlx-cuda", "candidate": softmax_candidate(body), "workloads": [{"label": "a", "axes": {"rows": 4, "cols": 32}, "seed": 1}], "timing": TIMING}
    p.stdin.write(json.dumps(req) + "\n")
    p.stdin.flush()
    out = p.stdout.read()
    code = p.wait(timeout=120)
    err = p.stderr.read()
    print("fault: exit", code, "stdout", out[-500:], "stderr", err[-1500:])
    assert code != 0
    for line in out.splitlines():
        json.loads(line)  # whatever came back is still clean JSON


def test_call_overheads():
    """How much of a timed repetition is not the kernel: printed, for the report."""
    from ksearch_mlx.worker import time_reps
    from ksearch_mlx.data import summarize

    x = mx.zeros((32,))
    mx.eval(x)

    def tiny_op():
        mx.eval(x + 1.0)
        mx.synchronize()

    task = load_task("softmax")
    cc = CompiledCandidate(softmax_candidate("if (threadIdx.x == 0) y[0] = x[0];"), task, "mlx-cuda")
    axes = {"rows": 1, "cols": 32}
    inputs = {"x": mx.zeros((1, 32))}

    def tiny_kernel():
        outs = cc(inputs, axes)
        mx.eval(list(outs.values()))
        mx.synchronize()

    tiny_kernel()
    t = {"warmup": 5, "min_reps": 200, "max_reps": 200, "target_ms": 0, "flush": False}
    print("mlx op + eval + sync:", summarize(time_reps(tiny_op, t, None)))
    print("1-thread kernel call + eval + sync:", summarize(time_reps(tiny_kernel, t, None)))
    from ksearch_mlx.worker import Worker

    bw = Worker("mlx-cuda", None).copy_bps()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    assert bw > 1e11


def test_mamba_scan_search_workloads_through_the_worker():
    task = load_task("mamba_scan")
    b = task["backends"].get("mlx-cuda")
    if not b:
        pytest.skip("mamba_scan has no mlx-cuda section")
    ws = [{"label": str(a), "axes": a, "seed": 11 + i} for i, a in enumerate(b["search"])]
    p = worker_proc()
    json.loads(p.stdout.readline())
    summary = {}
    for kernel in ["seed"] + [k["name"] for k in b.get("kernels", [])]:
        req = {"op": "eval", "id": 1, "task": task, "backend": "mlx-cuda", "candidate": task_candidate(task, "mlx-cuda", kernel), "workloads": ws, "timing": TIMING}
        _, r = ask(p, req)
        summary[kernel] = [(w["label"], w["timing"] and round(w["timing"]["median_us"], 1), w["failure"]) for w in r["workloads"]] or r["failure"]
    _, r = ask(p, {"op": "baseline", "id": 2, "task": task, "backend": "mlx-cuda", "workloads": ws, "timing": {**TIMING, "min_reps": 3, "warmup": 1}})
    summary["baseline"] = [(w["label"], w["timing"] and round(w["timing"]["median_us"], 1), w["failure"]) for w in r["workloads"]]
    p.stdin.write('{"op":"shutdown"}\n')
    p.stdin.flush()
    p.wait(timeout=60)
    print(json.dumps(summary, indent=1))
