"""Roll the world model out with its KV cache in kvforge, scheme by scheme, against BF16.

For each start frame and each scheme, the model is prompted with P real chunks
(fed one by one) and then generates N chunks, each fed back; every chunk it is
fed goes into the scheme's cache (kvforge.QuantizedKVCache through the Python
binding, queries passed to append so QSAC/PSAC get causal query statistics), so
each generated chunk is predicted from the compressed cache of the chunks before
it. Scheme "bf16" is the plain BF16 cache: the reference rollout.

Schemes: --schemes takes names (a shipped scheme, or NAME.lua in --scheme-dir) and
paths of .lua files, comma-separated (and may be repeated); --cache-factory
[LABEL=]MODULE:FUNCTION (or [LABEL=]path/to/file.py:FUNCTION; repeatable) adds a
cache built by FUNCTION(cfg, device), any object with kvcache.py's interface
(keys_values/append/nbytes/compression_ratio; see kvcache.py's docstring).
A scheme with mixed precision reads its sensitivity table (`kvforge calibrate` on a
dump of this model) from --table-dir: LABEL.json there, LABEL the scheme's label.

Per scheme and start (JSON), per generated frame:
  psnr_vs_bf16[t]      pixels in [0, 255] after unpatchify (capped at 100 dB where the
                       frames are identical); the means leave out the first generated
                       chunk when P = 1 (it reads no cached past, so it is BF16's under
                       every scheme)
  first_frame_below_30db  first generated frame whose PSNR vs BF16 is < 30 dB (null: none)
  flicker_energy       mean over t of the per-pixel mean of (f_t - f_{t-1})^2 over the
                       generated frames (RGB, 0..255 units); flicker_excess = that minus
                       the BF16 rollout's, flicker_ratio = their quotient
  psnr_vs_real[t]      the same frames against the real footage (how good the model is)
and per generated chunk c (its 3 frames; the pairs (f_t, f_{t-1}) of a chunk are its
3 frames with their predecessors, the first generated frame's being the last real one):
  psnr_vs_bf16_per_chunk[c]   PSNR of the chunk's mean squared error against the BF16
                       rollout's chunk (capped as above)
  psnr_vs_real_per_chunk[c]   the same against the real footage
  ssim_adjacent_per_chunk[c]  adjacent-frame consistency: mean SSIM(f_t, f_{t-1}) over the
                       chunk's pairs (scikit-image structural_similarity, RGB, data range
                       255, its default 7x7 window); ssim_adjacent_delta_per_chunk = that
                       minus the BF16 rollout's (negative: less consistent than BF16). This
                       stands in for the CLIP similarity of adjacent frames that the method
                       papers report: no CLIP weights can be had on the GPU machine, and
                       SSIM, like it, is 1 for identical frames and falls with structural
                       change (it compares local means, contrasts and correlations, not
                       semantic features, so it also drops with motion: only the delta
                       against BF16 is read as damage)
  flicker_energy_per_chunk[c] mean over the chunk's pairs of the per-pixel mean of
                       (f_t - f_{t-1})^2; flicker_excess_per_chunk = that minus BF16's
  first_perceptible_flicker_chunk  the first chunk c whose flicker excess exceeds
                       --flicker-threshold (null: none). Default 8 (squared 0..255 levels):
                       an error that is independent from frame to frame with an RMS of
                       sigma levels per pixel adds 2 sigma^2 to the mean squared frame
                       difference, and 8 is sigma = 2 levels, about the smallest frame-to-
                       frame luminance step of 8-bit video that is visible as noise (one
                       8-bit step near mid-gray is ~1.7% of linear luminance, at the Weber
                       threshold of a large uniform field; pixel-scale noise needs about
                       twice that). A convention, not a psychophysical measurement: the
                       per-chunk excess is in the JSON for any other threshold.
  attention            (--attn-stride s > 0) every s-th query of every chunk fed that has
                       a cached past, at every layer: logits against the scheme's decoded
                       keys vs against the exact keys of the same rollout (a shadow BF16
                       copy): top1_shift = share of queries whose highest-logit key
                       changes; top1_frame_shift = share whose top-1 key moves to another
                       frame; mean_top1_distance = mean (frame, row, column) distance of
                       the moved top-1 keys; logit_rel_error = ||dL|| / ||L|| (past keys).
                       The shadow is a full BF16 copy: with s > 0 the peak memory below
                       includes it (the long-stream runs use s = 0)
  compression_ratio, cache_bytes, cache_memory (the scheme's cache at the end: bytes it
                       holds, by kind when the cache reports them), seconds
  peak_gpu_bytes       torch.cuda.max_memory_allocated() over the rollout (CUDA only), and
                       peak_gpu_bytes_over_model = that minus what was allocated before it
                       (the model's weights, the frames): cache, decode buffers, activations

Writes --json (numbers), and pictures of the first start: rollout_strip.png
(rows: real, then --strip-schemes, default BF16 / QVG / QuantWM; a few generated
frames), flicker_<scheme>.png (per pixel, sum over t of |f_t - f_{t-1}|, mean over
RGB, minus the BF16 rollout's: flicker is speckle, motion coherent blobs),
flicker_grid.png with all schemes on one color scale, and temporal.png (per chunk,
one line per scheme, mean over the starts: PSNR vs BF16, flicker excess with the
threshold, adjacent-frame SSIM minus BF16's). --tar packs the PNGs as
docs/img/*.png (one file to bring back).

  python3 eval/worldmodel/rollout.py --weights eval/worldmodel/weights.safetensors \\
      --frames out/data/vtest_frames.npz --json $OUT/rollouts.json --img-dir $OUT/img \\
      --tar $OUT/rollout_img.tar
  # a long stream: 1 real chunk, 31 generated (the last predicted from 140,400 cached tokens)
  python3 eval/worldmodel/rollout.py --weights eval/worldmodel/weights_large.safetensors \\
      --frames ... --starts 636 --chunks 31 --attn-stride 0 --schemes bf16,qvg_int2,my.lua \\
      --cache-factory peer=eval/peer/qvg_cache.py:make_cache --json long.json --img-dir img
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
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
from kvcache import BF16Cache, KvforgeCache, cache_memory, check_cache  # noqa: E402
from model import (frames_to_patches, generate, load_model_and_frames,  # noqa: E402
                   patches_to_frames, weights_sha256)

DEFAULT_SCHEMES = ("bf16,rtn_int2,kivi_int2,quarot_int2,qvg_int2,qvg_pro_int2,quantwm_int2,"
                   "qvg_int4,quantwm_int4")
PSNR_CAP = 100.0
FLICKER_THRESHOLD = 8.0


def psnr_of_mse(mse) -> list:
    """PSNR (dB) of mean squared errors in 0..255 units, capped at PSNR_CAP."""
    return [PSNR_CAP if m <= 255.0 ** 2 * 10 ** (-PSNR_CAP / 10) else min(PSNR_CAP, 10 * math.log10(255.0 ** 2 / m))
            for m in np.atleast_1d(np.asarray(mse, np.float64))]


def psnr_frames(a: torch.Tensor, b: torch.Tensor) -> list:
    """Per-frame PSNR of float frames [T, H, W, C] in [0, 255], capped at PSNR_CAP."""
    mse = ((a.float() - b.float()) ** 2).flatten(1).mean(1).double().cpu().numpy()
    return psnr_of_mse(mse)


def psnr_chunks(a: torch.Tensor, b: torch.Tensor, fpc: int) -> list:
    """PSNR of each chunk of fpc frames: the chunk's mean squared error (frames [T, H, W, C])."""
    mse = ((a.float() - b.float()) ** 2).flatten(1).mean(1).double().cpu().numpy()
    return psnr_of_mse(mse.reshape(-1, fpc).mean(1))


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


def pair_energy(f: torch.Tensor, prev: torch.Tensor | None = None) -> np.ndarray:
    """Per-pixel mean of (f_t - f_{t-1})^2 for every frame t of f [T, H, W, C]; the predecessor
    of f_0 is `prev` [H, W, C] (None: f_0 has none and gets NaN). f64 [T]."""
    g = f.float() if prev is None else torch.cat([prev.float()[None].to(f.device), f.float()], 0)
    d = ((g[1:] - g[:-1]) ** 2).flatten(1).mean(1).double().cpu().numpy()
    return d if prev is not None else np.concatenate([[np.nan], d])


def pair_ssim(f: torch.Tensor, prev: torch.Tensor | None = None) -> np.ndarray:
    """SSIM(f_t, f_{t-1}) for every frame t of f [T, H, W, C] in [0, 255] (scikit-image,
    channel_axis=-1, data_range=255); the predecessor of f_0 is `prev` (None: NaN). f64 [T]."""
    from skimage.metrics import structural_similarity
    x = f.float().clamp(0, 255).cpu().numpy().astype(np.float64)
    if prev is not None:
        x = np.concatenate([prev.float().clamp(0, 255).cpu().numpy().astype(np.float64)[None], x], 0)
    out = [structural_similarity(x[i], x[i - 1], channel_axis=-1, data_range=255.0) for i in range(1, len(x))]
    return np.asarray(out if prev is not None else [np.nan] + out, np.float64)


def per_chunk(x: np.ndarray, fpc: int) -> list:
    """Mean of each chunk's fpc values (NaN left out); [T] -> [T / fpc]."""
    y = np.asarray(x, np.float64).reshape(-1, fpc)
    return [float(np.nanmean(r)) if np.isfinite(r).any() else float("nan") for r in y]


def first_above(xs, threshold):
    """Index of the first value > threshold (None: none)."""
    return next((i for i, v in enumerate(xs) if v is not None and np.isfinite(v) and v > threshold), None)


def temporal_metrics(f: torch.Tensor, ref: torch.Tensor, prev: torch.Tensor, fpc: int, threshold: float,
                     ref_cache: dict | None = None, ssim: bool = True) -> dict:
    """The per-chunk metrics of the module docstring for generated frames f against the BF16
    rollout's ref (both [T, H, W, C] in [0, 255]; prev: the last prompt frame). ref_cache keeps
    the reference's own per-frame values between schemes."""
    rc = ref_cache if ref_cache is not None else {}
    if "energy" not in rc:
        rc["energy"] = pair_energy(ref, prev)
    e, e_ref = pair_energy(f, prev), rc["energy"]
    fe_c, fe_ref_c = per_chunk(e, fpc), per_chunk(e_ref, fpc)
    excess = [a - b for a, b in zip(fe_c, fe_ref_c)]
    out = {"psnr_vs_bf16_per_chunk": psnr_chunks(f, ref, fpc),
           "flicker_energy_per_chunk": fe_c, "flicker_excess_per_chunk": excess,
           "flicker_threshold": threshold,
           "first_perceptible_flicker_chunk": first_above(excess, threshold)}
    if ssim:
        if "ssim" not in rc:
            rc["ssim"] = pair_ssim(ref, prev)
        s_c, s_ref_c = per_chunk(pair_ssim(f, prev), fpc), per_chunk(rc["ssim"], fpc)
        out["ssim_adjacent_per_chunk"] = s_c
        out["ssim_adjacent_bf16_per_chunk"] = s_ref_c
        out["ssim_adjacent_delta_per_chunk"] = [a - b for a, b in zip(s_c, s_ref_c)]
    return out


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


def load_factory(spec: str):
    """[LABEL=]MODULE:FUNCTION or [LABEL=]path/to/file.py:FUNCTION -> (label, callable). The
    repository root and eval/worldmodel are on sys.path, so "eval.peer.x:f" imports too."""
    label, target = spec.split("=", 1) if "=" in spec.split(":", 1)[0] else (None, spec)
    if ":" not in target:
        raise SystemExit(f"--cache-factory {spec!r}: expected MODULE:FUNCTION or FILE.py:FUNCTION")
    mod_name, fn_name = target.rsplit(":", 1)
    if mod_name.endswith(".py") or os.sep in mod_name:
        path = mod_name if os.path.isabs(mod_name) else os.path.join(os.getcwd(), mod_name)
        if not os.path.exists(path) and os.path.exists(os.path.join(REPO, mod_name)):
            path = os.path.join(REPO, mod_name)
        spec_ = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
        if spec_ is None:
            raise SystemExit(f"--cache-factory {spec!r}: cannot load {path}")
        mod = importlib.util.module_from_spec(spec_)
        sys.modules[spec_.name] = mod
        spec_.loader.exec_module(mod)
    else:
        if REPO not in sys.path:
            sys.path.append(REPO)
        mod = importlib.import_module(mod_name)
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise SystemExit(f"--cache-factory {spec!r}: {mod_name} has no callable {fn_name}")
    return label or fn_name, fn


def scheme_entries(a):
    """[(label, kind, target)]: kind "bf16", "kvforge" (a shipped name or a .lua path) or
    "factory" (a callable); "bf16" first, labels unique."""
    names = [x.strip() for spec in a.schemes for x in spec.split(",") if x.strip()]
    entries = [("bf16", "bf16", None)]
    for n in names:
        if n == "bf16":
            continue
        if n.endswith(".lua") or os.sep in n:
            entries.append((os.path.splitext(os.path.basename(n))[0], "kvforge", n))
        else:
            path = os.path.join(a.scheme_dir, n + ".lua") if a.scheme_dir else None
            entries.append((n, "kvforge", path if path and os.path.exists(path) else n))
    for spec in a.cache_factory or []:
        label, fn = load_factory(spec)
        entries.append((label, "factory", fn))
    seen, out = {}, []
    for label, kind, target in entries:
        seen[label] = seen.get(label, 0) + 1
        out.append((label if seen[label] == 1 else f"{label}#{seen[label]}", kind, target))
    return out


def make_cache(entry, cfg, device, table_dir=None):
    label, kind, target = entry
    if kind == "bf16":
        return BF16Cache(cfg.layers)
    if kind == "factory":
        return check_cache(target(cfg, device), f"cache factory {label}")
    table = os.path.join(table_dir, label + ".json") if table_dir else None
    return KvforgeCache(target, cfg.layers, cfg.kv_heads, cfg.head_dim, device=device, n_q_heads=cfg.heads,
                        table=table if table and os.path.exists(table) else None)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--weights", default=os.path.join(HERE, "weights.safetensors"))
    ap.add_argument("--frames", help="frames file from `make data`")
    ap.add_argument("--synthetic", type=int, default=0, help="N synthetic frames instead (tests)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--schemes", action="append", default=None,
                    help="comma-separated scheme names or .lua paths (repeatable); 'bf16' is the reference "
                         f"and always runs first (default: {DEFAULT_SCHEMES})")
    ap.add_argument("--cache-factory", action="append", default=None,
                    help="[LABEL=]MODULE:FUNCTION or [LABEL=]FILE.py:FUNCTION: FUNCTION(cfg, device) returns a "
                         "cache with kvcache.py's interface (repeatable)")
    ap.add_argument("--table-dir", default=None,
                    help="sensitivity tables of mixed-precision schemes: LABEL.json (kvforge calibrate)")
    ap.add_argument("--scheme-dir", default=os.path.join(REPO, "schemes"),
                    help="NAME.lua here is used when it exists, else NAME is a shipped scheme")
    ap.add_argument("--kvforge-python", default=os.path.join(REPO, "python"),
                    help="folder holding the kvforge package (put first on sys.path when it exists)")
    ap.add_argument("--prompt-chunks", type=int, default=1)
    ap.add_argument("--chunks", type=int, default=6, help="chunks generated (N)")
    ap.add_argument("--starts", default=None,
                    help="comma-separated first frames (default: 3 windows spread over the held-out split)")
    ap.add_argument("--attn-stride", type=int, default=16, help="probe every s-th query (0: no probe)")
    ap.add_argument("--flicker-threshold", type=float, default=FLICKER_THRESHOLD,
                    help="flicker excess (squared 0..255 levels) that counts as perceptible")
    ap.add_argument("--no-ssim", action="store_true", help="skip the adjacent-frame SSIM (scikit-image)")
    ap.add_argument("--strip-schemes", default="bf16,qvg_int2,quantwm_int2")
    ap.add_argument("--strip-frames", type=int, default=6)
    ap.add_argument("--json", required=True)
    ap.add_argument("--img-dir", default=None, help="where the PNGs go (default: none)")
    ap.add_argument("--tar", default=None, help="also pack the PNGs as docs/img/*.png into this tar")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args(argv)
    if a.schemes is None:
        a.schemes = [DEFAULT_SCHEMES]
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


def _mean_lists(lists):
    """Element-wise mean of equal-length lists (NaN left out)."""
    arr = np.array(lists, np.float64)
    return [float(np.nanmean(c)) if np.isfinite(c).any() else None for c in arr.T]


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
    entries = scheme_entries(a)
    ssim_ok = not a.no_ssim
    if ssim_ok:
        try:
            import skimage.metrics  # noqa: F401
        except ImportError:
            print("scikit-image is not installed: no adjacent-frame SSIM", flush=True)
            ssim_ok = False
    ac = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else torch.autocast("cpu", enabled=False)
    cuda = device.type == "cuda"

    ref = {}          # start -> BF16 frames [T, H, W, C] float (on device)
    ref_cache = {}    # start -> the reference's per-frame flicker / SSIM values
    real = {}
    prev = {}         # start -> the last prompt frame
    keep = {}         # scheme -> frames of the first start (for the pictures)
    results = {}
    for entry in entries:
        name, kind = entry[0], entry[1]
        r = {"status": "ok", "kind": kind,
             "source": None if kind == "bf16" else (entry[2] if kind == "kvforge" else
                                                    f"{getattr(entry[2], '__module__', '?')}:"
                                                    f"{getattr(entry[2], '__name__', repr(entry[2]))}"),
             "per_start": []}
        t0 = time.time()
        try:
            for s in starts:
                clip = torch.from_numpy(np.ascontiguousarray(frames[s:s + length])).to(device)
                p = frames_to_patches(clip, cfg)[None]
                real[s] = clip[P * fpc:].float()
                prev[s] = clip[P * fpc - 1].float()
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats(device)
                    base_mem = torch.cuda.memory_allocated(device)
                inner = make_cache(entry, cfg, device, a.table_dir)
                cache = ProbeCache(inner, cfg.layers, a.attn_stride, cfg) if (name != "bf16" and a.attn_stride) else inner
                ts = time.time()
                with ac:
                    gen = generate(model, p[:, :P * nc], N, cache)
                if cuda:
                    torch.cuda.synchronize()
                    peak = int(torch.cuda.max_memory_allocated(device))
                el = time.time() - ts
                f = patches_to_frames(gen[0].float(), cfg)         # [N*3, H, W, C] in [0, 255]
                del gen
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
                       "psnr_vs_real_per_chunk": psnr_chunks(f, real[s], fpc),
                       "compression_ratio": float(cache.compression_ratio), "cache_bytes": int(cache.nbytes),
                       "cache_memory": cache_memory(inner),
                       "peak_gpu_bytes": peak if cuda else None,
                       "peak_gpu_bytes_over_model": peak - base_mem if cuda else None,
                       "probe_shadow_in_peak": bool(cuda and isinstance(cache, ProbeCache))}
                row.update(temporal_metrics(f, ref[s], prev[s], fpc, a.flicker_threshold,
                                            ref_cache.setdefault(s, {}), ssim=ssim_ok))
                if isinstance(cache, ProbeCache):
                    row["attention"] = cache.summary()
                r["per_start"].append(row)
                if s == starts[0]:
                    keep[name] = f.cpu()
                del cache, inner
        except Exception as e:  # one scheme failing (not built, not implemented) must not sink the rest
            if name == "bf16":
                raise
            r = {"status": "error", "kind": kind, "error": f"{type(e).__name__}: {e}",
                 "traceback": traceback.format_exc(limit=4)}
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
                "first_perceptible_flicker_chunk": [row["first_perceptible_flicker_chunk"] for row in rows],
                "compression_ratio": rows[-1]["compression_ratio"], "cache_bytes": rows[-1]["cache_bytes"],
                "cache_memory": rows[-1]["cache_memory"],
                "peak_gpu_bytes": max((row["peak_gpu_bytes"] or 0) for row in rows) if cuda else None,
                "peak_gpu_bytes_over_model": (max((row["peak_gpu_bytes_over_model"] or 0) for row in rows)
                                              if cuda else None),
                "per_chunk_mean": {k: _mean_lists([row[k] for row in rows]) for k in
                                   ("psnr_vs_bf16_per_chunk", "psnr_vs_real_per_chunk", "flicker_excess_per_chunk",
                                    "ssim_adjacent_delta_per_chunk", "ssim_adjacent_per_chunk") if k in rows[0]},
            })
            if "ssim_adjacent_delta_per_chunk" in rows[0]:
                d = [v for row in rows for v in row["ssim_adjacent_delta_per_chunk"][(1 if P == 1 else 0):]]
                r["mean_ssim_adjacent_delta"] = float(np.nanmean(d)) if d else 0.0
            if "attention" in rows[0]:
                r["top1_shift"] = float(np.mean([row["attention"]["top1_shift"] for row in rows]))
                r["top1_frame_shift"] = float(np.mean([row["attention"]["top1_frame_shift"] for row in rows]))
                r["logit_rel_error"] = float(np.mean([row["attention"]["logit_rel_error"] for row in rows]))
        results[name] = r
        print(summary_line(name, r), flush=True)
        # After every scheme: a run stopped by a time limit keeps what it has measured.
        write_json(a.json, report(a, cfg, meta, source, starts, P, N, results, ssim_ok, device, partial=True))

    out = report(a, cfg, meta, source, starts, P, N, results, ssim_ok, device)
    write_json(a.json, out)
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


def report(a, cfg, meta, source, starts, P, N, results, ssim_ok, device, partial=False):
    fpc, nc = cfg.frames_per_chunk, cfg.tokens_per_chunk
    cuda = device.type == "cuda"
    return {
        "weights": os.path.relpath(a.weights, REPO) if os.path.abspath(a.weights).startswith(REPO) else a.weights,
        "weights_sha256": weights_sha256(a.weights), "source": source, "starts": starts,
        "model": json.loads(cfg.to_json()),
        "prompt_chunks": P, "generated_chunks": N, "generated_frames": N * fpc, "frames_per_chunk": fpc,
        "tokens_per_chunk": nc, "context_tokens_at_last_chunk": (P + N - 1) * nc,
        "attn_stride": a.attn_stride, "psnr_cap_db": PSNR_CAP,
        "flicker_threshold": a.flicker_threshold, "ssim": "skimage structural_similarity" if ssim_ok else None,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__, "partial": partial, "schemes": results,
    }


def write_json(path, obj):
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(obj, fh, indent=1)
    os.replace(tmp, path)


def summary_line(name, r):
    if r["status"] != "ok":
        return f"{name:14s} ERROR {r['error']}"
    s = (f"{name:14s} ratio {r['compression_ratio']:5.2f}x  PSNR vs BF16 mean {r['mean_psnr_vs_bf16']:6.2f} "
         f"min {r['min_psnr_vs_bf16']:6.2f} dB  first<30dB {r['first_frame_below_30db']}  "
         f"flicker excess {r['flicker_excess']:+8.3f}  first flicker chunk {r['first_perceptible_flicker_chunk']}  "
         f"PSNR vs real {r['mean_psnr_vs_real']:6.2f}")
    if "mean_ssim_adjacent_delta" in r:
        s += f"  adj. SSIM vs BF16 {r['mean_ssim_adjacent_delta']:+.4f}"
    if r.get("peak_gpu_bytes"):
        s += f"  peak {r['peak_gpu_bytes'] / 2**20:.0f} MiB, cache {r['cache_bytes'] / 2**20:.1f} MiB"
    if "top1_shift" in r:
        s += f"  top-1 shift {100 * r['top1_shift']:5.1f}% (other frame {100 * r['top1_frame_shift']:5.1f}%)"
    return s + f"  {r['seconds']:.1f} s"


# ----------------------------------------------------------------------------- pictures
def _png(fig_fn):
    buf = io.BytesIO()
    fig_fn(buf)
    return buf.getvalue()


def temporal_plot(results, threshold, title):
    """PNG bytes: per generated chunk, one line per scheme (mean over the starts), PSNR vs BF16,
    flicker excess (with the threshold) and adjacent-frame SSIM minus BF16's; None without
    matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    ok = {n: r for n, r in results.items() if r["status"] == "ok" and n != "bf16"}
    if not ok:
        return None
    panels = [("psnr_vs_bf16_per_chunk", "PSNR vs BF16 rollout (dB)"),
              ("flicker_excess_per_chunk", "flicker excess over BF16\n(mean sq. frame diff., 0-255)"),
              ("ssim_adjacent_delta_per_chunk", "adjacent-frame SSIM\nminus BF16's")]
    panels = [p for p in panels if any(p[0] in r["per_chunk_mean"] for r in ok.values())]
    fig, axs = plt.subplots(len(panels), 1, figsize=(8.0, 2.6 * len(panels) + 0.5), sharex=True, squeeze=False)
    for (key, ylabel), ax in zip(panels, axs[:, 0]):
        for n, r in ok.items():
            ys = r["per_chunk_mean"].get(key)
            if ys is None:
                continue
            xs = np.arange(1, len(ys) + 1)
            ax.plot(xs, [np.nan if y is None else y for y in ys], marker=".", ms=3, lw=1.2, label=n)
        if key == "flicker_excess_per_chunk":
            ax.axhline(threshold, color="k", ls="--", lw=0.8, label=f"threshold {threshold:g}")
        if key == "ssim_adjacent_delta_per_chunk":
            ax.axhline(0.0, color="k", lw=0.6)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    from matplotlib.ticker import MaxNLocator
    axs[-1, 0].xaxis.set_major_locator(MaxNLocator(integer=True))
    axs[-1, 0].set_xlabel("generated chunk (3 frames each)", fontsize=8)
    axs[0, 0].legend(fontsize=7, ncol=3, loc="lower left")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    png = _png(lambda b: fig.savefig(b, format="png", dpi=110))
    plt.close(fig)
    return png


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

    tp = temporal_plot(results, a.flicker_threshold, f"rollouts from frame {start}: {first_gen_frame} real frames, "
                                                     f"then {a.chunks} chunks generated (per chunk, one line a scheme)")
    if tp is not None:
        out["temporal.png"] = tp
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
