"""The pipeline (docs/METHODS.md section 11) through the binding: QuantizedKVCache
packs anchor spans, codes the spans between against them, carries the error and
reads a channel map from a sensitivity table, exactly as explicit Context calls
that follow the library's chunk policy do."""
import json

import numpy as np
import pytest

import kvforge
from conftest import video_like

H, D, N = 2, 128, 32
PIPE = 'return { base = "stable_int2", name = "pipe", anchors = { every = 3, bits = 8 } }'


def chunks(rng, n_chunks, n_tokens=N):
    return [(kvforge.float32_to_bf16_bits(video_like(rng, (H, n_tokens, D))),
             kvforge.float32_to_bf16_bits(video_like(rng, (H, n_tokens, D)))) for _ in range(n_chunks)]


def write_table(path, layers, heads=H, seed=3):
    """A sensitivity table (docs/FORMAT.md) of made-up scores."""
    r = np.random.default_rng(seed)
    t = {"format": "kvforge-sensitivity", "version": 1, "head_dim": D, "kv_heads": heads, "layers": layers,
         "key": r.random((layers, heads, D)).tolist(), "value": r.random((layers, heads, D)).tolist()}
    path.write_text(json.dumps(t))
    return str(path)


def test_info_names_the_pipeline():
    i = kvforge.Scheme("stable_int2").info
    assert i.outliers == (2, 2) and i.mixed_channels == (24, 8) and i.needs_channel_map
    assert i.anchor_every == 11 and i.anchor_bits == 8 and i.feedback_decay == pytest.approx(0.7)
    plain = kvforge.Scheme("rtn_int2").info
    assert plain.outliers == (0, 0) and not plain.needs_channel_map and plain.anchor_every == 0
    a = kvforge.Scheme("stable_int2").anchor_scheme()
    assert a.info.key_bits == 8 and a.info.anchor_every == 0
    with pytest.raises(kvforge.KvforgeError, match="no anchors|without anchors"):
        kvforge.Scheme("rtn_int2").anchor_scheme()


def test_mixed_map_from_a_table(tmp_path):
    s = kvforge.Scheme("stable_int2")
    path = write_table(tmp_path / "t.json", layers=2)
    m = s.mixed_map(path, 1, H)
    assert m.shape == (2, H, D) and m.dtype == np.uint8
    scores = json.loads(open(path).read())
    for sec, name, count in ((0, "key", 24), (1, "value", 8)):
        for h in range(H):
            refined = np.flatnonzero(m[sec, h] != 255)
            top = np.sort(np.argsort(-np.array(scores[name][1][h]), kind="stable")[:count])
            assert np.array_equal(refined, top)  # the highest scores, numbered in channel order
            assert np.array_equal(m[sec, h, refined], np.arange(count))
    with pytest.raises(kvforge.KvforgeError, match="layer"):
        s.mixed_map(path, 2, H)  # the table has 2 layers
    with pytest.raises(kvforge.KvforgeError, match="calibrate"):
        s.mixed_map(None, 0, H)  # the scheme names no table


def test_cache_matches_explicit_calls(rng, tmp_path):
    s = kvforge.Scheme.from_string(PIPE, "=pipe")
    with pytest.raises(kvforge.KvforgeError, match="calibrate"):
        kvforge.QuantizedKVCache(s, num_layers=1, num_kv_heads=H, head_dim=D)
    path = write_table(tmp_path / "t.json", layers=1)
    cache = kvforge.QuantizedKVCache(s, num_layers=1, num_kv_heads=H, head_dim=D, table=path)
    data = chunks(rng, 7)
    for k, v in data:
        cache.append(0, k, v)
    assert [seg[0] for seg in cache.segments(0)] == ["anchor", "packed", "packed"] * 2 + ["anchor"]
    K, V = cache.keys_values(0, bits=True)

    # The same stream by hand, step by step as kvf_chunk_policy says.
    ctx, actx = kvforge.Context(s), kvforge.Context(s.anchor_scheme())
    cmap = s.mixed_map(path, 0, H).reshape(-1).copy()
    fb = np.zeros(4 * 2 * H * N * D, dtype=np.uint8)
    anchor = None
    for t, (k, v) in enumerate(data):
        step = s.chunk_step(t)
        assert step.pack_first == t and step.pack_chunks == 1
        if step.anchor:
            anchor = (actx.encode(k, v), N)
            kd, vd = actx.decode(anchor[0], N, H, bits=True)
        else:
            assert step.anchor_first == t - t % 3
            p = ctx.encode(k, v, anchor=anchor, feedback=fb, feedback_in=step.feedback_in, channel_map=cmap)
            kd, vd = ctx.decode(p, N, H, bits=True, anchor=anchor)
        assert np.array_equal(K[:, N * t:N * (t + 1)], kd), t
        assert np.array_equal(V[:, N * t:N * (t + 1)], vd), t
        assert step.feedback_in == (t % 3 == 2)  # the span after an anchor starts a new chain

    m = cache.memory(0)
    assert m["feedback"] == 4 * 2 * H * N * D and m["channel_map"] == 2 * H * D
    a_bytes = s.anchor_scheme().packed_size(N, H)
    assert m["packed"] == 3 * a_bytes + 4 * s.packed_size(N, H)
    assert m["total"] == m["packed"] + m["feedback"] + m["channel_map"]
    cache.reset()
    assert cache.num_tokens(0) == 0 and cache.memory(0)["feedback"] == 0


def test_pipeline_lowers_the_error(rng, tmp_path):
    """On temporally coherent chunks (a scene that moves a little from chunk to
    chunk, as video does) the pipeline's cache is closer to the input than plain
    RTN INT2's: the spans between anchors code small differences. (On independent
    chunks anchors would double what is coded: they are for video.)"""
    path = write_table(tmp_path / "t.json", layers=1)
    base = [video_like(rng, (H, N, D)) for _ in range(2)]
    data = [tuple(kvforge.float32_to_bf16_bits(b + 0.05 * np.abs(b).mean() * rng.standard_normal(b.shape)
                                               .astype(np.float32)) for b in base) for _ in range(6)]
    ref = np.concatenate([kvforge.bf16_bits_to_float32(k) for k, _ in data], axis=1)
    err = {}
    for name in ("rtn_int2", "stable_int2"):
        c = kvforge.QuantizedKVCache(name, num_layers=1, num_kv_heads=H, head_dim=D,
                                     table=path if name == "stable_int2" else None)
        for k, v in data:
            c.append(0, k, v)
        K, _ = c.keys_values(0)
        err[name] = float(np.mean((K - ref) ** 2) / np.mean(ref ** 2))
    assert err["stable_int2"] < 0.5 * err["rtn_int2"], err


def test_batch_reads_each_heads_map(rng, tmp_path):
    """With a batch every entry is coded as it would be alone (its heads read their
    head's channel map)."""
    s = kvforge.Scheme.from_string(PIPE, "=pipe")
    path = write_table(tmp_path / "t.json", layers=1)
    data = chunks(rng, 4)
    batched = kvforge.QuantizedKVCache(s, num_layers=1, num_kv_heads=H, head_dim=D, table=path, batch_size=2)
    alone = kvforge.QuantizedKVCache(s, num_layers=1, num_kv_heads=H, head_dim=D, table=path)
    for k, v in data:
        batched.append(0, np.stack([k, k]), np.stack([v, v]))
        alone.append(0, k, v)
    Kb, Vb = batched.keys_values(0, bits=True)
    Ka, Va = alone.keys_values(0, bits=True)
    for b in range(2):
        assert np.array_equal(Kb[b], Ka) and np.array_equal(Vb[b], Va)


def _torch_device():
    """The device of the torch check: cuda where there is one, else the CPU reference
    through torch (KVFORGE_TEST_TORCH_DEVICE overrides)."""
    import os
    torch = pytest.importorskip("torch")
    dev = os.environ.get("KVFORGE_TEST_TORCH_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
    return torch, dev


def test_torch_cache_matches_numpy(rng, tmp_path):
    """The same stream through torch tensors (on a GPU: the pipeline's kernels) gives
    the CPU reference's bytes: anchors, the carried error and the channel map."""
    torch, dev = _torch_device()
    s = kvforge.Scheme.from_string(PIPE, "=pipe")
    path = write_table(tmp_path / "t.json", layers=2)
    data = chunks(rng, 7, 64)
    ref = kvforge.QuantizedKVCache(s, num_layers=2, num_kv_heads=H, head_dim=D, table=path)
    tc = kvforge.QuantizedKVCache(s, num_layers=2, num_kv_heads=H, head_dim=D, table=path, device=dev)
    for k, v in data:
        for layer in (0, 1):
            ref.append(layer, k, v)
            tc.append(layer, torch.from_numpy(k.view(np.int16)).view(torch.bfloat16).to(dev),
                      torch.from_numpy(v.view(np.int16)).view(torch.bfloat16).to(dev))
    for layer in (0, 1):
        K, V = ref.keys_values(layer, bits=True)
        Kt, Vt = tc.keys_values(layer)
        kt = Kt.cpu().view(torch.int16).numpy().view(np.uint16)
        vt = Vt.cpu().view(torch.int16).numpy().view(np.uint16)
        assert np.array_equal(kt, K) and np.array_equal(vt, V), (dev, layer, int((kt != K).sum()), int((vt != V).sum()))
    assert tc.memory() == ref.memory()
