#!/usr/bin/env python3
"""A scan kernel that [backends.mlx-cuda] registers as a whole CUDA unit (--kernel, default pipe_scan:
tasks/mamba_scan/cuda/pipe_scan.cu, compiled with NVRTC and run with mx.fast.precompiled_cuda_kernel
through ksearch_mlx.runtime.CompiledCandidate, the MLX worker's and the exported modules' runtime)
against the same file and configuration on the CUDA back-end, in one process, on the five anchor shapes.

    python3 bench/mlx_scan.py --pick scan_anchor.log --top 2        # the fastest CUDA configs per shape in a cuda_dev.py log
    python3 bench/mlx_scan.py --configs "CHUNK=128;SPT=2,SWZ=1"     # over the defaults

Per shape and configuration:
- CUDA: bench/cuda_dev.py's Runner (CuPy launches of the CUDA back-end's build, outputs poisoned inside
  NaN guard zones, every element checked against the float64 torch reference), timed with CUDA events,
  L2 flushed before each repetition, median of 25;
- MLX: the [backends.mlx-cuda] kernel of that name with the same tunables; checked against the MLX f32
  reference (ksearch_mlx.reference: y within the task's f16 tolerance, state within 1e-3 + 1e-2 * |ref|);
  timed as 16 calls queued and evaluated together on rotating input sets (at least 256 MB of inputs
  and outputs in rotation, so that the L2 holds no call's inputs), per-call share, median of 9 samples
  ("queued"), and as one synchronised call (mx.synchronize, the call, mx.eval, mx.synchronize),
  median of 15 ("single": MLX's dispatch and the host's synchronisation included), and on the GPU
  clock the MLX worker's judge uses (ksearch_mlx.gpuclock: 16 calls on rotating input sets queued
  behind a gate, timed between two %globaltimer stamps, one launch gap per call included; median of 9
  samples, "GPU clk"): what the kernel costs on a stream a model fills, without MLX's host time.
ratios = MLX GPU clock / CUDA (the target is <= 1.3) and MLX queued / CUDA. Writes $OUT/mlx_scan.json;
a table last.

--export-check: the module `ksearch export --mlx` writes for such a candidate (runtime.py, the TASK /
CANDIDATE / BACKEND lines, export_tail.py, concatenated as the exporter does) with the first
configuration: its `mamba_scan` on one shape against the f32 reference, and its `patch_mlx_lm` on a
small random mlx-lm Mamba (2 layers, d_inner 512, prompts of 1000 and 3 tokens, f32 weights, inputs
in f16 as the task's kernel dtypes) against stock mlx-lm's logits.
"""
import argparse
import json
import math
import os
import re
import statistics
import sys
import time
import tomllib
import traceback

# The GPU clock (ksearch_mlx.gpuclock) needs MLX's CUDA graphs off before MLX starts, as the worker runs.
os.environ.setdefault("MLX_USE_CUDA_GRAPHS", "0")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

OUT = os.environ.get("OUT", "/tmp")
SHAPES = [(1, 4096, 2048, 16), (1, 512, 2048, 16), (1, 2048, 1536, 16), (1, 1024, 3072, 16), (4, 1024, 2048, 16)]
T0 = time.perf_counter()


def log(msg):
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


KERNEL = "pipe_scan"


def kernel(task, backend):
    return next(k for k in task["backends"][backend]["kernels"] if k["name"] == KERNEL)


def full_cfg(k, over):
    d = {t["name"]: t.get("default", t["values"][0]) for t in k["tunables"]}
    d.update(over)
    return d


def pick(path, top):
    """The `top` fastest configurations of KERNEL per shape in a cuda_dev.py log (their union, in order)."""
    per = {}
    pat = re.compile(r"^mamba_scan a (\{[^}]*\})\s+" + KERNEL + r"\s+([\d.]+) us bad=0 .*?(\{'NS'[^}]*\})\s*$")
    with open(path) as f:
        for line in f:
            m = pat.match(line.strip())
            if m:
                wl, us, cfg = eval(m.group(1)), float(m.group(2)), eval(m.group(3))
                per.setdefault((wl["batch"], wl["L"], wl["D"]), []).append((us, cfg))
    out = []
    for s in per:
        for _, c in sorted(per[s], key=lambda x: x[0])[:top]:
            if c not in out:
                out.append(c)
    return out


def parse_configs(text):
    res = []
    for part in text.split(";"):
        part = part.strip()
        res.append({} if part in ("", "default") else {a: int(b) for a, b in (x.split("=") for x in part.split(","))})
    return res


def label(cfg, dflt):
    return " ".join(f"{k}={v}" for k, v in cfg.items() if k != "NS" and dflt.get(k) != v) or "defaults"


def cuda_times(task, kc, cfgs, shape):
    """{config label: (us, bad)} on the CUDA back-end (cuda_dev.py's Runner)."""
    import cuda_dev as cd
    cd._gpu_imports()
    b, L, D, N = shape
    wl = {"batch": b, "L": L, "D": D, "N": N}
    ins, bufs = cd.make_inputs(task, wl, 1234, "cuda")
    refs = cd.reference(task, wl, ins)
    res = {}
    for cfg in cfgs:
        key = json.dumps(cfg, sort_keys=True)
        try:
            r = cd.Runner("mamba_scan", task, "cuda", kc, cfg, wl, ins)
            r(); cd.torch.cuda.synchronize()
            nbad, worst = cd.check(task, r.outs, refs, "cuda")
            nbad += 0 if r.guards_ok() else 1
            us = cd.timeit(r) if nbad == 0 else float("nan")
            res[key] = {"us": us, "bad": nbad, "err_tol": worst}
            del r
        except Exception:
            res[key] = {"us": float("nan"), "bad": -1, "error": traceback.format_exc()[-800:]}
        log(f"cuda {shape} {cfg}: {res[key]}")
    del ins, bufs, refs
    cd.torch.cuda.empty_cache()
    return res


CLOCK = None  # ksearch_mlx.gpuclock.GpuClock where MLX runs on CUDA


def mlx_times(task, km, source, cfgs, shape, reps=15, queued=16):
    import mlx.core as mx
    from ksearch_mlx import reference as ref
    from ksearch_mlx import runtime as rt
    b, L, D, N = shape
    axes = {"batch": b, "L": L, "D": D, "N": N}
    per_call = 2 * (2 * b * L * D + 2 * b * L * N) + 4 * (D * N + D) + 2 * b * L * D + 4 * b * D * N
    nsets = max(2, min(64, math.ceil(256e6 / per_call)))
    sets = []
    for i in range(nsets):
        ks = mx.random.split(mx.random.key(77 + 1000 * i + L + D), 6)
        sets.append({
            "u": mx.random.normal((b, L, D), key=ks[0]).astype(mx.float16),
            "delta": mx.random.uniform(0.001, 0.1, (b, L, D), key=ks[1]).astype(mx.float16),
            "A": mx.random.uniform(-16.0, -1.0, (D, N), key=ks[2]),
            "Bm": mx.random.normal((b, L, N), key=ks[3]).astype(mx.float16),
            "Cm": mx.random.normal((b, L, N), key=ks[4]).astype(mx.float16),
            "Dv": mx.random.uniform(0.5, 1.5, (D,), key=ks[5]),
        })
        mx.eval(sets[-1])
    want_y, want_h = ref.mamba_scan(sets[0], axes, {})
    mx.eval(want_y, want_h)
    res = {}
    for cfg in cfgs:
        key = json.dumps(cfg, sort_keys=True)
        row = {}
        try:
            cand = {"source": source, "launches": [{"shared": "0", **la} for la in km["launches"]],
                    "scratch": km.get("scratch", []), "defines": cfg,
                    "options": {**km.get("options", {}), "file": km["file"]}}
            cc = rt.CompiledCandidate(cand, task, "mlx-cuda")
            t0 = time.perf_counter()
            out = cc(sets[0], axes)
            mx.eval(out["y"], out["state"])
            mx.synchronize()
            row["first_call_s"] = time.perf_counter() - t0
            y, h = out["y"].astype(mx.float32), out["state"]
            dy, dh = mx.abs(y - want_y), mx.abs(h - want_h)
            bad_y = (dy > 1e-2 + 1e-2 * mx.abs(want_y)).sum() + mx.isnan(y).sum()
            bad_h = (dh > 1e-3 + 1e-2 * mx.abs(want_h)).sum() + mx.isnan(h).sum()
            mx.eval(bad_y, bad_h, dy, dh)
            row.update(bad_y=int(bad_y.item()), bad_state=int(bad_h.item()),
                       max_dy=float(mx.max(dy).item()), max_dstate=float(mx.max(dh).item()))

            def call(i):
                o = cc(sets[i % nsets], axes)
                return [o["y"], o["state"]]
            for i in range(3):
                mx.eval(call(i))
            single = []
            for i in range(reps):
                mx.synchronize()
                t0 = time.perf_counter()
                mx.eval(call(i))
                mx.synchronize()
                single.append(time.perf_counter() - t0)
            q = []
            for j in range(9):
                mx.synchronize()
                t0 = time.perf_counter()
                outs = [call(j * queued + i) for i in range(queued)]
                mx.eval(outs)
                mx.synchronize()
                q.append((time.perf_counter() - t0) / queued)
                del outs
            row["single_us"] = statistics.median(single) * 1e6
            row["queued_us"] = statistics.median(q) * 1e6
            if CLOCK is not None:
                g = []
                for j in range(9):
                    views = [sets[(j * queued + i) % nsets] for i in range(queued)]
                    g.append(CLOCK.time_calls([lambda v: cc(v, axes)] * queued, views)[0])
                row["gpu_us"] = statistics.median(g) * 1e6
                row["gpu_spread"] = (max(g) - min(g)) / statistics.median(g)
        except Exception:
            row["error"] = traceback.format_exc()[-1500:]
        res[key] = row
        log(f"mlx {shape} {cfg}: {json.dumps(row)[:600]}")
    del sets
    return res


def export_check(task, km, source, cfg):
    """The exported module of such a candidate: its scan and its mlx-lm patch."""
    import types
    import mlx.core as mx
    from mlx_lm.models import mamba
    from ksearch_mlx import reference as ref
    py = os.path.join(ROOT, "python", "ksearch_mlx")
    tj = {"name": task["name"], "description": task.get("description", ""), "axes": task["axes"],
          "inputs": [{k: i[k] for k in ("name", "shape", "dtype")} for i in task["inputs"]],
          "outputs": [{k: o[k] for k in ("name", "shape", "dtype")} for o in task["outputs"]],
          "constants": task.get("constants", {}),
          "backends": {b: {"dtypes": dict(v.get("dtypes", {}))} for b, v in task["backends"].items()}}
    cand = {"lang": "cuda", "source": source, "launches": [{"shared": "0", **la} for la in km["launches"]],
            "scratch": km.get("scratch", []), "defines": cfg, "constraints": km.get("constraints", []),
            "options": {**km.get("options", {}), "file": km["file"]}}
    text = (open(os.path.join(py, "runtime.py")).read() + "\nimport json\n"
            + f"TASK = json.loads(r'''{json.dumps(tj)}''')\n"
            + f"CANDIDATE = json.loads(r'''{json.dumps(cand)}''')\n" + 'BACKEND = "mlx-cuda"\n'
            + open(os.path.join(py, "export_tail.py")).read())
    mod = types.ModuleType("scan_mlx_exported")
    sys.modules[mod.__name__] = mod
    exec(compile(text, f"<exported {KERNEL}>", "exec"), mod.__dict__)
    res = {}
    b, L, D, N = 1, 2000, 1536, 16
    ks = mx.random.split(mx.random.key(5), 6)
    ins = {"u": mx.random.normal((b, L, D), key=ks[0]).astype(mx.float16),
           "delta": mx.random.uniform(0.001, 0.1, (b, L, D), key=ks[1]).astype(mx.float16),
           "A": mx.random.uniform(-16.0, -1.0, (D, N), key=ks[2]),
           "Bm": mx.random.normal((b, L, N), key=ks[3]).astype(mx.float16),
           "Cm": mx.random.normal((b, L, N), key=ks[4]).astype(mx.float16),
           "Dv": mx.random.uniform(0.5, 1.5, (D,), key=ks[5])}
    y, h = mod.mamba_scan(*(ins[n] for n in ("u", "delta", "A", "Bm", "Cm", "Dv")))
    wy, wh = ref.mamba_scan(ins, {"batch": b, "L": L, "D": D, "N": N}, {})
    dy = mx.abs(y.astype(mx.float32) - wy)
    res["module_scan"] = {"shape": [b, L, D, N], "bad_y": int((dy > 1e-2 + 1e-2 * mx.abs(wy)).sum().item()),
                          "max_dy": float(mx.max(dy).item()), "max_dstate": float(mx.max(mx.abs(h - wh)).item()),
                          "kernel": type(mod.KERNEL).__name__}
    log(f"export: module scan {res['module_scan']}")
    mx.random.seed(3)
    args = mamba.ModelArgs(model_type="mamba", vocab_size=256, hidden_size=256, intermediate_size=512, state_size=16,
                           num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=16,
                           use_bcdt_rms=False)
    m = mamba.Model(args)
    for layer in m.layers:
        layer.mixer.A_log = layer.mixer.A_log + 0.3 * mx.random.normal(layer.mixer.A_log.shape)
    m.set_dtype(mx.float32)
    mx.eval(m.parameters())
    for T in (1000, 3):
        ids = mx.random.randint(0, 256, (1, T))
        stock = m(ids, cache=m.make_cache())
        mx.eval(stock)
        unpatch = mod.patch_mlx_lm(fused_decode=False)
        try:
            got = m(ids, cache=m.make_cache())
            mx.eval(got)
            stats = dict(unpatch.stats)
        finally:
            unpatch()
        d = mx.abs(got.astype(mx.float32) - stock.astype(mx.float32))
        res[f"patch_T{T}"] = {"stats": stats, "max_abs_logit_diff": float(mx.max(d).item()),
                              "max_abs_logit": float(mx.max(mx.abs(stock)).item()),
                              "argmax_equal": float((mx.argmax(got, -1) == mx.argmax(stock, -1)).mean().item())}
        log(f"export: patch_mlx_lm T={T} {res[f'patch_T{T}']}")
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="", help="';'-separated NAME=v,... over the defaults")
    ap.add_argument("--pick", default="", help="a cuda_dev.py anchor log: take the kernel's fastest configurations per shape")
    ap.add_argument("--kernel", default="pipe_scan", help="its name in [backends.mlx-cuda] (a whole CUDA unit)")
    ap.add_argument("--top", type=int, default=2)
    ap.add_argument("--no-cuda", action="store_true")
    ap.add_argument("--export-check", action="store_true")
    a = ap.parse_args()
    global KERNEL
    KERNEL = a.kernel
    with open(os.path.join(ROOT, "tasks", "mamba_scan", "task.toml"), "rb") as f:
        task = tomllib.load(f)
    kc, km = kernel(task, "cuda"), kernel(task, "mlx-cuda")
    with open(os.path.join(ROOT, "tasks", "mamba_scan", km["file"])) as f:
        source = f.read()
    dflt = full_cfg(km, {})
    over = []
    if a.pick and os.path.exists(a.pick):
        over = pick(a.pick, a.top)
        log(f"picked from {a.pick}: {over}")
    over += [c for c in parse_configs(a.configs) if c not in over] if a.configs else []
    if not over:
        over = [{}]
    cfgs = []
    for c in over:
        fc = full_cfg(km, c)
        if fc not in cfgs:
            cfgs.append(fc)
    import mlx.core as mx
    from ksearch_mlx import gpuclock
    global CLOCK
    CLOCK, why = gpuclock.GpuClock.create()
    log(f"GPU clock: empty bracket {CLOCK.empty_ns / 1e3:.2f} us, self-check {CLOCK.check_us:.1f} us per call"
        if CLOCK else f"no GPU clock ({why}): MLX timed on the host clock only")
    log(f"mlx {mx.__version__}, {len(cfgs)} configurations: " + "; ".join(label(c, dflt) for c in cfgs))
    res = {"configs": cfgs, "shapes": {}}
    for shape in SHAPES:
        cu = {} if a.no_cuda else cuda_times(task, kc, cfgs, shape)
        ml = mlx_times(task, km, source, cfgs, shape)
        res["shapes"][",".join(map(str, shape[:3]))] = {"cuda": cu, "mlx": ml}
    if a.export_check:
        try:
            res["export"] = export_check(task, km, source, cfgs[0])
        except Exception:
            res["export"] = {"error": traceback.format_exc()[-2000:]}
            log("export check failed: " + res["export"]["error"])
    with open(os.path.join(OUT, "mlx_scan.json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = ["", f"==== {KERNEL}: MLX (whole CUDA unit) against the CUDA back-end, same configuration, us ====",
             f"{'batch,L,D':<12} {'CUDA':>8} {'MLX GPU clk':>11} {'MLX queued':>11} {'MLX single':>11} {'GPU/CUDA':>9} {'queued/CUDA':>11}  bad(cuda/mlx y/state)  configuration"]
    for s, d in res["shapes"].items():
        for c in cfgs:
            key = json.dumps(c, sort_keys=True)
            cu, ml = d["cuda"].get(key, {}), d["mlx"].get(key, {})
            nan = float("nan")
            cus, mg = cu.get("us", nan), ml.get("gpu_us", nan)
            mq, ms = ml.get("queued_us", nan), ml.get("single_us", nan)
            ok = cus == cus and cus > 0
            lines.append(f"{s:<12} {cus:8.1f} {mg:11.1f} {mq:11.1f} {ms:11.1f} {mg / cus if ok else nan:9.2f} "
                         f"{mq / cus if ok else nan:11.2f}  "
                         f"{cu.get('bad', '-')}/{ml.get('bad_y', 'E')}/{ml.get('bad_state', 'E')}  {label(c, dflt)}")
    if "export" in res:
        lines.append("export check: " + json.dumps(res["export"])[:1500])
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
