#!/usr/bin/env python3
"""Where the GPU time of mlx-lm's Llama prefill goes, stock against the attention kernel patched in
(bench/mlx_llama.py's model and patch): every kernel the process runs on the GPU recorded by CUPTI
through torch.profiler (MLX's kernels included: CUPTI sees every context of the process), one
prefill per mode after two untimed ones.

    PYTHONPATH=python KS_ATT_KERNEL=flash_ws python3 bench/mlx_llama_trace.py --lens 2048,4096
    (KS_LLAMA_ROPE=0: the patch keeps stock's RoPE instead of its fused one; KS_LLAMA_QKV=0: without
    its fuse_qkv, one matmul for the q, k and v projections; KS_LLAMA_MLP=0: without its fuse_mlp, the
    block's rest fused; KS_LLAMA_COMPILE=0: its compile=False)

Per mode and L: the span from the first kernel's start to the last kernel's end, the sum of kernel
times, the idle time between kernels (gaps, and how many exceed 10 us), and the kernels with the
most total time. Needs PyTorch with CUDA next to MLX's CUDA back-end (the GPU machine).
"""
import argparse
import collections
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import torch  # noqa: E402  (CUDA initialised before MLX allocates)

torch.cuda.init()
import mlx.core as mx  # noqa: E402
import mlx_llama as ml  # noqa: E402
from mlx_lm.models import cache as mlx_cache  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from ksearch_mlx import export_llama  # noqa: E402


def kernels(prof):
    """[(start_us, end_us, name)] of the GPU kernels and memory operations in the trace."""
    out = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            out.append((e.time_range.start, e.time_range.end, e.name))
    return sorted(out)


def summary(evs, top):
    span = evs[-1][1] - evs[0][0]
    busy, gaps, big, end = 0.0, 0.0, 0, evs[0][0]
    per = collections.defaultdict(lambda: [0, 0.0])
    for s, e, n in evs:
        if s > end:
            gaps += s - end
            big += (s - end) > 10
        busy += max(0.0, e - max(s, end))
        end = max(end, e)
        per[n][0] += 1
        per[n][1] += e - s
    lines = [f"    span {span / 1e3:8.3f} ms  kernels {len(evs):5d}  busy {busy / 1e3:8.3f} ms  "
             f"idle {gaps / 1e3:7.3f} ms ({big} gaps > 10 us)"]
    for n, (c, t) in sorted(per.items(), key=lambda x: -x[1][1])[:top]:
        lines.append(f"    {t / 1e3:8.3f} ms {c:5d}x  {n[:110]}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", default="2048,4096")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--profile", type=int, default=0,
                    help="then build each mode's lazy graph this many times (no evaluation): the host time per "
                         "build, and the patched mode's Python profile (cProfile, by own time)")
    a = ap.parse_args()
    attention, admits = ml.kernel_attention()
    unpatch = export_llama.patch_mlx_lm_llama(attention, admits=admits, dtypes=(mx.float16,), choose="always",
                                              rope=None if os.environ.get("KS_LLAMA_ROPE") == "0" else "auto",
                                              fuse_qkv=os.environ.get("KS_LLAMA_QKV") != "0",
                                              fuse_mlp=os.environ.get("KS_LLAMA_MLP") != "0",
                                              compile=os.environ.get("KS_LLAMA_COMPILE") != "0")
    tg = ml.Toggle(unpatch)
    model, _ = ml.make_model(ml.FULL, mx.float16)
    vocab = ml.FULL["vocab_size"]
    for L in (int(x) for x in a.lens.split(",")):
        ids = mx.random.randint(0, vocab, (1, L), key=mx.random.key(100 + L))

        def run():
            c = mlx_cache.make_prompt_cache(model)
            h = model.model(ids, cache=c)
            return [model.lm_head(h[:, -1:])] + [s for x in c for s in (x.keys, x.values)]

        for mode in ("stock", "patched"):
            (tg.on if mode == "patched" else tg.off)()
            for _ in range(2):
                mx.eval(run())
            mx.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                mx.eval(run())
                mx.synchronize()
            evs = kernels(prof)
            print(f"== L={L} {mode}" + ("" if evs else ": no GPU events recorded"), flush=True)
            if evs:
                print(summary(evs, a.top), flush=True)
        if a.profile:
            profile_graph(run, tg, a.profile, L)
        tg.off()


def profile_graph(run, tg, n, L):
    """Host time of building one prefill's lazy graph per mode (median of n), and where the
    patched mode's goes (cProfile)."""
    import cProfile
    import pstats
    import statistics
    import time

    for mode in ("stock", "patched"):
        (tg.on if mode == "patched" else tg.off)()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            out = run()
            times.append(time.perf_counter() - t0)
            del out
        print(f"== L={L} {mode}: graph building {statistics.median(times) * 1e3:.3f} ms (median of {n})", flush=True)
    tg.on()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        run()
    pr.disable()
    print(f"== L={L} patched: cProfile of {n} graph builds, by own time", flush=True)
    pstats.Stats(pr, stream=sys.stdout).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
