"""Ulysses sequence parallelism (sp_rollout.py): two gloo ranks on the CPU, each with its own
kvforge cache of its KV heads (the binding's CPU reference), give the single-process
rollout bit for bit, for BF16, rtn_int2 and qvg_int2 (k-means)."""
import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
np = pytest.importorskip("numpy")

from kvcache import KvforgeCache  # noqa: E402
from model import (PRESETS, WMConfig, WorldModel, frames_to_patches, generate,  # noqa: E402
                   load_model_and_frames, save_weights)

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
LIB = os.environ.get("KVFORGE_LIB") or os.path.join(REPO, "out", "lib", "libkvforge.so")
SP = os.path.join(REPO, "eval", "worldmodel", "sp_rollout.py")
need_lib = pytest.mark.skipif(not os.path.exists(LIB), reason=f"no {LIB} (run make)")
dist_ok = pytest.mark.skipif(not (torch.distributed.is_available() and torch.distributed.is_gloo_available()),
                             reason="torch without gloo")

# The large preset's heads (8 query heads over 2 KV heads, head_dim 128, RoPE (16, 24, 24)) on
# a 10 x 12 grid: 360 tokens a chunk, more than qvg_int2's 256 centroids, so its k-means
# (and the seeds of its heads) decide the codes.
GQA = dict(PRESETS["large"], grid_h=10, grid_w=12, width=48, layers=2)
# The small preset's heads (2 over 2) on a smaller grid.
MHA = dict(PRESETS["small"], grid_h=10, grid_w=12, width=32, layers=2)
FRAMES, CHUNKS = 12, 3          # 1 prompt chunk, 3 generated: 3 forward calls, the last over 3 chunks


def _weights(path, cfg_kw, seed):
    """Random weights; the head (zero in an untrained model, which would copy the last frame
    whatever attention does) is drawn too, so the rollout depends on the cache."""
    torch.manual_seed(seed)
    m = WorldModel(WMConfig(**cfg_kw))
    torch.nn.init.normal_(m.head.weight, std=0.05)
    save_weights(m, str(path))
    return str(path)


def _drop_kvforge():
    for k in [k for k in sys.modules if k == "kvforge" or k.startswith("kvforge.")]:
        del sys.modules[k]


def _torchrun(args, tmp_path, chunks=CHUNKS):
    env = {**os.environ, "KVFORGE_LIB": LIB, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "KVFORGE_CACHE_DIR": str(tmp_path / "kc")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SP,
           "--synthetic", str(FRAMES), "--first-frame", "0", "--chunks", str(chunks), "--device", "cpu",
           "--kvforge-python", os.path.join(REPO, "python")] + args
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def _single(weights, scheme, monkeypatch):
    """The single-process rollout of rollout.py's kind: model.generate, one cache of all heads."""
    monkeypatch.setenv("KVFORGE_LIB", LIB)
    monkeypatch.syspath_prepend(os.path.join(REPO, "python"))
    model, frames, _ = load_model_and_frames(weights, "cpu", None, FRAMES, 1234)
    cfg = model.cfg
    prompt = frames_to_patches(torch.from_numpy(np.ascontiguousarray(frames[:FRAMES])), cfg)[None]
    prompt = prompt[:, :cfg.tokens_per_chunk]
    from kvcache import BF16Cache
    cache = BF16Cache(cfg.layers) if scheme == "bf16" else \
        KvforgeCache(scheme, cfg.layers, cfg.kv_heads, cfg.head_dim, device=torch.device("cpu"), n_q_heads=cfg.heads)
    return generate(model, prompt, CHUNKS, cache)[0].float().numpy()


@need_lib
@dist_ok
def test_two_ranks_equal_one_process_gqa(tmp_path, monkeypatch):
    w = _weights(tmp_path / "gqa.safetensors", GQA, 3)
    j, npz = tmp_path / "sp.json", tmp_path / "sp.npz"
    _torchrun(["--weights", w, "--schemes", "bf16,rtn_int2,qvg_int2", "--check", "--json", str(j),
               "--save", str(npz)], tmp_path)
    rep = json.loads(j.read_text())
    assert (rep["world_size"], rep["backend"], rep["partial"]) == (2, "gloo", False)
    assert (rep["kv_heads_per_rank"], rep["q_heads_per_rank"], rep["tokens_per_rank"]) == (1, 4, 180)
    s = rep["schemes"]
    assert list(s) == ["bf16", "rtn_int2", "qvg_int2"]
    for name, r in s.items():
        assert r["status"] == "ok", r
        assert r["check"]["identical"] and r["check"]["max_abs_diff"] == 0.0, (name, r["check"])
        assert len(r["seconds_per_call"]) == CHUNKS and r["peak_gpu_bytes_per_rank"] == [None, None]
    # the ranks hold one KV head each: half the BF16 cache each
    assert s["bf16"]["cache_bytes_per_rank"] == [2 * 2 * CHUNKS * 360 * 128 * 2] * 2
    rb = s["rtn_int2"]["cache_bytes_per_rank"]
    assert rb[0] == rb[1] and 0 < rb[0] < s["bf16"]["cache_bytes_per_rank"][0] / 4
    # rank 1's qvg_int2 seeds its k-means as global head 1 (another scheme id); RTN has no seed to move
    assert s["qvg_int2"]["head_seeds"] == ["global", "global"]
    ids = s["qvg_int2"]["scheme_id_per_rank"]
    assert ids[0].startswith("qvg_int2_") and ids[0] != ids[1]
    assert s["rtn_int2"]["scheme_id_per_rank"][0] == s["rtn_int2"]["scheme_id_per_rank"][1]
    # not vacuous: the compressed caches change the rollout (the first chunk reads no past)
    for name in ("rtn_int2", "qvg_int2"):
        p = s[name]["psnr_vs_bf16_per_chunk"]
        assert p[0] == 100.0 and max(p[1:]) < 100.0, (name, p)
    # and the saved 2-rank chunks against a single-process rollout made here
    saved = np.load(npz)
    _drop_kvforge()
    try:
        for name in ("bf16", "rtn_int2", "qvg_int2"):
            ref = _single(w, name, monkeypatch)
            assert saved[name].shape == ref.shape == (CHUNKS * 360, 192)
            assert np.array_equal(saved[name], ref), (name, float(np.abs(saved[name] - ref).max()))
    finally:
        _drop_kvforge()


@need_lib
@dist_ok
def test_two_ranks_mha_pre_pipeline_and_local_seeds(tmp_path):
    """The small preset's heads (one KV and one query head a rank), a scheme caching keys
    before RoPE (q and k before RoPE travel too, RoPE is applied by the cache), stable_int2
    (anchors, error feedback, outliers, mixed precision from a sensitivity table cut per rank),
    and --head-seeds local: those without k-means are the single-process rollout; qvg_int2
    no longer is (rank 1's head is seeded as head 0), which is what the seed offset is for."""
    w = _weights(tmp_path / "mha.safetensors", MHA, 4)
    pre = tmp_path / "rtn_pre.lua"
    pre.write_text("return { base = 'rtn_int4', name = 'rtn_pre', rope = { placement = 'pre', "
                   "sections = { 16, 24, 24 } } }\n")
    tables = tmp_path / "tables"
    tables.mkdir()
    rng = np.random.default_rng(5)
    (tables / "stable_int2.json").write_text(json.dumps({
        "format": "kvforge-sensitivity", "version": 1, "head_dim": 128, "kv_heads": 2, "layers": 2,
        "key": rng.random((2, 2, 128)).tolist(), "value": rng.random((2, 2, 128)).tolist()}))
    j = tmp_path / "sp.json"
    _torchrun(["--weights", w, "--schemes", f"rtn_int2,qvg_int2,stable_int2,{pre}", "--table-dir", str(tables),
               "--check", "--head-seeds", "local", "--json", str(j)], tmp_path, chunks=2)
    rep = json.loads(j.read_text())
    assert (rep["kv_heads_per_rank"], rep["q_heads_per_rank"]) == (1, 1)
    s = rep["schemes"]
    for name in ("bf16", "rtn_int2", "stable_int2", "rtn_pre"):
        assert s[name]["status"] == "ok" and s[name]["check"]["identical"], (name, s[name])
    assert max(s["rtn_pre"]["psnr_vs_bf16_per_chunk"][1:]) < 100.0
    m = s["stable_int2"]["per_rank"][1]["cache_memory"]
    assert m["channel_map"] > 0 and m["feedback"] > 0
    assert s["rtn_pre"]["per_rank"][0]["cache_memory"]["positions"] > 0
    assert s["qvg_int2"]["head_seeds"] == ["local", "local"]
    assert not s["qvg_int2"]["check"]["identical"] and s["qvg_int2"]["check"]["differing_values"] > 0


@need_lib
def test_rank_scheme_seeds_one_head_as_in_two(monkeypatch):
    """A cache of global KV head 1 alone, with rank_scheme's seed, packs and decodes that head
    as a cache of both heads does; with the scheme's own seed it does not."""
    monkeypatch.setenv("KVFORGE_LIB", LIB)
    monkeypatch.syspath_prepend(os.path.join(REPO, "python"))
    _drop_kvforge()
    try:
        import kvforge
        from sp_rollout import rank_scheme, seed_offset_exact
        g = torch.Generator().manual_seed(7)
        k = torch.randn(2, 300, 128, generator=g).to(torch.bfloat16)
        v = torch.randn(2, 300, 128, generator=g).to(torch.bfloat16)

        def decoded(scheme, heads, kk, vv):
            c = kvforge.QuantizedKVCache(scheme, 1, heads, 128, device="cpu")
            c.append(0, kk.contiguous(), vv.contiguous())
            return c.keys_values(0)

        K2, V2 = decoded("qvg_int2", 2, k, v)
        s1, exact = rank_scheme("qvg_int2", 1, 1)
        assert exact and s1.name == "qvg_int2" and s1.id != kvforge.Scheme("qvg_int2").id
        K1, V1 = decoded(s1, 1, k[1:], v[1:])
        assert torch.equal(K1[0], K2[1]) and torch.equal(V1[0], V2[1])
        K0, _ = decoded("qvg_int2", 1, k[1:], v[1:])
        assert not torch.equal(K0[0], K2[1])
        assert rank_scheme("rtn_int2", 1, 1)[0].id == kvforge.Scheme("rtn_int2").id   # no k-means: unchanged
    finally:
        _drop_kvforge()
    assert seed_offset_exact(2, 2) and seed_offset_exact(4, 4) and seed_offset_exact(3, 1)
    assert not seed_offset_exact(3, 3) and not seed_offset_exact(2, 3)


def test_rank_table_cuts_heads(tmp_path):
    from sp_rollout import rank_table
    t = {"format": "kvforge-sensitivity", "version": 1, "head_dim": 4, "kv_heads": 4, "layers": 2,
         "key": [[[h + 10 * layer] * 4 for h in range(4)] for layer in range(2)],
         "value": [[[-h] * 4 for h in range(4)] for _ in range(2)]}
    p = tmp_path / "s.json"
    p.write_text(json.dumps(t))
    out = json.loads(open(rank_table(str(p), 2, 2, str(tmp_path))).read())
    assert out["kv_heads"] == 2 and out["layers"] == 2
    assert out["key"] == [[[2] * 4, [3] * 4], [[12] * 4, [13] * 4]] and out["value"][1] == [[-2] * 4, [-3] * 4]
    with pytest.raises(ValueError):
        rank_table(str(p), 3, 2, str(tmp_path))


def test_sp_script_keeps_multicast_off():
    sh = os.path.join(REPO, "tools", "gpu", "sp.sh")
    assert subprocess.run(["bash", "-n", sh]).returncode == 0
    text = open(sh).read()
    export = next(line for line in text.splitlines() if line.startswith("export NCCL_NVLS_ENABLE"))
    for var in ("NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1", "NVSHMEM_DISABLE_NVLS=1"):
        assert var in export.split()
