"""QVG's own compress and decompress (PyPI quant-videogen 0.1.0) as a peerkv codec.

The peer runs as its integrations run it: `compress_kv_cache(k, v, quant_type,
QuantizeConfig, get_quantize_fn(...))` on a span [1, H, S, d] in BF16 on the
GPU, with `info = {"output_dtype", "quant_config"}` added to each state, and
`uncompress_kv_cache(k_state, v_state)` on every read (LingBot-v2's
wan/image2video.py _quantize_kv_cache, quant_videogen.kv_cache.ChunkedKVCache).
k-means starts from random tokens (torch.randint); as LingBot-v2 does, each
compression runs under a forked RNG seeded with a fixed seed (1234).

Stored bytes are counted from the state's real tensors (numel x element size):
residual codes, scales (FP8), zeros (asymmetric only), cluster ids (uint8) and
centroids (per stage), and any other tensor the state holds.

Configurations (CONFIGS): the shipped default of its scripts (1 stage, group
64, 256 centroids, 2 k-means iterations, symmetric INT2), its asymmetric option,
and QVG-Pro (4 stages, group 16, 5 iterations).
"""
from __future__ import annotations

import importlib.util

from peerkv import count_state

QUANT_TYPE = "triton-nstages-kmeans-int2"
CONFIGS = {
    "qvg-peer_int2_g64": dict(num_prq_stages=1, quant_block_size=64, kmeans_max_iters=2, asymmetric=False),
    "qvg-peer_int2_g64_asym": dict(num_prq_stages=1, quant_block_size=64, kmeans_max_iters=2, asymmetric=True),
    "qvg-peer_pro_int2_g16": dict(num_prq_stages=4, quant_block_size=16, kmeans_max_iters=5, asymmetric=False),
}
CENTROIDS = 256
# Parts of a QVG state, named as kvforge's reports name them.
PARTS = {"residual_quant": "codes", "scales": "scales", "zeros": "zeros", "cluster_ids_list": "cluster_ids",
         "centroids_list": "centroids", "residual": "clip_residual", "scale_factor": "clip_scale"}
DEFAULT_SEED = 1234


def unavailable(device: str = "cuda") -> str | None:
    """Why the peer cannot run here (None when it can): torch, CUDA, triton, quant_videogen."""
    for mod in ("torch", "triton", "quant_videogen"):
        if importlib.util.find_spec(mod) is None:
            return (f"python module {mod} is not installed (the peer needs torch, triton and quant-videogen "
                    f"with its imports: einops, termcolor, loguru)")
    try:
        import_peer()
    except Exception as e:  # a missing dependency, or a torch/triton it cannot use
        return f"import quant_videogen failed: {type(e).__name__}: {e}"
    import torch
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        return "no CUDA device (QVG's kernels are Triton, GPU only)"
    return None


IMPORT_NOTE = None  # set when the import needed the autotune-key shim below


def import_peer():
    """import quant_videogen. Its @triton.autotune keys name a few values that are not
    kernel arguments (key=["N", "D"] on kernels without N); Triton before the change
    "Reject autotune name lists that are not kernel arguments" (2026) ignored such names,
    later ones refuse them at import. Then the import is done again with those names
    left out of the keys, which is what the older Triton did with them."""
    global IMPORT_NOTE
    import sys
    try:
        import quant_videogen.compress  # noqa: F401  (its own imports: einops, termcolor, loguru)
        return
    except ValueError as e:
        if "not kernel arguments" not in str(e):
            raise
    for m in [m for m in sys.modules if m == "quant_videogen" or m.startswith("quant_videogen.")]:
        del sys.modules[m]
    import triton
    orig = triton.autotune

    def autotune(configs, key, *args, **kw):
        def apply(fn):
            names = getattr(fn, "arg_names", None)
            keep = list(key) if names is None else [k for k in key if k in names]
            return orig(configs, keep, *args, **kw)(fn)
        return apply

    triton.autotune = autotune
    try:
        import quant_videogen.compress  # noqa: F401,F811
    finally:
        triton.autotune = orig
    IMPORT_NOTE = (f"triton {triton.__version__}: autotune keys that are not kernel arguments left out, "
                   f"as older Triton did")


def describe(config: str) -> str:
    c = CONFIGS[config]
    return (f"quant-videogen {_version()} {QUANT_TYPE}: {c['num_prq_stages']} stage(s), {CENTROIDS} centroids, "
            f"group {c['quant_block_size']}, {c['kmeans_max_iters']} k-means iterations, "
            f"{'asymmetric' if c['asymmetric'] else 'symmetric'}" + (f" ({IMPORT_NOTE})" if IMPORT_NOTE else ""))


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("quant-videogen")
    except Exception:  # installed with --target: no metadata on the path
        return "0.1.0"


class QvgCodec:
    """peerkv codec over quant_videogen; native arrays are torch.bfloat16 [H, S, d] on `device`."""

    def __init__(self, config: str, device: str = "cuda", seed: int = DEFAULT_SEED):
        if config not in CONFIGS:
            raise ValueError(f"unknown QVG configuration {config!r} (known: {', '.join(CONFIGS)})")
        why = unavailable(device)
        if why:
            raise RuntimeError(why)
        import torch
        import_peer()
        from quant_videogen.compress import compress_kv_cache, get_quantize_fn
        from quant_videogen.sim.quant.quantize_config import QuantizeConfig
        from quant_videogen.uncompress import uncompress_kv_cache
        self.torch = torch
        self.name = config
        self.device = torch.device(device)
        self.seed = seed
        self.cfg = QuantizeConfig(quant_type=QUANT_TYPE, cache_num_k_centroids=CENTROIDS,
                                  cache_num_v_centroids=CENTROIDS, **CONFIGS[config])
        self._compress, self._uncompress = compress_kv_cache, uncompress_kv_cache
        self._quantize_fn = get_quantize_fn(self.cfg.quant_type, self.cfg)

    def describe(self) -> str:
        return describe(self.name)

    # ---------------------------------------------------------------- arrays
    def native(self, x):
        """A model's tensor [H, S, d] as this codec keeps it: BF16, contiguous, on the device."""
        return x.detach().to(device=self.device, dtype=self.torch.bfloat16).contiguous()

    def from_bits(self, bits):
        import numpy as np
        t = self.torch.from_numpy(np.array(bits, dtype=np.uint16).view(np.int16))
        return t.view(self.torch.bfloat16).to(self.device)

    def to_bits(self, x):
        import numpy as np
        return x.contiguous().view(self.torch.int16).cpu().numpy().view(np.uint16)

    def cat(self, xs):
        return xs[0] if len(xs) == 1 else self.torch.cat(xs, dim=1)

    def chunk_bytes(self, x) -> int:
        return int(x.numel()) * int(x.element_size())

    # ----------------------------------------------------------------- codec
    def compress(self, k, v, seeded: bool = True):
        """QVG's states of K and V [H, S, d]. seeded: under a forked RNG seeded with self.seed
        (as LingBot-v2); False draws k-means' initial tokens from the global RNG (timing)."""
        torch = self.torch
        k4, v4 = k.unsqueeze(0).contiguous(), v.unsqueeze(0).contiguous()
        devices = [self.device] if self.device.type == "cuda" else []
        if not seeded:
            with torch.no_grad():
                kq, vq = self._compress(k4, v4, self.cfg.quant_type, self.cfg, self._quantize_fn)
            return self._info(k, kq, vq)
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(self.seed)
            kq, vq = self._compress(k4, v4, self.cfg.quant_type, self.cfg, self._quantize_fn)
        return self._info(k, kq, vq)

    def _info(self, k, kq, vq):
        if not (isinstance(kq, dict) and isinstance(vq, dict)):
            raise RuntimeError(f"{self.cfg.quant_type}: compress_kv_cache returned no packed state")
        info = {"output_dtype": k.dtype, "quant_config": self.cfg}
        kq["info"] = info
        vq["info"] = info
        return kq, vq

    def decompress(self, sk, sv):
        with self.torch.no_grad():
            k, v = self._uncompress(sk, sv)
        return k[0], v[0]

    def state_bytes(self, state) -> dict:
        return count_state(state, PARTS)

    def held_bytes(self, state) -> int:
        """Bytes of the distinct storages behind a state's tensors (what the GPU holds;
        more than state_bytes if a tensor were a view into a larger buffer)."""
        seen, total = set(), 0

        def walk(x):
            nonlocal total
            if isinstance(x, (list, tuple)):
                for y in x:
                    walk(y)
            elif hasattr(x, "untyped_storage"):
                s = x.untyped_storage()
                if s.data_ptr() not in seen:
                    seen.add(s.data_ptr())
                    total += s.nbytes()
        for key, x in state.items():
            if key != "info":
                walk(x)
        return total
