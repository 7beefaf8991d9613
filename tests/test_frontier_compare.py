"""eval/frontier.py compare: the per-layer table and bars of several `kvforge eval` reports (CPU)."""
import json
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "eval"))
import frontier  # noqa: E402


def layer(i, top1, err, kmse, vmse):
    return {"layer": i, "top1_shift": top1, "attn_out_rel_err": err, "key_mse": kmse, "value_mse": vmse}


def report(compression, layers, overall, warnings=()):
    return {"data": "/x/hand.safetensors", "layers": layers, "warnings": list(warnings),
            "overall": dict(overall, compression=compression)}


# Two layers each (given out of order once); b's layer 1 had NaN inputs (null metrics).
HAND = [
    {"name": "a", "kind": "scheme", "report": report(8.0, [layer(0, 0.1, 0.02, 1e-3, 2e-3), layer(1, 0.3, 0.04, 3e-3, 4e-3)],
                                                     {"top1_shift": 0.2, "attn_out_rel_err": 0.03, "key_mse": 2e-3,
                                                      "value_mse": 3e-3})},
    {"name": "b|x", "kind": "scheme",
     "report": report(4.0, [layer(1, None, None, None, None), layer(0, 0.05, 0.01, 5e-4, 6e-4)],
                      {"top1_shift": None, "attn_out_rel_err": None, "key_mse": None, "value_mse": None},
                      ["the dump holds 3 NaN or infinite values"])},
    {"name": "peer1", "kind": "peer", "report": report(16 / 3, [layer(0, 0.2, 0.05, 1e-2, 1e-2), layer(1, 0.2, 0.05, 1e-2, 1e-2)],
                                                       {"top1_shift": 0.2, "attn_out_rel_err": 0.05, "key_mse": 1e-2,
                                                        "value_mse": 1e-2})},
]


def test_rows():
    rows = frontier.layer_rows(HAND)
    assert [(r[0], r[2]) for r in rows] == [("a", "0"), ("a", "1"), ("a", "overall"), ("b|x", "0"), ("b|x", "1"),
                                            ("b|x", "overall"), ("peer1", "0"), ("peer1", "1"), ("peer1", "overall")]
    assert rows[0][3] == 2.0 and rows[3][3] == 4.0 and rows[6][3] == 3.0
    assert rows[1][4] == {"top1_shift": 0.3, "attn_out_rel_err": 0.04, "key_mse": 3e-3, "value_mse": 4e-3}
    assert all(math.isnan(v) for v in rows[4][4].values())
    with pytest.raises(ValueError, match="kind"):
        frontier.layer_rows([{"name": "x", "kind": "other", "report": HAND[0]["report"]}])


def test_table():
    md = frontier.compare_table(HAND, "hand-made")
    lines = md.splitlines()
    assert lines[0] == "# hand-made"
    assert lines[2] == ("| entry | kind | layer | bits/value | top-1 shift | attention-output rel. error | key MSE "
                        "| value MSE |")
    assert lines[4] == "| a | scheme | 0 | 2.000 | 0.1000 | 2.0000e-02 | 1.0000e-03 | 2.0000e-03 |"
    assert lines[6] == "| a | scheme | **overall** | 2.000 | 0.2000 | 3.0000e-02 | 2.0000e-03 | 3.0000e-03 |"
    assert lines[8] == "| b\\|x | scheme | 1 | 4.000 | - | - | - | - |"
    assert lines[12] == "| peer1 | peer | **overall** | 3.000 | 0.2000 | 5.0000e-02 | 1.0000e-02 | 1.0000e-02 |"
    assert "- b|x: the dump holds 3 NaN or infinite values" in lines


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "c.png"
    drawn = frontier.compare_plot(HAND, str(png))
    assert list(drawn) == ["top1_shift", "attn_out_rel_err", "key_mse", "value_mse"]
    assert drawn["top1_shift"]["a"] == [0.1, 0.3, 0.2]
    assert drawn["key_mse"]["peer1"] == [1e-2, 1e-2, 1e-2]
    assert drawn["value_mse"]["b|x"][0] == 6e-4 and math.isnan(drawn["value_mse"]["b|x"][1])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10000


def test_cli(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "combined.json"
    path.write_text(json.dumps(HAND))
    md, png = tmp_path / "c.md", tmp_path / "c.png"
    assert frontier.main(["compare", str(path), "--png", str(png), "--md", str(md)]) == 0
    assert md.read_text().startswith("# kvforge eval, per layer on hand.safetensors\n")
    assert png.exists()
    path.write_text(json.dumps([{"name": "x", "kind": "scheme", "report": {}}]))
    with pytest.raises(ValueError, match="no report with 'overall'"):
        frontier.main(["compare", str(path), "--png", str(png), "--md", str(md)])
