"""Peer codecs for the CPU tests: numpy on BF16 bits, the shape of QVG's states."""
import numpy as np

import stio
from peerkv import count_state
from qvg_codec import PARTS


class NumpyCodec:
    """Native arrays are uint16 BF16 bits [H, S, d]."""

    def native(self, x):
        return np.ascontiguousarray(x, dtype=np.uint16)

    def from_bits(self, bits):
        return np.array(bits, dtype=np.uint16)

    def to_bits(self, x):
        return np.ascontiguousarray(x, dtype=np.uint16)

    def cat(self, xs):
        return np.concatenate(xs, axis=1)

    def chunk_bytes(self, x):
        return int(x.nbytes)

    def state_bytes(self, state):
        return count_state(state, PARTS)


class IdentityCodec(NumpyCodec):
    """Stores the BF16 bits as they are: lossless, 2 bytes a value."""

    def __init__(self):
        self.compressed = 0

    def compress(self, k, v):
        self.compressed += 1
        return {"raw": k.copy(), "info": "x"}, {"raw": v.copy(), "info": "x"}

    def decompress(self, sk, sv):
        return sk["raw"].copy(), sv["raw"].copy()


class RtnCodec(NumpyCodec):
    """A QVG-shaped lossy codec: one "centroid" (the span's mean per head), the residual
    quantized per token in groups of g to symmetric INT2 {-1, 0, 1} with FP16 scales,
    codes packed 4 a byte, cluster ids all 0."""

    def __init__(self, group=64):
        self.g = group

    def _one(self, x):
        f = stio.bf16_bits_to_f32(x)
        H, S, d = f.shape
        c = f.mean(axis=1, keepdims=True).astype(np.float16)
        r = (f - c.astype(np.float32)).reshape(H, S, d // self.g, self.g)
        s = np.maximum(np.abs(r).max(axis=-1), 1e-6).astype(np.float16)
        q = np.clip(np.rint(r / s.astype(np.float32)[..., None]), -1, 1).astype(np.int8) + 1
        q = q.reshape(H, S, d // 4, 4).astype(np.uint8)
        codes = (q[..., 0] << 6) | (q[..., 1] << 4) | (q[..., 2] << 2) | q[..., 3]
        return {"centroids_list": [c], "cluster_ids_list": [np.zeros((H, S), np.uint8)],
                "residual_quant": codes, "scales": s, "zeros": None, "info": {"g": self.g}}

    def compress(self, k, v):
        return self._one(k), self._one(v)

    def _dec(self, st):
        codes = st["residual_quant"]
        q = np.stack([(codes >> 6) & 3, (codes >> 4) & 3, (codes >> 2) & 3, codes & 3], -1).astype(np.float32) - 1
        H, S = codes.shape[:2]
        q = q.reshape(H, S, -1, self.g) * st["scales"].astype(np.float32)[..., None]
        f = q.reshape(H, S, -1) + st["centroids_list"][0].astype(np.float32)
        return stio.f32_to_bf16_bits(f)

    def decompress(self, sk, sv):
        return self._dec(sk), self._dec(sv)


def write_dump(path, layers=2, chunks=4, tokens=64, kv_heads=2, q_heads=4, queries=16, d=128, seed=0):
    """A small kvforge KV dump (post-RoPE keys only); returns {(l, c): (q, k, v)} float32."""
    rng = np.random.default_rng(seed)
    tensors, data = [], {}
    for l in range(layers):
        for c in range(chunks):
            scale = rng.uniform(0.5, 1.5, size=(kv_heads, tokens, 1))
            k = rng.standard_normal((kv_heads, tokens, d)) * scale
            k[:, :, 3] += 4.0  # an outlier channel
            v = rng.standard_normal((kv_heads, tokens, d))
            q = rng.standard_normal((q_heads, queries, d)) + 0.3 * np.repeat(k[:, :queries], q_heads // kv_heads, 0)
            bits = [stio.f32_to_bf16_bits(x.astype(np.float32)) for x in (q, k, v)]
            data[(l, c)] = tuple(stio.bf16_bits_to_f32(b) for b in bits)
            for r, b in zip("qkv", bits):
                tensors.append((f"l{l}.c{c}.{r}", b, "BF16"))
    meta = {"layers": layers, "chunks": chunks, "q_heads": q_heads, "kv_heads": kv_heads, "head_dim": d,
            "tokens_per_chunk": tokens, "rope_theta": "10000", "rope_sections": "[16, 24, 24]",
            "source": "eval/peer/tests (synthetic)"}
    stio.write(path, tensors, meta)
    return data
