#!/usr/bin/env python3
"""BF16 SDPA ceiling and decode + SDPA, on the GPU with torch.

SDPA alone: 4680 queries (one chunk) against 29640 cached + 4680 own tokens,
32 heads, d = 128: the benchmark layer of docs/BACKGROUND.md section 1. Then,
per scheme, kvforge decodes the packed 29640-token cache straight into the
first rows of the preallocated K/V buffers (strided output, no copy) and SDPA
runs: the target is decode + SDPA within 3% of SDPA alone. libkvforge is called through ctypes directly.

The overhead is a difference of two ~ms timings that drift with clocks and
temperature (single medians gave 1.8% in one run and 6.3% in another), so
every scheme is measured in ROUNDS interleaved rounds (SDPA alone, decode +
SDPA, decode alone, each timed with CUDA events, INNER calls per sample), and
the overhead is the median of the per-round ratios, with its 10th-90th
percentile spread. The same again with each step captured once in a CUDA
graph (no launch gaps or Python in the timing), unless --no-graph.

With --pipe, also the decode issued one layer ahead: a model that decodes
layer l+1's cache on a second stream while layer l's attention runs (two
sets of K/V buffers, each layer's SDPA waiting for its decode) spends per
layer the time of SDPA with the next decode beside it, and the overhead
printed is that over SDPA alone. Three orders: "pipe" queues the decode
before the SDPA, "pipe-a" after it, "pipe-hi" after it on a high-priority
stream. None is what the target measures (decode, then SDPA, on one stream:
"eager" and "graph"). On the H200, "pipe" hid little of the decode
(docs/journal/benchmarks.md, entry 584a543).
    KVFORGE_LIB=out/lib/libkvforge.so python3 bench/sdpa.py [--rounds N] [--inner N] [--no-graph] [--pipe] [SCHEME ...]
"""
import argparse
import ctypes as C
import os
import statistics
import time

import torch
import torch.nn.functional as F

H, D, CACHED, CHUNK = 32, 128, 29640, 4680


class Shape(C.Structure):
    _fields_ = [("n_tokens", C.c_int64), ("n_heads", C.c_int32), ("token_stride", C.c_int64), ("head_stride", C.c_int64)]


def lib():
    path = os.environ.get("KVFORGE_LIB", os.path.join(os.path.dirname(__file__), "..", "out", "lib", "libkvforge.so"))
    L = C.CDLL(path)
    L.kvf_last_error.restype = C.c_char_p
    return L


def check(L, rc):
    if rc:
        raise RuntimeError(L.kvf_last_error().decode())


def time_once(fn, inner, cuda=True):
    """Milliseconds per call of fn, over inner back-to-back calls, with CUDA events; with
    cuda=False, by the wall clock (fn runs synchronously on the CPU)."""
    if not cuda:
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - t) * 1e3 / inner
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(inner):
        fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / inner


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


def interleaved(fns, rounds, inner):
    """Per-round timings of each fn, the fns alternating within every round."""
    for fn in fns:  # warm up (and let clocks settle)
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    out = [[] for _ in fns]
    for r in range(rounds):
        order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))  # no fixed position
        for i in order:
            out[i].append(time_once(fns[i], inner))
    return out


def graphed(fn):
    """fn captured once in a CUDA graph; returns the replay function."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up on the side stream, as torch's docs ask
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def report(name, mode, t_sdpa, t_both, t_dec):
    ratios = [100 * (b / a - 1) for a, b in zip(t_sdpa, t_both)]
    med = statistics.median
    print(f"{name:16s} {mode:6s} {med(t_sdpa):8.3f} ms {med(t_both):9.3f} ms {med(t_dec):8.3f} ms "
          f"{med(ratios):7.2f}%  [{pct(ratios, 10):5.2f}, {pct(ratios, 90):5.2f}]  "
          f"{100 * (max(t_sdpa) / min(t_sdpa) - 1):5.1f}%")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("schemes", nargs="*", default=["rtn_int2", "qvg_int2", "quantwm_int2"])
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--inner", type=int, default=3)
    ap.add_argument("--no-graph", action="store_true")
    ap.add_argument("--pipe", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    dev = torch.device("cuda")
    total = CACHED + CHUNK
    q = torch.randn(1, H, CHUNK, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, H, total, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, H, total, D, device=dev, dtype=torch.bfloat16)
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v)
    (t_sdpa,) = interleaved([sdpa], args.rounds, args.inner)
    flops = 4.0 * H * CHUNK * total * D
    t = statistics.median(t_sdpa)
    print(f"SDPA alone: {t:.3f} ms = {flops / t / 1e9:.0f} TFLOP/s "
          f"({CHUNK} queries x {total} keys x {H} heads x d{D}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name()})")
    L = lib()
    # Per-token scale and two moving outlier channels (the benchmark layer's data,
    # docs/BACKGROUND.md section 1).
    src_k = torch.randn(1, H, CACHED, D, device=dev) * (0.5 + torch.rand(1, 1, CACHED, 1, device=dev))
    src_v = torch.randn(1, H, CACHED, D, device=dev) * (0.5 + torch.rand(1, 1, CACHED, 1, device=dev))
    idx = torch.randint(0, D, (1, H, CACHED, 2), device=dev)
    src_k.scatter_add_(3, idx, 20 * torch.ones_like(idx, dtype=src_k.dtype))
    src_v.scatter_add_(3, idx, 20 * torch.ones_like(idx, dtype=src_v.dtype))
    src_k, src_v = src_k.bfloat16().contiguous(), src_v.bfloat16().contiguous()
    print(f"{args.rounds} interleaved rounds x {args.inner} calls per sample; medians; overhead = median over rounds "
          f"of (decode+SDPA) / SDPA - 1, [10th, 90th percentile]; drift = SDPA's max/min over the rounds - 1")
    print(f"{'scheme':16s} {'mode':6s} {'SDPA':>11s} {'decode+SDPA':>12s} {'decode':>11s} {'overhead':>8s}  "
          f"{'spread':>15s}  {'drift':>6s}")
    for name in args.schemes:
        s = C.c_void_p()
        check(L, L.kvf_scheme_load_builtin(name.encode(), C.byref(s)))
        ctx = C.c_void_p()
        check(L, L.kvf_context_create(s, 0, C.byref(ctx)))
        nbytes = C.c_size_t()
        check(L, L.kvf_packed_size(s, C.c_int64(CACHED), C.c_int32(H), C.byref(nbytes)))
        packed = torch.empty(nbytes.value, dtype=torch.uint8, device=dev)
        sh = Shape(CACHED, H, 0, 0)
        stream = C.c_void_p(torch.cuda.current_stream().cuda_stream)
        check(L, L.kvf_encode(ctx, C.c_void_p(src_k.data_ptr()), C.c_void_p(src_v.data_ptr()), C.byref(sh), None,
                              C.c_void_p(packed.data_ptr()), C.c_size_t(nbytes.value), stream))
        torch.cuda.synchronize()
        out = Shape(CACHED, H, D, total * D)  # rows 0..CACHED-1 of the [H, total, D] buffers

        def decode_into(kb, vb, st):  # into rows 0..CACHED-1 of kb, vb, queued on torch stream st
            check(L, L.kvf_decode(ctx, C.c_void_p(packed.data_ptr()), C.c_size_t(nbytes.value), C.byref(out), None,
                                  C.c_void_p(kb.data_ptr()), C.c_void_p(vb.data_ptr()), C.c_void_p(st.cuda_stream)))

        def decode():  # on the current stream (the capture stream inside a graph capture)
            decode_into(k, v, torch.cuda.current_stream())

        def both():
            decode()
            sdpa()

        report(name, "eager", *interleaved([sdpa, both, decode], args.rounds, args.inner))
        if not args.no_graph:
            try:
                fns = [graphed(sdpa), graphed(both), graphed(decode)]
            except Exception as e:  # capture is an extra; the eager line stands on its own
                print(f"{name:16s} graph  capture failed: {e}")
            else:
                report(name, "graph", *interleaved(fns, args.rounds, args.inner))
        if args.pipe:
            # Layer l's SDPA on the current stream, layer l+1's decode on a side
            # stream into the other buffers; each step waits for the decode it
            # reads. "pipe": the decode queued before the SDPA, at the default
            # priority; "pipe-a": queued after it; "pipe-hi": queued after it on
            # a high-priority stream, so the decode's blocks take each SM that
            # SDPA's blocks leave (and any room beside them) before SDPA's next
            # wave does.
            bufs = [(k, v), (k.clone(), v.clone())]
            for mode, prio, after in (("pipe", 0, False), ("pipe-a", 0, True), ("pipe-hi", -1, True)):
                side = torch.cuda.Stream(priority=prio)
                step = [0]

                def pipelined(side=side, after=after, step=step):
                    main = torch.cuda.current_stream()
                    (kc, vc), (kn, vn) = bufs[step[0]], bufs[1 - step[0]]
                    step[0] ^= 1
                    done = main.record_event()  # the step that last read (kn, vn) is done
                    if after:
                        F.scaled_dot_product_attention(q, kc, vc)
                    side.wait_event(done)
                    decode_into(kn, vn, side)
                    if not after:
                        F.scaled_dot_product_attention(q, kc, vc)
                    main.wait_stream(side)  # the next step reads (kn, vn)

                report(name, mode, *interleaved([sdpa, pipelined, decode], args.rounds, args.inner))
        torch.cuda.synchronize()
        L.kvf_context_destroy(ctx)
        L.kvf_scheme_free(s)


if __name__ == "__main__":
    main()
