"""RoPE in Python for the BF16 chunks a QuantizedKVCache holds (rope.placement = "pre").

The cache of a "pre" scheme stores keys before RoPE; kvf_decode applies RoPE to
the packed spans, and this applies the same rotation (docs/METHODS.md section 6)
to the sink and recent chunks that are still BF16, so keys_values() returns
rotated keys throughout. f32 arithmetic as METHODS.md; sin/cos may differ from
the library's by an ulp (the contract's 2-bf16-ulp tolerance).
"""
from __future__ import annotations

import math


def _inv_freq(head_dim, sections, theta):
    """Per pair p = 0..d/2-1: (axis, f32 inverse frequency) as python lists."""
    axes, inv = [], []
    for a, n in enumerate(sections):
        d_a = 2 * n
        for p_a in range(n):
            axes.append(a)
            inv.append(2.0 ** (-(2.0 * p_a / d_a) * math.log2(theta)))
    if len(inv) != head_dim // 2:
        raise ValueError(f"rope.sections {tuple(sections)} sum to {len(inv)} pairs, head_dim/2 = {head_dim // 2}")
    return axes, inv


def _pairs(head_dim, layout):
    h = head_dim // 2
    if layout == "interleaved":
        return list(range(0, head_dim, 2)), list(range(1, head_dim, 2))
    return list(range(h)), list(range(h, head_dim))


def rope_numpy(k_bits, positions, info):
    """k_bits: uint16 [H, N, d] BF16 bits; positions int32 [N, A]. Returns new uint16 bits."""
    import numpy as np
    from ._bf16 import bf16_bits_to_float32, float32_to_bf16_bits
    d = info.head_dim
    axes, inv = _inv_freq(d, info.rope_sections, info.rope_theta)
    inv = np.asarray(inv, dtype=np.float64).astype(np.float32)
    pos = positions[:, axes].astype(np.float32)            # [N, d/2]
    ang = pos * inv[None, :]                               # f32 products
    c, s = np.cos(ang), np.sin(ang)                        # f32
    x = bf16_bits_to_float32(k_bits)
    i0, i1 = _pairs(d, info.rope_layout)
    a, b = x[..., i0], x[..., i1]
    y = np.empty_like(x)
    y[..., i0] = a * c - b * s
    y[..., i1] = a * s + b * c
    return float32_to_bf16_bits(y)


def rope_torch(k, positions, info):
    """k: torch.bfloat16 [H, N, d]; positions int32 [N, A] on its device. New bf16 tensor."""
    import torch
    d = info.head_dim
    axes, inv = _inv_freq(d, info.rope_sections, info.rope_theta)
    inv_t = torch.tensor(inv, dtype=torch.float64).to(torch.float32).to(k.device)
    pos = positions[:, torch.tensor(axes, device=k.device)].to(torch.float32)
    ang = pos * inv_t[None, :]
    c, s = torch.cos(ang), torch.sin(ang)
    x = k.to(torch.float32)
    i0, i1 = _pairs(d, info.rope_layout)
    i0, i1 = torch.tensor(i0, device=k.device), torch.tensor(i1, device=k.device)
    a, b = x[..., i0], x[..., i1]
    y = torch.empty_like(x)
    y[..., i0] = a * c - b * s
    y[..., i1] = a * s + b * c
    return y.to(torch.bfloat16)
