"""Safetensors files as numpy arrays, BF16 included (as its uint16 bits).

numpy has no bfloat16, and the safetensors package's numpy API refuses BF16
tensors, so the KV dumps (docs/QUALITY.md "Dump format") and the recon files
the harness writes ("Scoring a peer's cache") are read and written here: an
8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}, "__metadata__": {str: str}}, then the data. Reading maps the
file; arrays are read-only views into it.
"""
from __future__ import annotations

import json
import mmap
import struct

import numpy as np

DTYPES = {"BF16": np.dtype("<u2"), "F16": np.dtype("<f2"), "F32": np.dtype("<f4"), "F64": np.dtype("<f8"),
          "U8": np.dtype("u1"), "I8": np.dtype("i1"), "I16": np.dtype("<i2"), "I32": np.dtype("<i4"),
          "I64": np.dtype("<i8"), "U16": np.dtype("<u2"), "U32": np.dtype("<u4"), "U64": np.dtype("<u8"),
          "BOOL": np.dtype("?")}
_NP_TO_ST = {np.dtype("<f2"): "F16", np.dtype("<f4"): "F32", np.dtype("<f8"): "F64", np.dtype("u1"): "U8",
             np.dtype("i1"): "I8", np.dtype("<i2"): "I16", np.dtype("<i4"): "I32", np.dtype("<i8"): "I64",
             np.dtype("<u4"): "U32", np.dtype("<u8"): "U64", np.dtype("?"): "BOOL"}


class SafetensorsFile:
    """A mapped safetensors file: .metadata (dict of str), .entries (name -> header entry),
    .get(name) -> numpy array (BF16 as uint16 bits), .dtype(name) -> the file's dtype string."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if len(self._map) < 8:
            raise ValueError(f"{path}: too short for a safetensors file")
        (n,) = struct.unpack("<Q", self._map[:8])
        if n > len(self._map) - 8:
            raise ValueError(f"{path}: header length {n} runs past the end of the file")
        header = json.loads(bytes(self._map[8:8 + n]))
        self.metadata = header.pop("__metadata__", {}) or {}
        self.entries = header
        self._base = 8 + n

    def dtype(self, name: str) -> str:
        return self.entries[name]["dtype"]

    def get(self, name: str) -> np.ndarray:
        e = self.entries[name]
        a, b = e["data_offsets"]
        dt = DTYPES[e["dtype"]]
        return np.frombuffer(self._map, dtype=dt, count=(b - a) // dt.itemsize,
                             offset=self._base + a).reshape(e["shape"])

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def close(self):
        self._map.close()


def write(path: str, tensors, metadata: dict | None = None) -> None:
    """Write (name, array, dtype) triples in that order; dtype "BF16" takes uint16 bits, None
    takes the array's own dtype. Metadata values are written as strings."""
    header, off, items = {}, 0, []
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    for name, arr, dtype in tensors:
        arr = np.ascontiguousarray(arr)
        if dtype == "BF16":
            if arr.dtype != np.uint16:
                raise TypeError(f"{name}: BF16 data must be uint16 bits, got {arr.dtype}")
            arr = arr.astype("<u2", copy=False)
        else:
            dtype = dtype or _NP_TO_ST[arr.dtype.newbyteorder("<") if arr.dtype.byteorder == ">" else arr.dtype]
            arr = arr.astype(DTYPES[dtype], copy=False)
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + arr.nbytes]}
        off += arr.nbytes
        items.append(arr)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for arr in items:
            f.write(arr.tobytes())


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bits, round to nearest even (NaN kept NaN)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        r[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return r


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
