"""Compile checks of the fused decode glue kernels of export_tail.py and of the Llama patch's fused
RoPE (export_llama.py), both in the MLX CUDA dialect, with
NVRTC, no GPU and no MLX CUDA back-end needed: each body is wrapped the way
`mx.fast.cuda_kernel` wraps it (inputs `const T*`, outputs `T*`, template values as `constexpr
int`), as crates/eval/src/mlx_cuda.rs does for the task kernels, and compiled for sm_90 at the
mamba-370m sizes and a small one. NVRTC and the CUDA headers come from pip
(nvidia-cuda-nvrtc, nvidia-cuda-runtime 13.0, which scripts/nvrtc-check.sh installs); the test
skips when neither this interpreter nor `python3` can find them (fails instead with
KSEARCH_REQUIRE_NVRTC=1, as scripts/test.sh sets after installing them).

    cd python && python -m pytest -q tests/test_glue_nvrtc.py
"""
import ctypes
import glob
import os
import pathlib
import subprocess
import types

import pytest

TAIL = pathlib.Path(__file__).resolve().parent.parent / "ksearch_mlx" / "export_tail.py"

# dtype of every input and output of the glue kernels
DTYPES = {
    "ks_glue_conv_xproj": {"xz": "__half", "cache": "__half", "cw": "__half", "cb": "__half", "wx": "__half",
                           "xa": "__half", "ncache": "__half", "dbc": "__half"},
    "ks_glue_dt": {"dbc": "__half", "wdt": "__half", "bdt": "__half", "delta": "__half", "Bo": "__half", "Co": "__half"},
    "ks_glue_dt_step": {"dbc": "__half", "wdt": "__half", "bdt": "__half", "xa": "__half", "A": "float",
                        "Dv": "float", "s0": "float", "xz": "__half", "yg": "__half", "s1": "float"},
    # export_llama.py's fused RoPE (int32 is `int`, as crates/eval/src/mlx_cuda.rs wraps it)
    "ks_llama_rope": {"q": "__half", "k": "__half", "v": "__half", "dims": "int", "p": "float", "qo": "__half",
                      "ko": "__half", "vo": "__half"},
    "ks_llama_swiglu": {"gu": "__half", "dims": "int", "out": "__half"},
}


def cu13_dir():
    cands = []
    try:
        import nvidia  # noqa: F401

        cands += [os.path.join(p, "cu13") for p in nvidia.__path__]
    except ImportError:
        pass
    try:
        out = subprocess.run(["python3", "-c", "import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], 'cu13'))"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0:
            cands.append(out.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    for d in cands:
        if os.path.exists(os.path.join(d, "lib", "libnvrtc.so.13")) and os.path.exists(os.path.join(d, "include", "cuda_fp16.h")):
            return d
    return None


def load_glue():
    mod = types.ModuleType("export_tail_glue")
    src = TAIL.read_text()
    # only the string constants are needed: no MLX import
    start, end = src.index("_GLUE_HEADER = "), src.index("_glue_cache = {}")
    exec(compile(src[start:end], str(TAIL), "exec"), mod.__dict__)
    return mod


def wrap(name, ins, outs, body, template):
    d = DTYPES[name]
    params = [f"const {d[n]}* {n}" for n in ins] + [f"{d[n]}* {n}" for n in outs]
    consts = "".join(f"  constexpr int {k} = {v};\n" for k, v in template.items())
    return ("#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n"
            "namespace mlx { namespace core { namespace cu {\n"
            f"extern \"C\" __global__ void {name}(\n    " + ",\n    ".join(params) + ") {\n"
            + consts + body + "\n}\n}}}\n")


@pytest.fixture(scope="module")
def nvrtc():
    d = cu13_dir()
    if d is None:
        if os.environ.get("KSEARCH_REQUIRE_NVRTC") == "1":
            pytest.fail("NVRTC 13 from pip not found and KSEARCH_REQUIRE_NVRTC=1 (scripts/nvrtc-check.sh installs it)")
        pytest.skip("NVRTC 13 from pip not found (scripts/nvrtc-check.sh installs it)")
    for b in sorted(glob.glob(os.path.join(d, "lib", "libnvrtc-builtins.so.13*"))):
        try:
            ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
            break
        except OSError:
            pass
    return ctypes.CDLL(os.path.join(d, "lib", "libnvrtc.so.13")), os.path.join(d, "include")


def compile_src(nvrtc, src, arch="sm_90"):
    lib, inc = nvrtc
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"glue.cu", 0, None, None) == 0
    opts = [f"--gpu-architecture={arch}".encode(), b"--std=c++17", f"--include-path={inc}".encode()]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, buf)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, buf.value.decode(errors="replace")


@pytest.mark.parametrize("sizes", [dict(D=2048, K=4, R=64, N=16, NB=1), dict(D=256, K=2, R=8, N=4, NB=3)])
@pytest.mark.parametrize("name", ["ks_glue_conv_xproj", "ks_glue_dt", "ks_glue_dt_step"])
def test_glue_kernels_compile(nvrtc, name, sizes):
    g = load_glue()
    ins, outs, body = g._GLUE_KERNELS[name]
    assert set(ins) | set(outs) == set(DTYPES[name]), "DTYPES out of date"
    J = sizes["R"] + 2 * sizes["N"]
    template = {"ks_glue_conv_xproj": dict(D=sizes["D"], K=sizes["K"], J=J, NT=256)}.get(
        name, dict(D=sizes["D"], R=sizes["R"], N=sizes["N"], J=J, NB=sizes["NB"]))
    rc, log = compile_src(nvrtc, wrap(name, ins, outs, body, template))
    assert rc == 0, f"{name} {sizes}: NVRTC failed:\n{log}"
    assert "warning" not in log.lower(), log


LLAMA = TAIL.parent / "export_llama.py"


def llama_body(name="_LLAMA_ROPE_BODY"):
    src = LLAMA.read_text()
    start = src.index(f"{name} = ")
    end = src.index('"""', src.index('"""', start) + 3) + 3
    ns = {}
    exec(compile(src[start:end], str(LLAMA), "exec"), ns)
    return ns[name]


@pytest.mark.parametrize("qkv", [0, 1])
@pytest.mark.parametrize("D", [64, 96, 128])
def test_the_llama_patchs_fused_rope_compiles(nvrtc, D, qkv):
    """export_llama.py's RoPE kernel (mx.fast.cuda_kernel: q, k, v, dims, p -> qo, ko, vo; template
    D and QKV)."""
    rc, log = compile_src(nvrtc, wrap("ks_llama_rope", ["q", "k", "v", "dims", "p"], ["qo", "ko", "vo"], llama_body(),
                                      dict(D=D, QKV=qkv)))
    assert rc == 0, f"D={D} QKV={qkv}: NVRTC failed:\n{log}"
    assert "warning" not in log.lower(), log


@pytest.mark.parametrize("I", [5632, 8192, 8])
def test_the_llama_patchs_swiglu_compiles(nvrtc, I):
    """export_llama.py's silu(g) * u kernel (gu, dims -> out; template I)."""
    rc, log = compile_src(nvrtc, wrap("ks_llama_swiglu", ["gu", "dims"], ["out"], llama_body("_LLAMA_SWIGLU_BODY"),
                                      dict(I=I)))
    assert rc == 0, f"I={I}: NVRTC failed:\n{log}"
    assert "warning" not in log.lower(), log


def test_a_broken_body_is_caught(nvrtc):
    g = load_glue()
    ins, outs, body = g._GLUE_KERNELS["ks_glue_dt"]
    rc, log = compile_src(nvrtc, wrap("ks_glue_dt", ins, outs, body.replace("delta[i]", "deltaa[i]"),
                                      dict(D=256, R=8, N=4, J=16, NB=1)))
    assert rc != 0 and "deltaa" in log
