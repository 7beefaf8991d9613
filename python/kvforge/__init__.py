"""kvforge: KV-cache quantization for video world models, from Python.

A ctypes binding of libkvforge (no compiler step): schemes, contexts (CPU
reference or CUDA with JIT-compiled kernels), encode/decode of numpy arrays and
torch tensors, and :class:`QuantizedKVCache` for chunked autoregressive
generation, and attention over a cached layer a block at a time
(:func:`cache_attention`, ``QuantizedKVCache.attention``). See python/README.md. With torch: ``kvforge.ops`` (custom ops for
torch.compile and CUDA graphs), ``kvforge.dump`` (Q/K/V dumps for `kvforge
eval`), ``kvforge.diffusers`` (the cache in a diffusers transformer).
"""
from ._lib import KvforgeError, LibraryNotFoundError, library_path, status_codes
from .attention import cache_attention, merge_attention
from .cache import QuantizedKVCache
from .context import Context, device_count
from .scheme import Scheme, SchemeInfo, builtin_schemes, load_scheme

__version__ = "0.2.0"

__all__ = [
    "KvforgeError", "LibraryNotFoundError", "library_path", "status_codes", "version", "QuantizedKVCache",
    "cache_attention", "merge_attention",
    "Context", "device_count", "Scheme", "SchemeInfo", "builtin_schemes", "load_scheme",
    "cache_dir", "cache_clear", "float32_to_bf16_bits", "bf16_bits_to_float32",
]


def version() -> str:
    """Version of the loaded libkvforge (kvf_version)."""
    from ._lib import cstr, lib
    return cstr(lib().kvf_version())


def cache_dir():
    """Directory of the JIT disk cache, or None when it is off."""
    from ctypes import create_string_buffer
    from ._lib import check, lib
    buf = create_string_buffer(4096)
    check(lib().kvf_cache_dir(buf, len(buf)), "kvf_cache_dir")
    return buf.value.decode() or None


def cache_clear() -> None:
    """Remove every entry of the JIT disk cache."""
    from ._lib import check, lib
    check(lib().kvf_cache_clear(), "kvf_cache_clear")


def float32_to_bf16_bits(x):
    """float32 numpy array -> uint16 BF16 bits (round to nearest even)."""
    from ._bf16 import float32_to_bf16_bits as f
    return f(x)


def bf16_bits_to_float32(x):
    """uint16 BF16 bits -> float32 numpy array."""
    from ._bf16 import bf16_bits_to_float32 as f
    return f(x)
