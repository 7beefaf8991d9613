#!/usr/bin/env python3
"""Run QVG (the peer) over a kvforge KV dump and write what its cache returns, as a recon file.

For every layer of the dump, the chunks stream through the peer's cache
(peerkv.LayerStore: QVG's chunk policy, its compress on each span the policy
lets go, its decompress on every read). At every step c >= 1 (chunk c's queries
attend) the file records the history the cache returns for chunks 0..c-1 and
which of them came from compressed storage; at the end of the stream, the bytes
the cache stores, counted from the peer's tensors. `kvforge eval --peer
RECON --data DUMP` then scores it with the same streaming and metric code as
kvforge's own schemes (docs/QUALITY.md "Scoring a peer's cache").

    python3 eval/peer/qvg_peer.py --data DUMP.safetensors --config qvg-peer_int2_g64 \\
        --out RECON.safetensors [--quant-factor 1 --keep-recent 0 --sink-keep 0] [--json SUMMARY.json]

The keys given to the peer are the dump's post-RoPE `k` (as kvforge's qvg_int2
caches them). Without torch, triton, quant-videogen or a CUDA device it prints
why and exits with status 77 (skipped), writing nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stio  # noqa: E402
from peerkv import ChunkPolicy, LayerStore  # noqa: E402

SKIP = 77
RECON_FORMAT = "kvforge-recon 1"


class Dump:
    """The parts of a kvforge dump the harness reads (the C reader validates the rest)."""

    def __init__(self, path: str):
        self.file = stio.SafetensorsFile(path)
        m = self.file.metadata
        try:
            self.layers, self.chunks = int(m["layers"]), int(m["chunks"])
            self.kv_heads, self.head_dim = int(m["kv_heads"]), int(m["head_dim"])
            self.tokens = int(m["tokens_per_chunk"])
        except (KeyError, ValueError) as e:
            raise ValueError(f"{path}: not a kvforge KV dump (metadata: {e})") from None
        for l in range(self.layers):
            for c in range(self.chunks):
                for r in ("k", "v"):
                    name = f"l{l}.c{c}.{r}"
                    if name not in self.file or self.file.dtype(name) != "BF16" or \
                            tuple(self.file.entries[name]["shape"]) != (self.kv_heads, self.tokens, self.head_dim):
                        raise ValueError(f"{path}: tensor {name} missing or not BF16 "
                                         f"[{self.kv_heads}, {self.tokens}, {self.head_dim}]")

    def kv(self, layer: int, chunk: int):
        return self.file.get(f"l{layer}.c{chunk}.k"), self.file.get(f"l{layer}.c{chunk}.v")


def run(dump_path: str, codec, policy: ChunkPolicy, out_path: str, name: str, peer_text: str,
        layers=None, log=None) -> dict:
    """Stream the dump through the peer, write the recon file; returns a summary."""
    d = Dump(dump_path)
    layers = list(range(d.layers)) if layers is None else list(layers)
    if layers != list(range(d.layers)):
        raise ValueError("a recon file covers every layer of its dump")
    tensors, per_layer, order = [], [], []
    t0 = time.perf_counter()
    calls = {"compress": 0, "decompress": 0}
    for l in layers:
        store = LayerStore(codec, policy)
        for c in range(d.chunks):
            if c > 0:
                calls["compress"] += len(store.apply_policy(c))
                hist = store.read()
                calls["decompress"] += len(store.spans)  # read() decodes every span once
                k = np.concatenate([codec.to_bits(h[0]) for h in hist], axis=1)
                v = np.concatenate([codec.to_bits(h[1]) for h in hist], axis=1)
                flags = np.array([1 if h[2] else 0 for h in hist], dtype=np.uint8)
                want = (d.kv_heads, c * d.tokens, d.head_dim)
                if k.shape != want or v.shape != want:
                    raise RuntimeError(f"layer {l}, step {c}: the peer returned {k.shape} / {v.shape}, expected {want}")
                tensors += [(f"l{l}.s{c}.k", k, "BF16"), (f"l{l}.s{c}.v", v, "BF16"),
                            (f"l{l}.s{c}.packed", flags, "U8")]
            kb, vb = d.kv(l, c)
            store.append(codec.from_bits(kb), codec.from_bits(vb))
        calls["compress"] += len(store.apply_policy(d.chunks))  # the end of the stream
        parts = store.stored_bytes()
        for p in parts:
            if p not in order:
                order.append(p)
        held = sum(codec.held_bytes(s[x]) for s in store.spans for x in ("k", "v")) \
            if hasattr(codec, "held_bytes") else None
        per_layer.append({"layer": l, "parts": parts, "bf16_bytes": store.bf16_bytes(), "held_span_bytes": held,
                          "spans": [(s["a"], s["b"]) for s in store.spans]})
        if log:
            log(f"layer {l}: {len(store.spans)} spans compressed, stored {sum(parts.values())} B "
                f"of {store.bf16_bytes()} B BF16")
    for pl in per_layer:
        tensors.append((f"l{pl['layer']}.stored_bytes",
                        np.array([pl["parts"].get(p, 0) for p in order], dtype=np.int64), "I64"))
    meta = {"format": RECON_FORMAT, "layers": d.layers, "chunks": d.chunks, "kv_heads": d.kv_heads,
            "head_dim": d.head_dim, "tokens_per_chunk": d.tokens, **policy.as_kvforge(), "name": name,
            "peer": peer_text, "dump": dump_path, "stored_bytes_parts": ",".join(order)}
    stio.write(out_path, tensors, meta)
    stored = sum(sum(pl["parts"].values()) for pl in per_layer)
    bf16 = sum(pl["bf16_bytes"] for pl in per_layer)
    return {"name": name, "peer": peer_text, "dump": dump_path, "recon": out_path,
            "policy": policy.as_kvforge(), "seconds": time.perf_counter() - t0, "calls": calls,
            "stored_bytes": stored, "bf16_bytes": bf16, "compression": bf16 / stored if stored else None,
            "parts": {p: sum(pl["parts"].get(p, 0) for pl in per_layer) for p in order}, "layers": per_layer}


def main(argv=None) -> int:
    import qvg_codec
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True, help="kvforge KV dump (safetensors)")
    ap.add_argument("--config", default="qvg-peer_int2_g64", choices=sorted(qvg_codec.CONFIGS))
    ap.add_argument("--out", required=True, help="recon file to write")
    ap.add_argument("--quant-factor", type=int, default=1, help="chunks per compressed span (QVG quant_factor)")
    ap.add_argument("--keep-recent", type=int, default=0, help="newest finished chunks kept in BF16")
    ap.add_argument("--sink-keep", type=int, default=0, help="leading chunks never compressed")
    ap.add_argument("--seed", type=int, default=qvg_codec.DEFAULT_SEED, help="k-means RNG seed per span")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", help="also write a summary (bytes by part, spans, seconds) here")
    a = ap.parse_args(argv)
    why = qvg_codec.unavailable(a.device)
    if why:
        print(f"qvg_peer: skipped: {why}", flush=True)
        return SKIP
    policy = ChunkPolicy(a.quant_factor, a.keep_recent, a.sink_keep)
    codec = qvg_codec.QvgCodec(a.config, a.device, a.seed)
    text = (f"{codec.describe()}; chunk policy quant_factor {policy.quant_factor}, keep_recent "
            f"{policy.keep_recent}, sink_keep {policy.sink_keep}; k-means seed {a.seed}; post-RoPE keys")
    s = run(a.data, codec, policy, a.out, a.config, text, log=lambda m: print(f"qvg_peer: {m}", flush=True))
    print(f"qvg_peer: {a.config}: {s['recon']}: compression {s['compression']:.3f}x "
          f"({s['stored_bytes']} of {s['bf16_bytes']} B; {s['parts']}), {s['seconds']:.1f} s", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
