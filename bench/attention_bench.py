#!/usr/bin/env python3
"""Block-streamed attention over a packed cache against decode-everything-then-SDPA.

For each shape, scheme and history length (chunks appended to one layer of a
QuantizedKVCache), one chunk of queries attends to the whole cached history:

* sdpa:   SDPA alone on the history already decoded (the ceiling; not a way
          to run, its K/V are the history's full size);
* base:   keys_values() (the whole history decoded to BF16), then SDPA: what a
          user does without cache.attention;
* entry:  cache.attention(block_tokens=None): a block per cache entry;
* group:  cache.attention(block_tokens=G chunks);
* group-torch: the same with the merge in torch operations (no Triton).

GQA queries are folded into the query axis for SDPA ([1, Hkv, g*L, d], query
head i reads KV head i // g), as cache.attention does, so both run the same
kernel on the same problem. Times: interleaved rounds of CUDA-event timings,
medians; the ratio to base is the median over rounds of the per-round ratio,
with its 10th-90th percentile. Memory: torch.cuda.max_memory_allocated() during
one call minus memory_allocated() before it, the scratch ring released first
(so it counts), the cache itself and q not counted, the output counted. Errors:
each output against base's, and both against float32 arithmetic on the first
64 queries of every head.

Then one step (decode + attention) captured in a CUDA graph, replayed with new
queries, against eager.

    KVFORGE_LIB=out/lib/libkvforge.so PYTHONPATH=python python3 bench/attention_bench.py --out DIR
    ... --device cpu --tiny      (the whole script on the CPU, tiny shapes: a check of the script)
"""
import argparse
import gc
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import kvforge
from kvforge import attention as A
from sdpa import time_once  # bench/sdpa.py: the script's own folder is on sys.path

# LongCat's benchmark layer (docs/BENCHMARKS.md): 32 heads x 29640 tokens x 128,
# here 6 chunks of 4940; the world model: 2 KV heads, 8 query heads, 4680 tokens a chunk.
SHAPES = {
    "longcat": dict(hkv=32, hq=32, chunk=4940, q=4680, histories=[6, 12, 24]),
    "worldmodel": dict(hkv=2, hq=8, chunk=4680, q=4680, histories=[4, 8, 16, 32]),
}
TINY = {
    "longcat": dict(hkv=4, hq=4, chunk=96, q=64, histories=[2, 4]),
    "worldmodel": dict(hkv=2, hq=8, chunk=80, q=48, histories=[2, 4, 8]),
}


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


class Timer:
    def __init__(self, dev):
        self.cuda = dev.type == "cuda"

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def once(self, fn, inner):
        """Milliseconds per call over inner back-to-back calls."""
        return time_once(fn, inner, self.cuda)

    def interleaved(self, fns, rounds, inner):
        for fn in fns:
            for _ in range(2):
                fn()
        self.sync()
        out = [[] for _ in fns]
        for r in range(rounds):
            order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))
            for i in order:
                out[i].append(self.once(fns[i], inner))
        return out


def peak_bytes(fn, dev):
    """Peak bytes allocated during fn() above what was allocated before (None on the CPU)."""
    if dev.type != "cuda":
        fn()
        return None
    gc.collect()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    r = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del r
    return int(peak)


def make_cache(scheme, shp, n_chunks, dev, seed):
    """A one-layer cache of n_chunks chunks of synthetic K/V: per-token scale in
    [0.5, 1.5] and two outlier channels of amplitude about 20 a token (the
    benchmark layer's data, docs/BENCHMARKS.md)."""
    g = torch.Generator(device=dev).manual_seed(seed)
    cache = kvforge.QuantizedKVCache(scheme, 1, shp["hkv"], 128, device=str(dev), num_q_heads=shp["hq"])
    H, n, d = shp["hkv"], shp["chunk"], 128
    for _ in range(n_chunks):
        kv = []
        for _ in range(2):
            x = torch.randn(H, n, d, device=dev, generator=g) * (0.5 + torch.rand(1, n, 1, device=dev, generator=g))
            idx = torch.randint(0, d, (H, n, 2), device=dev, generator=g)
            x.scatter_add_(2, idx, torch.full(idx.shape, 20.0, device=dev))
            kv.append(x.to(torch.bfloat16))
        cache.append(0, kv[0], kv[1])
    return cache


_INLINE = A._Inline()


def attend(cache, q, bt, dev, merge="auto"):
    """cache.attention; on the CPU the path CUDA takes (ring, merges as blocks come),
    run in program order with float32 matmuls as the kernel, so that a CPU run
    checks the code the GPU runs."""
    if dev.type == "cuda":
        return A.cache_attention(cache, 0, q, block_tokens=bt, merge=merge)
    return A.cache_attention(cache, 0, q, block_tokens=bt, merge=merge, kernel="math", _streams=_INLINE)


def f32_reference(q, K, V, hkv, nq=64):
    """float32 attention of the first nq queries of every head: [Hq, nq, d]."""
    hq = q.shape[0]
    gq = hq // hkv
    qs = q[:, :nq].float().reshape(hkv, gq * min(nq, q.shape[1]), -1)
    s = torch.matmul(qs, K.float().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, V.float()).reshape(hq, -1, q.shape[-1])


def err(a, ref):
    a, ref = a.float(), ref.float()
    m = float((a - ref).abs().max())
    return {"max_abs": m, "rel": m / max(float(ref.abs().max()), 1e-30)}


def run_config(name, shp, scheme, n_chunks, group, args, dev, timer):
    cache = make_cache(scheme, shp, n_chunks, dev, seed=n_chunks)
    hkv, hq, L, d = shp["hkv"], shp["hq"], shp["q"], 128
    gq = hq // hkv
    T = cache.num_tokens(0)
    gen = torch.Generator(device=dev).manual_seed(99)
    q = torch.randn(hq, L, d, device=dev, generator=gen).to(torch.bfloat16)
    qf = q.reshape(1, hkv, gq * L, d)
    bt_group = group * shp["chunk"]

    def base():
        K, V = cache.keys_values(0)
        return F.scaled_dot_product_attention(qf, K[None], V[None])

    def entry():
        return attend(cache, q, None, dev)

    def grp():
        return attend(cache, q, bt_group, dev)

    def grp_torch():
        return attend(cache, q, bt_group, dev, merge="torch")

    # Outputs and errors (this first call also checks the kernel and loads Triton's).
    o_base = base()
    outs = {"entry": entry(), "group": grp(), "group-torch": grp_torch()}
    Kp, Vp = cache.keys_values(0)
    ref = f32_reference(q, Kp, Vp, hkv)
    nq = ref.shape[1]
    o_base_h = o_base.reshape(hq, L, d)
    errors = {"base_vs_f32": err(o_base_h[:, :nq], ref)}
    for k, o in outs.items():
        errors[f"{k}_vs_base"] = err(o, o_base_h)
        errors[f"{k}_vs_f32"] = err(o[:, :nq], ref)
    del outs, o_base, o_base_h, ref

    def sdpa():
        return F.scaled_dot_product_attention(qf, Kp[None], Vp[None])

    fns = {"sdpa": sdpa, "base": base, "entry": entry, "group": grp, "group-torch": grp_torch}
    raw = timer.interleaved(list(fns.values()), args.rounds, args.inner)
    times = dict(zip(fns, raw))
    del Kp, Vp
    med = statistics.median
    res = {"shape": name, "scheme": scheme, "chunks": n_chunks, "chunk_tokens": shp["chunk"], "tokens": T,
           "kv_heads": hkv, "q_heads": hq, "q_tokens": L, "group_chunks": group, "block_tokens_group": bt_group,
           "kernel": A.attention_kernel(cache, q, shp["chunk"]) if dev.type == "cuda" else "math (CPU)",
           "blocks_entry": len(A.block_plan(cache, 0, None)), "blocks_group": len(A.block_plan(cache, 0, bt_group)),
           "ms": {k: med(v) for k, v in times.items()},
           "ratio_to_base": {}, "ratio_to_sdpa": {}, "errors": errors, "transient_bytes": {}}
    for k in ("entry", "group", "group-torch", "sdpa"):
        rb = [b / a for a, b in zip(times["base"], times[k])]
        res["ratio_to_base"][k] = {"median": med(rb), "p10": pct(rb, 10), "p90": pct(rb, 90)}
    for k in ("base", "entry", "group"):
        rs = [b / a for a, b in zip(times["sdpa"], times[k])]
        res["ratio_to_sdpa"][k] = med(rs)
    # Memory: each way once, the ring released first so that it counts.
    res["transient_bytes"]["base"] = peak_bytes(base, dev)
    for k, fn in (("entry", entry), ("group", grp)):
        A.release_scratch(cache)
        res["transient_bytes"][k] = peak_bytes(fn, dev)
        res["transient_bytes"][k + "_ring"] = A.scratch_nbytes(cache)
    res["cache_bytes"] = cache.nbytes
    res["history_bf16_bytes"] = cache.bf16_nbytes
    A.release_scratch(cache)
    del cache
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def graph_test(shp, scheme, n_chunks, group, dev, timer, args):
    """One decode + attention step captured in a CUDA graph and replayed with new
    queries, against eager; and its time against eager."""
    r = {"shape": shp["name"], "scheme": scheme, "chunks": n_chunks, "block_tokens": group * shp["chunk"]}
    if dev.type != "cuda":
        r["captured"] = False
        r["reason"] = "CUDA graphs need a CUDA device"
        return r
    cache = make_cache(scheme, shp, n_chunks, dev, seed=5)
    bt = group * shp["chunk"]
    gen = torch.Generator(device=dev).manual_seed(7)
    q = torch.randn(shp["hq"], shp["q"], 128, device=dev, generator=gen).to(torch.bfloat16)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                cache.attention(0, q, block_tokens=bt)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            o = cache.attention(0, q, block_tokens=bt)
    except Exception as e:  # noqa: BLE001 - reported, not hidden
        r["captured"] = False
        r["reason"] = f"{type(e).__name__}: {e}"
        return r
    r["captured"] = True
    same, diffs = [], []
    for t in range(3):
        q.copy_(torch.randn(q.shape, device=dev, generator=gen).to(torch.bfloat16))
        g.replay()
        torch.cuda.synchronize()
        e = cache.attention(0, q, block_tokens=bt)
        same.append(bool(torch.equal(o, e)))
        diffs.append(float((o.float() - e.float()).abs().max()))
    r["replay_equals_eager"] = same
    r["replay_max_abs_diff"] = diffs
    te, tg = timer.interleaved([lambda: cache.attention(0, q, block_tokens=bt), g.replay], args.rounds, args.inner)
    r["ms"] = {"eager": statistics.median(te), "graph": statistics.median(tg)}
    del g, o, cache
    gc.collect()
    torch.cuda.empty_cache()
    return r


def fmt_mb(b):
    return "-" if b is None else f"{b / 2**20:.0f}"


def table(results, graph):
    lines = [f"{'shape':10s} {'scheme':9s} {'ch':>3s} {'tokens':>7s} {'sdpa':>8s} {'base':>8s} {'entry':>8s} "
             f"{'group':>8s} {'g-torch':>8s} | {'entry/b':>7s} {'group/b':>7s} {'gt/b':>6s} | "
             f"{'MB base':>8s} {'entry':>6s} {'group':>6s} | {'rel err grp/base':>16s} {'grp/f32':>8s} "
             f"{'base/f32':>8s}"]
    for r in results:
        if "skipped" in r:
            lines.append(f"{r['shape']:10s} {r['scheme']:9s} {r['chunks']:3d} skipped: {r['skipped']}")
            continue
        ms, rb, tb, e = r["ms"], r["ratio_to_base"], r["transient_bytes"], r["errors"]
        lines.append(
            f"{r['shape']:10s} {r['scheme']:9s} {r['chunks']:3d} {r['tokens']:7d} {ms['sdpa']:8.3f} {ms['base']:8.3f} "
            f"{ms['entry']:8.3f} {ms['group']:8.3f} {ms['group-torch']:8.3f} | {rb['entry']['median']:7.3f} "
            f"{rb['group']['median']:7.3f} {rb['group-torch']['median']:6.3f} | {fmt_mb(tb['base']):>8s} "
            f"{fmt_mb(tb['entry']):>6s} {fmt_mb(tb['group']):>6s} | {e['group_vs_base']['rel']:16.2e} "
            f"{e['group_vs_f32']['rel']:8.2e} {e['base_vs_f32']['rel']:8.2e}")
    lines.append("times in ms (medians); x/b = median per-round ratio to base (decode everything, then SDPA); "
                 "MB = peak transient MiB of one call (ring included); rel err = max abs error / max |reference|")
    if graph:
        if graph.get("captured"):
            lines.append(f"CUDA graph ({graph['shape']} {graph['scheme']} {graph['chunks']} chunks, block_tokens "
                         f"{graph['block_tokens']}): replay == eager {graph['replay_equals_eager']}, max abs diff "
                         f"{max(graph['replay_max_abs_diff']):.3g}; eager {graph['ms']['eager']:.3f} ms, "
                         f"graph {graph['ms']['graph']:.3f} ms")
        else:
            lines.append(f"CUDA graph: not captured: {graph.get('reason')}")
    return "\n".join(lines)


def goal(results):
    """The goal: block streaming within 5% of decode-then-SDPA's time, its transient
    memory independent of the history length."""
    done = [r for r in results if "skipped" not in r]
    out = {}
    for key in ("entry", "group"):
        worst = max((r["ratio_to_base"][key]["median"] for r in done), default=None)
        out[f"{key}_worst_ratio_to_base"] = worst
        out[f"{key}_within_5pct"] = worst is not None and worst <= 1.05
        flat = {}
        for r in done:
            k = (r["shape"], r["scheme"])
            if r["transient_bytes"][key] is not None:
                flat.setdefault(k, []).append(r["transient_bytes"][key])
        # "independent of the history": the largest history's transient memory no more
        # than 5% above the smallest's, for every shape and scheme.
        out[f"{key}_memory_flat"] = {f"{a}/{b}": (max(v) <= 1.05 * min(v)) for (a, b), v in flat.items()}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (a check of the script)")
    ap.add_argument("--schemes", default="rtn_int2,qvg_int2")
    ap.add_argument("--shapes", default="longcat,worldmodel")
    ap.add_argument("--group", type=int, default=4, help="chunks a block in the 'group' runs")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--inner", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=100.0, help="configurations not started after this are skipped")
    args = ap.parse_args()
    t0 = time.time()
    dev = torch.device(args.device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    timer = Timer(dev)
    shapes = TINY if args.tiny else SHAPES
    env = {"torch": torch.__version__, "kvforge": kvforge.version(), "device": str(dev),
           "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
           "triton_merge": dev.type == "cuda" and A._use_triton(torch, "auto", dev, 128),
           "commit": os.environ.get("KVF_COMMIT"), "tiny": args.tiny, "rounds": args.rounds, "inner": args.inner}
    os.makedirs(args.out, exist_ok=True)
    results = []
    report = {"env": env, "results": results, "graph": None}

    def save():
        report["goal"] = goal(results)
        if dev.type != "cuda":
            report["goal"]["note"] = "CPU timings: a check of the script, not a measurement of the goal"
        report["elapsed_s"] = time.time() - t0
        with open(os.path.join(args.out, "attention.json"), "w") as f:
            json.dump(report, f, indent=1)
        with open(os.path.join(args.out, "attention.txt"), "w") as f:
            f.write(table(results, report["graph"]) + "\n" + json.dumps(report["goal"]) + "\n")

    for scheme in args.schemes.split(","):
        for name in args.shapes.split(","):
            shp = dict(shapes[name], name=name)
            for n in shp["histories"]:
                if time.time() - t0 > args.budget_s:
                    results.append({"shape": name, "scheme": scheme, "chunks": n, "skipped": "time budget"})
                    continue
                r = run_config(name, shp, scheme, n, args.group, args, dev, timer)
                results.append(r)
                print(f"{name} {scheme} {n} chunks: base {r['ms']['base']:.3f} ms, entry x"
                      f"{r['ratio_to_base']['entry']['median']:.3f}, group x{r['ratio_to_base']['group']['median']:.3f}, "
                      f"MB base/entry/group {fmt_mb(r['transient_bytes']['base'])}/"
                      f"{fmt_mb(r['transient_bytes']['entry'])}/{fmt_mb(r['transient_bytes']['group'])} "
                      f"[{time.time() - t0:.0f} s]", flush=True)
                save()
    wm = dict(shapes["worldmodel"], name="worldmodel")
    # 8 chunks in blocks of 2: four blocks, merges into float32 and into the output.
    report["graph"] = graph_test(wm, args.schemes.split(",")[0], wm["histories"][1], 2, dev, timer, args)
    save()
    print(table(results, report["graph"]))
    print(json.dumps(report["goal"]))
    print(f"wrote {args.out}/attention.json, attention.txt in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
