"""How peaked and how head-specialized the world model's attention is, per layer and head.

The measure (the same code for every model, so models compare): the model runs
teacher forced over real held-out chunks with a BF16 cache; at every chunk t >= 1,
for every s-th query token of the chunk (--q-stride) and every query head h, the
attention row is taken over the keys it really attends (the past chunks < t and its
own chunk t), logits q.k / sqrt(d) in f32 from the BF16 q and k the model used
(post-RoPE; query head h reads KV head h // (Hq / Hkv)). Then, with a = the softmax
over the *past* keys only (the keys a compressed cache holds, renormalized), N_p of
them:

  entropy        -sum a log a, in nats (0: all weight on one key; log N_p: uniform)
  entropy_norm   entropy / log N_p (comparable across context lengths)
  top1           max a (the top-1 weight)
  top8_mass      the 8 largest a summed
  past_mass      the share of the *full* row's weight (past and own chunk) on past keys
  frame_lag      sum a * (frame of the query - frame of the key): how far back it looks

each the mean over the probed rows (chunks 1..T-1 and queries, equal weight), per
layer and head. A head that attends a few keys has low entropy and high top-1; heads
that differ in entropy and frame lag are specialized. The summary gives the mean over
all heads, and the spread across heads (standard deviation of the heads' means).

  python3 eval/worldmodel/peaked.py --frames out/data/vtest_frames.npz \\
      --weights small=eval/worldmodel/weights.safetensors \\
      --weights large=eval/worldmodel/weights_large.safetensors --json peaked.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from kvcache import BF16Cache  # noqa: E402
from model import frames_to_patches, load_model_and_frames, weights_sha256  # noqa: E402

STATS = ("entropy", "entropy_norm", "top1", "top8_mass", "past_mass", "frame_lag")


def row_stats(logits: torch.Tensor, n_past: int, lag: torch.Tensor | None = None) -> dict:
    """Per-row statistics of attention logits [..., n] whose first n_past columns are past keys
    (the rest: the query's own chunk). lag: [..., n_past] frame lag of each past key (or [n_past]).
    Returns tensors [...] (f64) for every name of STATS (frame_lag 0 without lag)."""
    if not 0 < n_past <= logits.shape[-1]:
        raise ValueError(f"n_past = {n_past} for rows of {logits.shape[-1]} keys")
    lf = logits.double()
    full = torch.softmax(lf, -1)
    past = lf[..., :n_past]
    a = torch.softmax(past, -1)
    logp = torch.log_softmax(past, -1)
    ent = -(a * logp).sum(-1)
    k = min(8, n_past)
    out = {"entropy": ent,
           "entropy_norm": ent / math.log(n_past) if n_past > 1 else torch.zeros_like(ent),
           "top1": a.max(-1).values,
           "top8_mass": a.topk(k, -1).values.sum(-1),
           "past_mass": full[..., :n_past].sum(-1),
           "frame_lag": (a * lag.double()).sum(-1) if lag is not None else torch.zeros_like(ent)}
    return out


class PeakednessCache:
    """Wraps a cache; at each append of a chunk with a cached past, measures the rows of every
    s-th query (row_stats) against the past keys (as the wrapped cache returned them) and the
    chunk's own keys, and accumulates per layer and query head."""

    def __init__(self, inner, cfg, stride: int):
        self.inner, self.cfg, self.stride = inner, cfg, max(1, int(stride))
        self.last = {}
        self.n_chunks = [0] * cfg.layers
        self.sums = np.zeros((cfg.layers, cfg.heads, len(STATS)), np.float64)
        self.rows = np.zeros((cfg.layers, cfg.heads), np.int64)

    def keys_values(self, layer):
        kv = self.inner.keys_values(layer)
        self.last[layer] = kv
        return kv

    def append(self, layer, k, v, q=None, k_pre=None, q_pre=None, positions=None):
        past = self.last.pop(layer, None)
        if past is not None and q is not None:
            self._measure(layer, q, k, past[0])
        self.inner.append(layer, k, v, q=q, k_pre=k_pre, q_pre=q_pre, positions=positions)
        self.n_chunks[layer] += 1

    def _measure(self, layer, q, k, k_past):
        cfg = self.cfg
        t = self.n_chunks[layer]                       # this chunk's index
        nc, tpf, fpc = cfg.tokens_per_chunk, cfg.tokens_per_frame, cfg.frames_per_chunk
        idx = torch.arange(0, q.shape[1], self.stride, device=q.device)
        qs = q[:, idx].float()                         # [Hq, nq, d]
        rep = q.shape[0] // k.shape[0]
        keys = torch.cat([k_past.to(qs.device).float(), k.float()], 1)    # [Hkv, n, d]
        n_past = k_past.shape[1]
        qf = t * fpc + torch.div(idx, tpf, rounding_mode="floor")           # query frames [nq]
        j = torch.arange(n_past, device=q.device)
        kf = torch.div(j, nc, rounding_mode="floor") * fpc + torch.div(j % nc, tpf, rounding_mode="floor")
        lag = (qf[:, None] - kf[None, :]).float()      # [nq, n_past]
        scale = 1.0 / math.sqrt(q.shape[-1])
        for h in range(q.shape[0]):                    # one head at a time: [nq, n] logits
            lg = (qs[h] @ keys[h // rep].T) * scale
            st = row_stats(lg, n_past, lag)
            self.sums[layer, h] += [float(st[n].sum()) for n in STATS]
            self.rows[layer, h] += qs.shape[1]

    def table(self) -> dict:
        """{"per_layer": [{"layer", "heads": [{stat: mean}]}], "summary": {...}}."""
        per_layer = []
        means = np.where(self.rows[..., None] > 0, self.sums / np.maximum(1, self.rows[..., None]), np.nan)
        for l in range(self.cfg.layers):
            per_layer.append({"layer": l, "rows": int(self.rows[l].sum()),
                              "heads": [dict({n: float(means[l, h, i]) for i, n in enumerate(STATS)},
                                             head=h, kv_head=h // (self.cfg.heads // self.cfg.kv_heads),
                                             rows=int(self.rows[l, h]))
                                        for h in range(self.cfg.heads)]})
        flat = means.reshape(-1, len(STATS))
        summary = {}
        for i, n in enumerate(STATS):
            summary[n] = float(np.nanmean(flat[:, i]))
            summary[n + "_head_std"] = float(np.nanstd(flat[:, i]))
        summary["top1_max_head"] = float(np.nanmax(flat[:, STATS.index("top1")]))
        summary["entropy_norm_min_head"] = float(np.nanmin(flat[:, STATS.index("entropy_norm")]))
        summary["heads"] = int(flat.shape[0])
        return {"per_layer": per_layer, "summary": summary}


@torch.no_grad()
def measure(model, frames, start: int, chunks: int, q_stride: int, device) -> dict:
    """Teacher forced over `chunks` chunks of real frames from `start`; the table of
    PeakednessCache (the first chunk has no past: chunks 1..chunks-1 are measured)."""
    cfg = model.cfg
    fpc, nc = cfg.frames_per_chunk, cfg.tokens_per_chunk
    need = chunks * fpc
    if start + need > len(frames):
        raise SystemExit(f"frames {start}..{start + need - 1} needed, the video has {len(frames)}")
    p = frames_to_patches(torch.from_numpy(np.ascontiguousarray(frames[start:start + need])).to(device), cfg)[None]
    cache = PeakednessCache(BF16Cache(cfg.layers), cfg, q_stride)
    ac = (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
          else torch.autocast("cpu", enabled=False))
    with ac:
        for c in range(chunks):
            model(p[:, c * nc:(c + 1) * nc], chunk0=c, cache=cache)
    out = cache.table()
    out.update({"start": start, "chunks": chunks, "q_stride": q_stride,
                "past_keys_at_last_chunk": (chunks - 1) * nc})
    return out


def format_table(name, t) -> str:
    lines = [f"{name}: entropy (nats) / entropy_norm / top-1 / past mass / frame lag, per layer and head"]
    for L in t["per_layer"]:
        cells = [f"{h['entropy']:5.2f}/{h['entropy_norm']:.2f}/{h['top1']:.3f}/{h['past_mass']:.2f}/"
                 f"{h['frame_lag']:4.1f}" for h in L["heads"]]
        lines.append(f"  L{L['layer']}: " + "  ".join(cells))
    s = t["summary"]
    lines.append(f"  mean over {s['heads']} heads: entropy {s['entropy']:.3f} nats (norm {s['entropy_norm']:.3f}, "
                 f"head std {s['entropy_norm_head_std']:.3f}, lowest head {s['entropy_norm_min_head']:.3f}), "
                 f"top-1 {s['top1']:.4f} (highest head {s['top1_max_head']:.4f}), top-8 mass {s['top8_mass']:.3f}, "
                 f"past mass {s['past_mass']:.3f}, frame lag {s['frame_lag']:.2f} (head std {s['frame_lag_head_std']:.2f})")
    return "\n".join(lines)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--weights", action="append", required=True,
                    help="NAME=PATH (or PATH) of a model to measure; repeat for several")
    ap.add_argument("--frames", help="frames file from `make data`")
    ap.add_argument("--synthetic", type=int, default=0, help="N synthetic frames instead (tests)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--start", type=int, default=None, help="first frame (default: the held-out split's)")
    ap.add_argument("--chunks", type=int, default=8, help="chunks run (1..chunks-1 measured)")
    ap.add_argument("--q-stride", type=int, default=16)
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    if not a.frames and not a.synthetic:
        ap.error("--frames or --synthetic is needed")
    return a


def main(argv=None):
    a = parse_args(argv)
    device = torch.device(a.device)
    out = {"models": {}, "chunks": a.chunks, "q_stride": a.q_stride}
    for spec in a.weights:
        name, path = spec.split("=", 1) if "=" in spec else (os.path.basename(spec).rsplit(".", 1)[0], spec)
        model, frames, meta = load_model_and_frames(path, device, a.frames, a.synthetic, a.seed)
        start = meta["heldout_start"] if a.start is None else a.start
        t = measure(model, frames, start, a.chunks, a.q_stride, device)
        cfg = model.cfg
        t.update({"weights": path, "weights_sha256": weights_sha256(path), "frames_sha256": meta["frames_sha256"],
                  "layers": cfg.layers, "heads": cfg.heads, "kv_heads": cfg.kv_heads})
        out["models"][name] = t
        print(format_table(name, t), flush=True)
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {a.json}")
    return out


if __name__ == "__main__":
    main()
