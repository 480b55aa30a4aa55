#!/usr/bin/env python3
"""End to end on MLX (CUDA back-end): kernels exported by `ksearch export <run> --mlx` inside
mlx-lm's Mamba, and the exported attention kernel against MLX's own attention.

    python3 bench/mlx_e2e.py OUT/mamba_scan_mlx.py OUT/mamba_step_mlx.py OUT/attention_mlx.py

    python3 bench/mlx_e2e.py --tail --lengths 512      # no modules: the export tail's fused decode

Arguments are exported modules in any order (each is recognised by its TASK name); any may be
missing. With --tail and no Mamba module, the repository's export tail patches mlx-lm by itself
(its fused one-launch decode needs no exported kernel; prefill then stays stock). In one process,
with the same inputs for every variant:

- mamba-370m-shaped mlx-lm 0.32 model (random weights, f16; the ModelArgs of
  ../shared/anchors/mlx_anchors.py): stock prefill tok/s at L=512 and L=4096 (stock L=4096 is
  one pass, ~30 s), patched prefill (median of >= 3 after warm-up), and decode tok/s stock vs
  patched after a 16-token prefill: a synchronous teacher-forced loop (the same tokens for all)
  and mlx-lm's generate_step (greedy), each as --reps runs of stock and patched interleaved with
  stock first and last (S P S P S P S), medians compared; the same steps all queued before one
  evaluation; the patch's other decode paths once each; the decode logits of both against the
  model in f32;
- the exported attention kernel vs mx.fast.scaled_dot_product_attention, B=4 H=32 L=2048 D=128
  f16, causal and not (median of >= 20), outputs compared with each other and with f32 SDPA.

Comparisons: rel = max|patched - stock| / max|stock| over the named tensor; "flag" when rel is
over MODEL_REL (2e-2) for the model's tensors, over F16_REL (1e-2, the tasks' f16 rtol) for the
attention output, or on a NaN. The stock model keeps its SSM state in f16, the patched one in f32,
so some difference is expected: 48 f16 layers alone put stock f16 at rel ~1e-2 on the SSM states
and ~5e-3 on the logits from the same model in f32 (H200, 2026-12-02). Where time allows, both
f16 runs are compared with the stock model in f32 at L=512 (same weights, rounded to f16), which
tells which of the two is off.
Writes $OUT/mlx_e2e.json and prints a short table last.
"""
import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import time
import traceback

import mlx.core as mx

F16_REL = 1e-2  # one f16 op (attention): the tasks' f16 rtol
MODEL_REL = 2e-2  # 48 f16 layers: about twice stock f16's own distance from f32
OUT = os.environ.get("OUT", "/tmp")
T_START = time.perf_counter()


def elapsed():
    return time.perf_counter() - T_START


def log(msg):
    print(f"[{elapsed():6.1f}s] {msg}", flush=True)


def err_tail():
    return traceback.format_exc()[-2000:]


def load_module(path):
    name = "ks_exported_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # as an import would: the runtime's dataclasses look themselves up there
    spec.loader.exec_module(mod)
    return mod


def load_tail(path):
    """python/ksearch_mlx/export_tail.py as a module of its own (what `ksearch export --mlx` pastes
    into every module), for its patch_mlx_lm without an exported kernel: the fused decode needs
    none. BACKEND as an exported module for this machine would have it."""
    import types

    mod = types.ModuleType("ks_export_tail")
    mod.__file__ = path
    exec(compile(open(path).read(), path, "exec"), mod.__dict__)
    cuda = getattr(mx, "cuda", None)
    mod.BACKEND = "mlx-cuda" if cuda is not None and cuda.is_available() else "mlx-metal"
    return mod


def compare(test, ref, tol=MODEL_REL):
    """max |test - ref|, the reference's scale max|ref|, their ratio, NaNs in test; flag past tol."""
    a, b = test.astype(mx.float32), ref.astype(mx.float32)
    d = mx.abs(a - b)
    max_abs, scale, nans = mx.max(d), mx.max(mx.abs(b)), mx.isnan(a).sum()
    mx.eval(max_abs, scale, nans)
    max_abs, scale = float(max_abs.item()), float(scale.item())
    rel = max_abs / scale if scale > 0 else float("inf")
    return {"max_abs": max_abs, "scale": scale, "rel": rel, "nan": int(nans.item()),
            "flag": bool(rel > tol or int(nans.item()) > 0 or not math.isfinite(rel))}


def timed(fn):
    mx.synchronize()
    t0 = time.perf_counter()
    out = fn()
    mx.eval(out)
    mx.synchronize()
    return time.perf_counter() - t0, out


# ---- attention ----------------------------------------------------------------------------------
def bench_attention(mod, res, shape=(4, 32, 2048, 128), reps=20):
    B, H, L, D = shape
    key = mx.random.key(1234)
    kq, kk, kv = mx.random.split(key, 3)
    q = mx.random.normal((B, H, L, D), key=kq).astype(mx.float16)
    k = mx.random.normal((B, H, L, D), key=kk).astype(mx.float16)
    v = mx.random.normal((B, H, L, D), key=kv).astype(mx.float16)
    mx.eval(q, k, v)
    scale = 1.0 / math.sqrt(D)
    rows = []
    for causal in (False, True):
        row = {"shape": [B, H, L, D], "causal": causal}
        flops = 4 * B * H * D * (L * L - (L * (L - 1) // 2 if causal else 0))
        mask = "causal" if causal else None
        try:
            sdpa = lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)  # noqa: E731
            ks = lambda: mod.attention(q, k, v, causal=causal)  # noqa: E731
            t0 = time.perf_counter()
            o_k = ks()
            mx.eval(o_k)
            mx.synchronize()
            row["kernel_first_call_s"] = time.perf_counter() - t0  # includes MLX's JIT compile
            for _ in range(3):
                mx.eval(ks(), sdpa())
            tk, ts = [], []
            for _ in range(reps):  # interleaved, so that drift hits both alike
                tk.append(timed(ks)[0])
                ts.append(timed(sdpa)[0])
            row["kernel_ms"] = statistics.median(tk) * 1e3
            row["sdpa_ms"] = statistics.median(ts) * 1e3
            row["kernel_tflops"] = flops / (row["kernel_ms"] * 1e-3) / 1e12
            row["sdpa_tflops"] = flops / (row["sdpa_ms"] * 1e-3) / 1e12
            row["kernel_vs_sdpa_speed"] = row["sdpa_ms"] / row["kernel_ms"]
            o_s = sdpa()
            o_32 = mx.fast.scaled_dot_product_attention(
                q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32), scale=scale, mask=mask)
            o_k = ks()
            mx.eval(o_s, o_32, o_k)
            row["kernel_vs_sdpa"] = compare(o_k, o_s, F16_REL)
            row["kernel_vs_f32"] = compare(o_k, o_32, F16_REL)
            row["sdpa_vs_f32"] = compare(o_s, o_32, F16_REL)
            bad = (mx.abs(o_k.astype(mx.float32) - o_32) > 1e-2 + 1e-2 * mx.abs(o_32)).sum()
            row["kernel_elements_beyond_f16_tol_vs_f32"] = int(bad.item())
            del o_s, o_32, o_k
        except Exception:
            row["error"] = err_tail()
        log(f"attention causal={causal}: " + json.dumps({k_: v_ for k_, v_ in row.items() if k_ != "error"})
            + (" ERROR " + row["error"][-300:] if "error" in row else ""))
        rows.append(row)
    res["attention"] = rows


# ---- Mamba ----------------------------------------------------------------------------------------
MODEL_370M = dict(model_type="mamba", vocab_size=50280, hidden_size=1024, intermediate_size=2048,
                  state_size=16, num_hidden_layers=48, conv_kernel=4, use_bias=False,
                  use_conv_bias=True, time_step_rank=64)
MODEL_TINY = dict(MODEL_370M, vocab_size=1000, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  time_step_rank=16)  # --tiny: a smoke test of this script on any machine
MODEL = dict(MODEL_370M)


def make_model(dtype, seed=0):
    """The same seed gives the same random weights; the f32 model gets them rounded to f16 first,
    so that it differs from the f16 runs only in the arithmetic."""
    from mlx_lm.models import mamba

    mx.random.seed(seed)
    m = mamba.Model(mamba.ModelArgs(**MODEL))
    m.set_dtype(mx.float16)
    if dtype != mx.float16:
        m.set_dtype(dtype)
    mx.eval(m.parameters())
    return m


def forward(m, ids, cache):
    """Model.__call__ (tied embeddings) split so that the final hidden state comes back too."""
    h = m.backbone(ids, cache)
    return h, m.backbone.embeddings.as_linear(h)


def prefill_pass(m, ids):
    cache = m.make_cache()
    dt, (h, logits) = timed(lambda: forward(m, ids, cache))
    states = [c[1] for c in cache]
    return dt, {"hidden": h, "logits": logits, "states": states}


def compare_outputs(test, ref):
    """What is compared: final-position logits [vocab]; logits at every position [L, vocab];
    final-position hidden state (backbone output after norm_f) [1024]; the SSM state h_L after
    the last token, every layer [48 x (2048, 16)] (worst layer reported)."""
    out = {
        "final_logits": compare(test["logits"][:, -1], ref["logits"][:, -1]),
        "all_logits": compare(test["logits"], ref["logits"]),
        "final_hidden": compare(test["hidden"][:, -1], ref["hidden"][:, -1]),
    }
    worst = None
    for i, (a, b) in enumerate(zip(test["states"], ref["states"])):
        c = compare(a, b)
        c["layer"] = i
        if worst is None or c["rel"] > worst["rel"]:
            worst = c
    out["ssm_state_worst_layer"] = worst
    out["argmax_final_equal"] = bool(
        (mx.argmax(test["logits"][:, -1], axis=-1) == mx.argmax(ref["logits"][:, -1], axis=-1)).all().item())
    out["flag"] = any(v.get("flag") for v in out.values() if isinstance(v, dict))
    return out


def decode_run(m, prompt, toks, warm):
    """16-token prefill, then teacher-forced single-token steps; returns (tok/s over the timed
    steps, per-step final logits, final states)."""
    cache = m.make_cache()
    mx.eval(m(prompt, cache=cache))
    logits = []
    for t in toks[:warm]:
        lg = m(mx.array([[t]]), cache=cache)
        mx.eval(lg)
        logits.append(lg[0, -1])
    mx.synchronize()
    t0 = time.perf_counter()
    for t in toks[warm:]:
        lg = m(mx.array([[t]]), cache=cache)
        mx.eval(lg)
        logits.append(lg[0, -1])
    mx.synchronize()
    dt = time.perf_counter() - t0
    return (len(toks) - warm) / dt, mx.stack(logits), [c[1] for c in cache]


def queued_run(m, prompt, toks, warm):
    """As decode_run, but the timed steps are all built first and evaluated together (the
    teacher-forced inputs do not depend on the outputs): no synchronisation per token."""
    cache = m.make_cache()
    mx.eval(m(prompt, cache=cache))
    warm_logits = []
    for t in toks[:warm]:
        lg = m(mx.array([[t]]), cache=cache)
        mx.eval(lg)
        warm_logits.append(lg[0, -1])
    mx.synchronize()
    t0 = time.perf_counter()
    logits = [m(mx.array([[t]]), cache=cache)[0, -1] for t in toks[warm:]]
    mx.eval(logits)
    mx.synchronize()
    dt = time.perf_counter() - t0
    return (len(toks) - warm) / dt, mx.stack(warm_logits + logits), [c[1] for c in cache]


def generate_run(m, prompt, steps, warm):
    """Tokens per second of mlx-lm's generate_step (greedy) over `steps` tokens after `warm`."""
    from mlx_lm.generate import generate_step

    n, t0 = 0, None
    for tok, _ in generate_step(prompt[0], m, max_tokens=steps + warm):
        n += 1
        if n == warm:
            mx.synchronize()
            t0 = time.perf_counter()
    mx.synchronize()
    return (n - warm) / (time.perf_counter() - t0)


def bench_mamba(scan_mod, step_mod, res, budget, lengths=(512, 4096), reps=3, steps=128, warm_steps=8, tail_mod=None):
    import mlx_lm
    from mlx_lm.models import mamba

    res["env"]["mlx_lm"] = getattr(mlx_lm, "__version__", "?")
    stock_fn = mamba.MambaBlock.__dict__["_process_sequence"]
    stock_backbone = mamba.Mamba.__dict__["__call__"]
    mm = {"model": dict(MODEL), "lengths": list(lengths), "stock": {}, "patched": {}, "compare": {}, "decode": {}}
    res["mamba"] = mm
    m = make_model(mx.float16)
    log(f"mamba model built (f16, random weights): {MODEL}")
    key = mx.random.key(7)
    vocab = min(50000, MODEL["vocab_size"])
    ids_all = mx.random.randint(0, vocab, (1, max(lengths)), key=key)
    ids = {L: ids_all[:, :L] for L in lengths}
    toks = mx.random.randint(0, vocab, (warm_steps + steps,), key=mx.random.key(8)).tolist()
    prompt = ids_all[:, :16]
    mx.eval(ids_all, prompt)

    # stock prefill: warm-up at a small L, two passes at 512, one at 4096 (about 30 s)
    stock_out = {}
    try:
        timed(lambda: forward(m, ids_all[:, :64], m.make_cache()))
        for L in lengths:
            n = 2 if L <= 1024 else 1
            ts = []
            for _ in range(n):
                dt, o = prefill_pass(m, ids[L])
                ts.append(dt)
            stock_out[L] = o
            mm["stock"][f"prefill_{L}_s"] = ts
            mm["stock"][f"prefill_{L}_tok_s"] = L / statistics.median(ts)
            log(f"stock prefill L={L}: {mm['stock'][f'prefill_{L}_tok_s']:.0f} tok/s ({ts})")
    except Exception:
        mm["stock"]["error"] = err_tail()
        log("stock prefill failed: " + mm["stock"]["error"][-300:])

    scan = getattr(scan_mod, "mamba_scan", None) if scan_mod else None
    step = getattr(step_mod, "mamba_step", None) if step_mod else None
    patcher = scan_mod or step_mod or tail_mod
    mm["patched"]["scan"] = "exported kernel" if scan else "stock loop (no scan module)"
    mm["patched"]["step"] = "exported kernel" if step else "stock step (no step module)"
    if patcher is tail_mod and tail_mod is not None:
        mm["patched"]["module"] = "the repository's export tail (--tail)"
    unpatch = None
    if patcher is None:
        mm["patched"]["skipped"] = "no mamba_scan or mamba_step module given, and no --tail"
    else:
        try:
            unpatch = patcher.patch_mlx_lm(scan=scan, step=step)
        except Exception:
            mm["patched"]["error"] = err_tail()
            log("patch failed: " + mm["patched"]["error"][-300:])

    # patched prefill: a warm-up pass per L (MLX compiles the kernel once per set of template
    # values), then the median of `reps`
    if unpatch is not None and scan is not None:
        for L in lengths:
            try:
                t_first, _ = prefill_pass(m, ids[L])
                mm["patched"][f"prefill_{L}_first_s"] = t_first
                ts, o = [], None
                for _ in range(reps):
                    dt, o = prefill_pass(m, ids[L])
                    ts.append(dt)
                mm["patched"][f"prefill_{L}_s"] = ts
                mm["patched"][f"prefill_{L}_tok_s"] = L / statistics.median(ts)
                if f"prefill_{L}_tok_s" in mm["stock"]:
                    mm["patched"][f"prefill_{L}_speedup"] = mm["patched"][f"prefill_{L}_tok_s"] / mm["stock"][f"prefill_{L}_tok_s"]
                if L in stock_out:
                    mm["compare"][f"prefill_{L}_patched_vs_stock"] = compare_outputs(o, stock_out[L])
                if L == min(lengths):
                    stock_out[("patched", L)] = o
                log(f"patched prefill L={L}: {mm['patched'][f'prefill_{L}_tok_s']:.0f} tok/s; "
                    + json.dumps(mm["compare"].get(f"prefill_{L}_patched_vs_stock", {}).get("final_logits", {})))
            except Exception:
                mm["patched"][f"prefill_{L}_error"] = err_tail()
                log(f"patched prefill L={L} failed: " + mm["patched"][f"prefill_{L}_error"][-300:])
            if L != min(lengths):
                stock_out.pop(L, None)
        mx.clear_cache()

    # decode: stock and patched interleaved, stock first and last (S P S P S P S), the same
    # prompt and the same teacher-forced tokens; medians of `reps` runs each. Then the same for
    # mlx-lm's generate_step. Patched = patch_mlx_lm's defaults (the fused one-launch decode where
    # it fits).
    de = mm["decode"]
    lg_stock = lg_p = None
    try:
        if unpatch is not None:
            unpatch()
        assert mamba.MambaBlock.__dict__["_process_sequence"] is stock_fn

        def patched(fn, **kw):
            up = patcher.patch_mlx_lm(scan=scan, step=step, **kw)
            try:
                out = fn()
                if hasattr(up, "fused_check"):
                    up.fused_check()  # raises where a fused launch did not finish
                return out, dict(up.stats), dict(getattr(up, "compiled", {}) or {})
            finally:
                up()

        stock_runs, patched_runs, st_stock, st_p = [], [], None, None
        for rep in range(reps if patcher is not None else 1):
            tps, lg_s, st_s = decode_run(m, prompt, toks, warm_steps)
            stock_runs.append(tps)
            if lg_stock is None:
                lg_stock, st_stock = lg_s, st_s
            log(f"stock decode run {rep + 1}: {tps:.1f} tok/s")
            if patcher is not None:
                (tps, lg_p, st_p), de["stats"], de["compiled"] = patched(lambda: decode_run(m, prompt, toks, warm_steps))
                patched_runs.append(tps)
                log(f"patched decode run {rep + 1}: {tps:.1f} tok/s; path {de['compiled'].get('fused')}")
        if patcher is not None:
            tps, _, _ = decode_run(m, prompt, toks, warm_steps)
            stock_runs.append(tps)
            log(f"stock decode again: {tps:.1f} tok/s")
        de["stock_runs_tok_s"] = stock_runs
        de["stock_tok_s"] = statistics.median(stock_runs)
        if patched_runs:
            de["patched_runs_tok_s"] = patched_runs
            de["patched_tok_s"] = statistics.median(patched_runs)
            de["speedup"] = de["patched_tok_s"] / de["stock_tok_s"]
            de["speedup_vs_fastest_stock"] = de["patched_tok_s"] / max(stock_runs)
            c = {"logits_every_step": compare(lg_p, lg_stock),
                 "logits_last_step": compare(lg_p[-1], lg_stock[-1]),
                 "argmax_equal_steps": int((mx.argmax(lg_p, -1) == mx.argmax(lg_stock, -1)).sum().item()),
                 "steps": len(toks)}
            worst = None
            for i, (a, b) in enumerate(zip(st_p, st_stock)):
                w = compare(a, b)
                w["layer"] = i
                worst = w if worst is None or w["rel"] > worst["rel"] else worst
            c["ssm_state_worst_layer"] = worst
            c["flag"] = any(v.get("flag") for v in c.values() if isinstance(v, dict))
            mm["compare"]["decode_patched_vs_stock"] = c
            log(f"decode medians: stock {de['stock_tok_s']:.1f}, patched {de['patched_tok_s']:.1f} tok/s "
                f"({de['speedup']:.2f}x); " + json.dumps(c["logits_every_step"]))
            # queued: every teacher-forced step built before one evaluation (no per-token sync):
            # what the GPU side costs per token, MLX's dispatch included
            try:
                (tq, lg_q, _), _, _ = patched(lambda: queued_run(m, prompt, toks, warm_steps))
                de["patched_queued_tok_s"] = tq
                mm["compare"]["decode_patched_queued_vs_stock"] = compare(lg_q, lg_stock)
                log(f"patched decode, all steps queued: {tq:.1f} tok/s")
            except Exception:
                de["patched_queued_error"] = err_tail()
            # other paths of the same patch, one run each, to tell the effects apart (those that
            # need a step module are skipped without one)
            for key, kw, what in (("patched_no_fused_tok_s", {"fused_decode": False}, "without the fused decode"),
                                  ("patched_glue_step_tok_s", {"decode_glue": "step", "fused_decode": False}, "with the step fused into the glue"),
                                  ("patched_no_glue_tok_s", {"decode_glue": False, "fused_decode": False}, "with MLX-op glue"),
                                  ("patched_uncompiled_tok_s", {"compile_decode": False, "fused_decode": False}, "without mx.compile")):
                if elapsed() > budget - 60:
                    break
                try:
                    (tps2, lg_v, _), _, comp = patched(lambda: decode_run(m, prompt, toks, warm_steps), **kw)
                except (TypeError, ValueError):  # an older module, or nothing to patch without the fused decode
                    continue
                de[key] = tps2
                cv = compare(lg_v, lg_stock)
                mm["compare"]["decode_" + key.replace("_tok_s", "") + "_vs_stock"] = cv
                de[key.replace("_tok_s", "_path")] = comp
                log(f"patched decode {what}: {tps2:.1f} tok/s; logits rel {cv['rel']:.1e}{' FLAG' if cv.get('flag') else ''}")
            # mlx-lm's own generation loop (generate_step: greedy, the next step built while the
            # GPU runs the current one), stock and patched interleaved the same way
            try:
                gs, gp = [], []
                for rep in range(reps):
                    gs.append(generate_run(m, prompt, steps, warm_steps))
                    gp.append(patched(lambda: generate_run(m, prompt, steps, warm_steps))[0])
                    log(f"generate_step run {rep + 1}: stock {gs[-1]:.1f}, patched {gp[-1]:.1f} tok/s")
                gs.append(generate_run(m, prompt, steps, warm_steps))
                g = {"stock_runs_tok_s": gs, "patched_runs_tok_s": gp,
                     "stock_tok_s": statistics.median(gs), "patched_tok_s": statistics.median(gp)}
                g["speedup"] = g["patched_tok_s"] / g["stock_tok_s"]
                g["speedup_vs_fastest_stock"] = g["patched_tok_s"] / max(gs)
                de["generate_step"] = g
                log(f"mlx_lm generate_step medians: stock {g['stock_tok_s']:.1f} tok/s, patched {g['patched_tok_s']:.1f} tok/s "
                    f"({g['speedup']:.2f}x; stock runs {', '.join(f'{v:.1f}' for v in gs)})")
            except Exception:
                de["generate_step"] = {"error": err_tail()}
                log("generate_step run failed: " + de["generate_step"]["error"][-300:])
    except Exception:
        de["error"] = err_tail()
        log("decode failed: " + de["error"][-300:])
    finally:
        mamba.MambaBlock._process_sequence = stock_fn
        mamba.Mamba.__call__ = stock_backbone

    # the decode logits of both f16 runs against the stock model in f32 (same weights, the same
    # teacher-forced tokens): which of the two is off
    if lg_stock is not None and lg_p is not None and elapsed() < budget - 30:
        try:
            m32 = make_model(mx.float32)
            _, lg32, _ = decode_run(m32, prompt, toks, warm_steps)
            mm["compare"]["decode_stock_f16_vs_f32"] = compare(lg_stock, lg32)
            mm["compare"]["decode_patched_f16_vs_f32"] = compare(lg_p, lg32)
            log("decode vs f32: stock f16 %.1e, patched f16 %.1e" % (mm["compare"]["decode_stock_f16_vs_f32"]["rel"],
                                                                     mm["compare"]["decode_patched_f16_vs_f32"]["rel"]))
            del m32
        except Exception:
            mm["compare"]["decode_f32_reference_error"] = err_tail()

    # which f16 run is off: both against the stock model in f32 at the smallest L (same weights)
    L0 = min(lengths)
    if L0 in stock_out and elapsed() < budget - 30:
        try:
            del m
            mx.clear_cache()
            m32 = make_model(mx.float32)
            dt, ref32 = prefill_pass(m32, ids[L0])
            mm["compare"][f"prefill_{L0}_f32_reference_s"] = dt
            mm["compare"][f"prefill_{L0}_stock_f16_vs_f32"] = compare_outputs(stock_out[L0], ref32)
            if ("patched", L0) in stock_out:
                mm["compare"][f"prefill_{L0}_patched_f16_vs_f32"] = compare_outputs(stock_out[("patched", L0)], ref32)
            log("f32 reference compared")
        except Exception:
            mm["compare"]["f32_reference_error"] = err_tail()
    else:
        mm["compare"]["f32_reference_skipped"] = "no stock output or out of time"
    mx.clear_cache()


def fmt(v, spec, suffix=""):
    return format(v, spec) + suffix if isinstance(v, (int, float)) else "-"


def table(res):
    lines = ["", "== mlx_e2e: exported ksearch kernels on MLX " + res["env"].get("device", "") + " =="]
    mm = res.get("mamba")
    if mm:
        st, pa, de = mm["stock"], mm["patched"], mm["decode"]
        shape = "mamba-370m shapes" if mm.get("model") == MODEL_370M else f"model {mm.get('model')}"
        lines.append(f"{shape}, f16, random weights; scan: {pa.get('scan')}; step: {pa.get('step')}")
        lines.append(f"{'what':<26}{'stock':>12}{'patched':>12}{'speed-up':>10}  outputs (rel = max|diff|/max|stock|)")
        for L in mm["lengths"]:
            c = mm["compare"].get(f"prefill_{L}_patched_vs_stock")
            cs = (f"logits {c['final_logits']['rel']:.1e} / all {c['all_logits']['rel']:.1e}, "
                  f"state {c['ssm_state_worst_layer']['rel']:.1e}{' FLAG' if c['flag'] else ''}") if c else "-"
            lines.append(f"{'prefill L=' + str(L) + ' tok/s':<26}{fmt(st.get(f'prefill_{L}_tok_s'), '12.0f'):>12}"
                         f"{fmt(pa.get(f'prefill_{L}_tok_s'), '12.0f'):>12}{fmt(pa.get(f'prefill_{L}_speedup'), '.1f', 'x'):>10}  {cs}")
        c = mm["compare"].get("decode_patched_vs_stock")
        cs = (f"logits {c['logits_every_step']['rel']:.1e} over {c['steps']} steps, argmax same {c['argmax_equal_steps']}/{c['steps']}"
              f"{' FLAG' if c['flag'] else ''}") if c else "-"
        lines.append(f"{'decode tok/s (median)':<26}{fmt(de.get('stock_tok_s'), '12.1f'):>12}{fmt(de.get('patched_tok_s'), '12.1f'):>12}"
                     f"{fmt(de.get('speedup'), '.2f', 'x'):>10}  {cs}")
        comp = de.get("compiled") or {}
        if comp:
            if comp.get("fused") == "on":
                lines.append(f"  decode path: fused, one launch per token ({comp.get('fused_calls', 0)} tokens in the last run)")
            else:
                lines.append(f"  decode path: {comp.get('compiled_calls', 0)} compiled calls (scope {comp.get('scope')})"
                             + (f", compile error: {comp['error'][:120]}" if comp.get("error") else "")
                             + (f", glue {comp['glue']}" if comp.get("glue") else ", MLX-op glue")
                             + (f"; fused decode off: {comp['fused'][:160]}" if comp.get("fused") else ""))
        if de.get("stock_runs_tok_s"):
            lines.append("  runs, in order (stock first and last): stock " + ", ".join(f"{v:.1f}" for v in de["stock_runs_tok_s"])
                         + "; patched " + ", ".join(f"{v:.1f}" for v in de.get("patched_runs_tok_s", []))
                         + (f"; vs the fastest stock run {de['speedup_vs_fastest_stock']:.2f}x" if "speedup_vs_fastest_stock" in de else ""))
        if "patched_queued_tok_s" in de:
            cv = mm["compare"].get("decode_patched_queued_vs_stock") or {}
            lines.append(f"  {'decode, steps queued':<24}{'':>12}{de['patched_queued_tok_s']:12.1f}"
                         f"{de['patched_queued_tok_s'] / de['stock_tok_s']:9.2f}x  logits {cv.get('rel', float('nan')):.1e}"
                         " (all steps built, one evaluation)")
        for key, what in (("patched_no_fused", "without fused decode"), ("patched_glue_step", "step fused into the glue"),
                          ("patched_no_glue", "MLX-op glue"), ("patched_uncompiled", "without mx.compile")):
            if key + "_tok_s" in de:
                cv = mm["compare"].get("decode_" + key + "_vs_stock") or {}
                lines.append(f"  {'decode, ' + what:<24}{'':>12}{de[key + '_tok_s']:12.1f}"
                             f"{de[key + '_tok_s'] / de['stock_tok_s']:9.2f}x  logits {cv.get('rel', float('nan')):.1e}"
                             f"{' FLAG' if cv.get('flag') else ''}")
        g = de.get("generate_step") or {}
        if "speedup" in g:
            lines.append(f"{'decode, generate_step':<26}{g['stock_tok_s']:12.1f}{g['patched_tok_s']:12.1f}{g['speedup']:9.2f}x  "
                         "greedy, own tokens; medians")
            lines.append("  runs, in order (stock first and last): stock " + ", ".join(f"{v:.1f}" for v in g["stock_runs_tok_s"])
                         + "; patched " + ", ".join(f"{v:.1f}" for v in g["patched_runs_tok_s"])
                         + f"; vs the fastest stock run {g['speedup_vs_fastest_stock']:.2f}x")
        a, b = mm["compare"].get("decode_stock_f16_vs_f32"), mm["compare"].get("decode_patched_f16_vs_f32")
        if a and b:
            lines.append(f"decode logits vs the f32 model (rel, every step): stock f16 {a['rel']:.1e}, patched f16 {b['rel']:.1e}")
        L0 = min(mm["lengths"])
        a, b = mm["compare"].get(f"prefill_{L0}_stock_f16_vs_f32"), mm["compare"].get(f"prefill_{L0}_patched_f16_vs_f32")
        if a:
            lines.append(f"vs f32 stock at L={L0} (final logits rel): stock f16 {a['final_logits']['rel']:.1e}"
                         + (f", patched f16 {b['final_logits']['rel']:.1e}" if b else ""))
        for k in ("error",):
            for part in (st, pa, de):
                if k in part:
                    lines.append("error: " + part[k].strip().splitlines()[-1])
    for row in res.get("attention", []):
        if "error" in row:
            lines.append(f"attention {row['shape']} causal={row['causal']}: error: {row['error'].strip().splitlines()[-1]}")
            continue
        c = row["kernel_vs_sdpa"]
        lines.append(
            f"attention {','.join(map(str, row['shape']))}{' causal' if row['causal'] else ''}: kernel {row['kernel_ms']:.3f} ms "
            f"({row['kernel_tflops']:.0f} TFLOP/s), MLX SDPA {row['sdpa_ms']:.3f} ms -> {row['kernel_vs_sdpa_speed']:.2f}x of SDPA; "
            f"max|kernel-SDPA| {c['max_abs']:.1e}, beyond f16 tol vs f32: {row['kernel_elements_beyond_f16_tol_vs_f32']}"
            f"{' FLAG' if c['flag'] else ''}")
    for s in res.get("skipped", []):
        lines.append("skipped: " + s)
    lines.append(f"wall {elapsed():.0f} s; JSON: {os.path.join(OUT, 'mlx_e2e.json')}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("modules", nargs="*", help="exported modules (mamba_scan, mamba_step, attention)")
    ap.add_argument("--budget", type=float, default=330.0, help="seconds; optional parts are skipped past it")
    ap.add_argument("--lengths", default="512,4096")
    ap.add_argument("--decode-steps", type=int, default=128, help="timed decode steps (after 8 untimed)")
    ap.add_argument("--att-shape", default="4,32,2048,128", help="B,H,L,D")
    ap.add_argument("--no-mamba", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="a tiny Mamba instead of mamba-370m (smoke test)")
    ap.add_argument("--tail", nargs="?", const=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python",
                                                           "ksearch_mlx", "export_tail.py"),
                    help="patch with this export tail where no mamba module is given (default: the repository's); "
                         "its fused decode needs no exported kernel")
    ap.add_argument("--reps", type=int, default=3, help="runs per variant (decode, generate_step, prefill)")
    a = ap.parse_args()
    if a.tiny:
        MODEL.clear()
        MODEL.update(MODEL_TINY)
    res = {"env": {"mlx": mx.__version__, "device": str(mx.default_device())}, "modules": {}, "skipped": []}
    try:
        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        res["env"]["device"] = str(info.get("device_name", info.get("architecture", res["env"]["device"])))
    except Exception:
        pass
    mods = {}
    for p in a.modules:
        if not os.path.exists(p):
            res["skipped"].append(f"{p}: no such file")
            continue
        try:
            mod = load_module(p)
            name = mod.TASK["name"]
            mods[name] = mod
            res["modules"][name] = {"path": p, "backend": mod.BACKEND,
                                    "defines": mod.CANDIDATE.get("defines"),
                                    "launches": [l.get("entry") for l in mod.CANDIDATE.get("launches", [])]}
        except Exception:
            res["modules"][p] = {"error": err_tail()}
            res["skipped"].append(f"{p}: failed to load")
    log("modules: " + json.dumps(res["modules"])[:1500])
    if "attention" in mods:
        bench_attention(mods["attention"], res, shape=tuple(int(x) for x in a.att_shape.split(",")))
    else:
        res["skipped"].append("attention: no exported attention module")
    if a.no_mamba:
        res["skipped"].append("mamba: --no-mamba")
    else:
        try:
            tail_mod = load_tail(a.tail) if a.tail else None
            bench_mamba(mods.get("mamba_scan"), mods.get("mamba_step"), res, a.budget,
                        lengths=tuple(int(x) for x in a.lengths.split(",")), steps=a.decode_steps,
                        reps=a.reps, tail_mod=tail_mod)
        except Exception:
            res["mamba_error"] = err_tail()
            log("mamba failed: " + res["mamba_error"][-500:])
    res["wall_s"] = elapsed()
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "mlx_e2e.json"), "w") as f:
        json.dump(res, f, indent=1)
    t = table(res)
    with open(os.path.join(OUT, "mlx_e2e_table.txt"), "w") as f:
        f.write(t + "\n")
    print(t)


if __name__ == "__main__":
    main()
