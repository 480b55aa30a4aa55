"""The worker's protocol (as a subprocess) and its evaluation flow (in process, with stand-in
kernels, since MLX's CPU back-end cannot run custom kernels)."""

import json
import math
import time
import subprocess
import sys

import mlx.core as mx
import pytest
from conftest import PYTHON_DIR, load_task

from ksearch_mlx import judge, runtime, worker

TIMING = {"warmup": 1, "min_reps": 3, "max_reps": 5, "target_ms": 1.0, "flush": True}
SOFTMAX_W = {"label": "rows=4,cols=24", "axes": {"rows": 4, "cols": 24}, "seed": 91823}


class Proc:
    """A worker subprocess spoken to line by line."""

    def __init__(self, *args):
        self.p = subprocess.Popen(
            [sys.executable, "-m", "ksearch_mlx.worker", *args],
            cwd=PYTHON_DIR,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def send(self, msg):
        self.p.stdin.write((msg if isinstance(msg, str) else json.dumps(msg)) + "\n")
        self.p.stdin.flush()

    def read(self):
        line = self.p.stdout.readline()
        assert line, "worker closed its channel; stderr: " + self.p.stderr.read()
        return json.loads(line)

    def until_reply(self):
        """Progress events, then the reply."""
        events = []
        while True:
            m = self.read()
            if m["reply"] != "progress":
                return events, m
            events.append(m)

    def close(self):
        self.send({"op": "shutdown"})
        return self.p.wait(timeout=30)


@pytest.fixture
def proc():
    p = Proc("--backend", "mlx-cuda")
    yield p
    if p.p.poll() is None:
        p.p.kill()
        p.p.wait()


def softmax_candidate(body="softmax"):
    return {
        "lang": "mlx_cuda",
        "source": body,
        "launches": [{"entry": "softmax", "grid": ["rows * 32", "1", "1"], "block": ["32", "1", "1"], "shared": "0"}],
        "scratch": [],
        "defines": {"VEC": 4},
        "options": {},
    }


def eval_req(task, candidate, workloads, id_=7, check_only=False):
    return {
        "op": "eval",
        "id": id_,
        "task": task,
        "backend": "mlx-cuda",
        "candidate": candidate,
        "workloads": workloads,
        "timing": TIMING,
        "check_only": check_only,
    }


def cuda_available():
    return hasattr(mx, "cuda") and mx.cuda.is_available()


# ---------------------------------------------------------------------------------------------
# Protocol, through a real subprocess
# ---------------------------------------------------------------------------------------------


def test_hello_first_then_on_request(proc):
    hello = proc.read()
    assert hello["reply"] == "hello" and hello["backend"] == "mlx-cuda"
    assert isinstance(hello["pid"], int) and hello["version"] == "0.1.0"
    assert hello["mlx"] == mx.__version__
    if not cuda_available():
        assert hello["kernels"] is False
        assert hello["device"].startswith("cpu (mlx ") and "no CUDA back-end" in hello["device"]
        assert hello["clock"] == "host clock"
    else:
        assert hello["clock"].startswith("GPU clock"), hello
    proc.send({"op": "hello"})
    assert proc.read() == hello
    assert proc.close() == 0


@pytest.mark.skipif(cuda_available(), reason="this machine has MLX's CUDA back-end")
def test_eval_without_gpu_fails_as_infra_and_keeps_serving(proc):
    proc.read()
    proc.send(eval_req(load_task("softmax"), softmax_candidate(), [SOFTMAX_W]))
    events, reply = proc.until_reply()
    assert reply["reply"] == "eval" and reply["id"] == 7
    assert reply["failure"]["class"] == "infra"
    assert "no CUDA back-end" in reply["failure"]["message"]
    assert reply["workloads"] == [] and set(reply["compile"]) == {"log", "cached", "seconds"}
    assert reply["compile_s"] > 0 and reply["device_s"] == 0 and "device_spans" not in reply
    proc.send({"op": "hello"})
    assert proc.read()["reply"] == "hello"
    assert proc.close() == 0


def test_unreadable_lines_get_errors_and_the_worker_goes_on(proc):
    proc.read()
    for bad in ["this is not json", "[1, 2]", json.dumps({"op": "dance", "id": 3})]:
        proc.send(bad)
        m = proc.read()
        assert m["reply"] == "error" and m["message"]
    proc.send({"op": "hello"})
    assert proc.read()["reply"] == "hello"
    assert proc.close() == 0


def test_end_of_input_exits_cleanly(proc):
    proc.read()
    proc.p.stdin.close()
    assert proc.p.wait(timeout=30) == 0


def test_reference_op_returns_inputs_and_f32_outputs(proc):
    proc.read()
    task = load_task("softmax")
    req = {"op": "reference", "id": 4, "task": task, "backend": "mlx-cuda", "workload": SOFTMAX_W}
    proc.send(req)
    r = proc.read()
    assert r["reply"] == "reference" and r["id"] == 4
    x, y = r["inputs"]["x"], r["outputs"]["y"]
    assert len(x) == len(y) == 4 * 24
    row = x[:24]
    m = max(row)
    e = [math.exp(v - m) for v in row]
    assert y[:24] == pytest.approx([v / sum(e) for v in e], rel=1e-5, abs=1e-7)
    proc.send(req)
    assert proc.read()["inputs"]["x"] == x  # same seed, same inputs
    assert proc.close() == 0


def test_baseline_op_times_the_native_implementation(proc):
    proc.read()
    proc.send({"op": "baseline", "id": 9, "task": load_task("softmax"), "backend": "mlx-cuda", "workloads": [SOFTMAX_W, SOFTMAX_W], "timing": TIMING})
    events, reply = proc.until_reply()
    assert [e["stage"] for e in events] == ["compiled", "workload 1/2", "workload 2/2"]
    assert all(e["id"] == 9 for e in events)
    assert reply["reply"] == "eval" and reply["id"] == 9 and reply["failure"] is None
    w = reply["workloads"][0]
    assert w["failure"] is None and w["check"]["elements"] == 96 and w["check"]["mismatches"] == 0
    assert 3 <= w["timing"]["reps"] <= 5 and w["timing"]["median_us"] > 0
    assert w["bytes"] == 2 * 96 * 4 and w["flops"] == 5 * 96 and w["floor_us"] > 0
    assert proc.close() == 0


def test_metal_on_linux_says_why():
    if sys.platform == "darwin":
        pytest.skip("macOS has Metal")
    p = Proc("--backend", "mlx-metal")
    hello = p.read()
    assert hello["kernels"] is False and "no Metal back-end" in hello["device"]
    assert p.close() == 0


def test_prints_cannot_reach_the_channel():
    code = "from ksearch_mlx.worker import Channel\nc = Channel()\nprint('noise', flush=True)\nc.send({'reply': 'x'})\n"
    r = subprocess.run([sys.executable, "-c", code], cwd=PYTHON_DIR, capture_output=True, text=True, timeout=60)
    assert r.stdout == '{"reply": "x"}\n'
    assert "noise" in r.stderr


# ---------------------------------------------------------------------------------------------
# The evaluation flow, in process, with stand-in kernels
# ---------------------------------------------------------------------------------------------


def fake_kernel(behaviour):
    """Emulates an MLX custom-kernel call for the softmax task: an output of the shape asked
    for (flat, with the judge's guard tail), filled with `init_value` where not written."""

    def call(*, inputs, output_shapes, output_dtypes, grid, threadgroup, template, init_value=None):
        if behaviour == "compile_error":
            raise RuntimeError("Failed to compile kernel: kernel.cu(3): error: expected a \";\".")
        if behaviour == "too_big":
            raise RuntimeError("cuLaunchKernel failed: too many resources requested for launch")
        if behaviour == "fault":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        x = inputs[0].astype(mx.float32)
        y = mx.softmax(x, axis=-1)
        if behaviour == "half":
            keep = mx.arange(y.shape[-1]) < y.shape[-1] // 2
            y = mx.where(keep, y, init_value if init_value is not None else 0.0)
        if behaviour == "nan":
            y = y * mx.array(math.nan)
        if behaviour == "wrong":
            y = y * 1.5
        size = math.prod(output_shapes[0])
        flat = y.reshape(-1)
        tail = mx.full((size - flat.size,), init_value if init_value is not None else 0.0)
        if behaviour == "past":
            tail = mx.concatenate([tail[:16], mx.array([1.0]), tail[17:]])
        out = mx.concatenate([flat, tail]).reshape(output_shapes[0])
        return [out.astype(output_dtypes[0])]

    return call


@pytest.fixture
def fake_worker(monkeypatch):
    class FakeCandidate(runtime.CompiledCandidate):
        def _kernel(self, s, shared):
            return fake_kernel(s.body.strip())

    monkeypatch.setattr(runtime, "CompiledCandidate", FakeCandidate)
    w = worker.Worker("mlx-cuda", None)
    w.kernels = True  # as if MLX had its CUDA back-end
    w._copy_bps = 1e11
    w.flush = lambda: None
    return w


def run_eval(w, body, workloads=None, check_only=False):
    events = []
    reply = w.eval(eval_req(load_task("softmax"), softmax_candidate(body), workloads or [SOFTMAX_W, SOFTMAX_W], check_only=check_only), events.append)
    json.dumps(reply, allow_nan=False)  # what goes on the wire must be strict JSON
    return events, reply


def test_a_correct_kernel_is_checked_and_timed(fake_worker):
    events, reply = run_eval(fake_worker, "softmax")
    assert events == ["compiled", "workload 1/2", "workload 2/2"]
    assert reply["failure"] is None and reply["id"] == 7
    for w in reply["workloads"]:
        assert w["failure"] is None and w["check"]["elements"] == 96
        assert 3 <= w["timing"]["reps"] <= 5
        assert w["axes"] == SOFTMAX_W["axes"] and w["seed"] == SOFTMAX_W["seed"]
    assert reply["compile"]["seconds"] > 0 and reply["kernel_s"] > 0
    assert "softmax: grid (128, 1, 1) threadgroup (32, 1, 1)" in reply["resources"]["raw"]
    # The pool's accounting: compile up to the first compiled call, then the device to the end,
    # as one span of the monotonic clock (the worker is alone on its device: no lock wait).
    assert reply["compile_s"] > 0 and reply["device_s"] > 0 and reply["lock_wait_s"] == 0
    (a, b), = reply["device_spans"]
    assert b - a == pytest.approx(reply["device_s"]) and b <= time.monotonic()
    assert "host clock" in reply["resources"]["raw"]  # no GPU clock for the fake kernels


def test_check_only_skips_timing(fake_worker):
    _, reply = run_eval(fake_worker, "softmax", check_only=True)
    assert all(w["timing"] is None and w["failure"] is None for w in reply["workloads"])


@pytest.mark.parametrize("body, cls", [("half", "unwritten"), ("nan", "nan"), ("wrong", "wrong"), ("past", "out_of_bounds")])
def test_bad_results_are_classified(fake_worker, body, cls):
    events, reply = run_eval(fake_worker, body)
    assert events[0] == "compiled" and len(events) == 3
    w = reply["workloads"][0]
    assert w["failure"]["class"] == cls and "output `y`" in w["failure"]["message"]
    if cls == "out_of_bounds":
        assert "1 elements written past its end (first 16 elements after it)" in w["failure"]["message"]
    assert w["timing"] is None
    if cls == "unwritten":
        assert w["check"]["unwritten"] == 4 * 12 and w["check"]["first_bad"][1] == "never written"


def test_compile_errors_stop_the_evaluation_with_the_log(fake_worker):
    events, reply = run_eval(fake_worker, "compile_error")
    assert events == []
    assert reply["failure"]["class"] == "compile"
    assert "expected a" in reply["compile"]["log"] and reply["workloads"] == []


def test_launch_refusals_fail_the_workload(fake_worker):
    events, reply = run_eval(fake_worker, "too_big")
    assert events == ["compiled", "workload 1/2", "workload 2/2"]
    assert reply["failure"] is None
    assert [w["failure"]["class"] for w in reply["workloads"]] == ["launch", "launch"]


def test_bad_configuration_is_a_launch_failure(fake_worker):
    c = softmax_candidate("softmax")
    c["launches"][0]["block"] = ["4096", "1", "1"]
    reply = fake_worker.eval(eval_req(load_task("softmax"), c, [SOFTMAX_W]), lambda s: None)
    assert reply["workloads"][0]["failure"]["class"] == "launch"
    assert "4096 threads" in reply["workloads"][0]["failure"]["message"]


def test_unknown_section_is_a_compile_failure(fake_worker):
    c = softmax_candidate("// @kernel other\nsoftmax\n")
    reply = fake_worker.eval(eval_req(load_task("softmax"), c, [SOFTMAX_W]), lambda s: None)
    assert reply["failure"]["class"] == "compile" and "`// @kernel softmax`" in reply["failure"]["message"]


def test_times_under_the_floor_are_rejected(fake_worker):
    fake_worker._copy_bps = 1.0  # one byte a second: any real time is "too fast"
    _, reply = run_eval(fake_worker, "softmax")
    w = reply["workloads"][0]
    assert w["failure"]["class"] == "below_floor" and w["timing"] is not None


def test_a_device_fault_ends_the_worker(fake_worker, monkeypatch):
    codes = []

    def fake_exit(code):
        codes.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(worker.os, "_exit", fake_exit)
    with pytest.raises(SystemExit):
        run_eval(fake_worker, "fault")
    assert codes == [worker.FAULT_EXIT_CODE]


def test_unexpected_errors_are_infra(fake_worker):
    reply = fake_worker.eval({"op": "eval", "id": 1}, lambda s: None)
    assert reply["failure"]["class"] == "infra" and "KeyError" in reply["failure"]["message"]


def test_classify():
    assert worker.classify(runtime.SourceError("x"))[0] == "compile"
    assert worker.classify(runtime.LaunchError("x"))[0] == "launch"
    assert worker.classify(RuntimeError("[metal::Device] Unable to build metal library from source\nerror: x"))[0] == "compile"
    assert worker.classify(RuntimeError("[malloc] Unable to allocate 1e12 bytes"))[0] == "out_of_memory"
    cls, msg = worker.classify(RuntimeError("something odd"))
    assert cls == "infra" and msg == "RuntimeError: something odd"
    with pytest.raises(worker.Fault):
        worker.classify(RuntimeError("unspecified launch failure"))


def test_time_reps_respects_min_max_and_target():
    calls = []
    samples = worker.time_reps(lambda: calls.append(1), {"warmup": 2, "min_reps": 3, "max_reps": 10, "target_ms": 0.0, "flush": False}, None)
    assert len(samples) == 3 and len(calls) == 5
    samples = worker.time_reps(lambda: None, {"warmup": 0, "min_reps": 3, "max_reps": 7, "target_ms": 1e9, "flush": True}, lambda: calls.append("f"))
    assert len(samples) == 7 and calls.count("f") == 7


def test_baseline_results_off_tolerance_are_reported_not_failed():
    w = worker.Worker("mlx-cuda", None)
    w._copy_bps = 1e11
    w.flush = lambda: None
    task = load_task("mamba_step")
    # mlx-lm forms delta * x * B in f16, so its f32 state is f16-accurate: far outside this.
    task["tolerance"]["f32"] = {"atol": 1e-9, "rtol": 1e-9}
    wl = {"label": "small", "axes": {"batch": 2, "D": 8, "N": 4}, "seed": 1234}
    req = {"op": "baseline", "id": 3, "task": task, "backend": "declared", "workloads": [wl], "timing": TIMING}
    stages = []
    reply = w.baseline(req, stages.append)
    assert stages == ["compiled", "workload 1/1"]
    res = reply["workloads"][0]
    assert reply["failure"] is None and res["failure"] is None and res["timing"]["reps"] >= 3
    assert res["check"]["mismatches"] > 0
    assert "outside tolerance (reported, not a failure): small: output `state_out`" in reply["compile"]["log"]


def test_small_calls_are_timed_in_batches_over_rotated_pools():
    # ~85 us per call (MLX's fixed cost dominates): a dozen calls per sample, pools rotated
    assert judge.choose_batch(85.0, 1e6) == (11, 11)
    # a big working set: batched, but as few pool sets as fit the rotation budget
    assert judge.choose_batch(85.0, 100e6) == (11, 2)
    # calls of a millisecond or more, or unmeasured: one per sample
    assert judge.choose_batch(1500.0, 1e6) == (1, 1)
    assert judge.choose_batch(0.0, 1e6) == (1, 1)
    assert judge.choose_batch(1.0, 1.0)[0] == judge.BATCH_MAX
