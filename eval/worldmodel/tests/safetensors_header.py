"""Read a safetensors file with the standard library alone (header JSON + raw bytes)."""
import json
import struct

DTYPE_SIZE = {"BF16": 2, "F16": 2, "F32": 4, "I32": 4, "I64": 8, "U8": 1, "F64": 8}


def read_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        hdr = json.loads(f.read(n))
    return hdr.pop("__metadata__", {}), hdr, 8 + n


def read_raw(path, entry, base):
    a, b = entry["data_offsets"]
    with open(path, "rb") as f:
        f.seek(base + a)
        return f.read(b - a)
