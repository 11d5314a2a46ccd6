"""The ``lumen.*`` metadata contract (SPEC section 2), defined once.

This module is the single home of the reserved keys, the dtype and layout tables and the
``TensorContract`` a task declares.  It also holds the pure-Python twin of
``csrc/descriptor.pyx``: :func:`parse_meta` turns a request's ``meta`` into a validated
:class:`Descriptor` or raises a distinct :class:`~lumen_core.errors.InvalidArgument` whose
``field`` names the key at fault.  The compiled twin imports these tables and must behave
identically (the test suite checks that with hypothesis), so every rule below is written as a
small, ordered check that the C code mirrors one to one.

Order of checks (both implementations):

0. one pass over ``meta``: keys must be ``str``; ``lumen.*`` keys must be known, with ``str``
   values no longer than ``MAX_META_VALUE_CHARS`` (first offender in iteration order wins);
1. request keys: input kind, priority, timeout, sequence id/start/end, preprocess.skip;
2. raw route: tensor keys are refused, preprocess id / model id / version are checked;
3. tensor route, SPEC order: dtype, shape, layout (+ rank), payload length, preprocess id,
   batch dimension, model id / version, format / byte order, the task's per-dimension rules.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping, Optional, Sequence

import numpy as np

from .errors import InvalidArgument

# --------------------------------------------------------------------------- reserved keys
KEY_INPUT_KIND = "lumen.input.kind"
KEY_DTYPE = "lumen.tensor.dtype"
KEY_SHAPE = "lumen.tensor.shape"
KEY_LAYOUT = "lumen.tensor.layout"
KEY_FORMAT = "lumen.tensor.format"
KEY_BYTE_ORDER = "lumen.tensor.byte_order"
KEY_PREPROCESS_ID = "lumen.preprocess.id"
KEY_PREPROCESS_SKIP = "lumen.preprocess.skip"
KEY_MODEL_ID = "lumen.model.id"
KEY_MODEL_VERSION = "lumen.model.version"
KEY_SEQUENCE_ID = "lumen.sequence.id"
KEY_SEQUENCE_START = "lumen.sequence.start"
KEY_SEQUENCE_END = "lumen.sequence.end"
KEY_PRIORITY = "lumen.priority"
KEY_TIMEOUT_MS = "lumen.timeout_ms"

#: ``field`` used when the payload length disagrees with dtype x shape.
FIELD_PAYLOAD = "payload"

RESERVED_KEYS = frozenset(
    {
        KEY_INPUT_KIND, KEY_DTYPE, KEY_SHAPE, KEY_LAYOUT, KEY_FORMAT, KEY_BYTE_ORDER,
        KEY_PREPROCESS_ID, KEY_PREPROCESS_SKIP, KEY_MODEL_ID, KEY_MODEL_VERSION,
        KEY_SEQUENCE_ID, KEY_SEQUENCE_START, KEY_SEQUENCE_END, KEY_PRIORITY, KEY_TIMEOUT_MS,
    }
)
#: keys that only make sense on the tensor route
TENSOR_KEYS = (KEY_DTYPE, KEY_SHAPE, KEY_LAYOUT, KEY_FORMAT, KEY_BYTE_ORDER)
RESERVED_PREFIX = "lumen."

# Response meta keys written by the runtime.
RESP_BATCH_SIZE = "lumen.batch.size"
RESP_QUEUE_US = "lumen.queue_us"
RESP_COMPUTE_US = "lumen.compute_us"
#: the input's token count (ragged inputs); the OpenAI-compatible ``usage`` sums it
RESP_TOKENS = "lumen.tokens"

# --------------------------------------------------------------------------- limits
MAX_META_VALUE_CHARS = 1024  # any lumen.* value; bounds the work on hostile input
MAX_SHAPE_CHARS = 256  # a rank-8 shape of 19-digit dims fits comfortably
MAX_RANK = 8
MAX_DIM_DIGITS = 19
MAX_PRIORITY_DIGITS = 9
MAX_TIMEOUT_DIGITS = 12
MAX_SEQUENCE_ID_CHARS = 256
INT64_MAX = (1 << 63) - 1

# --------------------------------------------------------------------------- dtypes, layouts
#: dtype name -> numpy dtype (little-endian on the wire)
DTYPES: dict[str, np.dtype] = {
    "fp32": np.dtype("<f4"),
    "fp16": np.dtype("<f2"),
    "uint8": np.dtype("u1"),
    "int64": np.dtype("<i8"),
    "int32": np.dtype("<i4"),
    "int8": np.dtype("i1"),
    "bool": np.dtype("?"),
}
DTYPE_SIZES: dict[str, int] = {name: dt.itemsize for name, dt in DTYPES.items()}
#: numpy dtype -> our name (for ``for_tensor_array`` and the generic onnx backend)
DTYPE_NAMES: dict[np.dtype, str] = {dt.newbyteorder("="): name for name, dt in DTYPES.items()}
#: ONNX ``TensorProto`` element type (stable enum values) -> our name
ONNX_ELEM_TYPES = {1: "fp32", 10: "fp16", 2: "uint8", 7: "int64", 6: "int32", 3: "int8", 9: "bool"}


@dataclass(frozen=True)
class Layout:
    name: str
    rank: int
    batch_axis: Optional[int]  # None: the layout has no batch axis


LAYOUTS: dict[str, Layout] = {
    lay.name: lay
    for lay in (
        Layout("N", 1, 0),
        Layout("NC", 2, 0),
        Layout("NL", 2, 0),
        Layout("NCL", 3, 0),
        Layout("NLC", 3, 0),
        Layout("NCHW", 4, 0),
        Layout("NHWC", 4, 0),
        Layout("NCDHW", 5, 0),
        Layout("NDHWC", 5, 0),
        Layout("C", 1, None),
        Layout("L", 1, None),
        Layout("HW", 2, None),
        Layout("CHW", 3, None),
        Layout("HWC", 3, None),
    )
}
#: the default layout a generic model input of rank r gets
DEFAULT_LAYOUT_FOR_RANK = {1: "N", 2: "NC", 3: "NCL", 4: "NCHW", 5: "NCDHW"}

UNBOUNDED = -1  # upper bound of a DimRange with no maximum


@dataclass(frozen=True)
class TensorSpec:
    """One tensor signature a task accepts on the tensor route.

    ``dims`` holds one ``(lo, hi)`` pair per dimension (batch axis included); ``hi`` may be
    ``UNBOUNDED``.  A fixed size ``n`` is ``(n, n)``; token ids ``[1, L]`` with
    ``1 <= L <= 256`` are ``((1, 1), (1, 256))``.
    """

    dtype: str
    layout: str
    preprocess_ids: frozenset
    dims: tuple

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}")
        lay = LAYOUTS.get(self.layout)
        if lay is None:
            raise ValueError(f"unknown layout {self.layout!r}")
        if len(self.dims) != lay.rank:
            raise ValueError(f"layout {self.layout} has rank {lay.rank}, dims {self.dims}")
        object.__setattr__(self, "preprocess_ids", frozenset(self.preprocess_ids))
        object.__setattr__(self, "dims", tuple((int(lo), int(hi)) for lo, hi in self.dims))

    def describe(self) -> dict:
        shape = [lo if lo == hi else [lo, None if hi == UNBOUNDED else hi] for lo, hi in self.dims]
        return {"dtype": self.dtype, "layout": self.layout, "shape": shape,
                "preprocess_ids": sorted(self.preprocess_ids)}


@dataclass(frozen=True)
class TensorContract:
    """What a task accepts on the tensor route, plus its effective model identity."""

    specs: tuple = ()
    model_id: str = ""
    model_version: str = "1"
    #: preprocess ids a raw request may name (the recipe the backend applies itself)
    raw_preprocess_ids: frozenset = frozenset()
    # derived lookups (filled in __post_init__; the compiled parser reads them directly)
    dtypes: frozenset = field(init=False, repr=False)
    layouts: frozenset = field(init=False, repr=False)
    preprocess_ids: frozenset = field(init=False, repr=False)
    index: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        specs = tuple(self.specs)
        object.__setattr__(self, "specs", specs)
        object.__setattr__(self, "raw_preprocess_ids", frozenset(self.raw_preprocess_ids))
        object.__setattr__(self, "dtypes", frozenset(s.dtype for s in specs))
        object.__setattr__(self, "layouts", frozenset(s.layout for s in specs))
        object.__setattr__(
            self, "preprocess_ids", frozenset(p for s in specs for p in s.preprocess_ids)
        )
        index = {}
        for i, s in enumerate(specs):
            for p in s.preprocess_ids:
                index.setdefault((s.dtype, s.layout, p), i)
        object.__setattr__(self, "index", index)

    def describe(self) -> dict:
        return {"model_id": self.model_id, "model_version": self.model_version,
                "tensor_signatures": [s.describe() for s in self.specs],
                "raw_preprocess_ids": sorted(self.raw_preprocess_ids)}


# --------------------------------------------------------------------------- parse result
class Descriptor:
    """A request's validated ``lumen.*`` metadata.

    ``kind`` is ``"raw"`` or ``"tensor"``; tensor fields are None on the raw route.
    ``priority`` / ``timeout_ms`` are 0 when the request does not set them.
    ``spec_index`` is the index of the matching :class:`TensorSpec` (-1 on the raw route).
    """

    __slots__ = ("kind", "dtype", "shape", "layout", "preprocess_id", "model_id",
                 "model_version", "nbytes", "spec_index", "priority", "timeout_ms",
                 "sequence_id", "sequence_start", "sequence_end")

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
        return tuple(getattr(self, k) for k in Descriptor.__slots__)

    def __eq__(self, other):
        return hasattr(other, "astuple") and self.astuple() == other.astuple()

    def __repr__(self):
        return "Descriptor(" + ", ".join(f"{k}={getattr(self, k)!r}" for k in self.__slots__) + ")"


EMPTY_CONTRACT = TensorContract()

# --------------------------------------------------------------------------- helpers
_WS = " \t\r\n"
_TRUE = ("true", "1")
_FALSE = ("false", "0")


def _bad(field_: Optional[str], message: str) -> InvalidArgument:
    return InvalidArgument(message, field_)


def _short(value: str, limit: int = 40) -> str:
    """Quote a hostile value for an error message without echoing all of it."""
    return repr(value if len(value) <= limit else value[:limit] + "...")


def _parse_bool(key: str, value: str) -> bool:
    low = value.lower()
    if low in _TRUE:
        return True
    if low in _FALSE:
        return False
    raise _bad(key, f"{key} must be 'true' or 'false', got {_short(value)}")


def _parse_uint(key: str, value: str, max_digits: int, what: str) -> int:
    if not value or len(value) > max_digits or not all("0" <= c <= "9" for c in value):
        raise _bad(key, f"{key} must be {what} (at most {max_digits} digits), got {_short(value)}")
    return int(value)


def parse_shape(text: str) -> tuple:
    """Parse ``[d0, d1, ...]`` into a tuple of non-negative ints; raise on anything else.

    Hand-written (not ``json.loads``) so the work is bounded and identical to the C parser.
    """
    if len(text) > MAX_SHAPE_CHARS:
        raise _bad(KEY_SHAPE, f"{KEY_SHAPE} is {len(text)} characters long; "
                              f"at most {MAX_SHAPE_CHARS} are accepted")
    n = len(text)
    i = 0
    while i < n and text[i] in _WS:
        i += 1
    if i >= n or text[i] != "[":
        raise _bad(KEY_SHAPE, f"{KEY_SHAPE} must be a JSON array of ints like [1,3,224,224], "
                              f"got {_short(text)}")
    i += 1
    dims = []
    while True:
        while i < n and text[i] in _WS:
            i += 1
        if i < n and text[i] == "]" and not dims:
            i += 1
            break
        if i < n and text[i] == "-":
            raise _bad(KEY_SHAPE, f"{KEY_SHAPE} has a negative dimension: {_short(text)}")
        start = i
        while i < n and "0" <= text[i] <= "9":
            i += 1
        if i == start:
            raise _bad(KEY_SHAPE, f"{KEY_SHAPE} must contain only non-negative integers, "
                                  f"got {_short(text)}")
        if i - start > MAX_DIM_DIGITS or int(text[start:i]) > INT64_MAX:
            raise _bad(KEY_SHAPE, f"{KEY_SHAPE} has a dimension that overflows int64: "
                                  f"{_short(text)}")
        if len(dims) == MAX_RANK:
            raise _bad(KEY_SHAPE, f"{KEY_SHAPE} has rank above {MAX_RANK}: {_short(text)}")
        dims.append(int(text[start:i]))
        while i < n and text[i] in _WS:
            i += 1
        if i < n and text[i] == ",":
            i += 1
            continue
        if i < n and text[i] == "]":
            i += 1
            break
        raise _bad(KEY_SHAPE, f"{KEY_SHAPE} must be a JSON array of ints like [1,3,224,224], "
                              f"got {_short(text)}")
    while i < n and text[i] in _WS:
        i += 1
    if i != n:
        raise _bad(KEY_SHAPE, f"{KEY_SHAPE} has trailing characters: {_short(text)}")
    if not dims:
        raise _bad(KEY_SHAPE, f"{KEY_SHAPE} must have rank 1..{MAX_RANK}, got []")
    return tuple(dims)


def shape_nbytes(shape: Sequence[int], itemsize: int) -> int:
    """``itemsize * prod(shape)``; raise when it would overflow int64 (never wrap around)."""
    total = itemsize
    for d in shape:
        total *= d
        if total > INT64_MAX:
            raise _bad(KEY_SHAPE, f"{KEY_SHAPE} {list(shape)} describes more than 2**63-1 bytes")
    return total


def _names(values: Iterable[str]) -> str:
    return ", ".join(sorted(values)) or "(none)"


# --------------------------------------------------------------------------- parse_meta
def parse_meta(meta: Optional[Mapping], payload_nbytes: int,
               contract: TensorContract = EMPTY_CONTRACT) -> Descriptor:
    """Validate ``meta`` against ``contract`` (pure-Python twin of the compiled parser)."""
    vals: dict = {}
    if meta:
        items = getattr(meta, "items", None)
        if items is None:
            raise _bad(None, f"meta must be a mapping of str to str, got {type(meta).__name__}")
        for key, value in items():
            if not isinstance(key, str):
                raise _bad(None, f"meta keys must be strings, got {type(key).__name__}")
            if not key.startswith(RESERVED_PREFIX):
                continue
            if key not in RESERVED_KEYS:
                raise _bad(key, f"unknown reserved key {_short(key)}; known lumen.* keys: "
                                f"{_names(RESERVED_KEYS)}")
            if not isinstance(value, str):
                raise _bad(key, f"{key} must be a string, got {type(value).__name__}")
            if len(value) > MAX_META_VALUE_CHARS:
                raise _bad(key, f"{key} is {len(value)} characters long; at most "
                                f"{MAX_META_VALUE_CHARS} are accepted")
            vals[key] = value
    d = Descriptor()
    if not vals:
        return d
    get = vals.get
    _parse_request_keys(d, get)
    if d.kind == "raw":
        _check_raw(d, get, contract)
    else:
        _check_tensor(d, get, payload_nbytes, contract)
    return d


def _parse_request_keys(d: Descriptor, get) -> None:
    kind = get(KEY_INPUT_KIND)
    if kind is not None:
        if kind not in ("raw", "tensor"):
            raise _bad(KEY_INPUT_KIND, f"{KEY_INPUT_KIND} must be 'raw' or 'tensor', "
                                       f"got {_short(kind)}")
        d.kind = kind
    v = get(KEY_PRIORITY)
    if v is not None:
        d.priority = _parse_uint(KEY_PRIORITY, v, MAX_PRIORITY_DIGITS, "an integer >= 1")
        if d.priority < 1:
            raise _bad(KEY_PRIORITY, f"{KEY_PRIORITY} must be >= 1 (1 is the highest)")
    v = get(KEY_TIMEOUT_MS)
    if v is not None:
        d.timeout_ms = _parse_uint(KEY_TIMEOUT_MS, v, MAX_TIMEOUT_DIGITS,
                                   "a positive number of milliseconds")
        if d.timeout_ms < 1:
            raise _bad(KEY_TIMEOUT_MS, f"{KEY_TIMEOUT_MS} must be >= 1")
    v = get(KEY_SEQUENCE_ID)
    if v is not None:
        if not v or len(v) > MAX_SEQUENCE_ID_CHARS:
            raise _bad(KEY_SEQUENCE_ID, f"{KEY_SEQUENCE_ID} must be a non-empty string of at "
                                        f"most {MAX_SEQUENCE_ID_CHARS} characters")
        d.sequence_id = v
    v = get(KEY_SEQUENCE_START)
    if v is not None:
        d.sequence_start = _parse_bool(KEY_SEQUENCE_START, v)
    v = get(KEY_SEQUENCE_END)
    if v is not None:
        d.sequence_end = _parse_bool(KEY_SEQUENCE_END, v)
    v = get(KEY_PREPROCESS_SKIP)
    if v is not None:
        skip = _parse_bool(KEY_PREPROCESS_SKIP, v)
        if skip and d.kind == "raw":
            raise _bad(KEY_PREPROCESS_SKIP, f"{KEY_PREPROCESS_SKIP}=true needs "
                                            f"{KEY_INPUT_KIND}=tensor")
        if not skip and d.kind == "tensor":
            raise _bad(KEY_PREPROCESS_SKIP, f"tensor inputs are already preprocessed; "
                                            f"{KEY_PREPROCESS_SKIP}=false is contradictory")


def _check_model(d: Descriptor, get, contract: TensorContract) -> None:
    v = get(KEY_MODEL_ID)
    if v is not None:
        if v != contract.model_id:
            raise _bad(KEY_MODEL_ID, f"{KEY_MODEL_ID} {_short(v)} does not match the task's "
                                     f"model {contract.model_id!r} (the task routes, never the model id)")
        d.model_id = v
    v = get(KEY_MODEL_VERSION)
    if v is not None:
        if v != contract.model_version:
            raise _bad(KEY_MODEL_VERSION, f"{KEY_MODEL_VERSION} {_short(v)} does not match the "
                                          f"task's model version {contract.model_version!r}")
        d.model_version = v


def _check_raw(d: Descriptor, get, contract: TensorContract) -> None:
    for key in TENSOR_KEYS:
        if get(key) is not None:
            raise _bad(key, f"{key} is only valid with {KEY_INPUT_KIND}=tensor")
    v = get(KEY_PREPROCESS_ID)
    if v is not None:
        if v not in contract.raw_preprocess_ids:
            raise _bad(KEY_PREPROCESS_ID, f"raw input is preprocessed with "
                                          f"{_names(contract.raw_preprocess_ids)}, not {_short(v)}")
        d.preprocess_id = v
    _check_model(d, get, contract)


def _check_tensor(d: Descriptor, get, payload_nbytes: int, contract: TensorContract) -> None:
    # 1. dtype
    dtype = get(KEY_DTYPE)
    if dtype is None:
        raise _bad(KEY_DTYPE, f"{KEY_DTYPE} is required for tensor input")
    if dtype not in DTYPES:
        raise _bad(KEY_DTYPE, f"unknown dtype {_short(dtype)}; known: {_names(DTYPES)}")
    if dtype not in contract.dtypes:
        raise _bad(KEY_DTYPE, f"dtype {dtype} is not accepted by this task; accepted: "
                              f"{_names(contract.dtypes)}")
    # 2. shape
    text = get(KEY_SHAPE)
    if text is None:
        raise _bad(KEY_SHAPE, f"{KEY_SHAPE} is required for tensor input")
    shape = parse_shape(text)
    nbytes = shape_nbytes(shape, DTYPE_SIZES[dtype])
    # 3. layout
    layout = get(KEY_LAYOUT)
    if layout is None:
        raise _bad(KEY_LAYOUT, f"{KEY_LAYOUT} is required for tensor input; accepted: "
                               f"{_names(contract.layouts)}")
    lay = LAYOUTS.get(layout)
    if lay is None:
        raise _bad(KEY_LAYOUT, f"unknown layout {_short(layout)}; known: {_names(LAYOUTS)}")
    if layout not in contract.layouts:
        raise _bad(KEY_LAYOUT, f"layout {layout} is not accepted by this task; accepted: "
                               f"{_names(contract.layouts)}")
    if lay.rank != len(shape):
        raise _bad(KEY_LAYOUT, f"layout {layout} has rank {lay.rank} but the shape "
                               f"{list(shape)} has rank {len(shape)}")
    # 4. payload length
    if payload_nbytes != nbytes:
        raise _bad(FIELD_PAYLOAD, f"payload is {payload_nbytes} bytes but {dtype} "
                                  f"{list(shape)} needs exactly {nbytes}")
    # 5. preprocess id
    pp = get(KEY_PREPROCESS_ID)
    if pp is None:
        raise _bad(KEY_PREPROCESS_ID, f"{KEY_PREPROCESS_ID} is required for tensor input; "
                                      f"accepted: {_names(contract.preprocess_ids)}")
    if pp not in contract.preprocess_ids:
        raise _bad(KEY_PREPROCESS_ID, f"preprocess id {_short(pp)} is not accepted by this "
                                      f"task; accepted: {_names(contract.preprocess_ids)}")
    # 6. no payload batches
    if lay.batch_axis is not None and shape[lay.batch_axis] != 1:
        raise _bad(KEY_SHAPE, f"the batch dimension of {list(shape)} must be 1: send many "
                              f"inputs as many requests, batching is the runtime's job")
    # 7. model id / version
    _check_model(d, get, contract)
    # 8. format / byte order
    v = get(KEY_FORMAT)
    if v is not None and v != "contiguous":
        raise _bad(KEY_FORMAT, f"{KEY_FORMAT} must be 'contiguous', got {_short(v)}")
    v = get(KEY_BYTE_ORDER)
    if v is not None and v != "little":
        raise _bad(KEY_BYTE_ORDER, f"{KEY_BYTE_ORDER} must be 'little', got {_short(v)}")
    # 9. the task's per-dimension constraints
    idx = contract.index.get((dtype, layout, pp))
    if idx is None:
        raise _bad(KEY_PREPROCESS_ID, f"no tensor signature of this task has dtype={dtype} "
                                      f"layout={layout} preprocess={pp}; accepted: "
                                      f"{[s.describe() for s in contract.specs]}")
    for axis, ((lo, hi), dim) in enumerate(zip(contract.specs[idx].dims, shape, strict=True)):
        if dim < lo or (hi != UNBOUNDED and dim > hi):
            want = str(lo) if lo == hi else (f"{lo} <= d" + ("" if hi == UNBOUNDED else f" <= {hi}"))
            raise _bad(KEY_SHAPE, f"dimension {axis} of {list(shape)} is {dim}; "
                                  f"this task needs {want}")
    d.dtype = dtype
    d.shape = shape
    d.layout = layout
    d.preprocess_id = pp
    d.nbytes = nbytes
    d.spec_index = idx
