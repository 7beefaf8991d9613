"""BF16 on the CPU with numpy, which has no bfloat16 dtype.

BF16 values travel as ``numpy.uint16`` arrays holding the bits (the top half
of an IEEE binary32). float32 arrays are converted with round-to-nearest-even,
NaNs made quiet, exactly as the library's ``kvf_f32_to_bf16`` and the GPU's
``cvt.rn.bf16.f32``.
"""
from __future__ import annotations

import numpy as np

__all__ = ["float32_to_bf16_bits", "bf16_bits_to_float32"]


def float32_to_bf16_bits(x) -> np.ndarray:
    """float32 array -> uint16 BF16 bits (round to nearest even; same shape, C order)."""
    a = np.asarray(x)
    if a.dtype != np.float32:
        raise TypeError(f"float32_to_bf16_bits: expected a float32 array, got {a.dtype}")
    u = np.ascontiguousarray(a).view(np.uint32)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    r = (u + (np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16)
    if nan.any():
        r = np.where(nan, (u >> np.uint32(16)) | np.uint32(0x0040), r)
    return r.astype(np.uint16)


def bf16_bits_to_float32(b) -> np.ndarray:
    """uint16 BF16 bits -> float32 (exact)."""
    a = np.asarray(b)
    if a.dtype != np.uint16:
        raise TypeError(f"bf16_bits_to_float32: expected a uint16 array of BF16 bits, got {a.dtype}")
    return (a.astype(np.uint32) << np.uint32(16)).view(np.float32)
