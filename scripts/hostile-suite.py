#!/usr/bin/env python3
"""The adversarial suite for any back-end, from the same table as the CPU suite in CI
(crates/cli/tests/fixtures/hostile/expect.toml): every hostile kernel through `ksearch bench`,
then all of them through one `ksearch run`, each compared with the outcomes it may have.
Prints a table and exits 1 if any kernel ends otherwise. Used on the GPU machine for CUDA and
for MLX's CUDA back-end (the Python worker: MLX with mlx-cuda installed for `$KSEARCH_PYTHON`,
default python3; the `python/` folder beside the binary's ancestors is found by ksearch):

    python3 scripts/hostile-suite.py --backend cuda --ksearch .gpu/ksearch
    python3 scripts/hostile-suite.py --backend mlx-cuda --ksearch .gpu/ksearch
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "crates/cli/tests/fixtures")
EXT = {"cpu": "cpp", "cuda": "cu", "mlx-cuda": "cu"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="cuda", choices=sorted(EXT))
    ap.add_argument("--ksearch", default=os.path.join(ROOT, "target/release/ksearch"))
    a = ap.parse_args()
    a.ksearch = os.path.abspath(a.ksearch)
    if not os.access(a.ksearch, os.X_OK):
        sys.exit(f"hostile-suite: no ksearch binary at {a.ksearch} (build one: cargo build --release)")
    with open(os.path.join(FIX, "hostile/expect.toml"), "rb") as f:
        expect = tomllib.load(f)[a.backend]
    d = tempfile.mkdtemp()
    base = [a.ksearch, "--tasks-dir", FIX, "--store", os.path.join(d, "s.db")]
    with open(os.path.join(d, "ksearch.toml"), "w") as f:
        f.write('[eval]\nrun_timeout = "20s"\nmax_reps = 10\n')
    env = dict(os.environ, OPENAI_API_KEY="sk-canary-7f3a9c2e51d84b6a")
    bad = 0
    rows = []
    for k, allowed in expect.items():
        src = os.path.join(FIX, "hostile", a.backend, f"{k}.{EXT[a.backend]}")
        cmd = base + ["bench", "hostile", src, "--backend", a.backend]
        if k != "good":
            cmd += ["--like", k]
        p = subprocess.run(cmd, cwd=d, env=env, capture_output=True, text=True)
        out = p.stdout + p.stderr
        m = re.search(r"kernel FAILED \(([a-z_]+)\)", out)
        got = m.group(1) if m else ("ok" if p.returncode == 0 else f"exit {p.returncode}")
        ok = got in allowed and "sk-canary" not in out
        bad += not ok
        rows.append(("bench", k, got, allowed, ok, out.strip().splitlines()[-1][:160] if out.strip() else ""))
    p = subprocess.run(base + ["run", "hostile", "--backend", a.backend, "--rounds", str(len(expect) + 2),
                              "--patience", "100"], cwd=d, env=env, capture_output=True, text=True)
    out = p.stdout + p.stderr
    tree = subprocess.run(base + ["tree", "1"], cwd=d, capture_output=True, text=True).stdout
    for k, allowed in expect.items():
        if k == "good":
            continue
        line = next((l for l in tree.splitlines() if f"adopt {k} " in l), "")
        m = re.search(r"FAILED ([a-z_]+) ", line)
        got = m.group(1) if m else ("ok" if line else "missing")
        ok = got in allowed
        bad += not ok
        rows.append(("run", k, got, allowed, ok, line.strip()[:160]))
    if "sk-canary" in out:
        bad += 1
        rows.append(("run", "secret", "leaked", ["absent"], False, ""))
    print(f"run exit {p.returncode}; " + next((l for l in out.splitlines() if l.startswith("isolation")), ""))
    for how, k, got, allowed, ok, detail in rows:
        print(f"{'ok  ' if ok else 'FAIL'} {how:<5} {k:<16} {got:<14} allowed {','.join(allowed):<28} {detail}")
    print(f"{len(rows) - bad} passed, {bad} failed")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
