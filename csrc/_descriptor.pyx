# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Descriptor parse + validate, compiled (twin of ``lumen_core.request_path.descriptor.parse_meta``).

Why compiled: every request -- raw or tensor -- passes through ``parse_meta`` before it may
queue, so its cost is paid per request on the event loop.  The pure twin builds a dict of the
``lumen.*`` values and runs ~30 Python-level checks (~10 us for a tensor request); here one
pass over the meta dict (``PyDict_Next``) fills a small C struct, the checks read that struct,
and Python objects are made only for the result.

Shape of the code follows asyncpg's ``frb.pxd``: the C struct (``desc_t``), its tables and the
``nogil`` inline helpers (the shape parser, overflow-checked multiplication, table lookups by
length + ``memcmp``) live in ``_descriptor.pxd``; this file fills the tables at import and
holds the checks.  Every table -- reserved keys, dtypes and their sizes, layouts, limits -- is
read from ``lumen_core.contract``, every spelling (whitespace, booleans, the one accepted
value of a key) from ``lumen_core.request_path.descriptor``; this module holds no second list of them.

Behaviour is the pure twin's, check for check, in the order documented in descriptor.py: same
exception class, same ``field``, same message.  Only the accept path is written here: where a
check fails, the pure twin's error builder (``err_*``) or parser (``parse_shape``,
``shape_nbytes``, ``parse_priority``, ``parse_timeout_ms``, ``parse_bool``) is called on that
cold path, so every message has one home.  Strings are judged by their character data (a
``str`` subclass is treated like the ``str`` it holds).

A ``TensorContract`` is read once into a cached ``_ContractView`` (accepted dtypes/layouts as
C flags, signatures and per-dimension bounds as packed C arrays): contracts are immutable
(frozen dataclasses), so the per-request checks never look up attributes.
"""
from cpython.dict cimport PyDict_CheckExact, PyDict_Next, PyDict_Size
from cpython.long cimport PyLong_FromLongLong
from cpython.object cimport PyObject
from cpython.ref cimport Py_INCREF
from cpython.tuple cimport PyTuple_New, PyTuple_SET_ITEM
from libc.stdint cimport int64_t, uint64_t
from libc.string cimport memcmp, memset

cimport cython

# the struct, capacities and nogil helpers: ``_descriptor.pxd`` beside this file, cimported by
# its plain name (Cython looks for a module's own .pxd under lumen_core/, and csrc/ is not a
# package); it declares no Python-level objects, so nothing is imported at run time
from _descriptor cimport (
    CAP_BOOL_CHARS,
    CAP_DIGITS,
    CAP_KEYS,
    CAP_RANK,
    CAP_TABLE,
    FLAG_SEQ_END,
    FLAG_SEQ_START,
    KIND_RAW,
    KIND_TENSOR,
    _bool_ascii,
    _find,
    _first_bad_dim,
    _parse_shape,
    _shape_nbytes,
    _uint_ascii,
    desc_t,
    name_table_t,
    shape_rules_t,
)

from array import array as _array

from lumen_core import contract as _c
from lumen_core.request_path import descriptor as _py
from lumen_core.errors import InternalError

__all__ = list(_py.__all__)


cdef extern from "Python.h":
    # Borrowed-pointer views of PEP 393 strings (no encoding, no allocation).
    bint PyUnicode_Check(PyObject* o)
    bint PyUnicode_IS_ASCII(PyObject* o)
    Py_ssize_t PyUnicode_GET_LENGTH(PyObject* o)
    unsigned int PyUnicode_KIND(PyObject* o)
    void* PyUnicode_DATA(PyObject* o)
    Py_UCS4 PyUnicode_READ(unsigned int kind, void* data, Py_ssize_t index)
    bint PyLong_CheckExact(PyObject* o)
    long long PyLong_AsLongLongAndOverflow(object o, int* overflow) except? -1


# ---------------------------------------------------------------- tables from the contract
cdef object _EMPTY_CONTRACT = _c.EMPTY_CONTRACT

cdef object KEY_INPUT_KIND = _c.KEY_INPUT_KIND
cdef object KEY_DTYPE = _c.KEY_DTYPE
cdef object KEY_SHAPE = _c.KEY_SHAPE
cdef object KEY_LAYOUT = _c.KEY_LAYOUT
cdef object KEY_FORMAT = _c.KEY_FORMAT
cdef object KEY_BYTE_ORDER = _c.KEY_BYTE_ORDER
cdef object KEY_PREPROCESS_ID = _c.KEY_PREPROCESS_ID
cdef object KEY_PREPROCESS_SKIP = _c.KEY_PREPROCESS_SKIP
cdef object KEY_MODEL_ID = _c.KEY_MODEL_ID
cdef object KEY_MODEL_VERSION = _c.KEY_MODEL_VERSION
cdef object KEY_SEQUENCE_ID = _c.KEY_SEQUENCE_ID
cdef object KEY_SEQUENCE_START = _c.KEY_SEQUENCE_START
cdef object KEY_SEQUENCE_END = _c.KEY_SEQUENCE_END
cdef object KEY_PRIORITY = _c.KEY_PRIORITY
cdef object KEY_TIMEOUT_MS = _c.KEY_TIMEOUT_MS
cdef object FIELD_PAYLOAD = _c.FIELD_PAYLOAD

cdef Py_ssize_t MAX_META_VALUE_CHARS = _c.MAX_META_VALUE_CHARS
cdef Py_ssize_t MAX_SHAPE_CHARS = _c.MAX_SHAPE_CHARS
cdef int MAX_RANK = _c.MAX_RANK
cdef int MAX_DIM_DIGITS = _c.MAX_DIM_DIGITS
cdef int MAX_PRIORITY_DIGITS = _c.MAX_PRIORITY_DIGITS
cdef int MAX_TIMEOUT_DIGITS = _c.MAX_TIMEOUT_DIGITS
cdef Py_ssize_t MAX_SEQUENCE_ID_CHARS = _c.MAX_SEQUENCE_ID_CHARS
cdef int64_t INT64_MAX = _c.INT64_MAX
cdef int64_t UNBOUNDED = _c.UNBOUNDED

if MAX_RANK > CAP_RANK or MAX_DIM_DIGITS > CAP_DIGITS or len(_c.RESERVED_KEYS) > CAP_KEYS:
    raise ImportError("lumen_core.request_path._descriptor was compiled for smaller contract limits; rebuild it")

# Values with one accepted spelling (the pure twin's constants).
cdef object V_RAW = _py.KIND_RAW
cdef object V_TENSOR = _py.KIND_TENSOR
cdef object V_CONTIGUOUS = _py.FORMAT_CONTIGUOUS
cdef object V_LITTLE = _py.BYTE_ORDER_LITTLE

# The pure twin's cold path: error builders and the parsers that own a message.
cdef object err_meta_not_mapping = _py.err_meta_not_mapping
cdef object err_key_not_str = _py.err_key_not_str
cdef object err_key_unknown = _py.err_key_unknown
cdef object err_value_not_str = _py.err_value_not_str
cdef object err_value_too_long = _py.err_value_too_long
cdef object err_input_kind = _py.err_input_kind
cdef object err_sequence_id = _py.err_sequence_id
cdef object err_skip_needs_tensor = _py.err_skip_needs_tensor
cdef object err_skip_contradicts_tensor = _py.err_skip_contradicts_tensor
cdef object err_tensor_key_on_raw = _py.err_tensor_key_on_raw
cdef object err_raw_preprocess_id = _py.err_raw_preprocess_id
cdef object err_model_id = _py.err_model_id
cdef object err_model_version = _py.err_model_version
cdef object err_required = _py.err_required
cdef object err_dtype_unknown = _py.err_dtype_unknown
cdef object err_dtype_refused = _py.err_dtype_refused
cdef object err_layout_unknown = _py.err_layout_unknown
cdef object err_layout_refused = _py.err_layout_refused
cdef object err_layout_rank = _py.err_layout_rank
cdef object err_payload = _py.err_payload
cdef object err_preprocess_refused = _py.err_preprocess_refused
cdef object err_batch_dim = _py.err_batch_dim
cdef object err_format = _py.err_format
cdef object err_byte_order = _py.err_byte_order
cdef object err_no_signature = _py.err_no_signature
cdef object err_dim = _py.err_dim
cdef object _py_parse_shape = _py.parse_shape
cdef object _py_shape_nbytes = _py.shape_nbytes
cdef object _py_parse_priority = _py.parse_priority
cdef object _py_parse_timeout_ms = _py.parse_timeout_ms
cdef object _py_parse_bool = _py.parse_bool
cdef object _short = _py._short


cdef object _disagree(str check, object value):
    """The error for a C test that refused what the pure twin's ``check`` accepts (a bug)."""
    return InternalError(f"lumen_core.request_path._descriptor refused {_short(str(value))}; "
                         f"lumen_core.request_path.descriptor.{check} accepts it", KEY_SHAPE)

# Everything the C tables point into stays alive here.
cdef list _keep = []


cdef const char* _ascii_ptr(object s, Py_ssize_t* n) except NULL:
    """Pointer to the ASCII bytes of ``s`` (kept alive in ``_keep``)."""
    if not isinstance(s, str) or not PyUnicode_IS_ASCII(<PyObject*>s):
        raise ImportError(f"contract table entry {s!r} must be an ASCII str")
    _keep.append(s)
    n[0] = PyUnicode_GET_LENGTH(<PyObject*>s)
    return <const char*>PyUnicode_DATA(<PyObject*>s)


cdef int _fill(name_table_t* t, object names, object a, object b) except -1:
    t.n = 0
    for i, name in enumerate(names):
        if i >= CAP_TABLE:
            raise ImportError("lumen_core.request_path._descriptor: contract table larger than CAP_TABLE")
        t.data[i] = _ascii_ptr(name, &t.length[i])
        t.a[i] = a[i]
        t.b[i] = b[i]
        t.n += 1
    return 0


# reserved keys: slot = position in sorted(RESERVED_KEYS); a = b = unused
cdef tuple _KEY_OBJS = tuple(sorted(_c.RESERVED_KEYS))
cdef name_table_t KEYS
_fill(&KEYS, _KEY_OBJS, [0] * len(_KEY_OBJS), [0] * len(_KEY_OBJS))
cdef PyObject* KEY_PTRS[CAP_KEYS]
for _i, _k in enumerate(_KEY_OBJS):
    KEY_PTRS[_i] = <PyObject*>_k

cdef int S_KIND = _KEY_OBJS.index(KEY_INPUT_KIND)
cdef int S_DTYPE = _KEY_OBJS.index(KEY_DTYPE)
cdef int S_SHAPE = _KEY_OBJS.index(KEY_SHAPE)
cdef int S_LAYOUT = _KEY_OBJS.index(KEY_LAYOUT)
cdef int S_FORMAT = _KEY_OBJS.index(KEY_FORMAT)
cdef int S_BYTE_ORDER = _KEY_OBJS.index(KEY_BYTE_ORDER)
cdef int S_PP_ID = _KEY_OBJS.index(KEY_PREPROCESS_ID)
cdef int S_PP_SKIP = _KEY_OBJS.index(KEY_PREPROCESS_SKIP)
cdef int S_MODEL_ID = _KEY_OBJS.index(KEY_MODEL_ID)
cdef int S_MODEL_VERSION = _KEY_OBJS.index(KEY_MODEL_VERSION)
cdef int S_SEQ_ID = _KEY_OBJS.index(KEY_SEQUENCE_ID)
cdef int S_SEQ_START = _KEY_OBJS.index(KEY_SEQUENCE_START)
cdef int S_SEQ_END = _KEY_OBJS.index(KEY_SEQUENCE_END)
cdef int S_PRIORITY = _KEY_OBJS.index(KEY_PRIORITY)
cdef int S_TIMEOUT = _KEY_OBJS.index(KEY_TIMEOUT_MS)

# keys refused on the raw route, in the contract's order
cdef int N_TENSOR_KEYS = len(_c.TENSOR_KEYS)
cdef int TENSOR_SLOTS[CAP_KEYS]
for _i, _k in enumerate(_c.TENSOR_KEYS):
    TENSOR_SLOTS[_i] = _KEY_OBJS.index(_k)

cdef const char* PREFIX
cdef Py_ssize_t PREFIX_LEN
PREFIX = _ascii_ptr(_c.RESERVED_PREFIX, &PREFIX_LEN)

# dtypes: a = itemsize
cdef tuple _DTYPE_OBJS = tuple(_c.DTYPES)
cdef name_table_t DTYPES
_fill(&DTYPES, _DTYPE_OBJS, [_c.DTYPE_SIZES[n] for n in _DTYPE_OBJS], [0] * len(_DTYPE_OBJS))

# layouts: a = rank, b = batch axis (-1: none)
cdef tuple _LAYOUT_OBJS = tuple(_c.LAYOUTS)
cdef name_table_t LAYOUTS
_fill(&LAYOUTS, _LAYOUT_OBJS, [_c.LAYOUTS[n].rank for n in _LAYOUT_OBJS],
      [-1 if _c.LAYOUTS[n].batch_axis is None else _c.LAYOUTS[n].batch_axis
       for n in _LAYOUT_OBJS])

# boolean spellings (lower case): a = the value
cdef tuple _BOOL_OBJS = tuple(_py.TRUE_SPELLINGS) + tuple(_py.FALSE_SPELLINGS)
cdef name_table_t BOOLS
_fill(&BOOLS, _BOOL_OBJS, [1] * len(_py.TRUE_SPELLINGS) + [0] * len(_py.FALSE_SPELLINGS),
      [0] * len(_BOOL_OBJS))
for _k in _BOOL_OBJS:
    if _k != _k.lower() or len(_k) > CAP_BOOL_CHARS:
        raise ImportError(f"boolean spelling {_k!r} must be lower case and short")

# what the shape parser accepts
cdef shape_rules_t SHAPE
memset(&SHAPE, 0, sizeof(SHAPE))
for _k in _py.SHAPE_WHITESPACE:
    if ord(_k) > 127:
        raise ImportError(f"shape whitespace {_k!r} must be ASCII")
    SHAPE.ws[ord(_k)] = True
SHAPE.max_rank = MAX_RANK
SHAPE.max_digits = MAX_DIM_DIGITS
SHAPE.max_dim = <uint64_t>INT64_MAX


# ---------------------------------------------------------------- string views (GIL, no refs)
cdef inline bint _has_prefix(PyObject* s) noexcept:
    """``s.startswith(RESERVED_PREFIX)`` on the character data, any string kind."""
    cdef Py_ssize_t i
    cdef unsigned int kind
    cdef void* data
    if PyUnicode_GET_LENGTH(s) < PREFIX_LEN:
        return False
    kind = PyUnicode_KIND(s)
    data = PyUnicode_DATA(s)
    if kind == 1:
        return memcmp(data, PREFIX, PREFIX_LEN) == 0
    for i in range(PREFIX_LEN):
        if PyUnicode_READ(kind, data, i) != <Py_UCS4>PREFIX[i]:
            return False
    return True


cdef inline int _key_slot(PyObject* k) noexcept:
    """Slot of a reserved key: identity with the contract's constants first, then the data."""
    cdef int i
    for i in range(KEYS.n):
        if KEY_PTRS[i] == k:
            return i
    if not PyUnicode_IS_ASCII(k):
        return -1
    return _find(&KEYS, <const char*>PyUnicode_DATA(k), PyUnicode_GET_LENGTH(k))


cdef inline int _lookup(const name_table_t* t, PyObject* s) noexcept:
    if not PyUnicode_IS_ASCII(s):
        return -1
    return _find(t, <const char*>PyUnicode_DATA(s), PyUnicode_GET_LENGTH(s))


cdef inline bint _equals(PyObject* s, object literal) noexcept:
    """``s == literal`` for an ASCII ``literal``."""
    cdef Py_ssize_t n = PyUnicode_GET_LENGTH(<PyObject*>literal)
    return (PyUnicode_IS_ASCII(s) and PyUnicode_GET_LENGTH(s) == n
            and memcmp(PyUnicode_DATA(s), PyUnicode_DATA(<PyObject*>literal), n) == 0)


# ---------------------------------------------------------------- the result
@cython.freelist(64)
cdef class Descriptor:
    """A request's validated ``lumen.*`` metadata (same attributes as descriptor.Descriptor).

    ``kind`` is ``"raw"`` or ``"tensor"``; tensor fields are None on the raw route.
    ``priority`` / ``timeout_ms`` are 0 when the request does not set them.
    ``spec_index`` is the index of the matching TensorSpec (-1 on the raw route).
    """

    cdef public object kind, dtype, shape, layout, preprocess_id, model_id, model_version
    cdef public object nbytes, spec_index, priority, timeout_ms
    cdef public object sequence_id, sequence_start, sequence_end

    def __init__(self, kind="raw", dtype=None, shape=None, layout=None, preprocess_id=None,
                 model_id=None, model_version=None, nbytes=0, spec_index=-1, priority=0,
                 timeout_ms=0, sequence_id=None, sequence_start=False, sequence_end=False):
        self.kind = kind
        self.dtype = dtype
        self.shape = shape
        self.layout = layout
        self.preprocess_id = preprocess_id
        self.model_id = model_id
        self.model_version = model_version
        self.nbytes = nbytes
        self.spec_index = spec_index
        self.priority = priority
        self.timeout_ms = timeout_ms
        self.sequence_id = sequence_id
        self.sequence_start = sequence_start
        self.sequence_end = sequence_end

    def astuple(self) -> tuple:
        """The fields in ``descriptor.Descriptor.__slots__`` order."""
        return (self.kind, self.dtype, self.shape, self.layout, self.preprocess_id,
                self.model_id, self.model_version, self.nbytes, self.spec_index,
                self.priority, self.timeout_ms, self.sequence_id, self.sequence_start,
                self.sequence_end)

    def __eq__(self, other):
        return hasattr(other, "astuple") and self.astuple() == other.astuple()

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = None

    def __repr__(self):
        return "Descriptor(" + ", ".join(
            f"{k}={v!r}" for k, v in zip(_py.Descriptor.__slots__, self.astuple())) + ")"

    def __reduce__(self):
        return (Descriptor, self.astuple())


for _k in _py.Descriptor.__slots__:
    if not hasattr(Descriptor, _k):
        raise ImportError(f"compiled Descriptor lacks the field {_k!r} of the pure twin's")


cdef inline Descriptor _new_descriptor():
    """The defaults of descriptor.Descriptor() without running ``__init__``."""
    cdef Descriptor o = Descriptor.__new__(Descriptor)
    o.kind = V_RAW
    o.nbytes = 0
    o.spec_index = -1
    o.priority = 0
    o.timeout_ms = 0
    o.sequence_start = False
    o.sequence_end = False
    return o


# ---------------------------------------------------------------- step 0: one pass over meta
cdef int _take(desc_t* d, PyObject* k, PyObject* v) except -1:
    cdef int slot
    if not PyUnicode_Check(k):
        raise err_key_not_str(<object>k)
    if not _has_prefix(k):
        return 0
    slot = _key_slot(k)
    if slot < 0:
        raise err_key_unknown(<object>k)
    if not PyUnicode_Check(v):
        raise err_value_not_str(<object>k, <object>v)
    if PyUnicode_GET_LENGTH(v) > MAX_META_VALUE_CHARS:
        raise err_value_too_long(<object>k, PyUnicode_GET_LENGTH(v))
    if d.vals[slot] == NULL:
        d.n_lumen += 1
    d.vals[slot] = v
    return 0


cdef object _collect(desc_t* d, object meta):
    """Fill ``d.vals``; return the object that keeps the borrowed values alive.

    An exact dict is walked with PyDict_Next (its values stay owned by ``meta``); any other
    mapping goes through ``.items()`` like the pure twin, each value kept in a list.
    """
    cdef Py_ssize_t pos = 0
    cdef PyObject* k
    cdef PyObject* v
    cdef list keep
    if PyDict_CheckExact(meta):
        while PyDict_Next(meta, &pos, &k, &v):
            _take(d, k, v)
        return meta
    keep = []
    items = getattr(meta, "items", None)
    if items is None:
        raise err_meta_not_mapping(meta)
    for key, value in items():
        keep.append(value)
        _take(d, <PyObject*>key, <PyObject*>value)
    return keep


# ---------------------------------------------------------------- step 1: request keys
cdef int64_t _uint(desc_t* d, int slot, int max_digits, object parse) except -1:
    """A positive integer key: ASCII digits >= 1 in C, else ``parse`` (the pure twin's)."""
    cdef PyObject* v = d.vals[slot]
    cdef int64_t out
    if PyUnicode_IS_ASCII(v) and _uint_ascii(<const char*>PyUnicode_DATA(v),
                                             PyUnicode_GET_LENGTH(v), max_digits, &out) \
            and out >= 1:
        return out
    # cold: the pure twin's parser raises with its message
    return parse(<object>v)


cdef int _bool(desc_t* d, int slot, object key) except -1:
    cdef PyObject* v = d.vals[slot]
    cdef int r = -1
    if PyUnicode_IS_ASCII(v):
        r = _bool_ascii(&BOOLS, <const char*>PyUnicode_DATA(v), PyUnicode_GET_LENGTH(v))
    if r >= 0:
        return r
    # cold: the pure twin's parser raises (or accepts a spelling only str.lower() knows)
    return 1 if _py_parse_bool(key, <object>v) else 0


cdef int _request_keys(desc_t* d) except -1:
    cdef PyObject* v = d.vals[S_KIND]
    cdef Py_ssize_t n
    cdef int skip
    if v != NULL:
        if _equals(v, V_RAW):
            d.kind = KIND_RAW
        elif _equals(v, V_TENSOR):
            d.kind = KIND_TENSOR
        else:
            raise err_input_kind(<object>v)
    if d.vals[S_PRIORITY] != NULL:
        d.priority = _uint(d, S_PRIORITY, MAX_PRIORITY_DIGITS, _py_parse_priority)
    if d.vals[S_TIMEOUT] != NULL:
        d.timeout_ms = _uint(d, S_TIMEOUT, MAX_TIMEOUT_DIGITS, _py_parse_timeout_ms)
    v = d.vals[S_SEQ_ID]
    if v != NULL:
        n = PyUnicode_GET_LENGTH(v)
        if n == 0 or n > MAX_SEQUENCE_ID_CHARS:
            raise err_sequence_id()
    if d.vals[S_SEQ_START] != NULL and _bool(d, S_SEQ_START, KEY_SEQUENCE_START):
        d.flags |= FLAG_SEQ_START
    if d.vals[S_SEQ_END] != NULL and _bool(d, S_SEQ_END, KEY_SEQUENCE_END):
        d.flags |= FLAG_SEQ_END
    if d.vals[S_PP_SKIP] != NULL:
        skip = _bool(d, S_PP_SKIP, KEY_PREPROCESS_SKIP)
        if skip and d.kind == KIND_RAW:
            raise err_skip_needs_tensor()
        if not skip and d.kind == KIND_TENSOR:
            raise err_skip_contradicts_tensor()
    return 0


# ---------------------------------------------------------------- the contract, prepared
cdef class _ContractView:
    """A TensorContract's attributes and derived C tables, read once.

    Like a prepared statement: the per-request checks index C arrays instead of looking up
    attributes and building ``(dtype, layout, pp)`` tuples.  ``TensorContract`` is frozen, so
    views of it are cached by identity (a strong reference keeps the id from being reused);
    any other contract-like object gets a fresh view per call.
    """

    cdef object contract
    cdef object dtypes, layouts, preprocess_ids, raw_preprocess_ids, index, specs
    cdef object model_id, model_version
    cdef bint dtype_ok[CAP_TABLE]
    cdef bint layout_ok[CAP_TABLE]
    # preprocess id -> bytes of int32 triples (dtype index, layout index, spec index), one per
    # contract.index entry with that id; every accepted id is a key (maybe with b"")
    cdef dict by_pp
    # spec index -> bytes of int64 (lo, hi) pairs, or None when a bound does not fit int64
    cdef list spec_dims

    def __cinit__(self, contract):
        self.contract = contract
        self.dtypes = contract.dtypes
        self.layouts = contract.layouts
        self.preprocess_ids = contract.preprocess_ids
        self.raw_preprocess_ids = contract.raw_preprocess_ids
        self.index = contract.index
        self.specs = contract.specs
        self.model_id = contract.model_id
        self.model_version = contract.model_version
        for i in range(DTYPES.n):
            self.dtype_ok[i] = _DTYPE_OBJS[i] in self.dtypes
        for i in range(LAYOUTS.n):
            self.layout_ok[i] = _LAYOUT_OBJS[i] in self.layouts
        triples = {pp: [] for pp in self.preprocess_ids}
        for (dtype, layout, pp), idx in self.index.items():
            if pp in triples and dtype in _DTYPE_OBJS and layout in _LAYOUT_OBJS:
                triples[pp].extend((_DTYPE_OBJS.index(dtype), _LAYOUT_OBJS.index(layout), idx))
        self.by_pp = {pp: _array("i", t).tobytes() for pp, t in triples.items()}
        self.spec_dims = []
        for spec in self.specs:
            bounds = [b for pair in spec.dims for b in pair]
            exact = all(type(b) is int and -INT64_MAX - 1 <= b <= INT64_MAX for b in bounds)
            self.spec_dims.append(_array("q", bounds).tobytes() if exact else None)


#: contracts whose views are kept (one per task in practice); past it the cache starts over
MAX_CACHED_CONTRACTS = 64
cdef dict _views = {}
cdef object _last_contract = None
cdef _ContractView _last_view = None
cdef object _TensorContract = _c.TensorContract


cdef _ContractView _view(object contract):
    global _last_contract, _last_view
    if contract is _last_contract:
        return _last_view
    if type(contract) is not _TensorContract:
        return _ContractView(contract)
    view = _views.get(id(contract))
    if view is None:
        if len(_views) >= MAX_CACHED_CONTRACTS:
            _views.clear()
        view = _ContractView(contract)
        _views[id(contract)] = view
    _last_contract = contract
    _last_view = view
    return view


# ---------------------------------------------------------------- step 2: raw route
cdef int _check_model(desc_t* d, _ContractView c) except -1:
    cdef PyObject* v = d.vals[S_MODEL_ID]
    if v != NULL and <object>v != c.model_id:
        raise err_model_id(<object>v, c.model_id)
    v = d.vals[S_MODEL_VERSION]
    if v != NULL and <object>v != c.model_version:
        raise err_model_version(<object>v, c.model_version)
    return 0


cdef int _check_raw(desc_t* d, _ContractView c) except -1:
    cdef int i
    cdef PyObject* v
    for i in range(N_TENSOR_KEYS):
        if d.vals[TENSOR_SLOTS[i]] != NULL:
            raise err_tensor_key_on_raw(_KEY_OBJS[TENSOR_SLOTS[i]])
    v = d.vals[S_PP_ID]
    if v != NULL and <object>v not in c.raw_preprocess_ids:
        raise err_raw_preprocess_id(<object>v, c.raw_preprocess_ids)
    return _check_model(d, c)


# ---------------------------------------------------------------- step 3: tensor route
cdef list _shape_list(desc_t* d):
    return [d.shape[i] for i in range(d.rank)]


cdef tuple _shape_tuple(desc_t* d):
    cdef tuple t = PyTuple_New(d.rank)
    cdef int i
    for i in range(d.rank):
        item = PyLong_FromLongLong(d.shape[i])
        Py_INCREF(item)
        PyTuple_SET_ITEM(t, i, item)
    return t


cdef int _tensor_shape(desc_t* d, _ContractView c) except -1:
    """dtype, shape and byte length (SPEC checks 1 and 2)."""
    cdef PyObject* v = d.vals[S_DTYPE]
    cdef Py_ssize_t n
    if v == NULL:
        raise err_required(KEY_DTYPE)
    d.dtype = _lookup(&DTYPES, v)
    if d.dtype < 0:
        raise err_dtype_unknown(<object>v)
    if not c.dtype_ok[d.dtype]:
        raise err_dtype_refused(_DTYPE_OBJS[d.dtype], c.dtypes)
    v = d.vals[S_SHAPE]
    if v == NULL:
        raise err_required(KEY_SHAPE)
    n = PyUnicode_GET_LENGTH(v)
    # a hostile length is refused here in O(1); a non-ASCII shape can only be an error.
    # No GIL release: a <= 256-byte parse is cheaper than releasing and re-acquiring it.
    d.rank = -1
    if n <= MAX_SHAPE_CHARS and PyUnicode_IS_ASCII(v):
        d.rank = _parse_shape(&SHAPE, <const char*>PyUnicode_DATA(v), n, d.shape)
    if d.rank < 0:
        _py_parse_shape(<object>v)  # cold: raises with the pure twin's message
        raise _disagree("parse_shape", <object>v)
    if not _shape_nbytes(d.shape, d.rank, DTYPES.a[d.dtype], &d.nbytes):
        _py_shape_nbytes(_shape_list(d), DTYPES.a[d.dtype])  # cold: raises
        raise _disagree("shape_nbytes", _shape_list(d))
    return 0


cdef int _check_layout(desc_t* d, _ContractView c) except -1:
    """SPEC check 3: known, accepted, rank matches the shape."""
    cdef PyObject* v = d.vals[S_LAYOUT]
    if v == NULL:
        raise err_required(KEY_LAYOUT, c.layouts)
    d.layout = _lookup(&LAYOUTS, v)
    if d.layout < 0:
        raise err_layout_unknown(<object>v)
    layout = _LAYOUT_OBJS[d.layout]
    if not c.layout_ok[d.layout]:
        raise err_layout_refused(layout, c.layouts)
    if LAYOUTS.a[d.layout] != d.rank:
        raise err_layout_rank(layout, LAYOUTS.a[d.layout], _shape_list(d))
    return 0


cdef int _payload_matches(desc_t* d, object payload_nbytes) except -1:
    cdef int overflow = 0
    cdef long long got
    if PyLong_CheckExact(<PyObject*>payload_nbytes):
        got = PyLong_AsLongLongAndOverflow(payload_nbytes, &overflow)
        return overflow == 0 and got == d.nbytes
    return not (payload_nbytes != d.nbytes)


cdef int _find_spec(desc_t* d, bytes triples) noexcept:
    """Spec index for (dtype, layout) among one preprocess id's signatures; -1 if none."""
    cdef const int* t = <const int*><const char*>triples
    cdef Py_ssize_t i, n = len(triples) // (3 * sizeof(int))
    for i in range(n):
        if t[3 * i] == d.dtype and t[3 * i + 1] == d.layout:
            return t[3 * i + 2]
    return -1


cdef int _check_dims(desc_t* d, _ContractView c, int idx) except -1:
    cdef object packed = c.spec_dims[idx]
    cdef int axis = -1, i = 0
    dims = c.specs[idx].dims
    if packed is not None and len(<bytes>packed) == <Py_ssize_t>(2 * d.rank * sizeof(int64_t)):
        axis = _first_bad_dim(d, <const int64_t*><const char*><bytes>packed, UNBOUNDED)
    else:  # bounds beyond int64 (or a duck-typed spec): compare as Python ints
        for lo, hi in dims:
            if i >= d.rank:
                break
            if d.shape[i] < lo or (hi != UNBOUNDED and d.shape[i] > hi):
                axis = i
                break
            i += 1
    if axis >= 0:
        lo, hi = dims[axis]
        raise err_dim(axis, _shape_list(d), lo, hi)
    return 0


cdef Descriptor _check_tensor(desc_t* d, object payload_nbytes, _ContractView c):
    cdef PyObject* v
    cdef int64_t batch_axis
    cdef int idx
    cdef object implied
    _tensor_shape(d, c)                         # 1. dtype, 2. shape
    if d.vals[S_LAYOUT] == NULL or d.vals[S_PP_ID] == NULL:
        # left out: the task's only choice, if it has one (cold: a hand-written request).
        # ``implied`` holds the strings while d.vals borrows them
        implied = c.contract.implied(
            _DTYPE_OBJS[d.dtype], d.rank,
            <object>d.vals[S_LAYOUT] if d.vals[S_LAYOUT] != NULL else None,
            <object>d.vals[S_PP_ID] if d.vals[S_PP_ID] != NULL else None)
        if d.vals[S_LAYOUT] == NULL and implied[0] is not None:
            d.vals[S_LAYOUT] = <PyObject*>implied[0]
        if d.vals[S_PP_ID] == NULL and implied[1] is not None:
            d.vals[S_PP_ID] = <PyObject*>implied[1]
    _check_layout(d, c)                         # 3. layout
    if not _payload_matches(d, payload_nbytes):  # 4. payload length
        raise err_payload(payload_nbytes, _DTYPE_OBJS[d.dtype], _shape_list(d), d.nbytes)
    v = d.vals[S_PP_ID]                         # 5. preprocess id
    if v == NULL:
        raise err_required(KEY_PREPROCESS_ID, c.preprocess_ids)
    pp = <object>v
    triples = c.by_pp.get(pp)
    if triples is None:
        raise err_preprocess_refused(pp, c.preprocess_ids)
    batch_axis = LAYOUTS.b[d.layout]            # 6. no payload batches
    if batch_axis >= 0 and d.shape[batch_axis] != 1:
        raise err_batch_dim(_shape_list(d))
    _check_model(d, c)                          # 7. model id / version
    v = d.vals[S_FORMAT]                        # 8. format / byte order
    if v != NULL and not _equals(v, V_CONTIGUOUS):
        raise err_format(<object>v)
    v = d.vals[S_BYTE_ORDER]
    if v != NULL and not _equals(v, V_LITTLE):
        raise err_byte_order(<object>v)
    idx = _find_spec(d, triples)                # 9. the task's per-dimension constraints
    if idx < 0:
        raise err_no_signature(_DTYPE_OBJS[d.dtype], _LAYOUT_OBJS[d.layout], pp, c.specs)
    _check_dims(d, c, idx)
    cdef Descriptor out = _new_descriptor()
    out.dtype = _DTYPE_OBJS[d.dtype]
    out.shape = _shape_tuple(d)
    out.layout = _LAYOUT_OBJS[d.layout]
    out.preprocess_id = pp
    out.nbytes = d.nbytes
    out.spec_index = idx
    return out


# ---------------------------------------------------------------- entry points
cdef inline void _fill_request_fields(Descriptor out, desc_t* d):
    cdef PyObject* v = d.vals[S_KIND]
    if v != NULL:
        out.kind = <object>v
    if d.priority:
        out.priority = d.priority
    if d.timeout_ms:
        out.timeout_ms = d.timeout_ms
    v = d.vals[S_SEQ_ID]
    if v != NULL:
        out.sequence_id = <object>v
    out.sequence_start = (d.flags & FLAG_SEQ_START) != 0
    out.sequence_end = (d.flags & FLAG_SEQ_END) != 0
    v = d.vals[S_MODEL_ID]
    if v != NULL:
        out.model_id = <object>v
    v = d.vals[S_MODEL_VERSION]
    if v != NULL:
        out.model_version = <object>v


def parse_meta(meta, payload_nbytes, contract=_EMPTY_CONTRACT) -> Descriptor:
    """Validate ``meta`` against ``contract``; see ``lumen_core.request_path.descriptor.parse_meta``."""
    cdef desc_t d
    cdef Descriptor out
    cdef PyObject* v
    if meta is None or (PyDict_Size(meta) == 0 if PyDict_CheckExact(meta) else not meta):
        return _new_descriptor()
    memset(&d, 0, sizeof(desc_t))
    keep = _collect(&d, meta)  # noqa: F841  (holds the borrowed value pointers alive)
    if d.n_lumen == 0:
        return _new_descriptor()
    _request_keys(&d)
    if d.kind == KIND_RAW:
        _check_raw(&d, _view(contract))
        out = _new_descriptor()
        v = d.vals[S_PP_ID]
        if v != NULL:
            out.preprocess_id = <object>v
    else:
        out = _check_tensor(&d, payload_nbytes, _view(contract))
    _fill_request_fields(out, &d)
    return out


def parse_shape(text: str) -> tuple:
    """Compiled ``descriptor.parse_shape``: ``[d0, d1, ...]`` -> tuple of non-negative ints."""
    cdef desc_t d
    cdef Py_ssize_t n
    if not isinstance(text, str):
        return _py_parse_shape(text)  # the pure twin's behaviour for a non-str, whatever it is
    n = PyUnicode_GET_LENGTH(<PyObject*>text)
    d.rank = -1
    if n <= MAX_SHAPE_CHARS and PyUnicode_IS_ASCII(<PyObject*>text):
        d.rank = _parse_shape(&SHAPE, <const char*>PyUnicode_DATA(<PyObject*>text), n, d.shape)
    if d.rank < 0:
        _py_parse_shape(text)  # cold: raises
        raise _disagree("parse_shape", text)
    return _shape_tuple(&d)
