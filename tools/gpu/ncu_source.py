#!/usr/bin/env python3
"""Summarize ncu's SASS source page of one kernel launch.

Input: the CSV of `ncu --import REPORT --page source --csv --print-source sass`
(the report taken with `--set full --import-source yes`), as
tools/gpu/h200_validate.sh's `source` part writes it. Output: the kernel's stall
reasons, its opcode mix (by executed warp instructions and by stall
samples), the straight-line regions of the code (consecutive instructions
run the same number of times) that hold at least 1% of the samples, and the
instructions with the most samples; for the regions with at least 5% of the
samples, their samples by opcode and by stall reason. Standard library only
(the GPU machine has no package registry).

    python3 tools/gpu/ncu_source.py FILE.csv [--top N]
"""
import argparse
import collections
import csv
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def number(row, col):
    try:
        return float(row[col].replace(",", ""))
    except (ValueError, IndexError):
        return 0.0


def opcode(source):
    words = source.split()
    if words and words[0].startswith("@"):  # predicate
        words = words[1:]
    return words[0].split(".")[0] if words else "?"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=20, help="instructions listed by samples")
    args = ap.parse_args()
    with open(args.csv, newline="") as f:
        first = f.readline()  # "Kernel Name","..."
        rows = list(csv.reader(f))
    needed = ("Source", SAMPLES, EXECUTED)
    if not rows or any(c not in rows[0] for c in needed):
        sys.exit(f"{args.csv}: not an ncu source page with the columns " + ", ".join(f"'{c}'" for c in needed))
    head, code = rows[0], rows[1:]
    col = {name: i for i, name in enumerate(head)}
    stalls = [(col[h], h[len("stall_"):]) for h in head if h.startswith("stall_") and "Not Issued" not in h]
    samples = [number(r, col[SAMPLES]) for r in code]
    executed = [number(r, col[EXECUTED]) for r in code]
    sum_s, sum_e = sum(samples), sum(executed)
    total_s, total_e = sum_s or 1.0, sum_e or 1.0  # divisors
    kernel = next(csv.reader([first]))
    print(f"{kernel[1] if len(kernel) > 1 else '?'}: {len(code)} instructions, {sum_s:.0f} samples, "
          f"{sum_e:.0f} warp instructions executed")

    reasons = collections.Counter()
    for r in code:
        for c, name in stalls:
            reasons[name] += number(r, c)
    print("stalls: " + ", ".join(f"{k} {100 * v / total_s:.1f}%" for k, v in reasons.most_common(10)))

    by_exec, by_samp = collections.Counter(), collections.Counter()
    for r, s, e in zip(code, samples, executed):
        op = opcode(r[col["Source"]])
        by_exec[op] += e
        by_samp[op] += s
    print("opcodes by executed: " + ", ".join(f"{k} {100 * v / total_e:.1f}%" for k, v in by_exec.most_common(16)))
    print("opcodes by samples:  " + ", ".join(f"{k} {100 * v / total_s:.1f}%" for k, v in by_samp.most_common(16)))

    regions = []  # [first, last, times executed, samples]: consecutive instructions run equally often
    for i, (s, e) in enumerate(zip(samples, executed)):
        if regions and regions[-1][2] == e:
            regions[-1][1] = i
            regions[-1][3] += s
        else:
            regions.append([i, i, e, s])
    print("regions with at least 1% of the samples (index range, times run, samples, instructions;")
    print("  then, for regions with at least 5%, their samples by opcode and by stall reason):")
    for first_i, last_i, times, s in regions:
        e = times * (last_i - first_i + 1)
        if s / total_s >= 0.01:
            src = code[first_i][col["Source"]].strip()[:44]
            print(f"  [{first_i}-{last_i}] x{times:.0f}: {100 * s / total_s:5.1f}% samples, "
                  f"{100 * e / total_e:5.1f}% instructions, {last_i - first_i + 1} static  ({src} ..)")
        if s / total_s >= 0.05:
            ops, why = collections.Counter(), collections.Counter()
            for i in range(first_i, last_i + 1):
                ops[opcode(code[i][col["Source"]])] += samples[i]
                for c, name in stalls:
                    why[name] += number(code[i], c)
            print("      " + ", ".join(f"{k} {100 * v / s:.0f}%" for k, v in ops.most_common(6))
                  + " | " + ", ".join(f"{k} {100 * v / s:.0f}%" for k, v in why.most_common(5)))

    print(f"top {args.top} instructions by samples (index, samples, times run, source, main stalls):")
    order = sorted(range(len(code)), key=lambda i: -samples[i])[:args.top]
    for i in order:
        top = sorted(((number(code[i], c), name) for c, name in stalls), reverse=True)[:3]
        reasons_txt = " ".join(f"{n}:{v:.0f}" for v, n in top if v > 0)
        print(f"  {i:5d} {samples[i]:7.0f} x{executed[i]:<9.0f} {code[i][col['Source']].strip()[:56]:56s} {reasons_txt}")


if __name__ == "__main__":
    main()
