"""World-model tests on the CPU: geometry, RoPE, chunk causality, and the smoke runs of
train.py, dump_kv.py and rollout.py (with a stand-in for the kvforge binding)."""
import json
import math
import os
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
np = pytest.importorskip("numpy")

import dump_kv  # noqa: E402
import rollout  # noqa: E402
import train  # noqa: E402
from kvcache import BF16Cache, KvforgeCache  # noqa: E402
from model import (WMConfig, WorldModel, apply_rope, chunk_positions, frames_to_patches,  # noqa: E402
                   patches_to_frames, rope_cos_sin)
from test_artifacts import check_dump  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FAKE = os.path.join(HERE, "fake_kvforge")
TINY = dict(grid_h=4, grid_w=6, width=64, heads=2, kv_heads=2, head_dim=32, layers=2, rope_sections=(4, 6, 6))


def tiny_model(seed=0, **kw):
    torch.manual_seed(seed)
    m = WorldModel(WMConfig(**{**TINY, **kw}))
    torch.nn.init.normal_(m.head.weight, std=0.05)   # a trained-looking head, not the zero init
    return m.eval()


def test_geometry_of_the_real_model():
    cfg = WMConfig()
    assert (cfg.tokens_per_frame, cfg.tokens_per_chunk, cfg.frame_hw) == (1560, 4680, (240, 416))
    assert cfg.head_dim == 128 and cfg.heads >= 2 and cfg.layers >= 4
    m = WorldModel(cfg)
    n = sum(p.numel() for p in m.parameters())
    assert 2 * n <= 16 * 2 ** 20, "fp16 weights must fit in 16 MiB"
    fr = torch.randint(0, 256, (3, 240, 416, 3), dtype=torch.uint8)
    p = frames_to_patches(fr, cfg)
    assert p.shape == (4680, 192) and float(p.min()) >= -1 and float(p.max()) <= 1
    assert torch.equal(patches_to_frames(p, cfg).round().to(torch.uint8), fr)
    # Token (j, y, x) is patch (y, x) of frame j.
    j, y, x = 2, 17, 40
    i = j * 1560 + y * 52 + x
    assert torch.equal(p[i].view(8, 8, 3), fr[j, 8 * y:8 * y + 8, 8 * x:8 * x + 8].float() / 127.5 - 1)


def test_positions():
    cfg = WMConfig()
    pos = chunk_positions(2, cfg, 2)
    assert pos.dtype == torch.int32 and pos.shape == (2 * 4680, 3)
    for i in (0, 1, 51, 52, 1559, 1560, 4679, 4680, 9359):
        c, r = divmod(i, 4680)
        assert pos[i].tolist() == [3 * (2 + c) + r // 1560, (r % 1560) // 52, r % 52]


def test_rope_is_methods_md_section_6():
    """Against an independent f64 evaluation of METHODS.md's formula (pairs (p, p + d/2),
    sections (16, 24, 24) for (frame, row, column), angle pos_a * theta^(-2 p_a / d_a))."""
    cfg = WMConfig()
    pos = chunk_positions(3, cfg)[::37]
    g = torch.Generator().manual_seed(1)
    k = torch.randn(2, pos.shape[0], 128, generator=g)
    cos, sin = rope_cos_sin(pos, cfg)
    got = apply_rope(k, cos, sin).double().numpy()
    kk = k.double().numpy()
    want = np.empty_like(kk)
    p = 0
    for a, n_a in enumerate((16, 24, 24)):
        for p_a in range(n_a):
            ang = pos[:, a].double().numpy() * 10000.0 ** (-2.0 * p_a / (2 * n_a))
            c, s = np.cos(ang), np.sin(ang)
            x1, x2 = kk[..., p], kk[..., p + 64]
            want[..., p], want[..., p + 64] = x1 * c - x2 * s, x1 * s + x2 * c
            p += 1
    assert np.abs(got - want).max() < 2e-3 * max(1.0, np.abs(want).max())


def test_rope_relative_and_axis_sections():
    cfg = WMConfig()
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(128, generator=g), torch.randn(128, generator=g)

    def rot(x, t, y, xx):
        c, s = rope_cos_sin(torch.tensor([[t, y, xx]], dtype=torch.int32), cfg)
        return apply_rope(x[None], c, s)[0].double()
    # q.k depends only on the position difference
    d1 = rot(q, 5, 3, 7) @ rot(k, 2, 10, 1)
    d2 = rot(q, 11, 13, 40) @ rot(k, 8, 20, 34)
    assert abs(float(d1 - d2)) < 1e-3 * (1 + abs(float(d1)))
    # the frame axis owns pairs 0..15 (channels 0-15, 64-79), row 16..39, column 40..63
    base = rot(q, 0, 0, 0)
    ch = lambda lo, hi: list(range(lo, hi)) + list(range(64 + lo, 64 + hi))
    for axis, (lo, hi) in enumerate(((0, 16), (16, 40), (40, 64))):
        pos = [0, 0, 0]
        pos[axis] = 9
        moved = rot(q, *pos)
        others = [c for c in range(128) if c not in ch(lo, hi)]
        assert torch.allclose(moved[others], base[others], atol=1e-5)
        assert not torch.allclose(moved[ch(lo, hi)], base[ch(lo, hi)], atol=1e-3)


def test_chunk_causality_and_cache_equivalence():
    m = tiny_model()
    nc = m.cfg.tokens_per_chunk
    g = torch.Generator().manual_seed(3)
    x = torch.rand(1, 4 * nc, m.cfg.patch_dim, generator=g) * 2 - 1
    with torch.no_grad():
        y = m(x)
        for t in range(3):                   # change chunks > t: outputs of chunks <= t stay
            x2 = x.clone()
            x2[:, (t + 1) * nc:] = torch.rand(1, (3 - t) * nc, m.cfg.patch_dim, generator=g) * 2 - 1
            y2 = m(x2)
            assert torch.equal(y2[:, :(t + 1) * nc], y[:, :(t + 1) * nc])
            assert not torch.allclose(y2[:, (t + 1) * nc:], y[:, (t + 1) * nc:])
        # chunk t does depend on chunks < t (the cache is read)
        x3 = x.clone()
        x3[:, :nc] = 0
        assert not torch.allclose(m(x3)[:, nc:2 * nc], y[:, nc:2 * nc])
        # chunk by chunk with a KV cache = the window forward
        cache = BF16Cache(m.cfg.layers, dtype=None)
        ys = [m(x[:, c * nc:(c + 1) * nc], chunk0=c, cache=cache) for c in range(4)]
        assert torch.allclose(torch.cat(ys, 1), y, atol=1e-5)
        assert cache.keys_values(0)[0].shape == (2, 4 * nc, 32)


def test_untrained_model_copies_the_last_frame():
    cfg = WMConfig(**TINY)
    m = WorldModel(cfg).eval()
    x = torch.rand(1, 2 * cfg.tokens_per_chunk, cfg.patch_dim) * 2 - 1
    with torch.no_grad():
        y = m(x).view(1, 2, 3, cfg.tokens_per_frame, -1)
    last = x.view(1, 2, 3, cfg.tokens_per_frame, -1)[:, :, 2:3]
    assert torch.equal(y, last.expand_as(y))


def test_kvforge_adapter_post_and_pre():
    """KvforgeCache against the stand-in binding: post schemes get post-RoPE keys and queries,
    pre schemes pre-RoPE keys, queries and positions, and hand back rotated keys."""
    sys.path.insert(0, FAKE)
    try:
        m = tiny_model(head_dim=128, heads=2, kv_heads=2, rope_sections=(16, 24, 24), width=256, layers=1)
        nc = m.cfg.tokens_per_chunk
        x = torch.rand(1, 2 * nc, m.cfg.patch_dim) * 2 - 1
        outs = {}
        for name in ("bf16", "t_int16", "t_pre_int16", "t_int2"):
            cache = BF16Cache(1) if name == "bf16" else KvforgeCache(name, 1, 2, 128, device="cpu", n_q_heads=2)
            with torch.no_grad():
                outs[name] = torch.cat([m(x[:, c * nc:(c + 1) * nc], chunk0=c, cache=cache) for c in range(2)], 1)
            if name != "bf16":
                assert cache.cache.queries_seen == 2 * 2 * nc
                assert cache.pre == ("pre" in name)
                assert cache.keys_values(0)[0].shape == (2, 2 * nc, 128)
        assert torch.allclose(outs["t_int16"], outs["bf16"], atol=1e-3)
        assert torch.allclose(outs["t_pre_int16"], outs["bf16"], atol=2e-2)
        assert not torch.allclose(outs["t_int2"], outs["bf16"], atol=1e-3)
    finally:
        sys.path.remove(FAKE)
        sys.modules.pop("kvforge", None)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    d = tmp_path_factory.mktemp("wm")
    report = train.main(["--smoke", "--out-dir", str(d), "--device", "cpu"])
    return d, report


def test_smoke_train(smoke):
    d, rep = smoke
    assert (d / "weights.safetensors").exists()
    r = json.loads((d / "train_report.json").read_text())
    assert r["recipe"]["steps"] == 4 and r["recipe"]["seed"] == 1234
    for k in ("heldout_teacher_forced", "heldout_autoregressive", "train_teacher_forced"):
        assert math.isfinite(r[k]["mse_model"]) and r[k]["mse_copy_last_frame"] > 0
    assert r["weights_sha256"] and r["data"]["heldout_frames"] == [36, 45]


def test_smoke_dump(smoke):
    d, _ = smoke
    out = d / "dump.safetensors"
    dump_kv.main(["--weights", str(d / "weights.safetensors"), "--synthetic", "45", "--out", str(out),
                  "--layers", "all", "--chunks", "3", "--q-stride", "4", "--device", "cpu"])
    meta = check_dump(str(out))
    assert (meta["layers"], meta["model_layers"], meta["chunks"]) == ("2", "0,1", "3")
    assert meta["q_tokens_per_chunk"] == "36"
    from safetensors.torch import load_file
    t = load_file(str(out))
    cfg = WMConfig(**train.SMOKE_CONFIG)
    cos, sin = rope_cos_sin(t["pos"][144:288], cfg)
    # k is RoPE(k_pre) (both rounded to bf16), q likewise on the kept query tokens
    kr = apply_rope(t["l1.c1.k_pre"].float(), cos, sin)
    assert torch.allclose(kr, t["l1.c1.k"].float(), atol=0.05, rtol=0.02)
    qr = apply_rope(t["l1.c1.q_pre"].float(), cos[::4], sin[::4])
    assert torch.allclose(qr, t["l1.c1.q"].float(), atol=0.05, rtol=0.02)
    # the teacher-forced dump = the model's cache on the same frames
    dump_kv.main(["--weights", str(d / "weights.safetensors"), "--synthetic", "45", "--out", str(d / "small.st"),
                  "--device", "cpu"])
    t2 = load_file(str(d / "small.st"))
    # the small preset: model layer 1 (the middle of 2) as dump layer 0, chunks 0-1, q stride 8
    assert sorted(k for k in t2 if k != "pos") == sorted(f"l0.c{c}.{n}" for c in (0, 1)
                                                          for n in ("q", "q_pre", "k", "k_pre", "v"))
    assert check_dump(str(d / "small.st"))["model_layers"] == "1"
    assert torch.equal(t2["l0.c1.k"], t["l1.c1.k"]) and t2["l0.c0.q"].shape[1] == 18


def test_smoke_rollout(smoke, tmp_path):
    d, _ = smoke
    j = tmp_path / "r.json"
    tarp = tmp_path / "img.tar"
    try:
        rollout.main(["--weights", str(d / "weights.safetensors"), "--synthetic", "45", "--chunks", "2",
                      "--schemes", "bf16,f_int2,f_int8,f_pre_int8,nosuch", "--kvforge-python", FAKE,
                      "--json", str(j), "--img-dir", str(tmp_path / "img"), "--tar", str(tarp),
                      "--strip-schemes", "bf16,f_int2,f_int8", "--attn-stride", "2", "--device", "cpu"])
    finally:
        sys.modules.pop("kvforge", None)
        if FAKE in sys.path:
            sys.path.remove(FAKE)
    r = json.loads(j.read_text())
    s = r["schemes"]
    assert r["generated_frames"] == 6 and r["starts"] == [36]
    assert s["bf16"]["min_psnr_vs_bf16"] == 100.0
    assert s["bf16"]["flicker_excess"] == 0.0
    assert s["nosuch"]["status"] == "error"
    for n in ("f_int2", "f_int8", "f_pre_int8"):
        assert s[n]["status"] == "ok", s[n]
        row = s[n]["per_start"][0]
        assert len(row["psnr_vs_bf16"]) == 6 and len(row["psnr_vs_real"]) == 6
        # the first generated chunk sees only its own BF16 keys: identical to BF16
        assert row["psnr_vs_bf16"][:3] == [100.0] * 3
        assert 0 <= row["attention"]["top1_shift"] <= 1 and row["attention"]["queries"] > 0
        assert s[n]["compression_ratio"] > 1
    assert s["f_int2"]["top1_shift"] >= s["f_int8"]["top1_shift"]
    assert s["f_int2"]["mean_psnr_vs_bf16"] <= s["f_int8"]["mean_psnr_vs_bf16"]
    imgs = sorted(os.listdir(tmp_path / "img"))
    assert imgs == ["flicker_f_int2.png", "flicker_f_int8.png", "flicker_f_pre_int8.png", "flicker_grid.png",
                    "rollout_strip.png", "temporal.png"]
    # per generated chunk: 2 chunks, the first read no cached past (identical to BF16)
    row = s["f_int2"]["per_start"][0]
    assert len(row["psnr_vs_bf16_per_chunk"]) == 2 and row["psnr_vs_bf16_per_chunk"][0] == 100.0
    assert row["flicker_excess_per_chunk"][0] == 0.0
    assert s["bf16"]["per_start"][0]["first_perceptible_flicker_chunk"] is None
    import tarfile
    with tarfile.open(tarp) as tf:
        assert sorted(tf.getnames()) == ["docs/img/" + x for x in imgs]
