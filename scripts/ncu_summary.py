#!/usr/bin/env python3
"""Sums an ncu CSV (`ncu --csv --metrics gpu__time_duration.sum ...`) by kernel name.

Usage: ncu_summary.py FILE.csv [DIVISOR] [TOP]
Prints total GPU time and launches, then the TOP kernels by time (each divided by DIVISOR, e.g.
the number of profiled steps)."""
import csv
import re
import sys


def main():
    path = sys.argv[1]
    div = float(sys.argv[2]) if len(sys.argv) > 2 else 1.0
    top = int(sys.argv[3]) if len(sys.argv) > 3 else 40
    lines = open(path, errors="replace").read().splitlines()
    start = [i for i, l in enumerate(lines) if l.startswith('"ID"') or l.startswith('"Process ID"')]
    if not start:
        sys.exit(f"{path}: no ncu CSV header found")
    agg = {}
    for row in csv.DictReader(lines[start[0]:]):
        if row.get("Metric Name") != "gpu__time_duration.sum":
            continue
        name = re.sub(r"\(.*", "", row["Kernel Name"])[-90:]
        unit = row.get("Metric Unit", "ns")
        v = float(row["Metric Value"].replace(",", ""))
        v *= {"ns": 1e-6, "usecond": 1e-3, "us": 1e-3, "msecond": 1.0, "ms": 1.0}.get(unit, 1e-6)
        a = agg.setdefault(name, [0.0, 0])
        a[0] += v
        a[1] += 1
    tot = sum(a for a, _ in agg.values())
    n = sum(b for _, b in agg.values())
    print(f"{path}: {tot / div:.3f} ms GPU time and {n / div:.1f} launches per unit (divisor {div:g})")
    for k, (a, b) in sorted(agg.items(), key=lambda x: -x[1][0])[:top]:
        print(f"{a / div:9.3f} ms {b / div:7.1f} x {a / b * 1e3:8.1f} us  {k}")


if __name__ == "__main__":
    main()
