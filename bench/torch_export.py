"""A module written by `ksearch export <run> --torch`, on the GPU machine: checked against a float32
reference and the peer on many shapes, timed against the peer and against the run's own
measurements of the same kernel, and run inside torch.compile. Prints a table last; exits 1 when a
result is wrong.

    python3 bench/torch_export.py MODULE.py [--shapes 24] [--seed 1] [--reps 30] [--no-compile]

attention: >= --shapes shapes (ragged L such as 1000 and 777, L = 1, grouped-query 32/8 and
multi-query heads, causal and not, head sizes 64/96/128) through scaled_dot_product_attention,
checked element by element against SDPA on float32 inputs (the task's f16 tolerance, atol = rtol
= 1e-2) and timed against torch's own SDPA (float16, its default back-end); then two calls the
kernel does not take (head size 80, bfloat16) must fall back and still be right. mamba_scan: the
selective_scan drop-in in mamba_ssm's layout (with z, delta_bias and delta_softplus) against a
float32 sequential reference, and mamba_ssm when it can be imported. Timing: CUDA events around
one call after a 256 MiB L2 flush and a GPU sleep that hides the host's dispatch (as a model's
queue does), median of --reps, the way the search times (flush, events around the launches
only); the host's cost per call is a column of its own; the run's figure is the median it recorded for the same build and
shape (its final re-timing or held-out validation).
"""
import argparse
import importlib.util
import math
import sys
import time
import warnings

import torch
import torch.nn.functional as F


def load(path):
    spec = importlib.util.spec_from_file_location("exported", path)
    m = importlib.util.module_from_spec(spec)
    sys.modules["exported"] = m
    spec.loader.exec_module(m)
    return m


_FLUSH = []


def time_us(fn, reps, warmup=3):
    """Median of `reps` CUDA-event timings of fn(), each after an L2 flush, with the host's
    dispatch hidden behind a busy GPU."""
    if not _FLUSH:
        _FLUSH.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        _FLUSH[0].zero_()
        # Keep the GPU busy while the host dispatches the call, as the queue of a running model
        # does: the events then bracket the call's device work, the way the search times its
        # launches, and the host's cost per call is reported on its own (dispatch_us).
        torch.cuda._sleep(200_000)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def dispatch_us(fn, n=200):
    """Host time of one call (the GPU kept idle-free by a queue that is not full)."""
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return host


def close(got, ref, atol=1e-2, rtol=1e-2):
    err = (got.float() - ref.float()).abs()
    bad = err > atol + rtol * ref.float().abs()
    return int(bad.sum()), float(err.max()) if err.numel() else 0.0


# ---- attention ------------------------------------------------------------------------------------

FIXED = [  # B, H, Hkv, L, D, causal: what the issue names, then ragged and edge cases
    (1, 32, 8, 1000, 128, 1), (1, 32, 8, 1000, 64, 0), (3, 32, 32, 777, 64, 0), (3, 32, 8, 777, 128, 1),
    (4, 32, 8, 2048, 128, 0), (2, 16, 16, 3072, 128, 1), (1, 32, 32, 1000, 96, 1), (5, 16, 1, 513, 128, 0),
    (4, 32, 8, 1, 128, 1), (2, 8, 8, 129, 64, 1), (1, 16, 4, 4096, 64, 1), (8, 32, 8, 333, 128, 0),
]


def attention_shapes(n, rng):
    shapes = list(FIXED)
    while len(shapes) < n:
        H, Hkv = rng.choice([(32, 8), (32, 32), (16, 1), (16, 4), (8, 8), (64, 8)])
        s = (rng.choice([1, 2, 3, 4]), H, Hkv, rng.choice([1, 17, 200, 511, 777, 1000, 1531, 2048, 2500]),
             rng.choice([64, 128, 128, 96]), rng.choice([0, 1]))
        if s not in shapes:
            shapes.append(s)
    return shapes


def sdpa_ref(q, k, v, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=bool(causal),
                                              enable_gqa=k.shape[1] != q.shape[1])


def bench_attention(m, args, rng):
    rows, wrong = [], 0
    for B, H, Hkv, L, D, causal in attention_shapes(args.shapes, rng):
        q = torch.randn(B, H, L, D, device="cuda", dtype=torch.float16)
        k, v = (torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.float16) for _ in range(2))
        before = dict(m.STATS)
        ours = lambda: m.scaled_dot_product_attention(q, k, v, is_causal=bool(causal), enable_gqa=Hkv != H)
        peer = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal), enable_gqa=Hkv != H)
        o = ours()
        path = "kernel" if m.STATS["kernel"] > before["kernel"] else "fell back"
        ref = sdpa_ref(q, k, v, causal)
        bad, err = close(o, ref)
        _, perr = close(peer(), ref)
        wrong += bad > 0
        t_ours, t_peer = time_us(ours, args.reps), time_us(peer, args.reps)
        rows.append((f"{B},{H},{Hkv},{L},{D},{causal}", path, bad, err, perr, t_ours, t_peer))
        del q, k, v, ref
    print(f"\n{'B,H,Hkv,L,D,causal':<22} {'path':<9} {'bad':>4} {'max err':>8} {'SDPA err':>8} {'module us':>10} {'SDPA us':>9} {'SDPA/module':>11}")
    for r in rows:
        print(f"{r[0]:<22} {r[1]:<9} {r[2]:>4} {r[3]:>8.1e} {r[4]:>8.1e} {r[5]:>10.1f} {r[6]:>9.1f} {r[6] / r[5]:>11.2f}")
    kern = [r for r in rows if r[1] == "kernel"]
    if kern:
        g = math.exp(sum(math.log(r[6] / r[5]) for r in kern) / len(kern))
        print(f"{len(rows)} shapes, {len(kern)} through the kernel, {wrong} wrong; SDPA / module geometric mean {g:.2f}")
    # Calls the kernel does not take: they must fall back, and be right.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for D, dt in ((80, torch.float16), (64, torch.bfloat16)):
            q = torch.randn(2, 8, 100, D, device="cuda", dtype=dt)
            n0 = m.STATS["fallback"]
            bad, err = close(m.scaled_dot_product_attention(q, q, q, is_causal=True), sdpa_ref(q, q, q, 1), 2e-2, 2e-2)
            fell = m.STATS["fallback"] > n0
            wrong += bad > 0 or not fell
            print(f"fall-back D={D} {str(dt)[6:]}: {'fell back' if fell else 'DID NOT FALL BACK'}, {bad} bad, max err {err:.1e}")
    print(f"warnings: {len(caught)} ({str(caught[0].message)[:160] if caught else ''})")
    return wrong


def attention_call(m, axes):
    B, H, Hkv, L, D, c = (axes[a] for a in ("B", "H", "Hkv", "L", "D", "causal"))
    q = torch.randn(B, H, L, D, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.float16) for _ in range(2))
    return lambda: m.scaled_dot_product_attention(q, k, v, is_causal=bool(c), enable_gqa=Hkv != H)


def compile_attention(m):
    q = torch.randn(2, 32, 1000, 128, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(2, 8, 1000, 128, device="cuda", dtype=torch.float16) for _ in range(2))

    def block(q, k, v):
        return m.scaled_dot_product_attention(q * 1.0, k, v, is_causal=True, enable_gqa=True).sum(dim=1)

    t = time.time()
    f = torch.compile(block, fullgraph=True)
    n0 = m.STATS["kernel"]
    got = f(q, k, v)
    secs = time.time() - t
    bad, err = close(got, block(q, k, v).float(), 2e-2, 2e-2)
    used = m.STATS["kernel"] > n0
    print(f"torch.compile(fullgraph=True): compiled and ran in {secs:.1f} s, kernel used: {used}, {bad} bad vs eager (max err {err:.1e})")
    return 0 if used and bad == 0 else 1


# ---- mamba_scan -----------------------------------------------------------------------------------

def scan_ref(u, delta, A, B, C, D, z=None, delta_bias=None, delta_softplus=False):
    """mamba_ssm's selective_scan_ref semantics in float32, its layout: u, delta (b, d, L)."""
    d = delta.float()
    if delta_bias is not None:
        d = d + delta_bias[..., None].float()
    if delta_softplus:
        d = F.softplus(d)
    b, dim, L = u.shape
    h = torch.zeros(b, dim, A.shape[1], device=u.device)
    ys = []
    dA = torch.exp(d[..., None] * A[None, :, None, :])  # b d L n
    dBu = d[..., None] * B.float().transpose(1, 2)[:, None] * u.float()[..., None]
    Cf = C.float()
    for t in range(L):
        h = dA[:, :, t] * h + dBu[:, :, t]
        ys.append((h * Cf[:, None, :, t]).sum(-1))
    y = torch.stack(ys, -1) + D[None, :, None] * u.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y, h


def bench_scan(m, args, rng):
    shapes = [(1, 4096, 2048, 16), (4, 1024, 2048, 16), (4, 1000, 2048, 16), (3, 777, 1536, 16),
              (1, 2000, 3072, 16), (2, 1, 2048, 16), (2, 513, 768, 16), (1, 300, 1024, 8)]
    rows, wrong = [], 0
    peer = m.mamba_ssm_scan()
    for b, L, D, N in shapes:
        u = torch.randn(b, D, L, device="cuda", dtype=torch.float16)
        dt = torch.randn(b, D, L, device="cuda", dtype=torch.float16) * 0.5 - 2
        A = -(torch.rand(D, N, device="cuda") * 15 + 1)
        Bm, Cm = (torch.randn(b, N, L, device="cuda", dtype=torch.float16) for _ in range(2))
        Dv = torch.rand(D, device="cuda") + 0.5
        z = torch.randn(b, D, L, device="cuda", dtype=torch.float16)
        bias = torch.rand(D, device="cuda") - 0.5
        n0 = m.STATS["kernel"]
        call = lambda: m.selective_scan(u, dt, A, Bm, Cm, Dv, z=z, delta_bias=bias, delta_softplus=True, return_last_state=True)
        out, last = call()
        path = "kernel" if m.STATS["kernel"] > n0 else "fell back"
        y, h = scan_ref(u, dt, A, Bm, Cm, Dv, z, bias, True)
        bad, err = close(out, y)
        sbad, serr = close(last, h, 1e-3, 1e-2)
        wrong += (bad + sbad) > 0
        t_ours = time_us(call, args.reps)
        plain = lambda: m.selective_scan(u, torch.nn.functional.softplus(dt.float()).half(), A, Bm, Cm, Dv)
        t_plain = time_us(plain, args.reps)
        t_peer = time_us(lambda: peer(u, dt, A, Bm, Cm, Dv, z=z, delta_bias=bias, delta_softplus=True), args.reps) if peer else float("nan")
        rows.append((f"{b},{L},{D},{N}", path, bad + sbad, max(err, serr), t_ours, t_plain, t_peer))
    print(f"\n{'batch,L,D,N':<18} {'path':<9} {'bad':>4} {'max err':>8} {'module us':>10} {'no z/bias us':>12} {'mamba_ssm us':>12}")
    for r in rows:
        print(f"{r[0]:<18} {r[1]:<9} {r[2]:>4} {r[3]:>8.1e} {r[4]:>10.1f} {r[5]:>12.1f} {r[6]:>12.1f}")
    print(f"{len(rows)} shapes, {wrong} wrong; mamba_ssm {'measured' if peer else 'not importable here'}")
    return wrong


def scan_call(m, axes):
    b, L, D, N = (axes[a] for a in ("batch", "L", "D", "N"))
    u = torch.randn(b, L, D, device="cuda", dtype=torch.float16)
    dt = (torch.rand(b, L, D, device="cuda") * 0.099 + 0.001).half()
    A = -(torch.rand(D, N, device="cuda") * 15 + 1)
    Bm, Cm = (torch.randn(b, L, N, device="cuda", dtype=torch.float16) for _ in range(2))
    Dv = torch.rand(D, device="cuda") + 0.5
    return lambda: m.mamba_scan(u, dt, A, Bm, Cm, Dv)  # the task's own layout, as the run timed it


# ---- against the run ------------------------------------------------------------------------------

def against_run(m, args, make_call):
    """The module on every shape the run measured, with the same build: module / run time."""
    rows = []
    for cls, e in m.SPEC["dispatch"].items():
        for w in e["measured"]:
            call = make_call(m, w["axes"])
            n0 = m.STATS["kernel"]
            call()
            if m.STATS["kernel"] == n0:
                rows.append((cls, w["label"], w["median_us"], float("nan"), float("nan"), "fell back"))
                continue
            t = time_us(call, args.reps)
            host = dispatch_us(call, 50)
            rows.append((cls, w["label"], w["median_us"], t, host, w["purpose"]))
    print(f"\n{'build':<8} {'workload':<40} {'run us':>9} {'module us':>10} {'module/run':>10} {'host us/call':>12}  run's figure from")
    worst = 0.0
    for r in rows:
        ratio = r[3] / r[2]
        worst = max(worst, abs(ratio - 1)) if ratio == ratio else worst
        print(f"{r[0]:<8} {r[1]:<40} {r[2]:>9.1f} {r[3]:>10.1f} {ratio:>10.3f} {r[4]:>12.1f}  {r[5]}")
    if rows:
        print(f"largest difference from the run's time: {100 * worst:.1f}% (target: within 5%)")
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("module")
    ap.add_argument("--shapes", type=int, default=24)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()
    import random

    rng = random.Random(args.seed)
    torch.manual_seed(args.seed)
    m = load(args.module)
    S = m.SPEC
    print(f"{args.module}: run {S['run']}, node {S['node']}, kernel {S['kernel']} {S['defines']}, builds {list(S['dispatch'])}")
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"cupy {__import__('cupy').__version__}, NVRTC {m.nvrtc_library()._name}")
    t = time.time()
    cc = torch.cuda.get_device_capability()
    print(f"NVRTC builds for {m.arch_for(cc)}: {m.compile_all(cc)} in {time.time() - t:.1f} s")
    task = S["task"]["name"]
    steps = {
        "attention": [lambda: bench_attention(m, args, rng), lambda: against_run(m, args, attention_call) and 0,
                      (lambda: 0) if args.no_compile else (lambda: compile_attention(m))],
        "mamba_scan": [lambda: bench_scan(m, args, rng), lambda: against_run(m, args, scan_call) and 0],
    }.get(task, [])
    if not steps:
        print(f"no checks for task {task} here")
    wrong = 0
    for step in steps:  # one failing step does not hide the others' figures
        try:
            wrong += step() or 0
        except Exception:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            wrong += 1
    print(f"STATS: kernel {m.STATS['kernel']}, fall-backs {m.STATS['fallback']}")
    sys.exit(1 if wrong else 0)


if __name__ == "__main__":
    main()
