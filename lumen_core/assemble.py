"""Batch assembly: copy request payloads into one batch buffer (pure-Python twin of csrc/_assemble.pyx).

Why this exists: a dynamic batch is N request payloads (each a ``bytes`` body, a tokenizer
output, a decoded image ...) that the model wants as ONE contiguous ``[N, ...]`` tensor.
``np.stack`` would allocate a fresh batch every time and go through the ufunc machinery per
item; here every payload is copied once, straight into a caller-owned (arena) buffer, and the
compiled twin does all the copying in one loop with the GIL released.

Both implementations (this module and ``lumen_core._assemble``, chosen by
``lumen_core.native``) accept the same inputs and raise the same exceptions, because the
checks and error builders below are the definition: the compiled twin tests the common case
in C and, when that test fails, calls these on its cold path to raise.

- ``TypeError``: an item does not support the buffer protocol, or ``dest``/``mask`` is not a
  ``numpy.ndarray``;
- ``ValueError``: everything else (sizes, shapes, non-contiguous or read-only buffers).

Items are read as raw bytes: the caller is responsible for the payload's dtype matching the
batch dtype (``lumen_core.request_path.descriptor.parse_meta`` has checked that before a payload gets here).
An item that aliases ``dest`` is copied as if by ``memmove``, in item order.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

#: the twin API (``lumen_core._assemble`` exports the same)
__all__ = ["first_non_finite", "gather", "gather_ragged"]

#: integer kinds accepted for the attention-style ``mask`` of ``gather_ragged``
MASK_KINDS = "iub"


# --------------------------------------------------------------------------- checks and errors
# Shared by both twins: each check raises (or returns a value derived from its argument), each
# builder returns the exception for the caller to raise, so a message has one home.
def check_dest(dest: Any, what: str) -> None:
    """``dest`` (or ``mask``) must be a writable, C-contiguous, non-object ndarray of rank >= 1."""
    if not isinstance(dest, np.ndarray):
        raise TypeError(f"{what} must be a numpy.ndarray, not {type(dest).__name__}")
    if dest.ndim < 1:
        raise ValueError(f"{what} must have at least one dimension")
    if not dest.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous")
    if not dest.flags.writeable:
        raise ValueError(f"{what} is read-only")
    if dest.dtype.hasobject:
        raise ValueError(f"{what} must not hold Python objects (dtype {dest.dtype})")


def check_ragged_dest(dest: Any) -> None:
    """``check_dest``, then the ``[N, Lmax]`` shape and a non-zero element size."""
    check_dest(dest, "dest")
    if dest.ndim != 2:
        raise ValueError(f"dest must be 2-D [N, Lmax], got shape {dest.shape}")
    if dest.itemsize == 0:
        raise ValueError("dest has zero-size elements")


def check_mask(mask: Any, dest: np.ndarray) -> None:
    """``mask`` must be a destination of ``dest``'s shape with a native integer or bool dtype."""
    check_dest(mask, "mask")
    if mask.shape != dest.shape:
        raise ValueError(f"mask shape {mask.shape} differs from dest shape {dest.shape}")
    if mask.dtype.kind not in MASK_KINDS or not mask.dtype.isnative:
        raise ValueError(f"mask must have a native integer or bool dtype, not {mask.dtype}")


def check_count(n: int, rows: int, what: str = "dest") -> None:
    if n > rows:
        raise ValueError(f"{n} items do not fit in {what} with {rows} rows")


def not_a_buffer(index: int, item: Any) -> TypeError:
    return TypeError(f"item {index}: {type(item).__name__} does not support the buffer protocol")


def not_contiguous(index: int) -> ValueError:
    return ValueError(f"item {index} is not C-contiguous")


def slot_mismatch(index: int, nbytes: int, slot: int) -> ValueError:
    return ValueError(f"item {index} has {nbytes} bytes, the batch slot has {slot}")


def ragged_length(index: int, nbytes: int, itemsize: int, lmax: int) -> int:
    """Item ``index``'s length in elements; raise when it is not whole or exceeds the row."""
    if nbytes % itemsize:
        raise ValueError(f"item {index} has {nbytes} bytes, not a multiple of the "
                         f"element size {itemsize}")
    length = nbytes // itemsize
    if length > lmax:
        raise ValueError(f"item {index} has {length} elements, the batch row has {lmax}")
    return length


def pad_element(pad_value: Any, dtype: np.dtype) -> np.ndarray:
    """``pad_value`` as one element of ``dtype`` (numpy's casting rules; both twins use this)."""
    return np.array(pad_value, dtype=dtype)


def _view(item: Any, index: int) -> memoryview:
    """A memoryview of item ``index``, C-contiguous, else the twins' error naming the index."""
    try:
        mv = memoryview(item)
    except TypeError:
        raise not_a_buffer(index, item) from None
    if not mv.c_contiguous:
        mv.release()
        raise not_contiguous(index)
    return mv


def _acquire(items: Sequence[Any], capacity: int) -> list:
    check_count(len(items), capacity)
    views: list = []
    try:
        for i, item in enumerate(items):
            views.append(_view(item, i))
    except BaseException:
        _release(views)
        raise
    return views


def _release(views: list) -> None:
    for mv in views:
        mv.release()


def _bytes_of(mv: memoryview) -> np.ndarray:
    # a flat uint8 view of a C-contiguous buffer of any format (memoryview.cast cannot do 'Zd' etc.)
    return np.frombuffer(mv, dtype=np.uint8)


# --------------------------------------------------------------------------- the twin API
def gather(items: Sequence[Any], dest: np.ndarray) -> None:
    """Copy item ``i`` (any C-contiguous buffer of exactly ``dest[0].nbytes`` bytes) into ``dest[i]``.

    Rows of ``dest`` past ``len(items)`` are left untouched.  All sizes are checked before the
    first byte is written, so a bad item leaves ``dest`` unchanged.
    """
    items = list(items)
    check_dest(dest, "dest")
    slot = dest[0].nbytes if dest.shape[0] else 0
    views = _acquire(items, dest.shape[0])
    try:
        for i, mv in enumerate(views):
            if mv.nbytes != slot:
                raise slot_mismatch(i, mv.nbytes, slot)
        if slot:
            flat = dest.reshape(-1).view(np.uint8)
            for i, mv in enumerate(views):
                flat[i * slot:(i + 1) * slot] = _bytes_of(mv)
    finally:
        _release(views)


def gather_ragged(items: Sequence[Any], dest: np.ndarray, mask: np.ndarray | None,
                  pad_value: Any) -> int:
    """Copy item ``i`` (``L_i`` elements of ``dest.dtype``) into row ``i`` and pad the row.

    ``dest`` is ``[N, Lmax]``; positions ``>= L_i`` get ``pad_value``; ``mask`` (same shape, an
    integer dtype, or None) gets 1 on the first ``L_i`` positions and 0 after.  Rows past
    ``len(items)`` are all padding.  Returns ``sum(L_i)`` so the caller can report the padding
    ratio without a second pass.  Items must not overlap ``dest`` or ``mask`` (unspecified
    result; the twins may write in different orders).
    """
    items = list(items)
    check_ragged_dest(dest)
    if mask is not None:
        check_mask(mask, dest)
    pad = pad_element(pad_value, dest.dtype)
    n_rows, lmax = dest.shape
    isz = dest.itemsize
    views = _acquire(items, n_rows)
    try:
        lengths = [ragged_length(i, mv.nbytes, isz, lmax) for i, mv in enumerate(views)]
        dest[...] = pad
        if lengths and lmax:
            rows = dest.view(np.uint8).reshape(n_rows, lmax * isz)
            for i, length in enumerate(lengths):
                if length:
                    rows[i, :length * isz] = _bytes_of(views[i])
        if mask is not None:
            lens = np.zeros((n_rows, 1), dtype=np.intp)
            lens[:len(lengths), 0] = lengths
            np.less(np.arange(lmax), lens, out=mask, casting="unsafe")
        return sum(lengths)
    finally:
        _release(views)


def first_non_finite(buf: Any) -> int:
    """Index of the first NaN or infinity in a little-endian float32 buffer, or -1.

    Request validation calls it on the event loop (e.g. audio samples), so the compiled twin
    checks with the GIL held: numpy's ufuncs release the GIL past 500 elements, and on a busy
    server the loop then waits for a worker thread to hand it back.  The buffer's size must be
    a multiple of 4 (``np.frombuffer``'s error otherwise).
    """
    finite = np.isfinite(np.frombuffer(buf, dtype="<f4"))
    if finite.all():
        return -1
    return int(np.argmin(finite))
