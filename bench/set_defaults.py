#!/usr/bin/env python3
"""Make a kernel's measured best configuration its tunable defaults in the task file.

    python3 bench/set_defaults.py LOG TASK KERNEL [--dry-run]

LOG is the output of `bench/cuda_dev.py run TASK` (every line `TASK s WORKLOAD KERNEL T us
bad=N ... {config}`). The configuration chosen is the one correct (bad=0) on every search
workload of the log with the smallest geometric-mean time over them; the defaults of
KERNEL's tunables in tasks/TASK/task.toml are rewritten to it (nothing else in the file
changes). Prints what it changed, or why it changed nothing; exit 0 either way, 2 on bad
arguments. The offline planner starts from a kernel's defaults when it adopts it, so this is
how a sweep's result reaches the search.
"""
import ast
import math
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
LINE = re.compile(r"^(\S+)\s+s\s+(\{.*?\})\s+(\S+)\s+([0-9.]+|nan)\s+us bad=(-?\d+).*?(\{[^{}]*\})\s*$")


def best_config(log_text, task, kernel):
    times = {}  # config -> {workload: us}
    bad = set()
    workloads = set()
    for line in log_text.splitlines():
        m = LINE.match(line.strip())
        if not m or m.group(1) != task or m.group(3) != kernel:
            continue
        wl, us, nbad, cfg = m.group(2), m.group(4), int(m.group(5)), m.group(6)
        workloads.add(wl)
        key = tuple(sorted(ast.literal_eval(cfg).items()))
        if nbad != 0 or us == "nan":
            bad.add(key)
            continue
        times.setdefault(key, {})[wl] = float(us)
    full = {k: v for k, v in times.items() if k not in bad and len(v) == len(workloads)}
    if not full:
        return None, 0
    score = {k: math.exp(sum(math.log(t) for t in v.values()) / len(v)) for k, v in full.items()}
    k = min(score, key=score.get)
    return dict(k), score[k]


def rewrite(toml_text, kernel, cfg):
    """New text with the defaults of KERNEL's tunables set from cfg; (text, changes)."""
    lines = toml_text.splitlines(keepends=True)
    out, changes = [], []
    in_kernel = False
    tunable = None
    for ln in lines:
        s = ln.strip()
        if s == "[[backends.cuda.kernels]]":
            in_kernel, tunable = None, None  # its name comes next
        elif s.startswith("[") and s not in ("[[backends.cuda.kernels.tunables]]", "[[backends.cuda.kernels.launches]]"):
            in_kernel, tunable = False, None  # another table: out of any kernel
        elif in_kernel is None and s.startswith("name"):
            in_kernel = s.split("=", 1)[1].strip().strip('"') == kernel
        if in_kernel and s == "[[backends.cuda.kernels.tunables]]":
            tunable = ""
        elif in_kernel and tunable == "" and s.startswith("name"):
            tunable = s.split("=", 1)[1].strip().strip('"')
        elif in_kernel and tunable and s.startswith("default") and tunable in cfg:
            old = s.split("=", 1)[1].strip()
            new = str(cfg[tunable])
            if old != new:
                changes.append(f"{tunable}: {old} -> {new}")
                ln = ln[: ln.index("=") + 1] + f" {new}\n"
            tunable = None
        out.append(ln)
    return "".join(out), changes


def main(argv):
    args = [a for a in argv if not a.startswith("--")]
    if len(args) != 3:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    log, task, kernel = args
    path = ROOT / "tasks" / task / "task.toml"
    try:
        text = pathlib.Path(log).read_text(errors="replace")
        toml = path.read_text()
    except OSError as e:
        print(f"set_defaults: {e}", file=sys.stderr)
        return 2
    cfg, us = best_config(text, task, kernel)
    if cfg is None:
        print(f"set_defaults: no configuration of {task}/{kernel} was correct on every search workload in {log}: defaults kept")
        return 0
    new, changes = rewrite(toml, kernel, cfg)
    if not changes:
        print(f"set_defaults: {task}/{kernel}: the defaults are already the best ({cfg}, {us:.1f} us geo-mean)")
        return 0
    if "--dry-run" not in argv:
        path.write_text(new)
    print(f"set_defaults: {task}/{kernel}: best {cfg} ({us:.1f} us geo-mean): " + ", ".join(changes))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
