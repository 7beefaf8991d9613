"""A miniature autoregressive video world model with the token geometry of a 480p model.

Frames of 240 x 416 pixels are cut into 8 x 8 patches: 30 x 52 = 1560 tokens per
frame; a chunk is 3 frames = 4680 tokens. Each transformer layer has 2 heads of
head_dim 128 (width 256), RMS-normalised q and k (as Wan-family models do) and
3D RoPE over (frame, row, column) on q and k; attention is chunk-causal: the
tokens of chunk t attend to every token of chunks <= t (bidirectionally inside
chunk t). From chunk t the model predicts chunk t+1 (deterministic regression:
token (j, y, x) of chunk t outputs patch (y, x) of frame j of chunk t+1, as the
last frame of chunk t plus a learned correction).

Inference runs chunk by chunk with a per-layer KV cache object: anything with
`keys_values(layer)` -> None or (K, V) [Hkv, N, d] and
`append(layer, k, v, q=None, k_pre=None, q_pre=None, positions=None)`
(see kvcache.py: BF16Cache, and KvforgeCache over kvforge.QuantizedKVCache).
Training runs a window of chunks in one call with the same attention code
(chunk t's queries against the keys of chunks <= t), so the two agree.

RoPE follows kvforge's docs/METHODS.md section 6 exactly (layout "half": pair p
rotates channels p and p + d/2; pairs cut into sections (16, 24, 24) for the axes
(frame, row, column); angle = pos_a * theta^(-2 p_a / d_a), inverse frequencies
computed in f64 and rounded to f32, angles and rotation in f32), so a kvforge
scheme with rope.placement = "pre" reproduces the model's keys.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class WMConfig:
    grid_h: int = 30              # patches per column
    grid_w: int = 52              # patches per row
    patch: int = 8                # pixels per patch side
    channels: int = 3             # RGB
    frames_per_chunk: int = 3
    width: int = 256
    heads: int = 2
    kv_heads: int = 2
    head_dim: int = 128
    layers: int = 6
    mlp_ratio: int = 4
    rope_theta: float = 10000.0
    rope_sections: tuple = field(default=(16, 24, 24))   # pairs for (frame, row, column)
    qk_norm: bool = True

    def __post_init__(self):
        self.rope_sections = tuple(int(s) for s in self.rope_sections)
        if sum(self.rope_sections) * 2 != self.head_dim:
            raise ValueError(f"rope_sections {self.rope_sections} must sum to head_dim/2 = {self.head_dim // 2}")
        if len(self.rope_sections) != 3:
            raise ValueError("rope_sections: three axes (frame, row, column)")
        if self.heads % self.kv_heads:
            raise ValueError("heads must be a multiple of kv_heads")

    @property
    def tokens_per_frame(self) -> int:
        return self.grid_h * self.grid_w

    @property
    def tokens_per_chunk(self) -> int:
        return self.frames_per_chunk * self.tokens_per_frame

    @property
    def patch_dim(self) -> int:
        return self.patch * self.patch * self.channels

    @property
    def frame_hw(self) -> tuple:
        return self.grid_h * self.patch, self.grid_w * self.patch

    @property
    def q_dim(self) -> int:
        """Width of the query/output projection: heads * head_dim (need not equal `width`)."""
        return self.heads * self.head_dim

    def to_json(self) -> str:
        d = asdict(self)
        d["rope_sections"] = list(self.rope_sections)
        return json.dumps(d, sort_keys=True)

    @classmethod
    def from_json(cls, s: str) -> "WMConfig":
        return cls(**json.loads(s))


# Named model sizes; the token geometry (1560 tokens a frame, 3 frames a chunk,
# head_dim 128, RoPE sections (16, 24, 24)) is the same for all of them.
#   small: the committed model (weights.safetensors): 6 layers, 2 heads (MHA), width 256.
#   large: 8 layers, 8 query heads over 2 KV heads (GQA: 4 query heads share a KV head,
#          as in Wan-family and most current video models), q/o projections of
#          8 x 128 = 1024 channels on a residual width of 256, MLP 2x: 7.4 M parameters
#          (14.8 MB in fp16, one file under 16 MiB). Its attention costs 5.3 times the
#          small model's per token (4x the heads, 8/6 the layers), which is what the
#          training time is spent on; the width barely matters for it.
PRESETS = {
    "small": {},
    "large": dict(width=256, heads=8, kv_heads=2, head_dim=128, layers=8, mlp_ratio=2),
}


def preset_config(name: str, **overrides) -> "WMConfig":
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r} (have {sorted(PRESETS)})")
    return WMConfig(**{**PRESETS[name], **overrides})


# ----------------------------------------------------------------------------- pixels <-> tokens
def frames_to_patches(frames: torch.Tensor, cfg: WMConfig) -> torch.Tensor:
    """uint8/float frames [..., F, H, W, C] -> float patches in [-1, 1], [..., F * grid_h * grid_w, P*P*C]
    (frame-major, then row, then column; inside a patch (py, px, c))."""
    *lead, nf, h, w, c = frames.shape
    p = cfg.patch
    assert (h, w, c) == (*cfg.frame_hw, cfg.channels), (h, w, c)
    x = frames.float() / 127.5 - 1.0
    x = x.reshape(*lead, nf, cfg.grid_h, p, cfg.grid_w, p, c)
    x = x.movedim(-4, -3)  # [..., F, gh, gw, p, p, c]
    return x.reshape(*lead, nf * cfg.tokens_per_frame, cfg.patch_dim)


def patches_to_frames(x: torch.Tensor, cfg: WMConfig) -> torch.Tensor:
    """Inverse of frames_to_patches: float patches [..., F*1560, 192] -> float pixels in [0, 255]
    [..., F, H, W, C] (clamped, not rounded)."""
    *lead, n, pd = x.shape
    p = cfg.patch
    nf = n // cfg.tokens_per_frame
    x = x.float().reshape(*lead, nf, cfg.grid_h, cfg.grid_w, p, p, cfg.channels)
    x = x.movedim(-3, -4)
    x = x.reshape(*lead, nf, cfg.grid_h * p, cfg.grid_w * p, cfg.channels)
    return ((x + 1.0) * 127.5).clamp(0, 255)


def chunk_positions(chunk: int, cfg: WMConfig, n_chunks: int = 1) -> torch.Tensor:
    """int32 [n_chunks * tokens_per_chunk, 3]: (frame index, row, column) of every token of
    chunks chunk .. chunk + n_chunks - 1; frame index = chunk * frames_per_chunk + j."""
    f0 = chunk * cfg.frames_per_chunk
    t = torch.arange(f0, f0 + n_chunks * cfg.frames_per_chunk, dtype=torch.int32)
    y = torch.arange(cfg.grid_h, dtype=torch.int32)
    x = torch.arange(cfg.grid_w, dtype=torch.int32)
    tt, yy, xx = torch.meshgrid(t, y, x, indexing="ij")
    return torch.stack([tt.reshape(-1), yy.reshape(-1), xx.reshape(-1)], 1).contiguous()


# ----------------------------------------------------------------------------- RoPE
def rope_tables(cfg: WMConfig):
    """(axis of each pair [d/2] int64, f32 inverse frequency of each pair [d/2])."""
    axes, inv = [], []
    log2_theta = math.log2(cfg.rope_theta)
    for a, n in enumerate(cfg.rope_sections):
        d_a = 2 * n
        for p_a in range(n):
            axes.append(a)
            inv.append(2.0 ** (-(2.0 * p_a / d_a) * log2_theta))   # f64, rounded to f32 below
    return torch.tensor(axes, dtype=torch.int64), torch.tensor(inv, dtype=torch.float64).to(torch.float32)


def rope_cos_sin(positions: torch.Tensor, cfg: WMConfig, device=None):
    """cos, sin f32 [N, d/2] for int32 positions [N, 3]."""
    axes, inv = rope_tables(cfg)
    device = device if device is not None else positions.device
    pos = positions.to(device)[:, axes.to(device)].to(torch.float32)
    ang = pos * inv.to(device)[None, :]
    return torch.cos(ang), torch.sin(ang)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., N, d] (any float dtype) -> f32 rotated; "half" layout: (p, p + d/2) pairs."""
    h = x.shape[-1] // 2
    xf = x.float()
    a, b = xf[..., :h], xf[..., h:]
    return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)


# ----------------------------------------------------------------------------- layers
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def gqa_flash_check(device) -> bool:
    """On CUDA: whether SDPA's flash kernel takes enable_gqa here (a small bf16 call with only
    that kernel allowed). If not, attend() repeats the KV heads instead, so attention never
    falls back to the math kernel, which would hold the whole score matrix. Returns whether
    enable_gqa stays in use."""
    global _SDPA_GQA
    if not _SDPA_GQA or torch.device(device).type != "cuda":
        return _SDPA_GQA
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        q = torch.randn(1, 4, 64, 128, device=device, dtype=torch.bfloat16)
        k = torch.randn(1, 2, 64, 128, device=device, dtype=torch.bfloat16)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, k, k, enable_gqa=True)
    except (RuntimeError, ImportError):
        _SDPA_GQA = False
    return _SDPA_GQA


def attend(q, k, v):
    """softmax(q k^T / sqrt(d)) v for q [B, Hq, Nq, d] and k, v [B, Hkv, N, d], Hq a multiple of
    Hkv: query head h reads KV head h // (Hq / Hkv) (the grouping of repeat_interleave). SDPA's
    enable_gqa (torch >= 2.5) reads the KV heads in place; the repeated copy it avoids would be
    Hq / Hkv times the cache's size for every attention call of a long stream."""
    if q.shape[1] != k.shape[1]:
        if _SDPA_GQA:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v)

class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()


class Attention(nn.Module):
    def __init__(self, cfg: WMConfig):
        super().__init__()
        self.cfg = cfg
        hq, hk, d = cfg.heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.width, hq * d, bias=False)
        self.wk = nn.Linear(cfg.width, hk * d, bias=False)
        self.wv = nn.Linear(cfg.width, hk * d, bias=False)
        self.wo = nn.Linear(hq * d, cfg.width, bias=False)
        if cfg.qk_norm:
            self.norm_q = RMSNorm(hq * d)
            self.norm_k = RMSNorm(hk * d)

    def project(self, x, cos, sin):
        """The heads of x [B, N, width] with cos/sin [N, d/2]: (q, k, v, q_pre, k_pre), where q
        [B, Hq, N, d] and k, v [B, Hkv, N, d] are in the compute dtype (autocast's where it is
        on, else x's; q and k RoPE-rotated) and q_pre, k_pre are q and k before RoPE in f32."""
        cfg = self.cfg
        B, N, _ = x.shape
        hq, hk, d = cfg.heads, cfg.kv_heads, cfg.head_dim
        dt = x.dtype if not torch.is_autocast_enabled(x.device.type) else torch.get_autocast_dtype(x.device.type)
        q, k, v = self.wq(x), self.wk(x), self.wv(x)
        if cfg.qk_norm:
            q, k = self.norm_q(q), self.norm_k(k)
        q_pre = q.float().view(B, N, hq, d).transpose(1, 2)           # [B, Hq, N, d] f32
        k_pre = k.float().view(B, N, hk, d).transpose(1, 2)
        v = v.view(B, N, hk, d).transpose(1, 2).to(dt)
        q = apply_rope(q_pre, cos, sin).to(dt)
        k = apply_rope(k_pre, cos, sin).to(dt)
        return q, k, v, q_pre, k_pre

    def forward(self, x, cos, sin, n_chunks, layer, cache=None, positions=None):
        """x [B, T*Nc, width] for T = n_chunks consecutive chunks; cos/sin [T*Nc, d/2].
        Chunk i of x attends to the cache's tokens (all earlier chunks) and to chunks <= i of x.
        With a cache (B = 1), each chunk's K, V (and Q) are appended after use."""
        cfg = self.cfg
        B, N, _ = x.shape
        hq, d = cfg.heads, cfg.head_dim
        q, k, v, q_pre, k_pre = self.project(x, cos, sin)
        dt = q.dtype                                                  # the compute dtype
        nc = N // n_chunks
        past = cache.keys_values(layer) if cache is not None else None
        if past is not None:
            pk, pv = past
            pk = pk.to(device=k.device, dtype=dt).unsqueeze(0).expand(B, -1, -1, -1)
            pv = pv.to(device=v.device, dtype=dt).unsqueeze(0).expand(B, -1, -1, -1)
            k_all, v_all = torch.cat([pk, k], 2), torch.cat([pv, v], 2)
            n_past = pk.shape[2]
        else:
            k_all, v_all, n_past = k, v, 0
        outs = []
        for i in range(n_chunks):
            qi = q[:, :, i * nc:(i + 1) * nc]
            end = n_past + (i + 1) * nc
            outs.append(attend(qi, k_all[:, :, :end], v_all[:, :, :end]))
        o = torch.cat(outs, 2) if n_chunks > 1 else outs[0]
        if cache is not None:
            for i in range(n_chunks):
                s = slice(i * nc, (i + 1) * nc)
                cache.append(layer, k[0, :, s], v[0, :, s], q=q[0, :, s],
                             k_pre=k_pre[0, :, s].to(dt), q_pre=q_pre[0, :, s].to(dt),
                             positions=None if positions is None else positions[s])
        o = o.transpose(1, 2).reshape(B, N, hq * d)
        return self.wo(o)


class Block(nn.Module):
    def __init__(self, cfg: WMConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.width)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.mlp = nn.Sequential(nn.Linear(cfg.width, cfg.mlp_ratio * cfg.width), nn.GELU(approximate="tanh"),
                                 nn.Linear(cfg.mlp_ratio * cfg.width, cfg.width))

    def forward(self, x, cos, sin, n_chunks, layer, cache=None, positions=None):
        x = x + self.attn(self.ln1(x), cos, sin, n_chunks, layer, cache, positions)
        return x + self.mlp(self.ln2(x))


class WorldModel(nn.Module):
    def __init__(self, cfg: WMConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Linear(cfg.patch_dim, cfg.width)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.layers)])
        self.ln_out = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.patch_dim)
        self.reset_parameters()

    def reset_parameters(self):
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        for b in self.blocks:
            nn.init.normal_(b.attn.wo.weight, std=0.02 / math.sqrt(2 * self.cfg.layers))
            nn.init.normal_(b.mlp[2].weight, std=0.02 / math.sqrt(2 * self.cfg.layers))
        # The head starts at zero: an untrained model copies the last frame.
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, patches: torch.Tensor, chunk0: int = 0, cache=None) -> torch.Tensor:
        """patches [B, T*Nc, patch_dim] in [-1, 1]: T consecutive chunks, the first with chunk
        index chunk0 (RoPE frame positions 3*chunk0 ...). Returns the predicted next chunk of
        each: [B, T*Nc, patch_dim]. Chunk-causal; with a cache (B = 1) the chunks' K/V are
        appended to it layer by layer (the cache must hold exactly chunks < chunk0)."""
        cfg = self.cfg
        B, N, _ = patches.shape
        nc, tpf = cfg.tokens_per_chunk, cfg.tokens_per_frame
        if N % nc:
            raise ValueError(f"{N} tokens is not a whole number of {nc}-token chunks")
        if cache is not None and B != 1:
            raise ValueError("a KV cache holds one sequence: batch must be 1")
        T = N // nc
        pos = chunk_positions(chunk0, cfg, T)
        cos, sin = rope_cos_sin(pos, cfg, patches.device)
        pos = pos.to(patches.device)
        x = self.embed(patches)
        for li, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, T, li, cache, pos)
        delta = self.head(self.ln_out(x)).float()
        # Base: the last frame of each input chunk, for all frames of the next chunk.
        last = patches.float().view(B, T, cfg.frames_per_chunk, tpf, cfg.patch_dim)[:, :, -1:]
        base = last.expand(B, T, cfg.frames_per_chunk, tpf, cfg.patch_dim).reshape(B, N, cfg.patch_dim)
        return base + delta


# ----------------------------------------------------------------------------- weights
MAX_SHARD_BYTES = 16 * 2 ** 20 - 2 ** 16   # a file returned from the GPU machine is at most 16 MiB


def shard_path(path: str, i: int) -> str:
    """File of shard i (i >= 1) of the weights whose first file is `path`: NAME.shardI.safetensors."""
    stem = path[:-len(".safetensors")] if path.endswith(".safetensors") else path
    return f"{stem}.shard{i}.safetensors"


def save_weights(model: WorldModel, path: str, extra_meta: dict | None = None,
                 max_shard_bytes: int = MAX_SHARD_BYTES) -> list:
    """fp16 weights to safetensors; returns the files written. Up to `max_shard_bytes` of tensor
    data a file: the first file is `path` and its metadata lists every file ("shards", names
    relative to its folder); shard i >= 1 is shard_path(path, i). A model under the limit is one
    file, as before (no "shards" key)."""
    import os
    from safetensors.torch import save_file
    sd = {k: v.detach().to("cpu", torch.float16).contiguous() for k, v in model.state_dict().items()}
    meta = {"config": model.cfg.to_json(), "format": "kvforge-worldmodel-v1"}
    for k, v in (extra_meta or {}).items():
        meta[k] = v if isinstance(v, str) else json.dumps(v, sort_keys=True)
    groups, cur, size = [], {}, 0
    for k, v in sd.items():                       # state_dict order: a deterministic split
        nb = v.numel() * v.element_size()
        if nb > max_shard_bytes:
            raise ValueError(f"tensor {k} alone ({nb} bytes) is over the shard limit {max_shard_bytes}")
        if cur and size + nb > max_shard_bytes:
            groups.append(cur)
            cur, size = {}, 0
        cur[k] = v
        size += nb
    groups.append(cur)
    files = [path] + [shard_path(path, i) for i in range(1, len(groups))]
    if len(groups) > 1:
        meta["shards"] = json.dumps([os.path.basename(f) for f in files])
    for i, (f, g) in enumerate(zip(files, groups)):
        save_file(g, f, metadata=meta if i == 0 else {"format": "kvforge-worldmodel-v1-shard",
                                                      "shard": f"{i} of {len(groups)}"})
    return files


def weight_files(path: str) -> list:
    """Every file of the weights whose first file is `path` (one, or the shards it lists)."""
    import os
    from safetensors import safe_open
    with safe_open(path, "pt") as f:
        meta = f.metadata() or {}
    if "shards" not in meta:
        return [path]
    d = os.path.dirname(os.path.abspath(path))
    return [os.path.join(d, n) for n in json.loads(meta["shards"])]


def load_weights(path: str, device="cpu") -> WorldModel:
    from safetensors import safe_open
    sd = {}
    meta = None
    for i, fp in enumerate(weight_files(path)):
        with safe_open(fp, "pt") as f:
            if i == 0:
                meta = f.metadata()
            for k in f.keys():
                if k in sd:
                    raise ValueError(f"{fp}: tensor {k} is in two shards")
                sd[k] = f.get_tensor(k).float()
    model = WorldModel(WMConfig.from_json(meta["config"]))
    model.load_state_dict(sd)
    return model.to(device).eval()


def weights_sha256(path: str) -> str:
    """sha256 of the weights: the file's for one file; for shards, of their bytes concatenated
    in order (first file first)."""
    import hashlib
    h = hashlib.sha256()
    for fp in weight_files(path):
        with open(fp, "rb") as f:
            for b in iter(lambda: f.read(1 << 20), b""):
                h.update(b)
    return h.hexdigest()


def load_model_and_frames(weights: str, device, frames_path: str | None = None, synthetic: int = 0,
                          seed: int = 0):
    """The model of `weights` on `device` and the frames it runs on: `synthetic`
    synthetic frames (seed `seed`, at the model's frame size) when > 0, else
    the frames file `frames_path` (`make data`). The common start of dump_kv.py
    and rollout.py. Returns (model, frames uint8 [F, H, W, 3], info):
    info["heldout_start"] is the first held-out frame (the file's, or 80% of a
    synthetic video), info["frames_sha256"] the frames' sha256 ('?' when a file
    does not record it)."""
    from frames import frames_sha256, load_frames, synthetic_frames
    model = load_weights(weights, device)
    gqa_flash_check(device)
    if synthetic:
        h, w = model.cfg.frame_hw
        frames = synthetic_frames(synthetic, h, w, seed=seed)
        return model, frames, {"heldout_start": int(round(synthetic * 0.8)), "frames_sha256": frames_sha256(frames)}
    frames, meta = load_frames(frames_path)
    return model, frames, {"heldout_start": int(meta["heldout_start"]),
                           "frames_sha256": meta.get("frames_sha256", "?")}


def file_sha256(path: str) -> str:
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


# ----------------------------------------------------------------------------- generation
@torch.no_grad()
def generate(model: WorldModel, prompt: torch.Tensor, n_new: int, cache, on_chunk=None) -> torch.Tensor:
    """Autoregressive rollout. prompt: patches [1, P*Nc, patch_dim] of P >= 1 real chunks, fed
    one by one (teacher forced); then each predicted chunk (clamped to [-1, 1]) is fed back.
    The cache must be empty; it ends holding the P + n_new - 1 chunks fed. Returns the n_new
    predicted chunks [1, n_new*Nc, patch_dim] (the first predicted from the last prompt chunk).
    on_chunk(i, pred_chunk) is called after each prediction."""
    nc = model.cfg.tokens_per_chunk
    P = prompt.shape[1] // nc
    if P < 1 or prompt.shape[1] % nc:
        raise ValueError("prompt: a whole, positive number of chunks")
    out = []
    pred = None
    for c in range(P + n_new - 1):
        inp = prompt[:, c * nc:(c + 1) * nc] if c < P else pred
        pred = model(inp, chunk0=c, cache=cache).clamp(-1.0, 1.0)
        if c >= P - 1:
            out.append(pred)
            if on_chunk is not None:
                on_chunk(len(out) - 1, pred)
    return torch.cat(out, 1)
