"""CPU batch buffers: alignment, and the arena's reuse-without-allocating steady state."""
from __future__ import annotations

import numpy as np
import pytest

from lumen_core.engine.buffers import (
    DEFAULT_ALIGN,
    MIN_CAPACITY,
    BufferArena,
    aligned_empty,
)


@pytest.mark.parametrize("align", [16, 64, 128, 4096])
@pytest.mark.parametrize("shape, dtype", [
    ((3, 5), np.float32), (7, np.uint8), ((0, 4), np.int64), ((2, 3, 224, 224), np.float32),
    ((1,), np.complex128),
], ids=["2d-f32", "int-shape", "empty", "images", "complex"])
def test_aligned_empty(align, shape, dtype):
    a = aligned_empty(shape, dtype, align=align)
    assert a.ctypes.data % align == 0
    assert a.flags.c_contiguous and a.flags.writeable
    assert a.dtype == np.dtype(dtype)
    assert a.shape == (shape if isinstance(shape, tuple) else (shape,))
    a[...] = 1                                     # the whole view is writable memory
    assert (a == 1).all()


def test_aligned_empty_rejects_bad_arguments():
    for align in (0, -64, 48):
        with pytest.raises(ValueError, match="power of two"):
            aligned_empty((2,), np.float32, align=align)
    with pytest.raises(ValueError, match="Python objects"):
        aligned_empty((2,), object)
    with pytest.raises(ValueError, match="negative"):
        aligned_empty((2, -1), np.float32)


def test_arena_reuses_memory_and_stays_aligned():
    arena = BufferArena()
    big = arena.get("input", (32, 3, 224, 224), np.float32)
    assert big.ctypes.data % DEFAULT_ALIGN == 0 and big.flags.c_contiguous
    reserved = arena.nbytes_reserved
    assert reserved >= big.nbytes
    assert reserved & (reserved - 1) == 0            # power-of-two capacity
    small = arena.get("input", (8, 3, 224, 224), np.float32)
    assert small.ctypes.data == big.ctypes.data      # same memory, nothing allocated
    other_dtype = arena.get("input", (5, 7), np.int64)
    assert other_dtype.ctypes.data == big.ctypes.data
    assert arena.allocations == 1 and arena.nbytes_reserved == reserved
    assert small.shape == (8, 3, 224, 224) and other_dtype.shape == (5, 7)


def test_arena_grows_only_past_capacity():
    arena = BufferArena()
    arena.get("ids", (4, 16), np.int64)
    assert arena.capacity("ids") == MIN_CAPACITY
    first = arena.get("ids", (8, 64), np.int64)          # 4096 bytes: still fits
    assert arena.allocations == 1
    grown = arena.get("ids", (8, 65), np.int64)          # 4160 bytes: regrow to 8192
    assert arena.allocations == 2 and arena.capacity("ids") == 8192
    assert grown.ctypes.data % DEFAULT_ALIGN == 0
    first[...] = 3                                       # an old view stays valid memory
    assert (first == 3).all()


def test_arena_names_are_separate_and_release_drops_them():
    arena = BufferArena(align=128)
    ids = arena.get("ids", (2, 8), np.int64)
    mask = arena.get("mask", (2, 8), np.int64)
    assert not np.shares_memory(ids, mask)
    assert ids.ctypes.data % 128 == 0 and mask.ctypes.data % 128 == 0
    assert arena.nbytes_reserved == arena.capacity("ids") + arena.capacity("mask")
    arena.release()
    assert arena.nbytes_reserved == 0 and arena.capacity("ids") == 0
    ids[...] = 1                                         # views outlive the release safely
    assert (ids == 1).all()
    assert "ids" not in repr(arena)


def test_arena_accepts_int_shape_and_rejects_objects():
    arena = BufferArena()
    assert arena.get("x", 10, np.float32).shape == (10,)
    assert arena.get("x", (0,), np.float32).size == 0
    with pytest.raises(ValueError, match="Python objects"):
        arena.get("x", (2,), object)
    with pytest.raises(ValueError, match="power of two"):
        BufferArena(align=3)


def test_gather_into_arena_buffer(assemble):
    arena = BufferArena()
    items = [np.full((3, 4, 4), i, dtype=np.float32) for i in range(5)]
    dest = arena.get("input", (5, 3, 4, 4), np.float32)
    assemble.gather(items, dest)
    np.testing.assert_array_equal(dest, np.stack(items))
    ids = arena.get("ids", (3, 6), np.int64)
    mask = arena.get("mask", (3, 6), np.int64)
    total = assemble.gather_ragged([np.arange(2), np.arange(6), np.arange(0)], ids, mask, 0)
    assert total == 8 and mask.sum() == 8
