#!/usr/bin/env python3
"""How often would the fast k-means assignment's index differ from the f64 one?

A model, not the hardware: the fast assignment (templates/kvf_kmeans.cuh,
`assign_fast`) picks the smallest h_j = N_j / 2 - <x, mu_j> as the tensor
cores compute it: the chain starts from f32(N_j) / 2 and each m16n8k16 mma
adds its 16 exact products, the sum truncated to f32 (the error model of
docs/METHODS.md section 3, step 2). The CPU reference picks the smallest f64
N_j - 2 <x, mu_j> (ties to the lower j on both sides). This runs a k-means
like qvg_int2's (C = 256, a strided sample from offset 0 as the start, two
Lloyd steps, means rounded to BF16, the last step's labels) both ways on each
head of the world-model dump's keys and values, and on 1560 x 128 of
test_gpu's random rows, and prints the share of labels that differ and the
relative change of the centroid error. docs/METHODS.md ("Fast assignment")
quotes its output; on a GPU test_gpu's gpu_fast_assign measures the same.
Usage: .venv/bin/python tools/gpu/fast_assign_model.py [DUMP]"""
import sys

import numpy as np

from kmeans_skip_bound import tensors

C = 256


def bf16(x):
    """Round to BF16 (nearest, ties to even) and back."""
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16
    return b.astype(np.uint32).view(np.float32).astype(np.float64)


def to_f32_toward_zero(v):
    f = v.astype(np.float32)
    over = np.abs(f.astype(np.float64)) > np.abs(v)
    f[over] = np.nextafter(f[over], np.float32(0))
    return f.astype(np.float64)


def exact_labels(x, mu):
    return ((mu * mu).sum(1)[None, :] - 2 * (x @ mu.T)).argmin(1)


def fast_labels(x, mu):
    h = np.broadcast_to((mu * mu).sum(1).astype(np.float32).astype(np.float64) * 0.5, (len(x), len(mu)))
    h = to_f32_toward_zero(h.copy())
    for k in range(0, x.shape[1], 16):
        h = to_f32_toward_zero(h - x[:, k:k + 16] @ mu[:, k:k + 16].T)
    return h.argmin(1)


def kmeans(x, labels, iters=2):
    mu = x[(np.arange(C) * len(x)) // C].copy()
    for _ in range(iters):
        z = labels(x, mu)
        new = mu.copy()
        for j in range(C):
            m = z == j
            if m.any():
                new[j] = bf16(x[m].mean(0))
        mu = new
    return z, mu


def compare(name, x):
    ze, me = kmeans(x, exact_labels)
    zf, mf = kmeans(x, fast_labels)
    once = (fast_labels(x, me) != exact_labels(x, me)).mean()
    ee, ef = ((x - me[ze]) ** 2).mean(), ((x - mf[zf]) ** 2).mean()
    print(f"{name}: {len(x)} tokens, labels differ {100 * (ze != zf).mean():.4f}% (one assignment against the "
          f"same centroids: {100 * once:.4f}%), centroid MSE change {100 * (ef - ee) / ee:+.4f}%", flush=True)


def random_rows(n, seed):
    """test_gpu.c random_bf16: values in [-8, 8) in steps of 1/4096, one in 256 times 40, rounded to BF16."""
    out, s, m = np.empty(n), (seed * 2654435761 + 1) % 2**64, 2**64
    for i in range(n):
        s = (s * 6364136223846793005 + 1442695040888963407) % m
        v = ((s >> 40) & 0xFFFF) / 4096.0 - 8.0
        out[i] = v * 40.0 if ((s >> 20) & 255) == 7 else v
    return bf16(out)


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "eval/worldmodel/kv_small.safetensors"
    for name, t in tensors(path):
        for h in range(t.shape[0]):
            compare(f"{name} head {h}", t[h])
    compare("random rows (test_gpu, K of 1560 tokens)", random_rows(1560 * 128, 11 + 1560).reshape(1560, 128))


if __name__ == "__main__":
    main()
