"""The peer harness, its cache adapter and the recon format, on the CPU with fake peers.

QVG itself (Triton, GPU) runs in tools/gpu/peer.sh; here its bookkeeping,
streaming, byte counting and the recon files are checked with numpy codecs of
the same shape (fakes.py), and scored by the real `kvforge eval --peer`.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import fakes
import qvg_cache
import qvg_codec
import qvg_peer
import stio
from peerkv import ChunkPolicy, LayerStore, count_state

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
KVFORGE = os.environ.get("KVFORGE_BIN", os.path.join(ROOT, os.environ.get("O", "out"), "bin", "kvforge"))
SMALL = os.path.join(ROOT, "eval", "worldmodel", "kv_small.safetensors")


def kvforge(*args):
    if not os.path.exists(KVFORGE):
        pytest.skip(f"{KVFORGE} is not built (make)")
    p = subprocess.run([KVFORGE, *args], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return p.stdout


def score(recon, dump):
    return json.loads(kvforge("eval", "--peer", recon, "--data", dump, "--json", "--threads", "2"))


# ------------------------------------------------------------------ the policy

@pytest.mark.parametrize("qf, kr, sk, expect", [
    (1, 0, 0, {0: [], 1: [(0, 1)], 2: [(1, 2)], 5: [(4, 5)]}),
    # LingBot-v2's script: every chunk, the newest finished one kept, the first never
    (1, 1, 1, {1: [], 2: [], 3: [(1, 2)], 4: [(2, 3)]}),
    # QuantizeConfig's default: 8 chunks at a time
    (8, 0, 0, {7: [], 8: [(0, 8)], 9: [], 15: [], 16: [(8, 16)]}),
    (2, 1, 0, {2: [], 3: [(0, 2)], 4: [], 5: [(2, 4)]}),
    (3, 0, 1, {3: [(1, 3)], 6: [(3, 6)]}),
])
def test_policy_rule(qf, kr, sk, expect):
    p = ChunkPolicy(qf, kr, sk)
    for chunk_id, spans in expect.items():
        assert p.spans(chunk_id) == spans, chunk_id
    assert p.as_kvforge() == {"sink": sk, "recent": kr, "span": qf}
    with pytest.raises(ValueError):
        ChunkPolicy(0)


def test_store_spans_read_and_bytes():
    rng = np.random.default_rng(1)
    codec = fakes.RtnCodec()
    st = LayerStore(codec, ChunkPolicy(2, 1, 0))
    chunks = [stio.f32_to_bf16_bits(rng.standard_normal((2, 8, 128)).astype(np.float32)) for _ in range(5)]
    done = []
    for c in chunks:
        st.append(c, c)
        done += st.apply_policy()
    assert done == [(0, 2), (2, 4)]
    parts = st.read()
    assert [p[2] for p in parts] == [True, True, True, True, False]
    assert np.array_equal(parts[4][0], chunks[4])                # the kept chunk is exact
    assert not np.array_equal(parts[1][0], chunks[1])            # a compressed one is not
    dec = codec.decompress(*[st.spans[0][x] for x in ("k", "v")])[0]
    assert np.array_equal(parts[1][0], dec[:, 8:16])             # chunk 1 = the second half of its span
    k, v = st.keys_values()
    assert k.shape == (2, 40, 128)
    b = st.stored_bytes()
    # per span and tensor: codes H*S*d/4, FP16 scales H*S*d/64, uint8 ids H*S, FP16 centroid H*d
    per = {"codes": 2 * 16 * 32, "scales": 2 * 16 * 2 * 2, "cluster_ids": 2 * 16, "centroids": 2 * 128 * 2}
    assert b == {**{p: 4 * n for p, n in per.items()}, "bf16": 2 * 2 * 8 * 128 * 2}
    assert st.bf16_bytes() == 5 * 2 * 2 * 8 * 128 * 2


def test_count_state_kinds():
    s = {"centroids_list": [np.zeros((1, 2, 4, 8), np.float16)] * 3, "zeros": None, "info": object(),
         "residual_quant": np.zeros(10, np.uint8), "scale_factor": 0.5, "other": np.zeros(3, np.int64)}
    assert count_state(s, qvg_codec.PARTS) == {"centroids": 3 * 64 * 2, "codes": 10, "clip_scale": 8, "other": 24}
    with pytest.raises(TypeError):
        count_state({"x": "text"}, {})


# ----------------------------------------------------------- harness -> kvforge

def test_identity_peer_scores_exact(tmp_path):
    dump, recon = str(tmp_path / "d.safetensors"), str(tmp_path / "r.safetensors")
    fakes.write_dump(dump)
    codec = fakes.IdentityCodec()
    s = qvg_peer.run(dump, codec, ChunkPolicy(), recon, "identity", "test: identity")
    assert codec.compressed == 2 * 4 and s["compression"] == 1.0
    r = score(recon, dump)
    o = r["overall"]
    assert r["kind"] == "peer" and r["scheme"] == "identity" and r["peer"] == "test: identity"
    assert o["top1_shift"] == 0 and o["attn_out_rel_err"] == 0 and o["key_mse"] == 0 and o["value_mse"] == 0
    assert o["packed_key_tokens"] == 2 * (1 + 2 + 3) * 64 * 2    # layers x packed chunks over steps x N x heads
    assert o["compression"] == 1.0 and r["stored_bytes_parts"] == {"raw": s["stored_bytes"], "bf16": 0}


def test_lossy_peer_metrics_match_python(tmp_path):
    """key/value MSE and compression of `kvforge eval --peer` against numpy over the recon itself."""
    dump, recon = str(tmp_path / "d.safetensors"), str(tmp_path / "r.safetensors")
    data = fakes.write_dump(dump, layers=2, chunks=4, tokens=64)
    pol = ChunkPolicy(1, 1, 0)
    s = qvg_peer.run(dump, fakes.RtnCodec(), pol, recon, "rtn-fake", "test: RTN-shaped fake")
    r = score(recon, dump)
    f = stio.SafetensorsFile(recon)
    assert f.metadata["format"] == "kvforge-recon 1" and f.metadata["recent"] == "1"
    sq = {"k": 0.0, "v": 0.0}
    n = 0
    for l in range(2):
        for c in range(1, 4):
            flags = f.get(f"l{l}.s{c}.packed")
            assert list(flags) == [1 if i <= c - 2 else 0 for i in range(c)]  # the newest chunk stays exact
            for x, idx in (("k", 1), ("v", 2)):
                hist = stio.bf16_bits_to_f32(f.get(f"l{l}.s{c}.{x}")).astype(np.float64)
                ref = np.concatenate([data[(l, i)][idx] for i in range(c)], axis=1)
                for i in range(c):
                    part = (hist - ref)[:, i * 64:(i + 1) * 64]
                    if flags[i]:
                        sq[x] += float((part ** 2).sum())
                    else:
                        assert not part.any()
            n += int(flags.sum()) * 64 * 2 * 128
    o = r["overall"]
    assert o["packed_values"] == n
    assert o["key_mse"] == pytest.approx(sq["k"] / n, rel=1e-9)
    assert o["value_mse"] == pytest.approx(sq["v"] / n, rel=1e-9)
    assert o["stored_bytes"] == s["stored_bytes"] and o["bf16_bytes"] == s["bf16_bytes"]
    assert o["compression"] == pytest.approx(s["bf16_bytes"] / s["stored_bytes"], rel=1e-9)  # JSON: 10 digits
    assert 0 < o["top1_shift"] < 1 and o["attn_out_rel_err"] > 0
    # at the end: chunks 0-2 compressed, chunk 3 (recent) in BF16
    assert s["parts"]["bf16"] == 2 * 2 * 2 * 64 * 128 * 2
    assert r["policy"] == {**r["policy"], "sink": 0, "recent": 1, "span": 1}


def test_kvforge_recon_is_readable_here(tmp_path):
    """A recon written by `kvforge eval --write-recon` reads with stio as the format says."""
    if not os.path.exists(SMALL):
        pytest.skip("no committed dump")
    recon = str(tmp_path / "k.safetensors")
    kvforge("eval", "--scheme", "rtn_int2", "--data", SMALL, "--threads", "2", "--write-recon", recon)
    f = stio.SafetensorsFile(recon)
    d = stio.SafetensorsFile(SMALL)
    assert f.metadata["stored_bytes_parts"] == "packed,bf16,qstats,feedback"
    k = f.get("l0.s1.k")
    assert k.shape == (2, 4680, 128) and f.dtype("l0.s1.k") == "BF16"
    assert list(f.get("l0.s1.packed")) == [1]
    assert not np.array_equal(k, d.get("l0.c0.k"))


def test_recon_bad_input(tmp_path):
    dump = str(tmp_path / "d.safetensors")
    fakes.write_dump(dump, layers=1, chunks=2)
    with pytest.raises(ValueError, match="a recon file covers every layer"):
        qvg_peer.run(dump, fakes.IdentityCodec(), ChunkPolicy(), str(tmp_path / "r"), "x", "x", layers=[0, 1])
    stio.write(str(tmp_path / "bad.safetensors"), [("a", np.zeros(2, np.uint8), None)], {"layers": "1"})
    with pytest.raises(ValueError, match="not a kvforge KV dump"):
        qvg_peer.Dump(str(tmp_path / "bad.safetensors"))


# ------------------------------------------------------------ rollout adapter

class Cfg:
    layers, kv_heads, head_dim, heads = 2, 2, 128, 4


def test_cache_adapter():
    rng = np.random.default_rng(2)
    cache = qvg_cache.qvg_int2(Cfg(), "cpu", codec=fakes.RtnCodec(), keep_recent=1)
    assert cache.policy == ChunkPolicy(1, 1, 0) and len(cache.layers) == 2
    assert cache.keys_values(0) is None
    ks = []
    for t in range(3):
        for layer in range(2):
            k = stio.f32_to_bf16_bits(rng.standard_normal((2, 16, 128)).astype(np.float32))
            if layer == 0:
                ks.append(k)
            cache.append(layer, k, k, q=None)
    k, v = cache.keys_values(0)
    assert k.shape == (2, 48, 128) and cache.num_chunks(0) == 3
    assert np.array_equal(k[:, 32:], ks[2]) and not np.array_equal(k[:, :16], ks[0])
    mem = cache.memory()
    assert cache.nbytes == sum(mem.values()) and mem["bf16"] == 2 * 2 * 2 * 16 * 128 * 2
    assert cache.compression_ratio == pytest.approx(cache.bf16_nbytes / cache.nbytes)
    assert cache.bf16_nbytes == 2 * 3 * 2 * 2 * 16 * 128 * 2
    with pytest.raises(ValueError, match="heads"):
        cache.append(0, ks[0][:1], ks[0][:1])
    # the other factories and the plain-number form
    for f in (qvg_cache.qvg_int2_asym, qvg_cache.qvg_pro_int2):
        c = f(3, 2, 128, "cpu", codec=fakes.IdentityCodec())
        assert len(c.layers) == 3 and c.compression_ratio == 1.0
    c = qvg_cache.qvg(n_layers=1, codec=fakes.IdentityCodec(), quant_factor=2)
    assert c.policy.quant_factor == 2


# --------------------------------------------------------------- skipping

def test_harness_skips_without_peer(tmp_path):
    why = qvg_codec.unavailable("cuda")
    if why is None:
        pytest.skip("the peer can run here: tools/gpu/peer.sh runs it")
    out = tmp_path / "r.safetensors"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "eval", "peer", "qvg_peer.py"), "--data", SMALL,
                        "--out", str(out)], capture_output=True, text=True)
    assert p.returncode == qvg_peer.SKIP, p.stderr
    assert p.stdout.startswith("qvg_peer: skipped: ") and why in p.stdout
    assert not out.exists()
    with pytest.raises(RuntimeError):
        qvg_codec.QvgCodec("qvg-peer_int2_g64")
    with pytest.raises(ValueError, match="unknown QVG configuration"):
        qvg_codec.QvgCodec("nope")
