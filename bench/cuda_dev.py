#!/usr/bin/env python3
"""Develop and measure the CUDA knowledge-base kernels of tasks/*/cuda.

  python3 bench/cuda_dev.py compile [task ...]   # local, no GPU: NVRTC-compile every admitted tunable
                                                 # combination of every workload (ctypes, libnvrtc.so.13),
                                                 # print registers/spills from ptxas
  python3 bench/cuda_dev.py run [task ...]       # on the H200: CuPy RawModule + torch, check every element
                                                 # against a float64/float32 torch reference, time with events
Launch sizes, shared bytes and scratch sizes are evaluated from the task.toml expressions. Kernels
are compiled by NVRTC (ctypes) for sm_90, or sm_90a when they use wgmma, and loaded by CuPy.
Environment: KS_KERNELS=a,b (only these kernels), KS_MAXCFG=n or name=n,... (configs per
workload, the default first), KS_HELDOUT=0 (search workloads only), KS_DEFS=X=1,... (extra defines).
"""
import itertools, os, re, sys, glob, math, ctypes, time
try:
    import tomllib
except ImportError:  # pragma: no cover
    import tomli as tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

def load_task(t):
    with open(os.path.join(ROOT, "tasks", t, "task.toml"), "rb") as f:
        return tomllib.load(f)

def ev(expr, env):
    e = str(expr).replace("&&", " and ").replace("||", " or ")
    e = re.sub(r"!(?!=)", " not ", e).replace("/", "//")
    return int(eval(e, {"ceil_div": lambda a, b: -(-a // b), "min": min, "max": max, "__builtins__": {}}, dict(env)))

def configs(kern, wl):
    tun = kern.get("tunables", [])
    names = [t["name"] for t in tun]
    for vals in itertools.product(*[t["values"] for t in tun]):
        cfg = dict(zip(names, vals))
        env = dict(wl); env.update(cfg)
        if all(ev(c, env) for c in kern.get("constraints", [])):
            yield cfg

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

# ---------------------------------------------------------------- local NVRTC compile check
def nvrtc_lib():
    cands = glob.glob(os.path.join(sys.prefix, "lib", "python*", "site-packages", "nvidia", "cu13", "lib", "libnvrtc.so.13"))
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
    prog = ctypes.c_void_p()
    lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"k.cu", 0, None, None)
    arr = (ctypes.c_char_p * len(opts))(*[x.encode() for x in opts])
    r = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t(); lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    buf = ctypes.create_string_buffer(n.value); lib.nvrtcGetProgramLog(prog, buf)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return r, buf.value.decode(errors="replace")

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


# ---------------------------------------------------------------- GPU runs (H200: CuPy + torch)
def _gpu_imports():
    global torch, cp, np
    import torch, cupy as cp, numpy as np

TDT = {}
def tdt(name):
    return {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16, "f64": torch.float64, "i32": torch.int32}[name]

def make_inputs(task, wl, seed):
    g = torch.Generator(device="cuda"); g.manual_seed(seed)
    ins = []
    for t in task["inputs"]:
        shape = [ev(d, wl) for d in t["shape"]]
        init = t.get("init", {"dist": "normal", "mean": 0.0, "std": 1.0})
        x = torch.empty(shape, device="cuda", dtype=torch.float32)
        if init["dist"] == "normal":
            x.normal_(init.get("mean", 0.0), init.get("std", 1.0), generator=g)
        else:
            x.uniform_(init["lo"], init["hi"], generator=g)
        ins.append(x.to(tdt(t["dtype"])))
    return ins

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
_lib = None
def module(task_name, kern, cfg, task):
    """NVRTC (ctypes) to a CUBIN for sm_90 or sm_90a, loaded by CuPy from a file."""
    global _lib
    key = (task_name, kern["file"], tuple(sorted(cfg.items())))
    if key not in _mods:
        if _lib is None:
            _lib = nvrtc_lib()
        src = open(os.path.join(ROOT, "tasks", task_name, kern["file"])).read()
        r, log, cubin = nvrtc_cubin(_lib, src, opts_for(task, cfg, src))
        if r != 0:
            raise RuntimeError("compile failed: " + log[:2000])
        import tempfile
        fd, path = tempfile.mkstemp(suffix=".cubin")
        os.write(fd, cubin); os.close(fd)
        _mods[key] = cp.RawModule(path=path)
    return _mods[key]

class Runner:
    def __init__(self, task_name, task, kern, cfg, wl, ins):
        self.task = task
        env = dict(wl); env.update(cfg)
        mod = module(task_name, kern, cfg, task)
        self.outs = [torch.full([ev(d, wl) for d in t["shape"]], float("nan"), device="cuda", dtype=tdt(t["dtype"]))
                     for t in task["outputs"]]
        self.scratch = [torch.full(((ev(s["bytes"], env) + 3) // 4,), float("nan"), device="cuda", dtype=torch.float32)
                        for s in kern.get("scratch", [])]
        axes = [np.int64(wl[a]) for a in task["axes"]]
        ptrs = ins + self.outs + self.scratch
        args = tuple(cp.asarray(t) for t in ptrs) + tuple(axes)
        self.calls = []
        for la in launches(kern):
            f = mod.get_function(la["entry"])
            sh = ev(la.get("shared", "0"), env)
            if sh > 48 * 1024:
                f.max_dynamic_shared_size_bytes = sh
            grid = tuple(ev(x, env) for x in la["grid"])
            block = tuple(ev(x, env) for x in la["block"])
            self.calls.append((f, grid, block, sh))
        self.args = args
    def __call__(self):
        for f, grid, block, sh in self.calls:
            f(grid, block, self.args, shared_mem=sh)

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

def check(task, outs, refs):
    worst = 0.0; nbad = 0
    for t, o, r in zip(task["outputs"], outs, refs):
        tol = task["tolerance"][t["dtype"]]
        o64 = o.double(); r64 = r.double()
        err = (o64 - r64).abs()
        lim = tol["atol"] + tol["rtol"] * r64.abs()
        bad = ~(err <= lim)   # NaN counts as bad
        nb = int(bad.sum())
        nbad += nb
        worst = max(worst, float((err / lim).nan_to_num(nan=1e30).max()))
        if nb:  # where the bad elements are: first few indices, and along each axis how many indices hold any
            idx = bad.nonzero()[:4].tolist()
            spread = [int(bad.transpose(0, i).reshape(bad.shape[i], -1).any(1).sum()) for i in range(bad.dim())]
            print(f"    {t['name']}: {nb} of {bad.numel()} bad; first {idx}; per axis, indices with a bad element: {spread} of {list(bad.shape)};"
                  f" got {o64[tuple(idx[0])].item():.4g} want {r64[tuple(idx[0])].item():.4g}")
    return nbad, worst

def peer(task_name, task, wl, ins):
    """Time of a library peer (torch), or None."""
    if task_name == "attention":
        q, k, v = ins
        return "torch SDPA", timeit(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(wl["causal"])))
    if task_name == "softmax":
        return "torch.softmax", timeit(lambda: torch.softmax(ins[0], -1))
    if task_name == "rmsnorm":
        return "F.rms_norm", timeit(lambda: torch.nn.functional.rms_norm(ins[0], (ins[0].shape[-1],), ins[1], 1e-5))
    return None

def nbytes(task, wl):
    n = 0
    for t in task["inputs"] + task["outputs"]:
        n += math.prod(ev(d, wl) for d in t["shape"]) * {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "i32": 4}[t["dtype"]]
    return n

def run(tasks, sweep_all=True):
    _gpu_imports()
    print(torch.cuda.get_device_name(), torch.__version__, "cupy", cp.__version__, time.strftime("%Y-%m-%d %H:%M"))
    table = []
    for tn in tasks:
        task = load_task(tn)
        cu = task["backends"]["cuda"]
        for kind in ("search", "heldout") if os.environ.get("KS_HELDOUT", "1") != "0" else ("search",):
            for wi, wl in enumerate(cu[kind]):
                ins = make_inputs(task, wl, 1234 + wi)
                refs = reference(task, wl, ins)
                flops = ev(task["flops"].replace("/", "/"), wl) if task.get("flops") else 0
                pr = peer(tn, task, wl, ins)
                kernels = [dict(cu["seed"], name="seed")] + cu.get("kernels", [])
                only = [k for k in os.environ.get("KS_KERNELS", "").split(",") if k]
                if only:
                    kernels = [k for k in kernels if k["name"] in only]
                best = {}
                for kern in kernels:
                    cfgs = list(configs(kern, wl))
                    dflt = {t["name"]: t.get("default", t["values"][0]) for t in kern.get("tunables", [])}
                    if dflt in cfgs:  # the default first
                        cfgs.remove(dflt); cfgs.insert(0, dflt)
                    # KS_MAXCFG: one number for every kernel, or name=n pairs (others: 1000)
                    mc = os.environ.get("KS_MAXCFG", "1000")
                    if "=" in mc:
                        limit = dict((a, int(b)) for a, b in (x.split("=") for x in mc.split(","))).get(kern["name"], 1000)
                    else:
                        limit = int(mc)
                    for cfg in cfgs[:limit]:
                        try:
                            r = Runner(tn, task, kern, cfg, wl, ins)
                            r(); torch.cuda.synchronize()
                            nbad, worst = check(task, r.outs, refs)
                            us = timeit(r) if nbad == 0 or kern["name"] != "seed" else float("nan")
                        except Exception as e:  # compile or launch failure
                            print("ERROR", tn, kern["name"], cfg, repr(e)[:400]); nbad, worst, us = -1, 0, float("nan")
                        isdef = cfg == {t["name"]: t.get("default", t["values"][0]) for t in kern.get("tunables", [])}
                        line = f"{tn:10s} {kind[0]} {str(wl):48s} {kern['name']:12s} {us:10.2f} us bad={nbad} err/tol={worst:.3f} {'[default] ' if isdef else ''}{cfg}"
                        print(line, flush=True)
                        if nbad == 0 and (kern["name"] not in best or us < best[kern["name"]][0]):
                            best[kern["name"]] = (us, cfg)
                        if isdef:
                            best[kern["name"] + "/default"] = (us, cfg)
                        del r
                for kname, (us, cfg) in best.items():
                    gbs = nbytes(task, wl) / (us * 1e-6) / 1e9
                    extra = f"{flops / (us * 1e-6) / 1e12:7.1f} TFLOP/s" if tn == "attention" else f"{gbs:7.0f} GB/s ({gbs / 4200:.2f} of 4.2 TB/s)"
                    ratio = f"  vs {pr[0]} {pr[1]:.2f} us: {pr[1] / us:.2f}x" if pr else ""
                    if tn == "mamba_scan" and "seed" in best:
                        ratio = f"  vs seed: {best['seed'][0] / us:.1f}x"
                    table.append(f"{tn:10s} {kind[0]} {str(wl):48s} {kname:22s} {us:10.2f} us {extra}{ratio}  {cfg if kname != 'seed' else ''}")
                torch.cuda.empty_cache()
    print("\n==== summary (best correct config per kernel, and the default) ====")
    for l in table:
        print(l)
def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    mode, tasks = sys.argv[1], sys.argv[2:] or ["softmax", "rmsnorm", "mamba_step", "mamba_scan", "attention"]
    if mode == "compile":
        sys.exit(1 if cmd_compile(tasks) else 0)
    if mode == "run":
        run(tasks)

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main()
