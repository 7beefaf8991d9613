"""eval/frontier.py: the Pareto front, the plot, and the driver over `kvforge eval`."""
import json
import os
import subprocess
import sys

import pytest

import fakes
import qvg_peer
from peerkv import ChunkPolicy
from test_peer import KVFORGE

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import frontier  # noqa: E402


def entry(name, kind, compression, top1, err):
    return {"name": name, "kind": kind, "report": {"data": "hand.safetensors", "overall": {
        "compression": compression, "top1_shift": top1, "attn_out_rel_err": err}}}


# bits per value = 16 / compression: 2.0, 3.0, 4.0, 4.0, 5.0, 8.0
HAND = [
    entry("a", "scheme", 8.0, 0.40, 0.10),
    entry("b", "scheme", 16 / 3, 0.30, 0.20),   # beats nothing on error: a has less at fewer bits
    entry("c", "scheme", 4.0, 0.20, 0.05),
    entry("c_dup", "scheme", 4.0, 0.20, 0.05),  # equal to c on both: c (the first) stays
    entry("d", "scheme", 3.2, 0.25, 0.04),      # more bits than c, worse top-1: off that front
    entry("e", "scheme", 2.0, 0.10, None),      # no error value: only in the top-1 panel
    entry("peer1", "peer", 16 / 3, 0.05, 0.01), # would beat b, c, d: never on kvforge's front
    entry("bad", "scheme", None, 0.0, 0.0),     # no compression: no point
]


def test_bits_and_points():
    assert frontier.bits_per_value(HAND[0]["report"]) == 2.0
    pts = frontier.points(HAND, "attn_out_rel_err")
    assert [p[0] for p in pts] == ["a", "b", "c", "c_dup", "d", "peer1"]
    with pytest.raises(ValueError, match="kind"):
        frontier.points([entry("x", "other", 1.0, 0.1, 0.1)], "top1_shift")


def test_held_bytes():
    """--bytes held: x from compression_held; an entry without it (a peer) has no point."""
    held = [entry("s", "scheme", 8.0, 0.4, 0.1), entry("p", "peer", 8.0, 0.3, 0.1)]
    held[0]["report"]["overall"]["compression_held"] = 2.0
    assert frontier.bits_per_value(held[0]["report"], "held") == 8.0
    assert [(p[0], p[2]) for p in frontier.points(held, "top1_shift", "held")] == [("s", 8.0)]
    assert [(p[0], p[2]) for p in frontier.points(held, "top1_shift")] == [("s", 2.0), ("p", 2.0)]


def test_pareto_front():
    ours = lambda m: [p for p in frontier.points(HAND, m) if p[1] == "scheme"]  # noqa: E731
    top1 = frontier.pareto_front(ours("top1_shift"))
    assert [p[0] for p in top1] == ["a", "b", "c", "e"]
    err = frontier.pareto_front(ours("attn_out_rel_err"))
    assert [p[0] for p in err] == ["a", "c", "d"]
    assert frontier.pareto_front([]) == []


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "f.png"
    fronts = frontier.plot(HAND, str(png), "hand-made")
    assert fronts == {"top1_shift": ["a", "b", "c", "e"], "attn_out_rel_err": ["a", "c", "d"]}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10000


def test_driver_over_kvforge(tmp_path):
    """run: `kvforge eval` over two schemes and a peer's recon file, then the plot's CLI."""
    if not os.path.exists(KVFORGE):
        pytest.skip(f"{KVFORGE} is not built (make)")
    dump, recon = str(tmp_path / "d.safetensors"), str(tmp_path / "r.safetensors")
    fakes.write_dump(dump, layers=1, chunks=3)
    qvg_peer.run(dump, fakes.RtnCodec(), ChunkPolicy(), recon, "rtn-fake-peer", "test")
    entries = frontier.run(KVFORGE, dump, ["rtn_int2", "rtn_int4"], [recon], threads=2)
    assert [(e["name"], e["kind"]) for e in entries] == [("rtn_int2", "scheme"), ("rtn_int4", "scheme"),
                                                         ("rtn-fake-peer", "peer")]
    assert entries[2]["report"]["kind"] == "peer"
    path = tmp_path / "combined.json"
    path.write_text(json.dumps(entries))
    if pytest.importorskip("matplotlib"):
        assert frontier.main(["plot", str(path), "--png", str(tmp_path / "p.png")]) == 0
        assert (tmp_path / "p.png").exists()
    with pytest.raises(RuntimeError, match="exit 1"):
        frontier.run(KVFORGE, dump, [], [dump])  # a dump is not a recon file


def test_peer_bench_on_the_cpu(tmp_path):
    """bench/peer_bench.py's CPU mode (what tools/gpu/peer.sh runs with KVF_PEER_GPU=0): kvforge's
    schemes encode and decode through the binding and the JSON says so; the peer is left out."""
    lib = os.path.join(os.path.dirname(os.path.dirname(KVFORGE)), "lib", "libkvforge.so")
    if not os.path.exists(lib):
        pytest.skip(f"{lib} is not built (make)")
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
    env = dict(os.environ, KVFORGE_LIB=lib, LD_LIBRARY_PATH=os.path.dirname(lib),
               PYTHONPATH=os.pathsep.join([os.path.join(root, "python"), os.path.join(root, "eval", "peer")]))
    out = tmp_path / "bench.json"
    p = subprocess.run([sys.executable, os.path.join(root, "bench", "peer_bench.py"), "--device", "cpu",
                        "--tokens", "256", "--heads", "2", "--reps", "1", "--warmup", "1", "--peers", "none",
                        "--json", str(out)], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    report = json.loads(out.read_text())
    assert "rtn_int2" in json.dumps(report)


def test_driver_keeps_what_it_scored(tmp_path):
    """run --out: the combined JSON holds every entry scored so far, so a run cut short keeps them."""
    if not os.path.exists(KVFORGE):
        pytest.skip(f"{KVFORGE} is not built (make)")
    dump, out = str(tmp_path / "d.safetensors"), str(tmp_path / "c.json")
    fakes.write_dump(dump, layers=1, chunks=2)
    with pytest.raises(RuntimeError, match="exit"):
        frontier.run(KVFORGE, dump, ["rtn_int2", "no_such_scheme"], [], threads=2, out=out)
    assert [e["name"] for e in json.loads(open(out).read())] == ["rtn_int2"]
