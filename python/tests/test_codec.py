"""Encode/decode of numpy arrays through the CPU reference: exact RTN results, error
bounds, layouts and strides, argument checks."""
import numpy as np
import pytest

import kvforge
from conftest import video_like
from rtn_model import rtn_bound, rtn_roundtrip_bits

SYM = ('return { base = "rtn_int2", name = "sym_mix", key = { bits = 4, mode = "symmetric" },'
       ' value = { bits = 2, mode = "symmetric", group_size = 32 } }')
INT8_BF16 = 'return { base = "rtn_int2", name = "k8v16", key = { bits = 8, group_size = 128 }, value = { bits = 16 } }'


def _schemes():
    return [("rtn_int2", None), ("rtn_int4", None), ("sym_mix", SYM), ("k8v16", INT8_BF16)]


def _load(name, text):
    return kvforge.Scheme.from_string(text, "=" + name) if text else kvforge.Scheme(name)


def _cfg(scheme):
    from canonical import parse_canonical
    c = parse_canonical(scheme.canonical)
    return [(c[t]["bits"], c[t]["group_size"], c[t]["mode"]) for t in ("key", "value")]


@pytest.mark.parametrize("name,text", _schemes())
def test_roundtrip_matches_format_model(rng, name, text):
    s = _load(name, text)
    ctx = kvforge.Context(s)
    H, N, d = 4, 37, 128
    k = kvforge.float32_to_bf16_bits(video_like(rng, (H, N, d)))
    v = kvforge.float32_to_bf16_bits(video_like(rng, (H, N, d)))
    packed = ctx.encode(k, v)
    assert packed.dtype == np.uint8 and packed.shape == (s.packed_size(N, H),)
    kb, vb = ctx.decode(packed, N, H, bits=True)
    assert kb.dtype == np.uint16 and kb.shape == (H, N, d)
    (kbits, kg, kmode), (vbits, vg, vmode) = _cfg(s)
    assert np.array_equal(kb, rtn_roundtrip_bits(k, kbits, kg, kmode))
    assert np.array_equal(vb, rtn_roundtrip_bits(v, vbits, vg, vmode))
    kf, vf = ctx.decode(packed, N, H)  # float32 by default
    assert kf.dtype == np.float32 and np.array_equal(kf, kvforge.bf16_bits_to_float32(kb))


@pytest.mark.parametrize("name", ["rtn_int2", "rtn_int4"])
def test_rtn_error_bound_float32_input(rng, name):
    ctx = kvforge.Context(name)
    bits = ctx.info.key_bits
    k = video_like(rng, (8, 64, 128))
    v = video_like(rng, (8, 64, 128))
    kf, vf = ctx.decode(ctx.encode(k, v), 64, 8)
    kq = kvforge.bf16_bits_to_float32(kvforge.float32_to_bf16_bits(k))  # what was encoded
    for x, y in ((kq, kf), (kvforge.bf16_bits_to_float32(kvforge.float32_to_bf16_bits(v)), vf)):
        assert np.all(np.abs(y - x) <= rtn_bound(x, bits, 64, "affine"))
    # relative error on Gaussian data (no outlier channels)
    g = rng.standard_normal((8, 64, 128)).astype(np.float32)
    gf, _ = ctx.decode(ctx.encode(g, g), 64, 8)
    rel = np.linalg.norm(gf - g) / np.linalg.norm(g)
    assert rel < (0.5 if bits == 2 else 0.1)  # ~ step / sqrt(12), step = range(64 normals) / L


def test_float32_and_uint16_inputs_agree(rng):
    ctx = kvforge.Context("rtn_int2")
    k = video_like(rng, (2, 16, 128))
    v = video_like(rng, (2, 16, 128))
    a = ctx.encode(k, v)
    b = ctx.encode(kvforge.float32_to_bf16_bits(k), kvforge.float32_to_bf16_bits(v))
    assert np.array_equal(a, b)


def test_layouts_and_strides_give_the_same_bytes(rng):
    ctx = kvforge.Context("rtn_int4")
    H, N, d = 3, 24, 128
    k = kvforge.float32_to_bf16_bits(video_like(rng, (H, N, d)))
    v = kvforge.float32_to_bf16_bits(video_like(rng, (H, N, d)))
    ref = ctx.encode(k, v)
    # [N, H, d] contiguous
    assert np.array_equal(ctx.encode(np.ascontiguousarray(k.transpose(1, 0, 2)),
                                     np.ascontiguousarray(v.transpose(1, 0, 2)), layout="nhd"), ref)
    # [N, H, d] view of the [H, N, d] data (no copy: token stride d, head stride N*d)
    assert np.array_equal(ctx.encode(k.transpose(1, 0, 2), v.transpose(1, 0, 2), layout="nhd"), ref)
    # batch-1 4-D
    assert np.array_equal(ctx.encode(k[None], v[None]), ref)
    # every other token of a larger buffer (token stride 2d), k and v with different strides
    big = np.zeros((H, 2 * N, d), np.uint16)
    big[:, ::2] = k
    assert np.array_equal(ctx.encode(big[:, ::2], v), ref)
    # negative strides and broadcasts are copied first
    assert np.array_equal(ctx.encode(k[:, ::-1][:, ::-1], v), ref)
    one = np.broadcast_to(k[:1], (H, N, d))
    assert np.array_equal(ctx.encode(one, v), ctx.encode(np.ascontiguousarray(one), v))
    # decode layouts
    K, V = ctx.decode(ref, N, H, bits=True)
    Kn, Vn = ctx.decode(ref, N, H, layout="nhd", bits=True)
    assert Kn.shape == (N, H, d) and np.array_equal(Kn, K.transpose(1, 0, 2))
    assert np.array_equal(Vn, V.transpose(1, 0, 2))
    # decode into strided outputs: slices of a larger buffer
    ok = np.zeros((H, N + 8, d), np.uint16)
    ov = np.zeros((H, N + 8, d), np.uint16)
    ctx.decode(ref, N, H, out=(ok[:, 4:4 + N], ov[:, 4:4 + N]))
    assert np.array_equal(ok[:, 4:4 + N], K) and not ok[:, :4].any() and not ok[:, 4 + N:].any()


def test_argument_errors(rng):
    ctx = kvforge.Context("rtn_int2")
    k = np.zeros((2, 8, 128), np.uint16)
    with pytest.raises(TypeError, match="uint16 .BF16 bits. or float32.*float64"):
        ctx.encode(k.astype(np.float64), k)
    with pytest.raises(TypeError, match="numpy dtype must be.*int16"):
        ctx.encode(k, k.astype(np.int16))
    with pytest.raises(TypeError, match="expected a numpy array, got list"):
        ctx.encode(k.tolist(), k)
    with pytest.raises(ValueError, match="last dimension is 64, the scheme's head_dim is 128"):
        ctx.encode(np.zeros((2, 8, 64), np.uint16), np.zeros((2, 8, 64), np.uint16))
    t = np.zeros((2, 128, 8), np.uint16).transpose(0, 2, 1)  # [2, 8, 128] with channel stride 8
    with pytest.raises(ValueError, match=r"last dimension \(head_dim\) must be contiguous"):
        ctx.encode(t, k)
    with pytest.raises(ValueError, match="expected a 3-D"):
        ctx.encode(k[0], k[0])
    with pytest.raises(ValueError, match="batch 1"):
        ctx.encode(np.zeros((2, 2, 8, 128), np.uint16), np.zeros((2, 2, 8, 128), np.uint16))
    with pytest.raises(ValueError, match="v has 7 tokens, k has 8"):
        ctx.encode(k, k[:, :7])
    with pytest.raises(ValueError, match="layout must be"):
        ctx.encode(k, k, layout="bhnd")
    with pytest.raises(ValueError, match="positions"):
        ctx.decode(ctx.encode(k, k), 8, 2, positions=np.zeros((8, 1), np.int32))


def test_c_errors_from_encode_and_decode(rng):
    ctx = kvforge.Context("rtn_int2")
    k = kvforge.float32_to_bf16_bits(video_like(rng, (2, 8, 128)))
    with pytest.raises(kvforge.KvforgeError) as e:
        ctx.encode(k, k, out=np.empty(100, np.uint8))
    assert e.value.status_name == "KVF_ERANGE" and "need" in e.value.detail
    p = ctx.encode(k, k)
    with pytest.raises(kvforge.KvforgeError, match="buffer has 2304 bytes, 9 tokens x 2 heads need 2816"):
        ctx.decode(p, 9, 2)
    with pytest.raises(kvforge.KvforgeError, match="n_tokens is 8, expected 9"):
        ctx.decode(np.concatenate([p, np.zeros(1024, np.uint8)]), 9, 2)  # header check of the CPU decode
    other = kvforge.Context("rtn_int4")
    with pytest.raises(kvforge.KvforgeError, match="written by scheme hash") as e:
        other.decode(np.concatenate([p, np.zeros(other.packed_size(8, 2), np.uint8)]), 8, 2)
    assert e.value.status_name == "KVF_EFORMAT"
    bad = p.copy()
    bad[0] ^= 1
    with pytest.raises(kvforge.KvforgeError, match="not a kvforge packed cache"):
        ctx.decode(bad, 8, 2)
    ctx.scheme.check_packed(p[:64], 8, 2)
    with pytest.raises(kvforge.KvforgeError, match="KVF_EFORMAT"):
        ctx.scheme.check_packed(bad[:64], 8, 2)
    with pytest.raises(TypeError, match="uint8"):
        ctx.decode(p.view(np.int8), 8, 2)
