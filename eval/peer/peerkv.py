"""A peer's KV cache, chunk by chunk: its chunk policy, its compressed spans, its bytes.

Shared by the evaluation harness (qvg_peer.py) and the rollout adapter
(qvg_cache.py). What is compressed, and how, is a codec's business; this module
only keeps QVG's bookkeeping, as its integrations do (quant_videogen's
ChunkedKVCache and LingBot-v2's wan/image2video.py):

* chunks arrive one at a time and are kept in BF16;
* before chunk `t` is generated (that is, once chunks 0..t-1 are finished), the
  policy may compress a span of finished chunks in one call; the span's BF16
  copies are dropped and only the compressed form is kept;
* every read returns the whole history in BF16, each compressed span
  decompressed again (ChunkedKVCache.read decodes on every read).

A codec works on "native" arrays [H, S, d] (numpy BF16 bits for CPU fakes,
torch.bfloat16 on a GPU for QVG) and provides:
    compress(k, v) -> (state_k, state_v)      decompress(state_k, state_v) -> (k, v)
    cat(list) -> native (along tokens)        state_bytes(state) -> {part: bytes}
    chunk_bytes(x) -> int (BF16 bytes)        from_bits(uint16 array) / to_bits(native)
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkPolicy:
    """Which finished chunks a QVG cache compresses, and when (LingBot-v2's rule).

    quant_factor: chunks per span, compressed together every quant_factor chunks
        (QuantizeConfig.quant_factor; 1 = each chunk as it is finished);
    keep_recent: newest finished chunks held in BF16 (quant_keep_recent_chunks);
    sink_keep: leading chunks never compressed (quant_sink_keep_chunks; LingBot-v2
        applies it in its sliding-window path, here always: no chunk is evicted in
        these streams).
    """
    quant_factor: int = 1
    keep_recent: int = 0
    sink_keep: int = 0

    def __post_init__(self):
        if self.quant_factor < 1 or self.keep_recent < 0 or self.sink_keep < 0:
            raise ValueError(f"bad chunk policy {self}")

    def spans(self, chunk_id: int) -> list[tuple[int, int]]:
        """Chunk ranges [a, b) to compress just before chunk `chunk_id` is generated
        (chunks 0..chunk_id-1 finished; chunk_id = their count at the end of a stream)."""
        qf, kr = self.quant_factor, self.keep_recent
        if chunk_id < qf + kr or (chunk_id - kr) % qf:
            return []
        a, b = max(chunk_id - qf - kr, self.sink_keep), chunk_id - kr
        return [(a, b)] if a < b else []

    def as_kvforge(self) -> dict:
        """kvforge's names (docs/QUALITY.md chunk policy) for the recon's metadata."""
        return {"sink": self.sink_keep, "recent": self.keep_recent, "span": self.quant_factor}


def tensor_bytes(x) -> int:
    """Bytes of a tensor or array as stored: elements x element size (torch or numpy)."""
    if hasattr(x, "element_size"):
        return int(x.numel()) * int(x.element_size())
    return int(x.nbytes)


def _is_tensor(x) -> bool:
    return hasattr(x, "element_size") or hasattr(x, "nbytes")


class LayerStore:
    """One layer's K and V history under a codec and a policy."""

    def __init__(self, codec, policy: ChunkPolicy):
        self.codec = codec
        self.policy = policy
        self.bf16: list = []   # per chunk: (k, v) native, or None once compressed
        self.span_of: list = []  # per chunk: index into self.spans, or None
        self.spans: list = []  # {"a", "b", "k", "v"} compressed states
        self.tokens: list = []  # per chunk: its token count
        self._bf16_total = 0

    def __len__(self) -> int:
        return len(self.bf16)

    def append(self, k, v) -> None:
        """Chunk len(self) is finished: keep its K and V ([H, N, d] native) in BF16."""
        self.bf16.append((k, v))
        self.span_of.append(None)
        self.tokens.append(int(k.shape[1]))
        self._bf16_total += self.codec.chunk_bytes(k) + self.codec.chunk_bytes(v)

    def apply_policy(self, chunk_id: int | None = None) -> list[tuple[int, int]]:
        """Compress what the policy lets go before chunk `chunk_id` (default: len(self))."""
        done = []
        for a, b in self.policy.spans(len(self) if chunk_id is None else chunk_id):
            if b > len(self) or any(self.span_of[i] is not None for i in range(a, b)):
                raise RuntimeError(f"chunk policy: span [{a}, {b}) is not a run of finished BF16 chunks")
            k = self.codec.cat([self.bf16[i][0] for i in range(a, b)])
            v = self.codec.cat([self.bf16[i][1] for i in range(a, b)])
            sk, sv = self.codec.compress(k, v)
            self.spans.append({"a": a, "b": b, "k": sk, "v": sv})
            for i in range(a, b):
                self.bf16[i] = None
                self.span_of[i] = len(self.spans) - 1
            done.append((a, b))
        return done

    def read(self):
        """The history as the cache returns it: per chunk (k, v, packed), each compressed
        span decompressed once for this read."""
        out, decoded = [], {}
        for i in range(len(self)):
            s = self.span_of[i]
            if s is None:
                out.append((self.bf16[i][0], self.bf16[i][1], False))
                continue
            if s not in decoded:
                decoded[s] = self.codec.decompress(self.spans[s]["k"], self.spans[s]["v"])
            sp, (k, v) = self.spans[s], decoded[s]
            t0 = sum(self.tokens[sp["a"]:i])
            out.append((k[:, t0:t0 + self.tokens[i]], v[:, t0:t0 + self.tokens[i]], True))
        return out

    def keys_values(self):
        """(K, V) [H, N_total, d] of the whole history, or None when empty."""
        parts = self.read()
        if not parts:
            return None
        return self.codec.cat([p[0] for p in parts]), self.codec.cat([p[1] for p in parts])

    def stored_bytes(self) -> dict:
        """Bytes held now, by part: the compressed spans' tensors (as the codec names
        them) and "bf16" for the chunks still in BF16."""
        parts: dict = {}
        for sp in self.spans:
            for st in (sp["k"], sp["v"]):
                for name, n in self.codec.state_bytes(st).items():
                    parts[name] = parts.get(name, 0) + int(n)
        parts["bf16"] = sum(self.codec.chunk_bytes(kv[0]) + self.codec.chunk_bytes(kv[1])
                            for kv in self.bf16 if kv is not None)
        return parts

    def bf16_bytes(self) -> int:
        """What the whole history takes in BF16 (the compression's numerator)."""
        return self._bf16_total


def count_state(state, names: dict, skip=("info",)) -> dict:
    """Bytes of every tensor in a codec state (a dict of tensors, lists of tensors,
    None), by part: names maps the state's keys to part names; a key not in names
    counts under its own name. Keys in skip hold no data (QVG's "info")."""
    parts: dict = {}

    def add(key, x):
        if x is None:
            return
        if isinstance(x, (list, tuple)):
            for y in x:
                add(key, y)
            return
        if isinstance(x, (int, float)):  # a Python scalar the peer keeps (8 bytes)
            parts[names.get(key, key)] = parts.get(names.get(key, key), 0) + 8
            return
        if not _is_tensor(x):
            raise TypeError(f"state[{key!r}]: cannot count the bytes of a {type(x).__name__}")
        parts[names.get(key, key)] = parts.get(names.get(key, key), 0) + tensor_bytes(x)

    for key, x in state.items():
        if key not in skip:
            add(key, x)
    return parts
