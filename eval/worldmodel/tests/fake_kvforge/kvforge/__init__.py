"""A stand-in for the kvforge Python binding, for the world-model tests only.

It has the binding's QuantizedKVCache interface (scheme, num_layers, num_kv_heads,
head_dim, device=..., num_q_heads=...; append(layer, k, v, q=None, positions=None);
keys_values(layer) -> (K, V) BF16 [Hkv, N, d]; num_tokens; nbytes;
compression_ratio; info.rope_placement) and quantizes per token, affine, in
groups of 32 channels, to the bit width in the scheme's name ("..._int2" -> 2).
A name containing "pre" caches keys before RoPE and rotates them on read
(sections 16/24/24 scaled to head_dim, theta 10000, layout "half").
It records how many queries it was given, so tests can check they arrive.
"""
import math
import os
import re

import torch


class _Info:
    def __init__(self, placement):
        self.rope_placement = placement


def _rtn(x, bits, g=32):
    h, n, d = x.shape
    xf = x.float().reshape(h, n, d // g, g)
    lo, hi = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
    s = (hi - lo).clamp_min(1e-8) / (2 ** bits - 1)
    q = torch.round((xf - lo) / s).clamp(0, 2 ** bits - 1)
    return (q * s + lo).reshape(h, n, d).to(torch.bfloat16)


def _rope(k, pos, theta=10000.0):
    d = k.shape[-1]
    half = d // 2
    secs = [half // 4, (half - half // 4) // 2]
    secs.append(half - sum(secs))
    axes, inv = [], []
    for a, n in enumerate(secs):
        for p in range(n):
            axes.append(a)
            inv.append(2.0 ** (-(2.0 * p / (2 * n)) * math.log2(theta)))
    inv = torch.tensor(inv, dtype=torch.float64).float().to(k.device)
    ang = pos[:, axes].float() * inv[None]
    c, s = torch.cos(ang), torch.sin(ang)
    x = k.float()
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * c - b * s, a * s + b * c], -1).to(torch.bfloat16)


class QuantizedKVCache:
    def __init__(self, scheme, num_layers, num_kv_heads, head_dim=None, *, device=None, num_q_heads=None, **kw):
        name = os.path.basename(str(scheme))
        m = re.search(r"int(\d+)", name)
        if not m:
            raise ValueError(f"fake kvforge: no bit width in scheme name {scheme!r}")
        self.bits = int(m.group(1))
        self.info = _Info("pre" if "pre" in name else "post")
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self._k = [[] for _ in range(num_layers)]
        self._v = [[] for _ in range(num_layers)]
        self._pos = [[] for _ in range(num_layers)]
        self.queries_seen = 0

    def append(self, layer, k, v, q=None, positions=None):
        assert k.dtype == torch.bfloat16 and v.dtype == torch.bfloat16 and k.dim() == 3
        if (self.info.rope_placement == "pre") != (positions is not None):
            raise ValueError("positions are for 'pre' schemes only, and required there")
        self._k[layer].append(_rtn(k, self.bits))
        self._v[layer].append(_rtn(v, self.bits))
        self._pos[layer].append(positions)
        if q is not None:
            assert q.dtype == torch.bfloat16
            self.queries_seen += q.shape[0] * q.shape[1]

    def num_tokens(self, layer=0):
        return sum(t.shape[1] for t in self._k[layer])

    def keys_values(self, layer):
        ks = self._k[layer]
        if self.info.rope_placement == "pre":
            ks = [_rope(k, p) for k, p in zip(ks, self._pos[layer])]
        return torch.cat(ks, 1), torch.cat(self._v[layer], 1)

    @property
    def nbytes(self):
        n = sum(self.num_tokens(l) for l in range(len(self._k)))
        return int(2 * n * self.num_kv_heads * self.head_dim * (self.bits / 8 + 2 * 2 / 32))

    @property
    def compression_ratio(self):
        n = sum(self.num_tokens(l) for l in range(len(self._k)))
        return 2 * n * self.num_kv_heads * self.head_dim * 2 / max(1, self.nbytes)
