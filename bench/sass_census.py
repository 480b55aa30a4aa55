#!/usr/bin/env python3
"""Static census of a CUDA kernel's machine code, without a GPU: what ptxas made of one configuration.

For each configuration it builds the cubin the CUDA back-end would (NVRTC, bench/cuda_dev.py's options),
disassembles it (cuobjdump and nvdisasm from PyPI: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm)
and prints
  - registers and local memory (spills) per thread;
  - the largest straight-line block (for the scan and attention kernels, the unrolled body of the hot
    loop): its instruction count, per unit of work where --per says how many units one pass of it does
    (e.g. state-steps per lane), and its instruction mix;
  - its shared-pipe cycles per warp: shuffles and shared loads / stores, each costing one cycle per
    32-bit register it delivers to the warp (the SM's shared memory returns 128 bytes a cycle);
  - a one-warp schedule: the block issued in order by a single warp, each instruction waiting for its
    predecessor's stall count and for the scoreboards its control word waits on, a variable-latency
    result ready a fixed time after issue (LDS 30, SHFL 24, MUFU 18 cycles: estimates) and MUFU taking
    8 cycles per warp instruction (16 lanes a cycle per SM). The control word's layout (stall 4 bits,
    yield, write and read scoreboard 3 bits each, wait mask 6 bits) is the one published for Volta and
    later (Jia et al., "Dissecting the NVIDIA Volta GPU Architecture via Microbenchmarking", 2018).

It ranks configurations; it does not time them. What the H200 measured against it is in bench/README.md
(section "warp_scan's first pass with Cm folded in"): fewer instructions do not make a kernel faster
when they lengthen a warp's schedule or load the shared pipe (warp_scan BF=1: 12% fewer instructions,
9% slower).

  python3 bench/sass_census.py mamba_scan warp_scan "K=8" "K=16,RT=1,CQ=1" --per 128
(--per with K in it is evaluated per configuration: --per "K*16".)
"""
import argparse
import collections
import glob
import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import cuda_dev as cd  # noqa: E402

LAT = {"LDS": 30, "LDSM": 30, "SHFL": 24, "MUFU": 18, "LDG": 500, "LDGSTS": 30, "STS": 20, "S2R": 20,
       "I2F": 14, "F2F": 14, "F2I": 14, "LDC": 20, "BAR": 20, "POPC": 14, "FLO": 14, "BREV": 14,
       "REDUX": 30, "MATCH": 30, "S2UR": 20, "ATOMS": 40, "LDL": 400, "STL": 20, "STG": 20, "HMMA": 30}
READ_LAT = 6  # a read scoreboard: released once the sources are read


def tool(name):
    """cuobjdump / nvdisasm: on PATH, or from pip's nvidia/cu13/bin."""
    found = shutil.which(name)
    if found:
        return found
    dirs = []
    try:
        import nvidia

        dirs += [os.path.join(p, "cu13", "bin") for p in nvidia.__path__]
    except ImportError:
        pass
    dirs += glob.glob(os.path.join(sys.prefix, "lib", "python*", "site-packages", "nvidia", "cu13", "bin"))
    for d in dirs:
        c = os.path.join(d, name)
        if os.path.exists(c):
            if not os.access(c, os.X_OK):
                sys.exit(f"{c} is not executable (chmod +x it)")
            return c
    sys.exit(f"{name} not found: pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm")


def cubin(task_name, kname, fix):
    task = cd.load_task(task_name)
    kern = next((k for k in task["backends"]["cuda"]["kernels"] if k["name"] == kname), None)
    if kern is None:
        sys.exit(f"no CUDA kernel {kname!r} in task {task_name!r}")
    cfg = cd.defaults(kern)
    for kv in filter(None, fix.split(",")):
        k, v = kv.split("=")
        if k not in cfg:
            sys.exit(f"{kname} has no tunable {k!r}")
        cfg[k] = int(v)
    with open(os.path.join(cd.ROOT, "tasks", task_name, kern["file"])) as f:
        src = f.read()
    path, _ = cd.cubin_for(src, cd.opts_for(task, cfg, src))
    return path, cfg


def parse(sass):
    """Instructions with their control words: stall, write / read scoreboard, wait mask."""
    out, lines = [], sass.split("\n")
    for i, line in enumerate(lines):
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s*(.*?);\s*/\* (0x[0-9a-f]{16}) \*/", line)
        if not m or i + 1 >= len(lines):
            continue
        m2 = re.match(r"\s*/\* (0x[0-9a-f]{16}) \*/", lines[i + 1])
        if not m2:
            continue
        hi = int(m2.group(1), 16)
        out.append({"addr": int(m.group(1), 16), "text": m.group(2).strip(), "stall": (hi >> 41) & 15,
                    "wb": (hi >> 46) & 7, "rb": (hi >> 49) & 7, "wait": (hi >> 52) & 63})
    return out


def opname(text):
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def blocks(ins):
    targets = {int(m.group(1), 16) for x in ins for m in [re.search(r"BRA (?:U?P\d, )?0x([0-9a-f]+)", x["text"])] if m}
    out, cur = [], []
    for x in ins:
        if x["addr"] in targets and cur:
            out.append(cur)
            cur = []
        cur.append(x)
        if re.search(r"\b(BRA|EXIT|RET|BAR|WARPSYNC)\b", x["text"]):
            out.append(cur)
            cur = []
    if cur:
        out.append(cur)
    return out


def words(op):
    """32-bit registers a shared-memory access or shuffle delivers per lane."""
    for w, n in ((".128", 4), (".64", 2)):
        if w in op:
            return n
    return 1


def schedule(block):
    t, bar, mufu_free = 0, [0] * 6, 0
    for x in block:
        base = opname(x["text"]).split(".")[0]
        ready = max([bar[b] for b in range(6) if x["wait"] >> b & 1] + [t])
        if base == "MUFU":
            ready = max(ready, mufu_free)
            mufu_free = ready + 8
        t = ready
        if x["wb"] != 7:
            bar[x["wb"]] = t + LAT.get(base, 20)
        if x["rb"] != 7:
            bar[x["rb"]] = max(bar[x["rb"]], t + READ_LAT)
        t += max(x["stall"], 1)
    return t


def pv_waits(ins):
    """Where a wgmma kernel that overlaps its softmax with a product in flight waits for that product:
    after each `WARPGROUP.DEPBAR.LE gsb0, 0x1` (the newest group, S, has landed; one older group, the PV
    product, may still run), the MUFU.EX2 issued before a `DEPBAR.LE gsb0, 0x0` (the wait for everything)
    and after it, up to the next branch or HGMMA; a loop body compiled twice (masked and plain tiles)
    gives one pair per copy. (before, after) per wait, in program order: a softmax that overlaps the
    product has its exponentials before the wait."""
    out, state = [], None
    for x in ins:
        t = x["text"]
        if "WARPGROUP.DEPBAR.LE gsb0, 0x1" in t:
            state = [0, 0, False]
        elif state is None:
            continue
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in t and not state[2]:
            state[2] = True
        elif "MUFU.EX2" in t:
            state[1 if state[2] else 0] += 1
        elif "HGMMA" in opname(t) or (state[2] and opname(t) == "BRA"):
            if state[2]:
                out.append((state[0], state[1]))
            state = None if "HGMMA" in opname(t) else [0, 0, False]
    return out


def census(task_name, kname, fix, per):
    path, cfg = cubin(task_name, kname, fix)
    res = subprocess.run([tool("cuobjdump"), "-res-usage", path], capture_output=True, text=True).stdout
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(tool("nvdisasm")) + os.pathsep + env.get("PATH", "")
    sass = subprocess.run([tool("cuobjdump"), "-sass", path], capture_output=True, text=True, env=env)
    if sass.returncode != 0 or "Function" not in sass.stdout:
        sys.exit("cuobjdump failed: " + (sass.stderr or sass.stdout)[-500:])
    m = re.search(r"REG:(\d+).*?LOCAL:(\d+)", res)
    ins = parse(sass.stdout)
    bl = blocks(ins)
    hot = max(bl, key=len)
    mix = collections.Counter(opname(x["text"]).split(".")[0] for x in hot)
    mio = sum(words(opname(x["text"])) if opname(x["text"]).split(".")[0] in ("LDS", "STS") else 1
              for x in hot if opname(x["text"]).split(".")[0] in ("LDS", "STS", "SHFL"))
    units = float(eval(per, {"__builtins__": {}}, dict(cfg))) if per else None
    return {"cfg": fix or "defaults", "regs": int(m.group(1)) if m else -1, "local": int(m.group(2)) if m else -1,
            "n": len(hot), "units": units, "mio": mio, "sched": schedule(hot), "mix": mix, "blocks": bl,
            "pv_waits": pv_waits(ins)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("task")
    ap.add_argument("kernel")
    ap.add_argument("configs", nargs="*", default=[""], help="tunables, e.g. K=16,RT=1 (others at their defaults)")
    ap.add_argument("--per", default="", help="units of work one pass of the hot block does, e.g. 'K*16'")
    ap.add_argument("--blocks", type=int, default=0, metavar="N",
                    help="also list every straight-line block of at least N instructions (address, size, one-warp schedule, mix)")
    ap.add_argument("--waits", action="store_true",
                    help="also list, for each S product waited on while a PV product runs, the exponentials "
                         "issued before and after the wait for that PV product (pv_waits)")
    a = ap.parse_args()
    os.environ.setdefault("KS_CUBIN_DIR", os.path.join(cd.ROOT, ".cubins"))
    hdr = f"{'configuration':34s} {'regs':>4s} {'local':>5s} {'instr':>6s} {'shared':>6s} {'1-warp':>7s}"
    if a.per:
        hdr += f" {'instr/u':>7s} {'shared/u':>8s} {'cyc/u':>6s}"
    print(hdr + "  mix (most issued)")
    for fix in a.configs or [""]:
        c = census(a.task, a.kernel, fix, a.per)
        line = f"{c['cfg']:34s} {c['regs']:4d} {c['local']:5d} {c['n']:6d} {c['mio']:6d} {c['sched']:7d}"
        if c["units"]:
            u = c["units"]
            line += f" {c['n'] / u:7.2f} {c['mio'] / u:8.2f} {c['sched'] / u:6.1f}"
        print(line + "  " + " ".join(f"{k} {v}" for k, v in c["mix"].most_common(8)))
        if a.waits:
            print("    exponentials before / after the PV wait: "
                  + ", ".join(f"{b}/{af}" for b, af in c["pv_waits"]))
        if a.blocks:
            for b in c["blocks"]:
                if len(b) >= a.blocks:
                    mix = collections.Counter(opname(x["text"]).split(".")[0] for x in b)
                    print(f"    {b[0]['addr']:#07x} {len(b):5d} instr {schedule(b):6d} cycles  "
                          + " ".join(f"{k} {v}" for k, v in mix.most_common(6)) + f"  | ends {b[-1]['text'][:40]}")


if __name__ == "__main__":
    main()
