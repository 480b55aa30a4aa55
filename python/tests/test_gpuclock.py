"""The GPU clock of the MLX worker (ksearch_mlx/gpuclock.py).

Without a GPU: its gate and stamp bodies compile with NVRTC for sm_90 and sm_80, wrapped as
`mx.fast.cuda_kernel` wraps them, and a broken body is caught. On a machine where MLX has its
CUDA back-end (test_gpu.py's condition): calls timed on it run one after the other, never side
by side, and their times are not MLX's host cost.
"""
import pytest
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


def _cuda():
    import mlx.core as mx

    return hasattr(mx, "cuda") and mx.cuda.is_available()


# A kernel that spins on the GPU clock for SPIN_NS, one block.
SPIN_NS = 20_000
SPIN = f"""
if (threadIdx.x == 0) {{
  unsigned long long t0, now;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {{ asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); }} while (now - t0 < {SPIN_NS}ull);
  y[0] = x[0] + 1.0f;
}}
"""


@pytest.mark.skipif(not _cuda(), reason="needs MLX's CUDA back-end")
def test_calls_on_the_gpu_clock_run_one_after_the_other():
    import mlx.core as mx

    clock, why = gpuclock.GpuClock.create()
    assert clock is not None, why
    spin = mx.fast.cuda_kernel(name="ks_test_spin", input_names=["x"], output_names=["y"], source=SPIN)

    def call(v):
        (y,) = spin(inputs=[v["x"]], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                    output_shapes=[(1,)], output_dtypes=[mx.float32])
        return {"y": y}

    xs = [{"x": mx.array([float(i)])} for i in range(8)]
    mx.eval([v["x"] for v in xs])
    call(xs[0])["y"].item()  # compiles
    per_call, results = clock.time_calls([call] * len(xs), xs)
    # Side by side, eight one-block calls would take one call's time, an eighth each.
    assert per_call >= SPIN_NS * 1e-9, per_call
    # Every call ran, on its own input.
    assert [r["y"].item() for r in results] == [float(i) + 1 for i in range(8)]
    assert clock.empty_ns >= 0
