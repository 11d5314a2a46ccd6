"""CPU batch buffers: 64-byte-aligned arrays and a per-engine arena that reuses them.

Why: every dynamic batch needs an input tensor (and a mask, ids ...).  Allocating a fresh
``[N, ...]`` array per batch costs a ``malloc`` + page faults on the hot path and fragments the
heap with large blocks; the arena keeps one buffer per name and hands out views of it, growing
only when a request is larger than anything seen before, so the steady state allocates nothing.
64-byte alignment is a cache line and what SIMD kernels (ONNX Runtime's MLAS included) prefer;
``np.empty`` only promises 16.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["DEFAULT_ALIGN", "MIN_CAPACITY", "BufferArena", "aligned_empty"]

#: default buffer alignment in bytes (one x86-64 cache line; enough for AVX-512 loads)
DEFAULT_ALIGN = 64
#: smallest capacity an arena buffer is given, in bytes (avoids regrowing through tiny sizes)
MIN_CAPACITY = 4096

Shape = int | Sequence[int]


def _normalise(shape: Shape, dtype: Any) -> tuple:
    shape_t = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    if any(s < 0 for s in shape_t):
        raise ValueError(f"negative dimension in shape {shape_t}")
    dt = np.dtype(dtype)
    if dt.hasobject:
        raise ValueError(f"dtype {dt} holds Python objects and cannot live in a raw buffer")
    return shape_t, dt, math.prod(shape_t) * dt.itemsize


def _raw_aligned(nbytes: int, align: int) -> np.ndarray:
    """A 1-D uint8 array of ``nbytes`` whose data pointer is a multiple of ``align``."""
    if align <= 0 or align & (align - 1):
        raise ValueError(f"align must be a positive power of two, got {align}")
    raw = np.empty(nbytes + align, dtype=np.uint8)
    offset = -raw.ctypes.data % align
    # numpy points an empty slice like raw[k:k] at raw's start; slice one byte, then trim
    return raw[offset:offset + max(nbytes, 1)][:nbytes]


def aligned_empty(shape: Shape, dtype: Any, align: int = DEFAULT_ALIGN) -> np.ndarray:
    """Like ``np.empty(shape, dtype)`` (C order, uninitialised) but aligned to ``align`` bytes."""
    shape_t, dt, nbytes = _normalise(shape, dtype)
    return _raw_aligned(nbytes, align).view(dt).reshape(shape_t)


def _capacity_for(nbytes: int) -> int:
    return max(MIN_CAPACITY, 1 << max(nbytes - 1, 0).bit_length())


class BufferArena:
    """Named, reusable, 64-byte-aligned CPU buffers for one engine instance.

    ``get(name, shape, dtype)`` returns a C-contiguous view of the buffer called ``name``; the
    buffer is re-allocated (capacity rounded up to a power of two) only when a request needs
    more bytes than it has, so repeated batches of any size up to the largest seen allocate
    nothing.  A view is valid until the next ``get`` of the same name, which may hand the same
    memory out again: the caller must be done with batch k before it asks for batch k+1's
    buffer (double buffering = two arenas, or two names).

    Not thread-safe by design: one arena per engine instance, used by the one thread that
    assembles that instance's batches.  Memory handed out stays valid after a regrow or
    ``release()`` for as long as a view references it (numpy keeps the old block alive), it is
    just no longer reused.
    """

    def __init__(self, align: int = DEFAULT_ALIGN) -> None:
        if align <= 0 or align & (align - 1):
            raise ValueError(f"align must be a positive power of two, got {align}")
        self._align = align
        self._buffers: dict[str, np.ndarray] = {}
        self.allocations = 0  #: how many times a buffer was (re)allocated; flat in steady state

    def get(self, name: str, shape: Shape, dtype: Any) -> np.ndarray:
        """A C-contiguous ``shape``/``dtype`` view of buffer ``name`` (uninitialised contents)."""
        shape_t, dt, nbytes = _normalise(shape, dtype)
        buf = self._buffers.get(name)
        if buf is None or buf.nbytes < nbytes:
            buf = _raw_aligned(_capacity_for(nbytes), self._align)
            self._buffers[name] = buf
            self.allocations += 1
        return buf[:nbytes].view(dt).reshape(shape_t)

    def capacity(self, name: str) -> int:
        """Bytes reserved for ``name`` (0 when it was never requested)."""
        buf = self._buffers.get(name)
        return 0 if buf is None else buf.nbytes

    @property
    def nbytes_reserved(self) -> int:
        """Bytes held by the arena across all names (the figure a memory metric reports)."""
        return sum(buf.nbytes for buf in self._buffers.values())

    def release(self) -> None:
        """Drop every buffer (e.g. when the engine instance is unloaded)."""
        self._buffers.clear()

    def __repr__(self) -> str:
        return (f"BufferArena(names={sorted(self._buffers)}, "
                f"nbytes_reserved={self.nbytes_reserved}, allocations={self.allocations})")
