"""Roll the world model out with its KV cache in kvforge, scheme by scheme, against BF16.

For each start frame and each scheme, the model is prompted with P real chunks
(fed one by one) and then generates N chunks, each fed back; every chunk it is
fed goes into the scheme's cache (kvforge.QuantizedKVCache through the Python
binding, queries passed to append so QSAC/PSAC get causal query statistics).
Scheme "bf16" is the plain BF16 cache: the reference rollout. Per scheme:

  psnr_vs_bf16[t]      per generated frame, pixels in [0, 255] after unpatchify
                       (capped at 100 dB where the frames are identical); the means
                       leave out the first generated chunk when P = 1 (it reads no
                       cached past, so it is BF16's under every scheme)
  first_frame_below_30db  first generated frame whose PSNR vs BF16 is < 30 dB (null: none)
  flicker_energy       mean over t of the per-pixel mean of (f_t - f_{t-1})^2 over the
                       generated frames (RGB, 0..255 units); flicker_excess = that minus
                       the BF16 rollout's, flicker_ratio = their quotient
  psnr_vs_real[t]      the same frames against the real footage (how good the model is)
  attention            (--attn-stride s > 0) every s-th query of every chunk fed that has
                       a cached past, at every layer: logits against the scheme's decoded
                       keys vs against the exact keys of the same rollout (a shadow BF16
                       copy): top1_shift = share of queries whose highest-logit key
                       changes; top1_frame_shift = share whose top-1 key moves to another
                       frame; mean_top1_distance = mean (frame, row, column) distance of
                       the moved top-1 keys; logit_rel_error = ||dL|| / ||L|| (past keys)
  compression_ratio, cache_bytes (the scheme's cache at the end), seconds

Writes --json (numbers), and pictures of the first start: rollout_strip.png
(rows: real, then --strip-schemes, default BF16 / QVG / QuantWM; a few generated
frames) and flicker_<scheme>.png (per pixel, sum over t of |f_t - f_{t-1}|,
mean over RGB, minus the BF16 rollout's: flicker is speckle, motion coherent
blobs), plus flicker_grid.png with all schemes on one color scale. --tar packs
the PNGs as docs/img/*.png (one file to bring back).

  python3 eval/worldmodel/rollout.py --weights eval/worldmodel/weights.safetensors \\
      --frames out/data/vtest_frames.npz --json $OUT/rollouts.json --img-dir $OUT/img \\
      --tar $OUT/rollout_img.tar
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import sys
import tarfile
import time
import traceback

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from kvcache import BF16Cache, KvforgeCache  # noqa: E402
from model import (file_sha256, frames_to_patches, generate, load_model_and_frames,  # noqa: E402
                   patches_to_frames)

DEFAULT_SCHEMES = ("bf16,rtn_int2,kivi_int2,quarot_int2,qvg_int2,qvg_pro_int2,quantwm_int2,"
                   "qvg_int4,quantwm_int4")
PSNR_CAP = 100.0


def psnr_frames(a: torch.Tensor, b: torch.Tensor) -> list:
    """Per-frame PSNR of float frames [T, H, W, C] in [0, 255], capped at PSNR_CAP."""
    mse = ((a.float() - b.float()) ** 2).flatten(1).mean(1).double().cpu().numpy()
    return [PSNR_CAP if m <= 255.0 ** 2 * 10 ** (-PSNR_CAP / 10) else min(PSNR_CAP, 10 * math.log10(255.0 ** 2 / m))
            for m in mse]


def flicker_energy(f: torch.Tensor) -> float:
    """Mean over t of the per-pixel mean of (f_t - f_{t-1})^2, frames [T, H, W, C]."""
    if f.shape[0] < 2:
        return 0.0
    d = (f[1:].float() - f[:-1].float()) ** 2
    return float(d.flatten(1).mean(1).mean())


def flicker_map(f: torch.Tensor) -> np.ndarray:
    """Per pixel, sum over t of |f_t - f_{t-1}| (mean over channels): [H, W] float64."""
    d = (f[1:].float() - f[:-1].float()).abs().mean(-1).sum(0)
    return d.double().cpu().numpy()


class ProbeCache:
    """Wraps a cache; keeps an exact BF16 shadow of what was appended and, at each append of a
    chunk with a cached past, compares the top-1 attended key of every s-th query under the
    wrapped cache's (decoded) keys and under the shadow's exact keys."""

    def __init__(self, inner, n_layers, stride, cfg):
        self.inner, self.stride, self.cfg = inner, stride, cfg
        self.shadow = BF16Cache(n_layers)
        self.last_kv = {}
        self.pos = []          # int32 positions of every cached token (CPU), per layer equal
        self.stats = [{"queries": 0, "shift": 0, "frame_shift": 0, "dist_sum": 0.0, "dl2": 0.0, "l2": 0.0}
                      for _ in range(n_layers)]

    def keys_values(self, layer):
        kv = self.inner.keys_values(layer)
        self.last_kv[layer] = kv
        return kv

    def append(self, layer, k, v, q=None, k_pre=None, q_pre=None, positions=None):
        past = self.last_kv.pop(layer, None)
        sh = self.shadow.keys_values(layer)
        if past is not None and sh is not None and q is not None and self.stride > 0:
            self._probe(layer, q, k, past[0], sh[0])
        self.inner.append(layer, k, v, q=q, k_pre=k_pre, q_pre=q_pre, positions=positions)
        self.shadow.append(layer, k, v)

    def _probe(self, layer, q, k, k_dec, k_exact):
        cfg = self.cfg
        qs = q[:, ::self.stride].float()                      # [Hq, nq, d]
        hk = k.shape[0]
        rep = qs.shape[0] // hk
        kd = torch.cat([k_dec.to(qs.device).float(), k.float()], 1).repeat_interleave(rep, 0)
        ke = torch.cat([k_exact.to(qs.device).float(), k.float()], 1).repeat_interleave(rep, 0)
        scale = 1.0 / math.sqrt(q.shape[-1])
        ld = torch.einsum("hqd,hkd->hqk", qs, kd) * scale
        le = torch.einsum("hqd,hkd->hqk", qs, ke) * scale
        n_past = k_dec.shape[1]
        td, te = ld.argmax(-1), le.argmax(-1)
        moved = td != te
        nc = cfg.tokens_per_chunk

        def pos_of(idx):  # token index in the cached sequence -> (frame, row, column)
            c, r = idx // nc, idx % nc
            f = c * cfg.frames_per_chunk + r // cfg.tokens_per_frame
            rr = r % cfg.tokens_per_frame
            return torch.stack([f, rr // cfg.grid_w, rr % cfg.grid_w], -1).float()
        pd, pe = pos_of(td), pos_of(te)
        st = self.stats[layer]
        st["queries"] += int(moved.numel())
        st["shift"] += int(moved.sum())
        st["frame_shift"] += int((pd[..., 0] != pe[..., 0]).sum())
        st["dist_sum"] += float(((pd - pe) ** 2).sum(-1).sqrt()[moved].sum()) if moved.any() else 0.0
        st["dl2"] += float(((ld[..., :n_past] - le[..., :n_past]) ** 2).sum())
        st["l2"] += float((le[..., :n_past] ** 2).sum())

    def summary(self):
        per = []
        tot = {"queries": 0, "shift": 0, "frame_shift": 0, "dist_sum": 0.0, "dl2": 0.0, "l2": 0.0}
        for st in self.stats:
            for k2 in tot:
                tot[k2] += st[k2]
            per.append(_attn_row(st))
        return {"per_layer": per, **_attn_row(tot)}

    @property
    def nbytes(self):
        return self.inner.nbytes

    @property
    def compression_ratio(self):
        return self.inner.compression_ratio


def _attn_row(st):
    q = max(1, st["queries"])
    return {"queries": st["queries"], "top1_shift": st["shift"] / q, "top1_frame_shift": st["frame_shift"] / q,
            "mean_top1_distance": st["dist_sum"] / max(1, st["shift"]),
            "logit_rel_error": math.sqrt(st["dl2"] / st["l2"]) if st["l2"] > 0 else 0.0}


def make_cache(name, cfg, device, scheme_dir):
    if name == "bf16":
        return BF16Cache(cfg.layers)
    path = os.path.join(scheme_dir, name + ".lua") if scheme_dir else None
    scheme = path if path and os.path.exists(path) else name
    return KvforgeCache(scheme, cfg.layers, cfg.kv_heads, cfg.head_dim, device=device, n_q_heads=cfg.heads)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--weights", default=os.path.join(HERE, "weights.safetensors"))
    ap.add_argument("--frames", help="frames file from `make data`")
    ap.add_argument("--synthetic", type=int, default=0, help="N synthetic frames instead (tests)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--schemes", default=DEFAULT_SCHEMES, help="comma-separated; 'bf16' is the reference")
    ap.add_argument("--scheme-dir", default=os.path.join(REPO, "schemes"),
                    help="NAME.lua here is used when it exists, else NAME is a shipped scheme")
    ap.add_argument("--kvforge-python", default=os.path.join(REPO, "python"),
                    help="folder holding the kvforge package (put first on sys.path when it exists)")
    ap.add_argument("--prompt-chunks", type=int, default=1)
    ap.add_argument("--chunks", type=int, default=6, help="chunks generated (N)")
    ap.add_argument("--starts", default=None,
                    help="comma-separated first frames (default: 3 windows spread over the held-out split)")
    ap.add_argument("--attn-stride", type=int, default=16, help="probe every s-th query (0: no probe)")
    ap.add_argument("--strip-schemes", default="bf16,qvg_int2,quantwm_int2")
    ap.add_argument("--strip-frames", type=int, default=6)
    ap.add_argument("--json", required=True)
    ap.add_argument("--img-dir", default=None, help="where the PNGs go (default: none)")
    ap.add_argument("--tar", default=None, help="also pack the PNGs as docs/img/*.png into this tar")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    if not a.frames and not a.synthetic:
        ap.error("--frames or --synthetic is needed")
    return a


def default_starts(split, n_frames, length, k=3):
    span = n_frames - length - split
    if span < 0:
        return []
    if k == 1 or span == 0:
        return [split]
    return sorted({split + (span * i) // (k - 1) for i in range(k)})


@torch.no_grad()
def run(a):
    if a.kvforge_python and os.path.isdir(a.kvforge_python):
        sys.path.insert(0, a.kvforge_python)
    device = torch.device(a.device)
    model, frames, meta = load_model_and_frames(a.weights, device, a.frames, a.synthetic, a.seed)
    cfg = model.cfg
    split = meta["heldout_start"]
    source = (f"synthetic ({a.synthetic} frames, seed {a.seed})" if a.synthetic
              else f"vtest.avi frames (sha256 {meta['frames_sha256']})")
    fpc, nc = cfg.frames_per_chunk, cfg.tokens_per_chunk
    P, N = a.prompt_chunks, a.chunks
    length = fpc * (P + N)
    starts = [int(s) for s in a.starts.split(",")] if a.starts else default_starts(split, len(frames), length)
    if not starts:
        raise SystemExit(f"no room for a rollout of {length} frames in the held-out split")
    for s in starts:
        if s + length > len(frames):
            raise SystemExit(f"start {s}: frames up to {s + length - 1} needed, the video has {len(frames)}")
    names = [x.strip() for x in a.schemes.split(",") if x.strip()]
    if "bf16" in names:
        names.remove("bf16")
    names = ["bf16"] + names
    ac = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)

    ref = {}          # start -> BF16 frames [T, H, W, C] float (on device)
    real = {}
    keep = {}         # scheme -> frames of the first start (for the pictures)
    results = {}
    for name in names:
        r = {"status": "ok", "per_start": []}
        t0 = time.time()
        try:
            for s in starts:
                clip = torch.from_numpy(np.ascontiguousarray(frames[s:s + length])).to(device)
                p = frames_to_patches(clip, cfg)[None]
                real[s] = clip[P * fpc:].float()
                inner = make_cache(name, cfg, device, a.scheme_dir)
                cache = ProbeCache(inner, cfg.layers, a.attn_stride, cfg) if (name != "bf16" and a.attn_stride) else inner
                ts = time.time()
                with ac:
                    gen = generate(model, p[:, :P * nc], N, cache)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                el = time.time() - ts
                f = patches_to_frames(gen[0].float(), cfg)         # [N*3, H, W, C] in [0, 255]
                if name == "bf16":
                    ref[s] = f
                ps = psnr_frames(f, ref[s])
                below = next((i for i, v in enumerate(ps) if v < 30.0), None)
                fe, fe_ref = flicker_energy(f), flicker_energy(ref[s])
                row = {"start": s, "seconds": round(el, 3), "psnr_vs_bf16": ps,
                       "first_frame_below_30db": below,
                       "first_frame_below_30db_abs": None if below is None else s + P * fpc + below,
                       "flicker_energy": fe, "flicker_excess": fe - fe_ref,
                       "flicker_ratio": fe / fe_ref if fe_ref > 0 else None,
                       "psnr_vs_real": psnr_frames(f, real[s]),
                       "compression_ratio": float(cache.compression_ratio), "cache_bytes": int(cache.nbytes)}
                if isinstance(cache, ProbeCache):
                    row["attention"] = cache.summary()
                r["per_start"].append(row)
                if s == starts[0]:
                    keep[name] = f.cpu()
                del cache, inner
        except Exception as e:  # one scheme failing (not built, not implemented) must not sink the rest
            if name == "bf16":
                raise
            r = {"status": "error", "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc(limit=4)}
        r["seconds"] = round(time.time() - t0, 2)
        if r["status"] == "ok":
            rows = r["per_start"]
            # With one prompt chunk the first generated chunk reads no cached past: it is the
            # BF16 one whatever the scheme, and left out of the means (kept in the per-frame lists).
            skip = fpc if P == 1 else 0
            allp = np.array([v for row in rows for v in row["psnr_vs_bf16"][skip:]] or [PSNR_CAP])
            r.update({
                "mean_psnr_vs_bf16": float(allp.mean()), "min_psnr_vs_bf16": float(allp.min()),
                "mean_psnr_vs_real": float(np.mean([v for row in rows for v in row["psnr_vs_real"][skip:]])),
            "psnr_mean_skips_frames": skip,
                "first_frame_below_30db": [row["first_frame_below_30db"] for row in rows],
                "flicker_energy": float(np.mean([row["flicker_energy"] for row in rows])),
                "flicker_excess": float(np.mean([row["flicker_excess"] for row in rows])),
                "compression_ratio": rows[-1]["compression_ratio"], "cache_bytes": rows[-1]["cache_bytes"],
            })
            if "attention" in rows[0]:
                r["top1_shift"] = float(np.mean([row["attention"]["top1_shift"] for row in rows]))
                r["top1_frame_shift"] = float(np.mean([row["attention"]["top1_frame_shift"] for row in rows]))
                r["logit_rel_error"] = float(np.mean([row["attention"]["logit_rel_error"] for row in rows]))
        results[name] = r
        print(summary_line(name, r), flush=True)

    out = {
        "weights": os.path.relpath(a.weights, REPO) if a.weights.startswith(REPO) else a.weights,
        "weights_sha256": file_sha256(a.weights), "source": source, "starts": starts,
        "prompt_chunks": P, "generated_chunks": N, "generated_frames": N * fpc, "frames_per_chunk": fpc,
        "tokens_per_chunk": nc, "attn_stride": a.attn_stride, "psnr_cap_db": PSNR_CAP,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "schemes": results,
    }
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"wrote {a.json}")
    if a.img_dir or a.tar:
        pngs = pictures(keep, real[starts[0]].cpu(), results, a, starts[0], P * fpc)
        if a.img_dir:
            os.makedirs(a.img_dir, exist_ok=True)
            for fname, data in pngs.items():
                with open(os.path.join(a.img_dir, fname), "wb") as fh:
                    fh.write(data)
            print(f"wrote {len(pngs)} PNGs to {a.img_dir}")
        if a.tar:
            with tarfile.open(a.tar, "w") as tf:
                for fname, data in sorted(pngs.items()):
                    ti = tarfile.TarInfo("docs/img/" + fname)
                    ti.size, ti.mtime, ti.mode = len(data), 0, 0o644
                    tf.addfile(ti, io.BytesIO(data))
            print(f"wrote {a.tar} ({len(pngs)} PNGs as docs/img/*.png)")
    return out


def summary_line(name, r):
    if r["status"] != "ok":
        return f"{name:14s} ERROR {r['error']}"
    s = (f"{name:14s} ratio {r['compression_ratio']:5.2f}x  PSNR vs BF16 mean {r['mean_psnr_vs_bf16']:6.2f} "
         f"min {r['min_psnr_vs_bf16']:6.2f} dB  first<30dB {r['first_frame_below_30db']}  "
         f"flicker excess {r['flicker_excess']:+8.3f}  PSNR vs real {r['mean_psnr_vs_real']:6.2f}")
    if "top1_shift" in r:
        s += f"  top-1 shift {100 * r['top1_shift']:5.1f}% (other frame {100 * r['top1_frame_shift']:5.1f}%)"
    return s + f"  {r['seconds']:.1f} s"


# ----------------------------------------------------------------------------- pictures
def _png(fig_fn):
    buf = io.BytesIO()
    fig_fn(buf)
    return buf.getvalue()


def pictures(keep, real, results, a, start, first_gen_frame):
    """PNG bytes by file name: rollout_strip.png, flicker_<scheme>.png, flicker_grid.png."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        plt = None
    T = real.shape[0]
    ncol = max(1, min(a.strip_frames, T))
    cols = sorted({round(i * (T - 1) / max(1, ncol - 1)) for i in range(ncol)})
    rows = [("real footage", real)] + [(n, keep[n]) for n in a.strip_schemes.split(",") if n in keep]
    out = {}
    label = {"bf16": "BF16", "qvg_int2": "QVG INT2", "quantwm_int2": "QuantWM INT2", "rtn_int2": "RTN INT2"}
    if plt is not None:
        h, w = real.shape[1:3]
        fig, axs = plt.subplots(len(rows), len(cols), figsize=(2.2 * len(cols), 2.2 * h / w * len(rows) + 0.4),
                                squeeze=False)
        for i, (n, f) in enumerate(rows):
            for j, t in enumerate(cols):
                ax = axs[i][j]
                ax.imshow(f[t].clamp(0, 255).round().to(torch.uint8).numpy())
                ax.set_xticks([]); ax.set_yticks([])
                if i == 0:
                    ax.set_title(f"frame +{t + 1}", fontsize=8)
                if j == 0:
                    ps = "" if n == "real footage" or n == "bf16" else \
                        f"\n{results[n]['per_start'][0]['psnr_vs_bf16'][cols[-1]]:.1f} dB at end"
                    ax.set_ylabel(label.get(n, n) + ps, fontsize=8)
        fig.suptitle(f"rollout from frame {start} ({first_gen_frame} real frames of prompt), generated frames",
                     fontsize=9)
        fig.tight_layout()
        out["rollout_strip.png"] = _png(lambda b: fig.savefig(b, format="png", dpi=110))
        plt.close(fig)
    else:
        from PIL import Image
        tiles = [np.concatenate([f[t].clamp(0, 255).round().to(torch.uint8).numpy() for t in cols], 1)
                 for _, f in rows]
        buf = io.BytesIO()
        Image.fromarray(np.concatenate(tiles, 0)).save(buf, format="PNG")
        out["rollout_strip.png"] = buf.getvalue()

    if "bf16" not in keep:
        return out
    base = flicker_map(keep["bf16"])
    diffs = {n: flicker_map(f) - base for n, f in keep.items() if n != "bf16"}
    if not diffs:
        return out
    vmax = max(1e-6, max(float(np.percentile(np.abs(d), 99.5)) for d in diffs.values()))
    if plt is not None:
        for n, d in diffs.items():
            fig, ax = plt.subplots(figsize=(6.4, 6.4 * d.shape[0] / d.shape[1] + 0.6))
            im = ax.imshow(d, cmap="RdBu_r", vmin=-vmax, vmax=vmax)
            ax.set_xticks([]); ax.set_yticks([])
            fe = results[n]["per_start"][0]["flicker_excess"]
            ax.set_title(f"{n}: sum_t |f_t - f_(t-1)| minus BF16's (flicker excess {fe:+.2f})", fontsize=8)
            fig.colorbar(im, ax=ax, fraction=0.03, pad=0.02)
            fig.tight_layout()
            out[f"flicker_{n}.png"] = _png(lambda b: fig.savefig(b, format="png", dpi=110))
            plt.close(fig)
        k = len(diffs)
        nc_ = min(4, k)
        nr = (k + nc_ - 1) // nc_
        fig, axs = plt.subplots(nr, nc_, figsize=(3.4 * nc_, 3.4 * nr * base.shape[0] / base.shape[1] + 0.6),
                                squeeze=False)
        for i, (n, d) in enumerate(diffs.items()):
            ax = axs[i // nc_][i % nc_]
            im = ax.imshow(d, cmap="RdBu_r", vmin=-vmax, vmax=vmax)
            ax.set_title(n, fontsize=8)
        for i in range(nr * nc_):
            axs[i // nc_][i % nc_].set_xticks([]); axs[i // nc_][i % nc_].set_yticks([])
            if i >= k:
                axs[i // nc_][i % nc_].axis("off")
        fig.suptitle("per pixel: sum over the rollout of |f_t - f_(t-1)| minus BF16's (one color scale)", fontsize=9)
        fig.tight_layout()
        out["flicker_grid.png"] = _png(lambda b: fig.savefig(b, format="png", dpi=110))
        plt.close(fig)
    else:
        from PIL import Image
        for n, d in diffs.items():
            x = np.clip(d / vmax, -1, 1)
            rgb = np.stack([np.clip(x, 0, 1), np.zeros_like(x), np.clip(-x, 0, 1)], -1)
            img = (255 * (1 - np.abs(x)[..., None]) + 255 * rgb * np.abs(x)[..., None]).astype(np.uint8)
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, format="PNG")
            out[f"flicker_{n}.png"] = buf.getvalue()
    return out


def main(argv=None):
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
