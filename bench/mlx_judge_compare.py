#!/usr/bin/env python3
"""The MLX worker's timings of honest kernels before and after a change to how it judges:
two copies of the `ksearch_mlx` package, each serving the same requests, interleaved.

    python3 bench/mlx_judge_compare.py OLD_DIR NEW_DIR [ROUNDS]

OLD_DIR and NEW_DIR each hold a `ksearch_mlx` package (for an older commit:
`mkdir -p OLD && git archive COMMIT python/ksearch_mlx | tar -x -C OLD --strip-components=1`).
On a machine where MLX has its CUDA back-end, both workers evaluate the MLX CUDA seed and
knowledge-base kernels (default tunables) of softmax and rmsnorm on their search workloads, and
MLX's native implementation (`baseline`), with the search's default timing, alternating old and
new ROUNDS times (default 2); prints the median per workload (min, spread) and any failure.
"""

import json
import os
import subprocess
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMING = {"warmup": 2, "min_reps": 5, "max_reps": 30, "target_ms": 200.0, "flush": True}
TASKS = ("softmax", "rmsnorm")


def load(name):
    with open(os.path.join(ROOT, "tasks", name, "task.toml"), "rb") as f:
        return tomllib.load(f)


def candidates(task):
    """(kernel name, candidate) for the seed and every knowledge-base kernel, at defaults."""
    b = task["backends"]["mlx-cuda"]
    specs = [("seed", b["seed"])] + [(k["name"], k) for k in b.get("kernels", [])]
    out = []
    for name, spec in specs:
        with open(os.path.join(ROOT, "tasks", task["name"], spec["file"])) as f:
            source = f.read()
        launches = [{"grid": ["1", "1", "1"], "block": ["1", "1", "1"], "shared": "0", **l} for l in spec.get("launches") or [{"entry": spec["entry"]}]]
        defines = {t["name"]: t.get("default", t["values"][0]) for t in spec.get("tunables", [])}
        out.append((name, {"lang": "mlx_cuda", "source": source, "launches": launches, "scratch": spec.get("scratch", []), "defines": defines, "options": {}}))
    return out


class Worker:
    def __init__(self, pkg_dir):
        env = dict(os.environ, PYTHONPATH=pkg_dir, PYTHONUNBUFFERED="1")
        self.p = subprocess.Popen(
            [sys.executable, "-m", "ksearch_mlx.worker", "--backend", "mlx-cuda"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
        )
        self.hello = json.loads(self.p.stdout.readline())

    def ask(self, req):
        self.p.stdin.write(json.dumps(req) + "\n")
        self.p.stdin.flush()
        while True:
            line = self.p.stdout.readline()
            if not line:
                return {"failure": {"class": "crash", "message": "the worker ended"}, "workloads": []}
            m = json.loads(line)
            if m.get("reply") != "progress":
                return m

    def close(self):
        self.p.stdin.write('{"op":"shutdown"}\n')
        self.p.stdin.flush()
        self.p.wait(timeout=60)


def cell(w):
    if w.get("failure"):
        return f"FAILED {w['failure']['class']}"
    t = w.get("timing") or {}
    return f"{t.get('median_us', 0):8.1f} us (min {t.get('min_us', 0):.1f}, spread {100 * t.get('spread', 0):.0f}%)"


def main():
    if len(sys.argv) < 3:
        sys.exit("usage: mlx_judge_compare.py OLD_DIR NEW_DIR [ROUNDS]")
    dirs = {"old": os.path.abspath(sys.argv[1]), "new": os.path.abspath(sys.argv[2])}
    for d in dirs.values():
        if not os.path.isfile(os.path.join(d, "ksearch_mlx", "worker.py")):
            sys.exit(f"mlx_judge_compare: no ksearch_mlx package in {d}")
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    workers = {k: Worker(d) for k, d in dirs.items()}
    print("device:", workers["new"].hello.get("device"))
    rows = {}
    for r in range(rounds):
        for which in ("old", "new"):
            w = workers[which]
            for tname in TASKS:
                task = load(tname)
                wls = [{"label": ",".join(f"{k}={v}" for k, v in a.items()), "axes": a, "seed": 7 + i} for i, a in enumerate(task["backends"]["mlx-cuda"]["search"])]
                base = {"task": task, "backend": "mlx-cuda", "workloads": wls, "timing": TIMING, "check_only": False}
                jobs = [(k, {**base, "op": "eval", "id": 1, "candidate": c}) for k, c in candidates(task)]
                jobs.append(("baseline", {**base, "op": "baseline", "id": 2}))
                for kname, req in jobs:
                    reply = w.ask(req)
                    for res in reply.get("workloads") or [{"label": "-", "failure": reply.get("failure")}]:
                        rows.setdefault((tname, kname, res["label"]), {}).setdefault(which, []).append(cell(res))
    for w in workers.values():
        w.close()
    print(f"{'task':<8} {'kernel':<10} {'workload':<20} " + "  ".join(f"{k} (round 1..{rounds})" for k in ("old", "new")))
    for (t, k, label), cells in rows.items():
        print(f"{t:<8} {k:<10} {label:<20} old: {' | '.join(cells.get('old', []))}")
        print(f"{'':<8} {'':<10} {'':<20} new: {' | '.join(cells.get('new', []))}")


if __name__ == "__main__":
    main()
