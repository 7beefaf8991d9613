"""Attention over a QuantizedKVCache layer, block by block.

``softmax(q K^T * scale) V`` over every cached token of a layer, without
decoding the layer's whole history: the cache's entries (packed spans, BF16
chunks) are taken in order, each block of them is decoded into a small scratch
buffer, attended with an attention kernel that also returns the log-sum-exp of
its scores, and the partial outputs are merged exactly (the online-softmax
merge, in float32). The transient memory is that of one block (two on a GPU,
where the next block is decoded while the current one is attended), and of
the query-sized output, whatever the length of the history.

Blocks (``block_tokens``): ``None`` makes every entry of the layer a block of
its own (a packed span, or a BF16 chunk). An int N groups consecutive entries
into blocks of at most N tokens and splits a BF16 entry of more than N tokens;
a packed span is decoded whole, so a block holds max(N, its largest span)
tokens at most. Bigger blocks mean fewer merges (each reads and writes a
query-sized float32 buffer) and longer, more efficient attention calls.

On a CUDA device the attention is the kernel ``scaled_dot_product_attention``
would pick for the block (flash, memory-efficient or cuDNN, called through the
ATen op that returns the log-sum-exp; each kernel's log-sum-exp is checked
against float32 arithmetic on a small problem at first use, and a kernel that
fails the check is not used), the decode of the next block runs on a second
stream into the other buffer of a ring of two, and the merge is one Triton
kernel per block where Triton is installed (torch operations otherwise). The
queries of grouped-query attention are folded into the query axis (query head
i reads KV head i // g): no KV head is repeated.

On the CPU (numpy arrays, or torch CPU tensors) the same blocks are attended in
float32 with numpy: the reference.

Causality between chunks is the caller's: q attends to every cached token. The
caller's own chunk (not yet cached) is attended separately and merged with
:func:`merge_attention` (pass ``return_lse=True``).
"""
from __future__ import annotations

import itertools
import math
import threading
import weakref

__all__ = ["cache_attention", "merge_attention", "block_plan", "scratch_nbytes", "release_scratch"]


# ----------------------------------------------------------------- the plan

def block_plan(cache, layer: int, block_tokens: int | None = None):
    """The blocks cache_attention takes for a layer: a list of blocks, each a list of
    (entry index, first token, end token) pieces (token offsets within the entry)."""
    st = cache._layer(layer)
    return [[(i, lo, hi) for (i, _e, lo, hi) in blk] for blk in _plan(st.entries, block_tokens)]


def _plan(entries, block_tokens):
    if block_tokens is not None and (not isinstance(block_tokens, int) or isinstance(block_tokens, bool)
                                     or block_tokens < 1):
        raise ValueError(f"block_tokens must be None or a positive int, got {block_tokens!r}")
    blocks, cur, cur_n = [], [], 0
    for i, e in enumerate(entries):
        n = e.n_tokens
        if e.kind == "packed" or block_tokens is None or n <= block_tokens:
            pieces = [(i, e, 0, n)]
        else:  # a BF16 entry is cut where the block size says
            pieces = [(i, e, a, min(a + block_tokens, n)) for a in range(0, n, block_tokens)]
        for p in pieces:
            m = p[3] - p[2]
            if cur and (block_tokens is None or cur_n + m > block_tokens):
                blocks.append(cur)
                cur, cur_n = [], 0
            cur.append(p)
            cur_n += m
    if cur:
        blocks.append(cur)
    return blocks


def _block_tokens(blk):
    return sum(hi - lo for (_i, _e, lo, hi) in blk)


def _direct(blk):
    """A block that is one piece of a BF16 entry without RoPE to apply: attended
    where it lies, with no copy."""
    return len(blk) == 1 and blk[0][1].kind != "packed" and blk[0][1].positions is None


# ----------------------------------------------------------- cache handles

_handles: dict = {}
_handle_ids = itertools.count(1)
_handle_lock = threading.Lock()


def handle(cache) -> int:
    """A process-wide int naming the cache (the custom op's argument)."""
    h = cache.__dict__.get("_kvf_attention_handle")
    if h is None:
        with _handle_lock:
            h = cache.__dict__.get("_kvf_attention_handle")
            if h is None:
                h = next(_handle_ids)
                _handles[h] = weakref.ref(cache, lambda _r, h=h: _handles.pop(h, None))
                cache.__dict__["_kvf_attention_handle"] = h
    return h


def cache_by_handle(h: int):
    r = _handles.get(int(h))
    c = r() if r is not None else None
    if c is None:
        raise ValueError(f"kvforge attention: no live QuantizedKVCache has handle {h}")
    return c


# ---------------------------------------------------------------- queries

def _query(cache, q):
    """(q as [B, Hq, L, d] (a view where possible), B, Hq, L) after checking q."""
    be, d, B, Hkv = cache.be, cache.head_dim, cache.batch_size, cache.num_kv_heads
    shape = tuple(int(s) for s in getattr(q, "shape", ()))
    hnd = cache.layout == "hnd"
    what = "[H, L, d]" if hnd else "[L, H, d]"
    if B is None:
        if not (len(shape) == 3 or (len(shape) == 4 and shape[0] == 1)):
            raise ValueError(f"q: expected a 3-D {what} tensor (or [1, ...]), got shape {shape}")
        Bq = 1
    else:
        if len(shape) != 4 or shape[0] != B:
            raise ValueError(f"q: this cache has batch_size={B}: expected a 4-D [B, ...] tensor with "
                             f"B = {B}, got shape {shape}")
        Bq = B
    Hq, L = (shape[-3], shape[-2]) if hnd else (shape[-2], shape[-3])
    if shape[-1] != d:
        raise ValueError(f"q: last dimension is {shape[-1]}, the scheme's head_dim is {d}")
    if Hq < 1 or Hq % Hkv:
        raise ValueError(f"q: {Hq} query heads in shape {shape} (layout {cache.layout!r}) is not a multiple "
                         f"of the {Hkv} KV heads")
    if cache.num_q_heads is not None and Hq != cache.num_q_heads:
        raise ValueError(f"q: {Hq} heads in shape {shape}, the cache was made for num_q_heads = "
                         f"{cache.num_q_heads}")
    if L < 1:
        raise ValueError(f"q: no query tokens (shape {shape})")
    if be.kind == "torch":
        torch = be.torch
        be._check_tensor(q, "q")
        if q.dtype != torch.bfloat16:
            raise TypeError(f"q: dtype must be torch.bfloat16, got {q.dtype}")
        q4 = q.reshape(Bq, Hq, L, d) if hnd else q.reshape(Bq, L, Hq, d).transpose(1, 2)
    else:
        np = be.np
        if not isinstance(q, np.ndarray):
            raise TypeError(f"q: expected a numpy array, got {type(q).__name__}")
        if q.dtype == np.uint16:
            from ._bf16 import bf16_bits_to_float32
            q = bf16_bits_to_float32(q)
        elif q.dtype != np.float32:
            raise TypeError(f"q: numpy dtype must be float32 or uint16 (BF16 bits), got {q.dtype}")
        q4 = q.reshape(Bq, Hq, L, d) if hnd else q.reshape(Bq, L, Hq, d).transpose(0, 2, 1, 3)
    return q4, Bq, Hq, L, shape


def _to_layout(cache, o4, lse3, shape):
    """[B, Hq, L, d] and [B, Hq, L] to q's own shape (and q's shape less d)."""
    if cache.layout == "hnd":
        return o4.reshape(shape), lse3.reshape(shape[:-1])
    if cache.be.kind == "torch":
        return o4.transpose(1, 2).reshape(shape), lse3.transpose(1, 2).reshape(shape[:-1])
    return o4.transpose(0, 2, 1, 3).reshape(shape), lse3.transpose(0, 2, 1).reshape(shape[:-1])


def _check_out(cache, out, shape):
    be = cache.be
    if be.kind == "torch":
        torch = be.torch
        be._check_tensor(out, "out")
        if out.dtype != torch.bfloat16 or tuple(out.shape) != shape:
            raise ValueError(f"out: expected a torch.bfloat16 tensor of shape {shape}, got {out.dtype} "
                             f"{tuple(out.shape)}")
    else:
        np = be.np
        if not isinstance(out, np.ndarray) or out.dtype != np.float32 or out.shape != shape:
            raise ValueError(f"out: expected a float32 numpy array of shape {shape}, got "
                             f"{getattr(out, 'dtype', type(out).__name__)} {getattr(out, 'shape', '')}")
        be.check_writable(out, "out")


# ------------------------------------------------------------------ scratch

class _CudaStreams:
    """torch's CUDA streams and events on one device."""

    def __init__(self, torch, device):
        self.torch, self.device = torch, device

    def current(self):
        return self.torch.cuda.current_stream(self.device)

    def stream(self):
        return self.torch.cuda.Stream(device=self.device)

    def event(self):
        return self.torch.cuda.Event()

    def on(self, stream):
        return self.torch.cuda.stream(stream)

    def capturing(self):
        return self.torch.cuda.is_current_stream_capturing()


class _Inline:
    """Streams and events that do nothing: the streamed path run in program order on
    the CPU (the tests check its blocks, ring and merges there)."""

    def current(self):
        return self

    stream = event = current

    def record(self, *_a):
        pass

    wait_event = wait_stream = record

    def on(self, _stream):
        import contextlib
        return contextlib.nullcontext()

    def capturing(self):
        return False


class _Ring:
    """Scratch K/V buffers (flat BF16) for decoded blocks: one for the CPU reference;
    two for the streamed path, with the side stream that decodes into them and the
    events that order it."""

    def __init__(self, be, elems, streams=None, old=None):
        self.be = be
        self.elems = elems
        slots = 1 if streams is None else 2
        self.bufs = [(be.empty_bf16((elems,)), be.empty_bf16((elems,))) for _ in range(slots)]
        self.streams = streams
        if streams is not None:
            if old is not None and old.streams is streams:
                # Kept: nothing but this cache uses them, and the old buffers' last
                # users were joined into the calling stream.
                self.side, self.decoded, self.free, self.fork = old.side, old.decoded, old.free, old.fork
            else:
                self.side = streams.stream()
                self.decoded = [streams.event() for _ in range(slots)]
                self.free = [streams.event() for _ in range(slots)]
                self.fork = streams.event()

    @property
    def nbytes(self):
        return sum(self.be.nbytes(k) + self.be.nbytes(v) for k, v in self.bufs)


def _ring(cache, elems, streams=None):
    r = cache.__dict__.get("_kvf_attention_ring")
    if r is None or r.elems < elems or (r.streams is None) != (streams is None) or \
            (streams is not None and r.streams is not streams):
        if streams is not None and streams.capturing():
            raise RuntimeError("kvforge attention: its scratch buffers would be allocated inside a CUDA "
                               "graph capture; call it once outside the capture first, with the same cache")
        r = _Ring(cache.be, max(elems, r.elems if r is not None else 0), streams, old=r)
        cache.__dict__["_kvf_attention_ring"] = r
    return r


def scratch_nbytes(cache) -> int:
    """Bytes of the scratch buffers cache_attention keeps for the cache (0 before its first call)."""
    r = cache.__dict__.get("_kvf_attention_ring")
    return r.nbytes if r is not None else 0


def release_scratch(cache) -> None:
    """Drop the cache's scratch buffers (the next call allocates them again)."""
    r = cache.__dict__.pop("_kvf_attention_ring", None)
    if r is not None and r.streams is not None:
        r.streams.current().wait_stream(r.side)


_streams_of: dict = {}


def _cuda_streams(torch, device):
    s = _streams_of.get(str(device))
    if s is None:
        s = _streams_of[str(device)] = _CudaStreams(torch, device)
    return s


def _materialize(cache, blk, n, kbuf, vbuf):
    """Decode / copy the block's pieces into the front of kbuf, vbuf as [H, n, d]
    (H = the library's heads, batch entries side by side). Runs on the current
    stream (the side stream on CUDA)."""
    be, H, d = cache.be, cache._heads, cache.head_dim
    K = kbuf[:H * n * d].reshape(H, n, d)
    V = vbuf[:H * n * d].reshape(H, n, d)
    kp, vp = be.ptr(K), be.ptr(V)
    t0 = 0
    for _i, e, lo, hi in blk:
        m = hi - lo
        if e.kind == "packed":
            ctx = cache.anchor_ctx if e.anchor else cache.ctx
            off = t0 * d * 2  # bytes; tokens t0.. of every head's rows
            ctx.decode_into(e.packed, e.n_tokens, H, kp + off, vp + off, d, n * d, e.positions,
                            anchor=None if e.ref is None else (e.ref.packed, e.ref.n_tokens))
        else:
            k = e.k[:, lo:hi]
            if e.positions is not None:
                k = cache._rope(k, e.positions[lo:hi])
            K[:, t0:t0 + m] = k
            V[:, t0:t0 + m] = e.v[:, lo:hi]
        t0 += m
    return K, V


def _bf16_entry_view(blk):
    _i, e, lo, hi = blk[0]
    return e.k[:, lo:hi], e.v[:, lo:hi]


# -------------------------------------------------------------- public API

def cache_attention(cache, layer: int, q, *, block_tokens: int | None = None, scale: float | None = None,
                    out=None, return_lse: bool = False, kernel: str = "auto", merge: str = "auto", _streams=None):
    """``softmax(q K^T * scale) V`` over every cached token of a layer, block by block.

    q: the queries, in the cache's layout and batch form: [Hq, L, d] (or [1, Hq, L, d];
    [L, Hq, d] with layout "nhd"; [B, ...] with batch_size=B), Hq a multiple of
    the KV heads; torch.bfloat16 on the cache's device, or numpy float32 / uint16
    BF16 bits. Returns the output in q's shape: torch.bfloat16, or numpy float32;
    with ``return_lse=True`` also the float32 log-sum-exp of each query's scores
    (q's shape without d). ``scale``: default 1/sqrt(d). ``out``: a tensor / array
    of the output's shape and dtype to write into (returned). ``block_tokens``: see
    the module's text. An empty layer gives zeros and a log-sum-exp of -inf.

    kernel (CUDA): "auto" (the one SDPA picks), "flash", "efficient", "cudnn" or
    "math" (float32 matmuls). merge (CUDA): "auto" (Triton where importable),
    "triton" or "torch".
    """
    st = cache._layer(layer)
    if kernel not in ("auto", "flash", "efficient", "cudnn", "math"):
        raise ValueError(f"kernel must be 'auto', 'flash', 'efficient', 'cudnn' or 'math', got {kernel!r}")
    if merge not in ("auto", "triton", "torch"):
        raise ValueError(f"merge must be 'auto', 'triton' or 'torch', got {merge!r}")
    q4, B, Hq, L, shape = _query(cache, q)
    if scale is None:
        scale = 1.0 / math.sqrt(cache.head_dim)
    scale = float(scale)
    if out is not None:
        _check_out(cache, out, shape)
    blocks = _plan(st.entries, block_tokens)
    be = cache.be
    if be.is_gpu or _streams is not None:
        streams = _streams if _streams is not None else _cuda_streams(be.torch, be.device)
        o, lse = _streamed(cache, blocks, q4, B, Hq, L, scale, kernel, merge,
                           out if cache.layout == "hnd" else None, streams)
    else:
        o, lse = _cpu(cache, blocks, q4, B, Hq, L, scale)
    o, lse = _to_layout(cache, o, lse, shape)
    if out is not None and o is not out:
        if not (be.kind == "torch" and o.data_ptr() == out.data_ptr() and o.stride() == out.stride()):
            out[...] = o
        o = out
    return (o, lse) if return_lse else o


def merge_attention(o1, lse1, o2, lse2):
    """The attention over the union of two key sets from the attention over each:
    o1, o2 outputs of the same shape [..., d], lse1, lse2 their log-sum-exps [...]
    (natural log). Returns (o, lse): float32 for numpy; for torch o in o1's dtype,
    lse float32, computed in float32."""
    if hasattr(o1, "data_ptr"):
        import torch
        new = torch.logaddexp(lse1.float(), lse2.float())
        o = o1.float() * torch.exp(lse1.float() - new).unsqueeze(-1) + \
            o2.float() * torch.exp(lse2.float() - new).unsqueeze(-1)
        return o.to(o1.dtype), new
    import numpy as np
    new = np.logaddexp(lse1, lse2).astype(np.float32)
    o = np.asarray(o1, np.float32) * np.exp(lse1 - new)[..., None] + \
        np.asarray(o2, np.float32) * np.exp(lse2 - new)[..., None]
    return o.astype(np.float32), new


# ------------------------------------------------------------ CPU reference

def _cpu(cache, blocks, q4, B, Hq, L, scale):
    """float32 with numpy: the reference (numpy arrays and torch CPU tensors)."""
    import numpy as np
    be, Hkv, d = cache.be, cache.num_kv_heads, cache.head_dim
    g = Hq // Hkv
    torch_in = be.kind == "torch"
    qn = q4.float().numpy() if torch_in else q4
    # [B, Hkv, g*L, d]: query head i = j*g + r reads KV head j.
    qf = np.ascontiguousarray(qn, dtype=np.float32).reshape(B, Hkv, g * L, d)
    acc = np.zeros((B, Hkv, g * L, d), np.float32)
    lse = np.full((B, Hkv, g * L), -np.inf, np.float32)
    if blocks:
        n_max = max(_block_tokens(b) for b in blocks)
        ring = None if all(_direct(b) for b in blocks) else _ring(cache, cache._heads * n_max * d)
    for i, blk in enumerate(blocks):
        n = _block_tokens(blk)
        K, V = _bf16_entry_view(blk) if _direct(blk) else _materialize(cache, blk, n, *ring.bufs[0])
        Kf, Vf = (_f32(be, x).reshape(B, Hkv, n, d) for x in (K, V))
        s = np.matmul(qf, Kf.transpose(0, 1, 3, 2)) * np.float32(scale)  # [B, Hkv, gL, n]
        m = s.max(axis=-1, keepdims=True)
        p = np.exp(s - m)
        l = p.sum(axis=-1, keepdims=True)
        o = np.matmul(p, Vf) / l
        lse_i = (m + np.log(l))[..., 0]
        if i == 0:
            acc, lse = o, lse_i
        else:
            new = np.logaddexp(lse, lse_i)
            acc = acc * np.exp(lse - new)[..., None] + o * np.exp(lse_i - new)[..., None]
            lse = new
    o4 = acc.reshape(B, Hq, L, d).astype(np.float32)
    lse3 = lse.reshape(B, Hq, L).astype(np.float32)
    if torch_in:
        torch = be.torch
        return torch.from_numpy(o4).to(torch.bfloat16), torch.from_numpy(lse3)
    return o4, lse3


def _f32(be, x):
    if be.kind == "torch":
        return x.float().numpy()
    from ._bf16 import bf16_bits_to_float32
    return bf16_bits_to_float32(x)


# --------------------------------------------------------------------- CUDA

_FLASH, _EFFICIENT, _CUDNN = 1, 2, 3  # torch's SDPBackend values (_fused_sdp_choice)
_kernel_ok: dict = {}  # (name, device) -> bool: the log-sum-exp check at first use
_triton_ok: dict = {}


def _run_kernel(torch, name, qf, K, V, scale):
    """(o [B, H, M, d] in q's dtype, lse [B, H, M] float32) of one kernel."""
    aten = torch.ops.aten
    B, H, M, d = qf.shape
    if name == "flash":
        r = aten._scaled_dot_product_flash_attention(qf, K, V, 0.0, False, False, scale=scale)
    elif name == "efficient":
        r = aten._scaled_dot_product_efficient_attention(qf, K, V, None, True, 0.0, False, scale=scale)
    elif name == "cudnn":
        r = aten._scaled_dot_product_cudnn_attention(qf, K, V, None, True, 0.0, False, False, scale=scale)
    else:
        return _math(torch, qf, K, V, scale)
    o, lse = r[0], r[1]
    # efficient pads the query axis of its log-sum-exp to a multiple of 32; cuDNN's
    # may carry a trailing 1.
    return o, lse.reshape(B, H, -1)[..., :M]


def _math(torch, qf, K, V, scale):
    """float32 matmuls, the queries in slices so that the scores stay near 256 MiB."""
    B, H, M, d = qf.shape
    n = K.shape[2]
    Kf, Vf = K.float(), V.float()
    step = max(1, (64 << 20) // max(1, B * H * n))
    os_, ls = [], []
    for a in range(0, M, step):
        s = torch.matmul(qf[:, :, a:a + step].float(), Kf.transpose(-1, -2)) * scale
        lse = torch.logsumexp(s, dim=-1)
        os_.append(torch.matmul(torch.exp(s - lse.unsqueeze(-1)), Vf))
        ls.append(lse)
    return torch.cat(os_, dim=2).to(qf.dtype), torch.cat(ls, dim=2)


def _check_kernel(torch, name, device, d, dtype, streams):
    """Whether a kernel's output and log-sum-exp agree with float32 arithmetic on a
    small problem (once per kernel and device)."""
    key = (name, str(device), d, dtype)
    ok = _kernel_ok.get(key)
    if ok is None:
        if streams.capturing():
            raise RuntimeError("kvforge attention: call it once outside the CUDA graph capture first "
                               "(it checks its attention kernel at first use)")
        g = torch.Generator(device="cpu").manual_seed(7)
        q = (torch.randn(1, 2, 96, d, generator=g)).to(device=device, dtype=dtype)
        k = (torch.randn(1, 2, 160, d, generator=g) * 2).to(device=device, dtype=dtype)
        v = torch.randn(1, 2, 160, d, generator=g).to(device=device, dtype=dtype)
        sc = 1.0 / math.sqrt(d)
        try:
            o, lse = _run_kernel(torch, name, q, k, v, sc)
            ro, rl = _math(torch, q, k, v, sc)
            ok = bool((lse.float() - rl).abs().max() < 1e-2) and bool((o.float() - ro.float()).abs().max() < 3e-2)
        except Exception:  # noqa: BLE001 - a kernel that cannot run is a kernel not to use
            ok = False
        _kernel_ok[key] = ok
    return ok


def _pick_kernel(torch, kernel, qf, K, V, scale, streams):
    if kernel != "auto":
        if kernel != "math" and not _check_kernel(torch, kernel, qf.device, qf.shape[-1], qf.dtype, streams):
            raise RuntimeError(f"kvforge attention: kernel {kernel!r} does not run here, or its log-sum-exp "
                               f"disagrees with float32 arithmetic")
        return kernel
    choice = int(torch._fused_sdp_choice(qf, K, V, None, 0.0, False, scale=scale))
    first = {_FLASH: "flash", _EFFICIENT: "efficient", _CUDNN: "cudnn"}.get(choice)
    for name in ([first] if first else []) + ["flash", "efficient", "cudnn"]:
        if _check_kernel(torch, name, qf.device, qf.shape[-1], qf.dtype, streams):
            return name
    return "math"


def attention_kernel(cache, q, block_tokens_hint: int | None = None):
    """The kernel cache_attention(kernel="auto") uses for q against a block of the
    cache's shape (for reports)."""
    torch = cache.be.torch
    q4, B, Hq, L, _ = _query(cache, q)
    Hkv, d = cache.num_kv_heads, cache.head_dim
    n = block_tokens_hint or 256
    qf = q4.contiguous().reshape(B, Hkv, (Hq // Hkv) * L, d)
    k = torch.empty(B, Hkv, n, d, dtype=q4.dtype, device=q4.device)
    return _pick_kernel(torch, "auto", qf, k, k, 1.0 / math.sqrt(d), _cuda_streams(torch, q4.device))


def _merge_torch(torch, a, la, b, lb, dst, dst_lse):
    """dst <- the merge of (a, la) and (b, lb), float32 arithmetic; dst may be a (float32)."""
    new = torch.logaddexp(la, lb)
    wa = torch.exp(la - new).unsqueeze(-1)
    wb = torch.exp(lb - new).unsqueeze(-1)
    if dst.dtype == torch.float32:
        acc = a.mul_(wa) if a is dst else torch.mul(a, wa, out=dst)
    else:  # the last merge: float32, then rounded once into the output
        acc = a.mul_(wa) if a.dtype == torch.float32 else a * wa
    acc.addcmul_(b, wb)
    if acc is not dst:
        dst.copy_(acc)
    dst_lse.copy_(new)


def _use_triton(torch, merge, device, d, streams=None):
    """Whether the merge is the Triton kernel: "auto" on CUDA where Triton imports
    and its kernel, at first use on the device, agrees with the torch merge;
    "triton" wherever asked (on the CPU only under TRITON_INTERPRET=1)."""
    if merge == "torch" or (merge == "auto" and torch.device(device).type != "cuda"):
        return False
    key = (str(device), d)
    ok = _triton_ok.get(key)
    if ok is None:
        if streams is not None and streams.capturing():
            raise RuntimeError("kvforge attention: call it once outside the CUDA graph capture first "
                               "(it checks its merge kernel at first use)")
        try:
            from ._attention_triton import merge as tmerge
            ok = d & (d - 1) == 0  # tl.arange over the head dimension
            if ok:
                g = torch.Generator(device="cpu").manual_seed(3)
                a, b = (torch.randn(1, 2, 40, d, generator=g).to(device, torch.bfloat16) for _ in range(2))
                la, lb = (torch.randn(1, 2, 40, generator=g).to(device) * 3 for _ in range(2))
                x, lx = torch.empty(1, 2, 40, d, device=device), torch.empty(1, 2, 40, device=device)
                y, ly = torch.empty_like(x), torch.empty_like(lx)
                tmerge(a, la, b, lb, x, lx)
                _merge_torch(torch, a, la, b, lb, y, ly)
                ok = bool((x - y).abs().max() < 1e-4) and bool((lx - ly).abs().max() < 1e-4)
        except Exception:  # noqa: BLE001 - no Triton, or no compiler for its launcher: the torch merge
            if merge == "triton":
                raise
            ok = False
        _triton_ok[key] = ok
    if merge == "triton" and not ok:
        raise RuntimeError("kvforge attention: merge='triton' needs triton and a power-of-two head_dim")
    return ok


def _streamed(cache, blocks, q4, B, Hq, L, scale, kernel, merge, out, streams):
    """The torch path: a ring of two scratch buffers, the next block decoded on a
    side stream while the current one is attended on the calling stream, each
    partial output merged as it comes. On CUDA streams is _CudaStreams; _Inline
    runs the same steps in program order (CPU tensors, tests)."""
    be = cache.be
    torch = be.torch
    Hkv, d = cache.num_kv_heads, cache.head_dim
    g = Hq // Hkv
    M = g * L
    dev = be.device
    with torch.no_grad():
        qf = q4 if q4.is_contiguous() else q4.contiguous()
        qf = qf.reshape(B, Hkv, M, d)  # query head j*g + r reads KV head j: no KV head repeated
        if not blocks:
            o = torch.zeros(B, Hq, L, d, dtype=torch.bfloat16, device=dev) if out is None else out.zero_()
            return o.reshape(B, Hq, L, d), torch.full((B, Hq, L), -math.inf, device=dev)
        if _use_triton(torch, merge, dev, d, streams):
            from ._attention_triton import merge as merge_fn
        else:
            def merge_fn(a, la, b, lb, dst, dst_lse):
                _merge_torch(torch, a, la, b, lb, dst, dst_lse)
        need = [b for b in blocks if not _direct(b)]
        ring = _ring(cache, cache._heads * max(_block_tokens(b) for b in need) * d, streams) if need else None
        main = streams.current()
        if ring is not None:
            side = ring.side
            ring.fork.record(main)  # the cache's packed bytes, and the ring's last readers
            side.wait_event(ring.fork)
        nb = len(blocks)
        used = [False, False]
        slot_of = itertools.count()

        def issue(blk):
            n = _block_tokens(blk)
            if _direct(blk):
                K, V = _bf16_entry_view(blk)
                return K.reshape(B, Hkv, n, d), V.reshape(B, Hkv, n, d), None
            s = next(slot_of) % 2
            if used[s]:
                side.wait_event(ring.free[s])  # the attention that read this buffer is done
            used[s] = True
            with streams.on(side):
                K, V = _materialize(cache, blk, n, *ring.bufs[s])
            ring.decoded[s].record(side)
            return K.reshape(B, Hkv, n, d), V.reshape(B, Hkv, n, d), s

        final = out.reshape(B, Hkv, M, d) if out is not None and out.is_contiguous() else \
            torch.empty(B, Hkv, M, d, dtype=torch.bfloat16, device=dev)
        acc = lse = None
        name = None
        cur = issue(blocks[0])
        for i in range(nb):
            nxt = issue(blocks[i + 1]) if i + 1 < nb else None  # decoded while block i is attended
            K, V, s = cur
            if s is not None:
                main.wait_event(ring.decoded[s])
            if name is None:
                name = _pick_kernel(torch, kernel, qf, K, V, scale, streams)
            o, lse_i = _run_kernel(torch, name, qf, K, V, scale)
            if s is not None:
                ring.free[s].record(main)
            if nb == 1:
                final.copy_(o)
                lse = lse_i
            elif i == 0:
                acc, lse = o, lse_i
            else:
                if i == nb - 1:
                    dst = final
                elif acc.dtype == torch.float32:
                    dst = acc  # in place from the second merge on
                else:
                    dst = torch.empty(B, Hkv, M, d, dtype=torch.float32, device=dev)
                dst_lse = lse if i > 1 else torch.empty(B, Hkv, M, dtype=torch.float32, device=dev)
                merge_fn(acc, lse, o, lse_i, dst, dst_lse)
                acc, lse = dst, dst_lse
            cur = nxt
        if ring is not None:
            main.wait_stream(side)  # join: a capture must end joined, and the ring is reused
        lse = lse if lse.is_contiguous() else lse.contiguous()
        return final.reshape(B, Hq, L, d), lse.reshape(B, Hq, L)
