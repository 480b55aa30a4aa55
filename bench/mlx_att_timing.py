"""Why an attention kernel's samples inside MLX spread above its minimum (bench/mlx_att_inputs.py saw
flash_ws at min 476 us, median 550-563 us at 4,32,8,2048,128, where the CUDA back-end's events
give 479 us): the kernel of the attention task's [backends.mlx-cuda] (KS_ATT_KERNEL, default
flash_ws) and MLX's SDPA, timed alternately, each sample after a 256 MiB flush, in these modes:

  gate1   one call between the GPU clock's stamps right behind its gate, the 256 MiB flush
          on the host before the sample (the judge's way before the lead existed)
  gate3   as gate1 with three chained calls, per call
  lead    the flush queued as GPU work between the gate and the first stamp (the judge's way
          now: python/ksearch_mlx/gpuclock.py), one call
  lead3   as lead with three chained calls, per call
  warm    as gate1, with ~2 ms of matrix products queued before the gate
  sumfl   as gate1, the flush a read (a sum of the 256 MiB) instead of a 256 MiB result
  noflush as gate1 without a flush
  keep    as gate1, the CUDA memory pool told to keep what it reserved (release threshold the
          maximum, through libcuda): no memory given back and mapped again between samples
  wall20  20 chained calls, host wall time / 20 (no gate: launches queue back to back)

and prints min / 25% / median / 75% / max per (mode, function).

On the GPU machine, MLX staged (bench/mlx_gpu.sh's header):
    PYTHONPATH=python python3 bench/mlx_att_timing.py [--shape 4,32,8,2048,128,0] [--reps 15]
"""

import argparse
import os
import statistics
import sys
import time

os.environ["MLX_USE_CUDA_GRAPHS"] = "0"  # before MLX starts: the GPU clock needs launches in order
os.environ.setdefault("KS_ATT_KERNEL", "flash_ws")

import mlx.core as mx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mlx_attention import Case, candidate, load  # noqa: E402

from ksearch_mlx import gpuclock  # noqa: E402
from ksearch_mlx import runtime as rt  # noqa: E402


def quantiles(ts: list) -> str:
    s = sorted(ts)
    q = lambda f: s[min(len(s) - 1, int(f * (len(s) - 1) + 0.5))]  # noqa: E731
    return f"{s[0]:8.1f} {q(0.25):8.1f} {statistics.median(s):8.1f} {q(0.75):8.1f} {s[-1]:8.1f}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4,32,8,2048,128,0", help="B,H,Hkv,L,D,causal")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--defs", default="", help='tunables of the kernel, e.g. "CTAS=1048576"')
    ap.add_argument("--modes", default="gate1,gate3,lead,lead3")
    a = ap.parse_args()
    B, H, Hkv, L, D, causal = (int(x) for x in a.shape.split(","))
    clock, why = gpuclock.GpuClock.create()
    if clock is None:
        print(f"no GPU clock: {why}")
        return 1
    task, k, source = load()
    defs = {n.strip(): int(x) for n, x in (kv.split("=") for kv in a.defs.split(",") if kv)}
    cc = rt.CompiledCandidate(candidate(k, source, defs), task, "mlx-cuda")
    case = Case(B, H, Hkv, L, D)
    axes = case.axes(causal)
    v = {"q": case.q, "k": case.k, "v": case.v}
    fns = {
        os.environ["KS_ATT_KERNEL"]: lambda x: {"o": cc(x, axes)["o"]},
        "MLX SDPA": lambda x: {"o": mx.fast.scaled_dot_product_attention(
            x["q"], x["k"], x["v"], scale=case.scale, mask="causal" if causal else None)},
    }
    flush_src = mx.zeros(((256 << 20) // 4,), mx.float32)
    busy_a = mx.random.normal((8192, 8192)).astype(mx.float16)  # 8192^3 * 2 flops: ~2 ms
    mx.eval(flush_src, busy_a)
    for f in fns.values():
        mx.eval(f(v)["o"])  # compiled and loaded outside any bracket
    mx.eval(busy_a @ busy_a)

    def flush(mode: str):
        if mode == "noflush":
            return
        mx.eval(mx.sum(flush_src) if mode == "sumfl" else flush_src + 1.0)
        mx.synchronize()

    def keep_reserved() -> None:
        import ctypes
        cu = ctypes.CDLL("libcuda.so.1")
        dev, pool = ctypes.c_int(), ctypes.c_void_p()
        for call in (lambda: cu.cuDeviceGet(ctypes.byref(dev), 0),
                     lambda: cu.cuDeviceGetDefaultMemPool(ctypes.byref(pool), dev),
                     lambda: cu.cuMemPoolSetAttribute(pool, 4, ctypes.byref(ctypes.c_uint64(2**64 - 1)))):
            r = call()
            if r != 0:
                raise RuntimeError(f"libcuda error {r}")

    def lead(after: list) -> list:
        return [mx.depends([flush_src], after)[0] + 1.0]

    def sample(mode: str, f) -> float:
        if mode == "lead":
            return clock.time_calls([f], [v], lead=lead)[0] * 1e6
        if mode == "lead3":
            return clock.time_calls([f, f, f], [v, v, v], lead=lead)[0] * 1e6
        flush(mode)
        if mode in ("gate1", "sumfl", "noflush", "keep"):
            return clock.time_calls([f], [v])[0] * 1e6
        if mode == "gate3":
            return clock.time_calls([f, f, f], [v, v, v])[0] * 1e6
        if mode == "warm":
            mx.async_eval(busy_a @ busy_a)  # queued before the gate: the GPU busy until the release
            return clock.time_calls([f], [v])[0] * 1e6
        if mode == "wall20":
            t0 = time.perf_counter()
            prev = []
            outs = []
            for _ in range(20):
                x = dict(zip(v, mx.depends(list(v.values()), prev))) if prev else v
                o = f(x)["o"]
                outs.append(o)
                prev = [o]
            mx.eval(outs)
            mx.synchronize()
            return (time.perf_counter() - t0) / 20 * 1e6
        raise ValueError(mode)

    print(f"mlx {mx.__version__}; shape {a.shape}; kernel {os.environ['KS_ATT_KERNEL']} {a.defs or 'defaults'}; {clock.empty_ns / 1e3:.1f} us empty bracket; "
          f"{a.reps} samples per row, alternating the functions; us per call")
    print(f"{'mode':<8} {'function':<12} {'min':>8} {'25%':>8} {'median':>8} {'75%':>8} {'max':>8}")
    for mode in a.modes.split(","):
        if mode == "keep":
            keep_reserved()
        ts = {n: [] for n in fns}
        for _ in range(a.reps):
            for n, f in fns.items():
                ts[n].append(sample(mode, f))
        for n in fns:
            print(f"{mode:<8} {n:<12} {quantiles(ts[n])}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
