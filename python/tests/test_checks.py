"""What the binding refuses and counts: strict NaN/Inf checks, read-only outputs,
positions beyond int32, the query statistics in nbytes, the status table asked
of the library, batched caches, and the CLI demo on pre-RoPE schemes."""
import os
import re
import subprocess

import numpy as np
import pytest

import kvforge
from conftest import REPO, video_like
from kvforge import _lib

H, D = 2, 128
PRE = 'return { base = "%s", name = "%s_pre", rope = { placement = "pre", sections = { 22, 21, 21 }, ' \
      'layout = "interleaved" } }'


def pre_scheme(base="rtn_int4"):
    return kvforge.Scheme.from_string(PRE % (base, base), f"={base}_pre")


# ------------------------------------------------------------------ strict

@pytest.mark.parametrize("scheme", ["rtn_int2", "qvg_int2", "kivi_int2", "quarot_int2"])
def test_strict_refuses_nonfinite_with_count_and_place(rng, scheme):
    ctx = kvforge.Context(scheme)
    k = video_like(rng, (H, 64, D))
    v = video_like(rng, (H, 64, D))
    k[1, 5, 17] = np.nan
    k[1, 9, 3] = np.inf
    v[0, 63, 127] = -np.inf
    with pytest.raises(ValueError, match=r"k: 2 of 16384 values are NaN or Inf \(strict=True\); the first at "
                                         r"index \[1, 5, 17\] of shape \[2, 64, 128\] is nan"):
        ctx.encode(k, v, strict=True)
    k = video_like(rng, (H, 64, D))
    with pytest.raises(ValueError, match=r"v: 1 of 16384 .* index \[0, 63, 127\] .* is -inf"):
        ctx.encode(k, v, strict=True)
    ctx.encode(k, v)  # not strict: the library takes it (the behaviour strict guards against)


def test_strict_on_bf16_bits_and_the_cache(rng):
    k = kvforge.float32_to_bf16_bits(video_like(rng, (H, 32, D)))
    v = kvforge.float32_to_bf16_bits(video_like(rng, (H, 32, D)))
    k[0, 31, 0] = 0x7FC0  # BF16 NaN
    cache = kvforge.QuantizedKVCache("rtn_int2", 1, H, D, strict=True)
    with pytest.raises(ValueError, match=r"k: 1 of 8192 .*\[0, 31, 0\]"):
        cache.append(0, k, v)
    assert cache.num_tokens(0) == 0  # refused before anything changed
    cache.append(0, k, v, strict=False)  # per-call override
    assert cache.num_tokens(0) == 32


def test_quarot_spreads_a_nan_without_strict(rng):
    """Why strict exists: a NaN in one channel comes back as a NaN token under QuaRot."""
    ctx = kvforge.Context("quarot_int2")
    k, v = video_like(rng, (H, 64, D)), video_like(rng, (H, 64, D))
    k[0, 3, 7] = np.nan
    k2, _ = ctx.decode(ctx.encode(k, v), 64, H)
    assert np.isnan(k2[0, 3]).sum() > 1


# ------------------------------------------------------ read-only, int32

def test_read_only_outputs_are_refused(rng):
    ctx = kvforge.Context("rtn_int2")
    k, v = video_like(rng, (H, 16, D)), video_like(rng, (H, 16, D))
    out = np.empty(ctx.packed_size(16, H), np.uint8)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="packed: the array is read-only"):
        ctx.encode(k, v, out=out)
    p = ctx.encode(k, v)
    ko, vo = np.empty((H, 16, D), np.uint16), np.empty((H, 16, D), np.uint16)
    vo.flags.writeable = False
    with pytest.raises(ValueError, match=r"out\[1\]: the array is read-only"):
        ctx.decode(p, 16, H, out=(ko, vo))
    cache = kvforge.QuantizedKVCache("rtn_int2", 1, H, D)
    cache.append(0, k, v)
    with pytest.raises(ValueError, match=r"out\[1\]: the array is read-only"):
        cache.keys_values(0, out=(ko, vo))
    q = ctx.qstats_new(H)
    q.flags.writeable = False
    with pytest.raises(ValueError, match="qstats: the array is read-only"):
        ctx.qstats_update(q, k)


def test_positions_beyond_int32_are_refused(rng):
    s = pre_scheme()
    ctx = kvforge.Context(s)
    k, v = video_like(rng, (H, 8, D)), video_like(rng, (H, 8, D))
    p = ctx.encode(k, v)
    pos = np.zeros((8, 3), np.int64)
    pos[4, 1] = 2**31
    with pytest.raises(ValueError, match=r"positions: value 2147483648 does not fit in int32"):
        ctx.decode(p, 8, H, positions=pos)
    pos[4, 1] = -2**31 - 1
    with pytest.raises(ValueError, match="does not fit in int32"):
        kvforge.QuantizedKVCache(s, 1, H, D).append(0, k, v, positions=pos)
    pos[4, 1] = 2**31 - 1  # the largest that fits goes through
    ctx.decode(p, 8, H, positions=pos)


def test_positions_beyond_int32_torch():
    torch = pytest.importorskip("torch")
    s = pre_scheme()
    cache = kvforge.QuantizedKVCache(s, 1, H, D, device="cpu")
    k = torch.randn(H, 8, D).to(torch.bfloat16)
    pos = torch.zeros(8, 3, dtype=torch.int64)
    pos[0, 0] = 2**33
    with pytest.raises(ValueError, match="value 8589934592 does not fit in int32"):
        cache.append(0, k, k, positions=pos)


# -------------------------------------------------------- nbytes, qstats

def test_nbytes_and_ratio_count_the_query_statistics(rng):
    s = kvforge.Scheme("quantwm_int2")  # PSAC keys: reads query statistics
    assert s.info.reads_qstats
    L, n, chunks = 2, 96, 3
    cache = kvforge.QuantizedKVCache(s, L, H, D)
    assert cache.uses_qstats
    qbytes = s.qstats_size(H)
    assert qbytes > 0
    assert cache.nbytes == L * qbytes  # held before any token: the buffers exist
    for _ in range(chunks):
        for layer in range(L):
            cache.append(layer, video_like(rng, (H, n, D)), video_like(rng, (H, n, D)),
                         q=video_like(rng, (2 * H, 16, D)))
    packed = L * chunks * s.packed_size(n, H)
    bf16 = L * 2 * chunks * n * H * D * 2
    assert cache.nbytes == packed + L * qbytes
    assert cache.bf16_nbytes == bf16
    assert cache.compression_ratio == bf16 / (packed + L * qbytes)
    m = cache.memory()
    assert (m["packed"], m["qstats"], m["total"]) == (packed, L * qbytes, cache.nbytes)


# ----------------------------------------------------------- status table

def test_status_codes_come_from_the_library():
    header = (REPO / "include" / "kvforge.h").read_text()
    # The enum is made from the one table, KVF_STATUS_MAP: XX(NAME, code, message).
    table = header[header.index("#define KVF_STATUS_MAP(XX)"):header.index("typedef enum kvf_status")]
    want = {f"KVF_{m.group(1)}": int(m.group(2)) for m in re.finditer(r"XX\((\w+),\s*(-?\d+),", table)}
    assert len(want) >= 14 and want["KVF_OK"] == 0
    assert _lib.status_codes() == want
    assert _lib.KVF_EFORMAT == want["KVF_EFORMAT"]
    descs = _lib.status_descriptions()
    assert len(descs) == len(want) and all(descs.values())
    src = (REPO / "python" / "kvforge" / "_lib.py").read_text()
    assert "KVF_EINVAL =" not in src and "-13" not in src  # no copy of the table to drift


# ------------------------------------------------------------------ batch

def _rel(x, ref):
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("scheme,layout,n", [("rtn_int2", "hnd", 64), ("kivi_int2", "nhd", 64),
                                             ("quarot_int2", "hnd", 64), ("quantwm_int2", "nhd", 320)])
def test_batch_against_one_cache_per_entry(rng, scheme, layout, n):
    """A batch of B is one packed span over B x Hkv heads. Every plane of the format
    is per head, so without k-means each entry decodes bit for bit as it would in a
    cache of its own (query statistics included). k-means starts from a sample
    whose offset depends on the head's index (docs/METHODS.md 3): entry 0 is still
    identical, the others are encoded from another, equally good, sample."""
    B, Hq = 3, 2 * H
    s = kvforge.Scheme(scheme)
    kmeans = s.info.key_centroids > 0
    big = kvforge.QuantizedKVCache(s, 1, H, D, layout=layout, batch_size=B)
    alone = [kvforge.QuantizedKVCache(s, 1, H, D, layout=layout) for _ in range(B)]
    ks, vs = [], []
    for _ in range(2):
        k = kvforge.float32_to_bf16_bits(video_like(rng, (B, H, n, D)))
        v = kvforge.float32_to_bf16_bits(video_like(rng, (B, H, n, D)))
        q = kvforge.float32_to_bf16_bits(video_like(rng, (B, Hq, 32, D)))
        if layout == "nhd":
            k, v, q = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (k, v, q))
        ks.append(kvforge.bf16_bits_to_float32(k))
        vs.append(kvforge.bf16_bits_to_float32(v))
        big.append(0, k, v, q=q)
        for b in range(B):
            alone[b].append(0, k[b], v[b], q=q[b])
    K, V = big.keys_values(0, bits=True)
    assert K.shape == ((B, H, 2 * n, D) if layout == "hnd" else (B, 2 * n, H, D))
    tok = 1 if layout == "hnd" else 0
    for b in range(B):
        k1, v1 = alone[b].keys_values(0, bits=True)
        if not kmeans or b == 0:
            assert np.array_equal(K[b], k1) and np.array_equal(V[b], v1), b
        else:
            kref = np.concatenate([x[b] for x in ks], axis=tok)
            vref = np.concatenate([x[b] for x in vs], axis=tok)
            f = kvforge.bf16_bits_to_float32
            for got, ref, lone in ((K[b], kref, k1), (V[b], vref, v1)):
                assert not np.array_equal(got, lone)  # another sample...
                assert _rel(f(got), ref) == pytest.approx(_rel(f(lone), ref), rel=0.15)  # ...as good
    # one header per span for the batch: fewer bytes than B caches
    assert big.nbytes < sum(c.nbytes for c in alone)
    assert big.bf16_nbytes == sum(c.bf16_nbytes for c in alone)
    if s.info.reads_qstats:
        assert big.memory()["qstats"] == s.qstats_size(B * H)


def test_batch_shapes_are_checked(rng):
    cache = kvforge.QuantizedKVCache("rtn_int2", 1, H, D, batch_size=2)
    with pytest.raises(ValueError, match=r"batch_size=2: expected a 4-D \[B, H, N, d\] tensor with B = 2"):
        cache.append(0, video_like(rng, (H, 8, D)), video_like(rng, (H, 8, D)))
    with pytest.raises(ValueError, match="3 heads"):
        cache.append(0, video_like(rng, (2, 3, 8, D)), video_like(rng, (2, 3, 8, D)))
    with pytest.raises(ValueError, match="batch_size must be"):
        kvforge.QuantizedKVCache("rtn_int2", 1, H, D, batch_size=0)


def test_batch_torch_cpu_and_pre_rope(rng):
    torch = pytest.importorskip("torch")
    s = pre_scheme("rtn_int4")
    B, n = 2, 16
    big = kvforge.QuantizedKVCache(s, 1, H, D, device="cpu", batch_size=B, layout="nhd")
    one = kvforge.QuantizedKVCache(s, 1, H, D, device="cpu", layout="nhd")
    pos = torch.tensor([[t // 8, t % 8, 0] for t in range(n)], dtype=torch.int32)
    k = torch.from_numpy(video_like(rng, (B, n, H, D))).to(torch.bfloat16)
    v = torch.from_numpy(video_like(rng, (B, n, H, D))).to(torch.bfloat16)
    big.append(0, k, v, positions=pos)
    one.append(0, k[1], v[1], positions=pos)
    K, V = big.keys_values(0)
    k1, v1 = one.keys_values(0)
    assert K.shape == (B, n, H, D) and torch.equal(K[1], k1) and torch.equal(V[1], v1)
    out = (torch.empty_like(K), torch.empty_like(V))
    big.keys_values(0, out=out)
    assert torch.equal(out[0], K) and torch.equal(out[1], V)


# ------------------------------------------------------------- CLI demo

def _cli():
    p = os.environ.get("KVFORGE_CLI") or str(REPO / "out" / "bin" / "kvforge")
    return p if os.path.exists(p) else None


@pytest.mark.skipif(_cli() is None, reason="no out/bin/kvforge (run make)")
@pytest.mark.parametrize("sections", ["{ 64 }", "{ 22, 21, 21 }"])
def test_cli_demo_runs_a_pre_rope_scheme(tmp_path, sections):
    f = tmp_path / "pre.lua"
    f.write_text('return { base = "rtn_int4", name = "rtn_int4_pre", '
                 f'rope = {{ placement = "pre", sections = {sections} }} }}\n')
    r = subprocess.run([_cli(), "demo", str(f), "--cpu"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "decode turned them" in r.stdout
    base = subprocess.run([_cli(), "demo", "rtn_int4", "--cpu"], capture_output=True, text=True, timeout=120)
    err = [float(m) for m in re.findall(r"K: relative error ([0-9.]+)", r.stdout + base.stdout)]
    # RoPE keeps norms: the turned keys' error is the plain scheme's (an error against
    # unturned keys would be near sqrt(2)).
    assert len(err) == 2 and abs(err[0] - err[1]) < 0.01, err


# ------------------------------------------------------- attention example

@pytest.mark.parametrize("sections", [None, "{ 22, 21, 21 }"])
def test_attention_example_runs_pre_rope_schemes(tmp_path, sections):
    pytest.importorskip("torch")
    f = tmp_path / "pre.lua"
    rope = 'placement = "pre"' + (f", sections = {sections}" if sections else "")
    f.write_text(f'return {{ base = "rtn_int4", name = "rtn_int4_pre", rope = {{ {rope} }} }}\n')
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    r = subprocess.run([os.sys.executable, str(REPO / "examples" / "attention_layer.py"), "--scheme", str(f),
                        "--device", "cpu", "--chunks", "3", "--heads", "4", "--kv-heads", "2",
                        "--tokens-per-frame", "104"], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "RoPE before the cache" in r.stdout
    m = re.search(r"relative error mean ([0-9.]+)", r.stdout)
    assert m and 0 < float(m.group(1)) < 0.1, r.stdout[-800:]  # 4 bits, turned keys compared with turned keys
