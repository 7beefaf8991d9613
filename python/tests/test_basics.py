"""Library loading, schemes, BF16 helpers, errors."""
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

import kvforge
from canonical import info_from_canonical, parse_canonical

from conftest import PYDIR


def test_library_and_version():
    assert os.path.exists(kvforge.library_path())
    assert kvforge.version() == "0.2.0"
    assert {"rtn_int2", "rtn_int4"} <= set(kvforge.builtin_schemes())
    assert kvforge.device_count() >= 0


def test_library_not_found_lists_the_search():
    code = "import kvforge\ntry:\n kvforge.version()\nexcept kvforge.LibraryNotFoundError as e:\n print('ERR', e)\n"
    env = dict(os.environ, KVFORGE_LIB="/nonexistent/libkvforge.so", PYTHONPATH=str(PYDIR))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "ERR libkvforge could not be loaded" in out
    assert "/nonexistent/libkvforge.so ($KVFORGE_LIB): no such file" in out


def _bf16_scalar(f):
    u = struct.unpack("<I", struct.pack("<f", f))[0]
    if (u & 0x7FFFFFFF) > 0x7F800000:
        return (u >> 16) | 0x40
    return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFFFFFF) >> 16


def test_bf16_round_to_nearest_even(rng):
    bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    specials = np.array([0.0, -0.0, 1.0, np.inf, -np.inf, np.nan, 3.4e38, -3.4e38, 1e-40], np.float32)
    # ties: exactly half way between two bf16 values, even and odd lower neighbours
    ties = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x7F7F8000], np.uint32).view(np.float32)
    x = np.concatenate([x, specials, ties])
    got = kvforge.float32_to_bf16_bits(x)
    want = np.array([_bf16_scalar(float(v)) for v in x], np.uint16)
    assert got.dtype == np.uint16 and got.shape == x.shape
    assert np.array_equal(got, want)
    assert got[-4:].tolist() == [0x3F80, 0x3F82, 0xBF80, 0x7F80]
    back = kvforge.bf16_bits_to_float32(got[:-13])
    normal = np.isfinite(x[:-13]) & (np.abs(x[:-13]) >= 2.0**-126) & (np.abs(x[:-13]) < 3.38e38)
    assert np.all(np.abs(back[normal] - x[:-13][normal]) <= np.abs(x[:-13][normal]) * 2.0**-8)
    with pytest.raises(TypeError, match="float32"):
        kvforge.float32_to_bf16_bits(np.zeros(3))
    with pytest.raises(TypeError, match="uint16"):
        kvforge.bf16_bits_to_float32(np.zeros(3, np.int16))


def test_scheme_load_and_info(schemes_dir):
    s = kvforge.Scheme(schemes_dir / "rtn_int2.lua")
    assert s.name == "rtn_int2" and s.id.startswith("rtn_int2_") and s.head_dim == 128
    i = s.info
    assert (i.head_dim, i.key_bits, i.value_bits) == (128, 2, 2)
    assert (i.chunk_tokens, i.chunk_span, i.chunk_recent, i.chunk_sink) == (4680, 1, 0, 0)
    assert i.rope_placement == "none" and i.rope_axes == 1 and not i.reads_qstats
    b = kvforge.Scheme("rtn_int4")
    assert b.info.key_bits == 4 and b.source == "<builtin>/rtn_int4.lua"
    assert kvforge.Scheme.builtin("rtn_int2").hash == s.hash
    t = kvforge.Scheme.from_string(
        'return { base = "rtn_int2", name = "pol", head_dim = 64, key = { bits = 4 },'
        ' chunk = { tokens = 32, span = 2, recent = 3, sink = 1 }, rope = { placement = "post" } }', "=pol")
    i = t.info
    assert (i.head_dim, i.key_bits, i.value_bits) == (64, 4, 2)
    assert (i.chunk_tokens, i.chunk_span, i.chunk_recent, i.chunk_sink) == (32, 2, 3, 1)
    assert i.rope_placement == "post" and i.rope_sections == (32,)


def test_canonical_parser():
    c = parse_canonical('-- c\nreturn {\n name = "x",\n head_dim = 128,\n'
                        ' rope = { layout = "half", placement = "pre", sections = { 16, 24, 24 }, theta = 1e4 },\n'
                        ' key = { bits = 2, flag = true, s = "a\\"b" },\n}\n')
    assert c["rope"]["sections"] == [16, 24, 24] and c["rope"]["theta"] == 1e4
    assert c["key"] == {"bits": 2, "flag": True, "s": 'a"b'}
    info = info_from_canonical(
        'return { head_dim = 128, rope = { placement = "pre", sections = { 16, 24, 24 } } }')
    assert info.rope_axes == 3 and info.rope_sections == (16, 24, 24) and info.rope_placement == "pre"


def test_unknown_scheme_file():
    with pytest.raises(kvforge.KvforgeError) as e:
        kvforge.Scheme("no/such/scheme.lua")
    assert e.value.status == -10 and e.value.status_name == "KVF_EIO"
    assert "no/such/scheme.lua" in str(e.value) and "kvf_scheme_load" in str(e.value)
    with pytest.raises(kvforge.KvforgeError, match='no shipped scheme named "rtn_int3"'):
        kvforge.Scheme("rtn_int3")
    assert issubclass(kvforge.KvforgeError, RuntimeError)


def test_c_error_message_propagated(tmp_path):
    p = tmp_path / "bad.lua"
    p.write_text('return {\n  key = {\n    bits = 3,\n  },\n}\n')
    with pytest.raises(kvforge.KvforgeError) as e:
        kvforge.Scheme(p)
    err = e.value
    assert err.status_name == "KVF_ESCHEME" and err.status == -3
    assert f"{p}:3: key.bits: must be one of 2, 4, 8, 16 (got 3)" in err.detail
    assert err.detail in str(err)
    with pytest.raises(kvforge.KvforgeError, match="unknown field"):
        kvforge.Scheme.from_string("return { key = { bitz = 2 } }", "=inline")


def test_packed_size_and_footprint():
    s = kvforge.Scheme("rtn_int2")
    assert s.packed_size(4680, 1) == 375552  # README / `kvforge info`
    f = s.footprint(4680, 8)
    assert f["packed_bytes"] == s.packed_size(4680, 8)
    assert f["bf16_bytes"] == 2 * 4680 * 8 * 128 * 2
    with pytest.raises(kvforge.KvforgeError, match="n_tokens = 0"):
        s.packed_size(0, 8)


def test_context_shared_and_named():
    a = kvforge.Context("rtn_int2")
    b = kvforge.Context(kvforge.Scheme("rtn_int2"))
    assert a._c is b._c  # one kvf_context per (scheme, device)
    assert a.backend == "cpu" and a.origin == "cpu"
    assert kvforge.Context("rtn_int4")._c is not a._c


def test_scheme_info_from_the_c_struct(monkeypatch):
    """SchemeInfo from the kvf_scheme_get_info struct (a stand-in filling every field)."""
    L = kvforge._lib.lib()

    def fake(scheme, out):
        ci = out.contents
        ci.head_dim, ci.key_bits, ci.value_bits = 128, 2, 4
        ci.chunk_tokens, ci.chunk_span, ci.chunk_recent, ci.chunk_sink = 4680, 2, 1, 1
        ci.rope_placement, ci.rope_axes, ci.rope_layout, ci.rope_theta = 1, 3, 1, 500.0
        ci.rope_sections[:] = [16, 24, 24, 0]
        ci.psac_rank, ci.key_centroids, ci.key_qsac_candidates = 8, 64, 4
        return 0

    monkeypatch.setattr(L, "kvf_scheme_get_info", fake)
    i = kvforge.Scheme("rtn_int2").info
    assert (i.value_bits, i.chunk_span, i.chunk_recent, i.chunk_sink) == (4, 2, 1, 1)
    assert (i.rope_placement, i.rope_layout, i.rope_axes, i.rope_sections) == ("pre", "interleaved", 3, (16, 24, 24))
    assert i.rope_theta == 500.0 and i.reads_qstats and i.psac_rank == 8 and i.key_centroids == 64

    monkeypatch.setattr(L, "kvf_scheme_get_info", lambda s, out: -3)
    with pytest.raises(kvforge.KvforgeError, match="kvf_scheme_get_info: KVF_ESCHEME"):
        kvforge.Scheme("rtn_int2").info


def test_scheme_info_c_agrees_with_canonical():
    """kvf_scheme_get_info says what the canonical text says."""
    texts = ['return { base = "rtn_int2", name = "a", head_dim = 64, key = { bits = 4 },'
             ' chunk = { tokens = 32, span = 2, recent = 3, sink = 1 }, rope = { placement = "post" } }',
             'return { base = "rtn_int4", name = "b", rope = { placement = "pre", layout = "interleaved", theta = 500.0 } }']
    for t in texts:
        s = kvforge.Scheme.from_string(t)
        assert s.info == info_from_canonical(s.canonical)
