# ---- NVRTC through ctypes: CUDA source to CUBIN (and PTX), no GPU and no CUDA toolkit needed ----
#
# One file, standard library only, shared by the code that compiles CUDA in Python:
#   * the MLX worker's whole-translation-unit kernels (ksearch_mlx/runtime.py imports it),
#   * modules written by `ksearch export --mlx` and `ksearch export --torch`, which paste this text
#     verbatim before their own (so they need no ksearch installed).
# libnvrtc is found in pip's nvidia-cuda-nvrtc wheel of this interpreter, on the loader's path,
# under $CUDA_HOME / $CUDA_PATH or /usr/local/cuda; $KSEARCH_NVRTC names it outright.
#
# No `from __future__` import and no module docstring: this text is pasted into other modules.

import ctypes
import glob
import os
import sys


class CompileError(RuntimeError):
    """NVRTC refused a build (the message carries its log)."""


def _nvidia_dirs():
    """`nvidia/cu13`-style folders of pip's CUDA wheels visible to this interpreter."""
    out = []
    for p in sys.path:
        for sub in ("cu13", "cuda_nvrtc", "cuda_runtime", "cu12"):
            d = os.path.join(p or ".", "nvidia", sub)
            if os.path.isdir(d):
                out.append(d)
    return out


_NVRTC = []


def nvrtc_library():
    """libnvrtc, loaded once: $KSEARCH_NVRTC (a file), pip's nvidia-cuda-nvrtc of this
    interpreter, the loader's search path, $CUDA_HOME / $CUDA_PATH, /usr/local/cuda."""
    if _NVRTC:
        return _NVRTC[0]
    cands = []
    if os.environ.get("KSEARCH_NVRTC"):
        cands.append(os.environ["KSEARCH_NVRTC"])
    for d in _nvidia_dirs():
        cands += sorted(glob.glob(os.path.join(d, "lib", "libnvrtc.so.1[0-9]")), reverse=True)
    cands += ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            cands += sorted(glob.glob(os.path.join(os.environ[var], "lib64", "libnvrtc.so.1[0-9]")), reverse=True)
    cands += sorted(glob.glob("/usr/local/cuda/lib64/libnvrtc.so.1[0-9]"), reverse=True)
    errors = []
    for c in cands:
        d = os.path.dirname(c)
        if d:  # its builtins beside it, for layouts whose loader path does not find them
            for b in sorted(glob.glob(os.path.join(d, "libnvrtc-builtins.so.*"))):
                try:
                    ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
                    break
                except OSError:
                    pass
        try:
            lib = ctypes.CDLL(c)
        except OSError as e:
            errors.append(str(e))
            continue
        lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_char_p,
                                           ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
        lib.nvrtcCompileProgram.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        for f in ("nvrtcGetProgramLogSize", "nvrtcGetCUBINSize", "nvrtcGetPTXSize"):
            getattr(lib, f).argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
        for f in ("nvrtcGetProgramLog", "nvrtcGetCUBIN", "nvrtcGetPTX"):
            getattr(lib, f).argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.nvrtcVersion.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
        _NVRTC.append(lib)
        return lib
    raise CompileError(
        "no NVRTC found (libnvrtc.so.13): pip install 'nvidia-cuda-nvrtc==13.0.*', or set KSEARCH_NVRTC to the library"
    )


def nvrtc_version():
    """NVRTC's (major, minor)."""
    lib = nvrtc_library()
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def cuda_include_dir():
    """Where the CUDA headers are, for kernels that include them: $KSEARCH_CUDA_INCLUDE,
    $CUDA_HOME / $CUDA_PATH, /usr/local/cuda, pip's nvidia-cuda-runtime (None if nowhere)."""
    cands = [d for d in os.environ.get("KSEARCH_CUDA_INCLUDE", "").split(":") if d]
    cands += [os.path.join(os.environ[v], "include") for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)]
    cands += ["/usr/local/cuda/include", "/usr/local/cuda/targets/x86_64-linux/include"]
    cands += [os.path.join(d, "include") for d in _nvidia_dirs()]
    return next((d for d in cands if os.path.isfile(os.path.join(d, "cuda_fp16.h"))), None)


def nvrtc_build(source, options, name="kernel.cu"):
    """(CUBIN bytes, PTX text, log) of `source` compiled with `options` (a real architecture,
    e.g. --gpu-architecture=sm_90a, so that NVRTC makes a CUBIN); raises CompileError with the
    log, whose lines name `name` and the line (`name(12): error: ...`)."""
    lib = nvrtc_library()
    prog = ctypes.c_void_p()
    rc = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None)
    if rc != 0:
        raise CompileError(f"nvrtcCreateProgram failed ({rc})")
    try:
        arr = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        rc = lib.nvrtcCompileProgram(prog, len(options), arr)
        n = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(max(n.value, 1))
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        if rc != 0:
            raise CompileError(log.strip() or f"nvrtcCompileProgram failed ({rc})")
        size = ctypes.c_size_t()
        if lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)) != 0 or size.value == 0:
            raise CompileError(f"NVRTC made no CUBIN (options: {' '.join(options)})")
        cubin = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetCUBIN(prog, cubin)
        ptx = ""
        if lib.nvrtcGetPTXSize(prog, ctypes.byref(size)) == 0 and size.value > 0:
            text = ctypes.create_string_buffer(size.value)
            if lib.nvrtcGetPTX(prog, text) == 0:
                ptx = text.value.decode(errors="replace")
        return cubin.raw, ptx, log
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def nvrtc_compile(source, options, name="kernel.cu"):
    """(CUBIN bytes, log) of `source`; raises CompileError with the log."""
    cubin, _, log = nvrtc_build(source, options, name)
    return cubin, log
