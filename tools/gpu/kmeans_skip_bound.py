#!/usr/bin/env python3
"""Could the second Lloyd assignment skip tokens whose label cannot change?

An estimate on the world-model dump (eval/worldmodel/kv_small.safetensors),
in f64 with numpy, of how many tokens a Hamerly-style bound would let the
second assignment skip: a token keeps its label z1 when its distance to
the moved centroid z1 is below (its second-nearest distance in the first
assignment) - (the largest shift of any other centroid). The init is a
strided sample of the tokens (kvforge's, with offset 0), C = 256 as
qvg_int2. Prints, per tensor and head, the fraction of labels that change,
the shifts, the nearest/second-nearest gap, and the skippable tokens and
whole 16-token tiles (the assignment's unit of work).
Usage: .venv/bin/python tools/gpu/kmeans_skip_bound.py [DUMP] (its figures:
docs/journal/benchmarks.md, entry c54bcd7)."""
import json
import struct
import sys

import numpy as np

C, TILE = 256, 16


def tensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        blob = f.read()
    for name, m in sorted(head.items()):
        if name == "__metadata__" or not name.endswith((".k", ".v")) or m["dtype"] != "BF16":
            continue
        a, b = m["data_offsets"]
        bits = np.frombuffer(blob[a:b], dtype=np.uint16).astype(np.uint32) << 16
        yield name, bits.view(np.float32).reshape(m["shape"]).astype(np.float64)


def sq_dists(x, mu):
    return np.maximum((x * x).sum(1)[:, None] - 2 * x @ mu.T + (mu * mu).sum(1)[None, :], 0)


def head_stats(x):
    n = len(x)
    mu = x[(np.arange(C) * n) // C]
    d = sq_dists(x, mu)
    z1 = d.argmin(1)
    s = np.sqrt(np.sort(d, 1)[:, :2])
    new = mu.copy()
    for j in range(C):
        if (z1 == j).any():
            new[j] = x[z1 == j].mean(0)
    shift = np.sqrt(((new - mu) ** 2).sum(1))
    d2 = sq_dists(x, new)
    z2 = d2.argmin(1)
    own = np.sqrt(d2[np.arange(n), z1])
    top = np.argsort(-shift)
    other = np.where(z1 == top[0], shift[top[1]], shift[top[0]])  # largest shift of a centroid other than z1
    skip = own < s[:, 1] - other
    assert not (skip & (z1 != z2)).any()  # the bound holds: a skipped token keeps its label
    tiles = skip[: n // TILE * TILE].reshape(-1, TILE).all(1)
    return (z1 != z2).mean(), shift.max(), np.median(shift), np.median(s[:, 1] - s[:, 0]), skip.mean(), tiles.mean()


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "eval/worldmodel/kv_small.safetensors"
    print("tensor head tokens labels_changed shift_max shift_median gap_median skippable_tokens skippable_tiles")
    for name, x in tensors(path):
        for h in range(x.shape[0]):
            ch, smax, smed, gap, tok, til = head_stats(x[h])
            print(f"{name} {h} {x.shape[1]} {ch:.3f} {smax:.3g} {smed:.3g} {gap:.3g} {tok:.3f} {til:.3f}")


if __name__ == "__main__":
    main()
