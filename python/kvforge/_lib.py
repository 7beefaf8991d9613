"""Loading libkvforge with ctypes, its prototypes, and C errors as exceptions.

Where the library comes from, first match wins:

1. ``$KVFORGE_LIB``: a path to ``libkvforge.so`` (or a directory holding it);
2. the copy bundled inside the installed package (``kvforge/_lib/``), which
   ``pip install ./python`` makes from ``$KVFORGE_BUILD_DIR`` or ``../out/lib``;
3. ``out/lib/libkvforge.so`` of the source tree this package sits in
   (``python/kvforge/../../out/lib``: running from a checkout with
   ``PYTHONPATH=python``);
4. the dynamic loader's own search (``libkvforge.so.0``, then
   ``libkvforge.so``: ``LD_LIBRARY_PATH``, ``ldconfig``).

The library is loaded on first use, not at import, so ``import kvforge``
never fails for a missing library: the first call that needs it raises
:class:`LibraryNotFoundError` listing every place it looked.
"""
from __future__ import annotations

import ctypes
import os
import threading
from ctypes import (POINTER, Structure, c_char_p, c_double, c_int, c_int32, c_int64, c_size_t,
                    c_uint64, c_void_p)
from pathlib import Path

__all__ = ["KvforgeError", "LibraryNotFoundError", "lib", "check", "library_path", "status_codes"]

# Status codes: only KVF_OK is fixed here. Every other code's name and text come
# from the library (kvf_status_name / kvf_strerror; status_codes() lists them),
# so the binding cannot drift from include/kvforge.h.
KVF_OK = 0
_STATUS_SCAN = 1024  # codes 0, -1, ... are asked for until the library says KVF_UNKNOWN

KVF_DEVICE_CPU = -1

_LIB_NAMES = ("libkvforge.so", "libkvforge.so.0")


class KvforgeError(RuntimeError):
    """A kvforge C call failed.

    Attributes: ``status`` (the negative ``kvf_status`` code), ``status_name``
    (``"KVF_ESCHEME"``...), ``detail`` (``kvf_last_error()``: file:line: field
    for schemes, the CUDA call for GPU errors) and ``function`` (the C function).
    """

    def __init__(self, status: int, status_name: str, description: str, detail: str,
                 function: str = ""):
        self.status = status
        self.status_name = status_name
        self.description = description
        self.detail = detail
        self.function = function
        where = f"{function}: " if function else ""
        text = f"{where}{status_name} ({description})"
        if detail:
            text += f": {detail}"
        super().__init__(text)


class LibraryNotFoundError(KvforgeError, OSError):
    """libkvforge.so could not be found or loaded (see kvforge._lib for the search)."""

    def __init__(self, message: str):
        RuntimeError.__init__(self, message)
        self.status = 0
        self.status_name = "LIBRARY_NOT_FOUND"
        self.description = "libkvforge could not be loaded"
        self.detail = message
        self.function = ""


# ----------------------------------------------------------------- C structs


class KvfShape(Structure):
    _fields_ = [("n_tokens", c_int64), ("n_heads", c_int32), ("token_stride", c_int64),
                ("head_stride", c_int64)]


class KvfFootprint(Structure):
    _fields_ = [("packed_bytes", c_size_t), ("bf16_bytes", c_size_t), ("compression", c_double),
                ("bits_per_value", c_double)]


KVF_MAX_ROPE_SECTIONS = 4


class KvfSchemeInfo(Structure):
    """``kvf_scheme_info`` of include/kvforge.h (kvf_scheme_get_info)."""
    _fields_ = [
        ("head_dim", c_int),
        ("key_bits", c_int), ("value_bits", c_int),
        ("chunk_tokens", c_int), ("chunk_span", c_int), ("chunk_recent", c_int),
        ("chunk_sink", c_int),
        ("rope_placement", c_int),
        ("rope_axes", c_int),
        ("psac_rank", c_int),
        ("key_centroids", c_int),
        ("key_qsac_candidates", c_int),
        ("rope_layout", c_int),
        ("rope_sections", c_int * KVF_MAX_ROPE_SECTIONS),
        ("rope_theta", c_double),
        ("outliers", c_int * 2),
        ("mixed_channels", c_int * 2),
        ("anchor_every", c_int), ("anchor_bits", c_int),
        ("feedback_decay", c_double),
    ]


class KvfChunkStep(Structure):
    """``kvf_chunk_step`` of include/kvforge.h (kvf_chunk_policy)."""
    _fields_ = [("pack_first", c_int64), ("pack_chunks", c_int32), ("sink", c_int32),
                ("warm_first", c_int64), ("warm_chunks", c_int32), ("reserved", c_int32)]


# ------------------------------------------------------------- prototypes

_p_scheme = c_void_p
_p_ctx = c_void_p

# name: (restype, argtypes); each one must be exported
_PROTOTYPES = {
    "kvf_strerror": (c_char_p, [c_int]),
    "kvf_status_name": (c_char_p, [c_int]),
    "kvf_last_error": (c_char_p, []),
    "kvf_version": (c_char_p, []),
    "kvf_scheme_load": (c_int, [c_char_p, POINTER(c_void_p)]),
    "kvf_scheme_load_string": (c_int, [c_char_p, c_size_t, c_char_p, POINTER(c_void_p)]),
    "kvf_scheme_load_builtin": (c_int, [c_char_p, POINTER(c_void_p)]),
    "kvf_scheme_free": (None, [_p_scheme]),
    "kvf_scheme_name": (c_char_p, [_p_scheme]),
    "kvf_scheme_canonical": (c_char_p, [_p_scheme]),
    "kvf_scheme_hash": (c_uint64, [_p_scheme]),
    "kvf_scheme_id": (c_char_p, [_p_scheme]),
    "kvf_scheme_head_dim": (c_int, [_p_scheme]),
    "kvf_builtin_schemes": (POINTER(c_char_p), []),
    "kvf_packed_size": (c_int, [_p_scheme, c_int64, c_int32, POINTER(c_size_t)]),
    "kvf_footprint_of": (c_int, [_p_scheme, c_int64, c_int32, POINTER(KvfFootprint)]),
    "kvf_device_count": (c_int, [POINTER(c_int)]),
    "kvf_context_create": (c_int, [_p_scheme, c_int, POINTER(c_void_p)]),
    "kvf_context_create_from_image": (c_int, [c_char_p, c_void_p, c_size_t, c_int,
                                              POINTER(c_void_p)]),
    "kvf_context_destroy": (None, [_p_ctx]),
    "kvf_context_backend": (c_char_p, [_p_ctx]),
    "kvf_context_origin": (c_char_p, [_p_ctx]),
    "kvf_encode": (c_int, [_p_ctx, c_void_p, c_void_p, POINTER(KvfShape), c_void_p, c_void_p,
                           c_size_t, c_void_p]),
    "kvf_encode_warm": (c_int, [_p_ctx, c_void_p, c_void_p, POINTER(KvfShape), c_void_p, c_void_p,
                                c_size_t, c_int64, c_void_p, c_size_t, c_void_p]),
    "kvf_decode": (c_int, [_p_ctx, c_void_p, c_size_t, POINTER(KvfShape), c_void_p, c_void_p,
                           c_void_p, c_void_p]),
    "kvf_packed_check": (c_int, [_p_scheme, c_void_p, c_size_t, c_int64, c_int32]),
    "kvf_scheme_get_info": (c_int, [_p_scheme, POINTER(KvfSchemeInfo)]),
    "kvf_chunk_policy": (c_int, [_p_scheme, c_int64, POINTER(KvfChunkStep)]),
    "kvf_cache_dir": (c_int, [c_char_p, c_size_t]),
    "kvf_cache_clear": (c_int, []),
    "kvf_qstats_size": (c_int, [_p_scheme, c_int32, POINTER(c_size_t)]),
    "kvf_qstats_init": (c_int, [_p_ctx, c_void_p, c_size_t, c_int32, c_void_p]),
    "kvf_qstats_update": (c_int, [_p_ctx, c_void_p, c_size_t, c_void_p, POINTER(KvfShape),
                                  c_void_p]),
    "kvf_qstats_skipped": (c_int, [c_void_p, c_size_t, POINTER(c_uint64)]),
}


class _Library:
    """The loaded libkvforge with typed functions as attributes (tests may
    replace them with Python callables)."""

    def __init__(self, cdll: ctypes.CDLL, path: str):
        self._cdll = cdll
        self.path = path
        for name, (restype, argtypes) in _PROTOTYPES.items():
            try:
                fn = getattr(cdll, name)
            except AttributeError:
                raise LibraryNotFoundError(
                    f"{path} does not export {name}: an old or foreign libkvforge "
                    f"(rebuild it with `make`)") from None
            fn.restype = restype
            fn.argtypes = argtypes
            setattr(self, name, fn)


_lock = threading.Lock()
_lib: _Library | None = None


def _candidates() -> list[tuple[str, str]]:
    """(path or soname, where it came from), in search order."""
    out: list[tuple[str, str]] = []
    env = os.environ.get("KVFORGE_LIB")
    if env:
        p = Path(env)
        if p.is_dir():
            p = p / "libkvforge.so"
        out.append((str(p), "$KVFORGE_LIB"))
        return out  # an explicit choice is never second-guessed
    here = Path(__file__).resolve().parent
    out.append((str(here / "_lib" / "libkvforge.so"), "bundled in the package"))
    build = os.environ.get("KVFORGE_BUILD_DIR")
    if build:
        out.append((str(Path(build) / "libkvforge.so"), "$KVFORGE_BUILD_DIR"))
    out.append((str(here.parent.parent / "out" / "lib" / "libkvforge.so"), "source tree out/lib"))
    for name in reversed(_LIB_NAMES):
        out.append((name, "dynamic loader search"))
    return out


def _load() -> _Library:
    tried = []
    for cand, where in _candidates():
        is_path = os.sep in cand
        if is_path and not os.path.exists(cand):
            tried.append(f"  {cand} ({where}): no such file")
            continue
        try:
            cdll = ctypes.CDLL(cand)
        except OSError as e:
            tried.append(f"  {cand} ({where}): {e}")
            if where == "$KVFORGE_LIB":
                break
            continue
        path = cand if is_path else (_loaded_path(cand) or cand)
        return _Library(cdll, os.path.abspath(path) if is_path else path)
    raise LibraryNotFoundError(
        "libkvforge could not be loaded; tried:\n" + "\n".join(tried) +
        "\nBuild it with `make` (out/lib/libkvforge.so) and set KVFORGE_LIB to its path, or "
        "reinstall the package after building (pip install ./python copies out/lib).")


def _loaded_path(soname: str) -> str | None:
    """The file the dynamic loader picked for a soname (Linux: /proc/self/maps)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                fields = line.split()
                if len(fields) >= 6 and os.path.basename(fields[-1]).startswith("libkvforge.so"):
                    return fields[-1]
    except OSError:
        pass
    return None


def lib() -> _Library:
    """The loaded library (loaded on first call)."""
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                _lib = _load()
    return _lib


def library_path() -> str:
    """Path of the libkvforge that is loaded (loading it if needed)."""
    return lib().path


def _s(b: bytes | None) -> str:
    return b.decode("utf-8", "replace") if b else ""


def error_for(status: int, function: str = "") -> KvforgeError:
    L = lib()
    return KvforgeError(status, _s(L.kvf_status_name(status)), _s(L.kvf_strerror(status)),
                        _s(L.kvf_last_error()), function)


def status_codes() -> dict:
    """{"KVF_OK": 0, "KVF_EINVAL": -1, ...}: every status the loaded library names,
    asked of it (kvf_status_name over 0, -1, -2, ... up to the first unknown code)."""
    global _status_codes
    if _status_codes is None:
        L = lib()
        out = {}
        for code in range(0, -_STATUS_SCAN, -1):
            name = _s(L.kvf_status_name(code))
            if not name or name == "KVF_UNKNOWN":
                break
            out[name] = code
        _status_codes = out
    return dict(_status_codes)


def status_descriptions() -> dict:
    """{code: kvf_strerror(code)} for every code of :func:`status_codes`."""
    L = lib()
    return {code: _s(L.kvf_strerror(code)) for code in status_codes().values()}


_status_codes = None


def __getattr__(name):
    """``_lib.KVF_EINVAL`` and so on, looked up in the library (module __getattr__)."""
    if name.startswith("KVF_E"):
        codes = status_codes()
        if name in codes:
            return codes[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check(status: int, function: str = "") -> None:
    """Raise KvforgeError for a negative status (reading kvf_last_error at once)."""
    if status != KVF_OK:
        raise error_for(status, function)


def cstr(b: bytes | None) -> str:
    return _s(b)
