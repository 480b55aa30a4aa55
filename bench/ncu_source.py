#!/usr/bin/env python3
"""Where a kernel's issue slots and stalls go, from Nsight Compute's source page (SASS, as CSV).

bench/scan_ncu.sh with SOURCE=1 writes ncu_<item>_sass.csv: one row per SASS instruction with its
executed count, its warp-stall samples (all and by reason) and its shared-memory wavefronts. This
script cuts the code into regions of consecutive instructions that ran equally often (a straight-line
stretch of a loop body, a wait loop, the prologue) and prints, for each region that matters:

  - instructions executed per unit (--per: e.g. the number of runs a launch does, so a loop body's
    region reads as instructions a run);
  - its share of the stall samples, and shared-memory wavefronts per unit;
  - its opcode mix;

then the samples by opcode class in the hottest regions (which instructions the warps stall on:
an FADD after a shuffle, a conversion after a shared load) and the stall reasons over the whole
kernel.

    python3 bench/ncu_source.py ncu_tw_scan_..._sass.csv --per 65536
"""
import argparse
import collections
import csv


def num(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(sass):
    parts = sass.split()
    if not parts:
        return "?"
    op = parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]
    return op.split(".")[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--per", type=float, default=1.0, help="units of work in the profiled launch (e.g. runs)")
    ap.add_argument("--min", type=float, default=2.0, help="list regions with at least this many instructions a unit")
    a = ap.parse_args()
    rows = list(csv.reader(open(a.csv, newline="")))
    head = next(i for i, r in enumerate(rows) if r and r[0] == "Address")
    hdr, data = rows[head], [r for r in rows[head + 1:] if len(r) == len(rows[head])]
    ix = {h: i for i, h in enumerate(hdr)}
    ex, sm, wf = "Instructions Executed", "Warp Stall Sampling (All Samples)", "L1 Wavefronts Shared"
    total_e = sum(num(r[ix[ex]]) for r in data)
    total_s = sum(num(r[ix[sm]]) for r in data) or 1.0
    print(f"{len(data)} instructions, {total_e / a.per:.1f} executed a unit, {total_s:.0f} stall samples")
    regions, cur = [], None
    for i, r in enumerate(data):
        e = num(r[ix[ex]])
        if cur is None or abs(e - cur["count"]) > 0.005 * max(e, cur["count"], 1.0):
            cur = {"first": i, "count": e, "rows": []}
            regions.append(cur)
        cur["rows"].append(r)
    hot = []
    for g in regions:
        e = sum(num(r[ix[ex]]) for r in g["rows"]) / a.per
        s = sum(num(r[ix[sm]]) for r in g["rows"])
        if e < a.min and s < 0.01 * total_s:
            continue
        w = sum(num(r[ix[wf]]) for r in g["rows"]) / a.per
        mix = collections.Counter(opcode(r[1]) for r in g["rows"])
        last = g["first"] + len(g["rows"]) - 1
        print(f"rows {g['first']:5d}-{last:5d}  x{g['count'] / a.per:6.2f}  {e:7.1f} instr  {100 * s / total_s:5.1f}% samples"
              f"  {w:6.1f} wavefronts  " + " ".join(f"{k} {v}" for k, v in mix.most_common(7)))
        hot.append((s, g))
    for s, g in sorted(hot, key=lambda x: -x[0])[:3]:
        by = collections.Counter()
        for r in g["rows"]:
            by[opcode(r[1])] += num(r[ix[sm]])
        print(f"samples by opcode, rows {g['first']}-{g['first'] + len(g['rows']) - 1}: "
              + " ".join(f"{k} {100 * v / total_s:.1f}%" for k, v in by.most_common(10)))
    reasons = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    tot = {h[6:]: sum(num(r[ix[h]]) for r in data) for h in reasons}
    print("stall reasons: " + " ".join(f"{k} {100 * v / total_s:.1f}%" for k, v in
                                       sorted(tot.items(), key=lambda x: -x[1]) if v > 0.005 * total_s))


if __name__ == "__main__":
    main()
