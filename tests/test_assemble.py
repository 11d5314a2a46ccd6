"""Batch assembly (gather / gather_ragged), both implementations via the ``assemble`` fixture.

The two twins must agree byte for byte and raise the same exception types, so every test runs
against both and the property test also compares them with each other.
"""
from __future__ import annotations

import numpy as np
import pytest
from conftest import twins
from hypothesis import given, settings
from hypothesis import strategies as st

# more than the compiled module's inline Py_buffer array, so the heap fallback runs
MANY_ITEMS = 100


# ---------------------------------------------------------------------------------- gather


def test_gather_mixed_buffer_types(assemble):
    slot = np.arange(12, dtype=np.float32).reshape(3, 4)
    raw = slot.tobytes()
    items = [
        raw,                                            # bytes fast path
        bytearray(raw),
        memoryview(raw),
        slot,                                           # same dtype, 2-D
        np.frombuffer(raw, dtype=np.uint8),             # other dtype, read-only
        np.frombuffer(raw, dtype=np.int16).reshape(2, 12),
        memoryview(bytearray(raw)).cast("f"),           # non-byte memoryview format
    ]
    dest = np.full((len(items) + 1, 3, 4), -1.0, dtype=np.float32)
    assert assemble.gather(items, dest) is None
    for i in range(len(items)):
        np.testing.assert_array_equal(dest[i], slot)
    np.testing.assert_array_equal(dest[-1], -1.0)      # rows past len(items) are untouched


def test_gather_read_only_inputs(assemble):
    src = np.arange(6, dtype=np.int64)
    ro = src.copy()
    ro.flags.writeable = False
    items = [ro, np.frombuffer(src.tobytes(), dtype=np.int64), memoryview(src.tobytes())]
    dest = np.zeros((3, 6), dtype=np.int64)
    assemble.gather(items, dest)
    np.testing.assert_array_equal(dest, np.tile(src, (3, 1)))


def test_gather_misaligned_inputs(assemble):
    payload = np.arange(16, dtype=np.float32)
    backing = b"\x00" + payload.tobytes() + b"\x00" * 7
    odd = np.frombuffer(backing, dtype=np.float32, offset=1, count=16)     # address not 4-aligned
    assert not odd.flags.aligned
    u8 = np.frombuffer(backing, dtype=np.uint8, offset=1, count=64)
    mv = memoryview(bytearray(backing))[1:65]
    dest = np.zeros((3, 16), dtype=np.float32)
    assemble.gather([odd, u8, mv], dest)
    np.testing.assert_array_equal(dest, np.tile(payload, (3, 1)))


def test_gather_many_items_uses_heap_path(assemble):
    items = [np.full(5, i, dtype=np.int32) if i % 2 else np.full(5, i, np.int32).tobytes()
             for i in range(MANY_ITEMS)]
    dest = np.zeros((MANY_ITEMS, 5), dtype=np.int32)
    assemble.gather(iter(items), dest)             # any iterable is accepted
    np.testing.assert_array_equal(dest, np.repeat(np.arange(MANY_ITEMS), 5).reshape(-1, 5))


def test_gather_empty_batch_and_zero_size_slots(assemble):
    assemble.gather([], np.zeros((0, 4), dtype=np.float32))
    assemble.gather([b"", bytearray()], np.zeros((2, 0), dtype=np.float32))
    with pytest.raises(ValueError, match="item 1 has 1 bytes, the batch slot has 0"):
        assemble.gather([b"", b"x"], np.zeros((2, 0), dtype=np.float32))


@pytest.mark.parametrize("bad_index", [0, 2])
def test_gather_wrong_size_names_item_and_leaves_dest(assemble, bad_index):
    items = [np.ones(4, dtype=np.float32) for _ in range(3)]
    items[bad_index] = np.ones(5, dtype=np.float32)
    dest = np.zeros((3, 4), dtype=np.float32)
    with pytest.raises(ValueError, match=f"item {bad_index} has 20 bytes, the batch slot has 16"):
        assemble.gather(items, dest)
    assert not dest.any()                               # checked before the first byte moves


@pytest.mark.parametrize("make", [
    lambda: np.arange(8, dtype=np.float32)[::2],
    lambda: np.asfortranarray(np.arange(4, dtype=np.float32).reshape(2, 2)),
    lambda: memoryview(bytearray(32)).cast("f")[::2],
    lambda: np.arange(16, dtype=np.float32).reshape(4, 4)[:, :1].T,
], ids=["strided", "fortran", "memoryview-step", "column"])
def test_gather_non_contiguous_is_value_error(assemble, make):
    item = make()
    assert memoryview(item).nbytes == 16
    with pytest.raises(ValueError, match="item 1 is not C-contiguous"):
        assemble.gather([np.zeros(4, np.float32), item], np.zeros((2, 4), np.float32))


def test_gather_non_buffer_is_type_error(assemble):
    with pytest.raises(TypeError, match="item 1: str does not support the buffer protocol"):
        assemble.gather([b"abcd", "abcd"], np.zeros((2, 4), np.uint8))


@pytest.mark.parametrize("dest, exc, match", [
    ([[0, 0]], TypeError, "dest must be a numpy.ndarray"),
    (np.zeros((), np.uint8), ValueError, "at least one dimension"),
    (np.zeros((4, 2), np.uint8).T, ValueError, "C-contiguous"),
    (np.frombuffer(bytes(4), np.uint8).reshape(2, 2), ValueError, "read-only"),
    (np.empty((2, 2), dtype=object), ValueError, "Python objects"),
    (np.zeros((1, 2), np.uint8), ValueError, "2 items do not fit in dest with 1 rows"),
])
def test_gather_bad_dest(assemble, dest, exc, match):
    with pytest.raises(exc, match=match):
        assemble.gather([b"ab", b"cd"], dest)


def test_gather_releases_buffers_even_on_error(assemble):
    good, bad = bytearray(4), bytearray(3)
    assemble.gather([good], np.zeros((1, 4), np.uint8))
    with pytest.raises(ValueError):
        assemble.gather([good, bad], np.zeros((2, 4), np.uint8))
    good.extend(b"x")                # a bytearray with a live export cannot resize (BufferError)
    bad.extend(b"x")


def test_gather_item_aliasing_dest_copies_in_order(assemble):
    dest = np.arange(12, dtype=np.int32).reshape(3, 4)
    assemble.gather([dest[2], dest[0]], dest)   # row0 <- row2, then row1 <- (new) row0
    np.testing.assert_array_equal(dest, [[8, 9, 10, 11], [8, 9, 10, 11], [8, 9, 10, 11]])


@pytest.mark.parametrize("slot", [255, 256, 1000, 4096 + 17])
def test_gather_vector_copy_sizes_and_overlap(assemble, slot):
    # slot sizes around the compiled copy's vector threshold, odd tails, misaligned sources,
    # and an item that partially overlaps its own slot (must behave like memmove)
    rng = np.random.default_rng(slot)
    payloads = [rng.integers(0, 256, slot, dtype=np.uint8).tobytes() for _ in range(3)]
    dest = np.zeros((3, slot), np.uint8)
    items = [payloads[0], memoryview(bytearray(b"\x00" + payloads[1]))[1:], payloads[2]]
    assemble.gather(items, dest)
    assert dest.tobytes() == b"".join(payloads)
    flat = dest.reshape(-1)
    expected = flat[3:slot + 3].copy()
    assemble.gather([flat[3:slot + 3]], dest)
    np.testing.assert_array_equal(dest[0], expected)


# ---------------------------------------------------------------------------------- ragged


def _reference(seqs, lmax, dtype, pad, n_rows):
    ids = np.full((n_rows, lmax), np.array(pad, dtype=dtype), dtype=dtype)
    mask = np.zeros((n_rows, lmax), dtype=np.int64)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = s
        mask[i, :len(s)] = 1
    return ids, mask


def test_gather_ragged_lengths_zero_to_lmax(assemble):
    seqs = [np.arange(1, 4, dtype=np.int64), np.arange(0, dtype=np.int64),
            np.arange(10, 16, dtype=np.int64), np.arange(7, 8, dtype=np.int64)]
    ids = np.full((5, 6), 99, dtype=np.int64)
    mask = np.full((5, 6), 99, dtype=np.int64)
    total = assemble.gather_ragged(seqs, ids, mask, 0)
    assert total == 3 + 0 + 6 + 1
    ref_ids, ref_mask = _reference(seqs, 6, np.int64, 0, 5)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_array_equal(mask, ref_mask)


def test_gather_ragged_mask_none_and_mixed_buffers(assemble):
    seqs = [np.array([5, 6], np.int32).tobytes(), bytearray(np.array([1], np.int32).tobytes()),
            memoryview(np.array([1, 2, 3], np.int32))]
    ids = np.zeros((3, 4), dtype=np.int32)
    assert assemble.gather_ragged(seqs, ids, None, -1) == 6
    np.testing.assert_array_equal(ids, [[5, 6, -1, -1], [1, -1, -1, -1], [1, 2, 3, -1]])


@pytest.mark.parametrize("dtype, pad", [
    (np.int64, 0), (np.int64, -1), (np.int64, 0x0102030405060708), (np.int32, 7),
    (np.int16, -300), (np.uint8, 255), (np.float32, 0.5), (np.float64, -2.25),
    (np.complex128, 1 + 2j), (np.dtype(">i4"), 258),
])
@pytest.mark.parametrize("mask_dtype", [np.int64, np.int32, np.int8, np.uint16, np.bool_])
def test_gather_ragged_pad_values_and_mask_dtypes(assemble, dtype, pad, mask_dtype):
    seqs = [np.arange(3).astype(dtype), np.arange(0).astype(dtype), np.arange(5).astype(dtype)]
    ids = np.zeros((4, 5), dtype=dtype)
    mask = np.full((4, 5), 3, dtype=mask_dtype)
    assert assemble.gather_ragged(seqs, ids, mask, pad) == 8
    ref_ids, ref_mask = _reference(seqs, 5, dtype, pad, 4)
    np.testing.assert_array_equal(ids, ref_ids)
    np.testing.assert_array_equal(mask.astype(np.int64), ref_mask)


def test_gather_ragged_zero_width_rows(assemble):
    ids = np.zeros((2, 0), np.int64)
    mask = np.zeros((2, 0), np.int64)
    assert assemble.gather_ragged([b""], ids, mask, 0) == 0


@pytest.mark.parametrize("items, dest, mask, match", [
    ([b"abc"], np.zeros((1, 4), np.int16), None, "item 0 has 3 bytes, not a multiple of the element size 2"),
    ([b"", bytes(10)], np.zeros((2, 4), np.int16), None, "item 1 has 5 elements, the batch row has 4"),
    ([b""], np.zeros(4, np.int16), None, "must be 2-D"),
    ([b""], np.zeros((1, 4), np.int16), np.zeros((1, 5), np.int64), "mask shape"),
    ([b""], np.zeros((1, 4), np.int16), np.zeros((1, 4), np.float32), "native integer or bool"),
    ([b""], np.zeros((1, 4), np.int16), np.zeros((1, 4), ">i8"), "native integer or bool"),
    ([b""], np.zeros((1, 4), np.int16), np.zeros((1, 8), np.int64)[:, ::2], "mask must be C-contiguous"),
    ([b"", b""], np.zeros((1, 4), np.int16), None, "2 items do not fit"),
    ([b""], np.zeros((1, 4), "V0"), None, "zero-size elements"),
])
def test_gather_ragged_errors(assemble, items, dest, mask, match):
    with pytest.raises(ValueError, match=match):
        assemble.gather_ragged(items, dest, mask, 0)


def test_gather_ragged_type_errors(assemble):
    with pytest.raises(TypeError, match="mask must be a numpy.ndarray"):
        assemble.gather_ragged([b""], np.zeros((1, 2), np.int64), [[0, 0]], 0)
    with pytest.raises(TypeError, match="item 0: int does not support"):
        assemble.gather_ragged([3], np.zeros((1, 2), np.int64), None, 0)


def test_gather_ragged_pad_out_of_range_is_numpy_error(assemble):
    # the pad is cast with numpy's rules in both twins, so both raise what numpy raises
    with pytest.raises(OverflowError):
        assemble.gather_ragged([b""], np.zeros((1, 2), np.uint8), None, -1)


def test_gather_ragged_non_contiguous_same_error(assemble):
    with pytest.raises(ValueError, match="item 0 is not C-contiguous"):
        assemble.gather_ragged([np.arange(6)[::2]], np.zeros((1, 4), np.int64), None, 0)


_DTYPES = [np.int64, np.int32, np.uint8, np.float32, np.float16, np.complex64]


@settings(max_examples=60, deadline=None)
@given(
    dtype=st.sampled_from(_DTYPES),
    lmax=st.integers(0, 40),
    extra_rows=st.integers(0, 3),
    data=st.data(),
)
def test_gather_ragged_property_matches_numpy_and_twins_agree(dtype, lmax, extra_rows, data):
    n = data.draw(st.integers(0, 12), label="n")
    lengths = data.draw(st.lists(st.integers(0, lmax), min_size=n, max_size=n), label="lengths")
    pad = data.draw(st.integers(0 if np.dtype(dtype).kind == "u" else -5, 100), label="pad")
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1), label="seed"))
    seqs = [rng.integers(0, 100, size=k).astype(dtype) for k in lengths]
    # present items as assorted buffer types, some misaligned
    items = []
    for i, s in enumerate(seqs):
        if i % 3 == 0:
            items.append(s.tobytes())
        elif i % 3 == 1:
            items.append(memoryview(bytearray(b"\x00" + s.tobytes()))[1:])
        else:
            items.append(s)
    ref_ids, ref_mask = _reference(seqs, lmax, dtype, pad, n + extra_rows)
    outputs = []
    for mod in twins("assemble"):
        ids = np.full((n + extra_rows, lmax), 77, dtype=dtype)
        mask = np.full((n + extra_rows, lmax), 77, dtype=np.int64)
        assert mod.gather_ragged(items, ids, mask, pad) == sum(lengths)
        np.testing.assert_array_equal(ids, ref_ids)
        np.testing.assert_array_equal(mask, ref_mask)
        outputs.append(ids.tobytes())
    assert len(set(outputs)) == 1                       # byte-identical (pads, NaN-free here)


@settings(max_examples=30, deadline=None)
@given(slot=st.integers(0, 64), n=st.integers(0, 40), data=st.data())
def test_gather_property_matches_stack_and_twins_agree(slot, n, data):
    payloads = [data.draw(st.binary(min_size=slot, max_size=slot)) for _ in range(n)]
    expected = np.frombuffer(b"".join(payloads), np.uint8).reshape(n, slot)
    for mod in twins("assemble"):
        dest = np.zeros((n, slot), np.uint8)
        mod.gather([bytearray(p) if i % 2 else p for i, p in enumerate(payloads)], dest)
        np.testing.assert_array_equal(dest, expected)


# ---------------------------------------------------------------------------------- errors

_RO = np.zeros((1, 4), np.int64)
_RO.flags.writeable = False
_ERRORS = [
    ("gather", lambda: ([b"ab"], [[0, 0]]), TypeError, "dest must be a numpy.ndarray, not list"),
    ("gather", lambda: ([], np.zeros((), np.uint8)), ValueError,
     "dest must have at least one dimension"),
    ("gather", lambda: ([], np.zeros((2, 2), np.uint8).T), ValueError, "dest must be C-contiguous"),
    ("gather", lambda: ([], _RO), ValueError, "dest is read-only"),
    ("gather", lambda: ([], np.empty(2, np.dtype([("a", object)]))), ValueError,
     "dest must not hold Python objects (dtype [('a', 'O')])"),
    ("gather", lambda: ([b"ab", b"cd"], np.zeros((1, 2), np.uint8)), ValueError,
     "2 items do not fit in dest with 1 rows"),
    ("gather", lambda: ([b"ab", "cd"], np.zeros((2, 2), np.uint8)), TypeError,
     "item 1: str does not support the buffer protocol"),
    ("gather", lambda: ([np.arange(4, dtype=np.uint8)[::2]], np.zeros((1, 2), np.uint8)),
     ValueError, "item 0 is not C-contiguous"),
    ("gather", lambda: ([b"abc"], np.zeros((1, 2), np.uint8)), ValueError,
     "item 0 has 3 bytes, the batch slot has 2"),
    ("gather_ragged", lambda: ([b""], np.zeros(4, np.int16), None, 0), ValueError,
     "dest must be 2-D [N, Lmax], got shape (4,)"),
    ("gather_ragged", lambda: ([b""], np.zeros((1, 4), "V0"), None, 0), ValueError,
     "dest has zero-size elements"),
    ("gather_ragged", lambda: ([b""], np.zeros((1, 4), np.int16), np.zeros(4, np.int64), 0),
     ValueError, "mask shape (4,) differs from dest shape (1, 4)"),
    ("gather_ragged", lambda: ([b""], np.zeros((1, 4), np.int16), np.zeros((4, 1), np.int64), 0),
     ValueError, "mask shape (4, 1) differs from dest shape (1, 4)"),
    ("gather_ragged", lambda: ([b""], np.zeros((1, 4), np.int16), np.zeros((1, 4), ">i8"), 0),
     ValueError, "mask must have a native integer or bool dtype, not >i8"),
    ("gather_ragged", lambda: ([b""], np.zeros((1, 4), np.int16), np.zeros((1, 4), np.float32), 0),
     ValueError, "mask must have a native integer or bool dtype, not float32"),
    ("gather_ragged", lambda: ([b""], np.zeros((1, 4), np.int16), _RO, 0), ValueError,
     "mask is read-only"),
    ("gather_ragged", lambda: ([b""], np.zeros((1, 4), np.int16), [[0] * 4], 0), TypeError,
     "mask must be a numpy.ndarray, not list"),
    ("gather_ragged", lambda: ([b"abc"], np.zeros((1, 4), np.int16), None, 0), ValueError,
     "item 0 has 3 bytes, not a multiple of the element size 2"),
    ("gather_ragged", lambda: ([bytes(10)], np.zeros((1, 4), np.int16), None, 0), ValueError,
     "item 0 has 5 elements, the batch row has 4"),
]


@pytest.mark.parametrize("fn, args, exc, message", _ERRORS,
                         ids=[f"{e[0]}-{i}" for i, e in enumerate(_ERRORS)])
def test_errors_are_the_pure_twins_word_for_word(assemble, fn, args, exc, message):
    """The compiled twin raises through the pure twin's checks: same class, same message."""
    with pytest.raises(exc) as info:
        getattr(assemble, fn)(*args())
    assert type(info.value) is exc and str(info.value) == message


# ------------------------------------------------------------------------ first_non_finite
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_first_non_finite_finds_the_first_bad_sample(assemble, bad):
    x = np.linspace(-1, 1, 512, dtype="<f4")
    assert assemble.first_non_finite(x) == -1
    assert assemble.first_non_finite(x.tobytes()) == -1
    y = x.copy()
    y[[300, 17]] = bad
    assert assemble.first_non_finite(y) == 17
    assert assemble.first_non_finite(memoryview(y.tobytes())) == 17
    assert assemble.first_non_finite(b"") == -1


def test_first_non_finite_reads_unaligned_buffers_and_refuses_odd_sizes(assemble):
    raw = bytearray(1 + 4 * 8)
    vals = np.zeros(8, "<f4")
    vals[5] = np.nan
    raw[1:] = vals.tobytes()
    assert assemble.first_non_finite(memoryview(raw)[1:]) == 5  # not 4-byte aligned
    with pytest.raises(ValueError):
        assemble.first_non_finite(bytes(6))
