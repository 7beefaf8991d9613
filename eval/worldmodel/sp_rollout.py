"""The world model's rollout under Ulysses sequence parallelism, kvforge on every rank.

Launch one process per device with torchrun (NCCL on GPUs, gloo with --device cpu):

  torchrun --nproc_per_node 2 eval/worldmodel/sp_rollout.py \\
      --weights eval/worldmodel/weights_large.safetensors --synthetic 120 --first-frame 0 \\
      --chunks 8 --schemes bf16,rtn_int2,qvg_int2 --check --json sp.json

How the work is split (P ranks; Ulysses, as in DeepSpeed-Ulysses and the video
pipelines built on it):

- Outside attention every rank holds N/P of a chunk's N tokens (a contiguous block:
  rank r has tokens r*N/P .. (r+1)*N/P - 1): embedding, LayerNorms, the q/k/v
  projections, the RMS norms of q and k (they normalise over all heads of a token,
  so they must run before the split by heads), RoPE, the output projection and the
  MLP run on those tokens alone.
- For attention one all-to-all turns the token split into a head split: rank r gets
  every token of KV heads r*Hkv/P .. (r+1)*Hkv/P - 1 and of the query heads that read
  them (GQA: query head h reads KV head h // (Hq/Hkv), so the query heads of a KV head
  are contiguous and stay with it). q, k, v (and, for a scheme that caches keys
  before RoPE, q and k before RoPE) travel in one all-to-all in the compute dtype.
  A second all-to-all brings the attention output back to the token split.
- The prediction head's output (f32) is all-gathered, so every rank holds the whole
  predicted chunk, which is fed back (each rank then takes its own tokens of it).

Every rank keeps the KV of its heads in its own cache on its own device: a
kvforge.QuantizedKVCache with num_kv_heads = Hkv/P and num_q_heads = Hq/P (through
kvcache.KvforgeCache), so the k-means, the query statistics, anchors and the
carried error stay per rank and head, and each rank's cache is 1/P of the whole.
Nothing about the binding or the library is distributed; ranks exchange activations
only.

Two details make the P-rank rollout the single-process one:
- k-means seeds. The library seeds head h's k-means with seed ^ (h << 40) (docs/
  METHODS.md section 3), h counted inside the encode call; on rank r the local head
  h is the global head r*Hkv/P + h. Each rank's scheme is the scheme with
  seed' = seed ^ ((r*Hkv/P) << 40), which gives every global head the
  initialisation it has in one process (exact when Hkv/P is a power of two, so that
  (r*Hkv/P + h) ^ h = r*Hkv/P; otherwise the run says so and the seeds stay local).
  --head-seeds local keeps the scheme's seed on every rank.
- Mixed precision's sensitivity table is per KV head: each rank reads its heads'
  rows (a copy of the table cut to them, in a temporary folder).

What is equal: on the CPU (one thread a rank) the P-rank rollout is bit for bit the
single-process one (tests/test_sp.py): the row blocks of a matrix product, the
heads of SDPA and RoPE's element-wise rotation give the same bits as the whole.
On GPUs under BF16 autocast the matrix products of N/P rows may take other kernels
(split-K, tiles) than those of N rows, so the two differ by rounding, and an
autoregressive rollout carries that on; --check reports the difference.

Per scheme (JSON; rank 0 writes it): seconds of every forward call (a chunk: the
prompt's, then the generated ones; after the all-gather that ends it, so every rank
has finished), their mean over the generated chunks after the first,
peak_gpu_bytes per rank (torch.cuda.max_memory_allocated over the rollout) and that
minus what was allocated before it (weights, frames), cache bytes per rank,
compression ratio, PSNR of the generated frames against the real ones and against
the P-rank BF16 rollout. With --check, rank 0 then runs the single-process rollout
of the same scheme (model.generate, one cache of all heads) and reports whether
the generated chunks are identical, their largest difference, PSNR per chunk
against it, and that run's seconds per chunk and peak memory (the one-device
baseline); the other ranks wait.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from kvcache import BF16Cache, KvforgeCache, cache_memory  # noqa: E402
from rollout import write_json  # noqa: E402
from model import (attend, chunk_positions, frames_to_patches, generate,  # noqa: E402
                   load_model_and_frames, patches_to_frames, rope_cos_sin, weights_sha256)


# ----------------------------------------------------------------------------- communication
class Ulysses:
    """The all-to-alls of Ulysses sequence parallelism over a process group (None: the
    default group). World size 1 passes tensors through."""

    def __init__(self, group=None):
        self.group = group
        self.rank = dist.get_rank(group) if dist.is_initialized() else 0
        self.world = dist.get_world_size(group) if dist.is_initialized() else 1

    def seq_to_heads(self, xs):
        """xs: tensors [H_i, n, d] of one dtype, this rank's n tokens of every head (H_i a
        multiple of the world size P). Returns [H_i / P, P*n, d] each: heads
        rank*H_i/P .. (rank+1)*H_i/P - 1 of every token, tokens in rank order. One
        all-to-all for all of them."""
        P = self.world
        if P == 1:
            return list(xs)
        parts = []
        for x in xs:
            h, n, d = x.shape
            if h % P:
                raise ValueError(f"{h} heads do not split over {P} ranks")
            parts.append(x.reshape(P, h // P, n, d))             # dim 0: the rank the heads go to
        send = torch.cat(parts, 1).contiguous()
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)      # recv[s]: rank s's tokens
        out, h0 = [], 0
        for p in parts:
            g, n, d = p.shape[1:]
            out.append(recv[:, h0:h0 + g].transpose(0, 1).reshape(g, P * n, d))
            h0 += g
        return out

    def heads_to_seq(self, o):
        """o [g, P*n, d]: this rank's g heads, every token -> [P*g, n, d]: every head (global
        order), this rank's n tokens."""
        P = self.world
        if P == 1:
            return o
        g, N, d = o.shape
        send = o.reshape(g, P, N // P, d).transpose(0, 1).contiguous()   # dim 0: the token block's rank
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)              # recv[s]: rank s's heads
        return recv.reshape(P * g, N // P, d)

    def gather_tokens(self, x):
        """x [B, n, c] -> [B, P*n, c], the ranks' blocks in rank order."""
        if self.world == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, 1)


# ----------------------------------------------------------------------------- the model, split
def wants_pre(cache) -> bool:
    """Whether the cache reads q and k before RoPE (a kvforge scheme with rope.placement
    "pre"): only then do they travel. Unknown caches get them."""
    if isinstance(cache, BF16Cache):
        return False
    return bool(getattr(cache, "pre", True))


def sp_attention(attn, x, cos, sin, layer, cache, positions, sp: Ulysses, pre: bool):
    """model.Attention.forward for one chunk under Ulysses: x [1, n, width] (this rank's
    tokens), cos/sin [n, d/2] of those tokens, positions int32 [N, 3] of the whole chunk.
    The cache holds this rank's heads. Returns [1, n, width]."""
    cfg = attn.cfg
    B, n, _ = x.shape
    hq, d = cfg.heads, cfg.head_dim
    q, k, v, q_pre, k_pre = attn.project(x, cos, sin)               # q [1, Hq, n, d], k, v [1, Hkv, n, d]
    dt = q.dtype                                                    # the compute dtype
    send = [q[0], k[0], v[0]] + ([q_pre[0].to(dt), k_pre[0].to(dt)] if pre else [])
    got = sp.seq_to_heads(send)
    qh, kh, vh = got[:3]                                            # [Hq/P, N, d], [Hkv/P, N, d] x 2
    past = cache.keys_values(layer)
    if past is not None:
        pk, pv = past
        k_all = torch.cat([pk.to(device=kh.device, dtype=dt), kh], 1)
        v_all = torch.cat([pv.to(device=vh.device, dtype=dt), vh], 1)
    else:
        k_all, v_all = kh, vh
    o = attend(qh[None], k_all[None], v_all[None])[0]               # [Hq/P, N, d]
    del past, k_all, v_all
    cache.append(layer, kh, vh, q=qh, k_pre=got[4] if pre else None, q_pre=got[3] if pre else None,
                 positions=positions)
    o = sp.heads_to_seq(o)                                          # [Hq, n, d]
    return attn.wo(o.transpose(0, 1).reshape(B, n, hq * d))


def sp_forward(model, patches, chunk0: int, cache, sp: Ulysses):
    """model.WorldModel.forward for one chunk (B = 1) under Ulysses: patches [1, N, patch_dim]
    is the whole chunk on every rank; returns the whole predicted chunk [1, N, patch_dim] (f32)
    on every rank."""
    cfg = model.cfg
    B, N, _ = patches.shape
    if B != 1 or N != cfg.tokens_per_chunk:
        raise ValueError(f"one chunk of one sequence: [1, {cfg.tokens_per_chunk}, ...], got {tuple(patches.shape)}")
    n = N // sp.world
    pos = chunk_positions(chunk0, cfg)
    cos, sin = rope_cos_sin(pos, cfg, patches.device)
    pos = pos.to(patches.device)
    mine = slice(sp.rank * n, (sp.rank + 1) * n)
    cos, sin = cos[mine], sin[mine]
    pre = wants_pre(cache)
    x = model.embed(patches[:, mine])
    for li, blk in enumerate(model.blocks):
        x = x + sp_attention(blk.attn, blk.ln1(x), cos, sin, li, cache, pos, sp, pre)
        x = x + blk.mlp(blk.ln2(x))
    delta = sp.gather_tokens(model.head(model.ln_out(x)).float())
    tpf, fpc = cfg.tokens_per_frame, cfg.frames_per_chunk
    last = patches.float().view(B, fpc, tpf, cfg.patch_dim)[:, -1:]
    base = last.expand(B, fpc, tpf, cfg.patch_dim).reshape(B, N, cfg.patch_dim)
    return base + delta


@torch.no_grad()
def sp_generate(model, prompt, n_new: int, cache, sp: Ulysses, on_call=None):
    """model.generate under Ulysses (the same feeding: P prompt chunks, then each prediction
    clamped and fed back). on_call(c, seconds) after forward call c (synchronised)."""
    nc = model.cfg.tokens_per_chunk
    P = prompt.shape[1] // nc
    if P < 1 or prompt.shape[1] % nc:
        raise ValueError("prompt: a whole, positive number of chunks")
    out, pred = [], None
    cuda = prompt.device.type == "cuda"
    for c in range(P + n_new - 1):
        t0 = time.perf_counter()
        inp = prompt[:, c * nc:(c + 1) * nc] if c < P else pred
        pred = sp_forward(model, inp, c, cache, sp).clamp(-1.0, 1.0)
        if cuda:
            torch.cuda.synchronize(prompt.device)
        if on_call is not None:
            on_call(c, time.perf_counter() - t0)
        if c >= P - 1:
            out.append(pred)
    return torch.cat(out, 1)


# ----------------------------------------------------------------------------- per-rank caches
def head_share(cfg, world: int):
    """(KV heads, query heads) a rank holds; refuses a split Ulysses cannot make."""
    if cfg.kv_heads % world or cfg.heads % world:
        raise SystemExit(f"{world} ranks: the {cfg.kv_heads} KV heads and {cfg.heads} query heads must "
                         f"split evenly (Ulysses gives each rank whole KV heads)")
    return cfg.kv_heads // world, cfg.heads // world


def seed_offset_exact(head0: int, heads: int) -> bool:
    """Whether seed ^ (head0 << 40) gives local heads 0..heads-1 the seeds of global heads
    head0..head0+heads-1: (head0 + h) ^ h == head0 for every h."""
    return all(((head0 + h) ^ h) == head0 for h in range(heads))


def rank_scheme(scheme, head0: int, heads: int):
    """The scheme a rank holding global KV heads head0.. head0+heads-1 encodes with: the same
    scheme with every k-means seed XORed with head0 << 40 (module docstring). Returns
    (Scheme, exact): exact False when no seed can do it (the scheme is returned as is)."""
    import kvforge
    s = kvforge.Scheme(scheme) if not isinstance(scheme, kvforge.Scheme) else scheme
    if head0 == 0:
        return s, True
    if not seed_offset_exact(head0, heads):
        return s, False
    def section(m):  # only a section with k-means reads its seed: the others keep their id
        body = m.group(0)
        c = re.search(r"\bcentroids = (\d+)", body)
        if c is None or int(c.group(1)) == 0:
            return body
        return re.sub(r"\bseed = (\d+)", lambda x: f"seed = {int(x.group(1)) ^ (head0 << 40)}", body)
    text, n = re.subn(r"(?m)^\s*(key|value) = \{[^\n]*\},$", section, s.canonical)
    if n != 2:
        raise RuntimeError(f"scheme {s.name}: expected a key and a value section in its canonical text, found {n}")
    if text == s.canonical:
        return s, True
    return kvforge.Scheme.from_string(text, f"={s.name} (KV heads from {head0})"), True


def rank_table(path: str, head0: int, heads: int, folder: str) -> str:
    """A copy of the sensitivity table `path` (docs/FORMAT.md) holding only KV heads
    head0 .. head0+heads-1, written in `folder`; returns its path."""
    with open(path) as f:
        t = json.load(f)
    if not 0 <= head0 < head0 + heads <= int(t["kv_heads"]):
        raise ValueError(f"{path}: {t['kv_heads']} KV heads, a rank needs {head0}..{head0 + heads - 1}")
    t["kv_heads"] = heads
    for sec in ("key", "value"):
        t[sec] = [layer[head0:head0 + heads] for layer in t[sec]]
    out = os.path.join(folder, f"{os.path.splitext(os.path.basename(path))[0]}.heads{head0}.json")
    with open(out, "w") as f:
        json.dump(t, f)
    return out


def make_rank_cache(entry, cfg, device, sp: Ulysses, table_dir=None, head_seeds="global", tmpdir=None):
    """This rank's cache of the scheme entry (label, kind, target) from rollout.scheme_entries:
    a BF16Cache, or a KvforgeCache of the rank's KV heads. Returns (cache, info dict)."""
    label, kind, target = entry
    if kind == "bf16":
        return BF16Cache(cfg.layers), {"scheme_id": "bf16", "seeds": None}
    if kind != "kvforge":
        raise ValueError(f"{label}: only BF16 and kvforge schemes run split (no cache factories)")
    hk, hq = head_share(cfg, sp.world)
    head0 = sp.rank * hk
    scheme, exact = (rank_scheme(target, head0, hk) if head_seeds == "global" else (rank_scheme(target, 0, hk)[0], True))
    table = os.path.join(table_dir, label + ".json") if table_dir else None
    table = table if table and os.path.exists(table) else None
    if table is not None and scheme.info.needs_channel_map and sp.world > 1:
        table = rank_table(table, head0, hk, tmpdir or tempfile.gettempdir())
    cache = KvforgeCache(scheme, cfg.layers, hk, cfg.head_dim, device=device, n_q_heads=hq, table=table)
    seeds = "local" if head_seeds == "local" else ("global" if exact else "local (no exact offset)")
    return cache, {"scheme_id": scheme.id, "seeds": seeds}


def make_single_cache(entry, cfg, device, table_dir=None):
    """The one-process cache of the entry (all heads), as rollout.py makes it."""
    label, kind, target = entry
    if kind == "bf16":
        return BF16Cache(cfg.layers)
    table = os.path.join(table_dir, label + ".json") if table_dir else None
    return KvforgeCache(target, cfg.layers, cfg.kv_heads, cfg.head_dim, device=device, n_q_heads=cfg.heads,
                        table=table if table and os.path.exists(table) else None)


# ----------------------------------------------------------------------------- driver
def psnr_list(a, b, fpc):
    """Per-chunk PSNR (dB, capped) of frames a against b ([T, H, W, C] in 0..255)."""
    from rollout import psnr_chunks
    return psnr_chunks(a, b, fpc)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--weights", default=os.path.join(HERE, "weights.safetensors"))
    ap.add_argument("--frames", help="frames file from `make data`")
    ap.add_argument("--synthetic", type=int, default=0, help="N synthetic frames instead")
    ap.add_argument("--seed", type=int, default=1234, help="synthetic frames' seed")
    ap.add_argument("--schemes", action="append", default=None,
                    help="comma-separated scheme names or .lua paths (repeatable); bf16 always runs first")
    ap.add_argument("--scheme-dir", default=os.path.join(REPO, "schemes"))
    ap.add_argument("--table-dir", default=None, help="sensitivity tables of mixed-precision schemes, LABEL.json")
    ap.add_argument("--kvforge-python", default=os.path.join(REPO, "python"))
    ap.add_argument("--prompt-chunks", type=int, default=1)
    ap.add_argument("--chunks", type=int, default=6, help="chunks generated")
    ap.add_argument("--first-frame", type=int, default=None, help="first frame (default: the held-out split's)")
    ap.add_argument("--head-seeds", choices=("global", "local"), default="global",
                    help="k-means seeds of a rank's heads: those of the global heads (default) or the scheme's")
    ap.add_argument("--check", action="store_true",
                    help="rank 0 also runs the single-process rollout of every scheme and compares")
    ap.add_argument("--save", default=None, help="rank 0 writes the generated patches here (.npz, one per scheme)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads a rank (--device cpu)")
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    if a.schemes is None:
        a.schemes = ["bf16,rtn_int2,qvg_int2"]
    if not a.frames and not a.synthetic:
        ap.error("--frames or --synthetic is needed")
    return a


def init_distributed(device_kind: str):
    """Joins the torchrun group (a lone process without torchrun's variables: world size 1).
    Returns (Ulysses, torch.device)."""
    if "RANK" in os.environ and not dist.is_initialized():
        if device_kind == "cuda":
            lr = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(lr)
            dist.init_process_group("nccl", device_id=torch.device("cuda", lr))
        else:
            dist.init_process_group("gloo")
    sp = Ulysses()
    if device_kind == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    else:
        device = torch.device(device_kind)
    return sp, device


def gather_obj(sp: Ulysses, obj):
    if sp.world == 1:
        return [obj]
    out = [None] * sp.world
    dist.all_gather_object(out, obj)
    return out


def barrier(sp: Ulysses, device):
    if sp.world > 1:
        if device.type == "cuda":
            dist.barrier(device_ids=[device.index])
        else:
            dist.barrier()


@torch.no_grad()
def run(a):
    if a.kvforge_python and os.path.isdir(a.kvforge_python):
        sys.path.insert(0, a.kvforge_python)
    import rollout  # scheme parsing and metrics (after the kvforge path is set)
    sp, device = init_distributed(torch.device(a.device).type)
    if device.type == "cpu":
        torch.set_num_threads(a.threads)
    cuda = device.type == "cuda"
    model, frames, meta = load_model_and_frames(a.weights, device, a.frames, a.synthetic, a.seed)
    cfg = model.cfg
    hk, hq = head_share(cfg, sp.world)
    if cfg.tokens_per_chunk % sp.world:
        raise SystemExit(f"{cfg.tokens_per_chunk} tokens a chunk do not split over {sp.world} ranks")
    fpc, nc = cfg.frames_per_chunk, cfg.tokens_per_chunk
    P, N = a.prompt_chunks, a.chunks
    length = fpc * (P + N)
    s = meta["heldout_start"] if a.first_frame is None else a.first_frame
    if s + length > len(frames):
        raise SystemExit(f"first frame {s}: frames up to {s + length - 1} needed, the video has {len(frames)}")
    clip = torch.from_numpy(np.ascontiguousarray(frames[s:s + length])).to(device)
    prompt = frames_to_patches(clip, cfg)[None][:, :P * nc]
    real = clip[P * fpc:].float()
    del frames
    entries = rollout.scheme_entries(argparse.Namespace(schemes=a.schemes, scheme_dir=a.scheme_dir,
                                                        cache_factory=None))
    ac = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    tmpdir = tempfile.mkdtemp(prefix=f"sp_rank{sp.rank}_")
    results, saved, bf16_frames = {}, {}, None
    for entry in entries:
        name, kind = entry[0], entry[1]
        r = {"status": "ok", "kind": kind, "source": entry[2] if kind == "kvforge" else None}
        t_all = time.time()
        try:
            barrier(sp, device)
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                base_mem = torch.cuda.memory_allocated(device)
            cache, info = make_rank_cache(entry, cfg, device, sp, a.table_dir, a.head_seeds, tmpdir)
            calls = []
            with ac:
                gen = sp_generate(model, prompt, N, cache, sp, on_call=lambda c, t: calls.append(t))
            peak = int(torch.cuda.max_memory_allocated(device)) if cuda else None
            mine = {"scheme_id": info["scheme_id"], "seeds": info["seeds"], "cache_bytes": int(cache.nbytes),
                    "cache_memory": cache_memory(cache), "compression_ratio": float(cache.compression_ratio),
                    "peak_gpu_bytes": peak, "peak_gpu_bytes_over_model": None if peak is None else peak - base_mem,
                    "seconds_per_call": [round(t, 5) for t in calls]}
            del cache
            ranks = gather_obj(sp, mine)
            gen_f = patches_to_frames(gen[0].float(), cfg)
            gen_cpu = gen[0].float().cpu()
            del gen
            if name == "bf16":
                bf16_frames = gen_f
            gen_calls = calls[P - 1:][1:] or calls[P - 1:]   # generated chunks after the first
            r.update({
                "per_rank": ranks,
                "scheme_id_per_rank": [x["scheme_id"] for x in ranks],
                "head_seeds": [x["seeds"] for x in ranks],
                "cache_bytes_per_rank": [x["cache_bytes"] for x in ranks],
                "cache_bytes_total": sum(x["cache_bytes"] for x in ranks),
                "compression_ratio": ranks[0]["compression_ratio"],
                "peak_gpu_bytes_per_rank": [x["peak_gpu_bytes"] for x in ranks],
                "peak_gpu_bytes_over_model_per_rank": [x["peak_gpu_bytes_over_model"] for x in ranks],
                "seconds_per_call": [max(x["seconds_per_call"][i] for x in ranks) for i in range(len(calls))],
                "mean_seconds_per_generated_chunk": float(np.mean(gen_calls)),
                "last_chunk_seconds": calls[-1],
                "psnr_vs_real_per_chunk": psnr_list(gen_f, real, fpc),
                "psnr_vs_bf16_per_chunk": psnr_list(gen_f, bf16_frames, fpc),
            })
            if a.save and sp.rank == 0:
                saved[name] = gen_cpu.numpy()
            if a.check:
                chk = None
                if sp.rank == 0:
                    if cuda:
                        torch.cuda.synchronize(device)
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats(device)
                        base1 = torch.cuda.memory_allocated(device)
                    one = make_single_cache(entry, cfg, device, a.table_dir)
                    times, t_prev = [], [time.perf_counter()]

                    def tick(i, pred):
                        if cuda:
                            torch.cuda.synchronize(device)
                        now = time.perf_counter()
                        times.append(now - t_prev[0])
                        t_prev[0] = now
                    with ac:
                        ref = generate(model, prompt, N, one, on_chunk=tick)[0].float().cpu()
                    peak1 = int(torch.cuda.max_memory_allocated(device)) if cuda else None
                    del one
                    diff = (gen_cpu - ref).abs()
                    chk = {"identical": bool(torch.equal(gen_cpu, ref)),
                           "max_abs_diff": float(diff.max()),
                           "differing_values": int((diff > 0).sum()),
                           "psnr_vs_single_per_chunk": psnr_list(gen_f.cpu(), patches_to_frames(ref, cfg), fpc),
                           "single_seconds_per_generated_chunk": [round(t, 5) for t in times],
                           "single_mean_seconds_per_generated_chunk": float(np.mean(times[1:] or times)),
                           "single_peak_gpu_bytes": peak1,
                           "single_peak_gpu_bytes_over_model": None if peak1 is None else peak1 - base1}
                barrier(sp, device)
                if sp.rank == 0:
                    r["check"] = chk
        except Exception as e:  # a scheme failing on one rank must not leave the others waiting
            if name == "bf16" or sp.world > 1:
                raise
            r = {"status": "error", "kind": kind, "error": f"{type(e).__name__}: {e}",
                 "traceback": traceback.format_exc(limit=4)}
        r["seconds"] = round(time.time() - t_all, 2)
        results[name] = r
        if sp.rank == 0:
            print(summary_line(name, r), flush=True)
            write_json(a.json, report(a, cfg, meta, s, P, N, sp, device, hk, hq, results, partial=True))
    if sp.rank == 0:
        write_json(a.json, report(a, cfg, meta, s, P, N, sp, device, hk, hq, results))
        if a.save:
            np.savez(a.save, **saved)
        print(f"wrote {a.json}", flush=True)
    shutil.rmtree(tmpdir, ignore_errors=True)
    barrier(sp, device)
    if dist.is_initialized():
        dist.destroy_process_group()
    return results


def report(a, cfg, meta, start, P, N, sp, device, hk, hq, results, partial=False):
    cuda = device.type == "cuda"
    return {
        "weights": os.path.relpath(a.weights, REPO) if os.path.abspath(a.weights).startswith(REPO) else a.weights,
        "weights_sha256": weights_sha256(a.weights), "model": json.loads(cfg.to_json()),
        "source": (f"synthetic ({a.synthetic} frames, seed {a.seed})" if a.synthetic
                   else f"vtest.avi frames (sha256 {meta['frames_sha256']})"),
        "start": start, "prompt_chunks": P, "generated_chunks": N, "tokens_per_chunk": cfg.tokens_per_chunk,
        "context_tokens_at_last_chunk": (P + N - 1) * cfg.tokens_per_chunk,
        "world_size": sp.world, "backend": dist.get_backend() if dist.is_initialized() else None,
        "kv_heads_per_rank": hk, "q_heads_per_rank": hq, "tokens_per_rank": cfg.tokens_per_chunk // sp.world,
        "head_seeds": a.head_seeds,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__, "partial": partial, "schemes": results,
    }


def summary_line(name, r):
    if r["status"] != "ok":
        return f"{name:12s} ERROR {r['error']}"
    s = (f"{name:12s} ratio {r['compression_ratio']:5.2f}x  cache/rank "
         f"{max(r['cache_bytes_per_rank']) / 2**20:8.2f} MiB  {1e3 * r['mean_seconds_per_generated_chunk']:8.1f} ms/chunk"
         f"  PSNR vs real {np.mean(r['psnr_vs_real_per_chunk']):6.2f}")
    if any(r["peak_gpu_bytes_per_rank"]):
        s += "  peak/rank " + ",".join(f"{x / 2**20:.0f}" for x in r["peak_gpu_bytes_per_rank"]) + " MiB"
    c = r.get("check")
    if c:
        s += (f"  vs 1 process: {'identical' if c['identical'] else 'differs'} (max |d| {c['max_abs_diff']:.3g}, "
              f"min PSNR {min(c['psnr_vs_single_per_chunk']):.1f} dB)")
        if c["single_peak_gpu_bytes"]:
            s += f", 1-GPU peak {c['single_peak_gpu_bytes'] / 2**20:.0f} MiB"
    return s + f"  {r['seconds']:.1f} s"


def main(argv=None):
    return run(parse_args(argv))


if __name__ == "__main__":
    main()
