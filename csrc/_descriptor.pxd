# cython: language_level=3
#
# The descriptor C struct and its nogil inline helpers (declarations of lumen_core.request_path._descriptor).
#
# Modelled on asyncpg / py-pgproto ``frb.pxd``: a small plain C struct plus ``nogil`` inline
# helpers that take everything they read as arguments (a table, a rules struct, a pointer and
# a length), so they hold no module state and compile down to the caller's loop.  The tables
# they read are filled by _descriptor.pyx at import from lumen_core.contract (keys, dtypes,
# layouts, limits) and lumen_core.request_path.descriptor (spellings); nothing here is a second copy.

from cpython.object cimport PyObject
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memcmp


cdef extern from *:
    """
    #include <stdint.h>
    /* a * b for non-negative int64 operands; returns 1 (and leaves *out alone) on overflow */
    static inline int lumen_mul_overflow(int64_t a, int64_t b, int64_t *out) {
    #if defined(__GNUC__) || defined(__clang__)
        return __builtin_mul_overflow(a, b, out);
    #else
        if (a != 0 && b > INT64_MAX / a) return 1;
        *out = a * b;
        return 0;
    #endif
    }
    """
    bint lumen_mul_overflow(int64_t a, int64_t b, int64_t* out) nogil


# ---------------------------------------------------------------- compile-time capacities
cdef enum:
    # array capacities; the contract's actual limits (checked at import) must fit in them
    CAP_KEYS = 32       # reserved keys
    CAP_TABLE = 32      # dtypes, layouts, boolean spellings
    CAP_RANK = 8        # contract.MAX_RANK
    CAP_DIGITS = 19     # contract.MAX_DIM_DIGITS: 19 decimal digits always fit in uint64
    CAP_BOOL_CHARS = 16  # longest accepted boolean spelling

cdef enum:
    KIND_RAW = 0
    KIND_TENSOR = 1

cdef enum:
    FLAG_SEQ_START = 1
    FLAG_SEQ_END = 2


# ---------------------------------------------------------------- the struct and its tables
cdef struct desc_t:
    # One request's lumen.* descriptor, filled by one pass over meta.
    int n_lumen                  # lumen.* keys seen
    int kind                     # KIND_RAW / KIND_TENSOR
    int dtype                    # index into the dtype table, -1 on the raw route
    int layout                   # index into the layout table, -1 on the raw route
    int rank
    int64_t shape[CAP_RANK]
    int64_t nbytes
    int64_t priority             # 0: not set
    int64_t timeout_ms           # 0: not set
    unsigned int flags           # FLAG_SEQ_*
    PyObject* vals[CAP_KEYS]     # borrowed: the meta's value strings, by key slot


cdef struct name_table_t:
    # ASCII names with a per-entry integer payload (dtype size, layout rank, ...)
    int n
    const char* data[CAP_TABLE]
    Py_ssize_t length[CAP_TABLE]
    int64_t a[CAP_TABLE]
    int64_t b[CAP_TABLE]


cdef struct shape_rules_t:
    # what the shape parser accepts (contract limits, descriptor.SHAPE_WHITESPACE)
    bint ws[256]                 # characters skipped around brackets, commas and digits
    int max_rank
    int max_digits               # per dimension, <= CAP_DIGITS
    uint64_t max_dim             # contract.INT64_MAX


# ---------------------------------------------------------------- nogil helpers
cdef inline int _find(const name_table_t* t, const char* p, Py_ssize_t n) noexcept nogil:
    """Index of the entry equal to ``p[:n]``, -1 when there is none (length, then memcmp)."""
    cdef int i
    for i in range(t.n):
        if t.length[i] == n and memcmp(t.data[i], p, n) == 0:
            return i
    return -1


cdef inline int _parse_shape(const shape_rules_t* r, const char* s, Py_ssize_t n,
                             int64_t* out) noexcept nogil:
    """Parse ``[d0, d1, ...]`` or ``d0,d1,...`` (ASCII) into ``out``; return the rank, or -1
    on any error.

    Mirrors descriptor.parse_shape step for step; the bounded length was checked by the
    caller, digit runs are bounded by ``r.max_digits`` so the accumulator never overflows.
    """
    cdef Py_ssize_t i = 0, start
    cdef int rank = 0
    cdef bint bracket
    cdef uint64_t v
    cdef unsigned char ch
    while i < n and r.ws[<unsigned char>s[i]]:
        i += 1
    bracket = i < n and s[i] == b'['
    if bracket:
        i += 1
    while True:
        while i < n and r.ws[<unsigned char>s[i]]:
            i += 1
        if bracket and i < n and s[i] == b']' and rank == 0:
            i += 1
            break
        if i < n and s[i] == b'-':
            return -1
        start = i
        v = 0
        while i < n:
            ch = <unsigned char>s[i]
            if ch < 48 or ch > 57:
                break
            if i - start < r.max_digits:
                v = v * 10 + (ch - 48)
            i += 1
        if i == start or i - start > r.max_digits or v > r.max_dim:
            return -1
        if rank == r.max_rank:
            return -1
        out[rank] = <int64_t>v
        rank += 1
        while i < n and r.ws[<unsigned char>s[i]]:
            i += 1
        if i < n and s[i] == b',':
            i += 1
            continue
        if bracket and i < n and s[i] == b']':
            i += 1
            break
        if not bracket and i == n:
            break
        return -1
    while i < n and r.ws[<unsigned char>s[i]]:
        i += 1
    if i != n or rank == 0:
        return -1
    return rank


cdef inline bint _shape_nbytes(const int64_t* shape, int rank, int64_t itemsize,
                               int64_t* out) noexcept nogil:
    """``itemsize * prod(shape)`` step by step like descriptor.shape_nbytes; False on overflow."""
    cdef int64_t total = itemsize
    cdef int i
    for i in range(rank):
        if lumen_mul_overflow(total, shape[i], &total):
            return False
    out[0] = total
    return True


cdef inline bint _uint_ascii(const char* p, Py_ssize_t n, int max_digits,
                             int64_t* out) noexcept nogil:
    """1..max_digits ASCII digits -> ``out``; False for anything else."""
    cdef int64_t acc = 0
    cdef Py_ssize_t i
    if n < 1 or n > max_digits:
        return False
    for i in range(n):
        if p[i] < b'0' or p[i] > b'9':
            return False
        acc = acc * 10 + (p[i] - 48)
    out[0] = acc
    return True


cdef inline int _bool_ascii(const name_table_t* spellings, const char* p,
                            Py_ssize_t n) noexcept nogil:
    """1 / 0 for an accepted boolean spelling (ASCII case-insensitive), -1 otherwise.

    ``spellings`` holds the lower-case spellings with their value in ``a``.
    """
    cdef char buf[CAP_BOOL_CHARS]
    cdef Py_ssize_t i
    cdef int j
    if n > CAP_BOOL_CHARS:
        return -1
    for i in range(n):
        buf[i] = p[i] + 32 if b'A' <= p[i] <= b'Z' else p[i]
    j = _find(spellings, buf, n)
    return -1 if j < 0 else <int>spellings.a[j]


cdef inline int _first_bad_dim(const desc_t* d, const int64_t* bounds,
                               int64_t unbounded) noexcept nogil:
    """First axis outside its ``(lo, hi)`` pair, -1 when all hold (SPEC check 9)."""
    cdef int axis
    for axis in range(d.rank):
        if d.shape[axis] < bounds[2 * axis] or (
                bounds[2 * axis + 1] != unbounded and d.shape[axis] > bounds[2 * axis + 1]):
            return axis
    return -1
