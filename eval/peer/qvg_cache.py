"""QVG (the peer) as a KV cache of the world-model rollout (eval/worldmodel/).

The interface of eval/worldmodel/kvcache.py's caches:
    keys_values(layer) -> None (empty) or (K, V), [Hkv, N_past, d] BF16
    append(layer, k, v, q=None, k_pre=None, q_pre=None, positions=None)
    nbytes, compression_ratio, num_chunks(layer)
Each layer keeps QVG's compressed spans (quant_videogen's compress on the spans
its chunk policy lets go, peerkv.LayerStore) and decodes them on every read, as
QVG's ChunkedKVCache does. Keys are the post-RoPE `k` the model attends with;
queries and positions are not used (QVG has no query statistics). nbytes counts
the peer's tensors (codes, scales, zeros, cluster ids, centroids) plus the
chunks still in BF16.

Factories for `rollout.py --cache-factory qvg_cache:qvg_int2` (PYTHONPATH=eval/peer):
qvg_int2, qvg_int2_asym, qvg_pro_int2 (qvg_codec.CONFIGS), and qvg(config=...,
quant_factor=..., keep_recent=..., sink_keep=...). Each takes the model's
config object (attributes layers, kv_heads, head_dim) or n_layers, n_kv_heads,
head_dim, and device.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peerkv import ChunkPolicy, LayerStore  # noqa: E402


class QvgCache:
    def __init__(self, n_layers: int, n_kv_heads: int | None = None, head_dim: int | None = None,
                 device="cuda", config: str = "qvg-peer_int2_g64", policy: ChunkPolicy | None = None,
                 codec=None, seed: int | None = None, **_ignored):
        if codec is None:
            import qvg_codec
            codec = qvg_codec.QvgCodec(config, device, qvg_codec.DEFAULT_SEED if seed is None else seed)
        self.codec = codec
        self.policy = policy or ChunkPolicy()
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self.layers = [LayerStore(codec, self.policy) for _ in range(n_layers)]

    def num_chunks(self, layer: int = 0) -> int:
        return len(self.layers[layer])

    def append(self, layer, k, v, q=None, k_pre=None, q_pre=None, positions=None):
        """Chunk finished in this layer: keep it in BF16, then compress what the policy lets go
        before the next chunk (its trigger runs before a chunk is generated)."""
        if self.n_kv_heads is not None and int(k.shape[0]) != self.n_kv_heads:
            raise ValueError(f"k has {k.shape[0]} heads, the cache {self.n_kv_heads}")
        st = self.layers[layer]
        st.append(self.codec.native(k), self.codec.native(v))
        st.apply_policy()

    def keys_values(self, layer):
        return self.layers[layer].keys_values()

    @property
    def nbytes(self) -> int:
        return int(sum(sum(st.stored_bytes().values()) for st in self.layers))

    @property
    def bf16_nbytes(self) -> int:
        return int(sum(st.bf16_bytes() for st in self.layers))

    @property
    def compression_ratio(self) -> float:
        n = self.nbytes
        return self.bf16_nbytes / n if n else 1.0

    def memory(self) -> dict:
        """Stored bytes by part, all layers."""
        out: dict = {}
        for st in self.layers:
            for p, n in st.stored_bytes().items():
                out[p] = out.get(p, 0) + n
        return out


def _dims(args, kw):
    """(n_layers, n_kv_heads, head_dim) from a config object or from numbers."""
    if args and hasattr(args[0], "layers"):
        cfg = args[0]
        if len(args) > 1:
            kw.setdefault("device", args[1])
        return (cfg.layers, getattr(cfg, "kv_heads", None), getattr(cfg, "head_dim", None)), kw
    if "cfg" in kw:
        cfg = kw.pop("cfg")
        return (cfg.layers, getattr(cfg, "kv_heads", None), getattr(cfg, "head_dim", None)), kw
    names = ("n_layers", "n_kv_heads", "head_dim")
    vals = list(args[:3]) + [kw.pop(n, None) for n in names[len(args[:3]):]]
    if len(args) > 3:
        kw.setdefault("device", args[3])
    if vals[0] is None:
        raise TypeError("a QVG cache needs the model's config or n_layers")
    return tuple(vals), kw


def qvg(*args, config: str = "qvg-peer_int2_g64", quant_factor: int = 1, keep_recent: int = 0,
        sink_keep: int = 0, **kw) -> QvgCache:
    (n_layers, n_kv_heads, head_dim), kw = _dims(args, kw)
    kw.pop("n_q_heads", None)
    return QvgCache(n_layers, n_kv_heads, head_dim, config=config,
                    policy=ChunkPolicy(quant_factor, keep_recent, sink_keep), **kw)


def qvg_int2(*args, **kw) -> QvgCache:
    return qvg(*args, config="qvg-peer_int2_g64", **kw)


def qvg_int2_asym(*args, **kw) -> QvgCache:
    return qvg(*args, config="qvg-peer_int2_g64_asym", **kw)


def qvg_pro_int2(*args, **kw) -> QvgCache:
    return qvg(*args, config="qvg-peer_pro_int2_g16", **kw)
