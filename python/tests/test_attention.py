"""Attention over a QuantizedKVCache layer a block at a time (kvforge.attention)
against decode-then-attention: keys_values() and a plain softmax attention in
float64. On the CPU the blocks are attended in float32 (the reference path), and
the streamed path (ring of two buffers, merges as blocks come) runs in program
order with float32 matmuls for the kernel; the CUDA tests skip without a GPU
(tools/gpu/attention.sh runs them on one).

Tolerances (stated, and shown to catch a block left out or a wrong merge):
- float32 path: |o - ref| <= 1e-5 * max|V| (measured: 2-3e-7) and |lse - ref| <= 1e-4.
- torch outputs (BF16): each partial output is rounded to BF16 (the SDPA
  kernels return BF16) and the result once more: |o - ref| <= 2**-7 * max|V|
  (measured: 1.4-1.7e-3 on the CPU).
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import kvforge
from kvforge import attention as A
from conftest import video_like

D = 128
TOL32 = 1e-5
TOL16 = 2.0 ** -7
POLICY = ('return { base = "rtn_int2", name = "policy", key = { bits = 4 },'
          ' chunk = { tokens = 16, span = 2, recent = 2, sink = 1 } }')
PRE = ('return { base = "rtn_int2", name = "pre", head_dim = 64, rope = { placement = "pre", theta = 100.0 },'
       ' chunk = { tokens = 8, span = 2, sink = 1 } }')
HELD = 'return { base = "rtn_int2", name = "held", chunk = { tokens = 16, sink = 64 } }'  # BF16 only (up to 64 chunks)
PIPE = 'return { base = "stable_int2", name = "pipe", anchors = { every = 3, bits = 8 } }'


def write_table(path, layers, heads, seed=3):
    """A sensitivity table (docs/FORMAT.md) of made-up scores."""
    r = np.random.default_rng(seed)
    t = {"format": "kvforge-sensitivity", "version": 1, "head_dim": D, "kv_heads": heads, "layers": layers,
         "key": r.random((layers, heads, D)).tolist(), "value": r.random((layers, heads, D)).tolist()}
    path.write_text(json.dumps(t))
    return str(path)


def fill(cache, rng, n_chunks, n_tokens, positions=False):
    """Appends n_chunks chunks to layer 0 (numpy BF16 bits, or torch tensors for a torch cache)."""
    hkv, d, B = cache.num_kv_heads, cache.head_dim, cache.batch_size
    shape = (hkv, n_tokens, d) if cache.layout == "hnd" else (n_tokens, hkv, d)
    if B is not None:
        shape = (B,) + shape
    for t in range(n_chunks):
        k = kvforge.float32_to_bf16_bits(video_like(rng, shape))
        v = kvforge.float32_to_bf16_bits(video_like(rng, shape))
        if cache.be.kind == "torch":
            import torch
            k = torch.from_numpy(k.view(np.int16)).view(torch.bfloat16).to(cache.device)
            v = torch.from_numpy(v.view(np.int16)).view(torch.bfloat16).to(cache.device)
        pos = None
        if positions:
            pos = np.arange(t * n_tokens, (t + 1) * n_tokens, dtype=np.int32)[:, None] * 3 + 7
        cache.append(0, k, v, positions=pos)


def queries(rng, cache, hq, n, torch_dev=None):
    d, B = cache.head_dim, cache.batch_size
    shape = (hq, n, d) if cache.layout == "hnd" else (n, hq, d)
    if B is not None:
        shape = (B,) + shape
    q = (rng.standard_normal(shape) * 0.7).astype(np.float32)
    q = kvforge.bf16_bits_to_float32(kvforge.float32_to_bf16_bits(q))  # BF16 values, for torch alike
    if torch_dev is None:
        return q, q
    import torch
    return torch.from_numpy(q).to(torch.bfloat16).to(torch_dev), q


def reference(cache, q, scale=None):
    """Decode-then-attention: keys_values() and softmax attention in float64.
    Returns (o, lse, max|V|), o in q's shape, lse in q's shape less d."""
    K, V = cache.keys_values(0, layout="hnd")
    if cache.be.kind == "torch":
        K, V = K.float().cpu().numpy(), V.float().cpu().numpy()
    B = cache.batch_size
    K = K[None] if B is None else K
    V = V[None] if B is None else V
    d = cache.head_dim
    qs = np.asarray(q, np.float64)
    shape = qs.shape
    if cache.layout == "hnd":
        q4 = qs.reshape((1,) + shape if B is None else shape)
    else:
        q4 = qs.reshape((1,) + shape if B is None else shape).transpose(0, 2, 1, 3)
    g = q4.shape[1] // K.shape[1]
    Kr = np.repeat(K.astype(np.float64), g, axis=1)  # query head i reads KV head i // g
    Vr = np.repeat(V.astype(np.float64), g, axis=1)
    s = q4 @ Kr.transpose(0, 1, 3, 2) * (1 / np.sqrt(d) if scale is None else scale)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    o = (p @ Vr) / l
    lse = (m + np.log(l))[..., 0]
    if cache.layout == "nhd":
        o, lse = o.transpose(0, 2, 1, 3), lse.transpose(0, 2, 1)
    return o.reshape(shape), lse.reshape(shape[:-1]), float(np.abs(V).max())


def np_of(x):
    return x.float().cpu().numpy() if hasattr(x, "data_ptr") else x


def assert_close(o, lse, ref, tol):
    ro, rl, vmax = ref
    o, lse = np_of(o), np_of(lse)
    assert o.shape == ro.shape and lse.shape == rl.shape, (o.shape, ro.shape, lse.shape, rl.shape)
    err = float(np.abs(o - ro).max())
    assert err <= tol * vmax, (err, tol * vmax)
    assert float(np.abs(lse - rl).max()) <= 1e-4 * max(1.0, float(np.abs(rl).max()))
    return err / vmax


# ------------------------------------------------------------ CPU reference

@pytest.mark.parametrize("scheme", ["rtn_int2", "qvg_int2"])
def test_matches_decode_then_attention(rng, scheme):
    cache = kvforge.QuantizedKVCache(scheme, 1, 2, D)
    fill(cache, rng, 4, 48)
    q, _ = queries(rng, cache, 8, 24)  # GQA: 8 query heads over 2 KV heads
    ref = reference(cache, q)
    o, lse = cache.attention(0, q, return_lse=True)
    assert o.dtype == np.float32 and lse.dtype == np.float32
    assert_close(o, lse, ref, TOL32)
    # bits in, same answer; scale honoured
    o2 = cache.attention(0, kvforge.float32_to_bf16_bits(q))
    assert np.array_equal(o2, o)
    o3, l3 = cache.attention(0, q, scale=0.05, return_lse=True)
    assert_close(o3, l3, reference(cache, q, scale=0.05), TOL32)


def test_a_wrong_answer_fails_the_tolerance(rng, monkeypatch):
    """The comparison can fail: a block left out, or a merge that ignores the
    log-sum-exps, is far outside the tolerance."""
    cache = kvforge.QuantizedKVCache("rtn_int2", 1, 2, D)
    fill(cache, rng, 4, 48)
    q, _ = queries(rng, cache, 8, 24)
    ref = reference(cache, q)
    plan = A._plan
    monkeypatch.setattr(A, "_plan", lambda entries, bt: plan(entries, bt)[:-1])
    with pytest.raises(AssertionError):
        assert_close(*cache.attention(0, q, return_lse=True), ref, TOL32)
    monkeypatch.setattr(A, "_plan", plan)
    monkeypatch.setattr(np, "logaddexp", lambda a, b: np.zeros_like(a))
    with pytest.raises(AssertionError):
        assert_close(*cache.attention(0, q, return_lse=True), ref, TOL32)


def test_rope_pre_scheme(rng):
    """Keys cached before RoPE: packed spans decode rotated (positions), the BF16
    sink and waiting chunks are rotated in Python, as keys_values does."""
    s = kvforge.Scheme.from_string(PRE, "=pre")
    cache = kvforge.QuantizedKVCache(s, 1, 2, 64)
    fill(cache, rng, 6, 8, positions=True)
    kinds = [seg[0] for seg in cache.segments(0)]
    assert kinds[0] == "sink" and "packed" in kinds and "bf16" in kinds, kinds
    q, _ = queries(rng, cache, 4, 16)
    ref = reference(cache, q)
    for bt in (None, 5, 24):
        assert_close(*cache.attention(0, q, block_tokens=bt, return_lse=True), ref, TOL32)


@pytest.mark.parametrize("layout", ["hnd", "nhd"])
def test_chunk_policy_sink_recent_span(rng, layout):
    s = kvforge.Scheme.from_string(POLICY, "=policy")
    cache = kvforge.QuantizedKVCache(s, 1, 2, D, layout=layout)
    fill(cache, rng, 7, 20)
    assert [seg[0] for seg in cache.segments(0)] == ["sink", "packed", "packed", "bf16", "bf16"]
    q, _ = queries(rng, cache, 4, 12)
    ref = reference(cache, q)
    for bt in (None, 7, 40, 1000):
        assert_close(*cache.attention(0, q, block_tokens=bt, return_lse=True), ref, TOL32)
    def sizes(bt):
        return [sum(hi - lo for _i, lo, hi in b) for b in A.block_plan(cache, 0, bt)]
    assert sizes(None) == [20, 40, 40, 20, 20]
    assert sizes(40) == [20, 40, 40, 40]  # the two BF16 chunks together
    assert sizes(7) == [7, 7, 6, 40, 40, 7, 7, 6, 7, 7, 6]  # BF16 chunks cut, spans whole


@pytest.mark.parametrize("layout", ["hnd", "nhd"])
def test_batch_and_gqa(rng, layout):
    cache = kvforge.QuantizedKVCache("qvg_int2", 1, 2, D, layout=layout, batch_size=3, num_q_heads=6)
    fill(cache, rng, 3, 32)
    q, _ = queries(rng, cache, 6, 10)
    ref = reference(cache, q)
    o, lse = cache.attention(0, q, return_lse=True)
    assert o.shape == q.shape and lse.shape == q.shape[:-1]
    assert_close(o, lse, ref, TOL32)
    with pytest.raises(ValueError, match="num_q_heads"):
        cache.attention(0, queries(rng, cache, 4, 10)[0])


@pytest.mark.parametrize("text", ["stable_int2", PIPE])
def test_pipeline_scheme(rng, tmp_path, text):
    """stable_int2 (outliers, mixed precision from a table, error feedback) and the
    pipeline with anchors every 3 spans (spans decoded against their anchor)."""
    s = kvforge.Scheme(text) if text == "stable_int2" else kvforge.Scheme.from_string(text, "=pipe")
    cache = kvforge.QuantizedKVCache(s, 1, 2, D, table=write_table(tmp_path / "t.json", 1, 2))
    fill(cache, rng, 7, 32)
    kinds = [seg[0] for seg in cache.segments(0)]
    if text == PIPE:
        assert kinds == ["anchor", "packed", "packed"] * 2 + ["anchor"]
    q, _ = queries(rng, cache, 4, 16)
    ref = reference(cache, q)
    assert_close(*cache.attention(0, q, return_lse=True), ref, TOL32)
    assert_close(*cache.attention(0, q, block_tokens=100, return_lse=True), ref, TOL32)


def test_merge_is_exact(rng):
    """A BF16-only cache cut into many blocks (chunks split, merged one by one)
    against one block holding everything: equal to float32 rounding."""
    s = kvforge.Scheme.from_string(HELD, "=held")
    cache = kvforge.QuantizedKVCache(s, 1, 2, D)
    fill(cache, rng, 5, 30)
    assert all(seg[0] == "sink" for seg in cache.segments(0))
    q, _ = queries(rng, cache, 4, 20)
    one, l1 = cache.attention(0, q, block_tokens=10 ** 6, return_lse=True)
    assert len(A.block_plan(cache, 0, 10 ** 6)) == 1
    many, lm = cache.attention(0, q, block_tokens=7, return_lse=True)
    assert len(A.block_plan(cache, 0, 7)) == 25
    vmax = reference(cache, q)[2]
    assert float(np.abs(one - many).max()) <= 4e-6 * vmax  # measured 1e-6
    assert float(np.abs(l1 - lm).max()) <= 2e-6 * max(1.0, float(np.abs(l1).max()))
    assert_close(many, lm, reference(cache, q), TOL32)


def test_empty_layer_out_and_errors(rng):
    cache = kvforge.QuantizedKVCache("rtn_int2", 2, 2, D)
    q, _ = queries(rng, cache, 4, 5)
    o, lse = cache.attention(1, q, return_lse=True)
    assert np.array_equal(o, np.zeros_like(q)) and np.all(lse == -np.inf)
    fill(cache, rng, 2, 16)
    out = np.empty_like(q)
    r = cache.attention(0, q, out=out)
    assert r is out and np.array_equal(out, cache.attention(0, q))
    with pytest.raises(ValueError, match="not a multiple"):
        cache.attention(0, queries(rng, cache, 3, 5)[0])
    with pytest.raises(ValueError, match="block_tokens"):
        cache.attention(0, q, block_tokens=0)
    with pytest.raises(TypeError, match="float32 or uint16"):
        cache.attention(0, q.astype(np.float64))
    with pytest.raises(ValueError, match="out"):
        cache.attention(0, q, out=np.empty((4, 6, D), np.float32))


def test_merge_attention_joins_the_own_chunk(rng):
    """The cache's attention merged with the attention over the caller's own chunk
    equals the attention over both."""
    cache = kvforge.QuantizedKVCache("rtn_int2", 1, 2, D)
    fill(cache, rng, 2, 24)
    own = kvforge.QuantizedKVCache(kvforge.Scheme.from_string(HELD, "=held"), 1, 2, D)
    fill(own, rng, 1, 24)
    q, _ = queries(rng, cache, 4, 8)
    o1, l1 = cache.attention(0, q, return_lse=True)
    o2, l2 = own.attention(0, q, return_lse=True)
    o, lse = kvforge.merge_attention(o1, l1, o2, l2)
    K1, V1 = cache.keys_values(0)
    K2, V2 = own.keys_values(0)
    both = kvforge.QuantizedKVCache(kvforge.Scheme.from_string(HELD, "=held"), 1, 2, D)
    both.append(0, np.concatenate([K1, K2], 1), np.concatenate([V1, V2], 1))
    assert_close(o, lse, reference(both, q), TOL32)


# ------------------------------------------------------------ torch on the CPU

def _torch():
    return pytest.importorskip("torch")


def test_torch_cpu_cache(rng):
    torch = _torch()
    s = kvforge.Scheme.from_string(POLICY, "=policy")
    cache = kvforge.QuantizedKVCache(s, 1, 2, D, device="cpu")
    fill(cache, rng, 7, 20)
    q, qn = queries(rng, cache, 8, 12, torch_dev="cpu")
    o, lse = cache.attention(0, q, return_lse=True)
    assert o.dtype == torch.bfloat16 and lse.dtype == torch.float32 and o.shape == q.shape
    assert_close(o, lse, reference(cache, qn), 2.0 ** -8)  # float32, rounded once


@pytest.mark.parametrize("case", ["policy", "pipe", "batch_nhd", "pre"])
def test_streamed_path_in_program_order(rng, tmp_path, case):
    """The torch path that runs on CUDA (ring of two scratch buffers, merges as the
    blocks come, BF16 partial outputs), here in program order on the CPU with
    float32 matmuls as its kernel; the ring is allocated once."""
    torch = _torch()
    kw, hkv, hq, n, d = {}, 2, 4, 20, D
    if case == "policy":
        s = kvforge.Scheme.from_string(POLICY, "=policy")
    elif case == "pipe":
        s = kvforge.Scheme.from_string(PIPE, "=pipe")
        kw["table"] = write_table(tmp_path / "t.json", 1, 2)
    elif case == "batch_nhd":
        s, kw = kvforge.Scheme("qvg_int2"), {"batch_size": 2, "layout": "nhd"}
    else:
        s, d = kvforge.Scheme.from_string(PRE, "=pre"), 64
    cache = kvforge.QuantizedKVCache(s, 1, hkv, d, device="cpu", **kw)
    fill(cache, rng, 7, n, positions=case == "pre")
    q, qn = queries(rng, cache, hq, 12, torch_dev="cpu")
    ref = reference(cache, qn)
    ring, inline = None, A._Inline()
    for bt in (None, 7, 50, 1000):
        o, lse = A.cache_attention(cache, 0, q, block_tokens=bt, return_lse=True, kernel="math",
                                   merge="torch", _streams=inline)
        assert o.dtype == torch.bfloat16
        assert_close(o, lse, ref, TOL16)
        r = cache.__dict__.get("_kvf_attention_ring")
        if ring is not None and r is not None and r.elems <= ring.elems:
            assert r is ring  # no allocation once the largest block has been seen
        ring = r
    if cache.layout == "hnd":
        out = torch.empty_like(q)
        r = A.cache_attention(cache, 0, q, out=out, kernel="math", merge="torch", _streams=inline)
        assert r is out and torch.equal(out, A.cache_attention(cache, 0, q, kernel="math", merge="torch",
                                                               _streams=inline))


def test_triton_merge_interpreted():
    """The Triton merge kernel (CUDA's default merge) under TRITON_INTERPRET=1 on
    the CPU: the streamed path's result equals the torch merge's to one BF16
    rounding, and float32 merges agree to float32 rounding."""
    _torch()
    pytest.importorskip("triton")
    code = r"""
import numpy as np, torch, kvforge
from kvforge import attention as A, _attention_triton as T
g = torch.Generator().manual_seed(0)
a = torch.randn(2, 70, 3, 128, generator=g).bfloat16().transpose(1, 2)  # strides as flash returns them
b = torch.randn(2, 70, 3, 128, generator=g).bfloat16().transpose(1, 2)
la = torch.randn(2, 3, 70, generator=g) * 3
lb = (torch.randn(2, 3, 96, generator=g) * 3)[..., :70]  # padded, as the efficient kernel's
d1, l1, d2, l2 = torch.empty(2, 3, 70, 128), torch.empty(2, 3, 70), torch.empty(2, 3, 70, 128), torch.empty(2, 3, 70)
T.merge(a, la, b, lb, d1, l1)
A._merge_torch(torch, a, la, b, lb, d2, l2)
assert (d1 - d2).abs().max() < 1e-5 and (l1 - l2).abs().max() < 1e-5
acc, lacc = d2.clone(), l2.clone()
T.merge(acc, lacc, b, lb, acc, lacc)  # in place, float32
ref, lr = torch.empty_like(acc), torch.empty_like(lacc)
A._merge_torch(torch, d2.clone(), l2.clone(), b, lb, ref, lr)
assert (acc - ref).abs().max() < 1e-5 and (lacc - lr).abs().max() < 1e-5
o16 = torch.empty(2, 3, 70, 128, dtype=torch.bfloat16)
T.merge(a, la, b, lb, o16, torch.empty(2, 3, 70))
assert (o16 != d2.to(torch.bfloat16)).float().mean() < 0.01  # rounded to nearest (1-ulp ties of f32 aside)
rng = np.random.default_rng(0)
s = kvforge.Scheme.from_string('return { base = "rtn_int2", name = "p", chunk = { tokens = 16, span = 2, recent = 2, sink = 1 } }', "=p")
c = kvforge.QuantizedKVCache(s, 1, 2, 128, device="cpu")
for t in range(6):
    c.append(0, torch.from_numpy(rng.standard_normal((2, 24, 128), np.float32)).bfloat16(),
             torch.from_numpy(rng.standard_normal((2, 24, 128), np.float32)).bfloat16())
q = torch.from_numpy(rng.standard_normal((4, 9, 128), np.float32)).bfloat16()
for bt in (None, 10):
    x = A.cache_attention(c, 0, q, block_tokens=bt, kernel="math", merge="triton", _streams=A._Inline())
    y = A.cache_attention(c, 0, q, block_tokens=bt, kernel="math", merge="torch", _streams=A._Inline())
    assert (x.float() - y.float()).abs().max() <= 2 ** -7 * y.float().abs().max(), bt
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(kvforge.__file__))))
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


# ------------------------------------------------------------ the custom op

def test_op_and_compile_cpu(rng):
    torch = _torch()
    if not hasattr(torch.library, "custom_op"):
        pytest.skip("kvforge.ops needs torch >= 2.4")
    import kvforge.ops as ops
    s = kvforge.Scheme.from_string(POLICY, "=policy")
    cache = kvforge.QuantizedKVCache(s, 1, 2, D, device="cpu")
    fill(cache, rng, 5, 16)
    q, qn = queries(rng, cache, 4, 8, torch_dev="cpu")
    h = A.handle(cache)
    torch.library.opcheck(torch.ops.kvforge.cache_attention.default, (q, h, 0, None, None))
    torch.library.opcheck(torch.ops.kvforge.cache_attention.default, (q, h, 0, 9, 0.1))

    def f(c, q):
        return ops.cache_attention(c, 0, q, return_lse=True)

    cf = torch.compile(f, fullgraph=True)
    for t in range(2):  # the second run reads the entries as they are then
        o, lse = cf(cache, q)
        eo, el = cache.attention(0, q, return_lse=True)
        assert torch.equal(o, eo) and torch.equal(lse, el), t
        assert_close(o, lse, reference(cache, qn), 2.0 ** -8)
        fill(cache, rng, 1, 16)
    with pytest.raises(ValueError, match="no live"):
        torch.ops.kvforge.cache_attention(q, 10 ** 9, 0, None, None)


# ------------------------------------------------------------ CUDA

def _cuda():
    torch = _torch()
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU visible to torch")
    return torch


@pytest.mark.parametrize("case", ["rtn_int2", "qvg_int2", "policy", "pre", "batch_nhd", "pipe"])
def test_cuda_matches_the_cpu_reference(rng, tmp_path, case):
    torch = _cuda()
    kw, d, hq = {}, D, 8
    if case == "policy":
        s = kvforge.Scheme.from_string(POLICY, "=policy")
    elif case == "pre":
        s, d = kvforge.Scheme.from_string(PRE, "=pre"), 64
    elif case == "batch_nhd":
        s, kw = kvforge.Scheme("qvg_int2"), {"batch_size": 2, "layout": "nhd"}
    elif case == "pipe":
        s = kvforge.Scheme.from_string(PIPE, "=pipe")
        kw["table"] = write_table(tmp_path / "t.json", 1, 2)
    else:
        s = kvforge.Scheme(case)
    cache = kvforge.QuantizedKVCache(s, 1, 2, d, device="cuda", **kw)
    fill(cache, rng, 7, 200, positions=case == "pre")
    q, qn = queries(rng, cache, hq, 96, torch_dev="cuda")
    ref = reference(cache, qn)
    for bt in (None, 150, 450):
        for merge in ("auto", "torch"):
            o, lse = A.cache_attention(cache, 0, q, block_tokens=bt, merge=merge, return_lse=True)
            assert o.dtype == torch.bfloat16 and o.device.type == "cuda"
            assert_close(o, lse, ref, TOL16)


def test_cuda_graph_capture_and_replay(rng):
    """One step (decode + attention over the cache, side stream and ring inside)
    captured in a CUDA graph; replays with new queries equal eager calls."""
    torch = _cuda()
    cache = kvforge.QuantizedKVCache("qvg_int2", 1, 2, D, device="cuda")
    fill(cache, rng, 5, 256)
    q = queries(rng, cache, 8, 128, torch_dev="cuda")[0]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            cache.attention(0, q, block_tokens=600)  # kernels checked, ring allocated
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        o = cache.attention(0, q, block_tokens=600)
    for t in range(3):
        q.copy_(queries(rng, cache, 8, 128, torch_dev="cuda")[0])
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(o, cache.attention(0, q, block_tokens=600)), t
