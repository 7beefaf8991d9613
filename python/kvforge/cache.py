"""QuantizedKVCache: the K/V cache of a chunked autoregressive video model, packed
by a kvforge scheme chunk by chunk."""
from __future__ import annotations

from ._tensors import check_finite, check_layout
from .context import Context
from .scheme import load_scheme

__all__ = ["QuantizedKVCache"]


class _Entry:
    """A run of consecutive chunks of one layer: one packed span, or one BF16 chunk."""
    __slots__ = ("kind", "first_chunk", "n_chunks", "n_tokens", "packed", "k", "v", "positions", "anchor", "ref")

    def __init__(self, kind, first_chunk, n_chunks, n_tokens, packed=None, k=None, v=None,
                 positions=None, anchor=False, ref=None):
        self.kind = kind  # "packed", "sink" (BF16 forever) or "bf16" (recent / waiting for a span)
        self.first_chunk = first_chunk
        self.n_chunks = n_chunks
        self.n_tokens = n_tokens
        self.packed = packed
        self.k = k  # [H, N, d] contiguous BF16 (held chunks)
        self.v = v
        self.positions = positions  # int32 [N, A] ("pre" schemes)
        self.anchor = anchor  # a packed anchor span (the anchor scheme's)
        self.ref = ref  # the anchor entry a packed span is coded against, or None


class _Layer:
    __slots__ = ("entries", "n_chunks", "n_tokens", "qstats", "q_chunks", "feedback", "channel_map")

    def __init__(self):
        self.entries = []
        self.n_chunks = 0
        self.n_tokens = 0
        self.qstats = None
        self.q_chunks = 0
        self.feedback = None  # error feedback's carried error of the last span (f32 [2, H, N, d] as bytes)
        self.channel_map = None  # mixed precision's channel map (u8 [2, H, d])


class QuantizedKVCache:
    """Per-layer K/V cache packed by a kvforge scheme, chunk by chunk.

    Parameters
    ----------
    scheme: a scheme file path, a shipped scheme's name, or a :class:`kvforge.Scheme`.
    num_layers, num_kv_heads, head_dim: the model's attention shape; head_dim must
        be the scheme's.
    device: ``None`` for numpy arrays on the CPU reference; ``"cpu"`` for torch CPU
        tensors; ``"cuda"``, ``"cuda:N"``, ``N`` or a torch.device for CUDA tensors
        (the kernels are JIT-compiled here, at construction, or read from the
        disk cache).
    layout: ``"hnd"`` ([Hkv, N, d], also [1, Hkv, N, d]) or ``"nhd"`` ([N, Hkv, d]):
        the layout of k, v and q given to :meth:`append` and of what
        :meth:`keys_values` returns.
    num_q_heads: optional; when given, q must have exactly this many heads (a
        multiple of num_kv_heads). Otherwise any multiple is accepted.
    qstats: ``"auto"`` keeps per-layer query statistics when the scheme reads them
        (QSAC or PSAC keys); ``True`` always; ``False`` never (q is then checked
        and ignored, and such schemes encode from a cold start).
    batch_size: ``None`` (default): k, v and q of one sequence ([Hkv, N, d], or
        [1, ...]), and keys_values returns [Hkv, T, d]. An int B >= 1: a leading batch
        dimension everywhere ([B, Hkv, N, d] / [B, N, Hkv, d] in, [B, Hkv, T, d] /
        [B, T, Hkv, d] out). The batch entries share the chunk schedule and positions;
        each span of a layer is one packed buffer over B x Hkv heads (every plane of
        the packed format is per head, so each entry is encoded as it would be alone,
        with its own query statistics: query head j of entry b feeds KV head j / g of
        entry b), one kernel launch and one header for the whole batch.
    strict: ``True``: append refuses K or V holding NaN or Inf (a ValueError naming
        how many and where the first is); ``False`` (default) lets the library take
        them (docs/METHODS.md). On a GPU the check synchronizes.
    warm_start: ``True``: each span's k-means starts from the centroids of the
        layer's previous packed span (``Context.encode(warm_from=...)``); the first
        span, and schemes without centroids, as without it. ``False`` (default): a
        sample of the span's own tokens. Whether it helps depends on how alike
        consecutive spans are (docs/METHODS.md section 3).
    table: mixed precision's sensitivity table (``kvforge calibrate`` writes it)
        for a scheme with ``mixed_precision``; None: the one the scheme names.
        Layer l of the cache reads layer l of the table.

    The pipeline (docs/METHODS.md section 11) needs nothing more: a scheme with
    ``anchors`` packs every ``every``-th span as an anchor (the anchor scheme,
    :meth:`kvforge.Scheme.anchor_scheme`) and codes the spans between against
    it; one with ``error_feedback`` keeps each layer's carried error (one span
    of float32 K and V, counted in :meth:`memory` as "feedback").

    Chunk policy (the scheme's ``chunk`` section, as the library states it:
    kvf_chunk_policy, :meth:`kvforge.Scheme.chunk_step`): chunk i of a layer is
    the i-th :meth:`append`. Chunks ``i < sink`` stay BF16 for ever. The
    ``recent`` newest other chunks stay BF16; a chunk older than that waits
    (BF16) until ``span`` such chunks are there, which are then packed together
    as one span. With the defaults (span 1, recent 0, sink 0) every chunk is
    packed inside its append.

    Query statistics are causal: a span packed inside append(t) is encoded with
    the layer's statistics as they are then, the queries of chunks < t (chunk
    t's are added after the pack).
    """

    def __init__(self, scheme, num_layers: int, num_kv_heads: int, head_dim: int | None = None, *,
                 device=None, layout: str = "hnd", num_q_heads: int | None = None, qstats="auto",
                 warm_start: bool = False, batch_size: int | None = None, strict: bool = False, table=None):
        self.scheme = load_scheme(scheme)
        info = self.info = self.scheme.info
        if head_dim is None:
            head_dim = info.head_dim
        for name, val in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            if not isinstance(val, int) or isinstance(val, bool) or val < 1:
                raise ValueError(f"{name} must be a positive int, got {val!r}")
        if head_dim != info.head_dim:
            raise ValueError(f"head_dim = {head_dim}, but scheme {self.scheme.name} is for head_dim = "
                             f"{info.head_dim} (set head_dim in the scheme file)")
        if num_q_heads is not None and (num_q_heads < 1 or num_q_heads % num_kv_heads):
            raise ValueError(f"num_q_heads = {num_q_heads} is not a multiple of num_kv_heads = {num_kv_heads}")
        if batch_size is not None and (not isinstance(batch_size, int) or isinstance(batch_size, bool)
                                       or batch_size < 1):
            raise ValueError(f"batch_size must be None or a positive int, got {batch_size!r}")
        self.batch_size = batch_size
        self.strict = bool(strict)
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        # Heads as the library sees them: the batch entries' heads side by side.
        self._heads = (batch_size or 1) * num_kv_heads
        self.num_q_heads = num_q_heads
        self.head_dim = head_dim
        self.layout = check_layout(layout)
        self.ctx = Context(self.scheme, device)  # JIT / disk cache here
        self.be = self.ctx.be
        if qstats == "auto":
            qstats = info.reads_qstats
        elif qstats not in (True, False):
            raise ValueError(f"qstats must be 'auto', True or False, got {qstats!r}")
        self.uses_qstats = bool(qstats)
        if warm_start not in (True, False):
            raise ValueError(f"warm_start must be True or False, got {warm_start!r}")
        self.warm_start = bool(warm_start)
        self._layers = [_Layer() for _ in range(num_layers)]
        if self.uses_qstats:
            for st in self._layers:
                st.qstats = self.ctx.qstats_new(self._heads)
        self.anchor_ctx = Context(self.scheme.anchor_scheme(), device) if info.anchor_every else None
        self.table = table
        if info.needs_channel_map:
            import numpy as np
            for layer, st in enumerate(self._layers):
                m = self.scheme.mixed_map(table, layer, num_kv_heads)  # [2, Hkv, d]
                if batch_size is not None:  # every batch entry's heads read their head's map
                    m = np.concatenate([np.tile(m[sec][None], (batch_size, 1, 1)).reshape(1, -1, head_dim)
                                        for sec in (0, 1)])
                st.channel_map = self.be.u8_from_numpy(m)

    # ------------------------------------------------------------ properties
    @property
    def device(self):
        return self.ctx.device

    @property
    def chunk_policy(self) -> dict:
        i = self.info
        return {"tokens": i.chunk_tokens, "span": i.chunk_span, "recent": i.chunk_recent, "sink": i.chunk_sink}

    def __repr__(self):
        return (f"QuantizedKVCache({self.scheme.id!r}, layers={self.num_layers}, kv_heads={self.num_kv_heads}, "
                f"batch={self.batch_size}, "
                f"head_dim={self.head_dim}, {self.be!r}, tokens={self.num_tokens()}, "
                f"nbytes={self.nbytes}, ratio={self.compression_ratio:.3f})")

    def _layer(self, layer) -> _Layer:
        if not isinstance(layer, int) or isinstance(layer, bool):
            raise TypeError(f"layer must be an int, got {type(layer).__name__}")
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range (the cache has {self.num_layers} layers)")
        return self._layers[layer]

    def num_tokens(self, layer: int = 0) -> int:
        return self._layer(layer).n_tokens

    def num_chunks(self, layer: int = 0) -> int:
        return self._layer(layer).n_chunks

    def segments(self, layer: int):
        """How a layer is held, oldest first: a list of (kind, first_chunk, n_chunks,
        n_tokens) with kind "sink" (BF16 for ever), "packed" (one span), "anchor" (a
        packed anchor span) or "bf16" (recent, or waiting for a full span)."""
        return [("anchor" if e.anchor else e.kind, e.first_chunk, e.n_chunks, e.n_tokens)
                for e in self._layer(layer).entries]

    def qstats_buffer(self, layer: int):
        """The layer's query-statistics buffer (None when the cache keeps none)."""
        return self._layer(layer).qstats

    # ------------------------------------------------------------ append
    def _flat(self, x, name, n_heads=None, heads_multiple_of=None):
        """A batched input [B, H, N, d] / [B, N, H, d] as the library's [B*H, N, d] ("hnd")."""
        be, d, B = self.be, self.head_dim, self.batch_size
        shape = tuple(int(s) for s in getattr(x, "shape", ()))
        what = "[B, H, N, d]" if self.layout == "hnd" else "[B, N, H, d]"
        if len(shape) != 4 or shape[0] != B:
            raise ValueError(f"{name}: this cache has batch_size={B}: expected a 4-D {what} tensor with "
                             f"B = {B}, got shape {shape}")
        h = shape[1] if self.layout == "hnd" else shape[2]
        if n_heads is not None and h != n_heads:
            raise ValueError(f"{name}: {h} heads in shape {shape} (layout {self.layout!r} = {what}), "
                             f"expected {n_heads}")
        if heads_multiple_of is not None and h % heads_multiple_of:
            raise ValueError(f"{name}: {h} query heads in shape {shape} is not a multiple of the "
                             f"{heads_multiple_of} KV heads")
        if shape[3] != d:
            raise ValueError(f"{name}: last dimension is {shape[3]}, the scheme's head_dim is {d}")
        if be.kind == "torch":
            be._check_tensor(x, name)
            if x.dtype != be.torch.bfloat16:
                raise TypeError(f"{name}: dtype must be torch.bfloat16, got {x.dtype}")
        flat = be.flat_heads(x, self.layout)
        mult = None if heads_multiple_of is None else B * heads_multiple_of
        return be.kv(flat, name, "hnd", d, n_heads=None if n_heads is None else B * n_heads,
                     heads_multiple_of=mult)

    def append(self, layer: int, k, v, q=None, positions=None, *, strict: bool | None = None):
        """Add one finished chunk of a layer.

        k, v: the chunk's keys and values, [Hkv, N, d] (or [N, Hkv, d] with
        layout="nhd"); torch.bfloat16 on the cache's device, or numpy uint16 BF16
        bits / float32. q (optional): the chunk's queries [Hq, Nq, d], Hq a
        multiple of Hkv (grouped-query attention); they update the layer's query
        statistics *after* whatever this append packs, so a span packed now is
        encoded with the queries of chunks before this one (with the defaults, a
        chunk's keys never see its own queries). positions: int32 [N, axes],
        required for rope.placement = "pre" schemes (k then holds keys before RoPE
        and q queries before RoPE) and refused otherwise; with a batch, one [N, axes]
        for every entry. strict: overrides the cache's ``strict`` for this call.

        With ``batch_size=B``: k, v [B, Hkv, N, d] (or [B, N, Hkv, d]), q [B, Hq, Nq, d].
        """
        st = self._layer(layer)
        be, d, info = self.be, self.head_dim, self.info
        if self.batch_size is None:
            ka = be.kv(k, "k", self.layout, d, n_heads=self.num_kv_heads)
            va = be.kv(v, "v", self.layout, d, n_heads=self.num_kv_heads)
        else:
            ka = self._flat(k, "k", n_heads=self.num_kv_heads)
            va = self._flat(v, "v", n_heads=self.num_kv_heads)
        if va.n_tokens != ka.n_tokens:
            raise ValueError(f"v has {va.n_tokens} tokens, k has {ka.n_tokens}")
        if self.strict if strict is None else strict:
            check_finite(be, k, "k")
            check_finite(be, v, "v")
        qa = None
        if q is not None:
            if self.batch_size is None:
                qa = be.kv(q, "q", self.layout, d, n_heads=self.num_q_heads, heads_multiple_of=self.num_kv_heads)
            else:
                qa = self._flat(q, "q", n_heads=self.num_q_heads, heads_multiple_of=self.num_kv_heads)
        if info.rope_placement == "pre":
            if positions is None:
                raise ValueError(f"positions: scheme {self.scheme.name} caches keys before RoPE "
                                 f"(rope.placement = 'pre'): append needs int32 positions "
                                 f"[{ka.n_tokens}, {info.rope_axes}]")
            pos = be.positions(positions, ka.n_tokens, info.rope_axes)
        else:
            if positions is not None:
                raise ValueError(f"positions: scheme {self.scheme.name} has rope.placement = "
                                 f"{info.rope_placement!r}; positions are only for 'pre' schemes")
            pos = None

        idx, n = st.n_chunks, ka.n_tokens
        step = self.scheme.chunk_step(idx)
        alone = step.pack_chunks == 1 and step.pack_first == idx
        if step.sink:
            entry = _Entry("sink", idx, 1, n, k=be.hnd_copy(ka), v=be.hnd_copy(va), positions=pos)
        elif alone:
            # Packed at once, straight from the caller's tensors (no copy).
            entry = self._encode(st, st.entries, step, ka, va, n, idx, 1, pos)
        else:
            entry = _Entry("bf16", idx, 1, n, k=be.hnd_copy(ka), v=be.hnd_copy(va), positions=pos)
        entries = st.entries + [entry]
        if step.pack_chunks and not alone:
            entries = self._pack(st, entries, step)
        # Everything that can fail has run: commit.
        st.entries = entries
        st.n_chunks += 1
        st.n_tokens += n
        if qa is not None and st.qstats is not None:
            self.ctx.qstats_update_arg(st.qstats, qa)
            st.q_chunks += 1

    def _warm(self, entries, step):
        """The warm start of the span the step packs: the packed span the policy
        names (step.warm_first), or None."""
        if not self.warm_start or not step.warm_chunks:
            return None
        prev = next((e for e in entries if e.kind == "packed" and e.first_chunk == step.warm_first), None)
        if prev is None or prev.n_chunks != step.warm_chunks:
            raise RuntimeError(f"kvf_chunk_policy names chunks {step.warm_first}.."
                               f"{step.warm_first + step.warm_chunks - 1} as the previous packed span, "
                               f"which this cache does not hold as one")
        return prev.packed, prev.n_tokens

    def _pack(self, st, entries, step):
        """Entries with the step's span packed: its chunks, waiting in BF16, become one
        packed span, encoded with the layer's statistics as they are now."""
        be = self.be
        lo, hi = step.pack_first, step.pack_first + step.pack_chunks
        at = [i for i, e in enumerate(entries) if lo <= e.first_chunk < hi]
        group = [entries[i] for i in at]
        if len(group) != step.pack_chunks or any(e.kind != "bf16" for e in group) or \
                at != list(range(at[0], at[0] + len(at))):
            raise RuntimeError(f"kvf_chunk_policy packs chunks {lo}..{hi - 1}, which this cache "
                               f"does not hold waiting in BF16")
        k = be.cat_tokens([e.k for e in group])
        v = be.cat_tokens([e.v for e in group])
        pos = be.cat_rows([e.positions for e in group]) if group[0].positions is not None else None
        ka = be.kv(k, "k", "hnd", self.head_dim)
        va = be.kv(v, "v", "hnd", self.head_dim)
        n = sum(e.n_tokens for e in group)
        span = self._encode(st, entries, step, ka, va, n, lo, len(group), pos)
        return entries[:at[0]] + [span] + entries[at[-1] + 1:]

    def _encode(self, st, entries, step, ka, va, n, first, n_chunks, pos):
        """The packed entry of the span the step packs: an anchor span (the anchor
        scheme), or a span of the scheme coded against its anchor, with the carried
        error and the channel map where the scheme has them."""
        be = self.be
        if step.anchor:
            packed = be.empty_u8(self.anchor_ctx.packed_size(n, self._heads))
            self.anchor_ctx.encode_args(ka, va, None, packed)
            return _Entry("packed", first, n_chunks, n, packed=packed, positions=pos, anchor=True)
        ref = None
        if step.anchor_first >= 0:
            ref = next((e for e in entries if e.kind == "packed" and e.anchor and e.first_chunk == step.anchor_first),
                       None)
            if ref is None or ref.n_chunks != step.anchor_chunks:
                raise RuntimeError(f"kvf_chunk_policy codes chunks {first}..{first + n_chunks - 1} against the "
                                   f"anchor span at chunk {step.anchor_first}, which this cache does not hold")
        feedback, feedback_in = None, False
        if self.info.feedback_decay > 0:
            need = 4 * 2 * self._heads * n * self.head_dim
            if st.feedback is None or be.nbytes(st.feedback) != need:
                st.feedback = be.empty_u8(need)  # a span of another size starts a new chain
            else:
                feedback_in = step.feedback_in
            feedback = st.feedback
        packed = be.empty_u8(self.ctx.packed_size(n, self._heads))
        self.ctx.encode_args(ka, va, st.qstats, packed, warm=self._warm(entries, step),
                             anchor=None if ref is None else (ref.packed, ref.n_tokens), feedback=feedback,
                             feedback_in=feedback_in, channel_map=st.channel_map)
        return _Entry("packed", first, n_chunks, n, packed=packed, positions=pos, ref=ref)

    # ------------------------------------------------------------ read back
    def keys_values(self, layer: int, *, layout: str | None = None, out=None, bits: bool = False):
        """Decoded keys and values of every cached token of a layer, oldest first.

        Returns (K, V) of shape [Hkv, T, d] (layout "hnd") or [T, Hkv, d] ("nhd"),
        [B, Hkv, T, d] / [B, T, Hkv, d] with a batch: torch.bfloat16 on the cache's
        device, or numpy float32 (uint16 BF16 bits with bits=True). Every packed span
        is decoded straight into its slice of one preallocated buffer (no
        concatenation), the BF16 chunks are copied in (with a batch and "nhd", the
        decode goes through one [B, Hkv, T, d] buffer first). For rope.placement =
        "pre" schemes the keys come back rotated. ``out``: (K, V) contiguous BF16
        tensors / writable uint16 arrays of that shape to write into.
        """
        st = self._layer(layer)
        layout = check_layout(layout or self.layout)
        be, H, d, T, B = self.be, self._heads, self.head_dim, st.n_tokens, self.batch_size
        Hkv = self.num_kv_heads
        if B is None:
            shape = (H, T, d) if layout == "hnd" else (T, H, d)
        else:
            shape = (B, Hkv, T, d) if layout == "hnd" else (B, T, Hkv, d)
        if out is not None:
            K, V = out
            for name, x in (("out[0]", K), ("out[1]", V)):
                be.check_writable(x, name)
                if tuple(x.shape) != shape:
                    raise ValueError(f"{name}: shape {tuple(x.shape)}, expected {shape}")
                if T:
                    kind = "torch.bfloat16 tensor" if be.kind == "torch" else "uint16 array"
                    if not _is_contiguous(be, x):
                        raise ValueError(f"{name}: must be a contiguous BF16 {kind}")
                    flat = x.reshape(-1, x.shape[-2], d)  # a view of a contiguous x (checks dtype, device)
                    if be.kv(flat, name, "hnd", d).obj is not flat:
                        raise ValueError(f"{name}: must be a contiguous BF16 {kind}")
        else:
            K, V = be.empty_bf16(shape), be.empty_bf16(shape)
        if T:
            via = B is not None and layout == "nhd"  # decode [B*Hkv, T, d], then transpose
            dl = "hnd" if B is not None else layout
            Kd, Vd = (be.empty_bf16((B, Hkv, T, d)), be.empty_bf16((B, Hkv, T, d))) if via else (K, V)
            tok_stride, head_stride = (d, T * d) if dl == "hnd" else (H * d, d)
            kbase, vbase = be.ptr(Kd), be.ptr(Vd)
            Kf = Kd if B is None else Kd.reshape(H, T, d)
            Vf = Vd if B is None else Vd.reshape(H, T, d)
            t0 = 0
            for e in st.entries:
                if e.kind == "packed":
                    off = t0 * tok_stride * 2  # bytes
                    ctx = self.anchor_ctx if e.anchor else self.ctx
                    ctx.decode_into(e.packed, e.n_tokens, H, kbase + off, vbase + off, tok_stride, head_stride,
                                    e.positions, anchor=None if e.ref is None else (e.ref.packed, e.ref.n_tokens))
                else:
                    k = e.k
                    if e.positions is not None:
                        k = self._rope(k, e.positions)
                    self._put(Kf, k, t0, e.n_tokens, dl)
                    self._put(Vf, e.v, t0, e.n_tokens, dl)
                t0 += e.n_tokens
            if via:
                K[...] = be.to_nhd(Kd)
                V[...] = be.to_nhd(Vd)
        if be.kind == "numpy" and not bits:
            from ._bf16 import bf16_bits_to_float32
            return bf16_bits_to_float32(K), bf16_bits_to_float32(V)
        return K, V

    def attention(self, layer: int, q, *, block_tokens: int | None = None, scale: float | None = None,
                  out=None, return_lse: bool = False):
        """``softmax(q K^T * scale) V`` over every cached token of a layer, with the
        history decoded a block at a time (:func:`kvforge.cache_attention`; its
        module's text says how): no BF16 copy of the whole layer is made.

        q: [Hq, L, d] ([L, Hq, d] with layout "nhd"; [B, ...] with a batch), Hq a
        multiple of the KV heads; torch.bfloat16 on the cache's device, or numpy
        float32 / uint16 BF16 bits. Returns q's shape: torch.bfloat16 (CUDA: the
        attention kernel SDPA picks, the next block decoded on a second stream) or
        numpy float32 (float32 arithmetic: the reference); with return_lse=True also
        the float32 log-sum-exp of each query's scores (q's shape without d).
        block_tokens: None, a block per entry (packed span or BF16 chunk); N,
        consecutive entries grouped into blocks of at most N tokens (BF16 chunks
        cut to fit; a packed span is decoded whole). scale: default 1/sqrt(d).
        q attends to every cached token: causality across chunks is the caller's.
        """
        from .attention import cache_attention
        return cache_attention(self, layer, q, block_tokens=block_tokens, scale=scale, out=out,
                               return_lse=return_lse)

    def _put(self, dst, src_hnd, t0, n, layout):
        if layout == "hnd":
            dst[:, t0:t0 + n] = src_hnd
        else:
            dst[t0:t0 + n] = src_hnd.transpose(1, 0, 2) if self.be.kind == "numpy" else src_hnd.transpose(0, 1)

    def _rope(self, k, positions):
        from ._rope import rope_numpy, rope_torch
        return rope_numpy(k, positions, self.info) if self.be.kind == "numpy" else rope_torch(k, positions, self.info)

    # ------------------------------------------------------------ memory
    def memory(self, layer: int | None = None) -> dict:
        """Bytes held, by kind, for one layer or all: packed (anchors included), bf16
        (sink/recent/waiting chunks), positions, qstats, feedback (the carried error),
        channel_map; total (= nbytes); kv_bf16 (what BF16 K and V of
        the same tokens take); compression_ratio = kv_bf16 / total."""
        be = self.be
        layers = self._layers if layer is None else [self._layer(layer)]
        m = {"packed": 0, "bf16": 0, "positions": 0, "qstats": 0, "feedback": 0, "channel_map": 0, "tokens": 0}
        for st in layers:
            for e in st.entries:
                if e.kind == "packed":
                    m["packed"] += be.nbytes(e.packed)
                else:
                    m["bf16"] += be.nbytes(e.k) + be.nbytes(e.v)
                m["positions"] += be.nbytes(e.positions)
            if st.qstats is not None:
                m["qstats"] += be.nbytes(st.qstats)
            m["feedback"] += be.nbytes(st.feedback)
            m["channel_map"] += be.nbytes(st.channel_map)
            m["tokens"] += st.n_tokens
        m["total"] = sum(m[x] for x in ("packed", "bf16", "positions", "qstats", "feedback", "channel_map"))
        m["kv_bf16"] = 2 * m["tokens"] * self._heads * self.head_dim * 2
        m["compression_ratio"] = m["kv_bf16"] / m["total"] if m["total"] else 1.0
        return m

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds: packed spans + BF16 chunks + positions + query statistics."""
        return self.memory()["total"]

    @property
    def bf16_nbytes(self) -> int:
        """Bytes BF16 K and V of every cached token would take."""
        return self.memory()["kv_bf16"]

    @property
    def compression_ratio(self) -> float:
        """bf16_nbytes / nbytes (1.0 while the cache is empty and holds nothing)."""
        return self.memory()["compression_ratio"]

    def reset(self):
        """Forget every chunk, anchor and carried error (the query statistics are
        re-initialized; the channel maps stay)."""
        for i, st in enumerate(self._layers):
            q = st.qstats
            self._layers[i] = _Layer()
            self._layers[i].channel_map = st.channel_map
            if q is not None:
                self.ctx.qstats_init(q, self._heads)
                self._layers[i].qstats = q


def _is_contiguous(be, x):
    if be.kind == "torch":
        return x.is_contiguous()
    return bool(x.flags.c_contiguous)
