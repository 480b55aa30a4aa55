#!/usr/bin/env python3
"""One attention kernel of tasks/attention ([backends.cuda], built as bench/cuda_dev.py builds it)
against cuDNN SDPA on the same inputs, timed two ways with CUDA events (median of --reps):
  one:  a single launch after the L2 is flushed (bench/cuda_dev.py's method);
  b2b:  N launches back to back, no flush (as MLX's "queued" timing and a model's layers run them),
        per-launch share.
If the kernel's b2b share grows against its single launch more than SDPA's does, sustained
back-to-back running (clocks under load, the L2 holding the next call's inputs) treats the two
differently. Correctness is bench/cuda_dev.py's business; this only times.
With --sustain S each runs back to back for S seconds while nvidia-smi samples the SM clock and the
board's power: a kernel held below its clock by the power cap shows as a lower clock at the same work.

    python3 bench/attention_b2b.py KERNEL[:NAME=V,...] ... [--shape B,H,Hkv,L,D,causal ...] [--n 16]
"""
import argparse
import os
import statistics
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cuda_dev as cd  # noqa: E402


def events(fn, n, reps, flush):
    torch = cd.torch
    ts = []
    for _ in range(reps):
        if flush:
            cd.FLUSH.fill_(1.0)
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / n)
    return statistics.median(ts)


def sustained(fn, seconds):
    """fn back to back for `seconds` (batches of 16 launches); the median SM clock (MHz) and power (W)
    nvidia-smi reported over the second half, and the launches' mean time (us)."""
    torch = cd.torch
    samples, stop = [], threading.Event()

    def poll():
        while not stop.is_set():
            r = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits"],
                               capture_output=True, text=True)
            try:
                c, w = (float(x) for x in r.stdout.strip().split(","))
                samples.append((time.monotonic(), c, w))
            except ValueError:
                pass
            time.sleep(0.05)

    th = threading.Thread(target=poll, daemon=True)
    t0 = time.monotonic()
    th.start()
    n = 0
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record()  # re-recorded at the half mark; a run shorter than one batch times every launch
    half = False
    while time.monotonic() - t0 < seconds:
        if not half and time.monotonic() - t0 > seconds / 2:
            torch.cuda.synchronize()
            a.record()
            half, n = True, 0
        for _ in range(16):
            fn()
        n += 16
        torch.cuda.synchronize()
    b.record()
    b.synchronize()
    stop.set()
    th.join()
    late = [x for x in samples if x[0] > t0 + seconds / 2]
    if not late:
        return float("nan"), float("nan"), a.elapsed_time(b) * 1e3 / max(n, 1)
    return (statistics.median(x[1] for x in late), statistics.median(x[2] for x in late),
            a.elapsed_time(b) * 1e3 / max(n, 1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("kernels", nargs="+", help="kernel names of [backends.cuda], each optionally :NAME=V,...")
    ap.add_argument("--shape", action="append", default=None, help="B,H,Hkv,L,D,causal (repeatable)")
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--sustain", type=float, default=0.0, help="seconds of back-to-back running per kernel, sampled")
    a = ap.parse_args()
    cd._gpu_imports()
    torch = cd.torch
    from torch.nn.attention import sdpa_kernel, SDPBackend

    cd.FLUSH = torch.empty(256 * 1024 * 1024 // 4, device="cuda", dtype=torch.float32)
    task = cd.load_task("attention")
    shapes = a.shape or ["4,32,32,2048,128,0", "4,32,32,2048,128,1"]
    print(f"{'shape':<26} {'kernel':<34} {'one us':>9} {'b2b us':>9} {'b2b/one':>8}")
    for sh in shapes:
        wl = dict(zip(["B", "H", "Hkv", "L", "D", "causal"], [int(x) for x in sh.split(",")]))
        ins, _ = cd.make_inputs(task, wl, 1234, "cuda")
        q, k, v = ins
        gqa = wl["H"] != wl["Hkv"]
        f = torch.nn.functional.scaled_dot_product_attention

        def sdpa():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                f(q, k, v, is_causal=bool(wl["causal"]), enable_gqa=gqa)

        rows = [("cuDNN SDPA", sdpa)]
        for spec in a.kernels:
            name, _, defs = spec.partition(":")
            kern = next(x for x in task["backends"]["cuda"]["kernels"] if x["name"] == name)
            want = {d.split("=")[0]: int(d.split("=")[1]) for d in defs.split(",") if d}
            near = [c for _, c in cd.near_default(kern, wl) if all(c.get(x) == y for x, y in want.items())]
            if not near:
                print(f"{sh:<26} {spec:<34} no admitted configuration")
                continue
            rows.append((spec, cd.Runner("attention", task, "cuda", kern, near[0], wl, ins)))
        for label, fn in rows:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            one = events(fn, 1, a.reps, True)
            b2b = events(fn, a.n, a.reps, False)
            print(f"{sh:<26} {label:<34} {one:9.1f} {b2b:9.1f} {b2b / one:8.3f}", flush=True)
            if a.sustain > 0:
                clk, watts, us = sustained(fn, a.sustain)
                print(f"{sh:<26} {label:<34} sustained {a.sustain:.0f} s: {us:9.1f} us a launch, SM clock {clk:.0f} MHz, "
                      f"{watts:.0f} W (medians of the second half)", flush=True)
        del ins
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
