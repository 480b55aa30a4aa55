#!/usr/bin/env python3
"""What one operation of a decode step costs MLX end to end (building it in Python, MLX encoding and
launching it, the GPU running it), per kind of operation at the Llama decode shapes of
bench/mlx_llama.py (hidden 2048, 32 query / 8 key-value heads of 128, MLP 5632, f16, one token).

    PYTHONPATH=python python3 bench/mlx_op_cost.py          # on the GPU machine (MLX's CUDA back-end)
    PYTHONPATH=python python3 bench/mlx_op_cost.py --tiny   # a CPU check of the script

For each kind, a chain of --n operations, each reading the last one's output, is built and
evaluated at once (as a decode step is), --reps times: reported are the median microseconds per
operation of building the chain (Python) and of evaluating it (encoding, launching, the GPU). Those
of a few operations that move no data (an add of two one-row vectors) are the floor every launch
pays; a kind above it by more than its bytes at the GPU's bandwidth is paying its setup on the host.
Then mlx-lm's own KVCache update of one position, evaluated each step as decode does, in a small
and a large buffer (a cost that grew with the buffer would be a copy of it). Writes
$OUT/mlx_op_cost.json. Measured on an H100 (2026-12-07, bench/h100-2026-12-07-llama-decode-plan.txt and
-llama-decode-step.txt): 2-3 us an add, 3-4 an RMSNorm or a RoPE, 4.5-5 a 2048 x 2048 gemv, 12-22 an
addmm of one row (cuBLASLt's set-up), 14-15 MLX's one-query SDPA and 33-46 the same with a mask array
(its unfused fallback).
"""
import argparse
import json
import os
import statistics
import sys
import time

import mlx.core as mx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))


def chain_cost(step, x0, n, reps):
    """(build us, eval us) per operation: median over reps of a chain of n steps from x0."""
    builds, evals = [], []
    for _ in range(reps + 1):
        mx.synchronize()
        t0 = time.perf_counter()
        x = x0
        for _ in range(n):
            x = step(x)
        t1 = time.perf_counter()
        mx.eval(x)
        mx.synchronize()
        t2 = time.perf_counter()
        builds.append((t1 - t0) / n)
        evals.append((t2 - t1) / n)
    return 1e6 * statistics.median(builds[1:]), 1e6 * statistics.median(evals[1:])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="small shapes (a CPU check)")
    ap.add_argument("--n", type=int, default=256, help="operations a chain")
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    M, I, H, Hkv, D, T = (2048, 5632, 32, 8, 128, 1152) if not a.tiny else (256, 512, 4, 2, 64, 64)
    f16 = mx.float16
    key = mx.random.key(0)

    def rnd(*shape):
        return (mx.random.normal(shape, key=key) * 0.02).astype(f16)

    x = rnd(1, M)
    w_sq, w_up, w_down = rnd(M, M), rnd(2 * I, M), rnd(M, 2 * I)
    ln = mx.ones((M,), dtype=f16)
    kc, vc = rnd(1, Hkv, T + 256, D), rnd(1, Hkv, T + 256, D)
    q = rnd(1, H, 1, D)
    off = mx.array(T, dtype=mx.int32)
    upd, pos = rnd(1, Hkv, 1, D), mx.array([0, 0, T, 0])
    keep = (mx.arange(T + 256) < T).reshape(1, 1, 1, T + 256)
    pos0 = mx.array([0, 0, 32, 0])  # one position's keys, written as a KV cache does
    mx.eval(x, w_sq, w_up, w_down, ln, kc, vc, q, off, upd, pos, keep, pos0)

    from ksearch_mlx import export_llama as el

    cuda = el._llama_rope_default() is not None
    add_c = mx.compile(lambda v: (v * 0.5 + 0.25) * v)

    kinds = {
        "add (one-row vectors)": (lambda v: v + x, x),
        "compiled elementwise (3 ops fused)": (lambda v: add_c(v), x),
        "rms_norm": (lambda v: mx.fast.rms_norm(v, ln, 1e-5), x),
        f"matmul 1x{M} by {M}x{M} (gemv)": (lambda v: v @ w_sq.T, x),
        f"addmm 1x{M} by {M}x{M}": (lambda v: mx.addmm(v, v, w_sq.T), x),
        f"matmul 1x{M} by {M}x{2 * I} then back (two gemvs)": (lambda v: (v @ w_up.T) @ w_down.T, x),
        f"dynamic slice update (start an array), one position of [1, {Hkv}, {T + 256}, {D}]": (
            lambda c: mx.slice_update(c, upd, pos, axes=(0, 1, 2, 3)), kc),
        f"dynamic slice update (start an array), one position of [1, {Hkv}, 64, {D}]": (
            lambda c: mx.slice_update(c, upd, pos0, axes=(0, 1, 2, 3)), kc[:, :, :64] + 0),
        f"rope (mx.fast.rope, offset an array) of [1, {H}, 1, {D}]": (
            lambda qq: mx.fast.rope(qq, D, traditional=False, base=10000.0, scale=1.0, offset=off), q),
        f"sdpa, one query over {T} keys (GQA {H}/{Hkv})": (
            lambda qq: mx.fast.scaled_dot_product_attention(qq, kc[:, :, :T], vc[:, :, :T], scale=D ** -0.5), q),
        f"sdpa, one query over a {T + 256}-key buffer, a boolean mask keeping {T}": (
            lambda qq: mx.fast.scaled_dot_product_attention(qq, kc, vc, scale=D ** -0.5, mask=keep), q),
    }
    kinds[f"concatenate of two [1, {I}] halves"] = (lambda g: mx.concatenate([g[:, :I], g[:, I:]], axis=1), rnd(1, 2 * I))
    if cuda:  # the custom kernel's output [1, I] made [1, 2 I] again by a concatenation (the kind above)
        kinds[f"custom kernel (the patch's swiglu, 1x{2 * I}) + concatenate"] = (
            lambda g: mx.concatenate([el._llama_swiglu_cuda(g)] * 2, axis=1), rnd(1, 2 * I))
    res = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "mlx": mx.__version__,
           "device": str(mx.default_device()), "n": a.n, "reps": a.reps, "env": {k: v for k, v in os.environ.items() if k.startswith("MLX_")},
           "kinds": {}}
    print(f"== MLX per-operation cost, chains of {a.n}, medians of {a.reps}, {res['device']}, mlx {mx.__version__}, "
          f"env {res['env']} ==")
    print(f"{'operation':<64} {'build us':>9} {'eval us':>9}")
    for name, (fn, x0) in kinds.items():
        b, e = chain_cost(fn, x0, a.n, a.reps)
        res["kinds"][name] = {"build_us": b, "eval_us": e}
        print(f"{name:<64} {b:>9.2f} {e:>9.2f}", flush=True)
    # mlx-lm's KVCache update (`keys[..., prev:offset, :] = new`) of one position, evaluated each
    # step as decode does, in buffers of two sizes: a cost that grows with the buffer is a copy of it
    from mlx_lm.models.cache import KVCache

    print(f"{'KVCache.update_and_fetch of one position, evaluated each step':<64} {'build us':>9} {'eval us':>9}")
    for T2 in ((256, 4096) if not a.tiny else (64, 512)):
        c = KVCache()
        c.update_and_fetch(rnd(1, Hkv, T2 - 8, D), rnd(1, Hkv, T2 - 8, D))
        mx.eval(c.keys, c.values)
        kv1 = (rnd(1, Hkv, 1, D), rnd(1, Hkv, 1, D))
        mx.eval(*kv1)
        bs, es = [], []
        for _ in range(7):
            c.offset = T2 - 8
            mx.synchronize()
            t0 = time.perf_counter()
            k, v = c.update_and_fetch(*kv1)
            t1 = time.perf_counter()
            mx.eval(k, v)
            mx.synchronize()
            bs.append(t1 - t0)
            es.append(time.perf_counter() - t1)
        name = f"  into a [1, {Hkv}, {T2}, {D}] buffer"
        b, e = 1e6 * statistics.median(bs[1:]), 1e6 * statistics.median(es[1:])
        res["kinds"]["kvcache update " + name.strip()] = {"build_us": b, "eval_us": e}
        print(f"{name:<64} {b:>9.2f} {e:>9.2f}", flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "mlx_op_cost.json"), "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
