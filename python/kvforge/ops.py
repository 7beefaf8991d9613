"""kvforge's encode and decode as PyTorch custom operators (``torch.library``).

``import kvforge.ops`` registers, in the ``kvforge`` namespace:

* ``torch.ops.kvforge.encode(k, v, qstats, scheme, layout, strict) -> packed``
* ``torch.ops.kvforge.decode(packed, n_tokens, n_heads, positions, scheme, layout) -> (k, v)``
* ``torch.ops.kvforge.decode_into(packed, positions, scheme, layout, k_out, v_out) -> ()``
  (writes preallocated outputs: the form for static buffers in CUDA graphs)
* ``torch.ops.kvforge.qstats_update(qstats, q, scheme, layout) -> ()`` (updates in place)
* ``torch.ops.kvforge.cache_attention(q, cache, layer, block_tokens, scale) -> (out, lse)``
  (attention over a QuantizedKVCache layer, a block at a time; ``cache`` is the
  cache's int handle: use the wrapper :func:`cache_attention`)

``scheme`` is the scheme's id (``Scheme.id``, e.g. ``"rtn_int2_1a2b3c4d"``): any
scheme loaded in the process, or a shipped one. Each op has a fake (meta)
implementation, so graphs that call them compile with ``torch.compile``
(``fullgraph=True``: the ops are opaque nodes, nothing breaks the graph), and
the CUDA implementations queue their kernels on torch's current stream without
synchronizing or allocating outside torch: a decode can be captured in a CUDA
graph (after one call outside the capture has JIT-compiled or loaded its
kernels). Encode may grow a k-means workspace on first use with a larger span,
which a capture does not allow: capture decodes, not encodes.

The Python functions :func:`encode`, :func:`decode`, :func:`decode_into` take a
:class:`kvforge.Scheme` (or its id) and call the ops. Needs torch >= 2.4.
"""

from typing import Optional, Tuple

import torch

from .context import Context
from .scheme import Scheme, scheme_by_id

__all__ = ["encode", "decode", "decode_into", "qstats_update", "cache_attention", "packed_size"]

if not hasattr(torch.library, "custom_op"):  # pragma: no cover - depends on the installed torch
    raise ImportError(f"kvforge.ops needs torch >= 2.4 (torch.library.custom_op); this is torch {torch.__version__}")

_contexts: dict = {}


def _ctx(scheme_id: str, device: torch.device) -> Context:
    key = (scheme_id, str(device))
    c = _contexts.get(key)
    if c is None:
        c = _contexts[key] = Context(scheme_by_id(scheme_id), device)
    return c


def _tokens_heads(x_shape, layout):
    if len(x_shape) != 3:
        raise ValueError(f"kvforge ops take 3-D tensors ([H, N, d] or [N, H, d]), got shape {tuple(x_shape)}")
    return (x_shape[1], x_shape[0]) if layout == "hnd" else (x_shape[0], x_shape[1])


# ----------------------------------------------------------------- encode

@torch.library.custom_op("kvforge::encode", mutates_args=())
def _encode(k: torch.Tensor, v: torch.Tensor, qstats: Optional[torch.Tensor], scheme: str, layout: str,
            strict: bool) -> torch.Tensor:
    return _ctx(scheme, k.device).encode(k, v, qstats=qstats, layout=layout, strict=strict)


@_encode.register_fake
def _(k, v, qstats, scheme, layout, strict):
    n, h = _tokens_heads(k.shape, layout)
    # The packed size is a function of the shape alone (kvf_packed_size): shapes are
    # specialized here, as a dynamic token count could not be carried through it.
    size = scheme_by_id(scheme).packed_size(int(n), int(h))
    return k.new_empty((size,), dtype=torch.uint8)


# ----------------------------------------------------------------- decode

@torch.library.custom_op("kvforge::decode", mutates_args=())
def _decode(packed: torch.Tensor, n_tokens: int, n_heads: int, positions: Optional[torch.Tensor], scheme: str,
            layout: str) -> Tuple[torch.Tensor, torch.Tensor]:
    return _ctx(scheme, packed.device).decode(packed, n_tokens, n_heads, positions=positions, layout=layout)


@_decode.register_fake
def _(packed, n_tokens, n_heads, positions, scheme, layout):
    d = scheme_by_id(scheme).head_dim
    shape = (n_heads, n_tokens, d) if layout == "hnd" else (n_tokens, n_heads, d)
    return packed.new_empty(shape, dtype=torch.bfloat16), packed.new_empty(shape, dtype=torch.bfloat16)


@torch.library.custom_op("kvforge::decode_into", mutates_args=("k_out", "v_out"))
def _decode_into(packed: torch.Tensor, positions: Optional[torch.Tensor], scheme: str, layout: str,
                 k_out: torch.Tensor, v_out: torch.Tensor) -> None:
    n, h = _tokens_heads(k_out.shape, layout)
    _ctx(scheme, packed.device).decode(packed, n, h, positions=positions, layout=layout, out=(k_out, v_out))


@_decode_into.register_fake
def _(packed, positions, scheme, layout, k_out, v_out):
    return None


# ------------------------------------------------------ query statistics

@torch.library.custom_op("kvforge::qstats_update", mutates_args=("qstats",))
def _qstats_update(qstats: torch.Tensor, q: torch.Tensor, scheme: str, layout: str) -> None:
    _ctx(scheme, q.device).qstats_update(qstats, q, layout=layout)


@_qstats_update.register_fake
def _(qstats, q, scheme, layout):
    return None


# --------------------------------------------------- attention over a cache

@torch.library.custom_op("kvforge::cache_attention", mutates_args=())
def _cache_attention(q: torch.Tensor, cache: int, layer: int, block_tokens: Optional[int],
                     scale: Optional[float]) -> Tuple[torch.Tensor, torch.Tensor]:
    from .attention import cache_attention as attend, cache_by_handle
    return attend(cache_by_handle(cache), layer, q, block_tokens=block_tokens, scale=scale, return_lse=True)


@_cache_attention.register_fake
def _(q, cache, layer, block_tokens, scale):
    # The output has q's shape in every layout and batch form, the log-sum-exp q's without d.
    return q.new_empty(q.shape, dtype=torch.bfloat16), q.new_empty(q.shape[:-1], dtype=torch.float32)


# ---------------------------------------------------------------- wrappers

def _sid(scheme) -> str:
    if isinstance(scheme, str):
        return scheme
    if isinstance(scheme, Scheme):
        return scheme.id
    raise TypeError(f"scheme: expected a kvforge.Scheme or its id, got {type(scheme).__name__}")


def encode(k, v, scheme, *, qstats=None, layout: str = "hnd", strict: bool = False):
    """``torch.ops.kvforge.encode``: pack k, v ([H, N, d] or [N, H, d], torch.bfloat16) into a uint8 tensor."""
    return torch.ops.kvforge.encode(k, v, qstats, _sid(scheme), layout, strict)


def decode(packed, n_tokens: int, n_heads: int, scheme, *, positions=None, layout: str = "hnd"):
    """``torch.ops.kvforge.decode``: (k, v) torch.bfloat16 of a packed span."""
    return torch.ops.kvforge.decode(packed, n_tokens, n_heads, positions, _sid(scheme), layout)


def decode_into(packed, scheme, k_out, v_out, *, positions=None, layout: str = "hnd"):
    """``torch.ops.kvforge.decode_into``: decode into preallocated BF16 outputs."""
    torch.ops.kvforge.decode_into(packed, positions, _sid(scheme), layout, k_out, v_out)


def qstats_update(qstats, q, scheme, *, layout: str = "hnd"):
    """``torch.ops.kvforge.qstats_update``: add a chunk's queries to a statistics buffer."""
    torch.ops.kvforge.qstats_update(qstats, q, _sid(scheme), layout)


@torch.compiler.assume_constant_result
def _handle(cache) -> int:
    # A constant of the traced graph: a cache keeps its handle for life.
    from .attention import handle
    return handle(cache)


def cache_attention(cache, layer: int, q, *, block_tokens: Optional[int] = None, scale: Optional[float] = None,
                    return_lse: bool = False):
    """``torch.ops.kvforge.cache_attention``: :meth:`QuantizedKVCache.attention` as an opaque
    node for torch.compile and CUDA graphs. The cache is named by an int handle
    (given at the cache's first attention call, or here), so a compiled graph reads
    the layer's entries as they are at each run, and a captured CUDA graph the
    buffers of the entries it was captured with."""
    o, lse = torch.ops.kvforge.cache_attention(q, _handle(cache), layer, block_tokens, scale)
    return (o, lse) if return_lse else o


def packed_size(scheme, n_tokens: int, n_heads: int) -> int:
    return (scheme if isinstance(scheme, Scheme) else scheme_by_id(scheme)).packed_size(n_tokens, n_heads)
