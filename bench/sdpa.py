#!/usr/bin/env python3
"""BF16 SDPA ceiling and decode + SDPA (issue 6), on the GPU with torch.

SDPA alone: 4680 queries (one chunk) against 29640 cached + 4680 own tokens,
32 heads, d = 128, as ANCHORS.md. Then, per scheme, kvforge decodes the packed
29640-token cache straight into the first rows of the preallocated K/V
buffers (strided output, no copy) and SDPA runs: the target is decode + SDPA
within 3% of SDPA alone. libkvforge is called through ctypes directly.
    KVFORGE_LIB=out/lib/libkvforge.so python3 bench/sdpa.py [SCHEME ...]
"""
import ctypes as C
import os
import sys

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


def bench(fn, reps=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def main():
    torch.manual_seed(0)
    dev = torch.device("cuda")
    total = CACHED + CHUNK
    q = torch.randn(1, H, CHUNK, D, device=dev, dtype=torch.bfloat16)
    k = torch.randn(1, H, total, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(1, H, total, D, device=dev, dtype=torch.bfloat16)
    sdpa = lambda: F.scaled_dot_product_attention(q, k, v)
    t_sdpa = bench(sdpa)
    flops = 4.0 * H * CHUNK * total * D
    print(f"SDPA alone: {t_sdpa:.3f} ms = {flops / t_sdpa / 1e9:.0f} TFLOP/s "
          f"({CHUNK} queries x {total} keys x {H} heads x d{D}, torch {torch.__version__})")
    L = lib()
    names = sys.argv[1:] or ["rtn_int2", "qvg_int2", "quantwm_int2"]
    # Per-token scale and two moving outlier channels (ANCHORS.md's data).
    src_k = torch.randn(1, H, CACHED, D, device=dev) * (0.5 + torch.rand(1, 1, CACHED, 1, device=dev))
    src_v = torch.randn(1, H, CACHED, D, device=dev) * (0.5 + torch.rand(1, 1, CACHED, 1, device=dev))
    idx = torch.randint(0, D, (1, H, CACHED, 2), device=dev)
    src_k.scatter_add_(3, idx, 20 * torch.ones_like(idx, dtype=src_k.dtype))
    src_v.scatter_add_(3, idx, 20 * torch.ones_like(idx, dtype=src_v.dtype))
    src_k, src_v = src_k.bfloat16().contiguous(), src_v.bfloat16().contiguous()
    print(f"{'scheme':16s} {'decode':>9s} {'decode+SDPA':>12s} {'overhead':>9s}")
    for name in names:
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
        out = Shape(CACHED, H, D, total * D)  # rows 0..CACHED-1 of the [H, total, D] buffers

        def decode():
            check(L, L.kvf_decode(ctx, C.c_void_p(packed.data_ptr()), C.c_size_t(nbytes.value), C.byref(out), None,
                                  C.c_void_p(k.data_ptr()), C.c_void_p(v.data_ptr()), stream))

        t_dec = bench(decode)
        t_both = bench(lambda: (decode(), sdpa()))
        print(f"{name:16s} {t_dec:7.3f} ms {t_both:9.3f} ms {100 * (t_both / t_sdpa - 1):8.1f}%")
        L.kvf_context_destroy(ctx)
        L.kvf_scheme_free(s)


if __name__ == "__main__":
    main()
