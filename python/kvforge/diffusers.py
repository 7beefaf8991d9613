"""A kvforge KV cache inside a diffusers video transformer's self-attention.

Chunked autoregressive video generation over a diffusers transformer (Wan2.1's
``WanTransformer3DModel`` and models built like it, as in CausVid and
Self-Forcing): each chunk of latent frames is denoised over several steps,
attending to the keys and values of every earlier chunk; once the chunk is
final, one more pass computes its keys and values for the cache. Here the
cache is a :class:`kvforge.QuantizedKVCache`, so the earlier chunks are held
packed and decoded when attended to.

    cache = kvforge.QuantizedKVCache("rtn_int2", num_layers=len(model.blocks),
                                     num_kv_heads=heads, head_dim=128, device="cuda", layout="nhd")
    kv = kvforge.diffusers.attach(model, cache)      # installs the processors
    for chunk in range(n_chunks):
        for t in timesteps:                         # read: earlier chunks + this one
            noise_pred = model(latents_chunk, t, prompt_embeds).sample
            ...
        with kv.writing():                          # the final pass: this chunk's K/V into the cache
            model(latents_chunk, t_clean, prompt_embeds)
    kv.detach()                                     # the model's own processors back

The processor implements diffusers' attention-processor interface,
``__call__(attn, hidden_states, encoder_hidden_states=None,
attention_mask=None, rotary_emb=None)``, for attention modules with ``to_q``,
``to_k``, ``to_v`` (or fused ``to_qkv``), ``norm_q``, ``norm_k``, ``heads``,
``to_out`` and RoPE given as ``rotary_emb = (cos, sin)`` over interleaved
channel pairs (diffusers' WanAttention). It does not import diffusers.
Cross-attention modules, and every call while the controller is off, go to
the module's own processor unchanged.

Schemes with ``rope.placement = "pre"`` cache keys before RoPE: give the
chunk's token positions (int32 ``[N, axes]``, e.g. (frame, row, column) with
the frame counted from the start of the video) to ``writing(positions=...)``;
the scheme's RoPE (``rope.layout = "interleaved"``, ``sections`` the model's
per-axis pairs, e.g. {22, 21, 21} for Wan's head_dim 128) then turns them at
decode.
"""
import contextlib

__all__ = ["KVCacheAttnProcessor", "KVCacheController", "attach", "self_attention_modules"]


def _is_self_attention(m) -> bool:
    has_proj = hasattr(m, "to_q") or hasattr(m, "to_qkv")
    return (has_proj and hasattr(m, "heads") and hasattr(m, "to_out") and hasattr(m, "processor")
            and not getattr(m, "is_cross_attention", False))


def self_attention_modules(model) -> list:
    """The self-attention modules of a diffusers transformer, in forward order
    (``named_modules`` order: block 0's first)."""
    return [m for _, m in model.named_modules() if _is_self_attention(m)]


def _apply_rotary(x, cos, sin):
    """diffusers' WanAttnProcessor RoPE: interleaved pairs (2i, 2i+1)."""
    import torch
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * c - x2 * s
    out[..., 1::2] = x1 * s + x2 * c
    return out.type_as(x)


class KVCacheController:
    """The shared state of one model's processors: the cache, and what they do.

    mode ``"read"`` (default): attend to the cached chunks and the current
    tokens; the cache is not changed. ``"write"`` (inside :meth:`writing`):
    the same, then append the current tokens' K/V (and queries, for the query
    statistics) to the cache. ``"off"`` (inside :meth:`off`): the module's own
    processor.
    """

    def __init__(self, cache):
        if getattr(cache, "layout", "nhd") != "nhd":
            raise ValueError("the cache must be built with layout='nhd' (diffusers' [B, N, H, d])")
        self.cache = cache
        self.mode = "read"
        self.positions = None
        self.modules = []
        self._original = []

    @contextlib.contextmanager
    def writing(self, positions=None):
        """Forward passes inside append each layer's K/V of the current tokens."""
        prev = self.mode, self.positions
        self.mode, self.positions = "write", positions
        try:
            yield self
        finally:
            self.mode, self.positions = prev

    @contextlib.contextmanager
    def off(self):
        prev = self.mode
        self.mode = "off"
        try:
            yield self
        finally:
            self.mode = prev

    def detach(self):
        """Give every module its own processor back."""
        for m, p in zip(self.modules, self._original):
            _set_processor(m, p)
        self.modules, self._original = [], []


def _set_processor(module, proc):
    if hasattr(module, "set_processor"):
        module.set_processor(proc)
    else:
        module.processor = proc


class KVCacheAttnProcessor:
    """Self-attention of one layer over [cached chunks, current tokens]."""

    def __init__(self, controller: KVCacheController, layer: int, fallback):
        self.controller = controller
        self.layer = layer
        self.fallback = fallback

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
                 **kwargs):
        ctl = self.controller
        if ctl.mode == "off" or encoder_hidden_states is not None:
            return self.fallback(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb, **kwargs)
        import torch
        F = torch.nn.functional
        if getattr(attn, "fused_projections", False):
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query = query.unflatten(2, (attn.heads, -1))       # [B, N, H, d]
        key = key.unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        q_pre, k_pre = query, key
        if rotary_emb is not None:
            query = _apply_rotary(query, *rotary_emb)
            key = _apply_rotary(key, *rotary_emb)

        cache = ctl.cache
        batched = getattr(cache, "batch_size", None) is not None
        if not batched and hidden_states.shape[0] != 1:
            raise ValueError(f"batch of {hidden_states.shape[0]}: build the QuantizedKVCache with "
                             f"batch_size={hidden_states.shape[0]}")
        k_all, v_all = key, value
        if cache.num_tokens(self.layer):
            K, V = cache.keys_values(self.layer)              # BF16 [T, H, d] or [B, T, H, d]
            if not batched:
                K, V = K[None], V[None]
            k_all = torch.cat([K.to(key.dtype), key], dim=1)  # attention in the model's dtype
            v_all = torch.cat([V.to(value.dtype), value], dim=1)
        out = F.scaled_dot_product_attention(query.transpose(1, 2), k_all.transpose(1, 2), v_all.transpose(1, 2),
                                             attn_mask=attention_mask, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).flatten(2, 3).type_as(query)

        if ctl.mode == "write":
            pre = cache.info.rope_placement == "pre"
            k_in, q_in = (k_pre, q_pre) if pre else (key, query)
            k_in, v_in, q_in = (x.to(torch.bfloat16) for x in (k_in, value, q_in))
            if not batched:
                k_in, v_in, q_in = k_in[0], v_in[0], q_in[0]
            cache.append(self.layer, k_in, v_in, q=q_in if cache.uses_qstats else None,
                         positions=ctl.positions if pre else None)

        out = attn.to_out[0](out)
        if len(attn.to_out) > 1:
            out = attn.to_out[1](out)
        return out


def attach(model, cache) -> KVCacheController:
    """Install a :class:`KVCacheAttnProcessor` on every self-attention module of a
    diffusers transformer (layer i = the i-th in forward order); the cache needs
    that many layers and layout="nhd". Returns the controller."""
    ctl = KVCacheController(cache)
    mods = self_attention_modules(model)
    if not mods:
        raise ValueError("no self-attention module (to_q/to_qkv, heads, to_out, processor) in this model")
    if len(mods) != cache.num_layers:
        raise ValueError(f"the model has {len(mods)} self-attention layers, the cache {cache.num_layers}")
    for i, m in enumerate(mods):
        if m.heads != cache.num_kv_heads:
            raise ValueError(f"layer {i} has {m.heads} heads, the cache {cache.num_kv_heads} KV heads")
        ctl.modules.append(m)
        ctl._original.append(m.processor)
        _set_processor(m, KVCacheAttnProcessor(ctl, i, m.processor))
    return ctl
