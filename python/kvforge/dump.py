"""Dump a model's Q, K and V for `kvforge eval` (docs/QUALITY.md, "Dump format").

Evaluate a scheme on your own model: record each layer's queries, keys and
values chunk by chunk while it generates, save, and run

    out/bin/kvforge eval --scheme rtn_int2 --data my_model.safetensors

Two ways to record:

* :meth:`KVDump.record` from your attention code: ``dump.record(layer, chunk, q, k, v)``
  with q ``[Hq, Nq, d]``, k and v ``[Hkv, N, d]`` (``layout="nhd"``: ``[N, H, d]``;
  a leading batch dimension takes ``batch_index``), the chunk's own tokens,
  keys after RoPE; ``k_pre``/``q_pre`` (before RoPE) and ``positions`` make the
  dump usable for ``rope.placement = "pre"`` schemes.
* :meth:`KVDump.capture_sdpa`: a context manager that sees every call of
  ``torch.nn.functional.scaled_dot_product_attention`` while one chunk is
  generated, and records the self-attention ones, in call order, as layers
  0, 1, ...: q ``[B, Hq, Nq, d]``, and the last Nq tokens of k and v (the
  chunk's own; the model's cache of earlier chunks comes before them). A call
  whose keys are fewer than its queries (cross-attention to a text prompt) is
  skipped; ``select(q, k, v) -> bool`` decides instead where that is not enough.

``q_stride`` keeps every q_stride-th query (the dump's ``q_subsample``): the
metrics need far fewer queries than a chunk has. Tensors are copied to host
memory as BF16 when recorded and written by :meth:`save` with safetensors.
Needs torch and safetensors.
"""
import contextlib
import os

__all__ = ["KVDump"]


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("kvforge.dump needs PyTorch (pip install torch)") from e
    return torch


class KVDump:
    """Q, K, V of a model, per layer and chunk, for `kvforge eval --data`.

    rope_theta, rope_sections: the model's RoPE (sections: frequency pairs per
    position axis, summing to head_dim / 2; default one axis). ``kvforge eval``
    checks them against a "pre" scheme's. source: free text shown in the report.
    """

    def __init__(self, path, *, rope_theta: float = 10000.0, rope_sections=None, q_stride: int = 1,
                 layout: str = "hnd", batch_index: int = 0, source: str = ""):
        if layout not in ("hnd", "nhd"):
            raise ValueError(f"layout must be 'hnd' or 'nhd', got {layout!r}")
        if not isinstance(q_stride, int) or q_stride < 1:
            raise ValueError(f"q_stride must be a positive int, got {q_stride!r}")
        if not rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {rope_theta!r}")
        self.path = os.fspath(path)
        self.rope_theta = float(rope_theta)
        self.rope_sections = None if rope_sections is None else [int(s) for s in rope_sections]
        self.q_stride = q_stride
        self.layout = layout
        self.batch_index = batch_index
        self.source = source
        self._t = {}           # name -> CPU bf16 tensor
        self._pos = {}         # chunk -> int32 [N, A]
        self.shape = None      # (q_heads, kv_heads, tokens_per_chunk, head_dim)

    # ------------------------------------------------------------ recording
    def _hnd(self, x, name, layout):
        torch = _torch()
        if not isinstance(x, torch.Tensor):
            import numpy as np
            x = np.asarray(x)
            x = torch.from_numpy(x.astype(np.float32) if x.dtype != np.uint16 else x.view(np.int16))
            if x.dtype == torch.int16:
                x = x.view(torch.bfloat16)
        if x.dim() == 4:
            x = x[self.batch_index]
        if x.dim() != 3:
            raise ValueError(f"{name}: expected [H, N, d] or [N, H, d] (or with a batch dimension), got "
                             f"shape {tuple(x.shape)}")
        if layout == "nhd":
            x = x.transpose(0, 1)
        return x.detach().to("cpu", torch.bfloat16).contiguous()

    def record(self, layer: int, chunk: int, q, k, v, *, k_pre=None, q_pre=None, positions=None,
               layout: str = None):
        """Record one (layer, chunk): the chunk's queries and its own keys and values."""
        layout = layout or self.layout
        torch = _torch()
        q = self._hnd(q, "q", layout)[:, ::self.q_stride].contiguous()
        k, v = self._hnd(k, "k", layout), self._hnd(v, "v", layout)
        if k.shape != v.shape:
            raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ")
        shape = (q.shape[0], k.shape[0], k.shape[1], k.shape[2])
        if q.shape[2] != k.shape[2] or q.shape[0] % k.shape[0]:
            raise ValueError(f"q {tuple(q.shape)} does not go with k {tuple(k.shape)} (same head_dim, "
                             f"query heads a multiple of KV heads)")
        if self.shape is None:
            self.shape = shape
        elif shape != self.shape:
            raise ValueError(f"layer {layer} chunk {chunk}: (q_heads, kv_heads, tokens, head_dim) = {shape}, "
                             f"earlier records had {self.shape} (every chunk must have the same shape)")
        key = f"l{int(layer)}.c{int(chunk)}"
        if f"{key}.k" in self._t:
            raise ValueError(f"layer {layer} chunk {chunk} is already recorded")
        self._t[f"{key}.q"], self._t[f"{key}.k"], self._t[f"{key}.v"] = q, k, v
        if k_pre is not None:
            kp = self._hnd(k_pre, "k_pre", layout)
            if kp.shape != k.shape:
                raise ValueError(f"k_pre {tuple(kp.shape)} differs from k {tuple(k.shape)}")
            self._t[f"{key}.k_pre"] = kp
        if q_pre is not None:
            qp = self._hnd(q_pre, "q_pre", layout)[:, ::self.q_stride].contiguous()
            if qp.shape != q.shape:
                raise ValueError(f"q_pre {tuple(qp.shape)} differs from q {tuple(q.shape)}")
            self._t[f"{key}.q_pre"] = qp
        if positions is not None:
            p = positions if isinstance(positions, torch.Tensor) else torch.as_tensor(positions)
            p = p.reshape(k.shape[1], -1)
            if p.numel() and (int(p.min()) < -2**31 or int(p.max()) >= 2**31):
                raise ValueError("positions do not fit in int32")
            self._pos[int(chunk)] = p.to("cpu", torch.int32).contiguous()

    @contextlib.contextmanager
    def capture_sdpa(self, chunk: int, *, select=None, first_layer: int = 0):
        """Record every self-attention SDPA call made inside the block as layers
        first_layer, first_layer + 1, ... of ``chunk`` (see the module's text)."""
        torch = _torch()
        F = torch.nn.functional
        real = F.scaled_dot_product_attention
        layer = [first_layer]

        def hooked(query, key, value, *args, **kwargs):
            nq = query.shape[-2]
            take = select(query, key, value) if select is not None else key.shape[-2] >= nq
            if take:
                self.record(layer[0], chunk, query, key[..., -nq:, :], value[..., -nq:, :], layout="hnd")
                layer[0] += 1
            return real(query, key, value, *args, **kwargs)

        F.scaled_dot_product_attention = hooked
        try:
            yield self
        finally:
            F.scaled_dot_product_attention = real

    # ---------------------------------------------------------------- save
    def layers_chunks(self):
        names = [n for n in self._t if n.endswith(".k")]
        layers = 1 + max(int(n.split(".")[0][1:]) for n in names)
        chunks = 1 + max(int(n.split(".")[1][1:]) for n in names)
        return layers, chunks

    def save(self):
        """Write the dump (checking that every layer has every chunk). Returns the path."""
        if not self._t:
            raise ValueError("nothing recorded")
        from safetensors.torch import save_file
        torch = _torch()
        layers, chunks = self.layers_chunks()
        missing = [f"l{l}.c{c}" for l in range(layers) for c in range(chunks) if f"l{l}.c{c}.k" not in self._t]
        if missing:
            raise ValueError(f"the dump needs q, k, v of every (layer, chunk): missing {missing[:8]}")
        qh, kvh, n, d = self.shape
        tensors = dict(self._t)
        if self._pos:
            if sorted(self._pos) != list(range(chunks)):
                raise ValueError(f"positions recorded for chunks {sorted(self._pos)}, the dump has {chunks}")
            tensors["pos"] = torch.cat([self._pos[c] for c in range(chunks)])
        sections = self.rope_sections or [d // 2]
        meta = {"layers": str(layers), "chunks": str(chunks), "q_heads": str(qh), "kv_heads": str(kvh),
                "head_dim": str(d), "tokens_per_chunk": str(n), "rope_theta": repr(self.rope_theta),
                "rope_sections": ",".join(str(s) for s in sections),
                "q_subsample": f"every {self.q_stride}th query" if self.q_stride > 1 else "all queries",
                "source": self.source or "kvforge.dump"}
        save_file(tensors, self.path, metadata=meta)
        return self.path
