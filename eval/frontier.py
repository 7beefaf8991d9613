#!/usr/bin/env python3
"""Quality against size: kvforge's schemes and peers on one dump, as a Pareto plot.

Input (the "combined" JSON): a list of entries
    {"name": "rtn_int2", "kind": "scheme" | "peer", "report": <`kvforge eval --json` output>}
one per scheme or peer, all on the same dump. Each becomes a point at
x = bits per cached value = 16 / compression (BF16 bytes of K and V over every
byte the cache stores, report["overall"]["compression"]), in two panels:
y = top-1 shift and y = attention-output relative error (lower is better on
both axes). kvforge's schemes are circles joined by their Pareto front (the
points no other scheme beats on both axes), peers are diamonds of another
colour, left off the front.

    python3 eval/frontier.py run --data DUMP --schemes rtn_int2 qvg_int2 ... --peers R1.safetensors ... \\
        --out combined.json [--kvforge out/bin/kvforge] [--gpu] [--threads N]
    python3 eval/frontier.py plot combined.json --png frontier.png [--title TEXT]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

METRICS = (("top1_shift", "top-1 shift"), ("attn_out_rel_err", "attention-output rel. error"))


def bits_per_value(report: dict) -> float:
    c = report["overall"].get("compression")
    return 16.0 / c if c else math.nan


def points(entries: list, metric: str) -> list:
    """(name, kind, x, y) of every entry with both numbers."""
    out = []
    for e in entries:
        if e.get("kind") not in ("scheme", "peer"):
            raise ValueError(f"entry {e.get('name')!r}: kind must be 'scheme' or 'peer'")
        x, y = bits_per_value(e["report"]), e["report"]["overall"].get(metric)
        if y is not None and math.isfinite(x) and math.isfinite(y):
            out.append((e["name"], e["kind"], x, y))
    return out


def pareto_front(pts: list) -> list:
    """The points (name, kind, x, y) that no other point beats: none other has x and y
    both <= and one of them < (lower is better); of points equal on both, the first.
    Sorted by x."""
    front = []
    for i, p in enumerate(pts):
        beaten = any(q[2] <= p[2] and q[3] <= p[3] and (q[2] < p[2] or q[3] < p[3] or j < i)
                     for j, q in enumerate(pts) if j != i)
        if not beaten:
            front.append(p)
    return sorted(front, key=lambda p: (p[2], p[3]))


def plot(entries: list, png: str, title: str | None = None) -> dict:
    """Draw both panels into png; returns {metric: [names on kvforge's front]}."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    fronts = {}
    for ax, (metric, label) in zip(axes, METRICS):
        pts = points(entries, metric)
        ours = [p for p in pts if p[1] == "scheme"]
        peers = [p for p in pts if p[1] == "peer"]
        front = pareto_front(ours)
        fronts[metric] = [p[0] for p in front]
        if front:
            ax.plot([p[2] for p in front], [p[3] for p in front], "-", color="tab:blue", lw=1.5,
                    label="kvforge Pareto front", zorder=1)
        ax.scatter([p[2] for p in ours], [p[3] for p in ours], marker="o", s=40, color="tab:blue",
                   label="kvforge schemes", zorder=2)
        ax.scatter([p[2] for p in peers], [p[3] for p in peers], marker="D", s=55, color="tab:red",
                   label="peers", zorder=3)
        for name, _, x, y in pts:
            ax.annotate(name, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.set_xlabel("bits per cached value (16 / compression)")
        ax.set_ylabel(label)
        if pts and min(p[3] for p in pts) > 0 and max(p[3] for p in pts) / min(p[3] for p in pts) > 20:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    data = entries[0]["report"].get("data", "") if entries else ""
    fig.suptitle(title or f"quality against size on {os.path.basename(data)}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return fronts


def run(kvforge: str, data: str, schemes: list, peers: list, gpu: bool = False, threads: int | None = None) -> list:
    """`kvforge eval --json` for every scheme and peer recon file; the combined list."""
    entries = []
    extra = ["--threads", str(threads)] if threads else []
    for kind, items in (("scheme", schemes), ("peer", peers)):
        for item in items:
            cmd = [kvforge, "eval", "--scheme" if kind == "scheme" else "--peer", item, "--data", data, "--json",
                   *extra, *(["--gpu"] if gpu and kind == "scheme" else [])]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}: {p.stderr.strip()}")
            report = json.loads(p.stdout)
            name = os.path.basename(item)[:-4] if kind == "scheme" and item.endswith(".lua") else \
                item if kind == "scheme" else report["scheme"]
            entries.append({"name": name, "kind": kind, "report": report})
    return entries


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="kvforge eval over schemes and peers, into a combined JSON")
    r.add_argument("--kvforge", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "out",
                                                     "bin", "kvforge"))
    r.add_argument("--data", required=True)
    r.add_argument("--schemes", nargs="*", default=[])
    r.add_argument("--peers", nargs="*", default=[], help="recon files (eval/peer/qvg_peer.py)")
    r.add_argument("--gpu", action="store_true", help="kvforge's schemes on GPU 0")
    r.add_argument("--threads", type=int)
    r.add_argument("--out", required=True)
    p = sub.add_parser("plot", help="plot a combined JSON")
    p.add_argument("combined")
    p.add_argument("--png", required=True)
    p.add_argument("--title")
    a = ap.parse_args(argv)
    if a.cmd == "run":
        entries = run(a.kvforge, a.data, a.schemes, a.peers, a.gpu, a.threads)
        with open(a.out, "w") as f:
            json.dump(entries, f, indent=1)
        for e in entries:
            o = e["report"]["overall"]
            print(f"{e['kind']:6s} {e['name']:28s} bits/value {bits_per_value(e['report']):6.3f}  "
                  f"top-1 shift {o['top1_shift']}  attn-out rel. err {o['attn_out_rel_err']}")
        return 0
    with open(a.combined) as f:
        entries = json.load(f)
    fronts = plot(entries, a.png, a.title)
    for metric, names in fronts.items():
        print(f"kvforge front ({metric}): {' -> '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
