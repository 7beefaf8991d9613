"""Per-layer KV caches the world model runs with, chunk by chunk.

The model calls, for each layer and each chunk it processes:
    cache.keys_values(layer)  -> None (empty) or (K, V), [Hkv, N_past, d]
    cache.append(layer, k, v, q=..., k_pre=..., q_pre=..., positions=...)
after the chunk's attention: k, q post-RoPE [H, Nc, d] (what the model attends
with), k_pre, q_pre the same before RoPE, v [Hkv, Nc, d], positions int32 [Nc, 3].

BF16Cache keeps everything in BF16 (the reference). KvforgeCache keeps it packed
by a kvforge scheme through the Python binding's QuantizedKVCache; the queries
go to it too, so schemes with query statistics (QSAC, PSAC) see the queries of
chunks already generated (strictly causal: the binding updates the statistics
after it has packed the chunk). RecordingCache is a BF16Cache that also keeps
copies of selected layers' chunks for dump_kv.py.
"""
from __future__ import annotations

import torch


class BF16Cache:
    """The reference cache: K and V of every chunk in BF16 (dtype=None keeps the model's dtype)."""

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
            self._cat[layer] = (torch.cat(self._k[layer], 1), torch.cat(self._v[layer], 1))
        return self._cat[layer]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for L in self._k + self._v for t in L)

    @property
    def compression_ratio(self) -> float:
        return 1.0


class RecordingCache(BF16Cache):
    """A BF16Cache that also keeps BF16 copies (on the CPU) of q, k, k_pre, q_pre, v and the
    positions of the chunks of `layers` (None: all)."""

    def __init__(self, n_layers: int, layers=None, dtype=torch.bfloat16):
        super().__init__(n_layers, dtype)
        self.layers = set(range(n_layers)) if layers is None else set(layers)
        self.records = {}      # (layer, chunk) -> dict of tensors
        self.positions = {}    # chunk -> int32 [Nc, 3]

    def append(self, layer, k, v, q=None, k_pre=None, q_pre=None, positions=None):
        chunk = self.num_chunks(layer)
        if layer in self.layers:
            cpu = lambda t: None if t is None else t.detach().to("cpu", torch.bfloat16).contiguous()
            self.records[(layer, chunk)] = {"q": cpu(q), "k": cpu(k), "k_pre": cpu(k_pre),
                                            "q_pre": cpu(q_pre), "v": cpu(v)}
            if positions is not None:
                self.positions[chunk] = positions.detach().to("cpu", torch.int32).contiguous()
        super().append(layer, k, v, q, k_pre, q_pre, positions)


class KvforgeCache:
    """Adapter over kvforge.QuantizedKVCache (python/kvforge/cache.py).

    Schemes with rope.placement "post" or "none" get the post-RoPE keys and queries the
    model attends with; "pre" schemes get the keys and queries before RoPE and the
    positions, and hand back rotated keys (the scheme's rope.sections and theta must be
    the model's: (16, 24, 24), 10000, layout "half")."""

    def __init__(self, scheme, n_layers: int, n_kv_heads: int, head_dim: int, device="cuda", n_q_heads=None):
        import kvforge
        self.cache = kvforge.QuantizedKVCache(scheme, n_layers, n_kv_heads, head_dim, device=device,
                                              num_q_heads=n_q_heads)
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
