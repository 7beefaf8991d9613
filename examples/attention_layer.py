#!/usr/bin/env python3
"""One attention layer of a video world model run through a kvforge KV cache.

Shape of a 480p video diffusion transformer's attention: 32 heads, head_dim 128,
1560 tokens per latent frame, 3 frames per chunk (4680 tokens). Chunks are
generated one after another; chunk t's queries attend to every earlier chunk
(from the cache: packed by the scheme, decoded to BF16) and to chunk t's own
keys and values (BF16), then chunk t goes into the cache. The same attention
over BF16 K/V of every chunk is the reference.

Printed per chunk: tokens cached, cache bytes against BF16 bytes, and the
attention output's error against the BF16 reference (relative Frobenius
error and cosine similarity); at the end, the memory saved.

    PYTHONPATH=python KVFORGE_LIB=out/lib/libkvforge.so \\
        python3 examples/attention_layer.py --scheme schemes/rtn_int2.lua --chunks 4

Schemes with rope.placement = "pre" cache keys before RoPE: the layer then
makes pre-RoPE queries and keys, gives the cache each chunk's token positions
((frame, row, column) on a 30 x 52 latent grid for 3-axis RoPE, the token's
index for 1-axis), and attends with keys and queries turned by the scheme's
RoPE (docs/METHODS.md section 6), in the reference too.

The K/V are synthetic with the statistics that make video caches hard to
quantize (per-channel offsets, a few outlier channels, neighbouring tokens
alike); pass --kv-heads 8 for grouped-query attention (32 query heads over 8
KV heads).
"""
import argparse
import sys
import time
from pathlib import Path

try:
    import torch
except ImportError:
    sys.exit("attention_layer.py needs PyTorch")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))  # a checkout without install
import kvforge  # noqa: E402


def synthetic(gen, heads, frames, tokens_per_frame, d, *, outliers, device, scale_all=1.0):
    """BF16 [heads, frames * tokens_per_frame, d] with video-like structure: per-channel
    offsets and scales, `outliers` times larger scales on 4 channels per head, a
    component shared by a frame's tokens, neighbouring tokens alike."""
    n = frames * tokens_per_frame
    off = torch.randn(heads, 1, d, generator=gen) * 1.5
    scale = torch.exp(torch.randn(heads, 1, d, generator=gen) * 0.5)
    if outliers > 1:
        idx = torch.randint(0, d, (heads, 4), generator=gen)
        scale.scatter_(2, idx[:, None, :], scale.gather(2, idx[:, None, :]) * outliers)
    # a frame's tokens share a per-frame component; neighbouring tokens are alike
    frame = torch.randn(heads, frames, 1, d, generator=gen).expand(heads, frames, tokens_per_frame, d)
    x = 0.5 * frame.reshape(heads, n, d) + torch.randn(heads, n, d, generator=gen)
    x = 0.7 * x + 0.3 * torch.roll(x, 1, dims=1)
    return ((x * scale + off) * scale_all).to(torch.bfloat16).to(device)


def positions(chunk, frames, tokens_per_frame, axes, device):
    """int32 [frames * tokens_per_frame, axes]: the chunk's tokens' RoPE positions,
    frames counted from the start of the video."""
    width = 52 if tokens_per_frame % 52 == 0 else tokens_per_frame
    t = torch.arange(frames * tokens_per_frame)
    if axes == 1:
        p = (t + chunk * frames * tokens_per_frame)[:, None]
    else:
        r = t % tokens_per_frame
        cols = [chunk * frames + t // tokens_per_frame, r // width, r % width]
        cols += [torch.zeros_like(t)] * (axes - 3)
        p = torch.stack(cols[:axes], 1)
    return p.to(torch.int32).to(device)


def attention(q, k, v):
    """q [Hq, N, d], k/v [Hkv, T, d]; non-causal inside the chunk (video diffusion)."""
    rep = q.shape[0] // k.shape[0]
    if rep > 1:
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    return torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None])[0]


def mib(n):
    return n / 2**20


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scheme", default="schemes/rtn_int2.lua", help="scheme file or shipped name")
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--heads", type=int, default=32, help="query heads")
    ap.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: --heads)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens-per-frame", type=int, default=1560)
    ap.add_argument("--frames-per-chunk", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--outliers", type=float, default=4.0,
                    help="scale factor of 4 outlier channels per head in K and V (1 = none)")
    ap.add_argument("--query-scale", type=float, default=0.5,
                    help="queries' scale: sets how peaked the softmax is")
    a = ap.parse_args()
    hkv = a.kv_heads or a.heads
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit("no CUDA device visible to torch (use --device cpu for the CPU reference, slowly)")
    dev = torch.device(a.device)
    gen = torch.Generator().manual_seed(a.seed)

    t0 = time.perf_counter()
    cache = kvforge.QuantizedKVCache(a.scheme, num_layers=1, num_kv_heads=hkv, head_dim=a.head_dim,
                                     device=dev, num_q_heads=a.heads)
    t_ctx = time.perf_counter() - t0
    n = a.frames_per_chunk * a.tokens_per_frame
    print(f"kvforge {kvforge.version()} ({kvforge.library_path()})")
    print(f"scheme {cache.scheme.id}: kernels {cache.ctx.backend} from {cache.ctx.origin} in {t_ctx:.2f} s; "
          f"chunk policy {cache.chunk_policy}")
    print(f"layer: {a.heads} query heads, {hkv} KV heads, d = {a.head_dim}, {a.tokens_per_frame} tokens/frame x "
          f"{a.frames_per_chunk} frames = {n} tokens/chunk, {a.chunks} chunks on {dev}")
    print(f"{'chunk':>5} {'cached':>8} {'cache MiB':>10} {'BF16 MiB':>9} {'ratio':>6} "
          f"{'rel.err':>8} {'cosine':>8} {'append ms':>9} {'decode ms':>9}")
    info = cache.info
    pre = info.rope_placement == "pre"
    if pre:
        from kvforge._rope import rope_torch
        print(f"RoPE before the cache: {info.rope_axes}-axis positions, sections {info.rope_sections}, "
              f"theta {info.rope_theta}, layout {info.rope_layout}")
    ks, vs = [], []
    errs = []
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    for t in range(a.chunks):
        q = synthetic(gen, a.heads, a.frames_per_chunk, a.tokens_per_frame, a.head_dim, outliers=1,
                      device=dev, scale_all=a.query_scale)
        k = synthetic(gen, hkv, a.frames_per_chunk, a.tokens_per_frame, a.head_dim, outliers=a.outliers, device=dev)
        v = synthetic(gen, hkv, a.frames_per_chunk, a.tokens_per_frame, a.head_dim, outliers=a.outliers, device=dev)
        if t == 0:
            rep = a.heads // hkv
            lg = (q[:rep, :256].float() @ k[:1].float().transpose(1, 2)) / a.head_dim ** 0.5
            print(f"(synthetic data: attention logits' std over keys {lg.std(-1).mean().item():.2f}, "
                  f"largest softmax weight {torch.softmax(lg, -1).max(-1).values.mean().item():.3f} on average)")
        pos = positions(t, a.frames_per_chunk, a.tokens_per_frame, info.rope_axes, dev) if pre else None
        # q, k are what the model computes before RoPE when the scheme caches them so;
        # attention always sees turned ones.
        q_att, k_att = (rope_torch(q, pos, info), rope_torch(k, pos, info)) if pre else (q, k)
        ks.append(k_att)
        vs.append(v)
        ref = attention(q_att, torch.cat(ks, 1), torch.cat(vs, 1)).float()
        sync()
        t1 = time.perf_counter()
        Kc, Vc = cache.keys_values(0)
        sync()
        t_dec = time.perf_counter() - t1
        out = attention(q_att, torch.cat([Kc, k_att], 1), torch.cat([Vc, v], 1)).float()
        rel = ((out - ref).norm() / ref.norm()).item()
        cos = torch.nn.functional.cosine_similarity(out.double().flatten(), ref.double().flatten(), dim=0).item()
        errs.append(rel)
        del Kc, Vc
        sync()
        t1 = time.perf_counter()
        cache.append(0, k, v, q=q, positions=pos)
        sync()
        t_app = time.perf_counter() - t1
        m = cache.memory()
        print(f"{t:>5} {m['tokens']:>8} {mib(m['total']):>10.2f} {mib(m['kv_bf16']):>9.2f} "
              f"{m['compression_ratio']:>6.2f} {rel:>8.5f} {cos:>8.6f} {1e3 * t_app:>9.2f} {1e3 * t_dec:>9.2f}")
    m = cache.memory()
    saved = m["kv_bf16"] - m["total"]
    print(f"memory: {mib(m['total']):.2f} MiB held (packed {mib(m['packed']):.2f}, BF16 {mib(m['bf16']):.2f}, "
          f"query statistics {mib(m['qstats']):.2f}) for {m['tokens']} tokens, against {mib(m['kv_bf16']):.2f} MiB "
          f"of BF16 K/V: {mib(saved):.2f} MiB saved ({100 * saved / m['kv_bf16']:.1f}%), "
          f"{m['compression_ratio']:.2f}x")
    if len(errs) > 1:
        print(f"attention output vs BF16 over chunks 1..{a.chunks - 1} (chunk 0 has an empty cache): "
              f"relative error mean {sum(errs[1:]) / len(errs[1:]):.5f}, max {max(errs[1:]):.5f}")


if __name__ == "__main__":
    main()
