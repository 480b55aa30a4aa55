"""Whole CUDA translation units on mlx-cuda (`options = { form = "cuda" }`), without a GPU: the
NVRTC build of tasks/attention/cuda/flash_wgmma.cu for sm_90a with pip's NVRTC, one name per
build, the check of the entry's parameters (axes as 32-bit int), compile errors naming the file
and line, and the launch plan. NVRTC 13 and the CUDA headers come from pip (nvidia-cuda-nvrtc,
nvidia-cuda-runtime, which scripts/nvrtc-check.sh installs); the tests that compile skip when
they are missing (fail instead with KSEARCH_REQUIRE_NVRTC=1, as scripts/test.sh sets).

    cd python && python -m pytest -q tests/test_cuda_unit.py
"""
import os

import pytest

import ksearch_mlx.runtime as rt
from conftest import REPO, load_task

FILE = "cuda/flash_wgmma.cu"


def _cu13():
    try:
        import nvidia

        for p in nvidia.__path__:
            d = os.path.join(p, "cu13")
            if os.path.exists(os.path.join(d, "lib", "libnvrtc.so.13")) and os.path.exists(
                os.path.join(d, "include", "cuda_fp16.h")
            ):
                return d
    except ImportError:
        pass
    return None


@pytest.fixture(scope="module")
def nvrtc():
    d = _cu13()
    if d is None:
        if os.environ.get("KSEARCH_REQUIRE_NVRTC") == "1":
            pytest.fail("NVRTC 13 from pip not found and KSEARCH_REQUIRE_NVRTC=1 (scripts/nvrtc-check.sh installs it)")
        pytest.skip("NVRTC 13 from pip not found (scripts/nvrtc-check.sh installs it)")
    return d


@pytest.fixture()
def env(nvrtc, monkeypatch):
    monkeypatch.setenv("KSEARCH_NVRTC", os.path.join(nvrtc, "lib", "libnvrtc.so.13"))
    monkeypatch.setenv("KSEARCH_CUDA_INCLUDE", os.path.join(nvrtc, "include"))
    rt._UNITS.clear()
    return nvrtc


def candidate(defines=None, source=None, kernel="flash_wgmma"):
    """An mlx-cuda kernel of the attention task (flash_wgmma unless named) at its defaults (+
    `defines`), as ksearch sends it (the loader adds the file to the options)."""
    task = load_task("attention")
    k = next(x for x in task["backends"]["mlx-cuda"]["kernels"] if x["name"] == kernel)
    if source is None:
        with open(os.path.join(REPO, "tasks", "attention", k["file"])) as f:
            source = f.read()
    d = {t["name"]: t.get("default", t["values"][0]) for t in k["tunables"]}
    d.update(defines or {})
    launches = [{"grid": ["1", "1", "1"], "block": ["1", "1", "1"], "shared": "0", **l} for l in k["launches"]]
    return task, {
        "source": source,
        "launches": launches,
        "scratch": [],
        "defines": d,
        "options": {**k["options"], "file": k["file"]},
    }


def build(task, cand, arch=None):
    static = rt.static_launches(cand, task, "mlx-cuda")
    arch = arch or rt.arch_for((9, 0), cand["source"], cand["options"])
    return rt.build_cuda_unit(cand, task, static, arch)


@pytest.mark.parametrize("hd", [64, 96, 128])
def test_flash_wgmma_builds_for_sm_90a_with_one_name_per_build(env, hd):
    task, cand = candidate({"HD": hd})
    assert rt.arch_for((9, 0), cand["source"], cand["options"]) == "sm_90a"
    assert rt.arch_for((8, 0), cand["source"], cand["options"]) == "sm_80"
    unit = build(task, cand)
    assert unit.arch == "sm_90a" and len(unit.cubin) > 10000 and unit.cubin[:4] == b"\x7fELF"
    name = unit.names["attention"]
    assert name.startswith("ks_attention_") and len(name) == len("ks_attention_") + 12
    # The same build again: the same object, compiled once.
    assert build(task, cand) is unit
    # Another tunable value, another source: other names (MLX keeps modules by name).
    _, other = candidate({"HD": hd, "STAGES": 4})
    assert build(task, other).names["attention"] != name
    _, edited = candidate({"HD": hd}, source=cand["source"] + "\n// an edit\n")
    assert build(task, edited).names["attention"] != name


@pytest.mark.parametrize("hd,lhd", [(64, 0), (96, 0), (128, 0), (128, 1)])
def test_flash_ws_with_tensor_maps_built_on_the_device_compiles_for_sm_90a(env, hd, lhd):
    # TMA=1 (the default): the maps are built in the kernel (tensormap.replace) and published to a
    # module-scope slot, so the unit carries that global; a build of its own beside the cp.async
    # one (TMA=0).
    task, cand = candidate({"HD": hd, "QO_LHD": lhd, "TMA": 1}, kernel="flash_ws")
    unit = build(task, cand)
    assert unit.arch == "sm_90a" and unit.cubin[:4] == b"\x7fELF" and b"ks_tmaps" in unit.cubin
    _, plain = candidate({"HD": hd, "QO_LHD": lhd, "TMA": 0}, kernel="flash_ws")
    plain_unit = build(task, plain)
    assert b"ks_tmaps" not in plain_unit.cubin
    assert plain_unit.names["attention"] != unit.names["attention"]


def test_axes_declared_64_bit_are_refused_in_one_line(env):
    task, cand = candidate()
    src = cand["source"].replace("KS_AXIS B, KS_AXIS H,", "long long B, KS_AXIS H,")
    assert src != cand["source"]
    with pytest.raises(rt.SourceError) as e:
        build(task, {**cand, "source": src})
    msg = str(e.value)
    assert msg.startswith(f"{FILE}: entry `attention` takes axis `B` as a 64-bit value") and "KS_AXIS" in msg
    assert "\n" not in msg


def test_an_entry_with_other_parameters_or_none_is_refused(env):
    task, cand = candidate()
    src = cand["source"].replace("KS_AXIS causal)", "KS_AXIS causal, KS_AXIS extra)")
    assert src != cand["source"]
    with pytest.raises(rt.SourceError, match=r"takes 11 parameters; on mlx-cuda it takes its 3 inputs and 1 outputs"):
        build(task, {**cand, "source": src})
    src = cand["source"].replace('extern "C" __global__', "__global__")
    with pytest.raises(rt.SourceError, match=r'no entry `attention` in the compiled unit \(declare it `extern "C"'):
        build(task, {**cand, "source": src})


def test_a_compile_error_names_the_file_and_line_and_is_remembered(env):
    task, cand = candidate()
    lines = cand["source"].split("\n")
    at = next(i for i, l in enumerate(lines) if "const int Ln = (int)L;" in l)
    lines[at] = lines[at].replace("(int)L;", "(int)L + undeclared_name;")
    bad = {**cand, "source": "\n".join(lines)}
    with pytest.raises(rt.SourceError) as e:
        build(task, bad)
    first = str(e.value).splitlines()[0]
    assert first.startswith(f"{FILE}({at + 1}): error") and "undeclared_name" in first
    with pytest.raises(rt.SourceError):  # remembered, not compiled again
        build(task, bad)


def test_forms_and_sections_are_checked_before_compiling():
    task, cand = candidate()
    with pytest.raises(rt.SourceError, match="form `ptx` is unknown"):
        rt.static_launches({**cand, "options": {"form": "ptx"}}, task, "mlx-cuda")
    with pytest.raises(rt.SourceError, match="mlx-cuda only"):
        rt.static_launches(cand, task, "mlx-metal")
    with pytest.raises(rt.SourceError, match="no `// @kernel` sections"):
        rt.static_launches({**cand, "source": "// @kernel attention\n" + cand["source"]}, task, "mlx-cuda")
    (s,) = rt.static_launches(cand, task, "mlx-cuda")
    assert s.form == "cuda" and s.header == "" and s.body == cand["source"]


def test_the_launch_counts_threads_and_asks_for_the_shared_bytes():
    task, cand = candidate()
    axes = {"B": 4, "H": 32, "Hkv": 32, "L": 2048, "D": 128, "causal": 1}
    (p,) = rt.plan_launches(cand, task, "mlx-cuda", axes)
    # 128 query rows per block (two warpgroups of 64), 256 threads per block.
    assert p.threadgroup == (256, 1, 1) and p.grid == (16 * 256, 4 * 32, 1)
    assert p.shared == 128 * 2 * 128 + 4 * 3 * 128 * 128 + 1024 + 128
    _, c64 = candidate({"HD": 64})
    (p,) = rt.plan_launches(c64, task, "mlx-cuda", {**axes, "D": 64, "L": 1})
    assert p.grid == (256, 128, 1)


def test_ptx_parameters_are_read_with_their_sizes():
    ptx = """
.visible .entry ks_f_0123(
	.param .u64 .ptr .global .align 1 ks_f_0123_param_0,
	.param .u64 ks_f_0123_param_1,
	.param .u32 ks_f_0123_param_2,
	.param .align 8 .b8 ks_f_0123_param_3[16]
)
{
}
.visible .entry g()
{
}
"""
    assert rt.ptx_params(ptx) == {"ks_f_0123": [8, 8, 4, 16], "g": []}


def test_a_call_passes_the_build_and_the_axes_in_task_order_to_mlx(env, monkeypatch):
    # MLX's precompiled-kernel call itself needs a GPU: here it is replaced by a recorder, and
    # what reaches it is checked: the build's name and CUBIN, the axes as ints in the task's
    # order, the launch's grid (threads), block and shared bytes, row-contiguous inputs.
    import mlx.core as mx

    task, cand = candidate()
    cc = rt.CompiledCandidate(cand, task, "mlx-cuda")
    monkeypatch.setattr(rt, "device_cc", lambda: (9, 0))
    seen = []

    def record(**kw):
        seen.append(kw)
        return [mx.zeros(tuple(kw["output_shapes"][0]), dtype=kw["output_dtypes"][0])]

    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel", record)
    axes = {"B": 2, "H": 8, "Hkv": 2, "L": 130, "D": 128, "causal": 1}
    q = mx.zeros((2, 8, 130, 128), dtype=mx.float16)
    kv = mx.zeros((2, 2, 130, 128), dtype=mx.float16)
    out = cc({"q": q, "k": kv, "v": kv}, axes, init_value=3.0)["o"]
    assert out.shape == (2, 8, 130, 128)
    (kw,) = seen
    unit = cc.unit()
    assert kw["name"] == unit.names["attention"] and kw["compiled_source"] is unit.cubin
    assert kw["scalars"] == [2, 8, 2, 130, 128, 1] and all(type(v) is int for v in kw["scalars"])
    assert kw["grid"] == (2 * 256, 16, 1) and kw["threadgroup"] == (256, 1, 1)
    assert kw["shared_memory"] == 128 * 2 * 128 + 4 * 3 * 128 * 128 + 1024 + 128
    assert kw["ensure_row_contiguous"] is True and kw["init_value"] == 3.0 and "template" not in kw
    assert [a.shape for a in kw["inputs"]] == [(2, 8, 130, 128), (2, 2, 130, 128), (2, 2, 130, 128)]
