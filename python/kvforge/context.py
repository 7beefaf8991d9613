"""Contexts: a scheme bound to the CPU reference or a CUDA device; encode, decode,
query statistics on numpy arrays or torch tensors."""
from __future__ import annotations

import threading
from ctypes import byref, c_int, c_uint64, c_void_p

from ._lib import KVF_DEVICE_CPU, KvfDecodeArgs, KvfEncodeArgs, KvfShape, check, cstr, lib
from ._tensors import check_finite, check_layout, make_backend
from .scheme import Scheme, load_scheme

__all__ = ["Context", "device_count"]


class _CContext:
    """One kvf_context. Shared by every Context of the same (scheme, device) and
    kept for the life of the process (destroying a CUDA context's module while
    work may still be queued, or at interpreter exit after torch tore CUDA down,
    is not worth the few kilobytes)."""

    def __init__(self, scheme: Scheme, device: int):
        L = lib()
        out = c_void_p()
        check(L.kvf_context_create(scheme._ptr, device, byref(out)), "kvf_context_create")
        self.ptr = out
        self.device = device
        self.backend = cstr(L.kvf_context_backend(out))
        self.origin = cstr(L.kvf_context_origin(out))


_registry: dict = {}
_registry_lock = threading.Lock()


def _c_context(scheme: Scheme, device: int) -> _CContext:
    key = (scheme.canonical, device)
    with _registry_lock:
        c = _registry.get(key)
        if c is None:
            c = _registry[key] = _CContext(scheme, device)
        return c


def device_count() -> int:
    """CUDA devices libkvforge sees (0 without libcuda or devices)."""
    n = c_int(0)
    lib().kvf_device_count(byref(n))  # the status only says why it is 0
    return n.value


class Context:
    """A scheme on a device.

    ``device=None``: numpy arrays on the CPU reference (BF16 as uint16 bits or
    float32). ``device="cpu"``: torch CPU tensors on the CPU reference.
    ``device="cuda"``, ``"cuda:1"``, ``1`` or a ``torch.device``: torch CUDA
    tensors; the kernels are JIT-compiled for the GPU the first time (then come
    from the disk cache), and work is queued on torch's current stream.
    The underlying kvf_context is shared per (scheme, device).
    """

    def __init__(self, scheme, device=None):
        self.scheme = load_scheme(scheme)
        self.info = self.scheme.info
        self.head_dim = self.info.head_dim
        self.be = make_backend(device)
        self._c = _c_context(self.scheme, self.be.device_index if self.be.is_gpu else KVF_DEVICE_CPU)

    @property
    def device(self):
        return self.be.device if self.be.kind == "torch" else None

    @property
    def backend(self) -> str:
        """"cpu" or "sm_90" and so on."""
        return self._c.backend

    @property
    def origin(self) -> str:
        """How the kernels were obtained: "cpu", "nvrtc", "disk-cache", "image"."""
        return self._c.origin

    def __repr__(self):
        return (f"Context({self.scheme.id!r}, {self.be!r}, backend={self.backend!r}, "
                f"origin={self.origin!r})")

    def packed_size(self, n_tokens: int, n_heads: int) -> int:
        return self.scheme.packed_size(n_tokens, n_heads)

    # ------------------------------------------------------------ helpers
    def _buffer(self, buf, name, min_bytes=None, writable=False):
        be = self.be
        if writable:
            be.check_writable(buf, name)
        if be.kind == "numpy":
            import numpy as np
            if not isinstance(buf, np.ndarray) or buf.dtype != np.uint8 or not buf.flags.c_contiguous:
                raise TypeError(f"{name}: expected a contiguous numpy uint8 array, got "
                                f"{type(buf).__name__} {getattr(buf, 'dtype', '')}")
        else:
            torch = be.torch
            if not isinstance(buf, torch.Tensor):
                raise TypeError(f"{name}: expected a torch uint8 tensor, got {type(buf).__name__}")
            if buf.dtype != torch.uint8 or not buf.is_contiguous():
                raise TypeError(f"{name}: expected a contiguous torch.uint8 tensor, got {buf.dtype}")
            if buf.device != be.device:
                raise ValueError(f"{name}: buffer is on {buf.device}, this context works on {be.device}")
            if be.is_gpu and buf.data_ptr() % 16:
                raise ValueError(f"{name}: buffer must be 16-byte aligned on the GPU")
        n = be.nbytes(buf)
        if min_bytes is not None and n < min_bytes:
            raise ValueError(f"{name}: {n} bytes, {min_bytes} needed")
        return be.ptr(buf), n

    def _qstats_ptr(self, qstats):
        if qstats is None:
            return None
        return self._buffer(qstats, "qstats")[0]

    def encode_args(self, k, v, qstats, packed, layout="hnd", n_heads=None, stream=None, warm=None,
                    anchor=None, feedback=None, feedback_in=False, channel_map=None):
        """Low-level: encode already resolved Args into a packed buffer.

        warm: None, or (the previous span's packed buffer, its token count): the
        k-means starts from that span's centroids (kvf_encode_warm). The
        pipeline (kvf_encode_ex): anchor, (the anchor span's packed buffer, its
        token count); feedback, the carried error (float32 [2, H, N, d] on this
        device, read when feedback_in, written always); channel_map, uint8
        [2, H, d] on this device."""
        pptr, pbytes = self._buffer(packed, "packed", writable=True)
        if warm is not None:
            wbuf, wtokens = warm
            if not isinstance(wtokens, int) or isinstance(wtokens, bool) or wtokens < 1:
                raise ValueError(f"warm_tokens must be a positive int (the previous span's tokens), got {wtokens!r}")
            wptr, wbytes = self._buffer(wbuf, "warm_from")
        if (k.n_tokens, k.n_heads) != (v.n_tokens, v.n_heads):
            raise ValueError(f"k and v differ: k has {k.n_heads} heads x {k.n_tokens} tokens, "
                             f"v {v.n_heads} x {v.n_tokens}")
        if (k.token_stride, k.head_stride) != (v.token_stride, v.head_stride):
            # One shape for both in the C API: give v the layout of k.
            v = self.be.kv(self.be.hnd_copy(v), "v", "hnd", self.head_dim)
            k = self.be.kv(self.be.hnd_copy(k), "k", "hnd", self.head_dim)
        sh = k.shape()
        st = stream if stream is not None else self.be.stream()
        if anchor is not None or feedback is not None or channel_map is not None:
            a = KvfEncodeArgs(qstats=self._qstats_ptr(qstats), feedback_in=1 if feedback_in else 0)
            if warm is not None:
                a.prev, a.prev_bytes, a.prev_n_tokens = wptr, wbytes, wtokens
            if anchor is not None:
                abuf, atokens = anchor
                a.anchor, a.anchor_bytes = self._buffer(abuf, "anchor")
                a.anchor_n_tokens = int(atokens)
            if feedback is not None:
                a.feedback = self._state(feedback, "feedback", 4 * 2 * sh.n_heads * sh.n_tokens * self.head_dim)
            if channel_map is not None:
                a.channel_map = self._state(channel_map, "channel_map", 2 * sh.n_heads * self.head_dim)
            check(lib().kvf_encode_ex(self._c.ptr, k.ptr, v.ptr, byref(sh), byref(a), pptr, pbytes, st),
                  "kvf_encode_ex")
        elif warm is None:
            check(lib().kvf_encode(self._c.ptr, k.ptr, v.ptr, byref(sh), self._qstats_ptr(qstats), pptr, pbytes, st),
                  "kvf_encode")
        else:
            check(lib().kvf_encode_warm(self._c.ptr, k.ptr, v.ptr, byref(sh), self._qstats_ptr(qstats), wptr, wbytes,
                                        wtokens, pptr, pbytes, st), "kvf_encode_warm")
        return k, v

    def _state(self, buf, name, nbytes):
        """The pointer of a pipeline state buffer (numpy array or torch tensor on this
        device, contiguous, at least nbytes)."""
        be = self.be
        if be.kind == "torch":
            if not isinstance(buf, be.torch.Tensor) or buf.device != be.device or not buf.is_contiguous():
                raise ValueError(f"{name}: expected a contiguous tensor on {be.device}")
        elif not hasattr(buf, "flags") or not buf.flags.c_contiguous:
            raise ValueError(f"{name}: expected a contiguous numpy array")
        if be.nbytes(buf) < nbytes:
            raise ValueError(f"{name}: {be.nbytes(buf)} bytes, {nbytes} needed")
        return be.ptr(buf)

    def decode_into(self, packed, n_tokens, n_heads, k_ptr, v_ptr, token_stride, head_stride,
                    positions=None, stream=None, anchor=None):
        """Low-level: decode into raw pointers with the given strides (elements).
        anchor: (the anchor span's packed buffer, its token count) for a span coded
        against one (kvf_decode_ex)."""
        pptr, pbytes = self._buffer(packed, "packed")
        sh = KvfShape(int(n_tokens), int(n_heads), int(token_stride), int(head_stride))
        if anchor is not None:
            abuf, atokens = anchor
            a = KvfDecodeArgs(positions=self.be.ptr(positions))
            a.anchor, a.anchor_bytes = self._buffer(abuf, "anchor")
            a.anchor_n_tokens = int(atokens)
            check(lib().kvf_decode_ex(self._c.ptr, pptr, pbytes, byref(sh), byref(a), k_ptr, v_ptr,
                                      stream if stream is not None else self.be.stream()), "kvf_decode_ex")
            return
        check(lib().kvf_decode(self._c.ptr, pptr, pbytes, byref(sh), self.be.ptr(positions), k_ptr, v_ptr,
                               stream if stream is not None else self.be.stream()), "kvf_decode")

    def _positions(self, positions, n_tokens):
        if self.info.rope_placement != "pre":
            if positions is not None:
                raise ValueError(f"positions: scheme {self.scheme.name} has rope.placement = "
                                 f"{self.info.rope_placement!r}: decode takes no positions")
            return None
        if positions is None:
            raise ValueError(f"positions: scheme {self.scheme.name} caches keys before RoPE "
                             f"(rope.placement = 'pre'): decode needs int32 positions "
                             f"[{n_tokens}, {self.info.rope_axes}]")
        return self.be.positions(positions, n_tokens, self.info.rope_axes)

    # ------------------------------------------------------------ public
    def encode(self, k, v, *, qstats=None, layout: str = "hnd", out=None, warm_from=None, warm_tokens=None,
               strict: bool = False, anchor=None, feedback=None, feedback_in: bool = False, channel_map=None):
        """Pack one span of K and V. Returns the packed buffer (uint8; ``out`` if given).

        k, v: ``[H, N, d]`` (layout ``"hnd"``) or ``[N, H, d]`` (``"nhd"``), optionally
        with a leading batch of 1; numpy uint16 (BF16 bits) / float32, or torch.bfloat16
        on this context's device. ``qstats``: the layer's query statistics
        (:meth:`qstats_new`), read only; None is the cold start. ``warm_from``: the
        previous span's packed buffer (this scheme, the same heads) and ``warm_tokens``
        its token count: each k-means starts from its centroids instead of a sample of
        this span's tokens (docs/METHODS.md section 3; sections without centroids
        ignore it). Whether that helps depends on how alike the spans are.
        ``strict=True``: a NaN or Inf in k or v is a ValueError naming how many there
        are and where the first is (otherwise the library takes them as they come:
        RTN, QVG and KIVI drop a NaN from the group's range, QuaRot's rotation spreads
        it over the token's channels). On a GPU the check synchronizes.

        The pipeline (docs/METHODS.md section 11; :class:`QuantizedKVCache` does all
        of this by itself): ``anchor=(packed, n_tokens)``, the anchor span this span
        is coded against (encoded with :meth:`Scheme.anchor_scheme`'s context);
        ``feedback``, the carried error, a uint8 buffer of 4 * 2 * H * N * d bytes
        on this device (float32 [2, H, N, d]), read when ``feedback_in`` and
        written always; ``channel_map``, uint8 [2, H, d] (:meth:`Scheme.mixed_map`),
        on this device.
        """
        if (warm_from is None) != (warm_tokens is None):
            raise ValueError("warm_from and warm_tokens go together (the previous span's packed buffer and tokens)")
        check_layout(layout)
        ka = self.be.kv(k, "k", layout, self.head_dim)
        va = self.be.kv(v, "v", layout, self.head_dim, n_heads=ka.n_heads)
        if va.n_tokens != ka.n_tokens:
            raise ValueError(f"v has {va.n_tokens} tokens, k has {ka.n_tokens}")
        if strict:
            check_finite(self.be, k, "k")
            check_finite(self.be, v, "v")
        size = self.packed_size(ka.n_tokens, ka.n_heads)
        if out is None:
            out = self.be.empty_u8(size)
        self.encode_args(ka, va, qstats, out, warm=None if warm_from is None else (warm_from, warm_tokens),
                         anchor=anchor, feedback=feedback, feedback_in=feedback_in, channel_map=channel_map)
        return out

    def decode(self, packed, n_tokens: int, n_heads: int, *, positions=None, layout: str = "hnd",
               out=None, bits: bool = False, anchor=None):
        """Unpack to BF16 K and V of shape [H, N, d] (``"hnd"``) or [N, H, d] (``"nhd"``).

        Returns (k, v): torch.bfloat16 tensors; for numpy, float32 arrays (or the uint16
        BF16 bits with ``bits=True``). ``positions`` (int32 [N, axes]) only for
        rope.placement = "pre" schemes. ``out=(k_out, v_out)``: BF16 tensors / uint16
        arrays to write into (any strides with a contiguous last dimension).
        ``anchor=(packed, n_tokens)``: the anchor span this span was coded against.
        """
        check_layout(layout)
        n_tokens, n_heads = int(n_tokens), int(n_heads)
        pos = self._positions(positions, n_tokens)
        shape = (n_heads, n_tokens, self.head_dim) if layout == "hnd" else (n_tokens, n_heads, self.head_dim)
        if out is None:
            ko, vo = self.be.empty_bf16(shape), self.be.empty_bf16(shape)
        else:
            ko, vo = out
            self.be.check_writable(ko, "out[0]")
            self.be.check_writable(vo, "out[1]")
        ka = self.be.kv(ko, "out[0]", layout, self.head_dim, n_heads=n_heads)
        va = self.be.kv(vo, "out[1]", layout, self.head_dim, n_heads=n_heads)
        if ka.obj is not ko or va.obj is not vo:
            raise ValueError("out: decode cannot write into these outputs: they must be BF16 "
                             "(torch.bfloat16, or numpy uint16 bits), with no zero or negative "
                             "strides, and on a GPU 16-byte aligned with strides multiple of 8")
        if ka.n_tokens != n_tokens or va.n_tokens != n_tokens:
            raise ValueError(f"out: {ka.n_tokens} tokens, {n_tokens} expected")
        if (ka.token_stride, ka.head_stride) != (va.token_stride, va.head_stride):
            raise ValueError("out: k and v outputs must have the same strides")
        self.decode_into(packed, n_tokens, n_heads, ka.ptr, va.ptr, ka.token_stride, ka.head_stride, pos,
                         anchor=anchor)
        if self.be.kind == "numpy" and not bits:
            from ._bf16 import bf16_bits_to_float32
            return bf16_bits_to_float32(ko), bf16_bits_to_float32(vo)
        return ko, vo

    # ------------------------------------------------------ query statistics
    def qstats_size(self, n_kv_heads: int) -> int:
        return self.scheme.qstats_size(n_kv_heads)

    def qstats_new(self, n_kv_heads: int):
        """A new, initialized query-statistics buffer of one layer (uint8, on this device)."""
        n = self.qstats_size(n_kv_heads)
        buf = self.be.zeros_u8(n)
        self.qstats_init(buf, n_kv_heads)
        return buf

    def qstats_init(self, qstats, n_kv_heads: int):
        ptr, n = self._buffer(qstats, "qstats", writable=True)
        check(lib().kvf_qstats_init(self._c.ptr, ptr, n, int(n_kv_heads), self.be.stream()), "kvf_qstats_init")

    def qstats_update(self, qstats, q, *, layout: str = "hnd", n_kv_heads: int | None = None):
        """Add one chunk's queries ([Hq, N, d] / [N, Hq, d]; Hq a multiple of the KV heads)."""
        check_layout(layout)
        qa = self.be.kv(q, "q", layout, self.head_dim, heads_multiple_of=n_kv_heads)
        self.qstats_update_arg(qstats, qa)

    def qstats_skipped(self, qstats) -> int:
        """Query rows left out of these statistics because they held NaN or Inf
        (each such row is skipped by :meth:`qstats_update`; docs/METHODS.md 4).
        On a GPU this reads the header back, after the stream's work so far."""
        self._buffer(qstats, "qstats", min_bytes=64)
        head = qstats[:64].tobytes() if self.be.kind == "numpy" else qstats[:64].cpu().numpy().tobytes()
        n = c_uint64()
        check(lib().kvf_qstats_skipped(head, len(head), byref(n)), "kvf_qstats_skipped")
        return n.value

    def qstats_update_arg(self, qstats, qa):
        ptr, n = self._buffer(qstats, "qstats", writable=True)
        sh = qa.shape()
        check(lib().kvf_qstats_update(self._c.ptr, ptr, n, qa.ptr, byref(sh), self.be.stream()),
              "kvf_qstats_update")
