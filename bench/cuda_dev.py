#!/usr/bin/env python3
"""Develop and measure the CUDA knowledge-base kernels of tasks/*/cuda (and the MLX CUDA-dialect
bodies of tasks/*/mlx, wrapped the way MLX wraps them) on the GPU, outside ksearch.

  python3 bench/cuda_dev.py compile [task ...]   # local, no GPU: NVRTC-compile every admitted tunable
                                                 # combination of every workload (ctypes, libnvrtc.so.13),
                                                 # print registers/spills from ptxas
  python3 bench/cuda_dev.py prepare [task ...]   # local, no GPU: compile what `run` will run (same
                                                 # selection, same environment) into the CUBIN cache
  python3 bench/cuda_dev.py run [task ...]       # on the H200: CuPy RawModule + torch, check every element
                                                 # against a float64/float32 torch reference, time with events

`run` checks every element of every output against a torch reference (float64; float32 SDPA for
attention) on fresh inputs, with NaN-poisoned outputs inside NaN guard zones: an element left
unwritten, a write past a tensor (guard changed) or an unmasked read past an input (NaN guards
around every input) all count as bad. Correct configurations are timed with CUDA events (L2
flushed before each repetition, median) next to the task's peer measured in the same process:
PyTorch SDPA (its default back-end, cuDNN on the H200, grouped-query heads through enable_gqa)
and its cuDNN back-end explicitly for attention; mamba_ssm's selective-scan forward (built from
KS_MAMBA_PEER, default .peer/mamba_ssm, when present) for mamba_scan.

Launch sizes, shared bytes and scratch sizes are evaluated from the task.toml expressions. Kernels
are compiled by NVRTC (ctypes) for sm_90, or sm_90a when they use wgmma, and loaded by CuPy; CUBINs
are cached under KS_CUBIN_DIR (default .cubins) by a hash of source and options, so `prepare` here
saves the GPU machine the compiles.
Environment:
  KS_SUITES=search,heldout,stress   workload sets: the task's search and held-out workloads of the
                                    back-end, STRESS below (small ragged / grouped-query shapes),
                                    `mixed` (MIXED below: the shapes of bench/mixed_shapes.sh) and
                                    `anchor` (ANCHOR below: the shapes the peers were timed on),
                                    `ragged` (RAGGED below), `long` (LONG below)
  KS_BACKENDS=cuda,mlx-cuda         kernel sets: [backends.cuda] and [backends.mlx-cuda] (wrapped bodies)
  KS_KERNELS=a,b                    only these kernels (names; `mlx:flash` for an MLX body)
  KS_MAXCFG=n or name=n,...         configurations per kernel and workload (nearest to the defaults
                                    first; the specialisation tunables follow the shape)
  KS_STRESS_DIST=1                  stress suite: every configuration within this many changes of the
                                    nearest-to-default one
  KS_SEED_MAXFLOPS=2e9              the naive seed only on workloads below this many flops
  KS_TIME=1                         time (0: check only); KS_HELDOUT=0 drops the held-out suite
  KS_DEFS=X=1,...                   extra defines (debugging)
  KS_TIME_WRONG=1                   time runs whose check failed too (diagnostic builds whose output is
                                    wrong by design, such as flash_ws's KS_DIAG_SOFTMAX); still FAILED
  KS_FIX=POLY=0|1,U=8               only configurations whose tunables of these names take these values
                                    (alternatives separated by ";": a configuration matching any of them)
"""
import hashlib, itertools, os, re, sys, glob, math, ctypes, time
try:
    import tomllib
except ImportError:  # pragma: no cover
    import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Small shapes for correctness: ragged lengths (1, around tile sizes), odd batches, grouped-query
# and multi-query heads, every served head size, causal and not; channels not a multiple of the
# block, N = 8. Checked for every kernel near its defaults.
STRESS = {
    "attention": [
        {"B": 1, "H": 2, "Hkv": 1, "L": 1, "D": 64, "causal": 0},
        {"B": 1, "H": 4, "Hkv": 4, "L": 15, "D": 128, "causal": 1},
        {"B": 2, "H": 4, "Hkv": 2, "L": 17, "D": 96, "causal": 1},
        {"B": 1, "H": 3, "Hkv": 3, "L": 65, "D": 128, "causal": 0},
        {"B": 3, "H": 8, "Hkv": 2, "L": 127, "D": 64, "causal": 1},
        {"B": 1, "H": 6, "Hkv": 3, "L": 129, "D": 96, "causal": 0},
        # more work items than an H200 has SMs twice over: persistent blocks take several
        {"B": 2, "H": 16, "Hkv": 4, "L": 1100, "D": 128, "causal": 1},
        {"B": 3, "H": 8, "Hkv": 8, "L": 1500, "D": 64, "causal": 0},
        {"B": 2, "H": 4, "Hkv": 1, "L": 200, "D": 128, "causal": 1},
        {"B": 1, "H": 2, "Hkv": 2, "L": 255, "D": 64, "causal": 0},
        # flash_ws: the last rows of its SMALL_L path and the first of the tiled one; lengths where
        # WIDE=1 takes 176- and 160-key tiles
        {"B": 1, "H": 4, "Hkv": 2, "L": 32, "D": 64, "causal": 1},
        {"B": 1, "H": 2, "Hkv": 1, "L": 33, "D": 96, "causal": 0},
        {"B": 2, "H": 4, "Hkv": 1, "L": 520, "D": 128, "causal": 0},
        {"B": 1, "H": 4, "Hkv": 2, "L": 300, "D": 64, "causal": 0},
    ],
    "mamba_scan": [
        {"batch": 1, "L": 1, "D": 2048, "N": 16},
        {"batch": 2, "L": 5, "D": 1544, "N": 16},
        {"batch": 3, "L": 129, "D": 520, "N": 16},
        {"batch": 2, "L": 333, "D": 1536, "N": 8},
        {"batch": 1, "L": 1000, "D": 2048, "N": 16},
        {"batch": 2, "L": 70, "D": 771, "N": 16},
    ],
}

# The shapes of bench/mixed_shapes.sh (KS_SUITES=mixed): head sizes 128 and 64, a prefill and a
# decode-like batch, grouped-query heads, ragged lengths.
MIXED = {
    "attention": [
        {"B": 2, "H": 16, "Hkv": 16, "L": 3072, "D": 128, "causal": 1},
        {"B": 16, "H": 8, "Hkv": 8, "L": 512, "D": 64, "causal": 0},
        {"B": 1, "H": 32, "Hkv": 8, "L": 1000, "D": 128, "causal": 1},
        {"B": 2, "H": 32, "Hkv": 8, "L": 777, "D": 64, "causal": 1},
        {"B": 4, "H": 32, "Hkv": 8, "L": 2048, "D": 128, "causal": 0},
    ],
}

# Ragged shapes outside the task's workloads (KS_SUITES=ragged): non-causal lengths a little past a
# multiple of 128 (where flash_ws's WIDE=1 takes 160- or 176-key tiles), one where it does not, and
# short prompts (flash_ws's SMALL_L path).
RAGGED = {
    "attention": [
        {"B": 4, "H": 32, "Hkv": 8, "L": 300, "D": 128, "causal": 0},
        {"B": 8, "H": 16, "Hkv": 16, "L": 520, "D": 64, "causal": 0},
        {"B": 2, "H": 32, "Hkv": 32, "L": 140, "D": 128, "causal": 0},
        {"B": 3, "H": 32, "Hkv": 8, "L": 650, "D": 128, "causal": 0},
        {"B": 4, "H": 32, "Hkv": 8, "L": 24, "D": 128, "causal": 1},
        {"B": 16, "H": 32, "Hkv": 8, "L": 1, "D": 128, "causal": 0},
    ],
}

# The shapes the peers were timed on in ANCHORS.md (KS_SUITES=anchor): for the scan, one layer of
# mamba-370m at L=4096 and L=512, mamba-130m's d_inner at L=2048, mamba-790m's at L=1024, batch 4.
# For attention: issue #13's shape (B,H,L,D = 4,32,2048,128, causal and not) and the prefill of
# a Llama-family model with 32 query heads on 8 key/value heads (B = 1, causal, L = 2048 and 4096).
ANCHOR = {
    "attention": [
        {"B": 4, "H": 32, "Hkv": 32, "L": 2048, "D": 128, "causal": 0},
        {"B": 4, "H": 32, "Hkv": 32, "L": 2048, "D": 128, "causal": 1},
        {"B": 1, "H": 32, "Hkv": 8, "L": 2048, "D": 128, "causal": 1},
        {"B": 1, "H": 32, "Hkv": 8, "L": 4096, "D": 128, "causal": 1},
    ],
    "mamba_scan": [
        {"batch": 1, "L": 4096, "D": 2048, "N": 16},
        {"batch": 1, "L": 512, "D": 2048, "N": 16},
        {"batch": 1, "L": 2048, "D": 1536, "N": 16},
        {"batch": 1, "L": 1024, "D": 3072, "N": 16},
        {"batch": 4, "L": 1024, "D": 2048, "N": 16},
    ],
}

# Non-causal attention at growing L with about the same number of 128-row query blocks (KS_SUITES=long):
# how much of a call goes to each block's start and end (its first S product and softmax, its last PV
# product and output store), which a longer L amortises over more key tiles.
LONG = {
    "attention": [
        {"B": 4, "H": 32, "Hkv": 32, "L": 2048, "D": 128, "causal": 0},
        {"B": 2, "H": 32, "Hkv": 32, "L": 4096, "D": 128, "causal": 0},
        {"B": 1, "H": 32, "Hkv": 32, "L": 8192, "D": 128, "causal": 0},
        {"B": 1, "H": 16, "Hkv": 16, "L": 16384, "D": 128, "causal": 0},
    ],
}

SIZE = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "i32": 4}
TIME_WRONG = os.environ.get("KS_TIME_WRONG", "0") == "1"


def load_task(t):
    with open(os.path.join(ROOT, "tasks", t, "task.toml"), "rb") as f:
        return tomllib.load(f)

def ev(expr, env):
    e = str(expr).replace("&&", " and ").replace("||", " or ")
    e = re.sub(r"!(?!=)", " not ", e).replace("/", "//")
    return int(eval(e, {"ceil_div": lambda a, b: -(-a // b), "min": min, "max": max, "__builtins__": {}}, dict(env)))

def defaults(kern):
    return {t["name"]: t.get("default", t["values"][0]) for t in kern.get("tunables", [])}

def configs(kern, wl, allowed=None):
    """Admitted configurations; `allowed` (name -> values) narrows the product before the constraints are
    evaluated (a kernel with many tunables has millions of combinations)."""
    tun = kern.get("tunables", [])
    names = [t["name"] for t in tun]
    allowed = allowed or {}
    for vals in itertools.product(*[[v for v in t["values"] if t["name"] not in allowed or v in allowed[t["name"]]]
                                    for t in tun]):
        cfg = dict(zip(names, vals))
        env = dict(wl); env.update(cfg)
        if all(ev(c, env) for c in kern.get("constraints", [])):
            yield cfg

def fix_union(kern, fixes):
    """Per tunable, the values some KS_FIX alternative admits (every value where one leaves it free)."""
    out = {}
    for t in kern.get("tunables", []):
        vals = set()
        for fix in fixes:
            vals |= fix.get(t["name"], set(t["values"]))
        out[t["name"]] = vals
    return out


def near_default(kern, wl, allowed=None):
    """Admitted configurations ordered by how many tunables differ from the defaults (so a
    `specialisation` tunable such as HD follows the shape), with that distance."""
    d = defaults(kern)
    out = [(sum(cfg[k] != d[k] for k in d), i, cfg) for i, cfg in enumerate(configs(kern, wl, allowed))]
    out.sort(key=lambda x: (x[0], x[1]))
    return [(dist, cfg) for dist, _, cfg in out]

def launches(kern):
    if "launches" in kern and kern["launches"]:
        return kern["launches"]
    return [{"entry": kern["entry"], "grid": ["1"] * 3, "block": ["1"] * 3, "shared": "0"}]

def arch_for(src):
    """sm_90a for sources with Hopper-only instructions (as the ksearch back-end picks), else sm_90."""
    return "sm_90a" if ("wgmma" in src or "setmaxnreg" in src) else "sm_90"

def opts_for(task, cfg, src=""):
    o = [f"--gpu-architecture={arch_for(src)}", "--std=c++17"]
    o += [f"-D{k}={v}" for k, v in cfg.items()]
    o += [f"-D{d}" for d in os.environ.get("KS_DEFS", "").split(",") if d]  # extra defines (debugging)
    o += [f"-DKS_{k.upper()}={v}" for k, v in task.get("constants", {}).items()]
    return o

def dtype_on(task, backend, t):
    return task["backends"].get(backend, {}).get("dtypes", {}).get(t["name"], t["dtype"])

# ---------------------------------------------------------------- MLX CUDA bodies, wrapped as MLX does
def body_of(src, entry):
    """(header, body) of `// @kernel entry` (the whole file is one body without sections)."""
    lines = src.split("\n")
    marks = [(i, m.group(1)) for i, l in enumerate(lines) if (m := re.match(r"\s*//\s*@kernel\s+(\w+)\s*$", l))]
    if not marks:
        return "", src
    header = "\n".join(lines[: marks[0][0]])
    for k, (i, name) in enumerate(marks):
        if name == entry:
            end = marks[k + 1][0] if k + 1 < len(marks) else len(lines)
            return header, "\n".join(lines[i + 1 : end])
    raise KeyError(f"no `// @kernel {entry}` section")

CUDA_T = {"f16": "__half", "bf16": "__nv_bfloat16", "f64": "double", "i32": "int", "f32": "float"}

def mlx_io(task, backend, kern, la):
    """(inputs, outputs) of one MLX launch: [(name, dtype)] (task tensors, else scratch)."""
    specs = {t["name"]: dtype_on(task, backend, t) for t in task["inputs"] + task["outputs"]}
    for s in kern.get("scratch", []):
        specs[s["name"]] = s.get("dtype", "f32")
    ins = la.get("inputs") or [t["name"] for t in task["inputs"]]
    outs = la.get("outputs") or [t["name"] for t in task["outputs"]]
    return [(n, specs[n]) for n in ins], [(n, specs[n]) for n in outs]

def mlx_wrap(task, backend, kern, la, template, src):
    """A CUDA translation unit for one launch, as mx.fast.cuda_kernel builds it (without MLX's
    device headers, which shipped bodies do not use): inputs `const T*`, outputs `T*`, every axis
    and tunable a `constexpr int`, the task constants as `KS_<NAME>`."""
    header, body = body_of(src, la["entry"])
    if re.search(r"\w+_(shape|strides|ndim)\b", body):
        raise RuntimeError("bodies using *_shape / *_strides are not supported here")
    ins, outs = mlx_io(task, backend, kern, la)
    s = "#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#define inf (__int_as_float(0x7f800000))\n"
    for k, v in task.get("constants", {}).items():
        s += f"constexpr float KS_{k.upper()} = {float(v)!r}f;\n"
    s += header + "\nnamespace mlx { namespace core { namespace cu {\n"
    params = [f"const {CUDA_T[d]}* {n}" for n, d in ins] + [f"{CUDA_T[d]}* {n}" for n, d in outs]
    s += 'extern "C" __global__ void ks_%s(%s) {\n' % (la["entry"], ", ".join(params))
    for n, v in sorted(template.items()):
        s += f"  constexpr int {n} = {v};\n"
    return s + body + "\n}\n}}}\n"

# ---------------------------------------------------------------- NVRTC (ctypes) and the CUBIN cache
def nvrtc_lib():
    cands = [os.path.join(d, "libnvrtc.so.13") for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
    cands = [c for c in cands if os.path.exists(c)]
    cands += glob.glob(os.path.join(sys.prefix, "lib", "python*", "site-packages", "nvidia", "cu13", "lib", "libnvrtc.so.13"))
    cands += glob.glob("/root/.pyenv/versions/*/lib/python*/site-packages/nvidia/cu13/lib/libnvrtc.so.13")
    cands += glob.glob("/usr/local/cuda/lib64/libnvrtc.so.13") + glob.glob("/usr/local/cuda/targets/x86_64-linux/lib/libnvrtc.so.13")
    if not cands:
        sys.exit("libnvrtc.so.13 not found: pip install nvidia-cuda-nvrtc==13.0.*")
    d = os.path.dirname(cands[0])
    for b in sorted(glob.glob(os.path.join(d, "libnvrtc-builtins.so.13*"))):
        try:
            ctypes.CDLL(b, mode=ctypes.RTLD_GLOBAL)
            break
        except OSError:
            pass
    return ctypes.CDLL(cands[0])

def cuda_include():
    """Where cuda_fp16.h lives (for wrapped MLX bodies): KSEARCH_CUDA_INCLUDE, pip's CUDA runtime
    headers, or the CUDA toolkit."""
    cands = [os.environ.get("KSEARCH_CUDA_INCLUDE", "")]
    cands += glob.glob(os.path.join(sys.prefix, "lib", "python*", "site-packages", "nvidia", "cu13", "include"))
    cands += glob.glob("/root/.pyenv/versions/*/lib/python*/site-packages/nvidia/cu13/include")
    cands += ["/usr/local/cuda/include", "/usr/local/cuda/targets/x86_64-linux/include"]
    for c in cands:
        if c and os.path.exists(os.path.join(c, "cuda_fp16.h")):
            return c
    return None

def nvrtc_cubin(lib, src, opts):
    """(rc, log, cubin bytes) for a real architecture."""
    prog = ctypes.c_void_p()
    lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"k.cu", 0, None, None)
    arr = (ctypes.c_char_p * len(opts))(*[x.encode() for x in opts])
    r = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t(); lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value); lib.nvrtcGetProgramLog(prog, buf)
    cubin = b""
    if r == 0:
        m = ctypes.c_size_t(); lib.nvrtcGetCUBINSize(prog, ctypes.byref(m))
        cb = ctypes.create_string_buffer(m.value); lib.nvrtcGetCUBIN(prog, cb)
        cubin = cb.raw
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return r, buf.value.decode(errors="replace"), cubin

def nvrtc_compile(lib, src, opts):
    r, log, _ = nvrtc_cubin(lib, src, opts)
    return r, log

_lib = None
def cubin_for(src, opts):
    """The CUBIN of (src, opts) from the cache, compiled (and cached) when missing."""
    global _lib
    d = os.environ.get("KS_CUBIN_DIR", os.path.join(ROOT, ".cubins"))
    key = hashlib.sha1((src + "\0" + "\0".join(opts)).encode()).hexdigest()[:24]
    path = os.path.join(d, key + ".cubin")
    if os.path.exists(path):
        return path, False
    if _lib is None:
        _lib = nvrtc_lib()
    inc = [f"--include-path={cuda_include()}"] if "#include" in src and cuda_include() else []
    r, log, cubin = nvrtc_cubin(_lib, src, opts + inc)
    if r != 0:
        raise RuntimeError("compile failed: " + log[:2000])
    os.makedirs(d, exist_ok=True)
    with open(path + ".tmp", "wb") as f:
        f.write(cubin)
    os.replace(path + ".tmp", path)
    return path, True

def cmd_compile(tasks):
    lib = nvrtc_lib()
    bad = 0
    for t in tasks:
        task = load_task(t)
        cu = task["backends"]["cuda"]
        kernels = [dict(cu["seed"], name="seed")] + cu.get("kernels", [])
        for kern in kernels:
            src = open(os.path.join(ROOT, "tasks", t, kern["file"])).read()
            seen = {}
            for wl in cu["search"] + cu.get("heldout", []):
                for cfg in configs(kern, wl):
                    key = tuple(sorted(cfg.items()))
                    if key in seen:
                        continue
                    r, log = nvrtc_compile(lib, src, opts_for(task, cfg, src) + ["--ptxas-options=-v"])
                    regs = ",".join(re.findall(r"Used (\d+) registers", log))
                    spill = re.findall(r"(\d+) bytes spill stores", log)
                    smem = re.findall(r"(\d+) bytes smem", log)
                    seen[key] = 1
                    status = "ok" if r == 0 else "FAIL"
                    if r != 0:
                        bad += 1
                    sp = max(map(int, spill)) if spill else 0
                    print(f"{t:11s} {kern['name']:14s} {status:4s} regs={regs:10s} spill={sp:<5d} smem={','.join(smem):8s} {cfg}")
                    if r != 0:
                        print(log[:3000])
            print(f"{t} {kern['name']}: {len(seen)} distinct configs")
    print("failures:", bad)
    return bad

# ---------------------------------------------------------------- what `run` runs (shared with `prepare`)
def plan(tasks):
    """[(task name, task, backend, suite, workload index, workload, kernel, [configs])], in run order."""
    suites = [s for s in os.environ.get("KS_SUITES", "search,heldout,stress").split(",") if s]
    if os.environ.get("KS_HELDOUT", "1") == "0":
        suites = [s for s in suites if s != "heldout"]
    backends = [b for b in os.environ.get("KS_BACKENDS", "cuda,mlx-cuda").split(",") if b]
    only = [k for k in os.environ.get("KS_KERNELS", "").split(",") if k]
    mc = os.environ.get("KS_MAXCFG", "1000")
    limits = dict((a, int(b)) for a, b in (x.split("=") for x in mc.split(","))) if "=" in mc else {}
    seed_max = float(os.environ.get("KS_SEED_MAXFLOPS", "2e9"))
    dist = int(os.environ.get("KS_STRESS_DIST", "1"))
    # KS_FIX: alternatives separated by ";", a configuration kept when it matches any of them
    fixes = [{a: {int(v) for v in b.split("|")} for a, b in (x.split("=") for x in alt.split(",") if x)}
             for alt in os.environ.get("KS_FIX", "").split(";")]
    out = []
    for tn in tasks:
        task = load_task(tn)
        for suite in suites:
            for be in backends:
                if be not in task["backends"]:
                    continue
                bs = task["backends"][be]
                named = {"stress": STRESS, "mixed": MIXED, "anchor": ANCHOR, "ragged": RAGGED, "long": LONG}
                wls = named[suite].get(tn, []) if suite in named else bs.get(suite, [])
                kernels = [dict(bs["seed"], name="seed")] + bs.get("kernels", [])
                for wi, wl in enumerate(wls):
                    flops = ev(task["flops"], wl) if task.get("flops") else 0
                    for kern in kernels:
                        kname = kern["name"] if be == "cuda" else "mlx:" + kern["name"]
                        if only and kname not in only:
                            continue
                        if kern["name"] == "seed" and suite != "stress" and flops > seed_max:
                            continue
                        near = [(d, c) for d, c in near_default(kern, wl, fix_union(kern, fixes))
                                if any(all(c[k] in v for k, v in fix.items() if k in c) for fix in fixes)]
                        if not near:
                            continue
                        if suite == "stress":
                            cfgs = [c for d, c in near if d <= near[0][0] + dist]
                        else:
                            cfgs = [c for _, c in near][: limits.get(kname, int(mc) if "=" not in mc else 1000)]
                        out.append((tn, task, be, suite, wi, wl, kern, kname, cfgs))
    return out

def sources(tn, task, be, kern, cfg, wl):
    """[(launch, source, options)] of one kernel configuration."""
    src = open(os.path.join(ROOT, "tasks", tn, kern["file"])).read()
    if be == "cuda":
        return [(la, src, opts_for(task, cfg, src)) for la in launches(kern)]
    template = dict(wl); template.update(cfg)
    res = []
    for la in launches(kern):
        s = mlx_wrap(task, be, kern, la, template, src)
        res.append((la, s, [f"--gpu-architecture={arch_for(s)}", "--std=c++17"]))
    return res

def cmd_prepare(tasks):
    n = new = bad = 0
    t0 = time.time()
    for tn, task, be, suite, wi, wl, kern, kname, cfgs in plan(tasks):
        for cfg in cfgs:
            for la, src, opts in sources(tn, task, be, kern, cfg, wl):
                n += 1
                try:
                    _, fresh = cubin_for(src, opts)
                    new += fresh
                except Exception as e:
                    bad += 1
                    print("FAIL", tn, be, kname, cfg, wl, str(e)[:1500])
    print(f"prepare: {n} modules, {new} compiled now, {bad} failed, {time.time() - t0:.0f} s")
    return bad

# ---------------------------------------------------------------- GPU runs (H200: CuPy + torch)
def _gpu_imports():
    global torch, cp, np
    import torch, cupy as cp, numpy as np

def tdt(name):
    return {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64, "i32": torch.int32}[name]

GUARD = 1 << 16  # elements of NaN guard before and after every input and output

def guarded(n, dtype, fill):
    """A flat tensor of n elements inside guard zones, and the whole buffer."""
    buf = torch.full((n + 2 * GUARD,), fill, device="cuda", dtype=dtype)
    return buf[GUARD:GUARD + n], buf

def guards_intact(buf, fill):
    g = torch.cat([buf[:GUARD], buf[-GUARD:]]).float()
    return bool(torch.isnan(g).all()) if math.isnan(fill) else bool((g == fill).all())

def make_inputs(task, wl, seed, backend="cuda"):
    """The inputs (each inside NaN guard zones) and their whole buffers."""
    g = torch.Generator(device="cuda"); g.manual_seed(seed)
    ins, bufs = [], []
    for t in task["inputs"]:
        shape = [ev(d, wl) for d in t["shape"]]
        init = t.get("init", {"dist": "normal", "mean": 0.0, "std": 1.0})
        x = torch.empty(shape, device="cuda", dtype=torch.float32)
        if init["dist"] == "normal":
            x.normal_(init.get("mean", 0.0), init.get("std", 1.0), generator=g)
        else:
            x.uniform_(init["lo"], init["hi"], generator=g)
        view, buf = guarded(x.numel(), tdt(dtype_on(task, backend, t)), float("nan"))
        view.copy_(x.reshape(-1))
        ins.append(view.view(shape)); bufs.append(buf)
    return ins, bufs

def reference(task, wl, ins):
    """float64 (float32 for attention) torch references following ksearch-core::reference."""
    name = task["reference"]
    X = [x.double() for x in ins]
    if name == "softmax":
        return [torch.softmax(X[0], dim=-1)]
    if name == "rmsnorm":
        eps = task.get("constants", {}).get("eps", 1e-5)
        x, w = X
        return [x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps) * w]
    if name == "attention":
        q, k, v = [x.float() for x in ins]
        g = q.shape[1] // k.shape[1]  # grouped-query heads: head h reads kv head h // g
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
        return [torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(wl["causal"]))]
    if name == "mamba_step":
        u, dl, A, Bm, Cm, Dv, s0 = X
        s1 = torch.exp(dl[:, :, None] * A[None]) * s0 + (dl * u)[:, :, None] * Bm[:, None, :]
        y = (s1 * Cm[:, None, :]).sum(-1) + Dv[None] * u
        return [y, s1]
    if name == "mamba_scan":
        u, dl, A, Bm, Cm, Dv = X
        b, L, D = u.shape
        h = torch.zeros(b, D, A.shape[1], dtype=torch.float64, device="cuda")
        ys = torch.empty(b, L, D, dtype=torch.float64, device="cuda")
        dA = torch.exp(dl[..., None] * A[None, None])          # [b, L, D, N]
        dBu = (dl * u)[..., None] * Bm[:, :, None, :]
        for t in range(L):
            h = dA[:, t] * h + dBu[:, t]
            ys[:, t] = (h * Cm[:, t, None, :]).sum(-1)
        return [ys + Dv * u, h]
    raise KeyError(name)

_mods = {}
def module(path):
    if path not in _mods:
        _mods[path] = cp.RawModule(path=path)
    return _mods[path]

class Runner:
    """One kernel configuration on one workload: outputs poisoned (NaN) inside NaN guard zones."""
    def __init__(self, task_name, task, backend, kern, cfg, wl, ins):
        self.task = task
        env = dict(wl); env.update(cfg)
        self.outs, self.bufs = [], []
        for t in task["outputs"]:
            shape = [ev(d, wl) for d in t["shape"]]
            view, buf = guarded(math.prod(shape), tdt(dtype_on(task, backend, t)), float("nan"))
            self.outs.append(view.view(shape)); self.bufs.append(buf)
        scratch = {}
        for s in kern.get("scratch", []):
            dt = s.get("dtype", "f32")
            scratch[s["name"]] = torch.full(((ev(s["bytes"], env) + SIZE[dt] - 1) // SIZE[dt],), float("nan"),
                                            device="cuda", dtype=tdt(dt))
        named = {t["name"]: x for t, x in zip(task["inputs"], ins)}
        named.update({t["name"]: x for t, x in zip(task["outputs"], self.outs)})
        named.update(scratch)
        self.calls = []
        for la, src, opts in sources(task_name, task, backend, kern, cfg, wl):
            path, _ = cubin_for(src, opts)
            mod = module(path)
            sh = ev(la.get("shared", "0"), env)
            grid = [ev(x, env) for x in la["grid"]]
            block = tuple(ev(x, env) for x in la["block"])
            if backend == "cuda":
                f = mod.get_function(la["entry"])
                axes = [np.int64(wl[a]) for a in task["axes"]]
                args = tuple(cp.asarray(t) for t in ins + self.outs + list(scratch.values())) + tuple(axes)
            else:  # MLX: grid counts threads; arguments are the launch's inputs then outputs, by name
                f = mod.get_function("ks_" + la["entry"])
                grid = [-(-g // b) for g, b in zip(grid, block)]
                lin, lout = mlx_io(task, backend, kern, la)
                args = tuple(cp.asarray(named[n]) for n, _ in lin + lout)
            if sh > 48 * 1024:
                f.max_dynamic_shared_size_bytes = sh
            self.calls.append((f, tuple(grid), block, sh, args))
    def __call__(self):
        for f, grid, block, sh, args in self.calls:
            f(grid, block, args, shared_mem=sh)
    def guards_ok(self):
        return all(guards_intact(b, float("nan")) for b in self.bufs)

FLUSH = None
def timeit(fn, reps=25, warm=3):
    global FLUSH
    if FLUSH is None:
        FLUSH = torch.empty(256 * 1024 * 1024 // 4, device="cuda", dtype=torch.float32)
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    t0 = time.time(); fn(); torch.cuda.synchronize(); one = time.time() - t0
    if one > 0.05:
        reps = 3
    ts = []
    for _ in range(reps):
        FLUSH.fill_(1.0)
        a = torch.cuda.Event(enable_timing=True); b = torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]

def check(task, outs, refs, backend="cuda"):
    worst = 0.0; nbad = 0
    for t, o, r in zip(task["outputs"], outs, refs):
        tol = task["tolerance"][dtype_on(task, backend, t)]
        o64 = o.double(); r64 = r.double()
        err = (o64 - r64).abs()
        lim = tol["atol"] + tol["rtol"] * r64.abs()
        bad = ~(err <= lim)   # NaN (poison left, or a NaN guard read) counts as bad
        nb = int(bad.sum())
        nbad += nb
        worst = max(worst, float((err / lim).nan_to_num(nan=1e30).max()))
        if nb:  # where the bad elements are: first few indices, and along each axis how many indices hold any
            idx = bad.nonzero()[:4].tolist()
            spread = [int(bad.transpose(0, i).reshape(bad.shape[i], -1).any(1).sum()) for i in range(bad.dim())]
            print(f"    {t['name']}: {nb} of {bad.numel()} bad; first {idx}; per axis, indices with a bad element: {spread} of {list(bad.shape)};"
                  f" got {o64[tuple(idx[0])].item():.4g} want {r64[tuple(idx[0])].item():.4g}")
    return nbad, worst

_scan_peer = None
def scan_peer():
    """mamba_ssm's selective-scan forward, built from KS_MAMBA_PEER (None when absent)."""
    global _scan_peer
    if _scan_peer is None:
        d = os.environ.get("KS_MAMBA_PEER", os.path.join(ROOT, ".peer", "mamba_ssm"))
        _scan_peer = False
        if os.path.exists(os.path.join(d, "peer.py")):
            sys.path.insert(0, d)
            try:
                import peer
                t0 = time.time()
                _scan_peer = (peer, peer.build())
                print(f"mamba_ssm peer ready in {time.time() - t0:.0f} s", flush=True)
            except Exception as e:
                print("mamba_ssm peer unavailable:", repr(e)[:500], flush=True)
    return _scan_peer or None

def peers(task_name, task, wl, ins):
    """[(name, time us)] of library peers, measured now."""
    if task_name == "attention":
        from torch.nn.attention import sdpa_kernel, SDPBackend
        q, k, v = ins
        gqa = q.shape[1] != k.shape[1]
        f = torch.nn.functional.scaled_dot_product_attention
        res = [("torch SDPA", timeit(lambda: f(q, k, v, is_causal=bool(wl["causal"]), enable_gqa=gqa)))]
        try:
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                res.append(("cuDNN SDPA", timeit(lambda: f(q, k, v, is_causal=bool(wl["causal"]), enable_gqa=gqa))))
        except Exception:
            g = q.shape[1] // k.shape[1]
            ke, ve = k.repeat_interleave(g, 1).contiguous(), v.repeat_interleave(g, 1).contiguous()
            try:
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    res.append(("cuDNN SDPA (kv expanded)", timeit(lambda: f(q, ke, ve, is_causal=bool(wl["causal"])))))
            except Exception as e:
                print("    cuDNN SDPA:", repr(e)[:200])
        return res
    if task_name == "mamba_scan":
        p = scan_peer()
        if p:
            return [("mamba_ssm", p[0].time_us(p[1], wl["batch"], wl["L"], wl["D"], wl["N"]))]
        return []
    if task_name == "softmax":
        return [("torch.softmax", timeit(lambda: torch.softmax(ins[0], -1)))]
    if task_name == "rmsnorm":
        return [("F.rms_norm", timeit(lambda: torch.nn.functional.rms_norm(ins[0], (ins[0].shape[-1],), ins[1], 1e-5)))]
    return []

def nbytes(task, wl, backend="cuda"):
    return sum(math.prod(ev(d, wl) for d in t["shape"]) * SIZE[dtype_on(task, backend, t)]
               for t in task["inputs"] + task["outputs"])

def run(tasks):
    _gpu_imports()
    print(torch.cuda.get_device_name(), torch.__version__, "cupy", cp.__version__, time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    do_time = os.environ.get("KS_TIME", "1") != "0"
    table, failures, nchecked = [], [], 0
    bycfg, peer_us = {}, {}  # (suite, kernel, config) -> {workload: us}; (suite, workload) -> first peer's us
    jobs = plan(tasks)
    # group by (task, suite, backend, workload): one input draw, one reference, one peer measurement
    groups = {}
    for j in jobs:
        groups.setdefault((j[0], j[3], j[2], j[4]), []).append(j)
    for (tn, suite, be, wi), js in groups.items():
        task, wl = js[0][1], js[0][5]
        ins, inbufs = make_inputs(task, wl, 1234 + wi, be)
        refs = reference(task, wl, ins)
        flops = ev(task["flops"], wl) if task.get("flops") else 0
        prs = peers(tn, task, wl, ins) if do_time and suite != "stress" else []
        for pname, pus in prs:
            print(f"{tn:10s} {suite[0]} {str(wl):48s} {'peer ' + pname:12s} {pus:10.2f} us", flush=True)
        if prs:
            peer_us[(tn, suite, str(wl))] = prs[0][1]
        best = {}
        for _, _, _, _, _, _, kern, kname, cfgs in js:
            dflt = defaults(kern)
            for cfg in cfgs:
                r = None
                try:
                    r = Runner(tn, task, be, kern, cfg, wl, ins)
                    r(); torch.cuda.synchronize()
                    nbad, worst = check(task, r.outs, refs, be)
                    if not r.guards_ok():
                        print("    a guard zone after an output was written")
                        nbad = max(nbad, 1)
                    if not all(guards_intact(b, float("nan")) for b in inbufs):
                        print("    a guard zone around an input was written")
                        nbad = max(nbad, 1)
                    us = timeit(r) if do_time and suite != "stress" and (nbad == 0 or TIME_WRONG) else float("nan")
                except Exception as e:  # compile or launch failure
                    print("ERROR", tn, kname, cfg, repr(e)[:400]); nbad, worst, us = -1, 0, float("nan")
                nchecked += 1
                isdef = cfg == dflt
                line = f"{tn:10s} {suite[0]} {str(wl):48s} {kname:12s} {us:10.2f} us bad={nbad} err/tol={worst:.3f} {'[default] ' if isdef else ''}{cfg}"
                print(line, flush=True)
                if nbad != 0:
                    failures.append(line)
                if nbad == 0 and us == us:
                    bycfg.setdefault((tn, suite, kname, str(sorted(cfg.items()))), {})[str(wl)] = us
                if nbad == 0 and us == us and (kname not in best or us < best[kname][0]):
                    best[kname] = (us, cfg)
                del r
        for kname, (us, cfg) in best.items():
            if tn == "attention":
                extra = f"{flops / (us * 1e-6) / 1e12:6.1f} TFLOP/s"
            else:
                gbs = nbytes(task, wl, be) / (us * 1e-6) / 1e9
                extra = f"{gbs:6.0f} GB/s"
            if tn == "mamba_scan":
                extra += f" {us / (wl['batch'] * wl['L']) * 1e3:7.2f} ns/token"
            ratio = "".join(f"  {pname} {pus:.1f} us: {pus / us:.2f}x" for pname, pus in prs)
            table.append(f"{tn:10s} {suite[0]} {str(wl):58s} {kname:12s} {us:9.1f} us {extra}{ratio}  {cfg if kname != 'seed' else ''}")
        del ins, inbufs, refs
        torch.cuda.empty_cache()
    # One configuration for every workload of a suite: those correct and timed on all of them, by
    # their worst ratio against the peer (or, without a peer, their worst time against the best).
    nwl = {}
    for (tn, suite, kname, _), d in bycfg.items():
        nwl[(tn, suite, kname)] = max(nwl.get((tn, suite, kname), 0), len(d))
    across = []
    for key in sorted(nwl):
        if nwl[key] < 2:
            continue
        tn, suite, kname = key
        full = [(c, d) for (t, s_, k, c), d in bycfg.items() if (t, s_, k) == key and len(d) == nwl[key]]
        wls = sorted(full[0][1]) if full else []
        fastest = {w: min(d[w] for _, d in full) for w in wls}
        def score(d):
            return min((peer_us[(tn, suite, w)] / d[w]) if (tn, suite, w) in peer_us else fastest[w] / d[w] for w in wls)
        full.sort(key=lambda cd: -score(cd[1]))
        for c, d in full[:6]:
            across.append(f"{tn:10s} {suite[0]} {kname:12s} worst {score(d):5.2f}x  " +
                          " ".join(f"{d[w]:7.1f}" for w in wls) + f"  {c}")
    print(f"\n==== checked {nchecked} (kernel, configuration, workload) runs on every element; {len(failures)} failed ====")
    for l in failures:
        print("FAILED", l)
    print("\n==== summary (best correct config per kernel; peers measured in the same process) ====")
    for l in table:
        print(l)
    if across:
        print("\n==== one configuration for all workloads of a suite (worst ratio to the peer, or to the fastest; times in us, workloads sorted) ====")
        for l in across:
            print(l)
    return len(failures)

def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    mode, tasks = sys.argv[1], sys.argv[2:] or ["softmax", "rmsnorm", "mamba_step", "mamba_scan", "attention"]
    if mode == "compile":
        sys.exit(1 if cmd_compile(tasks) else 0)
    if mode == "prepare":
        sys.exit(1 if cmd_prepare(tasks) else 0)
    if mode == "run":
        sys.exit(1 if run(tasks) else 0)
    sys.exit(__doc__)

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
