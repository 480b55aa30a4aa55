#!/usr/bin/env python3
"""Decode of the mlx-lm Llama model of bench/mlx_llama.py, stock against several builds of
`patch_mlx_lm_llama`, all in one process and interleaved, so that the host's drift (decode on MLX's
CUDA back-end is bound by the host work that builds and launches each step) falls on every build.

    PYTHONPATH=python python3 bench/mlx_llama_decode.py            # on the GPU machine
    PYTHONPATH=python python3 bench/mlx_llama_decode.py --tiny     # a CPU check of the script

Builds (each its own patch, toggled on the classes as bench/mlx_llama.py does):
  stock       mlx-lm as it is
  block       the patch with fuse_decode=False: a decode step runs stock's block
  fused       the patch's default: fuse_decode, one-row products as a matmul and an add (gemv)
  addmm       fuse_decode with its products through mx.addmm at one row too (LLAMA_ADDMM_MIN_ROWS 1)
  uncompiled  fuse_decode with compile=False
  replan      fuse_decode checking each block at every step (LLAMA_DECODE_PLAN False)
For each build, every decode step's logits against stock's (stock's tokens fed to both). Then
--rounds rounds; in each, each method (a synchronous loop: model, argmax, eval per token; and
mlx-lm's generate_step, greedy) runs every build for --decode tokens after a --prompt token prompt,
the builds' order rotated from round to round. Reported: each build's median tokens/s, and the
median over rounds of its rate divided by stock's in the same round, and where the synchronous
loop's token goes: building the step's graph in Python, then evaluating it (MLX's encoding and
launches, and the wait for the GPU). Writes $OUT/mlx_llama_decode.json.
"""
import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import mlx_llama as ml  # noqa: E402  (puts python/ on the path, imports MLX and mlx-lm)
from mlx_llama import mx, export_llama  # noqa: E402

BUILDS = {
    "block": dict(fuse_decode=False),
    "fused": dict(),
    "addmm": dict(addmm_min_rows=1),
    "uncompiled": dict(compile=False),
    "replan": dict(decode_plan=False),
}


def make_toggle(attention, admits, min_len, addmm_min_rows=None, decode_plan=None, **kw):
    keep = export_llama.LLAMA_ADDMM_MIN_ROWS, export_llama.LLAMA_DECODE_PLAN
    if addmm_min_rows is not None:  # module constants, read when the patch is made
        export_llama.LLAMA_ADDMM_MIN_ROWS = addmm_min_rows
    if decode_plan is not None:
        export_llama.LLAMA_DECODE_PLAN = decode_plan
    try:
        unpatch = export_llama.patch_mlx_lm_llama(attention, min_len=min_len, admits=admits, dtypes=(mx.float16,),
                                                  choose="always", **kw)
    finally:
        export_llama.LLAMA_ADDMM_MIN_ROWS, export_llama.LLAMA_DECODE_PLAN = keep
    return ml.Toggle(unpatch)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="a small config and few tokens (a CPU check)")
    ap.add_argument("--standin", action="store_true", help="attention in MLX ops (the default on MLX's CPU back-end)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--decode", type=int, default=None, help="tokens per run (128; tiny 4)")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens before decode (1024; tiny 64)")
    ap.add_argument("--builds", default=",".join(BUILDS), help="comma-separated, from " + ",".join(BUILDS))
    a = ap.parse_args()

    cfg = ml.TINY if a.tiny else ml.FULL
    n = a.decode or (4 if a.tiny else 128)
    prompt_len = a.prompt or (64 if a.tiny else 1024)
    min_len = 64 if a.tiny else export_llama.LLAMA_MIN_LEN
    cpu = mx.default_device() == mx.cpu
    attention, admits = ml.standin_attention() if (a.standin or cpu) else ml.kernel_attention()
    names = [b for b in a.builds.split(",") if b]
    unknown = [b for b in names if b not in BUILDS]
    if unknown:
        sys.exit(f"mlx_llama_decode: unknown build(s) {unknown}; known: {', '.join(BUILDS)}")
    toggles = {b: make_toggle(attention, admits, min_len, **BUILDS[b]) for b in names}
    model, _ = ml.make_model(cfg, mx.float16)
    prompt = mx.random.randint(0, cfg["vocab_size"], (prompt_len,), key=mx.random.key(7))
    res = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "mlx": mx.__version__,
           "device": str(mx.default_device()), "config": cfg, "prompt": prompt_len, "tokens": n, "rounds": a.rounds,
           "logits": {}, "rates": {}}
    ml.log(f"mlx {mx.__version__} on {mx.default_device()}; builds {names}; {a.rounds} rounds of {n} tokens")

    for b, tg in toggles.items():
        res["logits"][b] = ml.decode_logits(model, tg, prompt, min(n, 32))
    modes = ["stock"] + names

    def set_mode(mode):
        for tg in toggles.values():
            tg.off()
        if mode != "stock":
            toggles[mode].on()

    phases = {m: [] for m in modes}  # the sync loop's (build, eval) seconds a token, per round
    for method, fn in (("sync loop", ml.decode_sync), ("generate_step", ml.decode_generate)):
        rates = {m: [] for m in modes}
        for m in modes:  # warm-up: every build's traces and kernels made
            set_mode(m)
            fn(model, prompt, 2)
        for r in range(a.rounds):
            order = modes[r % len(modes):] + modes[: r % len(modes)]
            for m in order:
                set_mode(m)
                if fn is ml.decode_sync:
                    rates[m].append(fn(model, prompt, n, phases=phases[m]))
                else:
                    rates[m].append(fn(model, prompt, n))
        set_mode("stock")
        res["rates"][method] = rates
        ml.log(f"decode {method}: {json.dumps(rates)}")
    res["sync_phases"] = phases

    decode_counts = {b: dict(getattr(tg.unpatch, "decode", {})) for b, tg in toggles.items()}
    res["decode_paths"] = decode_counts
    with open(os.path.join(ml.OUT, "mlx_llama_decode.json"), "w") as f:
        json.dump(res, f, indent=1)

    lines = [f"== mlx-lm Llama decode ({cfg['num_hidden_layers']} layers, hidden {cfg['hidden_size']}, f16), "
             f"prompt {prompt_len}, {n} tokens a run, {a.rounds} rounds, {res['date']}, mlx {mx.__version__}, {res['device']} ==",
             f"{'method':<14} {'build':<11} {'tok/s (median)':>15} {'vs stock (median of rounds)':>28}  logits vs stock"]
    for method, rates in res["rates"].items():
        for m in modes:
            med = statistics.median(rates[m])
            rel = statistics.median(x / s for x, s in zip(rates[m], rates["stock"]))
            g = res["logits"].get(m)
            lg = "" if g is None else (f"worst step max rel {g['max_rel']:.2e}, bad {g['bad']}/{g['elements']}, "
                                       f"top-1 {100 * g['top1_agree']:.1f}%")
            lines.append(f"{method:<14} {m:<11} {med:>15.1f} {rel:>28.3f}  {lg}")
    lines.append("sync loop, where a token's time goes (medians over rounds of each run's median token): "
                 + "; ".join(f"{m} build {1e6 * statistics.median(b for b, _ in phases[m]):.0f} us + eval "
                             f"{1e6 * statistics.median(e for _, e in phases[m]):.0f} us" for m in modes if phases[m]))
    lines.append(f"fused decode blocks per build: {decode_counts}")
    print("\n" + "\n".join(lines), flush=True)
    bad = [b for b, g in res["logits"].items() if g["bad"]]
    if bad:
        print(f"logits beyond f16 tolerance: {bad}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
