#!/usr/bin/env python3
"""Where an attention call's host time goes on MLX's CUDA back-end, per path, at the Llama patch's
per-layer shape (B = 1, 32 query heads on 8 KV heads x 128, causal, q in mlx-lm's [B, L, H, D]
storage):

  stock     mx.fast.scaled_dot_product_attention (what mlx-lm runs), o back in [B, L, H * D];
  lhd       the searched kernel's QO_LHD build through ksearch_mlx.runtime.CompiledCandidate
            (bench/mlx_llama.py's kernel_attention, KS_ATT_KERNEL picks the kernel);
  lhd+comp  the same through mx.compile, as the Llama patch runs it;
  export    the task function of a module as `ksearch export --mlx` writes it (the runtime, the
            task, the kernel at its defaults, the tail), q and o in the task's [B, H, L, D], called
            plainly (COMPILE_CALLS = False); stock_t is stock's call in that layout;
  export+c  the same function as exported: each call shape through mx.compile;
  user+c    the exported function inside a caller's own mx.compile;
  bare      a precompiled_cuda_kernel call built and never evaluated, with a compiled source as
            long as the kernel's CUBIN (MLX copies it into every primitive it makes) and with a
            1 KB one: the cost of making the call and of that copy.

For each, per call: "build", the host time to make the call's lazy arrays (no evaluation);
"queued", the time per call of 32 calls each handed to the GPU as it is built (mx.async_eval) and
waited for together (the Llama patch's measured choice times so); at a short L the GPU's part is
small, so "queued" is the host's cost per call. Medians of --reps. Numbers, not a ranking: the
GPU times of the kernels themselves are the MLX worker's judge's (GPU clock).

  PYTHONPATH=python KS_ATT_KERNEL=flash_ws python3 bench/mlx_call_cost.py [--lens 128,1024] [--reps 5]
"""

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import mlx.core as mx  # noqa: E402

import mlx_llama  # noqa: E402

def per_call(fn, n, reps):
    """(build us, queued us): medians over reps of n calls each."""
    mx.eval(fn())
    build, queued = [], []
    for _ in range(reps):
        mx.synchronize()
        t0 = time.perf_counter()
        outs = [fn() for _ in range(n)]
        build.append((time.perf_counter() - t0) / n)
        del outs
        mx.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            mx.async_eval(fn())
        mx.synchronize()
        queued.append((time.perf_counter() - t0) / n)
    return statistics.median(build) * 1e6, statistics.median(queued) * 1e6


def exported_module():
    """The attention module as `ksearch export --mlx` writes it: runtime.py, the three generated
    lines (TASK, CANDIDATE at the kernel's defaults for D = 128, BACKEND) and export_tail.py."""
    import json
    import types

    import mlx_attention as ma

    task, kern, source = ma.load()
    cand = ma.candidate(kern, source, {"HD": 128})
    py = os.path.join(ROOT, "python", "ksearch_mlx")
    with open(os.path.join(py, "runtime.py")) as f:
        runtime = f.read()
    with open(os.path.join(py, "export_tail.py")) as f:
        tail = f.read()
    gen = (f"\nimport json\nTASK = json.loads(r'''{json.dumps(task)}''')\n"
           f"CANDIDATE = json.loads(r'''{json.dumps(cand)}''')\nBACKEND = \"mlx-cuda\"\n")
    mod = types.ModuleType("ks_exported_attention")
    exec(compile(runtime + gen + tail, "<ks_exported_attention>", "exec"), mod.__dict__)
    return mod


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", default="128,1024")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--calls", type=int, default=32)
    a = ap.parse_args()
    attention, _ = mlx_llama.kernel_attention()
    lhd = getattr(attention, "lhd", None)
    if lhd is None:
        sys.exit("the kernel has no QO_LHD build")
    H, Hkv, D = 32, 8, 128
    print(f"mlx {mx.__version__} {mx.default_device()}; kernel {os.environ.get('KS_ATT_KERNEL', 'flash_wgmma')}; "
          f"B 1, H {H}, Hkv {Hkv}, D {D}, causal; {a.calls} calls a timing, medians of {a.reps}")
    print(f"{'path':<10} {'L':>6} {'build us':>9} {'queued us':>10}")
    mod = exported_module()
    plain_mod = exported_module()  # its own module, never compiling its calls
    plain_mod.COMPILE_CALLS = False
    for L in [int(x) for x in a.lens.split(",")]:
        kq, kk, kv = mx.random.split(mx.random.key(L), 3)
        q = mx.random.normal((1, L, H, D), key=kq).astype(mx.float16)
        k = mx.random.normal((1, Hkv, L, D), key=kk).astype(mx.float16)
        v = mx.random.normal((1, Hkv, L, D), key=kv).astype(mx.float16)
        mx.eval(q, k, v)

        def back(q, k, v):
            return lhd(q, k, v, causal=1).reshape(1, L, -1)

        back_c = mx.compile(back)
        paths = {
            "stock": lambda: mx.fast.scaled_dot_product_attention(
                q.transpose(0, 2, 1, 3), k, v, scale=D ** -0.5, mask="causal").transpose(0, 2, 1, 3).reshape(1, L, -1),
            "lhd": lambda: back(q, k, v),
            "lhd+comp": lambda: back_c(q, k, v),
        }
        # The exported function, in the task's layout: plainly, as exported, inside a caller's
        # mx.compile. Each checked against stock once.
        qt = q.transpose(0, 2, 1, 3)
        mx.eval(qt)
        user_c = mx.compile(lambda q, k, v: mod.attention(q, k, v, causal=1))
        paths.update({
            "stock_t": lambda: mx.fast.scaled_dot_product_attention(qt, k, v, scale=D ** -0.5, mask="causal"),
            "export": lambda: plain_mod.attention(qt, k, v, causal=1),
            "export+c": lambda: mod.attention(qt, k, v, causal=1),
            "user+c": lambda: user_c(qt, k, v),
        })
        ref = paths["stock_t"]().astype(mx.float32)
        for name in ("export", "export+c", "user+c"):
            err = mx.abs(paths[name]().astype(mx.float32) - ref).max().item()
            if not err < 2e-2:
                sys.exit(f"{name} at L = {L}: max error {err} against stock")
        for name, fn in paths.items():
            b, qd = per_call(fn, a.calls, a.reps)
            print(f"{name:<10} {L:>6} {b:>9.1f} {qd:>10.1f}", flush=True)
    # Building (never evaluated) a precompiled_cuda_kernel call whose compiled source is as long as
    # the kernel's CUBIN, and one of 1 KB: what the copy of the source into each primitive costs.
    import mlx_attention as ma
    from ksearch_mlx import runtime as rt

    task, kern, source = ma.load()
    cubin = rt.CompiledCandidate(ma.candidate(kern, source, {"HD": 128, "QO_LHD": 1}), task, "mlx-cuda").unit().cubin
    x = mx.zeros((4,))
    mx.eval(x)
    for label, src in (("bare cubin", cubin), ("bare 1KB", cubin[:1024])):
        ts = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            outs = [mx.fast.precompiled_cuda_kernel(
                name="ks_cost_bare", compiled_source=src, inputs=[x], output_shapes=[(4,)],
                output_dtypes=[mx.float32], grid=(1, 1, 1), threadgroup=(1, 1, 1), scalars=[], shared_memory=0)
                for _ in range(a.calls)]
            ts.append((time.perf_counter() - t0) / a.calls)
            del outs
        print(f"{label:<10} {len(src):>6} {statistics.median(ts) * 1e6:>9.1f} {'-':>10}  (build only; L column: bytes)",
              flush=True)

if __name__ == "__main__":
    main()
