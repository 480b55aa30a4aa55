#!/usr/bin/env python3
"""A Llama-family mlx-lm model end to end, stock against the searched attention kernel patched into
`mlx_lm.models.llama.Attention` (python/ksearch_mlx/export_llama.py, `patch_mlx_lm_llama`).

    PYTHONPATH=python python3 bench/mlx_llama.py                  # the kernel from task.toml defaults
    PYTHONPATH=python python3 bench/mlx_llama.py --module attention_mlx.py   # a `ksearch export --mlx` module
    PYTHONPATH=python python3 bench/mlx_llama.py --tiny           # small config; on CPU, a stand-in kernel

The model: `mlx_lm.models.llama.Model` with random f16 weights, hidden 2048, 16 layers, 32 query
heads on 8 key/value heads (GQA 4:1), head_dim 128, MLP 5632, vocab 32000 (TinyLlama-1.1B's
widths with 16 layers and 8 KV heads; 1.0 B parameters, 2 GB in f16, lm_head untied): at L = 4096
the causal attention is about a quarter of a layer's prefill FLOPs (2*H*D*L = 34 M per token
against 2 * 56 M for the linear layers), enough for a faster kernel to show end to end; the
head size 128 is the kernel's main shape class. The kernel (without --module) is
tasks/attention/task.toml's mlx-cuda `flash_wgmma` at its default tunables (HD = D per call), as
bench/mlx_attention.py builds it.

Measured, one process, stock and patched interleaved per repetition (the patch is toggled on the
class):
- attention alone at the model's per-layer shape (B = 1, H, Hkv, L, D, causal; q/k/v laid out as the
  model's [B, L, H, D] transposed; each path up to o_proj's input, so a kernel that needs q and o
  copied pays for it; the kernel's QO_LHD build, which reads and writes mlx-lm's order, where its
  source has the switch, KS_LLAMA_LHD=0 to keep the [B, H, L, D] build; with it, q and k rotated by
  the patch's fused RoPE on MLX's CUDA back-end, KS_LLAMA_ROPE=0 for stock's RoPE, and k and v
  contiguous as that RoPE hands them over, transposed views as stock's), kernel against
  mx.fast.scaled_dot_product_attention for a few L, 8 calls per timing, each queued as it is built
  (KS_LLAMA_QKV=0: without the patch's fuse_qkv, the q, k and v projections one matmul;
  KS_LLAMA_COMPILE=0: its compile=False),
  median of --reps; "suggested min_len": the shortest L from which the kernel won at every longer
  L measured (none: keep stock);
- prefill tok/s at L = 2048 and 4096: the backbone over the prompt with a fresh KV cache, then the
  head on the last position (what generation needs), median of --reps; with the host time spent
  building each mode's lazy graph (Python, before the GPU starts), median;
- the same prompt prefilled in 2048-token pieces (mlx_lm.generate's prefill_step_size; the pieces
  after the first attend with stock's SDPA, the patch's RoPE and projection still run), its last
  piece's logits and the cache compared;
- decode tok/s after a --prompt token prompt: a synchronous loop (model, argmax, eval per token) and
  mlx-lm's generate_step (greedy), --decode tokens each, median of 5, stock and patched interleaved
  (and the median of each repetition's patched / stock ratio);
- logits of the whole prompt at L = 2048 and 4096 (one forward, no cache): patched against stock,
  and both against the same model in f32 (stock attention); max rel = max|a - b| / max|b|;
  "bad" counts elements beyond f16 tolerance (atol 1e-2 + rtol 1e-2 * |b|); top-1 agreement.
Time-boxed (--budget, default 170 s; phases past it are skipped and say so). Writes
$OUT/mlx_llama.json and prints a table last.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "bench"))
os.environ.setdefault("MLX_ENABLE_TF32", "0")  # the f32 reference in f32

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten, tree_map  # noqa: E402
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models import cache as mlx_cache  # noqa: E402
from mlx_lm.models import llama  # noqa: E402

from ksearch_mlx import export_llama  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
T0 = time.perf_counter()

FULL = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
            intermediate_size=5632, vocab_size=32000)
TINY = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            intermediate_size=512, vocab_size=1000)


def log(msg):
    print(f"[{time.perf_counter() - T0:6.1f}s] {msg}", flush=True)


def elapsed():
    return time.perf_counter() - T0


# ---- the attention callables -------------------------------------------------------------------------
def standin_attention():
    """The kernel's contract in MLX ops (f32 arithmetic, GQA, 1/sqrt(D), causal over the same L
    keys): for a run where the CUDA kernel cannot run (MLX's CPU back-end)."""

    def attention(q, k, v, causal=0):
        B, H, L, D = q.shape
        rep = H // k.shape[1]
        f = mx.float32
        qf = q.astype(f).reshape(B, k.shape[1], rep, L, D)
        s = (qf @ k.astype(f)[:, :, None].swapaxes(-1, -2)) / math.sqrt(D)
        if causal:
            s = mx.where(mx.arange(L)[:, None] >= mx.arange(L)[None], s, -mx.inf)
        o = mx.softmax(s, axis=-1) @ v.astype(f)[:, :, None]
        return o.reshape(B, H, L, D).astype(q.dtype)

    return attention, None


def kernel_attention():
    """tasks/attention/task.toml's mlx-cuda `flash_wgmma` at its default tunables, one build per
    head size (HD = D), through ksearch_mlx.runtime.CompiledCandidate; (attention, admits)."""
    import mlx_attention as ma
    from ksearch_mlx import runtime as rt

    task, k, source = ma.load()
    built = {}
    chosen = {}  # per shape (the choice evaluates constraints in Python: once, not once per layer)

    def defines_for(axes):
        shape = tuple(axes.values())
        if shape not in chosen:
            chosen[shape] = None
            for hd in (axes["D"], 128, 96, 64):
                d = ma.candidate(k, source, {"HD": hd})["defines"]
                if ma.admits(k, d, axes):
                    chosen[shape] = {"HD": hd}
                    break
        return chosen[shape]

    def admits(axes):
        return defines_for(axes) is not None

    def attention(q, kk, v, causal=0):
        axes = {"B": q.shape[0], "H": q.shape[1], "Hkv": kk.shape[1], "L": q.shape[2], "D": q.shape[3],
                "causal": int(causal)}
        d = defines_for(axes)
        if d is None:
            raise ValueError(f"no build of flash_wgmma admits {axes}")
        key = d["HD"]
        if key not in built:
            built[key] = rt.CompiledCandidate(ma.candidate(k, source, d), task, "mlx-cuda")
        return built[key]({"q": q, "k": kk, "v": v}, axes)["o"]

    def lhd(q, kk, v, causal=0):
        # q and o in mlx-lm's [B, L, H, D] order: the build with QO_LHD=1 (the kernel's switch),
        # the arrays handed over reshaped to the task's [B, H, L, D] (no copy).
        B, L, H, D = q.shape
        axes = {"B": B, "H": H, "Hkv": kk.shape[1], "L": L, "D": D, "causal": int(causal)}
        d = defines_for(axes)
        if d is None:
            raise ValueError(f"no build of the kernel admits {axes}")
        key = ("lhd", d["HD"])
        if key not in built:
            built[key] = rt.CompiledCandidate(ma.candidate(k, source, {**d, "QO_LHD": 1}), task, "mlx-cuda")
        return built[key]({"q": q.reshape(B, H, L, D), "k": kk, "v": v}, axes)["o"].reshape(B, L, H, D)

    if "QO_LHD" in source and os.environ.get("KS_LLAMA_LHD", "1") != "0":
        attention.lhd = lhd
    return attention, admits


def module_patch(path):
    """patch_mlx_lm_llama of a module written by `ksearch export --mlx` (its own kernel)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ks_exported_attention", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["ks_exported_attention"] = mod
    spec.loader.exec_module(mod)
    if hasattr(mod, "patch_mlx_lm_llama"):
        return mod.patch_mlx_lm_llama, mod.attention
    # a module exported before the Llama patch was appended: its attention with this patch
    return (lambda **kw: export_llama.patch_mlx_lm_llama(mod.attention, dtypes=(mx.float16,), **kw)), mod.attention


# ---- helpers --------------------------------------------------------------------------------------------
class Toggle:
    """The patch made once; on() / off() swap the classes' methods (the attention's and, with
    fuse_mlp, the block's), so the path counts accumulate."""

    CLASSES = (llama.Attention, llama.TransformerBlock)

    def __init__(self, unpatch):
        self.unpatch = unpatch
        self.patched = [c.__dict__["__call__"] for c in self.CLASSES]
        unpatch()
        self.stock = [c.__dict__["__call__"] for c in self.CLASSES]

    def on(self):
        for c, f in zip(self.CLASSES, self.patched):
            c.__call__ = f

    def off(self):
        for c, f in zip(self.CLASSES, self.stock):
            c.__call__ = f


def timed(fn):
    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return time.perf_counter() - t0


def timed_batch(fn, n=8):
    """Seconds per call of n calls, each handed to the GPU as soon as it is built (mx.async_eval),
    as the patch's measured choice times them (export_llama._llama_time): the host builds the next
    call while the GPU runs the last, as in a prefill."""
    mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        mx.async_eval(fn())
    mx.synchronize()
    return (time.perf_counter() - t0) / n


def compare(test, ref):
    a, b = test.astype(mx.float32), ref.astype(mx.float32)
    d = mx.abs(a - b)
    m, s = mx.max(d), mx.max(mx.abs(b))
    bad = (d > 1e-2 + 1e-2 * mx.abs(b)).sum()
    top = (mx.argmax(a, axis=-1) == mx.argmax(b, axis=-1)).astype(mx.float32).mean()
    nan = mx.isnan(a).sum()
    mx.eval(m, s, bad, top, nan)
    return {"max_abs": m.item(), "max_rel": m.item() / max(s.item(), 1e-30), "bad": int(bad.item()),
            "elements": int(a.size), "top1_agree": float(top.item()), "nan": int(nan.item())}


def make_model(cfg, dtype, seed=0):
    mx.random.seed(seed)
    args = llama.ModelArgs(model_type="llama", rms_norm_eps=1e-5, tie_word_embeddings=False, rope_theta=10000.0, **cfg)
    m = llama.Model(args)
    m.set_dtype(dtype)
    mx.eval(m.parameters())
    return m, args


# ---- phases -----------------------------------------------------------------------------------------------
def bench_attention(attention, admits, cfg, lens, reps, fused_rope=False):
    H, Hkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    rows = []
    for L in lens:
        axes = {"B": 1, "H": H, "Hkv": Hkv, "L": L, "D": D, "causal": 1}
        if admits is not None and not admits(axes):
            rows.append({"L": L, "error": "not admitted"})
            continue
        kq, kk, kv = mx.random.split(mx.random.key(L), 3)
        q = mx.random.normal((1, L, H, D), key=kq).astype(mx.float16).transpose(0, 2, 1, 3)
        k = mx.random.normal((1, L, Hkv, D), key=kk).astype(mx.float16).transpose(0, 2, 1, 3)
        v = mx.random.normal((1, L, Hkv, D), key=kv).astype(mx.float16).transpose(0, 2, 1, 3)
        if fused_rope:  # the patch's RoPE hands k and v over contiguous in [B, Hkv, L, D]
            k, v = mx.contiguous(k), mx.contiguous(v)
        mx.eval(q, k, v)
        # Each up to o_proj's input [B, L, H * D], as the patched layer runs it.
        lhd = getattr(attention, "lhd", None)
        if lhd is not None:
            kern = lambda: lhd(q.transpose(0, 2, 1, 3), k, v, causal=1).reshape(1, L, -1)  # noqa: E731
        else:
            kern = lambda: attention(q, k, v, causal=1).transpose(0, 2, 1, 3).reshape(1, L, -1)  # noqa: E731
        sdpa = lambda: mx.fast.scaled_dot_product_attention(  # noqa: E731
            q, k, v, scale=D ** -0.5, mask="causal").transpose(0, 2, 1, 3).reshape(1, L, -1)
        for _ in range(2):
            mx.eval(kern(), sdpa())
        tk, ts = [], []
        for _ in range(reps):
            tk.append(timed_batch(kern))
            ts.append(timed_batch(sdpa))
        row = {"L": L, "kernel_ms": statistics.median(tk) * 1e3, "sdpa_ms": statistics.median(ts) * 1e3}
        row["ratio"] = row["sdpa_ms"] / row["kernel_ms"]
        row["vs_sdpa"] = compare(kern(), sdpa())
        rows.append(row)
        log(f"attention L={L}: {json.dumps(row)}")
    suggested = None
    for r in reversed(rows):
        if r.get("ratio", 0) > 1.0:
            suggested = r["L"]
        else:
            break
    return rows, suggested


def time_pair(fused, stock, reps, n=20):
    """{"fused_us", "stock_us", "ratio"}: each side's time per call over n calls evaluated together
    (one call alone is MLX's host overhead), alternating, medians of `reps` after one untimed round."""

    def many(fn):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(n)])
        mx.synchronize()
        return (time.perf_counter() - t0) / n

    many(fused), many(stock)
    tf, ts = [], []
    for _ in range(reps):
        tf.append(many(fused))
        ts.append(many(stock))
    f, st = statistics.median(tf) * 1e6, statistics.median(ts) * 1e6
    return {"fused_us": f, "stock_us": st, "ratio": st / f}


def bench_rope(cfg, lens, reps):
    """The patch's fused RoPE (q and k rotated, v moved to [B, Hkv, L, D], one launch) against
    stock's (nn.RoPE on the transposed views of q and k, v's transpose made contiguous) at the
    model's per-layer shapes: every element compared, and the time of 20 calls evaluated together
    (median of `reps`; one call alone is MLX's host overhead)."""
    import mlx.nn as nn

    H, Hkv, D = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    rope = nn.RoPE(D, base=10000.0)
    rows = []
    for L in lens:
        kq, kk, kv = mx.random.split(mx.random.key(300 + L), 3)
        q = mx.random.normal((1, L, H, D), key=kq).astype(mx.float16)
        k = mx.random.normal((1, L, Hkv, D), key=kk).astype(mx.float16)
        v = mx.random.normal((1, L, Hkv, D), key=kv).astype(mx.float16)
        mx.eval(q, k, v)

        def fused():
            return export_llama._llama_rope_cuda(q, k, v, rope)

        def stock():
            return (rope(q.transpose(0, 2, 1, 3)), rope(k.transpose(0, 2, 1, 3)),
                    mx.contiguous(v.transpose(0, 2, 1, 3)))

        got, want = fused(), stock()
        row = {"L": L, "q": compare(got[0], want[0].transpose(0, 2, 1, 3)), "k": compare(got[1], want[1]),
               "v": compare(got[2], want[2])}
        # the same kernel reading the fused projection [B, L, H + 2 Hkv, D] (fuse_qkv)
        got = export_llama._llama_rope_cuda_qkv(mx.concatenate([q, k, v], axis=2), H, Hkv, rope)
        row["qkv_bad"] = sum(compare(g, w)["bad"] for g, w in zip(got, (want[0].transpose(0, 2, 1, 3), want[1], want[2])))
        row.update(time_pair(fused, stock, reps))
        rows.append(row)
        log(f"rope L={L}: {json.dumps(row)}")
    return rows


def bench_swiglu(cfg, lens, reps):
    """The patch's silu(g) * u kernel on the stacked gate/up output [L, 2 I] against mlx-lm's
    swiglu on the two projections' own outputs (what stock runs), at the model's per-layer shapes:
    every element compared, and the time of 20 calls evaluated together (median of `reps`)."""
    from mlx_lm.models.activations import swiglu

    I = cfg["intermediate_size"]
    rows = []
    for L in lens:
        gu = mx.random.normal((L, 2 * I), key=mx.random.key(400 + L)).astype(mx.float16)
        g, u = mx.contiguous(gu[:, :I]), mx.contiguous(gu[:, I:])
        mx.eval(gu, g, u)

        def fused():
            return export_llama._llama_swiglu_cuda(gu)

        def stock():
            return swiglu(g, u)

        row = {"L": L, "out": compare(fused(), stock())}
        row.update(time_pair(fused, stock, reps))
        row["fused_TBps"] = 3 * L * I * 2 / (row["fused_us"] * 1e-6) / 1e12
        rows.append(row)
        log(f"swiglu L={L}: {json.dumps(row)}")
    return rows


def bench_prefill(model, tg, L, reps, vocab):
    ids = mx.random.randint(0, vocab, (1, L), key=mx.random.key(100 + L))

    def run():
        c = mlx_cache.make_prompt_cache(model)
        h = model.model(ids, cache=c)
        return [model.lm_head(h[:, -1:])] + [s for x in c for s in (x.keys, x.values)]

    times = {"stock": [], "patched": []}
    builds = {"stock": [], "patched": []}  # of each timed call: building the lazy graph (host only)

    def timed_run(mode):
        mx.synchronize()
        t0 = time.perf_counter()
        out = run()
        builds[mode].append(time.perf_counter() - t0)
        mx.eval(out)
        mx.synchronize()
        times[mode].append(time.perf_counter() - t0)

    for mode in ("stock", "patched"):  # warm-up (the kernel's first call compiles it)
        (tg.on if mode == "patched" else tg.off)()
        timed(run)
    for _ in range(reps):
        for mode in ("stock", "patched"):
            (tg.on if mode == "patched" else tg.off)()
            timed_run(mode)
    tg.off()
    row = {"L": L}
    for mode, t in times.items():
        row[f"{mode}_ms"] = statistics.median(t) * 1e3
        row[f"{mode}_tok_s"] = L / statistics.median(t)
        row[f"{mode}_graph_ms"] = statistics.median(builds[mode]) * 1e3
    row["ratio"] = row["patched_tok_s"] / row["stock_tok_s"]
    log(f"prefill L={L}: {json.dumps(row)}")
    return row


def bench_prefill_chunked(model, tg, L, chunk, reps, vocab):
    """A prompt of L tokens prefilled in pieces of `chunk` (as mlx_lm.generate does past its
    prefill_step_size, 2048: the cache evaluated after each piece), then the head on the last
    position: tok/s stock and patched (interleaved, medians), and the last piece's logits and the
    cache compared."""
    ids = mx.random.randint(0, vocab, (1, L), key=mx.random.key(400 + L))

    def run(full=False):
        c = mlx_cache.make_prompt_cache(model)
        for i in range(0, L - chunk, chunk):
            model.model(ids[:, i : i + chunk], cache=c)
            mx.eval([x.state for x in c])
        h = model.model(ids[:, (L - 1) // chunk * chunk :], cache=c)
        return [model.lm_head(h if full else h[:, -1:])] + [s for x in c for s in (x.keys, x.values)]

    times = {"stock": [], "patched": []}
    outs = {}
    for mode in ("stock", "patched"):  # warm-up, with the last piece's logits whole
        (tg.on if mode == "patched" else tg.off)()
        outs[mode] = run(full=True)
        mx.eval(outs[mode])
    for _ in range(reps):
        for mode in ("stock", "patched"):
            (tg.on if mode == "patched" else tg.off)()
            times[mode].append(timed(run))
    tg.off()
    row = {"L": L, "chunk": chunk}
    for mode, t in times.items():
        row[f"{mode}_ms"] = statistics.median(t) * 1e3
        row[f"{mode}_tok_s"] = L / statistics.median(t)
    row["ratio"] = row["patched_tok_s"] / row["stock_tok_s"]
    row["logits"] = compare(outs["patched"][0], outs["stock"][0])
    row["cache_bad"] = sum(compare(a, b)["bad"] for a, b in zip(outs["patched"][1:], outs["stock"][1:]))
    log(f"prefill chunked L={L} chunk={chunk}: {json.dumps(row)}")
    return row


def decode_sync(model, prompt, n, phases=None):
    """Tokens/s of a synchronous loop (model, argmax, eval per token). `phases`: a list that gets
    the median seconds a token spends building the step's graph in Python (the model's call) and
    evaluating it (MLX encoding and launching it, then waiting for the GPU)."""
    c = mlx_cache.make_prompt_cache(model)
    logits = model(prompt[None], cache=c)
    tok = mx.argmax(logits[:, -1:], axis=-1)
    mx.eval(tok)
    mx.synchronize()
    build, run = [], []
    t0 = time.perf_counter()
    for _ in range(n):
        ta = time.perf_counter()
        logits = model(tok, cache=c)
        tok = mx.argmax(logits[:, -1:], axis=-1)
        tb = time.perf_counter()
        mx.eval(tok)
        run.append(time.perf_counter() - tb)
        build.append(tb - ta)
    mx.synchronize()
    rate = n / (time.perf_counter() - t0)
    if phases is not None:
        phases.append((statistics.median(build), statistics.median(run)))
    return rate


def decode_generate(model, prompt, n):
    t_first, count = None, 0
    for _tok, _ in generate_step(prompt, model, max_tokens=n + 1):
        if t_first is None:
            t_first = time.perf_counter()
        else:
            count += 1
    return count / (time.perf_counter() - t_first)


def decode_logits(model, tg, prompt, n):
    """Every decode step's logits, patched against stock, both fed stock's greedy tokens after the
    same prompt (each through its own KV cache): the worst step's comparison."""
    outs = {}
    toks = None
    for mode in ("stock", "patched"):
        (tg.on if mode == "patched" else tg.off)()
        c = mlx_cache.make_prompt_cache(model)
        logits = model(prompt[None], cache=c)
        got, fed = [], []
        tok = mx.argmax(logits[:, -1:], axis=-1)
        for i in range(n):
            if toks is not None:
                tok = toks[i]
            fed.append(tok)
            logits = model(tok, cache=c)
            mx.eval(logits)
            got.append(logits)
            tok = mx.argmax(logits[:, -1:], axis=-1)
        outs[mode] = got
        toks = fed if toks is None else toks
    tg.off()
    rows = [compare(a, b) for a, b in zip(outs["patched"], outs["stock"])]
    worst = max(rows, key=lambda r: (r["bad"], r["max_rel"]))
    return {**worst, "steps": n, "bad_steps": sum(r["bad"] > 0 for r in rows),
            "top1_agree": sum(r["top1_agree"] for r in rows) / n}


def bench_decode(model, tg, prompt_len, n, vocab, reps=5):
    prompt = mx.random.randint(0, vocab, (prompt_len,), key=mx.random.key(7))
    rows = []
    lg = decode_logits(model, tg, prompt, min(n, 32))
    log(f"decode logits: {json.dumps(lg)}")
    for name, fn in (("sync loop", decode_sync), ("generate_step", decode_generate)):
        rates = {"stock": [], "patched": []}
        for mode in ("stock", "patched"):  # warm-up
            (tg.on if mode == "patched" else tg.off)()
            fn(model, prompt, 2)
        for _ in range(reps):
            for mode in ("stock", "patched"):
                (tg.on if mode == "patched" else tg.off)()
                rates[mode].append(fn(model, prompt, n))
        tg.off()
        row = {"method": name, "prompt": prompt_len, "tokens": n,
               "stock_tok_s": statistics.median(rates["stock"]), "patched_tok_s": statistics.median(rates["patched"]),
               "stock_all": rates["stock"], "patched_all": rates["patched"], "logits": lg}
        row["ratio"] = row["patched_tok_s"] / row["stock_tok_s"]
        # the same repetition's pair: drift between repetitions (the host's, decode being bound by it) cancels
        row["ratio_of_pairs"] = statistics.median(p / s for p, s in zip(rates["patched"], rates["stock"]))
        rows.append(row)
        log(f"decode {name}: {json.dumps(row)}")
    return rows


def bench_logits(model, args, tg, lens, vocab, f32_ref):
    rows = []
    m32 = None
    if f32_ref:
        m32 = llama.Model(args)
        m32.update(tree_map(lambda a: a.astype(mx.float32), model.parameters()))
        mx.eval(m32.parameters())
    for L in lens:
        ids = mx.random.randint(0, vocab, (1, L), key=mx.random.key(200 + L))
        tg.off()
        stock = model(ids)
        mx.eval(stock)
        tg.on()
        patched = model(ids)
        mx.eval(patched)
        tg.off()
        row = {"L": L, "patched_vs_stock": compare(patched, stock)}
        if m32 is not None:
            ref = m32(ids)
            mx.eval(ref)
            row["patched_vs_f32"] = compare(patched, ref)
            row["stock_vs_f32"] = compare(stock, ref)
            del ref
        del stock, patched
        rows.append(row)
        log(f"logits L={L}: {json.dumps(row)}")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--module", default=None, help="a module written by `ksearch export --mlx` for attention")
    ap.add_argument("--tiny", action="store_true", help="a small config and short lengths (a CPU check)")
    ap.add_argument("--standin", action="store_true",
                    help="attention in MLX ops instead of the CUDA kernel (the default on MLX's CPU back-end)")
    ap.add_argument("--min-len", type=int, default=None,
                    help=f"patch_mlx_lm_llama's min_len (default {export_llama.LLAMA_MIN_LEN}, the module's; tiny 64)")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of prefill and attention timings")
    ap.add_argument("--decode", type=int, default=None, help="tokens per decode measurement (128; tiny 8)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens before decode (1024; tiny 64)")
    ap.add_argument("--budget", type=float, default=170.0, help="seconds; phases that would start past it are skipped")
    ap.add_argument("--no-f32", action="store_true", help="skip the f32 reference logits")
    ap.add_argument("--prefill-lens", default=None, help="prompt lengths for prefill and logits (default 2048,4096; tiny 128,256)")
    ap.add_argument("--choose", default="always", choices=("always", "measured"),
                    help="patch_mlx_lm_llama's choice: always the kernel (to measure it), or measured "
                         "(the patch's default: per shape class the faster of kernel and stock)")
    a = ap.parse_args()

    cfg = TINY if a.tiny else FULL
    prefill_lens = (128, 256) if a.tiny else (2048, 4096)
    if a.prefill_lens:
        prefill_lens = tuple(int(x) for x in a.prefill_lens.split(","))
    attn_lens = (32, 64, 128, 256) if a.tiny else (512, 1024, 2048, 4096)
    n_decode = a.decode or (8 if a.tiny else 128)
    prompt_len = a.prompt or (64 if a.tiny else 1024)
    min_len = a.min_len or (64 if a.tiny else export_llama.LLAMA_MIN_LEN)
    cpu = mx.default_device() == mx.cpu
    standin = a.standin or (cpu and not a.module)

    res = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "mlx": mx.__version__,
           "device": str(mx.default_device()), "config": cfg, "dtype": "f16", "min_len": min_len, "choose": a.choose,
           "attention": "stand-in (MLX ops)" if standin else (a.module or f"task.toml {os.environ.get('KS_ATT_KERNEL', 'flash_wgmma')} defaults"),
           "skipped": [], "errors": []}
    try:
        res["device_info"] = {k: (v if isinstance(v, (int, float, str, bool)) else str(v))
                              for k, v in mx.device_info().items()}
    except Exception as e:
        res["device_info"] = {"error": str(e)}
    log(f"mlx {mx.__version__} on {mx.default_device()}; config {cfg}; attention {res['attention']}; min_len {min_len}")

    if a.module:
        patch, attention = module_patch(a.module)
        admits = None
        unpatch = patch(min_len=min_len, choose=a.choose)
    else:
        attention, admits = standin_attention() if standin else kernel_attention()
        unpatch = export_llama.patch_mlx_lm_llama(attention, min_len=min_len, admits=admits, dtypes=(mx.float16,), choose=a.choose,
                                                  rope=None if os.environ.get("KS_LLAMA_ROPE") == "0" else "auto",
                                                  fuse_qkv=os.environ.get("KS_LLAMA_QKV") != "0",
                                                  fuse_mlp=os.environ.get("KS_LLAMA_MLP") != "0",
                                                  compile=os.environ.get("KS_LLAMA_COMPILE") != "0")
    tg = Toggle(unpatch)
    model, args = make_model(cfg, mx.float16)
    n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
    res["parameters"] = int(n_params)
    log(f"model: {n_params / 1e6:.1f} M parameters, f16")

    def phase(name, fn, share):
        """Runs fn() if there is time left; `share` is the fraction of the budget it may start after."""
        if elapsed() > a.budget * share:
            res["skipped"].append(f"{name} (at {elapsed():.0f} s of {a.budget:.0f} s)")
            log(f"skipping {name}: out of time")
            return None
        try:
            return fn()
        except Exception:
            res["errors"].append({"phase": name, "error": traceback.format_exc()[-1500:]})
            log(f"{name}: {traceback.format_exc()[-800:]}")
            return None

    fused_rope = export_llama._llama_rope_default() is not None and os.environ.get("KS_LLAMA_ROPE") != "0"
    res["attention_alone"], res["suggested_min_len"] = phase(
        "attention alone", lambda: bench_attention(attention, admits, cfg, attn_lens, max(a.reps, 10), fused_rope), 0.3) or ([], None)
    if fused_rope:
        res["rope"] = phase("fused rope", lambda: bench_rope(cfg, prefill_lens, a.reps), 0.3) or []
        res["swiglu"] = phase("swiglu", lambda: bench_swiglu(cfg, prefill_lens, a.reps), 0.3) or []
    else:
        res["rope"], res["swiglu"] = [], []
    res["prefill"] = [r for r in (phase(f"prefill L={L}", lambda L=L: bench_prefill(model, tg, L, a.reps, cfg["vocab_size"]), 0.5)
                                  for L in prefill_lens) if r]
    chunk = 64 if a.tiny else 2048
    res["prefill_chunked"] = [r for r in (phase(f"prefill chunked L={L}", lambda L=L: bench_prefill_chunked(
        model, tg, L, chunk, a.reps, cfg["vocab_size"]), 0.55) for L in prefill_lens if L > chunk) if r]
    res["decode"] = phase("decode", lambda: bench_decode(model, tg, prompt_len, n_decode, cfg["vocab_size"]), 0.65) or []
    res["logits"] = phase("logits", lambda: bench_logits(model, args, tg, prefill_lens, cfg["vocab_size"], not a.no_f32), 0.8) or []
    tg.off()
    res["paths"] = {"stats": dict(unpatch.stats), "reasons": dict(getattr(unpatch, "reasons", {})),
                    "rope": dict(getattr(unpatch, "rope", {})), "qkv": dict(getattr(unpatch, "qkv", {})),
                    "mlp": dict(getattr(unpatch, "mlp", {})), "decode": dict(getattr(unpatch, "decode", {})),
                    "choices": {str(k): list(v) for k, v in getattr(unpatch, "choices", {}).items()}}
    # attention's share of stock prefill: layers x SDPA time at that L / prefill time
    sdpa = {r["L"]: r["sdpa_ms"] for r in res["attention_alone"] if "sdpa_ms" in r}
    for r in res["prefill"]:
        if r["L"] in sdpa:
            r["attention_share"] = cfg["num_hidden_layers"] * sdpa[r["L"]] / r["stock_ms"]
    res["seconds"] = elapsed()
    with open(os.path.join(OUT, "mlx_llama.json"), "w") as f:
        json.dump(res, f, indent=1)

    c = cfg
    lines = [f"== mlx-lm Llama ({c['num_hidden_layers']} layers, hidden {c['hidden_size']}, {c['num_attention_heads']}/"
             f"{c['num_key_value_heads']} heads x {c['head_dim']}, MLP {c['intermediate_size']}, vocab {c['vocab_size']}, f16,"
             f" {res['parameters'] / 1e6:.0f} M params): stock vs patched ({res['attention']}, min_len {min_len}, choose {a.choose}),"
             f" {res['date']}, mlx {mx.__version__}, {res['device']} =="]
    if res["attention_alone"]:
        lines.append(f"{'attention alone (B=1, causal)':<32} {'L':>6} {'kernel ms':>10} {'SDPA ms':>9} {'ratio':>6}")
        for r in res["attention_alone"]:
            if "ratio" in r:
                lines.append(f"{'':<32} {r['L']:>6} {r['kernel_ms']:>10.3f} {r['sdpa_ms']:>9.3f} {r['ratio']:>6.3f}")
            else:
                lines.append(f"{'':<32} {r['L']:>6} {r.get('error', '')}")
        lines.append(f"suggested min_len (kernel faster at this L and every longer one measured): {res['suggested_min_len']}")
    for r in res["rope"]:
        bad = sum(r[t]["bad"] for t in ("q", "k", "v"))
        n = sum(r[t]["elements"] for t in ("q", "k", "v"))
        lines.append(f"{'fused RoPE + v move (layer)':<32} {r['L']:>6} {r['fused_us']:>8.1f} us {r['stock_us']:>7.1f} us "
                     f"{r['ratio']:>6.3f}  (stock RoPE + transpose); max|d| q {r['q']['max_abs']:.3g} "
                     f"k {r['k']['max_abs']:.3g} v {r['v']['max_abs']:.3g}, bad {bad}/{n} (from fused qkv: {r['qkv_bad']})")
    for r in res.get("swiglu", []):
        lines.append(f"{'swiglu of stacked gate/up (layer)':<32} {r['L']:>6} {r['fused_us']:>8.1f} us {r['stock_us']:>7.1f} us "
                     f"{r['ratio']:>6.3f}  (mlx-lm's swiglu); {r['fused_TBps']:.2f} TB/s, max|d| {r['out']['max_abs']:.3g}, "
                     f"bad {r['out']['bad']}/{r['out']['elements']}")
    lines.append(f"{'':<32} {'':>6} {'stock tok/s':>12} {'patched tok/s':>14} {'ratio':>6}")
    for r in res["prefill"]:
        share = f"  (attention {100 * r['attention_share']:.0f}% of stock)" if "attention_share" in r else ""
        lines.append(f"{'prefill':<32} {r['L']:>6} {r['stock_tok_s']:>12.0f} {r['patched_tok_s']:>14.0f} {r['ratio']:>6.3f}{share}"
                     f"  graph building {r['stock_graph_ms']:.2f} / {r['patched_graph_ms']:.2f} ms")
    for r in res["prefill_chunked"]:
        lines.append(f"{'prefill in ' + str(r['chunk']) + '-token pieces':<32} {r['L']:>6} {r['stock_tok_s']:>12.0f} "
                     f"{r['patched_tok_s']:>14.0f} {r['ratio']:>6.3f}  last piece's logits max|d| "
                     f"{r['logits']['max_abs']:.3g} bad {r['logits']['bad']}, cache bad {r['cache_bad']}")
    for r in res["decode"]:
        lines.append(f"{'decode ' + r['method'] + ' (ctx ' + str(r['prompt']) + ')':<32} {r['tokens']:>6} "
                     f"{r['stock_tok_s']:>12.1f} {r['patched_tok_s']:>14.1f} {r['ratio']:>6.3f}"
                     f"  (median of each repetition's pair: {r['ratio_of_pairs']:.3f})")
    if res["decode"]:
        g = res["decode"][0]["logits"]
        lines.append(f"{'decode logits (' + str(g['steps']) + ' steps)':<32} patched vs stock, stock's tokens fed to both: worst "
                     f"step max rel {g['max_rel']:.2e}, max|d| {g['max_abs']:.3g}, bad {g['bad']}/{g['elements']} "
                     f"({g['bad_steps']} steps with any), top-1 {100 * g['top1_agree']:.2f}%")
    for r in res["logits"]:
        p = r["patched_vs_stock"]
        s = f"{'logits L=' + str(r['L']):<32} patched vs stock: max rel {p['max_rel']:.2e}, max|d| {p['max_abs']:.3g}, " \
            f"bad {p['bad']}/{p['elements']}, top-1 {100 * p['top1_agree']:.2f}%"
        if "patched_vs_f32" in r:
            q, t = r["patched_vs_f32"], r["stock_vs_f32"]
            s += f"; vs f32: patched max rel {q['max_rel']:.2e} bad {q['bad']}, stock max rel {t['max_rel']:.2e} bad {t['bad']}"
        lines.append(s)
    lines.append(f"paths: {res['paths']['stats']} stock reasons {res['paths']['reasons']} fused RoPE {res['paths']['rope']}"
                 f" fused qkv {res['paths']['qkv']} fused MLP {res['paths']['mlp']} fused decode {res['paths']['decode']};"
                 f" {res['seconds']:.0f} s"
                 + (f"; skipped: {', '.join(res['skipped'])}" if res["skipped"] else "")
                 + (f"; errors in {', '.join(e['phase'] for e in res['errors'])}" if res["errors"] else ""))
    for k, (tk, ts, chosen) in res["paths"]["choices"].items():
        lines.append(f"measured choice {k}: kernel {tk * 1e6:.1f} us, stock {ts * 1e6:.1f} us -> {'kernel' if chosen else 'stock'}")
    print("\n" + "\n".join(lines), flush=True)
    return 1 if res["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
