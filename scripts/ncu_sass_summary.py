#!/usr/bin/env python3
"""Summarizes an ncu source page (per-SASS-instruction metrics) of one kernel: where its warps stall
and which instructions it executes.

Make the input with (the kernel profiled with the full set, which samples warp states):
  ncu --set full --import-source no --kernel-name regex:NAME --launch-skip 2 --launch-count 1 -o rep CMD...
  ncu -i rep.ncu-rep --page source --csv --print-source sass > NAME-sass.csv

Usage: ncu_sass_summary.py NAME-sass.csv [TOP]
Prints the stall reasons over all samples, the TOP instructions by samples (with each one's main
stall reason), the instructions that carry each of the four main stall reasons most (with the
instruction before them, usually the one waited for), and the executed-instruction mix by opcode."""
import collections
import csv
import sys


def main():
    path = sys.argv[1]
    top = int(sys.argv[2]) if len(sys.argv) > 2 else 25
    rows = list(csv.reader(open(path, errors="replace")))
    head = next((i for i, r in enumerate(rows) if r and r[0] == "Address"), None)
    if head is None:
        sys.exit(f"{path}: no 'Address' header row (is this an ncu --page source --csv file?)")
    hdr, data = rows[head], [r for r in rows[head + 1:] if len(r) == len(rows[head])]
    ix = {h: i for i, h in enumerate(hdr)}
    for need in ("Source", "Warp Stall Sampling (All Samples)", "Instructions Executed"):
        if need not in ix:
            sys.exit(f"{path}: column '{need}' missing (profile with --set full)")
    stalls = [h for h in hdr if h.startswith("stall_") and "Not Issued" not in h]
    num = lambda r, col: int(float(r[ix[col]] or 0))

    totals = collections.Counter()
    for r in data:
        for s in stalls:
            totals[s] += num(r, s)
    all_samples = sum(totals.values()) or 1
    print(f"{path}: {all_samples} warp-state samples")
    for s, v in totals.most_common(10):
        print(f"  {s:28s} {v:9d} {100 * v / all_samples:5.1f}%")

    print(f"\ntop {top} instructions by samples:")
    by_samples = sorted(data, key=lambda r: -num(r, "Warp Stall Sampling (All Samples)"))[:top]
    for r in by_samples:
        main_stall = max(stalls, key=lambda s: num(r, s)) if stalls else "-"
        print(f"  {num(r, 'Warp Stall Sampling (All Samples)'):8d}  {r[ix['Address']][-5:]}  "
              f"{r[ix['Source']].strip()[:60]:60s} {main_stall}")

    for s, _ in totals.most_common(4):
        print(f"\ntop {min(top, 10)} instructions by {s} (and the instruction before each):")
        ranked = sorted(range(len(data)), key=lambda i: -num(data[i], s))[:min(top, 10)]
        for i in ranked:
            before = data[i - 1][ix["Source"]].strip()[:44] if i > 0 else ""
            print(f"  {num(data[i], s):8d}  {data[i][ix['Address']][-5:]}  "
                  f"{data[i][ix['Source']].strip()[:52]:52s} <- {before}")

    mix = collections.Counter()
    for r in data:
        words = r[ix["Source"]].split()
        if not words:
            continue
        op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        mix[op.split(".")[0]] += num(r, "Instructions Executed")
    executed = sum(mix.values()) or 1
    print(f"\nexecuted warp instructions: {executed}")
    for op, v in mix.most_common(16):
        print(f"  {op:10s} {v:12d} {100 * v / executed:5.1f}%")


if __name__ == "__main__":
    main()
