"""kvforge.dump: the files it writes are read by `kvforge eval --data`."""
import json
import os
import subprocess

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from kvforge.dump import KVDump  # noqa: E402
from conftest import REPO  # noqa: E402
from kvforge._rope import rope_torch  # noqa: E402
import kvforge  # noqa: E402

D = 128


def _cli():
    p = os.environ.get("KVFORGE_CLI") or str(REPO / "out" / "bin" / "kvforge")
    if not os.path.exists(p):
        pytest.skip("no out/bin/kvforge (run make)")
    return p


def _eval(data, scheme):
    r = subprocess.run([_cli(), "eval", "--scheme", scheme, "--data", str(data), "--json", "--threads", "2"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return json.loads(r.stdout)


class TinyChunkedModel(torch.nn.Module):
    """Layers of self-attention over [earlier chunks' K/V, this chunk's] (its own
    BF16 cache), plus a cross-attention to a short prompt that the dump skips."""

    def __init__(self, layers=2, hq=4, hkv=2, seed=0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        w = hq * D
        self.hq, self.hkv = hq, hkv
        self.q = torch.nn.ParameterList([torch.randn(w, w, generator=g) / w ** 0.5 for _ in range(layers)])
        self.kv = torch.nn.ParameterList([torch.randn(w, 2 * hkv * D, generator=g) / w ** 0.5
                                          for _ in range(layers)])
        self.prompt = torch.randn(1, hq, 8, D, generator=g)
        self.cache = [[] for _ in range(layers)]

    def forward(self, x):  # x [N, hq*D]
        F = torch.nn.functional
        for layer, (wq, wkv) in enumerate(zip(self.q, self.kv)):
            n = x.shape[0]
            q = (x @ wq).view(n, self.hq, D).transpose(0, 1)[None].to(torch.bfloat16)
            k, v = (x @ wkv).view(n, 2, self.hkv, D).permute(1, 2, 0, 3).to(torch.bfloat16)
            self.cache[layer].append((k, v))
            K = torch.cat([c[0] for c in self.cache[layer]], 1)[None]
            V = torch.cat([c[1] for c in self.cache[layer]], 1)[None]
            o = F.scaled_dot_product_attention(q, K, V, enable_gqa=True)
            o = o + F.scaled_dot_product_attention(q, self.prompt.to(q.dtype), self.prompt.to(q.dtype))
            x = x + o[0].transpose(0, 1).reshape(n, -1).float()
        return x


def test_capture_sdpa_dump_is_read_by_kvforge_eval(tmp_path):
    model = TinyChunkedModel()
    dump = KVDump(tmp_path / "tiny.safetensors", q_stride=4, source="TinyChunkedModel")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for chunk in range(3):
            with dump.capture_sdpa(chunk):
                model(torch.randn(96, 4 * D, generator=g))
    assert dump.layers_chunks() == (2, 3)
    assert dump.shape == (4, 2, 96, D)
    # what was recorded is the chunk's own keys (the last tokens of the SDPA call)
    assert torch.equal(dump._t["l1.c2.k"], model.cache[1][2][0])
    assert torch.equal(dump._t["l0.c1.v"], model.cache[0][1][1])
    assert dump._t["l0.c0.q"].shape == (4, 24, D)
    path = dump.save()
    rep = _eval(path, "rtn_int2")
    assert rep["dump"] == {"layers": 2, "chunks": 3, "q_heads": 4, "kv_heads": 2, "head_dim": D,
                           "tokens_per_chunk": 96, "max_queries": 24, "source": "TinyChunkedModel",
                           "q_subsample": "every 4th query"}
    assert len(rep["layers"]) == 2


def test_record_with_pre_rope_keys_and_positions(tmp_path):
    """k_pre, q_pre and positions: a "pre" scheme evaluates on the dump (encodes the
    keys before RoPE and turns them at decode with the dump's positions)."""
    sections = (22, 21, 21)
    src = ('return { base = "rtn_int4", name = "rtn_int4_pre", rope = { placement = "pre", '
           'sections = { 22, 21, 21 } } }')
    s = kvforge.Scheme.from_string(src, "=rtn_int4_pre")
    scheme_file = tmp_path / "pre.lua"
    scheme_file.write_text(src + "\n")
    dump = KVDump(tmp_path / "pre.safetensors", rope_sections=sections, layout="nhd")
    g = torch.Generator().manual_seed(2)
    n = 64
    for chunk in range(2):
        pos = torch.tensor([[chunk, t // 8, t % 8] for t in range(n)], dtype=torch.int32)
        for layer in range(2):
            k_pre = torch.randn(2, n, D, generator=g).to(torch.bfloat16)
            q_pre = torch.randn(4, n, D, generator=g).to(torch.bfloat16)
            v = torch.randn(2, n, D, generator=g).to(torch.bfloat16)
            k, q = rope_torch(k_pre, pos, s.info), rope_torch(q_pre, pos, s.info)
            t = lambda x: x.transpose(0, 1)  # noqa: E731 - the dump's layout is nhd here
            dump.record(layer, chunk, t(q), t(k), t(v), k_pre=t(k_pre), q_pre=t(q_pre), positions=pos)
    dump.save()
    rep = _eval(dump.path, str(scheme_file))
    assert "rtn_int4_pre" in json.dumps(rep["scheme"])
    assert rep["dump"]["chunks"] == 2 and rep["dump"]["tokens_per_chunk"] == n


def test_dump_refuses_what_eval_would(tmp_path):
    dump = KVDump(tmp_path / "x.safetensors")
    a = np.zeros((2, 8, D), np.float32)
    dump.record(0, 0, np.zeros((4, 8, D), np.float32), a, a)
    with pytest.raises(ValueError, match="every chunk must have the same shape"):
        dump.record(0, 1, np.zeros((4, 8, D), np.float32), np.zeros((2, 9, D), np.float32),
                    np.zeros((2, 9, D), np.float32))
    with pytest.raises(ValueError, match="already recorded"):
        dump.record(0, 0, np.zeros((4, 8, D), np.float32), a, a)
    dump.record(1, 1, np.zeros((4, 8, D), np.float32), a, a)
    with pytest.raises(ValueError, match=r"missing \['l0.c1', 'l1.c0'\]"):
        dump.save()
