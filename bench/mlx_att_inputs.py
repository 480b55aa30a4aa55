"""Why an attention kernel runs slower inside MLX than on the CUDA back-end: one kernel of the
attention task's [backends.mlx-cuda] (KS_ATT_KERNEL, default flash_ws) and MLX's SDPA, both timed
on the MLX worker's GPU clock (python/ksearch_mlx/gpuclock.py), with q, k, v given as

  plain     arrays of their own (as a model holds them);
  win256    windows into pools 1/4 longer, at random multiples of 256 bytes (the judge's windows);
  win4k     the same at multiples of 4 KiB;
  win2m     the same at multiples of 2 MiB;

each sample one call after a flush of 256 MiB, median of REPS samples. Where `plain` runs as fast
as the CUDA back-end's events (`ksearch bench attention tasks/attention/cuda/flash_ws.cu --backend
cuda --like flash_ws` in the same call) and the windows do not, the judge's window alignment is
the cause; where `plain` is slow too, the launch through mx.fast.precompiled_cuda_kernel is.

On the GPU machine, MLX staged (bench/mlx_gpu.sh's header):
    PYTHONPATH=python python3 bench/mlx_att_inputs.py [--shape 4,32,8,2048,128,0] [--reps 15]
        [--variants "default;CTAS=1048576"]
"""

import argparse
import os
import random
import statistics
import sys

os.environ["MLX_USE_CUDA_GRAPHS"] = "0"  # before MLX starts: the GPU clock needs launches in order
os.environ.setdefault("KS_ATT_KERNEL", "flash_ws")

import mlx.core as mx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from mlx_attention import Case, candidate, load  # noqa: E402

from ksearch_mlx import gpuclock  # noqa: E402
from ksearch_mlx import runtime as rt  # noqa: E402

ALIGN = {"win256": 256, "win4k": 4096, "win2m": 2 << 20}


def windows(arrs: dict, align: int, rng: random.Random) -> dict:
    """Each array copied into a pool 1/4 longer (at least 4 alignments), viewed at a random
    multiple of `align` bytes, as the judge's windows are."""
    out = {}
    for name, a in arrs.items():
        n = a.size
        extra = max(n // 4, 4 * align // a.itemsize)
        pool = mx.concatenate([a.reshape(-1), mx.zeros((extra,), dtype=a.dtype)])
        mx.eval(pool)
        step = align // a.itemsize
        off = rng.randrange(extra // step) * step
        out[name] = pool[off:off + n].reshape(a.shape)
    mx.eval(list(out.values()))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4,32,8,2048,128,0", help="B,H,Hkv,L,D,causal (D = 128: the kernel's default build)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--variants", default="default",
                    help='";"-separated tunable settings of the kernel, e.g. "default;CTAS=1048576"')
    a = ap.parse_args()
    B, H, Hkv, L, D, causal = (int(x) for x in a.shape.split(","))
    clock, why = gpuclock.GpuClock.create()
    if clock is None:
        print(f"no GPU clock: {why}")
        return 1
    task, k, source = load()
    variants = {}
    for var in a.variants.split(";"):
        defs = {} if var.strip() in ("", "default") else {
            n.strip(): int(x) for n, x in (kv.split("=") for kv in var.split(","))}
        variants[var.strip() or "default"] = rt.CompiledCandidate(candidate(k, source, defs), task, "mlx-cuda")
    case = Case(B, H, Hkv, L, D)
    axes = case.axes(causal)
    flush_src = mx.zeros(((256 << 20) // 4,), mx.float32)
    mx.eval(flush_src)
    rng = random.Random(5)
    plain = {"q": case.q, "k": case.k, "v": case.v}
    kinds = {"plain": lambda: plain, **{n: (lambda al=al: windows(plain, al, rng)) for n, al in ALIGN.items()}}
    fns = {
        **{f"{os.environ['KS_ATT_KERNEL']} {var}": (lambda v, cc=cc: {"o": cc(v, axes)["o"]})
           for var, cc in variants.items()},
        "MLX SDPA": lambda v: {"o": mx.fast.scaled_dot_product_attention(
            v["q"], v["k"], v["v"], scale=case.scale, mask="causal" if causal else None)},
    }
    print(f"mlx {mx.__version__}; shape {a.shape}; {clock.empty_ns / 1e3:.1f} us empty bracket; median of {a.reps}, us")
    for fname, fn in fns.items():
        for kind, make in kinds.items():
            v = make()
            mx.eval(fn(v)["o"])  # compiled and loaded outside any bracket
            ts = []
            for _ in range(a.reps):
                mx.eval(flush_src + 1.0)
                mx.synchronize()
                per_call, _ = clock.time_calls([fn], [v])
                ts.append(per_call * 1e6)
            print(f"{fname:<24} {kind:<8} {statistics.median(ts):9.1f}  (min {min(ts):.1f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
