"""Peers for ksearch's best CUDA kernels, measured in the same call on the GPU machine.

Reads the final reports of ksearch runs (`ksearch best N --json`) and, for the same shapes,
times what a user would otherwise pick: PyTorch SDPA (its default back-end; grouped-query heads
through enable_gqa) for attention, mamba_ssm's selective-scan forward for the Mamba-1 scan (built
from KS_MAMBA_PEER, default .peer/mamba_ssm, when present; else the sequential PyTorch
reference), and computes bandwidth fractions for the decode step. Prints a short table last.

    python3 bench/peers.py report1.json report2.json ...
"""
import json
import math
import os
import sys
import tomllib

import torch

COPY_TBS = None


def events_median(fn, reps=20, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    ts = []
    for _ in range(reps):
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def copy_bandwidth():
    n = 1 << 30
    x = torch.empty(n, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    us = events_median(lambda: y.copy_(x), reps=10)
    return 2 * n / (us * 1e-6) / 1e12


def parse_label(label):
    return {k: int(v) for k, v in (p.split("=") for p in label.split(","))}


def sdpa_us(w):
    B, H, L, D = w["B"], w["H"], w["L"], w["D"]
    Hkv = w.get("Hkv", H)
    q = torch.randn(B, H, L, D, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.float16) for _ in range(2))
    f = lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=bool(w["causal"]),
                                                                 enable_gqa=Hkv != H)
    return events_median(f)


_PEER = None


def mamba_ssm_us(w):
    """mamba_ssm's selective-scan forward on its native layout, or None when its sources are absent."""
    global _PEER
    if _PEER is None:
        d = os.environ.get("KS_MAMBA_PEER", ".peer/mamba_ssm")
        _PEER = False
        if os.path.exists(os.path.join(d, "peer.py")):
            sys.path.insert(0, d)
            import peer
            _PEER = (peer, peer.build())
    if not _PEER:
        return None
    return _PEER[0].time_us(_PEER[1], w["batch"], w["L"], w["D"], w["N"])


def scan_sequential_us(w):
    b, L, D, N = w["batch"], w["L"], w["D"], w["N"]
    u = torch.randn(b, L, D, device="cuda", dtype=torch.float16)
    dt = (torch.rand(b, L, D, device="cuda") * 0.099 + 0.001).half()
    A = -(torch.rand(D, N, device="cuda") * 15 + 1)
    Bm = torch.randn(b, L, N, device="cuda", dtype=torch.float16)
    Cm = torch.randn(b, L, N, device="cuda", dtype=torch.float16)
    Dv = torch.rand(D, device="cuda") + 0.5

    def run():
        h = torch.zeros(b, D, N, device="cuda")
        ys = []
        for t in range(L):
            d = dt[:, t].float()
            h = torch.exp(d[..., None] * A) * h + (d * u[:, t].float())[..., None] * Bm[:, t, None, :].float()
            ys.append((h * Cm[:, t, None, :].float()).sum(-1) + Dv * u[:, t].float())
        return torch.stack(ys, 1).half(), h

    return events_median(run, reps=3, warmup=1)


def tensor_bytes(task, w, backend="cuda"):
    env = dict(w)
    size = {"f32": 4, "f16": 2, "bf16": 2, "f64": 8, "i32": 4}
    over = task["backends"].get(backend, {}).get("dtypes", {})
    total = 0
    for t in task["inputs"] + task["outputs"]:
        n = 1
        for d in t["shape"]:
            n *= int(eval(d, {}, env)) if isinstance(d, str) else int(d)
        total += n * size[over.get(t["name"], t["dtype"])]
    return total


def main(paths):
    global COPY_TBS
    COPY_TBS = copy_bandwidth()
    rows = []
    for p in paths:
        rep = json.load(open(p))
        task = tomllib.load(open(f"tasks/{rep['task']}/task.toml", "rb"))
        for label, seed_us, best_us in zip(rep["workloads"], rep["seed_us"], rep["best_us"]):
            w = parse_label(label)
            floor = tensor_bytes(task, w) / (COPY_TBS * 1e12) * 1e6
            if rep["task"] == "attention":
                peer = sdpa_us(w)
                flops = 4 * w["B"] * w["H"] * w["L"] * w["L"] * w["D"] / (2 if w["causal"] else 1)
                rows.append((rep["task"], label, seed_us, best_us, "torch SDPA", peer, peer / best_us,
                             f"{flops / best_us / 1e6:.0f} TFLOP/s"))
            elif rep["task"] == "mamba_scan":
                peer, name = mamba_ssm_us(w), "mamba_ssm"
                if peer is None:
                    peer, name = scan_sequential_us(w), "torch sequential"
                exp_floor = w["batch"] * w["L"] * w["D"] * w["N"] / 4e12 * 1e6
                rows.append((rep["task"], label, seed_us, best_us, name, peer, peer / best_us,
                             f"floor {max(floor, exp_floor):.1f} us"))
            else:
                bw = tensor_bytes(task, w) / (best_us * 1e-6) / 1e12
                rows.append((rep["task"], label, seed_us, best_us, "copy roofline", floor, floor / best_us,
                             f"{bw:.2f} TB/s = {100 * bw / COPY_TBS:.0f}% of copy"))
    print(f"\ndevice-to-device copy: {COPY_TBS:.2f} TB/s")
    print(f"{'task':<11} {'workload':<36} {'seed us':>10} {'best us':>10} {'peer':<17} {'peer us':>10} {'peer/best':>9}  note")
    for r in rows:
        print(f"{r[0]:<11} {r[1]:<36} {r[2]:>10.1f} {r[3]:>10.1f} {r[4]:<17} {r[5]:>10.1f} {r[6]:>9.2f}  {r[7]}")


if __name__ == "__main__":
    main(sys.argv[1:])
