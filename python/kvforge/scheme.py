"""Schemes: loading, their configuration, packed sizes."""
from __future__ import annotations

import ctypes
import os
import weakref
from ctypes import byref, c_size_t, c_void_p
from dataclasses import dataclass, field

from . import _lib
from ._lib import KvfChunkStep, KvfFootprint, KvfSchemeInfo, check, cstr, lib

__all__ = ["ChunkStep", "Scheme", "SchemeInfo", "load_scheme", "builtin_schemes"]

ROPE_PLACEMENTS = ("none", "pre", "post")
ROPE_LAYOUTS = ("half", "interleaved")


@dataclass(frozen=True)
class SchemeInfo:
    """What the binding needs to know of a scheme (kvf_scheme_info)."""
    head_dim: int
    key_bits: int
    value_bits: int
    chunk_tokens: int
    chunk_span: int
    chunk_recent: int
    chunk_sink: int
    rope_placement: str          # "none", "pre", "post"
    rope_axes: int               # position axes decode needs (1 = 1D RoPE)
    psac_rank: int
    key_centroids: int
    key_qsac_candidates: int
    rope_layout: str = "half"
    rope_theta: float = 10000.0
    rope_sections: tuple = field(default=())  # frequency pairs per axis (sum = head_dim / 2)

    @property
    def reads_qstats(self) -> bool:
        """Whether encode reads query statistics (QSAC or PSAC keys)."""
        return self.key_qsac_candidates > 1 or self.psac_rank > 0


@dataclass(frozen=True)
class ChunkStep:
    """What the chunk policy does after chunk t of a layer (kvf_chunk_policy).

    sink: chunk t stays BF16 for ever. pack_first, pack_chunks: the span of
    chunks to pack now (pack_chunks 0: none), with the layer's query statistics
    as they are now (before chunk t's queries are added). warm_first,
    warm_chunks: the layer's previous packed span, which a warm-started encode
    starts its k-means from (warm_chunks 0: none).
    """
    sink: bool
    pack_first: int
    pack_chunks: int
    warm_first: int
    warm_chunks: int


def _info_from_c(ci: KvfSchemeInfo) -> SchemeInfo:
    axes = ci.rope_axes  # >= 1, and rope_sections filled for 1-D RoPE too (kvforge.h)
    sections = tuple(ci.rope_sections[i] for i in range(min(axes, _lib.KVF_MAX_ROPE_SECTIONS)))
    return SchemeInfo(
        head_dim=ci.head_dim, key_bits=ci.key_bits, value_bits=ci.value_bits,
        chunk_tokens=ci.chunk_tokens, chunk_span=ci.chunk_span, chunk_recent=ci.chunk_recent,
        chunk_sink=ci.chunk_sink,
        rope_placement=ROPE_PLACEMENTS[ci.rope_placement] if 0 <= ci.rope_placement < 3 else "none",
        rope_axes=axes, psac_rank=ci.psac_rank, key_centroids=ci.key_centroids,
        key_qsac_candidates=ci.key_qsac_candidates,
        rope_layout=ROPE_LAYOUTS[ci.rope_layout] if ci.rope_layout in (0, 1) else "half",
        rope_theta=ci.rope_theta, rope_sections=sections)


# ------------------------------------------------------------------- Scheme


class _InfoBuffer(ctypes.Union):
    _fields_ = [("info", KvfSchemeInfo), ("spare", ctypes.c_char * 1024)]


def _load_builtin(name: str):
    """(kvf_scheme pointer, source text) of a shipped scheme."""
    out = c_void_p()
    check(lib().kvf_scheme_load_builtin(name.encode(), byref(out)), "kvf_scheme_load_builtin")
    return out, f"<builtin>/{name}.lua"


def _free_scheme(L, ptr):
    try:
        L.kvf_scheme_free(ptr)
    except Exception:  # pragma: no cover - interpreter shutdown
        pass


class Scheme:
    """A loaded scheme (``kvf_scheme``).

    ``Scheme("schemes/rtn_int2.lua")`` loads a file; ``Scheme("rtn_int2")`` a
    scheme shipped inside the library (a string with no ``/`` and no ``.lua``
    that is not an existing file); :meth:`from_string` loads Lua text.
    """

    def __init__(self, source, *, _ptr=None, _origin=None):
        if isinstance(source, Scheme):
            raise TypeError("Scheme(scheme): pass the Scheme itself, no copy is needed")
        L = lib()
        if _ptr is None:
            if not isinstance(source, (str, os.PathLike)):
                raise TypeError(f"Scheme: expected a path or a shipped scheme's name, got "
                                f"{type(source).__name__}")
            s = os.fspath(source)
            if os.path.exists(s) or s.endswith(".lua") or os.sep in s:
                _ptr = c_void_p()
                check(L.kvf_scheme_load(s.encode(), byref(_ptr)), "kvf_scheme_load")
                _origin = s
            else:
                _ptr, _origin = _load_builtin(s)
        self._ptr = _ptr
        self.source = _origin
        self._finalizer = weakref.finalize(self, _free_scheme, L, _ptr)
        self._info = None
        # Kept as a plain attribute: torch.compile traces `scheme.id` without a C call.
        self._id = cstr(L.kvf_scheme_id(_ptr))
        _by_id.setdefault(self._id, self)

    @classmethod
    def from_string(cls, text: str, chunkname: str | None = None) -> "Scheme":
        """Load Lua text; ``chunkname`` names it in messages (``"@file.lua"``, ``"=name"``)."""
        if not isinstance(text, str):
            raise TypeError(f"Scheme.from_string: text must be str, got {type(text).__name__}")
        L = lib()
        b = text.encode()
        out = c_void_p()
        check(L.kvf_scheme_load_string(b, len(b), chunkname.encode() if chunkname else None,
                                       byref(out)), "kvf_scheme_load_string")
        return cls(None, _ptr=out, _origin=chunkname or "<string>")

    @classmethod
    def builtin(cls, name: str) -> "Scheme":
        ptr, origin = _load_builtin(name)
        return cls(None, _ptr=ptr, _origin=origin)

    # ----------------------------------------------------------- properties
    @property
    def name(self) -> str:
        return cstr(lib().kvf_scheme_name(self._ptr))

    @property
    def id(self) -> str:
        """name_xxxxxxxx: the name and the hash of the canonical configuration."""
        return self._id

    @property
    def hash(self) -> int:
        return int(lib().kvf_scheme_hash(self._ptr))

    @property
    def canonical(self) -> str:
        return cstr(lib().kvf_scheme_canonical(self._ptr))

    @property
    def head_dim(self) -> int:
        return int(lib().kvf_scheme_head_dim(self._ptr))

    @property
    def info(self) -> SchemeInfo:
        """Chunk policy, bits, RoPE placement... (kvf_scheme_get_info)."""
        if self._info is None:
            # Room to spare: a library whose struct grew fields at its end
            # cannot write past this buffer.
            buf = _InfoBuffer()
            ci = ctypes.cast(ctypes.pointer(buf), ctypes.POINTER(KvfSchemeInfo))
            check(lib().kvf_scheme_get_info(self._ptr, ci), "kvf_scheme_get_info")
            self._info = _info_from_c(ci.contents)
        return self._info

    def chunk_step(self, t: int) -> ChunkStep:
        """The chunk policy after chunk t (0-based) of a layer is appended (kvf_chunk_policy)."""
        st = KvfChunkStep()
        check(lib().kvf_chunk_policy(self._ptr, int(t), byref(st)), "kvf_chunk_policy")
        return ChunkStep(sink=bool(st.sink), pack_first=st.pack_first, pack_chunks=st.pack_chunks,
                         warm_first=st.warm_first, warm_chunks=st.warm_chunks)

    def packed_size(self, n_tokens: int, n_heads: int) -> int:
        """Bytes of the packed K and V of n_tokens x n_heads (kvf_packed_size)."""
        n = c_size_t()
        check(lib().kvf_packed_size(self._ptr, int(n_tokens), int(n_heads), byref(n)),
              "kvf_packed_size")
        return n.value

    def footprint(self, n_tokens: int, n_heads: int) -> dict:
        f = KvfFootprint()
        check(lib().kvf_footprint_of(self._ptr, int(n_tokens), int(n_heads), byref(f)),
              "kvf_footprint_of")
        return {"packed_bytes": f.packed_bytes, "bf16_bytes": f.bf16_bytes,
                "compression": f.compression, "bits_per_value": f.bits_per_value}

    def qstats_size(self, n_kv_heads: int) -> int:
        """Bytes of one layer's query statistics (kvf_qstats_size)."""
        n = c_size_t()
        check(lib().kvf_qstats_size(self._ptr, int(n_kv_heads), byref(n)), "kvf_qstats_size")
        return n.value

    def check_packed(self, header, n_tokens: int, n_heads: int) -> None:
        """kvf_packed_check on a host buffer (numpy uint8, bytes) holding the first >= 64 bytes."""
        import numpy as np
        h = np.ascontiguousarray(np.frombuffer(bytes(header), dtype=np.uint8)
                                 if isinstance(header, (bytes, bytearray)) else header)
        check(lib().kvf_packed_check(self._ptr, h.ctypes.data, h.nbytes, int(n_tokens),
                                     int(n_heads)), "kvf_packed_check")

    def __repr__(self) -> str:
        return f"Scheme({self.id!r}, source={self.source!r})"


# Every scheme loaded in this process, by id: the torch custom ops (kvforge.ops)
# name their scheme by id, a string a graph can hold.
_by_id: dict = {}


def scheme_by_id(scheme_id: str) -> Scheme:
    """The loaded scheme of this id; a shipped scheme is loaded on demand."""
    s = _by_id.get(scheme_id)
    if s is None:
        name = scheme_id.rsplit("_", 1)[0]
        if name in builtin_schemes():
            s = Scheme.builtin(name)
        if s is None or s.id != scheme_id:
            raise KeyError(f"no scheme with id {scheme_id!r} is loaded in this process (load it with "
                           f"kvforge.Scheme(...) first)")
    return s


def load_scheme(scheme) -> Scheme:
    """A Scheme from a Scheme, a path or a shipped name."""
    return scheme if isinstance(scheme, Scheme) else Scheme(scheme)


def builtin_schemes() -> list:
    p = lib().kvf_builtin_schemes()
    out = []
    i = 0
    while p[i]:
        out.append(cstr(p[i]))
        i += 1
    return out
