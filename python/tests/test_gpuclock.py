"""The GPU clock of the MLX worker (ksearch_mlx/gpuclock.py).

Without a GPU: its gate and stamp bodies compile with NVRTC for sm_90 and sm_80, wrapped as
`mx.fast.cuda_kernel` wraps them, and a broken body is caught. On a machine where MLX has its
CUDA back-end (test_gpu.py's condition): calls timed on it run one after the other, never side
by side, and their times are not MLX's host cost.
"""
import json
import os
import subprocess
import sys

import pytest
from conftest import PYTHON_DIR
from test_glue_nvrtc import compile_src, nvrtc  # noqa: F401  (the fixture)

from ksearch_mlx import gpuclock

TYPES = {"addr": "uint64_t", "seq": "uint32_t", "after": "uint32_t", "t": "uint64_t"}


def wrap(name, ins, body):
    params = [f"const {TYPES[n]}* {n}" for n in ins] + ["uint64_t* t"]
    return ("typedef unsigned long long uint64_t;\ntypedef unsigned int uint32_t;\n"
            "namespace mlx { namespace core { namespace cu {\n"
            f"extern \"C\" __global__ void {name}(\n    " + ",\n    ".join(params) + ") {\n"
            + body + "\n}\n}}}\n")


@pytest.mark.parametrize("arch", ["sm_90", "sm_80"])
@pytest.mark.parametrize("which", ["gate", "stamp"])
def test_clock_kernels_compile(nvrtc, which, arch):  # noqa: F811
    name, ins, body = {
        "gate": (gpuclock.GATE_NAME, gpuclock.GATE_INPUTS, gpuclock.GATE_BODY),
        "stamp": (gpuclock.STAMP_NAME, gpuclock.STAMP_INPUTS, gpuclock.STAMP_BODY),
    }[which]
    rc, log = compile_src(nvrtc, wrap(name, ins, body), arch)
    assert rc == 0, f"{which}: NVRTC failed:\n{log}"
    assert "warning" not in log.lower(), log


def test_a_broken_clock_body_is_caught(nvrtc):  # noqa: F811
    body = gpuclock.GATE_BODY.replace("seq[0]", "sequence[0]")
    rc, log = compile_src(nvrtc, wrap(gpuclock.GATE_NAME, gpuclock.GATE_INPUTS, body), "sm_90")
    assert rc != 0 and "sequence" in log


def test_no_clock_while_mlx_cuda_graphs_are_on(monkeypatch):
    # In a CUDA graph the calls would not wait for the gate: the clock refuses, with the reason.
    monkeypatch.delenv("MLX_USE_CUDA_GRAPHS", raising=False)
    clock, why = gpuclock.GpuClock.create()
    assert clock is None and "MLX_USE_CUDA_GRAPHS=0" in why, why


def _cuda():
    import mlx.core as mx

    return hasattr(mx, "cuda") and mx.cuda.is_available()


# In a fresh process (MLX reads MLX_USE_CUDA_GRAPHS once): a clock, its self-check, and eight
# calls that each spin SPIN_NS on the GPU clock, timed on it.
SPIN_NS = 20_000
LEAD_NS = 400_000
PROBE = f"""
import json, os
import mlx.core as mx
from ksearch_mlx import gpuclock
clock, why = gpuclock.GpuClock.create()
out = {{"why": why}}
if clock is not None:
    spin = mx.fast.cuda_kernel(name="ks_test_spin", input_names=["x"], output_names=["y"], source=gpuclock.CHECK_BODY.replace(
        str(gpuclock.CHECK_NS), "{SPIN_NS}"))

    def call(v):
        (y,) = spin(inputs=[v["x"]], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(4,)], output_dtypes=[mx.float32])
        return {{"y": y}}

    xs = [{{"x": mx.full((4,), float(i))}} for i in range(8)]
    mx.eval([v["x"] for v in xs])
    mx.eval(call(xs[0])["y"])
    per_call, results = clock.time_calls([call] * 8, xs)
    out.update(per_call=per_call, ys=[float(r["y"][0].item()) for r in results], empty_ns=clock.empty_ns, check_us=clock.check_us)
    # A lead of LEAD_NS between the gate and the first stamp is not part of the calls' time.
    lead_k = mx.fast.cuda_kernel(name="ks_test_lead", input_names=["x"], output_names=["y"], source=gpuclock.CHECK_BODY.replace(
        str(gpuclock.CHECK_NS), "{LEAD_NS}"))

    def lead(after):
        x = mx.depends([xs[0]["x"]], after)[0]
        return [lead_k(inputs=[x], grid=(32, 1, 1), threadgroup=(32, 1, 1), output_shapes=[(4,)], output_dtypes=[mx.float32])[0]]

    mx.eval(lead([])[0])
    out["per_call_lead"] = clock.time_calls([call] * 8, xs, lead=lead)[0]
print(json.dumps(out))
"""


@pytest.mark.skipif(not _cuda(), reason="needs MLX's CUDA back-end")
def test_calls_on_the_gpu_clock_run_one_after_the_other():
    env = {**os.environ, "MLX_USE_CUDA_GRAPHS": "0", "PYTHONPATH": str(PYTHON_DIR)}
    r = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["why"] == "", out
    # Side by side, eight one-block calls would take one call's time, an eighth each.
    assert out["per_call"] >= SPIN_NS * 1e-9, out
    assert out["check_us"] >= gpuclock.CHECK_NS / 1e3, out
    # Every call ran, on its own input.
    assert out["ys"] == [float(i) + 1 for i in range(8)], out
    assert out["empty_ns"] >= 0, out
    # Counted, the lead would add LEAD_NS / 8 = 50 us to each call's ~20 us.
    assert SPIN_NS * 1e-9 <= out["per_call_lead"] < (SPIN_NS + LEAD_NS / 16) * 1e-9, out
