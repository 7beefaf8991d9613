"""Per-layer KV caches the world model runs with, chunk by chunk, and the interface they share.

The cache interface (what model.py calls; any object with these members plugs in)
-------------------------------------------------------------------------------
For each chunk it processes, the model calls, layer by layer (0, 1, ..., L-1):

    cache.keys_values(layer) -> None | (K, V)
        None while the layer holds nothing; else K and V [Hkv, N_past, d] of every
        chunk appended to this layer so far, oldest first, K *after* RoPE (the keys the
        model attends with), on the model's device, any float dtype (the model casts
        to its compute dtype, BF16 under autocast). The model reads them for this one
        attention call and drops them before the next layer: a cache may decode into
        a fresh buffer at every call (KvforgeCache does) and need keep nothing decoded.
    cache.append(layer, k, v, q=None, k_pre=None, q_pre=None, positions=None)
        after that attention: the chunk's own k, v [Hkv, Nc, d] (k after RoPE), its
        queries q [Hq, Nc, d] after RoPE, k_pre and q_pre the same before RoPE, and
        positions int32 [Nc, 3] (frame, row, column; frame counted from the stream's
        first frame), all on the model's device, k/v/q/k_pre/q_pre in the compute
        dtype. Hq is a multiple of Hkv (query head h reads KV head h // (Hq / Hkv)).
        A cache keeps what it wants of them; after this call the next
        keys_values(layer) must include the chunk.

and the reports read

    cache.nbytes             int: bytes the cache holds now (packed data, anything kept
                             in full precision, side data such as statistics)
    cache.compression_ratio  float: BF16 bytes of the same K and V / nbytes
    cache.memory()           optional: a dict of byte counts by kind (reported as is)

`CacheProtocol` below states this for type checkers; `check_cache` tests an object
against it (rollout.py does, for caches from --cache-factory).

A *cache factory* (rollout.py --cache-factory module:function) is a callable

    factory(cfg, device) -> cache

cfg being the model's WMConfig (layers, kv_heads, heads, head_dim, tokens_per_chunk,
rope_sections, rope_theta; RoPE layout "half", docs/METHODS.md section 6) and device
a torch.device; it is called once per rollout (a fresh, empty cache each time).

The caches here
---------------
BF16Cache keeps everything in BF16 (the reference). KvforgeCache keeps it packed by a
kvforge scheme through the Python binding's QuantizedKVCache (which keeps only the
packed spans and the chunks its policy holds in BF16, and decodes into a fresh buffer
at each keys_values call); the queries go to it too, so schemes with query statistics
(QSAC, PSAC) see the queries of chunks already generated (strictly causal: the binding
updates the statistics after it has packed the chunk). RecordingCache wraps any cache
and keeps CPU copies of selected layers' chunks for dump_kv.py.
"""
from __future__ import annotations

from typing import Optional, Protocol, Tuple, runtime_checkable

import torch


@runtime_checkable
class CacheProtocol(Protocol):
    """The interface of the module docstring."""

    def keys_values(self, layer: int) -> Optional[Tuple[torch.Tensor, torch.Tensor]]: ...

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, q: Optional[torch.Tensor] = None,
               k_pre: Optional[torch.Tensor] = None, q_pre: Optional[torch.Tensor] = None,
               positions: Optional[torch.Tensor] = None) -> None: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def compression_ratio(self) -> float: ...


def check_cache(obj, where: str = "cache"):
    """Raise TypeError naming what `obj` lacks of the cache interface; returns obj."""
    missing = [m for m in ("keys_values", "append") if not callable(getattr(obj, m, None))]
    missing += [m for m in ("nbytes", "compression_ratio") if not hasattr(obj, m)]
    if missing:
        raise TypeError(f"{where}: {type(obj).__name__} lacks {', '.join(missing)} "
                        f"(see eval/worldmodel/kvcache.py for the interface)")
    return obj


def cache_memory(cache) -> dict:
    """The cache's byte counts: its memory() when it has one, else {"total": nbytes}."""
    mem = getattr(cache, "memory", None)
    if callable(mem):
        try:
            m = dict(mem())
            m.setdefault("total", int(cache.nbytes))
            return {k: (float(v) if isinstance(v, float) else int(v)) for k, v in m.items()}
        except TypeError:
            pass
    return {"total": int(cache.nbytes)}


class BF16Cache:
    """The reference cache: K and V of every chunk in BF16 (dtype=None keeps the model's dtype).
    Chunks are kept as appended; keys_values concatenates them for the call (the concatenation
    lives until the layer's next append, i.e. for one attention call)."""

    def __init__(self, n_layers: int, dtype=torch.bfloat16):
        self.n_layers = n_layers
        self.dtype = dtype
        self._k = [[] for _ in range(n_layers)]
        self._v = [[] for _ in range(n_layers)]
        self._cat = [None] * n_layers

    def num_chunks(self, layer: int = 0) -> int:
        return len(self._k[layer])

    def append(self, layer, k, v, q=None, k_pre=None, q_pre=None, positions=None):
        dt = self.dtype or k.dtype
        self._k[layer].append(k.detach().to(dt).contiguous())
        self._v[layer].append(v.detach().to(dt).contiguous())
        self._cat[layer] = None

    def keys_values(self, layer):
        if not self._k[layer]:
            return None
        if self._cat[layer] is None:
            ks, vs = self._k[layer], self._v[layer]
            self._cat[layer] = (ks[0], vs[0]) if len(ks) == 1 else (torch.cat(ks, 1), torch.cat(vs, 1))
        return self._cat[layer]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for L in self._k + self._v for t in L)

    @property
    def compression_ratio(self) -> float:
        return 1.0

    def memory(self) -> dict:
        return {"bf16": self.nbytes, "total": self.nbytes, "compression_ratio": 1.0}


class RecordingCache:
    """Wraps a cache (default: a BF16Cache) and keeps BF16 copies (on the CPU) of q, k, k_pre,
    q_pre, v and the positions of the chunks of `layers` (None: all), as the model handed them
    to append: the exact tensors of the trajectory the wrapped cache produced."""

    def __init__(self, n_layers: int, layers=None, dtype=torch.bfloat16, inner=None):
        self.inner = inner if inner is not None else BF16Cache(n_layers, dtype)
        self.n_layers = n_layers
        self.layers = set(range(n_layers)) if layers is None else set(layers)
        self.records = {}      # (layer, chunk) -> dict of tensors
        self.positions = {}    # chunk -> int32 [Nc, 3]
        self._chunks = [0] * n_layers

    def num_chunks(self, layer: int = 0) -> int:
        return self._chunks[layer]

    def keys_values(self, layer):
        return self.inner.keys_values(layer)

    def append(self, layer, k, v, q=None, k_pre=None, q_pre=None, positions=None):
        chunk = self._chunks[layer]
        if layer in self.layers:
            cpu = lambda t: None if t is None else t.detach().to("cpu", torch.bfloat16).contiguous()
            self.records[(layer, chunk)] = {"q": cpu(q), "k": cpu(k), "k_pre": cpu(k_pre),
                                            "q_pre": cpu(q_pre), "v": cpu(v)}
            if positions is not None:
                self.positions[chunk] = positions.detach().to("cpu", torch.int32).contiguous()
        self.inner.append(layer, k, v, q=q, k_pre=k_pre, q_pre=q_pre, positions=positions)
        self._chunks[layer] += 1

    @property
    def nbytes(self) -> int:
        return int(self.inner.nbytes)

    @property
    def compression_ratio(self) -> float:
        return float(self.inner.compression_ratio)


class KvforgeCache:
    """Adapter over kvforge.QuantizedKVCache (python/kvforge/cache.py).

    Schemes with rope.placement "post" or "none" get the post-RoPE keys and queries the
    model attends with; "pre" schemes get the keys and queries before RoPE and the
    positions, and hand back rotated keys (the scheme's rope.sections and theta must be
    the model's: (16, 24, 24), 10000, layout "half"). The binding keeps packed spans (and
    the BF16 chunks its chunk policy names: sink, recent, a span still filling); every
    keys_values call decodes into a new buffer that the model drops after the layer's
    attention, so no full-history BF16 copy outlives one attention call."""

    def __init__(self, scheme, n_layers: int, n_kv_heads: int, head_dim: int, device="cuda", n_q_heads=None,
                 table=None):
        import kvforge
        self.cache = kvforge.QuantizedKVCache(scheme, n_layers, n_kv_heads, head_dim, device=device,
                                              num_q_heads=n_q_heads, table=table)
        info = getattr(self.cache, "info", None)
        self.pre = getattr(info, "rope_placement", "post") == "pre"

    def append(self, layer, k, v, q=None, k_pre=None, q_pre=None, positions=None):
        bf = lambda t: None if t is None else t.detach().to(torch.bfloat16).contiguous()
        if self.pre:
            if k_pre is None or positions is None:
                raise ValueError("a rope.placement = 'pre' scheme needs k_pre and positions")
            self.cache.append(layer, bf(k_pre), bf(v), q=bf(q_pre),
                              positions=positions.to(device=k.device, dtype=torch.int32).contiguous())
        else:
            self.cache.append(layer, bf(k), bf(v), q=bf(q))

    def keys_values(self, layer):
        if self.cache.num_tokens(layer) == 0:
            return None
        return self.cache.keys_values(layer)

    @property
    def nbytes(self) -> int:
        return int(self.cache.nbytes)

    @property
    def compression_ratio(self) -> float:
        return float(self.cache.compression_ratio)

    def memory(self) -> dict:
        mem = getattr(self.cache, "memory", None)
        return dict(mem()) if callable(mem) else {"total": self.nbytes}
