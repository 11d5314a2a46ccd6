# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Batch assembly, compiled (twin of ``lumen_core.assemble``; same behaviour, same errors).

Why compiled: a batch is N payload buffers that must end up in one contiguous tensor.  The pure
twin pays a numpy slice assignment (and a memoryview) per item with the GIL held; here all
buffers are acquired with the GIL, every size is checked, and then ONE ``with nogil:`` loop
does the copies (and, for ragged batches, the padding and the mask in the same pass), so other
Python threads -- the event loop, the next batch's preprocessing -- keep running.  Only when
the copy is large enough to be worth it (``NOGIL_MIN_BYTES``): a thread that gives up the GIL
has to get it back, and while the event loop is busy that costs the worker far more than a
small copy (bench/HISTORY.md, round 3: tens of microseconds of CPU per hand-over).

Shape of the code follows uvloop's ``_StreamWriteContext``: a ``bytes`` fast path
(``PyBytes_AS_STRING``, no buffer acquisition), ``PyObject_GetBuffer`` for everything else, a
small inline array of ``Py_buffer`` with a heap fallback, every buffer released in one place.

Only the hot path lives here.  Each check tests the common case in C; when that test fails,
the pure twin's check (or error builder) is called to raise, so every message and the order
of the checks have one home (``lumen_core.assemble``).  A pure check that does not raise where
the C test refused is a bug in this file and surfaces as ``InternalError``.
"""
from cpython.buffer cimport (PyBUF_FULL_RO, PyBuffer_IsContiguous, PyBuffer_Release,
                             PyObject_GetBuffer)
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.math cimport isfinite
from libc.stdint cimport uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset

cimport numpy as cnp

from lumen_core import assemble as _py
from lumen_core.errors import InternalError

cnp.import_array()

import sys

cdef bint _LITTLE = sys.byteorder == "little"

cdef extern from "numpy/arrayobject.h" nogil:
    # the flag behind ``dtype.hasobject``
    bint PyDataType_REFCHK(cnp.dtype dtype)

cdef extern from "assemble_copy.h" nogil:
    # memcpy with a vector loop for slot-sized copies and memmove for aliasing (see the header)
    void lumen_copy(char* dst, const char* src, size_t n)

__all__ = list(_py.__all__)

# a copy of at least this many bytes (about 10-20 us of memcpy) runs without the GIL
cdef Py_ssize_t NOGIL_MIN_BYTES = 256 * 1024

cdef enum:
    # items whose Py_buffer lives inline (no malloc); larger batches use one heap block
    INLINE_ITEMS = 32

# the pure twin's definitions, read once
cdef object _check_dest = _py.check_dest
cdef object _check_ragged_dest = _py.check_ragged_dest
cdef object _check_mask = _py.check_mask
cdef object _check_count = _py.check_count
cdef object _not_a_buffer = _py.not_a_buffer
cdef object _not_contiguous = _py.not_contiguous
cdef object _slot_mismatch = _py.slot_mismatch
cdef object _ragged_length = _py.ragged_length
cdef object _pad_element = _py.pad_element
# integer kinds accepted for the mask of gather_ragged: the pure twin's MASK_KINDS as C flags
cdef bint MASK_KIND_OK[256]
memset(MASK_KIND_OK, 0, sizeof(MASK_KIND_OK))
for _kind in _py.MASK_KINDS:
    MASK_KIND_OK[ord(_kind)] = True


cdef object _disagree(str check):
    """The error for a C test that refused what the pure twin's ``check`` accepts."""
    return InternalError(f"lumen_core._assemble refused an argument that "
                         f"lumen_core.assemble.{check} accepts")


cdef struct _Src:
    const char* ptr
    Py_ssize_t nbytes
    bint held               # views[i] was acquired and must be released


cdef class _Sources:
    """The acquired item buffers of one call; ``release()`` is the one place they are let go."""

    cdef Py_buffer inline_views[INLINE_ITEMS]
    cdef _Src inline_src[INLINE_ITEMS]
    cdef Py_buffer* views
    cdef _Src* src
    cdef Py_ssize_t n
    cdef Py_ssize_t acquired
    cdef tuple items        # keeps the bytes items (not acquired, only borrowed) alive

    def __cinit__(self):
        self.views = self.inline_views
        self.src = self.inline_src
        self.n = 0
        self.acquired = 0

    cdef int acquire(self, tuple items) except -1:
        cdef Py_ssize_t i, n = len(items)
        cdef object item
        self.items = items
        if n > INLINE_ITEMS:
            self.views = <Py_buffer*>PyMem_Malloc(n * sizeof(Py_buffer))
            self.src = <_Src*>PyMem_Malloc(n * sizeof(_Src))
            if self.views == NULL or self.src == NULL:
                raise MemoryError()
        self.n = n
        for i in range(n):
            self.src[i].held = False
        for i in range(n):
            item = items[i]
            if type(item) is bytes:
                self.src[i].ptr = PyBytes_AS_STRING(item)
                self.src[i].nbytes = PyBytes_GET_SIZE(item)
                continue
            try:
                PyObject_GetBuffer(item, &self.views[i], PyBUF_FULL_RO)
            except TypeError:
                raise _not_a_buffer(i, item) from None
            self.src[i].held = True
            self.acquired += 1
            if not PyBuffer_IsContiguous(&self.views[i], b'C'):
                raise _not_contiguous(i)
            self.src[i].ptr = <const char*>self.views[i].buf
            self.src[i].nbytes = self.views[i].len
        return 0

    cdef void release(self) noexcept:
        cdef Py_ssize_t i
        if self.acquired:
            for i in range(self.n):
                if self.src[i].held:
                    self.src[i].held = False
                    PyBuffer_Release(&self.views[i])
            self.acquired = 0
        if self.views != self.inline_views:
            PyMem_Free(self.views)
            self.views = self.inline_views
        if self.src != self.inline_src:
            PyMem_Free(self.src)
            self.src = self.inline_src
        self.n = 0
        self.items = None

    def __dealloc__(self):
        self.release()


cdef inline bint _dest_ok(object dest) noexcept:
    """The C test of ``lumen_core.assemble.check_dest``."""
    if not isinstance(dest, cnp.ndarray):
        return False
    cdef cnp.ndarray d = <cnp.ndarray>dest
    return (cnp.PyArray_NDIM(d) >= 1 and cnp.PyArray_IS_C_CONTIGUOUS(d)
            and cnp.PyArray_ISWRITEABLE(d) and not PyDataType_REFCHK(d.descr))


cdef cnp.ndarray _dest(object dest, str what):
    if not _dest_ok(dest):
        _check_dest(dest, what)  # cold: raises with the twin's message
        raise _disagree("check_dest")
    return <cnp.ndarray>dest


cdef inline int _count(Py_ssize_t n, Py_ssize_t rows) except -1:
    if n > rows:
        _check_count(n, rows)  # cold: raises
        raise _disagree("check_count")
    return 0


cdef void _copy_rows(char* out, _Src* src, Py_ssize_t n, Py_ssize_t slot) noexcept nogil:
    """``gather``'s copies: item ``i`` into row ``i`` (sizes already checked)."""
    cdef Py_ssize_t i
    for i in range(n):
        lumen_copy(out + i * slot, src[i].ptr, <size_t>slot)


cdef void _pad_rows(char* out, char* mout, _Src* src, Py_ssize_t n, Py_ssize_t rows,
                    Py_ssize_t lmax, Py_ssize_t isz, Py_ssize_t msz, const char* pad_elem,
                    bint pad_uniform, const char* one_elem) noexcept nogil:
    """``gather_ragged``'s one pass: copy, pad and mask every row (sizes already checked)."""
    cdef Py_ssize_t i, length
    cdef char* row
    cdef char* mrow
    for i in range(rows):
        row = out + i * lmax * isz
        length = src[i].nbytes // isz if i < n else 0
        if length:
            lumen_copy(row, src[i].ptr, <size_t>(length * isz))
        _fill(row + length * isz, pad_elem, isz, lmax - length, pad_uniform)
        if mout != NULL:
            mrow = mout + i * lmax * msz
            _fill(mrow, one_elem, msz, length, msz == 1)
            if lmax > length:
                memset(mrow + length * msz, 0, <size_t>((lmax - length) * msz))


def gather(items, dest) -> None:
    """Copy item ``i`` (any C-contiguous buffer of exactly ``dest[0].nbytes`` bytes) into ``dest[i]``.

    Rows of ``dest`` past ``len(items)`` are left untouched.  All sizes are checked before the
    first byte is written, so a bad item leaves ``dest`` unchanged.
    """
    cdef tuple seq = tuple(items)
    cdef cnp.ndarray d = _dest(dest, "dest")
    cdef Py_ssize_t rows = cnp.PyArray_DIM(d, 0)
    cdef Py_ssize_t slot = cnp.PyArray_NBYTES(d) // rows if rows else 0
    cdef Py_ssize_t i, n = len(seq)
    cdef char* out = <char*>cnp.PyArray_DATA(d)
    cdef _Sources s = _Sources()
    _count(n, rows)
    try:
        s.acquire(seq)
        for i in range(n):
            if s.src[i].nbytes != slot:
                raise _slot_mismatch(i, s.src[i].nbytes, slot)
        if n * slot >= NOGIL_MIN_BYTES:
            with nogil:
                _copy_rows(out, s.src, n, slot)
        else:
            _copy_rows(out, s.src, n, slot)
    finally:
        s.release()


cdef void _fill(char* dst, const char* elem, Py_ssize_t isz, Py_ssize_t count,
                bint uniform) noexcept nogil:
    """Write ``count`` copies of the ``isz``-byte element ``elem`` at ``dst``."""
    cdef Py_ssize_t k
    cdef uint16_t v16
    cdef uint32_t v32
    cdef uint64_t v64
    if count <= 0:
        return
    if uniform:                   # every byte of the element equal (0, -1, ...): one memset
        memset(dst, elem[0], <size_t>(count * isz))
    elif isz == 8:
        memcpy(&v64, elem, 8)
        for k in range(count):
            memcpy(dst + 8 * k, &v64, 8)
    elif isz == 4:
        memcpy(&v32, elem, 4)
        for k in range(count):
            memcpy(dst + 4 * k, &v32, 4)
    elif isz == 2:
        memcpy(&v16, elem, 2)
        for k in range(count):
            memcpy(dst + 2 * k, &v16, 2)
    else:
        for k in range(count):
            memcpy(dst + isz * k, elem, <size_t>isz)


cdef bint _is_uniform(const char* elem, Py_ssize_t isz) noexcept:
    cdef Py_ssize_t k
    for k in range(1, isz):
        if elem[k] != elem[0]:
            return False
    return True


cdef inline bint _ragged_dest_ok(object dest) noexcept:
    """The C test of ``lumen_core.assemble.check_ragged_dest``."""
    return (_dest_ok(dest) and cnp.PyArray_NDIM(<cnp.ndarray>dest) == 2
            and cnp.PyArray_ITEMSIZE(<cnp.ndarray>dest) != 0)


cdef bint _mask_ok(object mask, cnp.ndarray d):
    """The C test of ``lumen_core.assemble.check_mask`` (``d`` passed ``_ragged_dest_ok``)."""
    cdef cnp.ndarray m
    cdef cnp.dtype dt
    if not _dest_ok(mask):
        return False
    m = <cnp.ndarray>mask
    if (cnp.PyArray_NDIM(m) != 2 or cnp.PyArray_DIM(m, 0) != cnp.PyArray_DIM(d, 0)
            or cnp.PyArray_DIM(m, 1) != cnp.PyArray_DIM(d, 1)):
        return False
    dt = m.descr
    return MASK_KIND_OK[<unsigned char>dt.kind] and cnp.PyArray_ISNBO(dt.byteorder)


def gather_ragged(items, dest, mask, pad_value) -> int:
    """Copy item ``i`` (``L_i`` elements of ``dest.dtype``) into row ``i`` and pad the row.

    ``dest`` is ``[N, Lmax]``; positions ``>= L_i`` get ``pad_value``; ``mask`` (same shape, an
    integer dtype, or None) gets 1 on the first ``L_i`` positions and 0 after.  Rows past
    ``len(items)`` are all padding.  Copy, padding and mask are one pass without the GIL.
    Returns ``sum(L_i)`` so the caller can report the padding ratio without a second pass.
    Items must not overlap ``dest`` or ``mask`` (unspecified result; the twins may write in
    different orders).
    """
    cdef tuple seq = tuple(items)
    if not _ragged_dest_ok(dest):
        _check_ragged_dest(dest)  # cold: raises
        raise _disagree("check_ragged_dest")
    cdef cnp.ndarray d = <cnp.ndarray>dest
    if mask is not None and not _mask_ok(mask, d):
        _check_mask(mask, dest)  # cold: raises
        raise _disagree("check_mask")
    cdef cnp.ndarray m = <cnp.ndarray>mask if mask is not None else None
    cdef bytes pad = _pad_element(pad_value, dest.dtype).tobytes()
    cdef Py_ssize_t rows = cnp.PyArray_DIM(d, 0)
    cdef Py_ssize_t lmax = cnp.PyArray_DIM(d, 1)
    cdef Py_ssize_t isz = cnp.PyArray_ITEMSIZE(d)
    cdef Py_ssize_t msz = 0 if m is None else cnp.PyArray_ITEMSIZE(m)
    cdef char* out = <char*>cnp.PyArray_DATA(d)
    cdef char* mout = NULL if m is None else <char*>cnp.PyArray_DATA(m)
    cdef const char* pad_elem = PyBytes_AS_STRING(pad)
    cdef bint pad_uniform = _is_uniform(pad_elem, isz)
    cdef Py_ssize_t i, length, total = 0, n = len(seq)
    cdef char* row
    cdef char* mrow
    cdef uint64_t one = 1
    cdef const char* one_elem = <const char*>&one      # 1 in the low bytes (little endian)
    cdef _Sources s = _Sources()
    if (<const char*>&one)[0] != 1:                      # big-endian host: 1 sits in the last bytes
        one_elem = (<const char*>&one) + 8 - msz
    _count(n, rows)
    try:
        s.acquire(seq)
        for i in range(n):
            length = s.src[i].nbytes // isz
            if s.src[i].nbytes % isz or length > lmax:
                _ragged_length(i, s.src[i].nbytes, isz, lmax)  # cold: raises
                raise _disagree("ragged_length")
            total += length
        if rows * lmax * (isz + msz) >= NOGIL_MIN_BYTES:
            with nogil:
                _pad_rows(out, mout, s.src, n, rows, lmax, isz, msz, pad_elem, pad_uniform,
                          one_elem)
        else:
            _pad_rows(out, mout, s.src, n, rows, lmax, isz, msz, pad_elem, pad_uniform, one_elem)
        return total
    finally:
        s.release()


def first_non_finite(buf) -> int:
    """Index of the first NaN or infinity in a little-endian float32 buffer, or -1 (the twin's
    docstring says why the GIL is held here)."""
    cdef Py_buffer view
    cdef Py_ssize_t i, n
    cdef float v
    cdef const char* p
    if not _LITTLE:
        return _py.first_non_finite(buf)
    if PyObject_GetBuffer(buf, &view, PyBUF_FULL_RO) != 0:
        return _py.first_non_finite(buf)  # not a buffer: the twin raises
    try:
        if view.len % 4 or not PyBuffer_IsContiguous(&view, b"C"):
            return _py.first_non_finite(buf)  # cold: the twin's error (or its copy)
        n = view.len // 4
        p = <const char*>view.buf
        for i in range(n):
            memcpy(&v, p + 4 * i, 4)  # the buffer need not be 4-byte aligned
            if not isfinite(v):
                return i
        return -1
    finally:
        PyBuffer_Release(&view)
