"""A numpy model of docs/FORMAT.md's RTN decode (finite inputs), independent of the
library: what decode(encode(x)) must give, bit for bit."""
import numpy as np

import kvforge


def rtn_roundtrip_bits(x_bits, bits, group_size, mode):
    """x_bits: uint16 BF16 [..., d]. Returns the decoded uint16 BF16 bits."""
    if bits == 16:
        return x_bits.copy()
    x = kvforge.bf16_bits_to_float32(x_bits)
    shp = x.shape
    g = x.reshape(*shp[:-1], shp[-1] // group_size, group_size)
    f32 = np.float32
    if mode == "affine":
        L = f32(2 ** bits - 1)
        mn = g.min(axis=-1, keepdims=True)
        mx = g.max(axis=-1, keepdims=True)
        mn = np.where(mn == 0, f32(0), mn)
        mx = np.where(mx == 0, f32(0), mx)
        s = (mx - mn) / L
        S = s.astype(np.float16).astype(f32)
        M = mn.astype(np.float16).astype(f32)
        with np.errstate(divide="ignore", invalid="ignore"):
            t = (g - M) / S
        q = np.where(S > 0, np.clip(np.rint(t), 0, L), f32(0)).astype(f32) + f32(0)  # no -0
        y = S * q + M  # S*q exact: equals fmaf
    else:
        qmax = f32(2 ** (bits - 1) - 1)
        a = np.abs(g).max(axis=-1, keepdims=True)
        s = a / qmax
        S = s.astype(np.float16).astype(f32)
        with np.errstate(divide="ignore", invalid="ignore"):
            t = g / S
        q = np.where(S > 0, np.clip(np.rint(t), -qmax, qmax), f32(0)).astype(f32) + f32(0)  # no -0
        y = S * q
    return kvforge.float32_to_bf16_bits(y.astype(f32).reshape(shp))


def rtn_bound(x_f32, bits, group_size, mode):
    """Per-element error bound of FORMAT.md: half a step (of the stored scale) plus
    the f16 rounding of the zero/scale and the BF16 rounding of the output."""
    shp = x_f32.shape
    g = x_f32.reshape(*shp[:-1], shp[-1] // group_size, group_size).astype(np.float64)
    if mode == "affine":
        L = 2 ** bits - 1
        s = (g.max(-1, keepdims=True) - g.min(-1, keepdims=True)) / L
        zero_err = np.abs(g.min(-1, keepdims=True)) * 2.0 ** -11
    else:
        L = 2 ** (bits - 1) - 1
        s = np.abs(g).max(-1, keepdims=True) / L
        zero_err = 0
    scale_err = s * 2.0 ** -11 * L
    b = s / 2 + zero_err + scale_err + np.abs(g) * 2.0 ** -8 + 1e-30
    return np.broadcast_to(b, g.shape).reshape(shp)
