"""Train the miniature world model (model.py) on the vtest.avi frames.

Deterministic regression of the next chunk (MSE on pixels scaled to [-1, 1]),
teacher forced: a sample is W+1 consecutive chunks (3(W+1) frames) of the
training split (frames before `heldout_start`), randomly flipped left-right;
the model sees chunks 0..W-1 (chunk-causal) and predicts chunks 1..W. AdamW,
linear warm-up then cosine decay, bf16 autocast on CUDA, fixed seed.

At the end the weights are rounded to fp16, saved (safetensors, the config and
recipe in its metadata), loaded back and evaluated on the held-out frames:
  * one chunk ahead, teacher forced, against the copy-the-last-frame baseline;
  * autoregressive: from one real chunk, W chunks generated, against the last
    real frame repeated.
  * with --compare-weights (the large preset: the committed small model), the other
    model on the same windows, so the two are compared on equal terms;
  * --eval-long-chunks N: one long autoregressive stream from the first held-out
    frame (1 real chunk, N generated), per chunk MSE against the real frames, for
    this model, the compared one and the last real frame repeated.
The numbers go to the report (train_report.json, or --report-name) beside the weights,
with the recipe, every weight file's sha256 and the timings (start-up, training,
evaluation).

Presets (--preset, model.py's PRESETS): "small" is the committed model (1500 steps,
batch 4, windows of 6 chunks); "large" (8 layers, 8 query heads over 2 KV heads)
trains on windows of 4 chunks, where its attention, which is what the time goes to,
costs 10/21 of a 6-chunk window's, batch 4, for at most --steps 1200 steps fitted
to --time-limit. Time budget: --time-limit T plans the step count after 25 steps so
that training takes about T seconds (the plan is final from then on: the run equals
one started with --steps N, N in the report); --max-seconds M stops training cleanly
after M seconds whatever the plan (the report then says stopped_early, with the steps
done), a guard against a slower machine than planned for.

  python3 eval/worldmodel/train.py --frames out/data/vtest_frames.npz --out-dir DIR
  python3 eval/worldmodel/train.py --preset large --frames ... --out-dir DIR \
      --weights-name weights_large.safetensors --report-name train_report_large.json \
      --time-limit 200 --max-seconds 230
  python3 eval/worldmodel/train.py --smoke --out-dir DIR     # CPU, seconds, synthetic frames
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

_T_START = time.time()   # before torch is imported: the report's start-up time counts the import

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from frames import frames_sha256, load_frames, synthetic_frames  # noqa: E402
from kvcache import BF16Cache  # noqa: E402
import model as model_mod  # noqa: E402
from model import (PRESETS, WMConfig, WorldModel, file_sha256, frames_to_patches, generate,  # noqa: E402
                   gqa_flash_check, load_weights, save_weights, weights_sha256)

HERE = os.path.dirname(os.path.abspath(__file__))
SMOKE_CONFIG = dict(grid_h=6, grid_w=8, width=64, heads=2, kv_heads=2, head_dim=32, layers=2,
                    rope_sections=(4, 6, 6))
# The large preset's shape at smoke size: grouped-query attention, q/o wider than the residual.
SMOKE_CONFIG_LARGE = dict(grid_h=6, grid_w=8, width=48, heads=8, kv_heads=2, head_dim=32, layers=2,
                          mlp_ratio=2, rope_sections=(4, 6, 6))
# Training defaults per preset: (steps, batch, window chunks, warm-up steps, --time-limit,
# --max-seconds). The large preset's budget: about 5 minutes on one H200 in all, i.e.
# ~25 s of start-up (torch, CUDA, frames), 200 s of training (at most 230), ~20 s of
# evaluation (both models, the long stream included).
PRESET_RECIPE = {"small": (1500, 4, 6, 100, 0.0, 0.0), "large": (1200, 4, 4, 50, 200.0, 230.0)}
PIX = 127.5 ** 2  # MSE in [-1, 1] units -> MSE in [0, 255] pixel units


def psnr(mse_pix: float) -> float:
    return float("inf") if mse_pix <= 0 else 10.0 * math.log10(255.0 ** 2 / mse_pix)


def autocast(device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def window_starts(lo: int, hi: int, length: int, max_n: int | None = None):
    """Non-overlapping windows of `length` frames inside [lo, hi)."""
    s = list(range(lo, hi - length + 1, length))
    return s if max_n is None else s[:max_n]


@torch.no_grad()
def eval_teacher_forced(model, frames_t, starts, W, device):
    """One chunk ahead on real inputs: per-pixel MSE (0..255 units) of the model and of the
    copy-last-frame baseline, over windows of W+1 chunks starting at `starts`."""
    cfg = model.cfg
    nc, fpc = cfg.tokens_per_chunk, cfg.frames_per_chunk
    se_m = se_c = 0.0
    n = 0
    per_chunk_m = np.zeros(W)
    per_chunk_c = np.zeros(W)
    for s in starts:
        p = frames_to_patches(frames_t[s:s + fpc * (W + 1)].to(device), cfg)[None]
        inp, tgt = p[:, :W * nc], p[:, nc:]
        with autocast(device):
            pred = model(inp).float().clamp(-1, 1)
        base = inp.view(1, W, fpc, -1, cfg.patch_dim)[:, :, -1:].expand(1, W, fpc, cfg.tokens_per_frame,
                                                                        cfg.patch_dim).reshape(1, W * nc, -1)
        em = ((pred - tgt) ** 2).view(W, -1).mean(1).cpu().numpy() * PIX
        ec = ((base - tgt) ** 2).view(W, -1).mean(1).cpu().numpy() * PIX
        per_chunk_m += em
        per_chunk_c += ec
        se_m += em.sum()
        se_c += ec.sum()
        n += W
    mm, mc = float(se_m / n), float(se_c / n)
    return {"windows": len(starts), "chunks": n, "mse_model": mm, "mse_copy_last_frame": mc,
            "mse_model_per_chunk_offset": (per_chunk_m / len(starts)).tolist(),
            "psnr_model": psnr(mm), "psnr_copy_last_frame": psnr(mc), "mse_ratio": mm / mc}


@torch.no_grad()
def eval_autoregressive(model, frames_t, starts, n_new, device):
    """From one real chunk, n_new chunks generated (BF16 cache) against the real frames; baseline:
    the last real frame repeated. Per generated chunk MSE (0..255 units), averaged over windows."""
    cfg = model.cfg
    nc, fpc = cfg.tokens_per_chunk, cfg.frames_per_chunk
    em = np.zeros(n_new, np.float64)
    ec = np.zeros(n_new, np.float64)
    for s in starts:
        p = frames_to_patches(frames_t[s:s + fpc * (n_new + 1)].to(device), cfg)[None]
        cache = BF16Cache(cfg.layers)
        with autocast(device):
            gen = generate(model, p[:, :nc], n_new, cache).float()
        tgt = p[:, nc:]
        last = p[:, :nc].view(1, fpc, -1, cfg.patch_dim)[:, -1:]
        base = last.expand(1, n_new * fpc, cfg.tokens_per_frame, cfg.patch_dim).reshape(1, n_new * nc, -1)
        em += ((gen - tgt) ** 2).view(n_new, -1).mean(1).cpu().numpy() * PIX
        ec += ((base - tgt) ** 2).view(n_new, -1).mean(1).cpu().numpy() * PIX
    em /= len(starts)
    ec /= len(starts)
    return {"windows": len(starts), "generated_chunks": n_new,
            "mse_model_per_chunk": em.tolist(), "mse_copy_per_chunk": ec.tolist(),
            "mse_model": float(em.mean()), "mse_copy_last_frame": float(ec.mean()),
            "psnr_model": psnr(float(em.mean())), "psnr_copy_last_frame": psnr(float(ec.mean())),
            "mse_ratio": float(em.mean() / ec.mean())}


@torch.no_grad()
def eval_long(model, frames_t, start, n_new, device):
    """One stream from frame `start`: 1 real chunk, n_new generated (BF16 cache), per chunk MSE
    (0..255 units) against the real frames; baseline: the last real frame repeated."""
    cfg = model.cfg
    nc, fpc = cfg.tokens_per_chunk, cfg.frames_per_chunk
    p = frames_to_patches(frames_t[start:start + fpc * (n_new + 1)].to(device), cfg)[None]
    with autocast(device):
        gen = generate(model, p[:, :nc], n_new, BF16Cache(cfg.layers)).float()
    tgt = p[:, nc:]
    last = p[:, :nc].view(1, fpc, -1, cfg.patch_dim)[:, -1:]
    base = last.expand(1, n_new * fpc, cfg.tokens_per_frame, cfg.patch_dim).reshape(1, n_new * nc, -1)
    em = ((gen - tgt) ** 2).view(n_new, -1).mean(1).cpu().numpy() * PIX
    ec = ((base - tgt) ** 2).view(n_new, -1).mean(1).cpu().numpy() * PIX
    return {"start": start, "generated_chunks": n_new, "mse_model_per_chunk": em.tolist(),
            "mse_copy_per_chunk": ec.tolist(), "mse_model": float(em.mean()),
            "mse_copy_last_frame": float(ec.mean()), "psnr_model": psnr(float(em.mean())),
            "psnr_copy_last_frame": psnr(float(ec.mean())), "mse_ratio": float(em.mean() / ec.mean())}


def evaluate(model, frames_t, split, n_frames, W_eval, long_chunks, device, eval_windows=0):
    """Held-out numbers of one model: teacher forced and autoregressive over the windows of
    W_eval + 1 chunks, the training split's first windows, and the long stream."""
    L = model.cfg.frames_per_chunk * (W_eval + 1)
    starts_ho = window_starts(split, n_frames, L, eval_windows or None)
    if not starts_ho:
        raise SystemExit(f"held-out split ({n_frames - split} frames) is shorter than one window of {L}")
    starts_tr = window_starts(0, split, L, len(starts_ho) or 1)
    res = {"eval_window_chunks": W_eval, "heldout_window_starts": starts_ho,
           "heldout_teacher_forced": eval_teacher_forced(model, frames_t, starts_ho, W_eval, device),
           "heldout_autoregressive": eval_autoregressive(model, frames_t, starts_ho, W_eval, device),
           "train_teacher_forced": eval_teacher_forced(model, frames_t, starts_tr, W_eval, device)}
    if long_chunks:
        need = model.cfg.frames_per_chunk * (long_chunks + 1)
        if split + need > n_frames:
            raise SystemExit(f"--eval-long-chunks {long_chunks}: {need} frames from {split}, the video has {n_frames}")
        res["heldout_long_autoregressive"] = eval_long(model, frames_t, split, long_chunks, device)
    return res


def lr_at(step, steps, lr, warmup):
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--frames", help="frames file from `make data` (out/data/vtest_frames.npz)")
    ap.add_argument("--synthetic", type=int, default=0, help="use N synthetic frames instead (tests)")
    ap.add_argument("--smoke", action="store_true", help="tiny model, synthetic frames, a few steps (CPU)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small", help="model size (model.py PRESETS)")
    ap.add_argument("--config", default=None,
                    help="JSON object of WMConfig fields overriding the preset's (tests: tiny shapes)")
    ap.add_argument("--out-dir", required=True, help="where the weights and the report go")
    ap.add_argument("--weights-name", default="weights.safetensors")
    ap.add_argument("--report-name", default="train_report.json")
    ap.add_argument("--max-shard-bytes", type=int, default=None,
                    help="tensor bytes per weights file (default: model.MAX_SHARD_BYTES, just under 16 MiB)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--steps", type=int, default=None, help="default: the preset's (small 1500, large 1200)")
    ap.add_argument("--batch", type=int, default=None, help="default: 4")
    ap.add_argument("--window", type=int, default=None,
                    help="chunks the model sees per sample (W; default: small 6, large 4)")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=None, help="default: small 100, large 50")
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds of training to fit (0: none; default: small 0, large 200): after 25 steps the "
                         "step count is lowered if needed (the schedule follows); the report says so")
    ap.add_argument("--max-seconds", type=float, default=None,
                    help="hard guard (0: none; default: small 0, large 230): stop training cleanly once it has "
                         "run this many seconds; the report records the steps done and stopped_early")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    ap.add_argument("--eval-windows", type=int, default=0, help="at most this many held-out windows (0: all)")
    ap.add_argument("--eval-window", type=int, default=None,
                    help="chunks per evaluation window (default: 6, the small model's training window, "
                         "for both presets: their numbers compare)")
    ap.add_argument("--eval-long-chunks", type=int, default=None,
                    help="chunks generated in the long held-out stream (default: 31 with --frames, 0 smoke)")
    ap.add_argument("--compare-weights", default=None,
                    help="another model evaluated on the same windows (default for --preset large: "
                         "eval/worldmodel/weights.safetensors when there; 'none': no comparison)")
    a = ap.parse_args(argv)
    steps, batch, window, warmup, time_limit, max_seconds = PRESET_RECIPE[a.preset]
    if a.smoke:
        if not a.frames and not a.synthetic:
            a.synthetic = 45
        steps, batch, window, warmup, time_limit, max_seconds = 4, 2, 2, 2, 0.0, 0.0
        a.log_every = 1
    a.time_limit = time_limit if a.time_limit is None else a.time_limit
    a.max_seconds = max_seconds if a.max_seconds is None else a.max_seconds
    a.steps = steps if a.steps is None else a.steps
    a.batch = batch if a.batch is None else a.batch
    a.window = window if a.window is None else a.window
    a.warmup = warmup if a.warmup is None else a.warmup
    if a.eval_window is None:
        a.eval_window = a.window if a.smoke else 6
    if a.eval_long_chunks is None:
        a.eval_long_chunks = 0 if (a.smoke or a.synthetic) else 31
    if a.compare_weights is None:
        dflt = os.path.join(HERE, "weights.safetensors")
        a.compare_weights = dflt if (a.preset == "large" and not a.smoke and os.path.exists(dflt)) else None
    elif a.compare_weights == "none":
        a.compare_weights = None
    if not a.frames and not a.synthetic:
        ap.error("--frames or --synthetic (or --smoke) is needed")
    return a


def main(argv=None):
    a = parse_args(argv)
    torch.manual_seed(a.seed)
    np.random.seed(a.seed)
    rng = np.random.default_rng(a.seed)
    device = torch.device(a.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    if a.smoke:
        cfg_kw = dict(SMOKE_CONFIG_LARGE if a.preset == "large" else SMOKE_CONFIG)
    else:
        cfg_kw = dict(PRESETS[a.preset])
    if a.config:
        cfg_kw.update(json.loads(a.config))
    if a.layers:
        cfg_kw["layers"] = a.layers
    cfg = WMConfig(**cfg_kw)
    H, Wd = cfg.frame_hw
    if a.synthetic:
        frames = synthetic_frames(a.synthetic, H, Wd, seed=a.seed)
        meta = {"source": f"synthetic ({a.synthetic} frames, seed {a.seed})",
                "heldout_start": int(round(a.synthetic * 0.8))}
        meta["frames_sha256"] = frames_sha256(frames)
    else:
        frames, meta = load_frames(a.frames)
        meta.setdefault("frames_sha256", frames_sha256(frames))
    if frames.shape[1:] != (H, Wd, 3):
        raise SystemExit(f"frames are {frames.shape[1:]}, the model wants {(H, Wd, 3)}")
    F_all, split = len(frames), int(meta["heldout_start"])
    fpc, W, nc = cfg.frames_per_chunk, a.window, cfg.tokens_per_chunk
    L = fpc * (W + 1)
    if split < L:
        raise SystemExit(f"training split of {split} frames is shorter than one window of {L}")
    frames_t = torch.from_numpy(np.ascontiguousarray(frames))   # uint8 on the CPU
    train_t = frames_t[:split].to(device)

    model = WorldModel(cfg).to(device)
    gqa_flash_check(device)
    gqa = ("none (MHA)" if cfg.heads == cfg.kv_heads else
           "sdpa enable_gqa" if model_mod._SDPA_GQA else "KV heads repeated (repeat_interleave)")
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"model ({a.preset}): {cfg.layers} layers, width {cfg.width}, {cfg.heads} query heads over "
          f"{cfg.kv_heads} KV heads x {cfg.head_dim}, "
          f"{nc} tokens/chunk, {n_params / 1e6:.2f} M parameters; device {dev_name}; "
          f"frames {F_all} ({split} train, {F_all - split} held out); window {W} chunks, batch {a.batch}, "
          f"{a.steps} steps", flush=True)

    model.train()
    t0 = time.time()
    startup_s = t0 - _T_START
    losses = []
    steps_done = 0
    stopped_early = False
    steps = a.steps
    steps_requested = a.steps
    t_probe = None
    step = 0
    while step < steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, a.lr, a.warmup)
        starts = rng.integers(0, split - L + 1, size=a.batch)
        flips = rng.random(a.batch) < 0.5
        clip = torch.stack([train_t[s:s + L] for s in starts])           # [B, L, H, W, 3]
        fl = torch.from_numpy(flips).to(device)
        clip = torch.where(fl[:, None, None, None, None], clip.flip(3), clip)
        p = frames_to_patches(clip, cfg)                                  # [B, L*1560, 192]
        inp, tgt = p[:, :W * nc], p[:, nc:]
        with autocast(device):
            pred = model(inp)
        loss = F.mse_loss(pred.float(), tgt)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        opt.step()
        steps_done = step + 1
        lv = float(loss.detach())
        losses.append(lv)
        if not math.isfinite(lv):
            raise SystemExit(f"step {step}: loss is {lv}")
        el = time.time() - t0
        if step == 4:
            t_probe = el
        if step == 24 and steps > 25:
            per = (el - t_probe) / 20
            print(f"  {per:.3f} s/step (steps 5-24): about {t_probe + per * (steps - 5):.0f} s for {steps} steps",
                  flush=True)
            # Fit the time limit by planning fewer steps now (the schedule is still in its warm-up
            # or just past it, so the run equals one started with --steps N).
            if a.time_limit and t_probe + per * (steps - 5) > 0.95 * a.time_limit:
                n = max(steps_done + 1, int((0.95 * a.time_limit - t_probe) / per) + 5)
                print(f"  planning {n} steps instead of {steps} to fit --time-limit {a.time_limit:.0f} s",
                      flush=True)
                steps = n
        if step % a.log_every == 0 or step == steps - 1:
            print(f"  step {step:5d}  loss {lv:.5f}  (pixel MSE {lv * PIX:.2f})  grad {float(gn):.3f}  "
                  f"lr {opt.param_groups[0]['lr']:.2e}  {el:.0f} s", flush=True)
        if a.time_limit and el > 1.1 * a.time_limit and steps_done < steps:
            print(f"  time limit {a.time_limit:.0f} s overrun after {steps_done} steps: stopping", flush=True)
            stopped_early = True
            break
        if a.max_seconds and el > a.max_seconds and steps_done < steps:
            print(f"  --max-seconds {a.max_seconds:.0f} reached after {steps_done} of {steps} steps: stopping",
                  flush=True)
            stopped_early = True
            break
        step += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.time() - t0

    os.makedirs(a.out_dir, exist_ok=True)
    wpath = os.path.join(a.out_dir, a.weights_name)
    recipe = {"preset": a.preset, "seed": a.seed, "steps": steps_done, "steps_planned": steps,
              "steps_requested": steps_requested, "stopped_early": stopped_early,
              "time_limit_s": a.time_limit, "max_seconds": a.max_seconds,
              "batch": a.batch, "window_chunks": W, "lr": a.lr, "weight_decay": a.weight_decay,
              "warmup": a.warmup, "grad_clip": a.grad_clip, "optimizer": "AdamW(0.9, 0.95)",
              "schedule": "linear warm-up, cosine to 0.1 lr", "loss": "MSE, next chunk, pixels in [-1, 1]",
              "augmentation": "random left-right flip", "autocast": "bf16" if device.type == "cuda" else "none",
              "objective": "deterministic regression (no flow matching)",
              "reproduce": f"train.py --preset {a.preset} --steps {steps} --seed {a.seed} "
                           f"--batch {a.batch} --window {W} --warmup {a.warmup}"}
    data = {"source": meta.get("source"), "frames_sha256": meta.get("frames_sha256"),
            "video_sha256": meta.get("video_sha256"), "opencv": meta.get("opencv"), "n_frames": F_all,
            "train_frames": [0, split],
            "heldout_frames": [split, F_all]}
    kw = {} if a.max_shard_bytes is None else {"max_shard_bytes": a.max_shard_bytes}
    files = save_weights(model, wpath, {"recipe": recipe, "data": data}, **kw)

    # Evaluate what was saved (fp16 weights).
    t_eval = time.time()
    model = load_weights(wpath, device)
    res = evaluate(model, frames_t, split, F_all, a.eval_window, a.eval_long_chunks, device, a.eval_windows)
    report = {
        "model": json.loads(cfg.to_json()), "parameters": n_params, "recipe": recipe, "data": data,
        "device": dev_name, "torch": torch.__version__, "train_seconds": round(train_s, 1),
        "startup_seconds": round(startup_s, 1), "gqa_attention": gqa,
        "seconds_per_step": round(train_s / max(1, steps_done), 4),
        "loss_first": losses[0], "loss_last_50_mean": float(np.mean(losses[-50:])),
        "weights": os.path.basename(wpath), "weights_bytes": sum(os.path.getsize(f) for f in files),
        "weights_sha256": weights_sha256(wpath),
        "weight_files": [{"file": os.path.basename(f), "bytes": os.path.getsize(f), "sha256": file_sha256(f)}
                         for f in files],
        **res,
    }
    if a.compare_weights:
        other = load_weights(a.compare_weights, device)
        ores = evaluate(other, frames_t, split, F_all, a.eval_window, a.eval_long_chunks, device, a.eval_windows)
        report["compared"] = {"weights": os.path.relpath(a.compare_weights, os.path.dirname(os.path.dirname(HERE))),
                              "weights_sha256": weights_sha256(a.compare_weights),
                              "parameters": sum(p.numel() for p in other.parameters()),
                              "model": json.loads(other.cfg.to_json()), **ores}
        del other
    report["eval_seconds"] = round(time.time() - t_eval, 1)
    report["total_seconds"] = round(time.time() - _T_START, 1)
    rpath = os.path.join(a.out_dir, a.report_name)
    with open(rpath, "w") as f:
        json.dump(report, f, indent=1, sort_keys=True)
    tf, ar = res["heldout_teacher_forced"], res["heldout_autoregressive"]
    We = a.eval_window
    print(f"trained {steps_done} steps in {train_s:.0f} s (start-up {startup_s:.0f} s); weights {wpath} "
          f"({len(files)} file(s), {report['weights_bytes']} bytes, sha256 {report['weights_sha256'][:16]})")
    print(f"held out, one chunk ahead: model MSE {tf['mse_model']:.2f} ({tf['psnr_model']:.2f} dB) vs "
          f"copy-last-frame {tf['mse_copy_last_frame']:.2f} ({tf['psnr_copy_last_frame']:.2f} dB): "
          f"ratio {tf['mse_ratio']:.3f}")
    print(f"held out, autoregressive {We} chunks: model MSE {ar['mse_model']:.2f} ({ar['psnr_model']:.2f} dB) "
          f"vs last frame repeated {ar['mse_copy_last_frame']:.2f} ({ar['psnr_copy_last_frame']:.2f} dB): "
          f"ratio {ar['mse_ratio']:.3f}")
    if "heldout_long_autoregressive" in res:
        lg = res["heldout_long_autoregressive"]
        print(f"held out, long stream ({lg['generated_chunks']} chunks from frame {lg['start']}): model MSE "
              f"{lg['mse_model']:.2f} vs last frame repeated {lg['mse_copy_last_frame']:.2f}")
    if "compared" in report:
        c = report["compared"]
        print(f"compared ({c['weights']}): one chunk ahead MSE {c['heldout_teacher_forced']['mse_model']:.2f}, "
              f"autoregressive {c['heldout_autoregressive']['mse_model']:.2f}"
              + (f", long stream {c['heldout_long_autoregressive']['mse_model']:.2f}"
                 if "heldout_long_autoregressive" in c else ""))
    print(f"report {rpath} (total {report['total_seconds']:.0f} s)")
    return report


if __name__ == "__main__":
    main()
