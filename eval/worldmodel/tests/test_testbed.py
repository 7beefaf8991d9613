"""The testbed on the CPU: the large preset (GQA) at tiny size, weight shards, the time guard,
long-stream rollouts through the real kvforge binding (CPU backend) and a cache factory,
the temporal metrics on frames with known answers, and the attention peakedness measure."""
import json
import math
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
np = pytest.importorskip("numpy")

import dump_kv  # noqa: E402
import peaked  # noqa: E402
import rollout  # noqa: E402
import train  # noqa: E402
from kvcache import BF16Cache, check_cache  # noqa: E402
from model import (PRESETS, WMConfig, WorldModel, attend, load_weights, preset_config,  # noqa: E402
                   save_weights, weight_files, weights_sha256)
from test_artifacts import check_dump  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
LIB = os.environ.get("KVFORGE_LIB") or os.path.join(REPO, "out", "lib", "libkvforge.so")
KVF_BIN = os.path.join(REPO, "out", "bin", "kvforge")
# The large preset at test size, with the real head_dim and RoPE sections, so shipped schemes
# (head_dim 128) run on it: 8 query heads over 2 KV heads, q/o 1024 wide on a width of 48.
TINY_LARGE = dict(PRESETS["large"], grid_h=4, grid_w=6, width=48, layers=2, rope_sections=(16, 24, 24))


def test_large_preset():
    cfg = preset_config("large")
    assert (cfg.layers, cfg.heads, cfg.kv_heads, cfg.head_dim) == (8, 8, 2, 128)
    assert cfg.tokens_per_chunk == 4680 and cfg.rope_sections == (16, 24, 24)
    assert cfg.q_dim == 1024 != cfg.width
    n = sum(p.numel() for p in WorldModel(cfg).parameters())
    assert n <= 8_000_000 and 2 * n <= 16 * 2 ** 20
    with pytest.raises(ValueError):
        preset_config("huge")


def test_gqa_attention_is_repeated_kv():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 8, 7, 16, generator=g)
    k, v = torch.randn(2, 2, 11, 16, generator=g), torch.randn(2, 2, 11, 16, generator=g)
    want = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(4, 1), v.repeat_interleave(4, 1))
    assert torch.allclose(attend(q, k, v), want, atol=1e-5)
    # query head 5 reads KV head 1 (= 5 // 4): changing KV head 0 leaves it alone
    k2 = k.clone()
    k2[:, 0] += 1
    o1, o2 = attend(q, k, v), attend(q, k2, v)
    assert torch.equal(o1[:, 4:], o2[:, 4:]) and not torch.allclose(o1[:, :4], o2[:, :4])


def test_shards_round_trip(tmp_path):
    torch.manual_seed(0)
    m = WorldModel(WMConfig(**TINY_LARGE))
    p = str(tmp_path / "w.safetensors")
    files = save_weights(m, p, {"recipe": {"x": 1}}, max_shard_bytes=150_000)
    assert len(files) > 2 and files[0] == p and files[1].endswith("w.shard1.safetensors")
    assert all(os.path.getsize(f) <= 150_000 + 20_000 for f in files)
    assert weight_files(p) == [os.path.abspath(f) for f in files]
    m2 = load_weights(p)
    for (k, a), (k2, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert k == k2 and torch.equal(a.half().float(), b)
    one = str(tmp_path / "one.safetensors")
    assert save_weights(m, one) == [one] and weight_files(one) == [one]
    assert weights_sha256(p) != weights_sha256(one)


@pytest.fixture(scope="module")
def tiny_large(tmp_path_factory):
    """A tiny large-preset model trained 3 steps on synthetic frames, weights in 2+ shards."""
    d = tmp_path_factory.mktemp("wml")
    rep = train.main(["--smoke", "--preset", "large", "--config", json.dumps(TINY_LARGE), "--steps", "3",
                      "--out-dir", str(d), "--weights-name", "wl.safetensors", "--report-name", "rep.json",
                      "--max-shard-bytes", "400000", "--device", "cpu"])
    return d, rep


def test_tiny_large_trains(tiny_large):
    d, rep = tiny_large
    r = json.loads((d / "rep.json").read_text())
    assert r == json.loads(json.dumps(rep))
    assert r["model"]["heads"] == 8 and r["model"]["kv_heads"] == 2 and r["recipe"]["preset"] == "large"
    assert r["recipe"]["steps"] == 3 and r["recipe"]["seed"] == 1234 and not r["recipe"]["stopped_early"]
    assert len(r["weight_files"]) >= 2 and all(len(f["sha256"]) == 64 for f in r["weight_files"])
    assert r["weights_sha256"] == weights_sha256(str(d / "wl.safetensors"))
    assert math.isfinite(r["loss_first"]) and r["startup_seconds"] >= 0 and r["train_seconds"] > 0
    tf = r["heldout_teacher_forced"]
    assert math.isfinite(tf["mse_model"]) and tf["mse_copy_last_frame"] > 0
    m = load_weights(str(d / "wl.safetensors"))
    assert m.cfg.heads == 8 and m.cfg.kv_heads == 2


def test_max_seconds_stops_cleanly(tmp_path):
    r = train.main(["--smoke", "--preset", "large", "--steps", "40", "--max-seconds", "1e-6",
                    "--out-dir", str(tmp_path), "--device", "cpu"])
    assert r["recipe"]["stopped_early"] and r["recipe"]["steps"] == 1 and r["recipe"]["steps_planned"] == 40
    assert os.path.exists(tmp_path / "weights.safetensors")


def test_compare_and_long_eval(tiny_large, tmp_path):
    """--compare-weights evaluates another model on the same windows; --eval-long-chunks adds
    the long stream for both."""
    d, _ = tiny_large
    r = train.main(["--smoke", "--preset", "large", "--config", json.dumps(TINY_LARGE), "--steps", "1",
                    "--synthetic", "120", "--out-dir", str(tmp_path), "--device", "cpu",
                    "--compare-weights", str(d / "wl.safetensors"), "--eval-long-chunks", "6"])
    lg, c = r["heldout_long_autoregressive"], r["compared"]
    assert lg["start"] == 96 and len(lg["mse_model_per_chunk"]) == 6
    assert c["heldout_window_starts"] == r["heldout_window_starts"]
    assert len(c["heldout_long_autoregressive"]["mse_model_per_chunk"]) == 6
    assert c["heldout_long_autoregressive"]["mse_copy_per_chunk"] == lg["mse_copy_per_chunk"]


# ----------------------------------------------------------------------------- temporal metrics
def _flicker_clip(T=6, a=2.0):
    """Reference: gray 100 everywhere; f_t = 100 + a * (-1)^t; the last prompt frame: 100."""
    ref = torch.full((T, 16, 16, 3), 100.0)
    f = torch.stack([torch.full((16, 16, 3), 100.0 + a * (-1) ** t) for t in range(T)])
    return f, ref, torch.full((16, 16, 3), 100.0)


def _ssim_const(x, y):
    c1 = (0.01 * 255) ** 2
    return (2 * x * y + c1) / (x * x + y * y + c1)    # constant images: the contrast term is 1


def test_temporal_metrics_known_values():
    f, ref, prev = _flicker_clip()
    # frame differences: +2 (from the prompt frame), then -4, +4, ...: energies 4, 16, 16 | 16, 16, 16
    m = rollout.temporal_metrics(f, ref, prev, 3, threshold=8.0, ssim=True)
    assert m["flicker_energy_per_chunk"] == pytest.approx([12.0, 16.0])
    assert m["flicker_excess_per_chunk"] == pytest.approx([12.0, 16.0])
    assert m["first_perceptible_flicker_chunk"] == 0
    assert rollout.temporal_metrics(f, ref, prev, 3, 13.0, ssim=False)["first_perceptible_flicker_chunk"] == 1
    assert rollout.temporal_metrics(f, ref, prev, 3, 16.0, ssim=False)["first_perceptible_flicker_chunk"] is None
    # every frame is 2 levels off the reference: MSE 4
    assert m["psnr_vs_bf16_per_chunk"] == pytest.approx([10 * math.log10(255 ** 2 / 4)] * 2)
    if m.get("ssim_adjacent_per_chunk") is None:
        pytest.skip("no scikit-image")
    s1, s2 = _ssim_const(100, 102), _ssim_const(102, 98)
    assert m["ssim_adjacent_per_chunk"] == pytest.approx([(s1 + 2 * s2) / 3, s2], abs=1e-9)
    assert m["ssim_adjacent_bf16_per_chunk"] == pytest.approx([1.0, 1.0])
    assert m["ssim_adjacent_delta_per_chunk"] == pytest.approx([(s1 + 2 * s2) / 3 - 1, s2 - 1], abs=1e-9)
    # identical rollouts: no excess, no flicker, PSNR at the cap
    z = rollout.temporal_metrics(ref, ref, prev, 3, 8.0, ssim=False)
    assert z["flicker_excess_per_chunk"] == [0.0, 0.0] and z["first_perceptible_flicker_chunk"] is None
    assert z["psnr_vs_bf16_per_chunk"] == [rollout.PSNR_CAP] * 2


def test_pair_helpers():
    f = torch.zeros(4, 2, 2, 3)
    f[2] = 3.0
    e = rollout.pair_energy(f)
    assert math.isnan(e[0]) and list(e[1:]) == [0.0, 9.0, 9.0]
    assert rollout.per_chunk(e, 2) == [0.0, 9.0]
    assert rollout.first_above([None, float("nan"), 1.0, 5.0], 2.0) == 3


# ----------------------------------------------------------------------------- peakedness
def test_row_stats_hand_made():
    # uniform over 4 past keys, 2 keys of the own chunk
    st = peaked.row_stats(torch.zeros(1, 6), 4, torch.tensor([1.0, 1.0, 4.0, 4.0]))
    assert float(st["entropy"]) == pytest.approx(math.log(4)) and float(st["entropy_norm"]) == pytest.approx(1.0)
    assert float(st["top1"]) == pytest.approx(0.25) and float(st["top8_mass"]) == pytest.approx(1.0)
    assert float(st["past_mass"]) == pytest.approx(4 / 6) and float(st["frame_lag"]) == pytest.approx(2.5)
    # weights 3/4, 1/4 on two past keys (no own keys)
    st = peaked.row_stats(torch.tensor([[math.log(3.0), 0.0]]), 2, torch.tensor([2.0, 5.0]))
    assert float(st["entropy"]) == pytest.approx(-(0.75 * math.log(0.75) + 0.25 * math.log(0.25)))
    assert float(st["top1"]) == pytest.approx(0.75) and float(st["frame_lag"]) == pytest.approx(2.75)
    assert float(st["past_mass"]) == pytest.approx(1.0)
    # one dominant key: entropy ~ 0, top-1 ~ 1
    st = peaked.row_stats(torch.tensor([[50.0, 0.0, 0.0, 0.0]]), 4)
    assert float(st["entropy"]) < 1e-15 and float(st["top1"]) == pytest.approx(1.0)


def test_peakedness_cache_gqa_heads():
    """Hand-made q and k: query heads 0-1 (KV head 0) point at past key 0, heads 2-3 (KV head 1)
    at past key 1; with the grouping of the model every head is peaked on its key."""
    cfg = WMConfig(grid_h=1, grid_w=2, width=16, heads=4, kv_heads=2, head_dim=8, layers=1, rope_sections=(1, 1, 2))
    pc = peaked.PeakednessCache(BF16Cache(1, dtype=torch.float32), cfg, stride=1)
    nc = cfg.tokens_per_chunk                           # 6 tokens a chunk
    e = torch.eye(8)
    k0 = torch.zeros(2, nc, 8)
    k0[0, 0], k0[1, 1] = 40 * e[0], 40 * e[1]           # KV head 0: key 0; KV head 1: key 1
    assert pc.keys_values(0) is None
    pc.append(0, k0, torch.zeros(2, nc, 8), q=torch.zeros(4, nc, 8))
    q = torch.zeros(4, nc, 8)
    q[:2], q[2:] = e[0], e[1]
    pc.keys_values(0)
    pc.append(0, torch.zeros(2, nc, 8), torch.zeros(2, nc, 8), q=q)
    t = pc.table()
    heads = t["per_layer"][0]["heads"]
    assert [h["kv_head"] for h in heads] == [0, 0, 1, 1] and all(h["rows"] == nc for h in heads)
    assert all(h["top1"] > 0.99 for h in heads)
    # the key sits in frame 0 of chunk 0; the queries in frames 3..5: mean lag 4 - 0... per query
    lag = np.mean([3 + (i // cfg.tokens_per_frame) for i in range(nc)])
    assert all(h["frame_lag"] == pytest.approx(lag, abs=1e-3) for h in heads)
    assert t["summary"]["heads"] == 4 and t["summary"]["top1"] > 0.99


def test_peaked_cli_tiny(tiny_large, tmp_path):
    d, _ = tiny_large
    out = peaked.main(["--weights", f"tl={d / 'wl.safetensors'}", "--synthetic", "45", "--chunks", "3",
                       "--q-stride", "4", "--device", "cpu", "--json", str(tmp_path / "p.json")])
    t = out["models"]["tl"]
    assert len(t["per_layer"]) == 2 and len(t["per_layer"][0]["heads"]) == 8
    n_past_max = 2 * 72
    for L in t["per_layer"]:
        for h in L["heads"]:
            assert 0 <= h["entropy"] <= math.log(n_past_max) + 1e-9 and 0 < h["top1"] <= 1
            assert 0 < h["past_mass"] < 1 and h["rows"] == 2 * 18
    assert json.loads((tmp_path / "p.json").read_text())["models"]["tl"]["summary"]["heads"] == 16


# ----------------------------------------------------------------------------- real kvforge, CPU
need_lib = pytest.mark.skipif(not os.path.exists(LIB), reason=f"no {LIB} (run make)")


def _drop_kvforge():
    for k in [k for k in sys.modules if k == "kvforge" or k.startswith("kvforge.")]:
        del sys.modules[k]


@need_lib
def test_long_rollout_real_kvforge_cpu(tiny_large, tmp_path, monkeypatch):
    """Autoregressive rollout of 8 generated chunks through shipped schemes (CPU backend of the
    real binding), a RoPE "pre" scheme file and a cache factory; each chunk is predicted from
    the compressed cache of the chunks before it."""
    d, _ = tiny_large
    monkeypatch.setenv("KVFORGE_LIB", LIB)
    pre = tmp_path / "rtn_pre.lua"
    pre.write_text("return { base = 'rtn_int4', name = 'rtn_pre', rope = { placement = 'pre', "
                   "sections = { 16, 24, 24 } } }\n")
    fac = tmp_path / "myfac.py"
    fac.write_text("from kvcache import BF16Cache\n\ndef make(cfg, device):\n    return BF16Cache(cfg.layers)\n")
    j = tmp_path / "long.json"
    _drop_kvforge()
    try:
        out = rollout.main(["--weights", str(d / "wl.safetensors"), "--synthetic", "45", "--starts", "0",
                            "--chunks", "8", "--attn-stride", "0", "--schemes", "rtn_int2,kivi_int2",
                            "--schemes", str(pre), "--cache-factory", f"same={fac}:make",
                            "--json", str(j), "--img-dir", str(tmp_path / "img"), "--device", "cpu"])
    finally:
        _drop_kvforge()
    s = out["schemes"]
    assert list(s) == ["bf16", "rtn_int2", "kivi_int2", "rtn_pre", "same"]
    assert all(r["status"] == "ok" for r in s.values()), {n: r.get("error") for n, r in s.items()}
    assert out["context_tokens_at_last_chunk"] == 8 * 72
    for n in ("rtn_int2", "kivi_int2", "rtn_pre"):
        row = s[n]["per_start"][0]
        assert len(row["psnr_vs_bf16_per_chunk"]) == 8 and row["psnr_vs_bf16_per_chunk"][0] == 100.0
        assert min(row["psnr_vs_bf16_per_chunk"][2:]) < 100.0        # compressed past: not BF16's
        assert s[n]["compression_ratio"] > 1.5
    # the binding keeps packed spans only (kivi: its one recent chunk a layer in BF16)
    assert s["rtn_int2"]["cache_memory"]["bf16"] == 0 and s["rtn_int2"]["cache_memory"]["packed"] > 0
    assert s["kivi_int2"]["cache_memory"]["bf16"] == 2 * 2 * 72 * 2 * 128 * 2
    assert s["rtn_pre"]["cache_memory"]["positions"] > 0
    # the factory's BF16 cache reproduces the reference exactly
    assert s["same"]["min_psnr_vs_bf16"] == 100.0 and s["same"]["kind"] == "factory"
    assert s["same"]["per_start"][0]["flicker_excess_per_chunk"] == [0.0] * 8
    assert s["bf16"]["peak_gpu_bytes"] is None
    assert os.path.exists(tmp_path / "img" / "temporal.png")


def test_cache_factory_forms(tmp_path):
    label, fn = rollout.load_factory("kvcache:BF16Cache")
    assert label == "BF16Cache" and fn is BF16Cache
    bad = tmp_path / "bad.py"
    bad.write_text("def make(cfg, device):\n    return object()\n")
    label, fn = rollout.load_factory(f"x={bad}:make")
    with pytest.raises(TypeError, match="lacks keys_values, append, nbytes, compression_ratio"):
        check_cache(fn(None, None), label)
    with pytest.raises(SystemExit):
        rollout.load_factory("kvcache:nothing_here")


@need_lib
def test_long_dump_through_scheme_and_eval(tiny_large, tmp_path, monkeypatch):
    """dump_kv --preset long through a scheme's cache (the stream each chunk of which is predicted
    from the compressed past), then `kvforge eval` reads it (grouped-query heads)."""
    d, _ = tiny_large
    monkeypatch.setenv("KVFORGE_LIB", LIB)
    out = tmp_path / "long.safetensors"
    _drop_kvforge()
    try:
        dump_kv.main(["--weights", str(d / "wl.safetensors"), "--synthetic", "45", "--preset", "long",
                      "--chunks", "6", "--start", "0", "--q-stride", "8", "--cache-scheme", "rtn_int2",
                      "--out", str(out), "--device", "cpu"])
    finally:
        _drop_kvforge()
    meta = check_dump(str(out))
    assert (meta["mode"], meta["trajectory_cache"], meta["chunks"]) == ("autoregressive", "rtn_int2", "6")
    assert meta["model_layers"] == "0,1" and meta["q_heads"] == "8" and meta["kv_heads"] == "2"
    if not os.path.exists(KVF_BIN):
        pytest.skip("no out/bin/kvforge")
    r = subprocess.run([KVF_BIN, "eval", "--scheme", os.path.join(REPO, "schemes", "rtn_int2.lua"), "--data", str(out),
                        "--json", "--threads", "2"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    rep = json.loads(r.stdout)
    assert rep["overall"]["queries"] > 0 and 0 <= rep["overall"]["top1_shift"] <= 1
    assert len(rep["layers"]) == 2 and len(rep["layers"][0]["chunks"]) == 5


def test_dump_layer_spread():
    assert dump_kv.parse_layers("spread3", 8) == [0, 4, 7]     # round(3.5) = 4
    assert dump_kv.parse_layers("spread2", 8) == [0, 7]
    assert dump_kv.parse_layers("spread1", 8) == [4]
    assert dump_kv.parse_layers("spread3", 2) == [0, 1]


def test_testbed_script_parses():
    sh = os.path.join(REPO, "tools", "gpu", "testbed.sh")
    assert subprocess.run(["bash", "-n", sh]).returncode == 0
    r = subprocess.run(["bash", sh], capture_output=True, text=True, cwd=REPO, env={**os.environ, "OUT": "/tmp/tb_out"})
    assert r.returncode == 2 and "rollout [SCHEMES]" in r.stdout
