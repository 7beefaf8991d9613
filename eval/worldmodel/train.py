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
The numbers go to train_report.json beside the weights.

  python3 eval/worldmodel/train.py --frames out/data/vtest_frames.npz --out-dir DIR
  python3 eval/worldmodel/train.py --smoke --out-dir DIR     # CPU, seconds, synthetic frames
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from frames import frames_sha256, load_frames, synthetic_frames  # noqa: E402
from kvcache import BF16Cache  # noqa: E402
from model import (WMConfig, WorldModel, file_sha256, frames_to_patches, generate,  # noqa: E402
                   load_weights, save_weights)

SMOKE_CONFIG = dict(grid_h=6, grid_w=8, width=64, heads=2, kv_heads=2, head_dim=32, layers=2,
                    rope_sections=(4, 6, 6))
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
    ap.add_argument("--out-dir", required=True, help="where weights.safetensors and train_report.json go")
    ap.add_argument("--weights-name", default="weights.safetensors")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--window", type=int, default=6, help="chunks the model sees per sample (W)")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--time-limit", type=float, default=0,
                    help="seconds of training to fit (0: none): after 25 steps the step count is lowered "
                         "if needed (the schedule follows); the report says so")
    ap.add_argument("--log-every", type=int, default=50)
    ap.add_argument("--layers", type=int, default=None, help="override the model's layer count")
    ap.add_argument("--eval-windows", type=int, default=0, help="at most this many held-out windows (0: all)")
    a = ap.parse_args(argv)
    if a.smoke:
        if not a.frames and not a.synthetic:
            a.synthetic = 45
        if a.steps == ap.get_default("steps"):
            a.steps = 4
        a.batch, a.window, a.warmup, a.log_every = 2, 2, 2, 1
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

    cfg_kw = dict(SMOKE_CONFIG) if a.smoke else {}
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
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=a.lr, betas=(0.9, 0.95), eps=1e-8)
    dev_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"model: {cfg.layers} layers, width {cfg.width}, {cfg.heads} heads x {cfg.head_dim}, "
          f"{nc} tokens/chunk, {n_params / 1e6:.2f} M parameters; device {dev_name}; "
          f"frames {F_all} ({split} train, {F_all - split} held out); window {W} chunks, batch {a.batch}, "
          f"{a.steps} steps", flush=True)

    model.train()
    t0 = time.time()
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
        if a.time_limit and el > 1.1 * a.time_limit:
            print(f"  time limit {a.time_limit:.0f} s overrun after {steps_done} steps: stopping", flush=True)
            stopped_early = True
            break
        step += 1
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.time() - t0

    os.makedirs(a.out_dir, exist_ok=True)
    wpath = os.path.join(a.out_dir, a.weights_name)
    recipe = {"seed": a.seed, "steps": steps_done, "steps_planned": steps, "steps_requested": steps_requested,
              "stopped_early": stopped_early,
              "batch": a.batch, "window_chunks": W, "lr": a.lr, "weight_decay": a.weight_decay,
              "warmup": a.warmup, "grad_clip": a.grad_clip, "optimizer": "AdamW(0.9, 0.95)",
              "schedule": "linear warm-up, cosine to 0.1 lr", "loss": "MSE, next chunk, pixels in [-1, 1]",
              "augmentation": "random left-right flip", "autocast": "bf16" if device.type == "cuda" else "none",
              "objective": "deterministic regression (no flow matching)"}
    data = {"source": meta.get("source"), "frames_sha256": meta.get("frames_sha256"),
            "video_sha256": meta.get("video_sha256"), "opencv": meta.get("opencv"), "n_frames": F_all,
            "train_frames": [0, split],
            "heldout_frames": [split, F_all]}
    save_weights(model, wpath, {"recipe": recipe, "data": data})

    # Evaluate what was saved (fp16 weights).
    model = load_weights(wpath, device)
    starts_ho = window_starts(split, F_all, L, a.eval_windows or None)
    starts_tr = window_starts(0, split, L, len(starts_ho) or 1)
    if not starts_ho:
        raise SystemExit(f"held-out split ({F_all - split} frames) is shorter than one window of {L}")
    res = {
        "heldout_teacher_forced": eval_teacher_forced(model, frames_t, starts_ho, W, device),
        "heldout_autoregressive": eval_autoregressive(model, frames_t, starts_ho, W, device),
        "train_teacher_forced": eval_teacher_forced(model, frames_t, starts_tr, W, device),
    }
    report = {
        "model": json.loads(cfg.to_json()), "parameters": n_params, "recipe": recipe, "data": data,
        "device": dev_name, "torch": torch.__version__, "train_seconds": round(train_s, 1),
        "loss_first": losses[0], "loss_last_50_mean": float(np.mean(losses[-50:])),
        "weights": os.path.basename(wpath), "weights_bytes": os.path.getsize(wpath),
        "weights_sha256": file_sha256(wpath), "heldout_window_starts": starts_ho, **res,
    }
    rpath = os.path.join(a.out_dir, "train_report.json")
    with open(rpath, "w") as f:
        json.dump(report, f, indent=1, sort_keys=True)
    tf, ar = res["heldout_teacher_forced"], res["heldout_autoregressive"]
    print(f"trained {steps_done} steps in {train_s:.0f} s; weights {wpath} ({report['weights_bytes']} bytes, "
          f"sha256 {report['weights_sha256'][:16]})")
    print(f"held out, one chunk ahead: model MSE {tf['mse_model']:.2f} ({tf['psnr_model']:.2f} dB) vs "
          f"copy-last-frame {tf['mse_copy_last_frame']:.2f} ({tf['psnr_copy_last_frame']:.2f} dB): "
          f"ratio {tf['mse_ratio']:.3f}")
    print(f"held out, autoregressive {W} chunks: model MSE {ar['mse_model']:.2f} ({ar['psnr_model']:.2f} dB) "
          f"vs last frame repeated {ar['mse_copy_last_frame']:.2f} ({ar['psnr_copy_last_frame']:.2f} dB): "
          f"ratio {ar['mse_ratio']:.3f}")
    print(f"report {rpath}")
    return report


if __name__ == "__main__":
    main()
