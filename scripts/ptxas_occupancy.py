#!/usr/bin/env python3
"""Registers, spills and static shared memory of every kernel in some CUDA files (ptxas -v, no GPU
needed), and the resident blocks an SM they allow on a Hopper GPU (H100 / H200: 64K registers, 228
KB of shared memory, 64 warps, 32 blocks). With --base REV, the same files at a git revision beside
them, kernels whose blocks an SM changed marked with '!'.

Why: on 2026-11-29 (BENCHMARKS.md, pass 32) a 64-bit division helper added 8 registers to the SSD's
chunk_scan_wg (93 -> 101). At 128 threads a block registers are allocated 8 at a time a thread, so
the kernel fell from 5 resident blocks an SM to 4 and the forward lost 6 %; a device call found it
only after the fact. This check takes a minute here.

Usage: scripts/ptxas_occupancy.py [--threads 128] [--base REV] [--filter REGEX] FILE.cu...
Threads a block are not in ptxas's output: --threads applies to every kernel listed (most hax
kernels use 128; check the launch). Dynamic shared memory is not counted (the 'smem' column is the
static part only)."""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

NVCC = os.environ.get("NVCC", "/usr/local/cuda/bin/nvcc")
REGS_SM, SMEM_SM, WARPS_SM, BLOCKS_SM = 65536, 228 * 1024, 64, 32
SMEM_RESERVED = 1024  # per block, by the driver


def kernels(root, path, arch):
    """{kernel name: (registers, spill bytes stored, static shared bytes)} of one file under root."""
    cmd = [NVCC, "-std=c++17", "-O3", f"-arch={arch}", "-I", os.path.join(root, "src"), "--expt-relaxed-constexpr",
           "-c", os.path.join(root, path), "-o", os.devnull, "-Xptxas", "-v"]
    run = subprocess.run(cmd, capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"ptxas_occupancy: nvcc failed on {path} under {root}:\n{run.stderr[-3000:]}")
    out, name, spill = {}, None, 0
    for line in run.stderr.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            name, spill = m.group(1), 0
            continue
        m = re.search(r"(\d+) bytes spill stores", line)
        if m and name:
            spill = int(m.group(1))
            continue
        m = re.search(r"Used (\d+) registers.*?(?:(\d+) bytes smem)?$", line)
        if m and name:
            out[name] = (int(m.group(1)), spill, int(m.group(2) or 0))
            name = None
    return out


def blocks_per_sm(regs, smem, threads):
    warps = (threads + 31) // 32
    per_warp = ((regs * 32 + 255) // 256) * 256  # registers are allocated per warp, 256 at a time
    by_regs = REGS_SM // (per_warp * warps) if regs else BLOCKS_SM
    by_smem = SMEM_SM // (smem + SMEM_RESERVED)
    return min(by_regs, by_smem, WARPS_SM // warps, BLOCKS_SM)


def demangle(names):
    """{mangled: short name}: no return type, namespaces or parameter list. The short name also keys
    the comparison with --base (an anonymous namespace's mangled name differs between trees)."""
    run = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True)
    pretty = run.stdout.splitlines() if run.returncode == 0 else names
    short = {}
    for n, p in zip(names, pretty):
        p = p.replace("(anonymous namespace)::", "")
        p = re.sub(r"^void ", "", p)
        p = re.sub(r"\b(hax|ops|\w+_cuda)::", "", p)
        short[n] = re.sub(r"\((SsdParams|SsdGradParams|Attention|Causal|\w+Params).*$", "", p)
    return short


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--threads", type=int, default=128)
    ap.add_argument("--arch", default="sm_90a")
    ap.add_argument("--base", help="a git revision to compare with")
    ap.add_argument("--filter", default="", help="only kernels whose name matches this regex")
    a = ap.parse_args()
    if a.threads < 1 or a.threads > 1024:
        sys.exit(f"ptxas_occupancy: --threads {a.threads} must be 1..1024")
    repo = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True).stdout.strip() or "."
    files = [os.path.relpath(os.path.abspath(f), repo) for f in a.files]
    base_dir = None
    if a.base:
        arch = subprocess.run(["git", "-C", repo, "archive", a.base, "src"], capture_output=True)
        if arch.returncode != 0:
            sys.exit(f"ptxas_occupancy: --base {a.base}: {arch.stderr.decode().strip()}")
        base_dir = tempfile.mkdtemp(prefix="ptxas_base_")
        subprocess.run(["tar", "x", "-C", base_dir], input=arch.stdout, check=True)
    try:
        report(a, repo, files, base_dir)
    finally:
        if base_dir:
            shutil.rmtree(base_dir, ignore_errors=True)


def report(a, repo, files, base_dir):
    print(f"{'kernel':<60} {'regs':>5} {'spill':>6} {'smem':>7} {'blocks/SM':>9}" + ("  base: regs spill blocks" if a.base else ""))
    for f in files:
        now = kernels(repo, f, a.arch)
        old = kernels(base_dir, f, a.arch) if base_dir and os.path.exists(os.path.join(base_dir, f)) else {}
        names = demangle(sorted(now))
        old_names = demangle(sorted(old)) if old else {}
        old = {old_names[n]: v for n, v in old.items()}
        print(f"== {f}")
        for n in sorted(now, key=lambda n: names[n]):
            if a.filter and not re.search(a.filter, names[n]):
                continue
            regs, spill, smem = now[n]
            blocks = blocks_per_sm(regs, smem, a.threads)
            line = f"{names[n][:60]:<60} {regs:>5} {spill:>6} {smem:>7} {blocks:>9}"
            if a.base:
                if names[n] in old:
                    r0, s0, m0 = old[names[n]]
                    b0 = blocks_per_sm(r0, m0, a.threads)
                    line += f"  {'!' if b0 != blocks else ' '} {r0:>4} {s0:>5} {b0:>6}"
                else:
                    line += "    (new)"
            print(line)


if __name__ == "__main__":
    main()
