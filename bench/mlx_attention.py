#!/usr/bin/env python3
"""The attention task's wgmma kernel inside MLX (mlx-cuda, a whole CUDA translation unit run with
mx.fast.precompiled_cuda_kernel) against mx.fast.scaled_dot_product_attention, on the GPU machine.

    python3 bench/mlx_attention.py                      # tunable variants, then every shape
    python3 bench/mlx_attention.py --module attention_mlx.py   # also a module from `ksearch export --mlx`

In one process, with the same f16 inputs for both (q [B,H,L,D], k and v [B,Hkv,L,D], normal(0,1)):
- the kernel's build comes from tasks/attention/task.toml, [backends.mlx-cuda] kernel
  `flash_wgmma` at its default tunables (HD set to D per shape, as the search specialises it),
  run through ksearch_mlx.runtime.CompiledCandidate, the worker's own runtime;
- first the tunable variants (--variants) at B,H,L,D = 4,32,2048,128, causal and not; the fastest
  (geometric mean of both) then runs every shape: 4,32,2048,128 and the task's mlx-cuda search and
  held-out workloads (ragged L, grouped- and multi-query heads, D 64/96/128, L = 1);
- timing as bench/mlx_e2e.py: mx.synchronize, the call, mx.eval, mx.synchronize, kernel and SDPA
  interleaved, median of --reps; also "queued": 16 calls evaluated together per sample (as a
  model's graph runs them and as the judge times calls under 1 ms), per-call share, median;
- checks: the kernel against SDPA in f16 and against SDPA on f32 copies of the inputs; "bad" counts
  elements beyond the task's f16 tolerance (atol 1e-2 + rtol 1e-2 * |ref|) against the f32 result.
ratio = SDPA time / kernel time (> 1: the kernel is faster). Writes $OUT/mlx_attention.json and
prints a table last.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time
import tomllib
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))

import mlx.core as mx  # noqa: E402

from ksearch_mlx import runtime as rt  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
MAIN = (4, 32, 32, 2048, 128)  # B, H, Hkv, L, D
T0 = time.perf_counter()


def log(msg):
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def load():
    with open(os.path.join(ROOT, "tasks", "attention", "task.toml"), "rb") as f:
        task = tomllib.load(f)
    b = task["backends"]["mlx-cuda"]
    # KS_ATT_KERNEL: another [backends.mlx-cuda] kernel of the task (bench/mlx_llama.py follows it too).
    name = os.environ.get("KS_ATT_KERNEL", "flash_wgmma")
    k = next(x for x in b["kernels"] if x["name"] == name)
    with open(os.path.join(ROOT, "tasks", "attention", k["file"])) as f:
        source = f.read()
    return task, k, source


def candidate(k, source, defines):
    d = {t["name"]: t.get("default", t["values"][0]) for t in k["tunables"]}
    d.update(defines)
    launches = [{"grid": ["1", "1", "1"], "block": ["1", "1", "1"], "shared": "0", **l} for l in k["launches"]]
    return {"source": source, "launches": launches, "scratch": [], "defines": d,
            "options": {**k.get("options", {}), "file": k["file"]}}


def admits(k, defines, axes):
    env = {**axes, **defines}
    return all(rt.eval_expr(c, env) != 0 for c in k.get("constraints", []))


def timed(fn, n=1):
    mx.synchronize()
    t0 = time.perf_counter()
    outs = [fn() for _ in range(n)]
    mx.eval(outs)
    mx.synchronize()
    return (time.perf_counter() - t0) / n


def compare(test, ref):
    a, b = test.astype(mx.float32), ref.astype(mx.float32)
    d = mx.abs(a - b)
    m, s, nans = mx.max(d), mx.max(mx.abs(b)), mx.isnan(a).sum()
    bad = (d > 1e-2 + 1e-2 * mx.abs(b)).sum()
    mx.eval(m, s, nans, bad)
    return {"max_abs": float(m.item()), "scale": float(s.item()), "nan": int(nans.item()), "bad": int(bad.item())}


class Case:
    def __init__(self, B, H, Hkv, L, D, seed=1234):
        self.B, self.H, self.Hkv, self.L, self.D = B, H, Hkv, L, D
        kq, kk, kv = mx.random.split(mx.random.key(seed + L + D + H), 3)
        self.q = mx.random.normal((B, H, L, D), key=kq).astype(mx.float16)
        self.k = mx.random.normal((B, Hkv, L, D), key=kk).astype(mx.float16)
        self.v = mx.random.normal((B, Hkv, L, D), key=kv).astype(mx.float16)
        mx.eval(self.q, self.k, self.v)
        self.scale = 1.0 / math.sqrt(D)

    def axes(self, causal):
        return {"B": self.B, "H": self.H, "Hkv": self.Hkv, "L": self.L, "D": self.D, "causal": int(causal)}

    def sdpa(self, causal):
        return lambda: mx.fast.scaled_dot_product_attention(
            self.q, self.k, self.v, scale=self.scale, mask="causal" if causal else None)

    def sdpa32(self, causal):
        return mx.fast.scaled_dot_product_attention(
            self.q.astype(mx.float32), self.k.astype(mx.float32), self.v.astype(mx.float32),
            scale=self.scale, mask="causal" if causal else None)


def run_case(case, causal, fn, reps, label, queued=16):
    row = {"label": label, "shape": [case.B, case.H, case.Hkv, case.L, case.D], "causal": bool(causal)}
    sd = case.sdpa(causal)
    try:
        t0 = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        row["first_call_s"] = time.perf_counter() - t0  # NVRTC + module load on a fresh build
        for _ in range(3):
            mx.eval(fn(), sd())
        tk, ts, qk, qs = [], [], [], []
        for _ in range(reps):  # interleaved, so that drift hits both alike
            tk.append(timed(fn))
            ts.append(timed(sd))
        for _ in range(max(5, reps // 2)):
            qk.append(timed(fn, queued))
            qs.append(timed(sd, queued))
        row["kernel_ms"], row["sdpa_ms"] = statistics.median(tk) * 1e3, statistics.median(ts) * 1e3
        row["ratio"] = row["sdpa_ms"] / row["kernel_ms"]
        row["q_kernel_ms"], row["q_sdpa_ms"] = statistics.median(qk) * 1e3, statistics.median(qs) * 1e3
        row["q_ratio"] = row["q_sdpa_ms"] / row["q_kernel_ms"]
        o_k, o_s, o_32 = fn(), sd(), case.sdpa32(causal)
        mx.eval(o_k, o_s, o_32)
        row["vs_sdpa"] = compare(o_k, o_s)
        row["vs_f32"] = compare(o_k, o_32)
        row["sdpa_vs_f32"] = compare(o_s, o_32)
        row["ok"] = row["vs_f32"]["bad"] == 0 and row["vs_f32"]["nan"] == 0
    except Exception:
        row["error"] = traceback.format_exc()[-1500:]
        row["ok"] = False
    log(f"{label} {row['shape']} causal={int(causal)}: "
        + json.dumps({k: v for k, v in row.items() if k not in ("error", "label", "shape", "causal")})
        + (" ERROR " + row["error"][-400:] if "error" in row else ""))
    return row


def kernel_fn(task, k, source, defines, case, causal, cache):
    axes = case.axes(causal)
    d = dict(defines)
    if not admits(k, {**candidate(k, source, d)["defines"]}, axes):
        hd = next((v for v in (64, 96, 128) if admits(k, {**candidate(k, source, {**d, "HD": v})["defines"]}, axes)), None)
        if hd is None:
            raise ValueError(f"no build of {defines} admits {axes}")
        d["HD"] = hd
    cand = candidate(k, source, d)
    key = json.dumps(cand["defines"], sort_keys=True)
    if key not in cache:
        cache[key] = rt.CompiledCandidate(cand, task, "mlx-cuda")
    cc = cache[key]
    inputs = {"q": case.q, "k": case.k, "v": case.v}
    return lambda: cc(inputs, axes)["o"]


def judge(task, k, source, defines, shapes):
    """The search's view: the MLX worker (python -m ksearch_mlx.worker, the judge: fresh pools,
    poison, checked calls, guard tails, its own timing) evaluates the kernel, one build per head
    size, and times the native baseline on the same workloads."""
    import subprocess

    p = subprocess.Popen([sys.executable, "-m", "ksearch_mlx.worker", "--backend", "mlx-cuda"],
                         cwd=os.path.join(ROOT, "python"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)

    def ask(req):
        p.stdin.write(json.dumps(req) + "\n")
        p.stdin.flush()
        while True:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError("the worker closed its channel: " + p.stderr.read()[-1500:])
            m = json.loads(line)
            if m.get("reply") not in ("progress", "hello"):
                return m

    timing = {"warmup": 2, "min_reps": 5, "max_reps": 50, "target_ms": 300.0, "flush": True}
    rows = []
    try:
        for i, s in enumerate(shapes):
            axes = dict(zip(["B", "H", "Hkv", "L", "D", "causal"], s))
            w = {"label": ",".join(map(str, s)), "axes": axes, "seed": 1000 + i}
            d = {**defines, "HD": axes["D"]}
            cand = {"lang": "mlx_cuda", **candidate(k, source, d)}
            r = ask({"op": "eval", "id": 2 * i + 1, "task": task, "backend": "mlx-cuda", "candidate": cand,
                     "workloads": [w], "timing": timing, "check_only": False})
            b = ask({"op": "baseline", "id": 2 * i + 2, "task": task, "backend": "mlx-cuda",
                     "workloads": [w], "timing": timing})
            kw = (r.get("workloads") or [{}])[0]
            bw = (b.get("workloads") or [{}])[0]
            row = {"shape": list(s), "failure": r.get("failure") or kw.get("failure"),
                   "kernel_us": (kw.get("timing") or {}).get("median_us"),
                   "sdpa_us": (bw.get("timing") or {}).get("median_us"),
                   "compile_s": (r.get("compile") or {}).get("seconds")}
            if row["kernel_us"] and row["sdpa_us"]:
                row["ratio"] = row["sdpa_us"] / row["kernel_us"]
            rows.append(row)
            log(f"judge {s}: {json.dumps(row)}")
    finally:
        try:
            p.stdin.write('{"op":"shutdown"}\n')
            p.stdin.flush()
            p.wait(timeout=60)
        except Exception:
            p.kill()
    return rows


def parse_variants(text):
    out = []
    for v in text.split(";"):
        v = v.strip()
        d = {}
        if v and v != "default":
            for kv in v.split(","):
                n, x = kv.split("=")
                d[n.strip()] = int(x)
        out.append(d)
    return out


def label_of(d):
    return ",".join(f"{k}={v}" for k, v in sorted(d.items())) or "default"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="default;MBAR=0;BLOCK_N=64;BLOCK_N=64,STAGES=4;NWG=1",
                    help="tunable variants tried at the main shape, `;`-separated")
    ap.add_argument("--shape-variants", default="",
                    help="variants (`;`-separated) also run on every shape, and through the judge, beside the fastest")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--module", default=None, help="a module written by `ksearch export --mlx` to check too")
    ap.add_argument("--module-only", action="store_true", help="check and time only --module, at the main shape")
    ap.add_argument("--no-judge", action="store_true", help="skip the evaluation through the MLX worker")
    a = ap.parse_args()
    info = {}
    try:
        info = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in mx.device_info().items()}
    except Exception as e:
        info = {"error": str(e)}
    log(f"mlx {mx.__version__}, device {mx.default_device()}, device_info {info}")
    log(f"compute capability {rt.device_cc()}, NVRTC {rt.nvrtc_version()}")
    task, k, source = load()
    res = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "mlx": mx.__version__, "device_info": info,
           "variants": [], "shapes": [], "module": []}
    cache = {}
    main_case = Case(*MAIN)
    best, best_score = {}, 0.0
    for d in [] if a.module_only else parse_variants(a.variants):
        rows = []
        for causal in (0, 1):
            try:
                fn = kernel_fn(task, k, source, d, main_case, causal, cache)
            except Exception:
                log(f"{label_of(d)}: {traceback.format_exc()[-600:]}")
                rows.append({"label": label_of(d), "ok": False, "error": traceback.format_exc()[-1500:]})
                continue
            rows.append(run_case(main_case, causal, fn, a.reps, label_of(d)))
        res["variants"] += rows
        if all(r.get("ok") for r in rows) and len(rows) == 2:
            score = math.sqrt(rows[0]["ratio"] * rows[1]["ratio"])
            if score > best_score:
                best, best_score = d, score
    log(f"fastest variant at the main shape: {label_of(best)} (geometric mean ratio {best_score:.3f})")
    res["best_variant"] = label_of(best)

    b = task["backends"]["mlx-cuda"]
    shapes = [MAIN + (c,) for c in (0, 1)]
    for w in b["search"] + b["heldout"]:
        s = (w["B"], w["H"], w["Hkv"], w["L"], w["D"], w["causal"])
        if s not in shapes:
            shapes.append(s)
    kinds = {}
    for w in b["search"]:
        kinds[(w["B"], w["H"], w["Hkv"], w["L"], w["D"], w["causal"])] = "search"
    for w in b["heldout"]:
        kinds[(w["B"], w["H"], w["Hkv"], w["L"], w["D"], w["causal"])] = "heldout"
    # The fastest at the main shape, then each --shape-variants one not the same.
    per_shape = [best] + [d for d in (parse_variants(a.shape_variants) if a.shape_variants else []) if d != best]
    cases = {}
    for s in [] if a.module_only else shapes:
        key = s[:5]
        if key not in cases:
            cases[key] = main_case if key == MAIN else Case(*key)
        case = cases[key]
        for d in per_shape:
            try:
                fn = kernel_fn(task, k, source, d, case, s[5], cache)
                row = run_case(case, s[5], fn, a.reps, label_of(d))
            except Exception:
                row = {"label": label_of(d), "shape": list(key), "causal": bool(s[5]), "ok": False,
                       "error": traceback.format_exc()[-1500:]}
                log(f"{key} causal={s[5]}: {row['error'][-400:]}")
            row["kind"] = "main" if key == MAIN else kinds.get(s, "")
            res["shapes"].append(row)

    res["judge"] = []
    if not a.module_only and not a.no_judge:
        for d in per_shape:
            try:
                rows = judge(task, k, source, d, [s for s in shapes if kinds.get(s) or s[:5] == MAIN])
                for r in rows:
                    r["label"] = label_of(d)
                res["judge"] += rows
            except Exception:
                log("judge: " + traceback.format_exc()[-1500:])

    if a.module:
        import importlib.util

        spec = importlib.util.spec_from_file_location("ks_exported_attention", a.module)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["ks_exported_attention"] = mod
        spec.loader.exec_module(mod)
        for causal in (0, 1):
            fn = lambda c=causal: mod.attention(main_case.q, main_case.k, main_case.v, causal=c)  # noqa: E731
            row = run_case(main_case, causal, fn, a.reps, "exported " + os.path.basename(a.module))
            row["defines"] = mod.CANDIDATE.get("defines")
            res["module"].append(row)

    name = "mlx_attention_module" if a.module_only else "mlx_attention"
    with open(os.path.join(OUT, name + ".json"), "w") as f:
        json.dump(res, f, indent=1)
    lines = [f"== wgmma kernel in MLX vs mx.fast.scaled_dot_product_attention ({res['date']}, mlx {mx.__version__}) ==",
             f"{'kernel':<34} {'B,H,Hkv,L,D':<20} {'causal':>6} {'kernel ms':>10} {'SDPA ms':>9} {'ratio':>6} "
             f"{'q.kern ms':>10} {'q.SDPA ms':>10} {'q.ratio':>7} {'max|d| f32':>10} {'bad':>4}  kind"]
    for r in res["variants"] + res["shapes"] + res["module"]:
        shape = ",".join(map(str, r.get("shape", [])))
        if "kernel_ms" not in r:
            err = (r.get("error") or "").strip().splitlines()
            lines.append(f"{r.get('label', ''):<34} {shape:<20} {int(r.get('causal', 0)):>6} ERROR {err[-1] if err else ''}")
            continue
        lines.append(
            f"{r['label']:<34} {shape:<20} {int(r['causal']):>6} {r['kernel_ms']:>10.3f} {r['sdpa_ms']:>9.3f} "
            f"{r['ratio']:>6.3f} {r['q_kernel_ms']:>10.4f} {r['q_sdpa_ms']:>10.4f} {r['q_ratio']:>7.3f} "
            f"{r['vs_f32']['max_abs']:>10.2e} {r['vs_f32']['bad']:>4}  {r.get('kind', 'variant')}")
    if res.get("judge"):
        lines.append("-- through the MLX worker (the judge; median of its timed calls, us) --")
        for r in res["judge"]:
            f = r.get("failure")
            lines.append(f"{'judge ' + r.get('label', res['best_variant']):<34} {','.join(map(str, r['shape'])):<26} "
                         + (f"FAILED {f.get('class')}: {str(f.get('message'))[:150]}" if f else
                            f"kernel {r['kernel_us']:.1f} us  SDPA {r['sdpa_us']:.1f} us  ratio {r.get('ratio', 0):.3f}"))
    table = "\n".join(lines)
    if not a.module_only:
        with open(os.path.join(OUT, "mlx_attention_table.txt"), "w") as f:
            f.write(table + "\n")
    print("\n" + table, flush=True)
    return 0 if all(r.get("ok") for r in res["shapes"] + res["module"]) else 1


if __name__ == "__main__":
    sys.exit(main())
