"""Dump the world model's Q, K (before and after RoPE) and V, per layer and chunk, to safetensors.

The model runs chunk by chunk over held-out frames with a BF16 KV cache, either
teacher forced (every chunk fed is real footage: the default) or autoregressive
(one real chunk, then its own predictions fed back). Tensors, all BF16:

  l{l}.c{c}.q      [Hq,  Nq, d]  queries after RoPE (what the model attends with)
  l{l}.c{c}.q_pre  [Hq,  Nq, d]  queries before RoPE
  l{l}.c{c}.k      [Hkv, N,  d]  keys after RoPE (what a "post" scheme caches)
  l{l}.c{c}.k_pre  [Hkv, N,  d]  keys before RoPE (what a "pre" scheme caches)
  l{l}.c{c}.v      [Hkv, N,  d]
  pos              int32 [chunks * N, 3]: (frame, row, column) of every token, frame
                   counted from the dump's first frame (chunk c: frames 3c..3c+2)

for l < layers and c < chunks (the format of docs/QUALITY.md that `kvforge eval`
reads): l numbers the dumped layers, model layer `model_layers[l]`. N = 4680
tokens per chunk, token order frame-major then row then column. Queries may be
subsampled: Nq = ceil(N / q_subsample), the query tokens kept being 0, s, 2s,
... of each chunk (their positions are pos rows c*N + i*s). Chunk c's queries
attend to keys of chunks <= c. `__metadata__` (strings): layers, chunks (counts),
model_layers (comma-separated model layer of each dumped layer),
n_layers_model, q_heads, kv_heads, head_dim, tokens_per_chunk,
frames_per_chunk, grid ("30,52"), rope_theta, rope_sections ("16,24,24"),
rope_layout ("half"), q_subsample, q_tokens_per_chunk, q_pre, mode, source
(frames, weights sha256), weights_sha256.

Presets:
  --preset small  the committed test dump: the middle layer, chunks 0-1, q_subsample 8
                  (15.7 MB; chunk 0's queries give chunk 1's keys their statistics)
  --preset full   every layer, 8 chunks, every query (for GPU-side evaluation; ~0.8 GB)
  --preset long   a long stream: autoregressive, 32 chunks (1 real, 31 generated: the last
                  step attends 149,760 keys), 3 layers spread over the model (first,
                  middle, last), every 256th query (~0.7 GB: kept on the GPU
                  machine, evaluated there)

--cache-scheme S (autoregressive mode) generates the stream through scheme S's cache
(each chunk predicted from the compressed cache of the chunks before it) and dumps the
exact Q, K, V the model produced along that trajectory; without it the stream is the
BF16 rollout's. `kvforge eval` then replays the scheme on those exact tensors.
"""
from __future__ import annotations

import argparse
import math
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from kvcache import KvforgeCache, RecordingCache  # noqa: E402
from model import frames_to_patches, generate, load_model_and_frames, weights_sha256  # noqa: E402


def parse_layers(s, n_layers):
    """'all', 'mid', 'spreadK' (K layers evenly spread, first and last included) or indices."""
    if s in ("all", "*"):
        return list(range(n_layers))
    if s == "mid":
        return [n_layers // 2]
    if s.startswith("spread"):
        k = max(1, min(n_layers, int(s[len("spread"):] or 3)))
        return sorted({round(i * (n_layers - 1) / max(1, k - 1)) for i in range(k)}) if k > 1 else [n_layers // 2]
    out = sorted({int(x) for x in s.split(",")})
    for x in out:
        if not 0 <= x < n_layers:
            raise SystemExit(f"--layers: {x} is not a layer of this {n_layers}-layer model")
    return out


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--weights", required=True)
    ap.add_argument("--frames", help="frames file from `make data`")
    ap.add_argument("--synthetic", type=int, default=0, help="N synthetic frames instead (tests)")
    ap.add_argument("--seed", type=int, default=1234, help="seed of the synthetic frames")
    ap.add_argument("--out", required=True, help="safetensors file to write")
    ap.add_argument("--preset", choices=["small", "full", "long"], default=None)
    ap.add_argument("--layers", default=None, help="'all', 'mid' or comma-separated indices")
    ap.add_argument("--chunks", type=int, default=None, help="chunks to run and dump (from chunk 0)")
    ap.add_argument("--q-stride", type=int, default=None, help="keep every s-th query token")
    ap.add_argument("--no-q-pre", action="store_true", help="leave out the pre-RoPE queries")
    ap.add_argument("--start", type=int, default=None, help="first frame (default: the held-out split's)")
    ap.add_argument("--mode", choices=["teacher", "autoregressive"], default=None,
                    help="default: teacher (autoregressive for --preset long)")
    ap.add_argument("--cache-scheme", default=None,
                    help="autoregressive mode: generate through this kvforge scheme's cache (name or .lua)")
    ap.add_argument("--kvforge-python", default=os.path.join(REPO, "python"),
                    help="folder holding the kvforge package (for --cache-scheme)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    presets = {"small": ("mid", 2, 8, "teacher"), "full": ("all", 8, 1, "teacher"),
               "long": ("spread3", 32, 256, "autoregressive"), None: ("mid", 2, 8, "teacher")}
    pl, pc, ps, pm = presets[a.preset]
    a.layers = a.layers or pl
    a.chunks = a.chunks or pc
    a.q_stride = a.q_stride or ps
    a.mode = a.mode or pm
    if a.cache_scheme and a.mode != "autoregressive":
        ap.error("--cache-scheme needs --mode autoregressive (teacher forcing reads no cache)")
    if not a.frames and not a.synthetic:
        ap.error("--frames or --synthetic is needed")
    return a


@torch.no_grad()
def run(a):
    from safetensors.torch import save_file
    device = torch.device(a.device)
    model, frames, meta = load_model_and_frames(a.weights, device, a.frames, a.synthetic, a.seed)
    cfg = model.cfg
    src_name = f"synthetic frames (seed {a.seed})" if a.synthetic else "vtest.avi frames"
    start = meta["heldout_start"] if a.start is None else a.start
    fpc, nc = cfg.frames_per_chunk, cfg.tokens_per_chunk
    need = a.chunks * fpc
    if start + need > len(frames):
        raise SystemExit(f"frames {start}..{start + need - 1} needed, the video has {len(frames)}")
    layers = parse_layers(a.layers, cfg.layers)
    p = frames_to_patches(torch.from_numpy(np.ascontiguousarray(frames[start:start + need])).to(device), cfg)[None]
    inner = None
    if a.cache_scheme:
        if a.kvforge_python and os.path.isdir(a.kvforge_python):
            sys.path.insert(0, a.kvforge_python)
        inner = KvforgeCache(a.cache_scheme, cfg.layers, cfg.kv_heads, cfg.head_dim, device=device,
                             n_q_heads=cfg.heads)
    cache = RecordingCache(cfg.layers, layers, inner=inner)
    ac = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    with ac:
        if a.mode == "teacher":
            for c in range(a.chunks):
                model(p[:, c * nc:(c + 1) * nc], chunk0=c, cache=cache)
        else:
            generate(model, p[:, :nc], a.chunks, cache)
    tensors = {}
    s = a.q_stride
    index = {ml: i for i, ml in enumerate(layers)}   # model layer -> dump layer
    for (ml, c), r in sorted(cache.records.items()):
        l = index[ml]
        tensors[f"l{l}.c{c}.q"] = r["q"][:, ::s].contiguous()
        if not a.no_q_pre:
            tensors[f"l{l}.c{c}.q_pre"] = r["q_pre"][:, ::s].contiguous()
        tensors[f"l{l}.c{c}.k"] = r["k"]
        tensors[f"l{l}.c{c}.k_pre"] = r["k_pre"]
        tensors[f"l{l}.c{c}.v"] = r["v"]
    tensors["pos"] = torch.cat([cache.positions[c] for c in range(a.chunks)], 0).to(torch.int32).contiguous()
    wsha = weights_sha256(a.weights)
    mode = ("teacher forced: every chunk fed is a source chunk" if a.mode == "teacher"
            else "autoregressive from one source chunk" +
            (f", generated through scheme {a.cache_scheme}'s cache" if a.cache_scheme else ", BF16 cache"))
    md = {
        "layers": str(len(layers)),
        "chunks": str(a.chunks),
        "model_layers": ",".join(str(l) for l in layers),
        "n_layers_model": str(cfg.layers),
        "q_heads": str(cfg.heads), "kv_heads": str(cfg.kv_heads), "head_dim": str(cfg.head_dim),
        "tokens_per_chunk": str(nc), "frames_per_chunk": str(fpc), "grid": f"{cfg.grid_h},{cfg.grid_w}",
        "rope_theta": repr(float(cfg.rope_theta)), "rope_sections": ",".join(map(str, cfg.rope_sections)),
        "rope_layout": "half", "qk_norm": "rmsnorm" if cfg.qk_norm else "none",
        "q_subsample": str(s), "q_tokens_per_chunk": str(math.ceil(nc / s)),
        "q_pre": "no" if a.no_q_pre else "yes",
        "mode": a.mode,
        "trajectory_cache": a.cache_scheme or "bf16",
        "source": (f"{src_name} {start}..{start + need - 1} ({mode}), "
                   f"frames sha256 {meta['frames_sha256']}, model weights sha256 {wsha}"),
        "weights_sha256": wsha,
        "positions": "pos[i] = (frame from the dump's first frame, row, column) of token i; chunk c = rows c*N..c*N+N-1",
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    save_file(tensors, a.out, metadata=md)
    size = os.path.getsize(a.out)
    print(f"{a.out}: {size} bytes ({size / 2**20:.2f} MiB), model layers {md['model_layers']}, "
          f"{md['chunks']} chunks, "
          f"{len(tensors)} tensors, q_subsample {s}, mode {a.mode}, frames {start}..{start + need - 1}")
    return a.out, md


def main(argv=None):
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
