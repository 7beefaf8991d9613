#!/usr/bin/env python3
"""QVG's own encode/decode (the peer) beside kvforge's, on the same tensors, in one process.

The LongCat layer of docs/BACKGROUND.md section 1: K and V each [1, 32 heads, 29640 tokens, 128]
BF16, heterogeneous (per-token scale in [0.5, 1.5], two outlier channels per
token of amplitude 20 at positions that differ from token to token): the data
of kvf_bench (libkvforge's kvf_synth_kv, seeds 1 and 2), copied to the GPU once.

Timed with CUDA events (median of --reps after --warmup calls), all in one
process and on one stream:
  * copy: a device-to-device copy of K and V (the bandwidth ceiling; read + write);
  * QVG (quant-videogen, eval/peer/qvg_codec.py, each of CONFIGS): encode =
    compress_kv_cache on K and V, decode = uncompress_kv_cache to BF16;
  * kvforge schemes (python/kvforge Context on the GPU): encode = kvf_encode of
    the 29640-token span, decode = kvf_decode into preallocated BF16 [H, N, d].
Per method: milliseconds, decode bandwidth = (stored bytes read + BF16 bytes
written) / time and its fraction of the copy's, compression = BF16 bytes / stored
bytes (QVG: counted from its tensors; kvforge: kvf_packed_size), relative
error of K and V (Frobenius). Then ratios against the first QVG configuration.

    KVFORGE_LIB=out/lib/libkvforge.so PYTHONPATH=python python3 bench/peer_bench.py \\
        [--schemes rtn_int2 qvg_int2 quantwm_int2] [--peers all|none|NAME ...] [--json OUT.json]

Without torch or CUDA it prints why and exits with status 77 (skipped); without
the peer it times kvforge alone and says so. --device cpu --tokens 256 --heads 2
runs the same code on the CPU reference (perf_counter times) as a smoke test.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "eval", "peer"))
SKIP = 77


def synth(torch, tokens, heads, d, seed):
    """Seeded BF16 data [heads, tokens, d] shaped as kvf_synth_kv's (unit-scale
    values and two outlier channels of amplitude ~20 a token, on random channels):
    a torch.bfloat16 CPU tensor. Both systems are timed on the same tensor."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(heads, tokens, d, generator=g)
    ch = torch.randint(0, d, (heads, tokens, 2), generator=g)
    amp = 20.0 * (1.0 + 0.25 * torch.randn(heads, tokens, 2, generator=g))
    x.scatter_(2, ch, amp)
    return x.to(torch.bfloat16)


class Timer:
    def __init__(self, torch, device, reps, warmup):
        self.torch, self.cuda, self.reps, self.warmup = torch, device.startswith("cuda"), reps, warmup

    def __call__(self, fn):
        """Median milliseconds of fn over reps calls (after warmup), and every sample."""
        torch = self.torch
        for _ in range(self.warmup):
            fn()
        if self.cuda:
            torch.cuda.synchronize()
        ms = []
        for _ in range(self.reps):
            if self.cuda:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                ms.append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                fn()
                ms.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(ms), ms


def rel_err(torch, x, ref):
    x, ref = x.float(), ref.float()
    return float(torch.linalg.vector_norm(x - ref) / torch.linalg.vector_norm(ref))


def bench_qvg(torch, timer, k, v, config, seed, log):
    import qvg_codec
    codec = qvg_codec.QvgCodec(config, str(k.device), seed)
    state = {}

    torch.manual_seed(seed)  # k-means' initial tokens; the timed calls do not reseed

    def enc():
        state["kv"] = codec.compress(k, v, seeded=False)

    def dec():
        state["out"] = codec.decompress(*state["kv"])

    enc_ms, enc_all = timer(enc)
    dec_ms, dec_all = timer(dec)
    sk, sv = state["kv"]
    parts = {}
    for s in (sk, sv):
        for p, n in codec.state_bytes(s).items():
            parts[p] = parts.get(p, 0) + n
    ko, vo = state["out"]
    log(f"{config}: encode {enc_ms:.3f} ms, decode {dec_ms:.3f} ms, stored {sum(parts.values())} B {parts}")
    return {"name": config, "kind": "peer", "describe": codec.describe(), "encode_ms": enc_ms, "decode_ms": dec_ms,
            "encode_samples": enc_all, "decode_samples": dec_all, "stored_bytes": sum(parts.values()),
            "parts": parts, "held_bytes": codec.held_bytes(sk) + codec.held_bytes(sv),
            "rel_err_k": rel_err(torch, ko, k), "rel_err_v": rel_err(torch, vo, v)}


def bench_kvforge(torch, timer, k, v, scheme, device, log):
    import kvforge
    ctx = kvforge.Context(scheme, device=device)
    H, N, _ = k.shape
    packed = torch.empty(ctx.packed_size(N, H), dtype=torch.uint8, device=k.device)
    ko, vo = torch.empty_like(k), torch.empty_like(v)
    enc_ms, enc_all = timer(lambda: ctx.encode(k, v, out=packed))
    dec_ms, dec_all = timer(lambda: ctx.decode(packed, N, H, out=(ko, vo)))
    log(f"{scheme}: encode {enc_ms:.3f} ms, decode {dec_ms:.3f} ms, stored {packed.numel()} B ({ctx.backend})")
    return {"name": scheme, "kind": "scheme", "describe": f"{ctx.scheme.id} ({ctx.backend}, {ctx.origin})",
            "encode_ms": enc_ms, "decode_ms": dec_ms, "encode_samples": enc_all, "decode_samples": dec_all,
            "stored_bytes": int(packed.numel()), "parts": {"packed": int(packed.numel())},
            "rel_err_k": rel_err(torch, ko, k), "rel_err_v": rel_err(torch, vo, v)}


def finish(rows, copy, bf16_bytes):
    """Derived columns and ratios against the first peer row (if any)."""
    copy_bw = 2 * bf16_bytes / (copy["ms"] * 1e-3)
    for r in rows:
        r["compression"] = bf16_bytes / r["stored_bytes"]
        r["decode_bytes_per_s"] = (r["stored_bytes"] + bf16_bytes) / (r["decode_ms"] * 1e-3)
        r["decode_bw_of_copy"] = r["decode_bytes_per_s"] / copy_bw
    base = next((r for r in rows if r["kind"] == "peer"), None)
    for r in rows:
        r["vs"] = base["name"] if base else None
        for key in ("encode_ms", "decode_ms"):
            r[f"{key}_ratio"] = r[key] / base[key] if base else None
        r["compression_ratio"] = r["compression"] / base["compression"] if base else None
    return copy_bw


def table(rows, copy, copy_bw) -> str:
    out = [f"copy ceiling: {copy['ms']:.3f} ms for K+V, {copy_bw / 1e12:.3f} TB/s (read + write)",
           f"{'method':26s} {'encode ms':>10s} {'decode ms':>10s} {'dec TB/s':>9s} {'of copy':>8s} "
           f"{'compr.':>7s} {'rel.err K':>9s} {'enc x':>7s} {'dec x':>7s} {'compr x':>8s}"]
    for r in rows:
        ratio = lambda key: f"{r[key]:7.3f}" if r.get(key) is not None else f"{'-':>7s}"  # noqa: E731
        out.append(f"{r['kind'][0]}:{r['name']:24s} {r['encode_ms']:10.3f} {r['decode_ms']:10.3f} "
                   f"{r['decode_bytes_per_s'] / 1e12:9.3f} {r['decode_bw_of_copy']:8.3f} {r['compression']:6.2f}x "
                   f"{r['rel_err_k']:9.4f} {ratio('encode_ms_ratio')} {ratio('decode_ms_ratio')} "
                   f" {ratio('compression_ratio')}")
    if rows and rows[0].get("vs"):
        out.append(f"'enc x', 'dec x': time / {rows[0]['vs']}'s time (below 1: faster); 'compr x': compression / "
                   f"its compression; 'of copy': decode bandwidth / the copy's")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--schemes", nargs="*", default=["rtn_int2", "qvg_int2", "quantwm_int2"])
    ap.add_argument("--peers", nargs="*", default=["all"], help="QVG configurations, 'all' or 'none'")
    ap.add_argument("--tokens", type=int, default=29640)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1234, help="QVG's k-means RNG seed")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    log = lambda m: print(f"peer_bench: {m}", flush=True)  # noqa: E731
    try:
        import torch
    except ImportError:
        print("peer_bench: skipped: torch is not installed", flush=True)
        return SKIP
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("peer_bench: skipped: no CUDA device", flush=True)
        return SKIP
    import kvforge
    import qvg_codec
    peers = list(qvg_codec.CONFIGS) if a.peers == ["all"] else [] if a.peers == ["none"] else a.peers
    why = qvg_codec.unavailable(a.device) if peers else None
    if why:
        log(f"the peer is skipped: {why}")
        peers = []
    dev = torch.device(a.device)
    k = synth(torch, a.tokens, a.heads, a.head_dim, 1).to(dev)
    v = synth(torch, a.tokens, a.heads, a.head_dim, 2).to(dev)
    bf16_bytes = 2 * k.numel() * k.element_size()
    timer = Timer(torch, a.device, a.reps, a.warmup)
    src = torch.cat([k.reshape(-1), v.reshape(-1)])
    dst = torch.empty_like(src)
    copy_ms, copy_all = timer(lambda: dst.copy_(src))
    del src, dst
    copy = {"ms": copy_ms, "samples": copy_all}
    rows = []
    for p in peers:
        rows.append(bench_qvg(torch, timer, k, v, p, a.seed, log))
        if a.device.startswith("cuda"):
            torch.cuda.empty_cache()
    for s in a.schemes:
        rows.append(bench_kvforge(torch, timer, k, v, s, a.device, log))
    copy_bw = finish(rows, copy, bf16_bytes)
    text = table(rows, copy, copy_bw)
    print(text, flush=True)
    if a.json:
        env = {"torch": torch.__version__, "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
               "kvforge": kvforge.version()}
        try:
            import triton
            env["triton"] = triton.__version__
        except ImportError:
            pass
        with open(a.json, "w") as f:
            json.dump({"shape": {"heads": a.heads, "tokens": a.tokens, "head_dim": a.head_dim},
                       "data": "kvf_synth_kv seeds 1 (K) and 2 (V)", "bf16_bytes": bf16_bytes, "reps": a.reps,
                       "warmup": a.warmup, "env": env, "copy": copy, "copy_bytes_per_s": copy_bw,
                       "rows": rows, "table": text}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
