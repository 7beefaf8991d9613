#!/usr/bin/env python3
"""How many tokens and 16-token tiles take the assignment's slow path?

The GPU assignment (templates/kvf_kmeans.cuh, `assign`) settles a token in
registers when the tensor-core filter leaves it exactly one candidate: the
centroids j with h_j <= min h + B, h_j = |mu_j|^2 / 2 - <a, mu_j> and
B = KAPPA (|a| max|mu| + max|mu|^2), KAPPA = 2^-12 (`filter_bound`). A token
with two or more candidates takes the f64 path, and the whole 16-token tile
(one warp) waits for it. This estimates both fractions on the world-model
dump (eval/worldmodel/kv_small.safetensors) in f64 with numpy, from the exact
h_j (the filter's keys are within B / 2 of them, so the GPU's counts can
differ slightly), for the two assignments of qvg_int2's k-means: against the
init (a strided sample of the tokens, kvforge's with offset 0) and against
the centroids after one Lloyd update, C = 256, centroids rounded to BF16 as
kvforge stores them.
Usage: .venv/bin/python tools/gpu/assign_candidates.py [DUMP]"""
import sys

import numpy as np

from kmeans_skip_bound import C, TILE, tensors

KAPPA = 2.0 ** -12


def bf16(x):
    """Round f64 values to BF16 (nearest, ties to even) and back."""
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16
    return b.astype(np.uint32).view(np.float32).astype(np.float64)


def candidates(x, mu):
    """Per token: the filter's candidate count against centroids mu, and the labels."""
    nn = (mu * mu).sum(1)
    h = nn[None, :] / 2 - x @ mu.T
    an = np.sqrt((x * x).sum(1))
    b = KAPPA * (an * np.sqrt(nn).max() + nn.max())
    return (h <= h.min(1, keepdims=True) + b[:, None]).sum(1), h.argmin(1)


def head_stats(x):
    n = len(x)
    mu = bf16(x[(np.arange(C) * n) // C])
    out = []
    for _ in range(2):
        cand, z = candidates(x, mu)
        slow = cand >= 2
        tiles = np.pad(slow, (0, -n % TILE)).reshape(-1, TILE).any(1)
        out.append((cand.mean(), slow.mean(), tiles.mean()))
        new = mu.copy()
        for j in range(C):
            if (z == j).any():
                new[j] = bf16(x[z == j].mean(0))
        mu = new
    return out


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "eval/worldmodel/kv_small.safetensors"
    print("tensor head tokens | assignment 1: candidates/token slow_tokens slow_tiles | assignment 2: the same")
    for name, x in tensors(path):
        for h in range(x.shape[0]):
            (c1, s1, t1), (c2, s2, t2) = head_stats(x[h])
            print(f"{name} {h} {x.shape[1]} | {c1:.3f} {s1:.4f} {t1:.3f} | {c2:.3f} {s2:.4f} {t2:.3f}")


if __name__ == "__main__":
    main()
