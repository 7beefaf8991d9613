"""Arrays in and out: numpy (CPU reference) and torch (CPU or CUDA) behind one interface.

A backend turns the caller's K, V, Q, positions and buffers into what the C API
takes (a pointer plus a kvf_shape with strides), checking dtype, shape, the
contiguity of the last dimension and the device, and allocates outputs.

Layouts: ``"hnd"`` is ``[H, N, d]`` (also ``[1, H, N, d]``, torch SDPA's
``[B=1, H, N, d]``); ``"nhd"`` is ``[N, H, d]`` (also ``[1, N, H, d]``,
flash-attn's). Both go to C without a copy when the last dimension is
contiguous; the other strides are free on the CPU. On a GPU the strides must
be multiples of 8 elements and the data 16-byte aligned: a tensor that is not
(and any tensor with a zero or negative stride) is copied to a contiguous one
first. A last dimension that is not contiguous is an error, not a copy: it
usually means a transposed tensor was passed by mistake.
"""
from __future__ import annotations

from ctypes import c_void_p

from ._lib import KvfShape

LAYOUTS = ("hnd", "nhd")


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be 'hnd' ([H, N, d]) or 'nhd' ([N, H, d]), got {layout!r}")
    return layout


class Arg:
    """A tensor argument resolved for C: data pointer, heads, tokens, strides (elements)."""
    __slots__ = ("ptr", "n_heads", "n_tokens", "token_stride", "head_stride", "obj", "layout")

    def __init__(self, ptr, n_heads, n_tokens, token_stride, head_stride, obj, layout):
        self.ptr = ptr
        self.n_heads = n_heads
        self.n_tokens = n_tokens
        self.token_stride = token_stride
        self.head_stride = head_stride
        self.obj = obj  # keeps the memory alive (and is what a copy produced)
        self.layout = layout

    def hnd_view(self):
        """obj seen as [H, N, d] (a view, no copy)."""
        x = self.obj
        if x.ndim == 4:
            x = x[0]
        return x if self.layout == "hnd" else x.transpose(0, 1) if hasattr(x, "data_ptr") \
            else x.transpose(1, 0, 2)

    def shape(self) -> KvfShape:
        return KvfShape(self.n_tokens, self.n_heads, self.token_stride, self.head_stride)


def _dims(name, shape, layout, head_dim, n_heads, heads_multiple_of):
    """(H, N, axis of H, axis of N) of a 3-D or batch-1 4-D shape, checked."""
    shape = tuple(int(s) for s in shape)
    what = "[H, N, d]" if layout == "hnd" else "[N, H, d]"
    if len(shape) == 4:
        if shape[0] != 1:
            raise ValueError(f"{name}: a 4-D tensor must have batch 1 ([1, ...]), got shape "
                             f"{shape}; pass one batch element at a time")
        off = 1
    elif len(shape) == 3:
        off = 0
    else:
        raise ValueError(f"{name}: expected a 3-D {what} tensor (or [1, ...]), got shape {shape}")
    h_ax, n_ax = (off, off + 1) if layout == "hnd" else (off + 1, off)
    H, N, d = shape[h_ax], shape[n_ax], shape[off + 2]
    if d != head_dim:
        raise ValueError(f"{name}: last dimension is {d}, the scheme's head_dim is {head_dim} "
                         f"(shape {shape}, layout {layout!r} = {what})")
    if n_heads is not None and H != n_heads:
        other = "nhd" if layout == "hnd" else "hnd"
        raise ValueError(f"{name}: {H} heads in shape {shape} (layout {layout!r} = {what}), "
                         f"expected {n_heads}; is the layout {other!r}?")
    if heads_multiple_of is not None and (H < 1 or H % heads_multiple_of):
        raise ValueError(f"{name}: {H} query heads in shape {shape} is not a multiple of the "
                         f"{heads_multiple_of} KV heads (grouped-query attention needs Hq = g * Hkv)")
    if N < 1:
        raise ValueError(f"{name}: no tokens (shape {shape})")
    return H, N, h_ax, n_ax, off + 2


def _needs_copy(gpu, ptr, strides, extents):
    for s, e in zip(strides, extents):
        if e > 1 and s <= 0:
            return True
    if gpu:
        if ptr % 16:
            return True
        if any(s % 8 for s, e in zip(strides, extents) if e > 1):
            return True
    return False


# ---------------------------------------------------------------- numpy


class NumpyBackend:
    """Host numpy arrays through the CPU reference. BF16 is uint16 bits; float32 is
    converted (round to nearest even)."""
    kind = "numpy"
    is_gpu = False
    device_index = -1

    def __init__(self):
        import numpy as np
        self.np = np

    def __repr__(self):
        return "numpy (CPU reference)"

    def stream(self):
        return None

    def kv(self, x, name, layout, head_dim, n_heads=None, heads_multiple_of=None) -> Arg:
        np = self.np
        if not isinstance(x, np.ndarray):
            hint = " (a torch tensor: build the cache or context with device=... for torch)" \
                if type(x).__module__.startswith("torch") else ""
            raise TypeError(f"{name}: expected a numpy array, got {type(x).__name__}{hint}")
        if x.dtype == np.float32:
            from ._bf16 import float32_to_bf16_bits
            x = float32_to_bf16_bits(x)
        elif x.dtype != np.uint16:
            raise TypeError(f"{name}: numpy dtype must be uint16 (BF16 bits) or float32 "
                            f"(converted to BF16), got {x.dtype}")
        H, N, h_ax, n_ax, d_ax = _dims(name, x.shape, layout, head_dim, n_heads, heads_multiple_of)
        if any(s % x.itemsize for s in x.strides):
            x = np.ascontiguousarray(x)
        st = [s // x.itemsize for s in x.strides]
        if head_dim > 1 and st[d_ax] != 1:
            raise ValueError(f"{name}: the last dimension (head_dim) must be contiguous (stride 1), "
                             f"got strides {tuple(st)} elements; use np.ascontiguousarray({name})")
        if _needs_copy(False, x.ctypes.data, (st[n_ax], st[h_ax]), (N, H)):
            x = np.ascontiguousarray(x)
            st = [s // x.itemsize for s in x.strides]
        return Arg(x.ctypes.data, H, N, st[n_ax], st[h_ax], x, layout)

    def positions(self, p, n_tokens, n_axes, name="positions"):
        np = self.np
        if not isinstance(p, np.ndarray):
            raise TypeError(f"{name}: expected a numpy int32 array [N, {n_axes}], got {type(p).__name__}")
        if p.dtype.kind not in "iu":
            raise TypeError(f"{name}: must be an integer array (int32), got {p.dtype}")
        if p.ndim == 1 and n_axes == 1:
            p = p.reshape(-1, 1)
        if p.shape != (n_tokens, n_axes):
            raise ValueError(f"{name}: expected shape ({n_tokens}, {n_axes}) [N, axes], got {p.shape}")
        if p.dtype != np.int32:
            _check_int32(name, p, int(p.min()) if p.size else 0, int(p.max()) if p.size else 0)
            p = p.astype(np.int32)
        return np.ascontiguousarray(p)

    def ptr(self, a):
        return a.ctypes.data if a is not None else None

    def nonfinite(self, x):
        """(count, first index, value) of NaN/Inf elements of BF16 bits or float32, or None."""
        np = self.np
        if x.dtype == np.uint16:
            bad = (x & 0x7F80) == 0x7F80
        else:
            bad = ~np.isfinite(x)
        n = int(np.count_nonzero(bad))
        if not n:
            return None
        first = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), x.shape))
        val = x[first]
        if x.dtype == np.uint16:
            from ._bf16 import bf16_bits_to_float32
            val = bf16_bits_to_float32(np.asarray([val], dtype=np.uint16))[0]
        return n, first, float(val)

    def check_writable(self, a, name):
        if isinstance(a, self.np.ndarray) and not a.flags.writeable:
            raise ValueError(f"{name}: the array is read-only (flags.writeable is False); "
                             f"pass a writable array (np.empty(...)) or None to allocate one")

    def flat_heads(self, x, layout):
        """[B, H, N, d] / [B, N, H, d] -> [B*H, N, d] (a view where the strides allow)."""
        if layout == "nhd":
            x = x.transpose(0, 2, 1, 3)
        return x.reshape(x.shape[0] * x.shape[1], x.shape[2], x.shape[3])

    def to_nhd(self, x4):
        """[B, H, T, d] -> a new contiguous [B, T, H, d]."""
        return self.np.ascontiguousarray(x4.transpose(0, 2, 1, 3))

    def empty_u8(self, n):
        return self.np.empty(int(n), dtype=self.np.uint8)

    def zeros_u8(self, n):
        return self.np.zeros(int(n), dtype=self.np.uint8)

    def empty_bf16(self, shape):
        return self.np.empty(tuple(shape), dtype=self.np.uint16)

    def hnd_copy(self, arg: Arg):
        """A new contiguous [H, N, d] copy of a resolved argument (held BF16 chunks)."""
        return self.np.array(arg.hnd_view(), order="C", copy=True)

    def cat_tokens(self, xs):
        return xs[0] if len(xs) == 1 else self.np.concatenate(xs, axis=1)

    def cat_rows(self, xs):
        return xs[0] if len(xs) == 1 else self.np.concatenate(xs, axis=0)

    def nbytes(self, a):
        return int(a.nbytes) if a is not None else 0

    def sync(self):
        pass


# ---------------------------------------------------------------- torch


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("kvforge: torch tensors need PyTorch (pip install torch); "
                          "numpy arrays work without it (device=None)") from e
    return torch


class TorchBackend:
    """torch tensors on one device: CUDA (JIT kernels, the current stream) or CPU
    (the CPU reference). BF16 is torch.bfloat16."""
    kind = "torch"

    def __init__(self, device):
        torch = _torch()
        self.torch = torch
        dev = torch.device(device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"kvforge: device {device!r} asked for, but torch sees no CUDA device")
            if dev.index is None:
                dev = torch.device("cuda", torch.cuda.current_device())
        elif dev.type != "cpu":
            raise ValueError(f"kvforge: device must be 'cpu' or 'cuda[:N]', got {str(dev)!r}")
        self.device = dev
        self.is_gpu = dev.type == "cuda"
        self.device_index = dev.index if self.is_gpu else -1

    def __repr__(self):
        return f"torch on {self.device}"

    def stream(self):
        if not self.is_gpu:
            return None
        return c_void_p(self.torch.cuda.current_stream(self.device).cuda_stream)

    def _check_tensor(self, x, name):
        torch = self.torch
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor on {self.device}, got {type(x).__name__}")
        if x.device != self.device:
            raise ValueError(f"{name}: tensor is on {x.device}, this kvforge object works on {self.device}")

    def kv(self, x, name, layout, head_dim, n_heads=None, heads_multiple_of=None) -> Arg:
        torch = self.torch
        self._check_tensor(x, name)
        if x.dtype != torch.bfloat16:
            raise TypeError(f"{name}: dtype must be torch.bfloat16, got {x.dtype}; "
                            f"convert with {name}.to(torch.bfloat16)")
        H, N, h_ax, n_ax, d_ax = _dims(name, x.shape, layout, head_dim, n_heads, heads_multiple_of)
        st = x.stride()
        if head_dim > 1 and st[d_ax] != 1:
            raise ValueError(f"{name}: the last dimension (head_dim) must be contiguous (stride 1), "
                             f"got strides {tuple(st)}; use {name}.contiguous()")
        if _needs_copy(self.is_gpu, x.data_ptr(), (st[n_ax], st[h_ax]), (N, H)):
            x = x.contiguous()
            st = x.stride()
            if _needs_copy(self.is_gpu, x.data_ptr(), (st[n_ax], st[h_ax]), (N, H)):
                x = x.clone(memory_format=torch.contiguous_format)
                st = x.stride()
        return Arg(x.data_ptr(), H, N, st[n_ax], st[h_ax], x, layout)

    def positions(self, p, n_tokens, n_axes, name="positions"):
        torch = self.torch
        if not isinstance(p, torch.Tensor):
            import numpy as np  # numpy positions are accepted and moved
            if isinstance(p, np.ndarray):
                p = torch.from_numpy(np.ascontiguousarray(p))
            else:
                raise TypeError(f"{name}: expected an int32 tensor [N, {n_axes}], got {type(p).__name__}")
        if p.dtype.is_floating_point or p.dtype == torch.bool or p.is_complex():
            raise TypeError(f"{name}: must be an integer tensor (int32), got {p.dtype}")
        if p.dim() == 1 and n_axes == 1:
            p = p.reshape(-1, 1)
        if tuple(p.shape) != (n_tokens, n_axes):
            raise ValueError(f"{name}: expected shape ({n_tokens}, {n_axes}) [N, axes], got {tuple(p.shape)}")
        if p.dtype != torch.int32 and p.numel():
            # A silent wrap-around would turn the keys by wrong angles.
            _check_int32(name, p, int(p.min()), int(p.max()))
        return p.to(device=self.device, dtype=torch.int32).contiguous()

    def ptr(self, a):
        return a.data_ptr() if a is not None else None

    def nonfinite(self, x):
        """(count, first index, value) of NaN/Inf elements, or None (synchronizes on a GPU)."""
        torch = self.torch
        bad = ~torch.isfinite(x)
        n = int(bad.sum())
        if not n:
            return None
        flat = int(bad.reshape(-1).nonzero()[0, 0])
        first = []
        for size in reversed(x.shape):
            first.append(flat % size)
            flat //= size
        first = tuple(reversed(first))
        return n, first, float(x[first])

    def check_writable(self, a, name):
        pass  # torch tensors carry no read-only flag

    def flat_heads(self, x, layout):
        """[B, H, N, d] / [B, N, H, d] -> [B*H, N, d] (a view where the strides allow)."""
        if layout == "nhd":
            x = x.permute(0, 2, 1, 3)
        return x.reshape(x.shape[0] * x.shape[1], x.shape[2], x.shape[3])

    def to_nhd(self, x4):
        """[B, H, T, d] -> a new contiguous [B, T, H, d]."""
        return x4.permute(0, 2, 1, 3).contiguous()

    def empty_u8(self, n):
        return self.torch.empty(int(n), dtype=self.torch.uint8, device=self.device)

    def zeros_u8(self, n):
        return self.torch.zeros(int(n), dtype=self.torch.uint8, device=self.device)

    def empty_bf16(self, shape):
        return self.torch.empty(tuple(shape), dtype=self.torch.bfloat16, device=self.device)

    def hnd_copy(self, arg: Arg):
        """A new contiguous [H, N, d] copy of a resolved argument (held BF16 chunks)."""
        return arg.hnd_view().clone(memory_format=self.torch.contiguous_format)

    def cat_tokens(self, xs):
        return xs[0] if len(xs) == 1 else self.torch.cat(xs, dim=1)

    def cat_rows(self, xs):
        return xs[0] if len(xs) == 1 else self.torch.cat(xs, dim=0)

    def nbytes(self, a):
        return int(a.numel() * a.element_size()) if a is not None else 0

    def sync(self):
        if self.is_gpu:
            self.torch.cuda.current_stream(self.device).synchronize()


def _check_int32(name, p, lo, hi):
    if lo < -2**31 or hi >= 2**31:
        bad = lo if lo < -2**31 else hi
        raise ValueError(f"{name}: value {bad} does not fit in int32 (the library's positions are int32: "
                         f"[{-2**31}, {2**31 - 1}])")


def check_finite(be, x, name):
    """strict=True: refuse NaN or Inf in an input, naming how many and the first one."""
    r = be.nonfinite(x)
    if r is not None:
        n, first, val = r
        total = int(x.size) if be.kind == "numpy" else int(x.numel())
        raise ValueError(f"{name}: {n} of {total} values are NaN or Inf (strict=True); the first at index "
                         f"{list(first)} of shape {list(x.shape)} is {val}")


def make_backend(device):
    """None -> numpy on the CPU; anything else (str, int, torch.device) -> torch on it."""
    if device is None or (isinstance(device, str) and device == "numpy"):
        return NumpyBackend()
    if isinstance(device, int) and not isinstance(device, bool):
        device = f"cuda:{device}"
    return TorchBackend(device)
