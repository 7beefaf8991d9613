"""QuantizedKVCache on the CPU (numpy): chunks, chunk policy, GQA queries, memory
accounting, causality of the query statistics, errors."""
import ctypes

import numpy as np
import pytest

import kvforge
from conftest import video_like

H, D = 4, 128
POLICY = ('return { base = "rtn_int2", name = "policy", key = { bits = 4 },'
          ' chunk = { tokens = 16, span = 2, recent = 2, sink = 1 } }')


def chunks(rng, n_chunks, n_tokens, h=H):
    return [(kvforge.float32_to_bf16_bits(video_like(rng, (h, n_tokens, D))),
             kvforge.float32_to_bf16_bits(video_like(rng, (h, n_tokens, D)))) for _ in range(n_chunks)]


def test_default_policy_packs_every_chunk(rng):
    cache = kvforge.QuantizedKVCache("rtn_int2", num_layers=3, num_kv_heads=H, head_dim=D)
    assert cache.chunk_policy == {"tokens": 4680, "span": 1, "recent": 0, "sink": 0}
    assert not cache.uses_qstats  # RTN reads no query statistics ("auto")
    ctx = kvforge.Context("rtn_int2")
    data = chunks(rng, 5, 40)
    for t, (k, v) in enumerate(data):
        q = video_like(rng, (4 * H, 40, D))  # GQA: 16 query heads over 4 KV heads
        cache.append(1, k, v, q=q)
        assert cache.num_chunks(1) == t + 1 and cache.num_tokens(1) == 40 * (t + 1)
    assert cache.segments(1) == [("packed", t, 1, 40) for t in range(5)]
    K, V = cache.keys_values(1, bits=True)
    assert K.shape == V.shape == (H, 200, D) and K.dtype == np.uint16
    for t, (k, v) in enumerate(data):
        kd, vd = ctx.decode(ctx.encode(k, v), 40, H, bits=True)
        assert np.array_equal(K[:, 40 * t:40 * (t + 1)], kd)
        assert np.array_equal(V[:, 40 * t:40 * (t + 1)], vd)
    Kf, Vf = cache.keys_values(1)
    assert Kf.dtype == np.float32 and np.array_equal(Kf, kvforge.bf16_bits_to_float32(K))
    # memory: exactly the packed sizes
    packed = 5 * cache.scheme.packed_size(40, H)
    assert cache.nbytes == packed
    assert cache.bf16_nbytes == 2 * 200 * H * D * 2
    assert cache.compression_ratio == pytest.approx(cache.bf16_nbytes / packed)
    m = cache.memory(1)
    assert m["packed"] == packed and m["bf16"] == 0 and m["qstats"] == 0 and m["tokens"] == 200
    # other layers are untouched
    K0, V0 = cache.keys_values(0)
    assert K0.shape == (H, 0, D) and cache.memory(0)["total"] == 0


def test_chunk_policy_sink_recent_span(rng):
    s = kvforge.Scheme.from_string(POLICY, "=policy")
    cache = kvforge.QuantizedKVCache(s, num_layers=1, num_kv_heads=H, head_dim=D)
    ctx = kvforge.Context(s)
    data = chunks(rng, 7, 16)
    expect = [
        [("sink", 0, 1, 16)],
        [("sink", 0, 1, 16), ("bf16", 1, 1, 16)],
        [("sink", 0, 1, 16), ("bf16", 1, 1, 16), ("bf16", 2, 1, 16)],
        [("sink", 0, 1, 16), ("bf16", 1, 1, 16), ("bf16", 2, 1, 16), ("bf16", 3, 1, 16)],
        [("sink", 0, 1, 16), ("packed", 1, 2, 32), ("bf16", 3, 1, 16), ("bf16", 4, 1, 16)],
        [("sink", 0, 1, 16), ("packed", 1, 2, 32), ("bf16", 3, 1, 16), ("bf16", 4, 1, 16), ("bf16", 5, 1, 16)],
        [("sink", 0, 1, 16), ("packed", 1, 2, 32), ("packed", 3, 2, 32), ("bf16", 5, 1, 16), ("bf16", 6, 1, 16)],
    ]
    for t, (k, v) in enumerate(data):
        cache.append(0, k, v)
        assert cache.segments(0) == expect[t], t
    K, V = cache.keys_values(0, bits=True)
    assert K.shape == (H, 112, D)
    # sink and recent chunks are BF16, bit for bit
    for t in (0, 5, 6):
        assert np.array_equal(K[:, 16 * t:16 * (t + 1)], data[t][0])
        assert np.array_equal(V[:, 16 * t:16 * (t + 1)], data[t][1])
    # spans (1, 2) and (3, 4) are packed together: the same as one encode of both
    for a in (1, 3):
        k = np.concatenate([data[a][0], data[a + 1][0]], axis=1)
        v = np.concatenate([data[a][1], data[a + 1][1]], axis=1)
        kd, vd = ctx.decode(ctx.encode(k, v), 32, H, bits=True)
        assert np.array_equal(K[:, 16 * a:16 * (a + 2)], kd)
        assert np.array_equal(V[:, 16 * a:16 * (a + 2)], vd)
        assert not np.array_equal(kd, k)  # really quantized
    bf16 = 3 * 2 * H * 16 * D * 2
    packed = 2 * s.packed_size(32, H)
    m = cache.memory()
    assert (m["bf16"], m["packed"], m["total"]) == (bf16, packed, bf16 + packed)
    assert cache.nbytes == bf16 + packed
    assert cache.compression_ratio == pytest.approx(2 * 112 * H * D * 2 / (bf16 + packed))
    # the caller's arrays were copied: changing them does not change the cache
    data[6][0][:] = 0
    K2, _ = cache.keys_values(0, bits=True)
    assert np.array_equal(K2, K)


def test_chunk_step_is_the_librarys():
    s = kvforge.Scheme.from_string(POLICY, "=policy")  # span 2, recent 2, sink 1
    steps = [s.chunk_step(t) for t in range(8)]
    assert [st.sink for st in steps] == [True] + [False] * 7
    # span (1, 2) leaves the recent window after chunk 4, (3, 4) after 6
    assert [(st.pack_first, st.pack_chunks) for st in steps if st.pack_chunks] == [(1, 2), (3, 2)]
    assert [t for t, st in enumerate(steps) if st.pack_chunks] == [4, 6]
    assert (steps[4].warm_chunks, steps[6].warm_first, steps[6].warm_chunks) == (0, 1, 2)
    d = kvforge.Scheme("rtn_int2").chunk_step(5)  # the defaults: each chunk packed in its append
    assert (d.sink, d.pack_first, d.pack_chunks, d.warm_first, d.warm_chunks) == (False, 5, 1, 4, 1)
    with pytest.raises(kvforge.KvforgeError, match="KVF_EINVAL"):
        s.chunk_step(-1)


def test_nhd_layout_and_out(rng):
    s = kvforge.Scheme.from_string(POLICY, "=policy")
    a = kvforge.QuantizedKVCache(s, 1, H, D)
    b = kvforge.QuantizedKVCache(s, 1, H, D, layout="nhd")
    for k, v in chunks(rng, 5, 16):
        a.append(0, k, v)
        b.append(0, k.transpose(1, 0, 2), np.ascontiguousarray(v.transpose(1, 0, 2)))
    Ka, Va = a.keys_values(0, bits=True)
    Kb, Vb = b.keys_values(0, bits=True)
    assert Kb.shape == (80, H, D)
    assert np.array_equal(Kb, Ka.transpose(1, 0, 2)) and np.array_equal(Vb, Va.transpose(1, 0, 2))
    Kc, Vc = a.keys_values(0, layout="nhd", bits=True)
    assert np.array_equal(Kc, Kb) and np.array_equal(Vc, Vb)
    out = (np.empty((H, 80, D), np.uint16), np.empty((H, 80, D), np.uint16))
    r = a.keys_values(0, out=out, bits=True)
    assert r[0] is out[0] and np.array_equal(out[0], Ka) and np.array_equal(out[1], Va)
    with pytest.raises(ValueError, match="shape"):
        a.keys_values(0, out=(np.empty((H, 79, D), np.uint16),) * 2)


def test_float32_inputs_and_reset(rng):
    cache = kvforge.QuantizedKVCache("rtn_int4", 2, H, D)
    k = video_like(rng, (H, 24, D))
    cache.append(0, k, k)
    K, _ = cache.keys_values(0)
    assert np.max(np.abs(K - k)) < 0.5 * np.abs(k).max()
    cache.reset()
    assert cache.num_tokens(0) == 0 and cache.nbytes == 0 and cache.compression_ratio == 1.0


def test_append_errors_leave_the_cache_unchanged(rng):
    cache = kvforge.QuantizedKVCache("rtn_int2", 2, H, D, num_q_heads=8)
    (k, v), = chunks(rng, 1, 8)
    cache.append(0, k, v)
    before = (cache.segments(0), cache.nbytes)
    with pytest.raises(ValueError, match="not a multiple of the 4 KV heads"):
        kvforge.QuantizedKVCache("rtn_int2", 2, H, D).append(0, k, v, q=np.zeros((6, 8, D), np.float32))
    with pytest.raises(ValueError, match="12 heads .* expected 8"):
        cache.append(0, k, v, q=np.zeros((12, 8, D), np.float32))
    with pytest.raises(ValueError, match="3 heads .* expected 4; is the layout 'nhd'"):
        cache.append(0, k[:3], v[:3])
    with pytest.raises(ValueError, match="v has 7 tokens"):
        cache.append(0, k, v[:, :7])
    with pytest.raises(TypeError, match="float64"):
        cache.append(0, k.astype(np.float64), v)
    with pytest.raises(IndexError, match="layer 2 out of range"):
        cache.append(2, k, v)
    with pytest.raises(ValueError, match="positions are only for 'pre' schemes"):
        cache.append(0, k, v, positions=np.zeros((8, 1), np.int32))
    assert (cache.segments(0), cache.nbytes) == before
    with pytest.raises(ValueError, match="head_dim = 64, but scheme rtn_int2 is for head_dim = 128"):
        kvforge.QuantizedKVCache("rtn_int2", 2, H, 64)
    with pytest.raises(ValueError, match="num_q_heads = 6 is not a multiple"):
        kvforge.QuantizedKVCache("rtn_int2", 2, H, D, num_q_heads=6)
    with pytest.raises(kvforge.KvforgeError, match="KVF_EIO"):
        kvforge.QuantizedKVCache("missing/scheme.lua", 2, H, D)


def test_torch_tensor_into_numpy_cache(rng):
    torch = pytest.importorskip("torch")
    cache = kvforge.QuantizedKVCache("rtn_int2", 1, H, D)
    k = torch.zeros(H, 8, D, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="a torch tensor: build the cache or context with device="):
        cache.append(0, k, k)


class _FakeQstats:
    """Python stand-ins for kvf_qstats_* recording what encode saw: the buffer's
    first u32 counts the updates (chunks whose queries were added)."""

    def __init__(self, lib, log):
        self.log = log
        self.real_encode = lib.kvf_encode

    def size(self, scheme, n_heads, out):
        out._obj.value = 256
        return 0

    def init(self, ctx, buf, n, n_heads, stream):
        ctypes.memset(buf, 0, n)
        return 0

    def update(self, ctx, buf, n, q, shape, stream):
        c = ctypes.c_uint32.from_address(buf)
        c.value += 1
        self.log.append(("update", shape._obj.n_heads))
        return 0

    def encode(self, ctx, k, v, shape, qstats, packed, nbytes, stream):
        seen = ctypes.c_uint32.from_address(qstats).value if qstats else None
        self.log.append(("encode", int(shape._obj.n_tokens), seen))
        # the fake buffer is no real one (a library that reads statistics checks them)
        return self.real_encode(ctx, k, v, shape, None, packed, nbytes, stream)


@pytest.mark.parametrize("policy", ["default", "delayed"])
def test_qstats_strictly_causal(rng, monkeypatch, policy):
    L = kvforge._lib.lib()
    log = []
    fake = _FakeQstats(L, log)
    for name in ("size", "init", "update", "encode"):
        fn = "kvf_encode" if name == "encode" else f"kvf_qstats_{name}"
        monkeypatch.setattr(L, fn, getattr(fake, name))
    s = kvforge.Scheme("rtn_int2") if policy == "default" else kvforge.Scheme.from_string(POLICY, "=policy")
    cache = kvforge.QuantizedKVCache(s, 1, H, D, qstats=True)
    assert cache.uses_qstats and cache.memory()["qstats"] == 256
    for t, (k, v) in enumerate(chunks(rng, 7, 16)):
        cache.append(0, k, v, q=np.zeros((2 * H, 16, D), np.uint16))
    encodes = [e for e in log if e[0] == "encode"]
    assert all(e == ("update", 2 * H) for e in log if e[0] == "update")
    if policy == "default":
        # chunk t is encoded inside append t, before its queries are added: t updates seen
        assert [e[2] for e in encodes] == list(range(7))
        assert [e[0] for e in log] == ["encode", "update"] * 7
    else:
        # spans (1, 2) and (3, 4) are packed during appends 4 and 6, with the statistics
        # as they are then: queries of chunks < 4 and < 6 (kvf_chunk_policy's semantics)
        assert encodes == [("encode", 32, 4), ("encode", 32, 6)]
        assert [e[0] for e in log] == ["update"] * 4 + ["encode"] + ["update"] * 2 + ["encode", "update"]
        # no copy of the statistics waits with a span: the layer's one buffer only
        assert cache.memory()["qstats"] == 256


def test_qstats_false_and_bad_values():
    c = kvforge.QuantizedKVCache("rtn_int2", 1, H, D, qstats=False)
    (k, v), = chunks(np.random.default_rng(0), 1, 8)
    c.append(0, k, v, q=np.zeros((H, 8, D), np.float32))  # checked, then ignored
    assert not c.uses_qstats and c.memory()["qstats"] == 0
    with pytest.raises(ValueError, match="not a multiple of the"):
        c.append(0, k, v, q=np.zeros((H + 1, 8, D), np.float32))
    with pytest.raises(ValueError, match="qstats must be"):
        kvforge.QuantizedKVCache("rtn_int2", 1, H, D, qstats="yes")


PRE = ('return { base = "rtn_int2", name = "pre", head_dim = 64, rope = { placement = "pre", theta = 100.0 },'
       ' chunk = { tokens = 8, sink = 1 } }')


def _rope_reference(x, pos, theta, layout):
    d = x.shape[-1]
    p = np.arange(d // 2)
    ang = pos[:, None].astype(np.float64) * theta ** (-2.0 * p / d)
    i0, i1 = (p, p + d // 2) if layout == "half" else (2 * p, 2 * p + 1)
    z = (x[..., i0] + 1j * x[..., i1]) * np.exp(1j * ang)
    y = np.empty_like(x, dtype=np.float64)
    y[..., i0], y[..., i1] = z.real, z.imag
    return y


@pytest.mark.parametrize("layout", ["half", "interleaved"])
def test_rope_pre_sink_chunk_is_rotated(rng, layout):
    s = kvforge.Scheme.from_string(PRE.replace('theta = 100.0', f'theta = 100.0, layout = "{layout}"'), "=pre")
    assert s.info.rope_placement == "pre" and s.info.rope_layout == layout
    cache = kvforge.QuantizedKVCache(s, 1, 2, 64)
    k = video_like(rng, (2, 8, 64))
    with pytest.raises(ValueError, match=r"append needs int32 positions \[8, 1\]"):
        cache.append(0, k, k)
    with pytest.raises(ValueError, match=r"expected shape \(8, 1\)"):
        cache.append(0, k, k, positions=np.zeros((7, 1), np.int32))
    pos = np.arange(100, 108, dtype=np.int64)
    cache.append(0, k, k, positions=pos)  # sink chunk: held BF16, rotated by keys_values
    K, V = cache.keys_values(0)
    kb = kvforge.bf16_bits_to_float32(kvforge.float32_to_bf16_bits(k))
    ref = _rope_reference(kb, pos, 100.0, layout)
    assert np.all(np.abs(K - ref) <= np.abs(ref) * 2.0**-7 + 1e-3)  # within 2 bf16 ulps
    assert np.array_equal(V, kb)  # values are not rotated
    assert cache.memory()["positions"] == 8 * 4


@pytest.mark.parametrize("layout,sections", [("half", ""), ("interleaved", ""), ("half", "sections = { 16, 24, 24 },")])
def test_python_rope_matches_the_library(rng, layout, sections):
    """The RoPE applied to held BF16 chunks is the library's, bit for bit: a scheme
    with BF16 keys (bits 16) decodes through the library's RoPE without rounding."""
    text = (f'return {{ base = "rtn_int2", name = "pre16", key = {{ bits = 16 }},'
            f' rope = {{ placement = "pre", layout = "{layout}", {sections} theta = 500.0 }} }}')
    s = kvforge.Scheme.from_string(text, "=pre16")
    axes = s.info.rope_axes
    ctx = kvforge.Context(s)
    k = kvforge.float32_to_bf16_bits(video_like(rng, (2, 24, 128)))
    p = ctx.encode(k, k)
    pos = rng.integers(-50, 5000, (24, axes)).astype(np.int32)
    kd, _ = ctx.decode(p, 24, 2, positions=pos, bits=True)
    assert not np.array_equal(kd, k)  # decode rotated the keys
    from kvforge._rope import rope_numpy
    assert np.array_equal(kd, rope_numpy(k, pos, s.info))


def test_real_qstats(rng):
    s = kvforge.Scheme("rtn_int2")
    cache = kvforge.QuantizedKVCache(s, 2, H, D, qstats=True)
    n = s.qstats_size(H)
    assert cache.memory()["qstats"] == 2 * n
    for t in range(3):
        (k, v), = chunks(rng, 1, 16)
        cache.append(0, k, v, q=video_like(rng, (2 * H, 20, D)))  # GQA: 2 query heads per KV head
    b = cache.qstats_buffer(0)
    assert b[:4].tobytes() == b"KVFQ"
    count = np.frombuffer(b[256:256 + 8 * H].tobytes(), np.float64)  # METHODS.md section 4
    assert np.array_equal(count, np.full(H, 3 * 20 * 2.0))
    assert not cache.qstats_buffer(1)[256:256 + 8 * H].any()  # layer 1 saw no queries
    cache.reset()
    assert not cache.qstats_buffer(0)[256:256 + 8 * H].any()


def test_nonfinite_queries_are_skipped(rng):
    """A query row with NaN or Inf adds nothing (METHODS.md 4); the header counts it."""
    ctx = kvforge.Context(kvforge.Scheme("rtn_int2"))
    q = video_like(rng, (2 * H, 20, D))
    bad = q.copy()
    bad[1, 3, 7] = np.nan
    bad[5, 0, 0] = np.inf
    a, b = ctx.qstats_new(H), ctx.qstats_new(H)
    ctx.qstats_update(a, bad)
    ctx.qstats_update(b, q)
    assert ctx.qstats_skipped(a) == 2 and ctx.qstats_skipped(b) == 0
    count = np.frombuffer(a[256:256 + 8 * H].tobytes(), np.float64)  # METHODS.md section 4
    assert np.array_equal(count, [39.0, 40.0, 39.0, 40.0])  # query heads 1 and 5: KV heads 0 and 2
    msum = np.frombuffer(a[512:512 + 4 * H * D * D].tobytes(), np.float32)
    assert np.isfinite(msum).all()


WARM = ('return { base = "qvg_int2", name = "warm", key = { centroids = 16 }, value = { centroids = 16 } }')


def test_warm_start(rng):
    """Context.encode(warm_from=...) starts each k-means from the previous span's
    centroids (other bytes than a cold start, the same bytes twice), and
    QuantizedKVCache(warm_start=True) chains its spans that way."""
    s = kvforge.Scheme.from_string(WARM, "=warm")
    ctx = kvforge.Context(s)
    data = chunks(rng, 3, 50)
    p0 = ctx.encode(*data[0])
    cold = ctx.encode(*data[1])
    warm = ctx.encode(*data[1], warm_from=p0, warm_tokens=50)
    assert warm.shape == cold.shape and not np.array_equal(warm, cold)
    assert np.array_equal(warm, ctx.encode(*data[1], warm_from=p0, warm_tokens=50))
    cache = kvforge.QuantizedKVCache(s, num_layers=1, num_kv_heads=H, head_dim=D, warm_start=True)
    for k, v in data:
        cache.append(0, k, v)
    K, V = cache.keys_values(0, bits=True)
    p = [p0, warm, ctx.encode(*data[2], warm_from=warm, warm_tokens=50)]
    for t in range(3):
        kd, vd = ctx.decode(p[t], 50, H, bits=True)
        assert np.array_equal(K[:, 50 * t:50 * (t + 1)], kd) and np.array_equal(V[:, 50 * t:50 * (t + 1)], vd)
    # a cache without it packs every span from a cold start
    plain = kvforge.QuantizedKVCache(s, num_layers=1, num_kv_heads=H, head_dim=D)
    for k, v in data[:2]:
        plain.append(0, k, v)
    assert np.array_equal(plain.keys_values(0, bits=True)[0][:, 50:], ctx.decode(cold, 50, H, bits=True)[0])
    with pytest.raises(ValueError, match="go together"):
        ctx.encode(*data[1], warm_from=p0)
    with pytest.raises(ValueError, match="warm_tokens"):
        ctx.encode(*data[1], warm_from=p0, warm_tokens=0)
    with pytest.raises(kvforge.KvforgeError, match="previous span"):
        ctx.encode(*data[1], warm_from=p0, warm_tokens=51)  # its buffer holds 50 tokens
    with pytest.raises(ValueError, match="warm_start"):
        kvforge.QuantizedKVCache(s, num_layers=1, num_kv_heads=H, head_dim=D, warm_start="yes")
