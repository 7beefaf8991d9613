#!/usr/bin/env python3
"""Quality against size: kvforge's schemes and peers on one dump, as a Pareto plot and a comparison.

Input (the "combined" JSON): a list of entries
    {"name": "rtn_int2", "kind": "scheme" | "peer", "report": <`kvforge eval --json` output>}
one per scheme or peer, all on the same dump. Each becomes a point at
x = bits per cached value = 16 / compression (BF16 bytes of K and V over every
byte the cache stores, report["overall"]["compression"]), in two panels:
y = top-1 shift and y = attention-output relative error (lower is better on
both axes). kvforge's schemes are circles joined by their Pareto front (the
points no other scheme beats on both axes), peers are diamonds of another
colour, left off the front.

`compare` puts the same entries side by side, per layer and overall: one
markdown table (a row per entry and layer, then its overall: bits per value,
top-1 shift, attention-output relative error, key and value MSE; "-" where a
metric is undefined, e.g. a layer whose inputs held NaN) and one PNG of the
four metrics per layer, grouped bars with one colour per entry.

    python3 eval/frontier.py run --data DUMP --schemes rtn_int2 qvg_int2 ... --peers R1.safetensors ... \\
        --out combined.json [--kvforge out/bin/kvforge] [--gpu] [--threads N]
    python3 eval/frontier.py plot combined.json --png frontier.png [--title TEXT] [--bytes end|held]
    python3 eval/frontier.py compare combined.json --png compare.png --md compare.md [--title TEXT]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

METRICS = (("top1_shift", "top-1 shift"), ("attn_out_rel_err", "attention-output rel. error"))
# compare's metrics: the frontier's two, then the cache's own error
COMPARE_METRICS = METRICS + (("key_mse", "key MSE"), ("value_mse", "value MSE"))


def load(path: str) -> list:
    """The combined JSON's entries, each checked: a name, kind 'scheme' or 'peer', a report with "overall"."""
    with open(path) as f:
        entries = json.load(f)
    if not isinstance(entries, list):
        raise ValueError(f"{path}: a list of entries expected")
    for e in entries:
        if not isinstance(e, dict) or not isinstance(e.get("report"), dict) or "overall" not in e["report"]:
            raise ValueError(f"{path}: entry {e.get('name') if isinstance(e, dict) else e!r}: no report with 'overall'")
        check_kind(e)
    return entries


def check_kind(e: dict) -> None:
    if e.get("kind") not in ("scheme", "peer"):
        raise ValueError(f"entry {e.get('name')!r}: kind must be 'scheme' or 'peer'")


def value(x) -> float:
    """A report's number; NaN for null (undefined) or absent."""
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else math.nan


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _maybe_log(ax, ys: list) -> None:
    """A log y axis where the positive values span more than a factor 20."""
    ys = [y for y in ys if math.isfinite(y)]
    if ys and min(ys) > 0 and max(ys) / min(ys) > 20:
        ax.set_yscale("log")


def _title(entries: list, what: str, title: str | None) -> str:
    data = entries[0]["report"].get("data", "") if entries else ""
    return title or f"{what} on {os.path.basename(data)}"


# x of the plot: the stored bytes at the stream's end, or those held on average over its
# steps (a span policy holds its open span in BF16; a peer's recon has no held figure)
BYTES = {"end": ("compression", "bits per cached value at the stream's end (16 / compression)"),
         "held": ("compression_held", "bits per value held, averaged over the steps (16 / compression_held)")}


def bits_per_value(report: dict, bytes_: str = "end") -> float:
    c = report["overall"].get(BYTES[bytes_][0])
    return 16.0 / c if c else math.nan


def points(entries: list, metric: str, bytes_: str = "end") -> list:
    """(name, kind, x, y) of every entry with both numbers."""
    out = []
    for e in entries:
        check_kind(e)
        x, y = bits_per_value(e["report"], bytes_), e["report"]["overall"].get(metric)
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


def plot(entries: list, png: str, title: str | None = None, bytes_: str = "end") -> dict:
    """Draw both panels into png; returns {metric: [names on kvforge's front]}."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    fronts = {}
    for ax, (metric, label) in zip(axes, METRICS):
        pts = points(entries, metric, bytes_)
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
        ax.set_xlabel(BYTES[bytes_][1])
        ax.set_ylabel(label)
        _maybe_log(ax, [p[3] for p in pts])
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(_title(entries, "quality against size", title), fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)
    return fronts


def layer_rows(entries: list) -> list:
    """(name, kind, layer, bits per value, {metric: value}) per entry: its layers in order, then
    layer "overall"; NaN where a metric is null or absent."""
    rows = []
    for e in entries:
        check_kind(e)
        rep = e["report"]
        bits = bits_per_value(rep) if rep["overall"].get("compression") is not None else math.nan
        for lay in sorted(rep.get("layers", []), key=lambda x: x.get("layer", 0)):
            rows.append((e["name"], e["kind"], str(lay.get("layer")), bits,
                         {m: value(lay.get(m)) for m, _ in COMPARE_METRICS}))
        rows.append((e["name"], e["kind"], "overall", bits,
                     {m: value(rep["overall"].get(m)) for m, _ in COMPARE_METRICS}))
    return rows


def _cell(x: float, fmt: str) -> str:
    return "-" if not math.isfinite(x) else format(x, fmt)


def compare_table(entries: list, title: str | None = None) -> str:
    """The markdown table of compare: a row per entry and layer, then the entry's overall."""
    head = ["entry", "kind", "layer", "bits/value"] + [label for _, label in COMPARE_METRICS]
    lines = [f"# {_title(entries, 'kvforge eval, per layer', title)}", "",
             "| " + " | ".join(head) + " |", "|" + "|".join(["---"] * 3 + ["---:"] * (len(head) - 3)) + "|"]
    fmts = {"top1_shift": ".4f", "attn_out_rel_err": ".4e", "key_mse": ".4e", "value_mse": ".4e"}
    for name, kind, layer, bits, m in layer_rows(entries):
        cells = [name.replace("|", "\\|"), kind, f"**{layer}**" if layer == "overall" else layer, _cell(bits, ".3f")]
        cells += [_cell(m[k], fmts[k]) for k, _ in COMPARE_METRICS]
        lines.append("| " + " | ".join(cells) + " |")
    warned = [(e["name"], w) for e in entries for w in e["report"].get("warnings", [])]
    if warned:
        lines += ["", "Warnings:", ""] + [f"- {n}: {w}" for n, w in warned]
    return "\n".join(lines) + "\n"


def compare_plot(entries: list, png: str, title: str | None = None) -> dict:
    """Four panels (COMPARE_METRICS), each grouped bars: x = layer (then "all" for the overall),
    one bar and one colour per entry; an undefined value leaves its bar out. Returns
    {metric: {entry name: [values per layer..., overall]}} as drawn."""
    plt = _pyplot()
    rows = layer_rows(entries)
    names = list(dict.fromkeys(r[0] for r in rows))
    layers = list(dict.fromkeys(r[2] for r in rows if r[2] != "overall"))
    groups = layers + ["overall"]
    cmap = plt.get_cmap("tab10" if len(names) <= 10 else "tab20")
    fig, axes = plt.subplots(2, 2, figsize=(max(10, 1.2 * len(groups) * max(1, len(names)) / 2 + 4), 8))
    width = 0.8 / max(1, len(names))
    drawn = {}
    for ax, (metric, label) in zip(axes.flat, COMPARE_METRICS):
        drawn[metric] = {}
        ys_all = []
        for i, name in enumerate(names):
            by_group = {r[2]: r[4][metric] for r in rows if r[0] == name}
            ys = [by_group.get(g, math.nan) for g in groups]
            drawn[metric][name] = ys
            ys_all += ys
            xs = [j + (i - (len(names) - 1) / 2) * width for j in range(len(groups))]
            ok = [(x, y) for x, y in zip(xs, ys) if math.isfinite(y)]
            bits = next(r[3] for r in rows if r[0] == name)
            ax.bar([x for x, _ in ok], [y for _, y in ok], width, color=cmap(i % cmap.N),
                   label=f"{name} ({_cell(bits, '.2f')} bits/value)")
            # an undefined value is no bar, which must not read as zero error: say so
            for x, y in zip(xs, ys):
                if not math.isfinite(y):
                    ax.text(x, 0.02, "n/a", transform=ax.get_xaxis_transform(), ha="center", va="bottom",
                            rotation=90, fontsize=7, color=cmap(i % cmap.N))
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels(groups)
        ax.set_xlabel("layer")
        ax.set_ylabel(label)
        _maybe_log(ax, ys_all)
        ax.grid(True, axis="y", alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(_title(entries, "per layer", title), fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return drawn


def _line(e: dict) -> str:
    o = e["report"]["overall"]
    return (f"{e['kind']:6s} {e['name']:28s} bits/value {bits_per_value(e['report']):6.3f}  "
            f"top-1 shift {o['top1_shift']}  attn-out rel. err {o['attn_out_rel_err']}")


def _write(path: str, entries: list) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(entries, f, indent=1)
    os.replace(tmp, path)


def run(kvforge: str, data: str, schemes: list, peers: list, gpu: bool = False, threads: int | None = None,
        table_dir: str | None = None, out: str | None = None) -> list:
    """`kvforge eval --json` for every scheme and peer recon file; the combined list.
    table_dir: where a mixed-precision scheme's sensitivity table is, NAME.json.
    out: the combined JSON, rewritten after every entry (a run cut short by a time
    limit keeps what it scored), each entry's line printed as it comes."""
    entries = []
    extra = ["--threads", str(threads)] if threads else []
    for kind, items in (("scheme", schemes), ("peer", peers)):
        for item in items:
            stem = os.path.basename(item)[:-4] if item.endswith(".lua") else item
            table = os.path.join(table_dir, stem + ".json") if table_dir and kind == "scheme" else None
            cmd = [kvforge, "eval", "--scheme" if kind == "scheme" else "--peer", item, "--data", data, "--json",
                   *extra, *(["--gpu"] if gpu and kind == "scheme" else []),
                   *(["--table", table] if table and os.path.exists(table) else [])]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)}: exit {p.returncode}: {p.stderr.strip()}")
            report = json.loads(p.stdout)
            for line in p.stderr.splitlines():  # kvforge's warnings (NaN in the dump, --warm unscored)
                if line.startswith("warning:"):
                    print(f"{item}: {line}", file=sys.stderr)
            name = os.path.basename(item)[:-4] if kind == "scheme" and item.endswith(".lua") else \
                item if kind == "scheme" else report["scheme"]
            entries.append({"name": name, "kind": kind, "report": report})
            if out:
                _write(out, entries)
                print(_line(entries[-1]), flush=True)
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
    r.add_argument("--table-dir", help="sensitivity tables of mixed-precision schemes: NAME.json (kvforge calibrate)")
    r.add_argument("--out", required=True)
    p = sub.add_parser("plot", help="plot a combined JSON")
    p.add_argument("combined")
    p.add_argument("--png", required=True)
    p.add_argument("--title")
    p.add_argument("--bytes", choices=sorted(BYTES), default="end",
                   help="x: the bytes stored at the stream's end (default) or held on average over its steps")
    c = sub.add_parser("compare", help="a combined JSON per layer: a markdown table and a PNG of bars")
    c.add_argument("combined")
    c.add_argument("--png", required=True)
    c.add_argument("--md", required=True, help="the markdown table")
    c.add_argument("--title")
    a = ap.parse_args(argv)
    if a.cmd == "run":
        entries = run(a.kvforge, a.data, a.schemes, a.peers, a.gpu, a.threads, a.table_dir, out=a.out)
        _write(a.out, entries)  # also when there was nothing to score
        return 0
    entries = load(a.combined)
    if a.cmd == "compare":
        table = compare_table(entries, a.title)
        with open(a.md, "w") as f:
            f.write(table)
        compare_plot(entries, a.png, a.title)
        print(f"wrote {a.md} ({len(layer_rows(entries))} rows) and {a.png}")
        return 0
    fronts = plot(entries, a.png, a.title, a.bytes)
    for metric, names in fronts.items():
        print(f"kvforge front ({metric}): {' -> '.join(names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
