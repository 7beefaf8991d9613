#!/usr/bin/env python3
"""How the k-means warm start (kvf_encode_warm) changes the round-trip error
on real footage: chunk 1 of each layer of a world-model KV dump encoded from a
cold start and warm-started from chunk 0's packed cache, on the CPU reference.
Prints, per scheme and tensor, the relative MSE sum (x - x_hat)^2 / sum x^2
over the layer's heads (keys after RoPE, as the dump's "k").
Usage: PYTHONPATH=python KVFORGE_LIB=out/lib/libkvforge.so \\
    .venv/bin/python tools/gpu/warm_start_quality.py [DUMP] [SCHEME ...]
(docs/METHODS.md section 3 records its output for eval/worldmodel/kv_small.safetensors)."""
import json
import struct
import sys

import numpy as np

import kvforge


def tensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        head = json.loads(f.read(n))
        blob = f.read()
    out = {}
    for name, m in head.items():
        if name == "__metadata__" or m["dtype"] != "BF16":
            continue
        a, b = m["data_offsets"]
        out[name] = np.frombuffer(blob[a:b], dtype=np.uint16).reshape(m["shape"])
    return out


def rel_mse(x, y):
    x, y = kvforge.bf16_bits_to_float32(x).astype(np.float64), kvforge.bf16_bits_to_float32(y).astype(np.float64)
    return float(((x - y) ** 2).sum() / (x ** 2).sum())


def main():
    args = sys.argv[1:]
    path = args.pop(0) if args and args[0].endswith(".safetensors") else "eval/worldmodel/kv_small.safetensors"
    schemes = args or ["qvg_int2", "qvg_int4", "quantwm_int2"]
    t = tensors(path)
    layers = sorted({k.split(".")[0] for k in t if k.startswith("l")})
    print(f"{path}: layers {', '.join(layers)}; chunk 1 after chunk 0 (CPU reference, no query statistics)")
    print(f"{'scheme':14s} {'layer':5s} {'K cold':>9s} {'K warm':>9s} {'V cold':>9s} {'V warm':>9s}")
    for name in schemes:
        ctx = kvforge.Context(name)
        for layer in layers:
            k0, v0 = t[f"{layer}.c0.k"], t[f"{layer}.c0.v"]
            k1, v1 = t[f"{layer}.c1.k"], t[f"{layer}.c1.v"]
            h, n = k1.shape[0], k1.shape[1]
            p0 = ctx.encode(k0, v0)
            res = []
            for warm in (None, p0):
                p1 = ctx.encode(k1, v1) if warm is None else ctx.encode(k1, v1, warm_from=p0, warm_tokens=k0.shape[1])
                kd, vd = ctx.decode(p1, n, h, bits=True)
                res.append((rel_mse(k1, kd), rel_mse(v1, vd)))
            print(f"{name:14s} {layer:5s} {res[0][0]:9.5f} {res[1][0]:9.5f} {res[0][1]:9.5f} {res[1][1]:9.5f}")


if __name__ == "__main__":
    main()
