"""Checks of the committed artifacts (weights, KV dump) that need only the standard library."""
import array
import json
import math
import os

import pytest

from safetensors_header import DTYPE_SIZE, read_header, read_raw

WM = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DUMP = os.path.join(WM, "kv_small.safetensors")
WEIGHTS = os.path.join(WM, "weights.safetensors")
REQUIRED_META = ("layers", "chunks", "model_layers", "n_layers_model", "q_heads", "kv_heads", "head_dim", "tokens_per_chunk",
                 "frames_per_chunk", "grid", "rope_theta", "rope_sections", "rope_layout", "q_subsample",
                 "q_tokens_per_chunk", "q_pre", "mode", "source")


def check_dump(path):
    """Every name, dtype, shape, offset and position of a dump_kv.py file; returns its metadata."""
    meta, hdr, base = read_header(path)
    for k in REQUIRED_META:
        assert k in meta and isinstance(meta[k], str), f"metadata {k} missing"
    layers = list(range(int(meta["layers"])))      # docs/QUALITY.md: counts, names from 0
    chunks = list(range(int(meta["chunks"])))
    model_layers = [int(x) for x in meta["model_layers"].split(",")]
    assert len(model_layers) == len(layers) and model_layers == sorted(set(model_layers))
    hq, hk, d = int(meta["q_heads"]), int(meta["kv_heads"]), int(meta["head_dim"])
    n, fpc = int(meta["tokens_per_chunk"]), int(meta["frames_per_chunk"])
    gh, gw = (int(x) for x in meta["grid"].split(","))
    s = int(meta["q_subsample"])
    nq = int(meta["q_tokens_per_chunk"])
    assert nq == math.ceil(n / s) and n == fpc * gh * gw and hq % hk == 0
    secs = [int(x) for x in meta["rope_sections"].split(",")]
    assert len(secs) == 3 and 2 * sum(secs) == d
    assert float(meta["rope_theta"]) > 0 and meta["rope_layout"] == "half"
    assert all(0 <= l < int(meta["n_layers_model"]) for l in model_layers)
    assert "sha256" in meta["source"]

    want = {"pos": ("I32", [len(chunks) * n, 3])}
    for l in layers:
        for c in chunks:
            want[f"l{l}.c{c}.q"] = ("BF16", [hq, nq, d])
            if meta["q_pre"] == "yes":
                want[f"l{l}.c{c}.q_pre"] = ("BF16", [hq, nq, d])
            for t in ("k", "k_pre", "v"):
                want[f"l{l}.c{c}.{t}"] = ("BF16", [hk, n, d])
    assert set(hdr) == set(want), sorted(set(hdr) ^ set(want))
    size = os.path.getsize(path)
    spans = []
    for name, (dt, shape) in want.items():
        e = hdr[name]
        assert e["dtype"] == dt and e["shape"] == shape, (name, e["dtype"], e["shape"])
        a, b = e["data_offsets"]
        assert b - a == DTYPE_SIZE[dt] * math.prod(shape), name
        spans.append((a, b))
    spans.sort()
    assert spans[0][0] == 0 and all(x[1] == y[0] for x, y in zip(spans, spans[1:]))
    assert base + spans[-1][1] == size

    pos = array.array("i")
    pos.frombytes(read_raw(path, hdr["pos"], base))
    tpf = gh * gw
    for i in list(range(0, len(pos) // 3, 97)) + [len(pos) // 3 - 1]:
        c, r = divmod(i, n)
        assert tuple(pos[3 * i:3 * i + 3]) == (c * fpc + r // tpf, (r % tpf) // gw, r % gw), i
    # Tensors are not all zero (a dump of something).
    k0 = read_raw(path, hdr[f"l{layers[0]}.c0.k"], base)
    assert any(k0[:4096])
    return meta


@pytest.mark.skipif(not os.path.exists(DUMP), reason="no committed dump (eval/worldmodel/kv_small.safetensors) yet")
def test_committed_dump():
    assert os.path.getsize(DUMP) <= 20 * 10 ** 6
    meta = check_dump(DUMP)
    assert meta["tokens_per_chunk"] == "4680" and meta["head_dim"] == "128"
    assert meta["grid"] == "30,52" and meta["rope_sections"] == "16,24,24"
    assert int(meta["chunks"]) >= 2
    if os.path.exists(WEIGHTS):
        from hashlib import sha256
        with open(WEIGHTS, "rb") as f:
            assert sha256(f.read()).hexdigest() in meta["source"], "dump made with other weights"


@pytest.mark.skipif(not os.path.exists(WEIGHTS), reason="no committed weights yet")
def test_committed_weights():
    assert os.path.getsize(WEIGHTS) <= 16 * 2 ** 20
    meta, hdr, _ = read_header(WEIGHTS)
    cfg = json.loads(meta["config"])
    assert cfg["head_dim"] == 128 and cfg["heads"] >= 2 and cfg["layers"] >= 4
    assert cfg["grid_h"] * cfg["grid_w"] == 1560 and cfg["frames_per_chunk"] == 3
    assert sum(cfg["rope_sections"]) * 2 == 128
    assert all(e["dtype"] == "F16" for e in hdr.values())
    assert "recipe" in meta and "data" in meta
