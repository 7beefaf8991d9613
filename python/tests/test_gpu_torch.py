"""torch tensors through kvforge: torch CPU tensors (CPU reference), and on a CUDA
GPU the JIT kernels, checked against the CPU reference bit for bit, and a small
attention layer run over several chunks through QuantizedKVCache compared with
BF16 attention. Skipped without torch (all) or without CUDA (the GPU part).

Runs under pytest, or as a script where pytest is missing:
    PYTHONPATH=python KVFORGE_LIB=out/lib/libkvforge.so python3 python/tests/test_gpu_torch.py
"""
import os
import sys

import numpy as np

try:
    import pytest
except ImportError:  # the script runner below
    pytest = None

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

try:
    import torch
except ImportError:
    torch = None

import kvforge  # noqa: E402
from canonical import info_from_canonical  # noqa: E402

HAS_CUDA = torch is not None and torch.cuda.is_available()
# KVFORGE_TEST_TORCH_DEVICE=cpu runs the "GPU" tests on torch CPU tensors (the CPU
# reference): a check of the binding's torch code on a machine without a GPU.
DEV = os.environ.get("KVFORGE_TEST_TORCH_DEVICE", "cuda")
ON_CUDA = DEV.startswith("cuda")
RUN_GPU_TESTS = HAS_CUDA or not ON_CUDA
if pytest is not None:
    pytestmark = pytest.mark.skipif(torch is None, reason="torch is not installed")
    gpu = pytest.mark.skipif(not RUN_GPU_TESTS, reason="no CUDA GPU visible to torch")
    _raises = pytest.raises
else:
    def gpu(f):
        f._gpu = True
        return f

    class _raises:  # minimal pytest.raises
        def __init__(self, exc, match=None):
            self.exc, self.match = exc, match

        def __enter__(self):
            return self

        def __exit__(self, et, ev, tb):
            import re
            if et is None:
                raise AssertionError(f"did not raise {self.exc}")
            if not issubclass(et, self.exc):
                return False
            if self.match and not re.search(self.match, str(ev)):
                raise AssertionError(f"{ev!r} does not match {self.match!r}")
            return True

D = 128
POLICY = ('return { base = "rtn_int4", name = "policy_t", chunk = { tokens = 64, span = 2, recent = 1, sink = 1 } }')


def video_like(gen, shape, device, outliers=4.0, scale_all=1.0):
    """BF16 K/V/Q-like data: per-channel offsets and scales (4 outlier channels
    `outliers` times larger), neighbouring tokens alike."""
    d = shape[-1]
    off = torch.randn(d, generator=gen) * 1.5
    scale = torch.exp(torch.randn(d, generator=gen) * 0.5)
    if outliers > 1:
        scale[torch.randperm(d, generator=gen)[:4]] *= outliers
    x = torch.randn(shape, generator=gen)
    x = 0.7 * x + 0.3 * torch.roll(x, 1, dims=-2)
    return ((x * scale + off) * scale_all).to(torch.bfloat16).to(device)


def to_bits(t):
    return t.detach().cpu().view(torch.int16).numpy().view(np.uint16)


# ----------------------------------------------------------------- torch CPU


def test_torch_cpu_matches_numpy():
    g = torch.Generator().manual_seed(0)
    k, v = video_like(g, (4, 40, D), "cpu"), video_like(g, (4, 40, D), "cpu")
    tc = kvforge.Context("rtn_int2", "cpu")
    nc = kvforge.Context("rtn_int2")
    assert tc.backend == "cpu" and tc._c is nc._c
    pt = tc.encode(k, v)
    pn = nc.encode(to_bits(k), to_bits(v))
    assert pt.dtype == torch.uint8 and np.array_equal(pt.numpy(), pn)
    K, V = tc.decode(pt, 40, 4)
    Kn, Vn = nc.decode(pn, 40, 4, bits=True)
    assert K.dtype == torch.bfloat16 and np.array_equal(to_bits(K), Kn) and np.array_equal(to_bits(V), Vn)
    # [1, H, N, d] and [N, H, d] views
    assert torch.equal(tc.encode(k[None], v[None]), pt)
    assert torch.equal(tc.encode(k.transpose(0, 1), v.transpose(0, 1), layout="nhd"), pt)
    cache = kvforge.QuantizedKVCache("rtn_int2", 1, 4, D, device="cpu")
    cache.append(0, k, v, q=k.repeat_interleave(2, 0))
    Kc, Vc = cache.keys_values(0)
    assert torch.equal(Kc, K) and torch.equal(Vc, V)


def test_torch_rope_matches_numpy():
    from kvforge._rope import rope_numpy, rope_torch
    for text in ('rope = { placement = "pre", theta = 500.0 }',
                 'rope = { placement = "pre", layout = "interleaved" }'):
        info = info_from_canonical(f"return {{ head_dim = 128, {text} }}")
        g = torch.Generator().manual_seed(7)
        k = video_like(g, (3, 40, D), "cpu")
        pos = torch.randint(-10, 3000, (40, 1), generator=g, dtype=torch.int32)
        a = rope_torch(k, pos, info)
        b = rope_numpy(to_bits(k), pos.numpy(), info)
        diff = (a.float() - torch.from_numpy(kvforge.bf16_bits_to_float32(b))).abs()
        # f32 sin/cos of numpy and torch may differ by an ulp: within 2 bf16 ulps
        assert (diff <= a.float().abs() * 2.0**-7 + 1e-6).all()


def test_torch_argument_errors():
    tc = kvforge.Context("rtn_int2", "cpu")
    k = torch.zeros(2, 8, D, dtype=torch.bfloat16)
    with _raises(TypeError, match=r"dtype must be torch.bfloat16, got torch.float16"):
        tc.encode(k.half(), k)
    with _raises(TypeError, match="expected a torch.Tensor on cpu, got ndarray"):
        tc.encode(np.zeros((2, 8, D), np.uint16), k)
    with _raises(ValueError, match=r"last dimension \(head_dim\) must be contiguous"):
        tc.encode(torch.zeros(2, D, 8, dtype=torch.bfloat16).transpose(1, 2), k)
    with _raises(ValueError, match="the scheme's head_dim is 128"):
        tc.encode(k[..., :64], k[..., :64])
    if HAS_CUDA:
        with _raises(ValueError, match="tensor is on cpu, this kvforge object works on cuda:0"):
            kvforge.Context("rtn_int2", "cuda:0").encode(k, k)


# ----------------------------------------------------------------- CUDA


@gpu
def test_gpu_encode_decode_bit_identical_to_cpu():
    dev = torch.device("cuda", 0) if ON_CUDA else torch.device(DEV)
    g = torch.Generator().manual_seed(1)
    for name in ("rtn_int2", "rtn_int4"):
        ctx = kvforge.Context(name, dev)
        if ON_CUDA:
            assert ctx.backend.startswith("sm_") and ctx.origin in ("nvrtc", "disk-cache")
        cpu = kvforge.Context(name)
        k, v = video_like(g, (8, 4680, D), dev), video_like(g, (8, 4680, D), dev)
        packed = ctx.encode(k, v)
        assert packed.device == dev and packed.numel() == ctx.packed_size(4680, 8)
        K, V = ctx.decode(packed, 4680, 8)
        if ON_CUDA:
            torch.cuda.synchronize()
        pc = cpu.encode(to_bits(k), to_bits(v))
        Kc, Vc = cpu.decode(pc, 4680, 8, bits=True)
        assert np.array_equal(to_bits(K), Kc) and np.array_equal(to_bits(V), Vc)
        # the GPU's packed bytes decode on the CPU to the same values (planes and header agree)
        Kg, _ = cpu.decode(packed.cpu().numpy(), 4680, 8, bits=True)
        assert np.array_equal(Kg, Kc)
        # layouts: [1, H, N, d], [N, H, d] views, and a misaligned tensor (copied first)
        assert torch.equal(ctx.decode(ctx.encode(k[None], v[None]), 4680, 8)[0], K)
        kt, vt = k.transpose(0, 1), v.transpose(0, 1)
        Kn, Vn = ctx.decode(ctx.encode(kt, vt, layout="nhd"), 4680, 8, layout="nhd")
        assert torch.equal(Kn, K.transpose(0, 1).contiguous()) and torch.equal(Vn.transpose(0, 1), V)
        flat = torch.empty(k.numel() + 1, dtype=torch.bfloat16, device=dev)
        km = flat[1:].view(k.shape)
        km.copy_(k)
        assert km.data_ptr() % 16 != 0
        assert torch.equal(ctx.decode(ctx.encode(km, v), 4680, 8)[0], K)


@gpu
def test_gpu_errors():
    ctx = kvforge.Context("rtn_int2", DEV)
    k = torch.zeros(2, 8, D, dtype=torch.bfloat16, device=DEV)
    with _raises(TypeError, match="torch.bfloat16, got torch.float32"):
        ctx.encode(k.float(), k)
    with _raises(kvforge.KvforgeError, match="KVF_ERANGE"):
        ctx.encode(k, k, out=torch.empty(64, dtype=torch.uint8, device=DEV))
    if ON_CUDA:
        with _raises(ValueError, match="tensor is on cpu"):
            ctx.encode(k.cpu(), k)
        with _raises(kvforge.KvforgeError, match="KVF_ENODEV"):
            kvforge.Context("rtn_int2", "cuda:1000")


def _sdpa(q, k, v):
    """q [Hq, N, d], k/v [Hkv, T, d] -> [Hq, N, d]; GQA by repeating KV heads."""
    rep = q.shape[0] // k.shape[0]
    if rep > 1:
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    return torch.nn.functional.scaled_dot_product_attention(q[None], k[None], v[None])[0]


def run_attention(scheme, n_chunks, hq, hkv, n_tokens, device, seed=0, layers=1, stream=None):
    """Chunked attention: chunk t's queries attend to the cache (chunks < t, packed)
    plus chunk t's own BF16 K/V; the reference attends to BF16 K/V of every chunk."""
    g = torch.Generator().manual_seed(seed)
    cache = kvforge.QuantizedKVCache(scheme, layers, hkv, D, device=device, num_q_heads=hq)
    ks, vs, errs, drops = [], [], [], []
    for t in range(n_chunks):
        q = video_like(g, (hq, n_tokens, D), device, outliers=1, scale_all=0.5)  # softmax not too peaked
        k = video_like(g, (hkv, n_tokens, D), device)
        v = video_like(g, (hkv, n_tokens, D), device)
        ks.append(k)
        vs.append(v)
        ref = _sdpa(q, torch.cat(ks, 1), torch.cat(vs, 1))
        Kc, Vc = cache.keys_values(0)
        out = _sdpa(q, torch.cat([Kc, k], 1), torch.cat([Vc, v], 1))
        errs.append(((out.float() - ref.float()).norm() / ref.float().norm()).item())
        drop = _sdpa(q, k, v)  # baseline: no cache at all, chunk t alone
        drops.append(((drop.float() - ref.float()).norm() / ref.float().norm()).item())
        cache.append(0, k, v, q=q)
    run_attention.drops = drops
    return cache, errs, ks, vs


@gpu
def test_attention_through_the_cache_vs_bf16():
    """8 query heads over 2 KV heads, 4 chunks of 768 tokens; chunk t attends to the
    cache (chunks < t) and to itself. Errors are against BF16 attention over every
    chunk; "drop" is attending to chunk t alone (no cache), which the cache must beat
    by far. On the synthetic data (seed 0) the CPU gives INT4 ~0.02-0.07, INT2
    ~0.4-0.75, drop ~0.8-1.7."""
    errs_of = {}
    for scheme, tol in (("rtn_int4", 0.1), ("rtn_int2", 0.9)):
        cache, errs, ks, vs = run_attention(scheme, 4, hq=8, hkv=2, n_tokens=3 * 256, device=DEV)
        drops = run_attention.drops
        assert errs[0] < 1e-6, errs  # no cached chunk yet: exact
        assert all(0 < e < tol for e in errs[1:]), (scheme, errs)
        assert all(e < 0.6 * dr for e, dr in zip(errs[1:], drops[1:])), (scheme, errs, drops)
        errs_of[scheme] = errs
        # the cache decodes as the CPU reference would, bit for bit
        cpu, _, _, _ = run_attention(scheme, 4, hq=8, hkv=2, n_tokens=3 * 256, device="cpu")
        Kg, Vg = cache.keys_values(0)
        Kc, Vc = cpu.keys_values(0)
        assert torch.equal(Kg.cpu(), Kc) and torch.equal(Vg.cpu(), Vc)
        assert cache.nbytes == cpu.nbytes == 4 * cache.scheme.packed_size(768, 2)
        assert cache.compression_ratio > (3.5 if scheme == "rtn_int4" else 6.0)
        print(f"\n{scheme} on {DEV}: attention rel. error per chunk {['%.4f' % e for e in errs]} "
              f"(no cache: {['%.4f' % e for e in drops]}), ratio {cache.compression_ratio:.2f}")
    assert all(a < b for a, b in zip(errs_of["rtn_int4"][1:], errs_of["rtn_int2"][1:]))


@gpu
def test_cache_policy_on_gpu_and_side_stream():
    s = kvforge.Scheme.from_string(POLICY, "=policy_t")
    g = torch.Generator().manual_seed(3)
    data = [(video_like(g, (2, 64, D), DEV), video_like(g, (2, 64, D), DEV)) for _ in range(6)]
    gc = kvforge.QuantizedKVCache(s, 1, 2, D, device=DEV)
    cc = kvforge.QuantizedKVCache(s, 1, 2, D, device="cpu")
    import contextlib
    side = torch.cuda.Stream() if ON_CUDA else None
    if side is not None:
        side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
        for k, v in data:
            gc.append(0, k, v)
        K, V = gc.keys_values(0)
        Kn, Vn = gc.keys_values(0, layout="nhd")
    if side is not None:
        side.synchronize()
    for k, v in data:
        cc.append(0, k.cpu(), v.cpu())
    assert gc.segments(0) == cc.segments(0) == [
        ("sink", 0, 1, 64), ("packed", 1, 2, 128), ("packed", 3, 2, 128), ("bf16", 5, 1, 64)]
    Kc, Vc = cc.keys_values(0)
    assert torch.equal(K.cpu(), Kc) and torch.equal(V.cpu(), Vc)
    assert torch.equal(Kn.transpose(0, 1).cpu(), Kc)
    assert torch.equal(K[:, :64], data[0][0]) and torch.equal(V[:, 320:], data[5][1])
    assert gc.nbytes == cc.nbytes


@gpu
def test_gpu_warm_start_bit_identical_to_cpu():
    """Context.encode(warm_from=...) on torch tensors of the device: what the
    CPU reference's warm start decodes to, bit for bit (qvg_int2: the previous
    span's centroid tables taken by the device's init kernel; the
    packed buffers are compared through their decode, the device leaving the
    padding between planes as it was)."""
    dev = torch.device("cuda", 0) if ON_CUDA else torch.device(DEV)
    g = torch.Generator().manual_seed(3)
    # assign = "exact": the CPU's k-means indices bit for bit (the default, "fast", is
    # held to a bound instead: docs/METHODS.md 3)
    s = kvforge.Scheme.from_string('return { base = "qvg_int2", name = "qvg_exact", key = { assign = "exact" }, '
                                   'value = { assign = "exact" } }', "=qvg_exact")
    ctx, cpu = kvforge.Context(s, dev), kvforge.Context(s)
    k0, v0 = video_like(g, (2, 500, D), dev), video_like(g, (2, 500, D), dev)
    k1, v1 = video_like(g, (2, 700, D), dev), video_like(g, (2, 700, D), dev)
    p0 = ctx.encode(k0, v0)
    p1 = ctx.encode(k1, v1, warm_from=p0, warm_tokens=500)
    if ON_CUDA:
        torch.cuda.synchronize()
    c0 = cpu.encode(to_bits(k0), to_bits(v0))
    c1 = cpu.encode(to_bits(k1), to_bits(v1), warm_from=c0, warm_tokens=500)
    for pg, pc, n in ((p0, c0, 500), (p1, c1, 700)):
        Kg, Vg = cpu.decode(pg.cpu().numpy(), n, 2, bits=True)
        Kc, Vc = cpu.decode(pc, n, 2, bits=True)
        assert np.array_equal(Kg, Kc) and np.array_equal(Vg, Vc)
    cold = cpu.decode(cpu.encode(to_bits(k1), to_bits(v1)), 700, 2, bits=True)[0]
    assert not np.array_equal(cpu.decode(c1, 700, 2, bits=True)[0], cold)


if __name__ == "__main__":
    if pytest is not None:
        sys.exit(pytest.main([__file__, "-q", "-rs", "-s"]))
    if torch is None:
        print("SKIP: torch is not installed")
        sys.exit(0)
    failed = 0
    for name, fn in sorted((n, f) for n, f in globals().items() if n.startswith("test_") and callable(f)):
        if getattr(fn, "_gpu", False) and not RUN_GPU_TESTS:
            print(f"SKIP {name}: no CUDA GPU")
            continue
        try:
            fn()
            print(f"PASS {name}")
        except Exception as e:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            print(f"FAIL {name}: {e!r}")
            failed += 1
    sys.exit(1 if failed else 0)
