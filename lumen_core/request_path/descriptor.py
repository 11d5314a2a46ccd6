"""Descriptor parse + validate: the pure-Python twin of ``csrc/_descriptor.pyx``.

:func:`parse_meta` turns a request's ``meta`` into a validated :class:`Descriptor` or raises a
distinct :class:`~lumen_core.errors.InvalidArgument` whose ``field`` names the key at fault.
The tables it checks against (reserved keys, dtypes, layouts, limits, ``TensorContract``) are
defined once in :mod:`lumen_core.contract`; this module is the definition of the *rules*.  The
compiled twin (``request_path._descriptor``) implements them over a C struct and, on its error
path, raises with the builders below (``err_*``, :func:`parse_shape`, :func:`parse_uint` ...),
so every message has one home; hypothesis checks that both twins agree, messages included.

Order of checks (both implementations):

0. one pass over ``meta``: keys must be ``str``; ``lumen.*`` keys must be known, with ``str``
   values no longer than ``MAX_META_VALUE_CHARS`` (first offender in iteration order wins);
1. request keys: input kind, priority, timeout, sequence id/start/end, preprocess.skip;
2. raw route: tensor keys are refused, preprocess id / model id / version are checked;
3. tensor route, SPEC order: dtype, shape, layout (+ rank), payload length, preprocess id,
   batch dimension, model id / version, format / byte order, the task's per-dimension rules.

Task options in the ``lumen.*`` namespace (``lumen.embedding.dimensions`` / ``.type``) pass
step 0 like every reserved key (both twins read ``RESERVED_KEYS``); their values depend on the
task (its embedding size), so the backend that honours them parses them with
:func:`embedding_options` below, which owns their messages.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from ..contract import (
    DTYPE_SIZES,
    DTYPES,
    EMBEDDING_TYPES,
    EMPTY_CONTRACT,
    FIELD_PAYLOAD,
    INT64_MAX,
    KEY_BYTE_ORDER,
    KEY_DTYPE,
    KEY_EMBEDDING_DIMENSIONS,
    KEY_EMBEDDING_TYPE,
    KEY_FORMAT,
    KEY_INPUT_KIND,
    KEY_LAYOUT,
    KEY_MODEL_ID,
    KEY_MODEL_VERSION,
    KEY_PREPROCESS_ID,
    KEY_PREPROCESS_SKIP,
    KEY_PRIORITY,
    KEY_SEQUENCE_END,
    KEY_SEQUENCE_ID,
    KEY_SEQUENCE_START,
    KEY_SHAPE,
    KEY_TIMEOUT_MS,
    LAYOUTS,
    MAX_DIM_DIGITS,
    MAX_EMBEDDING_DIM_DIGITS,
    MAX_META_VALUE_CHARS,
    MAX_PRIORITY_DIGITS,
    MAX_RANK,
    MAX_SEQUENCE_ID_CHARS,
    MAX_SHAPE_CHARS,
    MAX_TIMEOUT_DIGITS,
    RESERVED_KEYS,
    RESERVED_PREFIX,
    TENSOR_KEYS,
    UNBOUNDED,
    TensorContract,
)
from ..errors import InvalidArgument

#: the twin API (``lumen_core.request_path._descriptor`` exports the same)
__all__ = ["Descriptor", "parse_meta", "parse_shape"]

# --------------------------------------------------------------------------- spellings
#: whitespace allowed around the brackets, commas and digits of a shape
SHAPE_WHITESPACE = " \t\r\n"
#: accepted boolean spellings, lower case (values are matched case-insensitively)
TRUE_SPELLINGS = ("true", "1")
FALSE_SPELLINGS = ("false", "0")
#: the only accepted values of the keys that have one
KIND_RAW, KIND_TENSOR = "raw", "tensor"
FORMAT_CONTIGUOUS, BYTE_ORDER_LITTLE = "contiguous", "little"
#: how long a hostile value may be quoted in a message
QUOTE_CHARS = 40


# --------------------------------------------------------------------------- parse result
class Descriptor:
    """A request's validated ``lumen.*`` metadata.

    ``kind`` is ``"raw"`` or ``"tensor"``; tensor fields are None on the raw route.
    ``priority`` / ``timeout_ms`` are 0 when not set; ``spec_index`` is the index of the
    matching :class:`~lumen_core.contract.TensorSpec` (-1 on the raw route)."""

    __slots__ = ("kind", "dtype", "shape", "layout", "preprocess_id", "model_id",
                 "model_version", "nbytes", "spec_index", "priority", "timeout_ms",
                 "sequence_id", "sequence_start", "sequence_end")

    def __init__(self, kind: str = "raw", dtype: Optional[str] = None,
                 shape: Any = None, layout: Optional[str] = None,
                 preprocess_id: Optional[str] = None, model_id: Optional[str] = None,
                 model_version: Optional[str] = None, nbytes: int = 0, spec_index: int = -1,
                 priority: int = 0, timeout_ms: int = 0, sequence_id: Optional[str] = None,
                 sequence_start: bool = False, sequence_end: bool = False) -> None:
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

    def astuple(self) -> tuple[Any, ...]:
        return tuple(getattr(self, k) for k in Descriptor.__slots__)

    def __eq__(self, other: object) -> bool:  # either twin's descriptor compares alike
        astuple = getattr(other, "astuple", None)
        return astuple is not None and self.astuple() == astuple()

    def __repr__(self) -> str:
        return f"Descriptor({', '.join(f'{k}={getattr(self, k)!r}' for k in self.__slots__)})"


# --------------------------------------------------------------------------- message helpers
def _bad(field_: Optional[str], message: str) -> InvalidArgument:
    return InvalidArgument(message, field_)


def _names(values: Iterable[str]) -> str:
    return ", ".join(sorted(values)) or "(none)"


def _short(value: str, limit: int = QUOTE_CHARS) -> str:
    """Quote a hostile value for an error message without echoing all of it."""
    return repr(value if len(value) <= limit else value[:limit] + "...")


# --------------------------------------------------------------------------- error builders
# The cold path of both twins: each returns the InvalidArgument for one rule, for the caller to
# raise.  Shapes may be passed as any sequence of ints.
def err_meta_not_mapping(meta: object) -> InvalidArgument:
    return _bad(None, f"meta must be a mapping of str to str, got {type(meta).__name__}")


def err_key_not_str(key: object) -> InvalidArgument:
    return _bad(None, f"meta keys must be strings, got {type(key).__name__}")


def err_key_unknown(key: str) -> InvalidArgument:
    return _bad(key, f"unknown reserved key {_short(key)}; known lumen.* keys: "
                     f"{_names(RESERVED_KEYS)}")


def err_value_not_str(key: str, value: object) -> InvalidArgument:
    return _bad(key, f"{key} must be a string, got {type(value).__name__}")


def err_value_too_long(key: str, length: int) -> InvalidArgument:
    return _bad(key, f"{key} is {length} characters long; at most "
                     f"{MAX_META_VALUE_CHARS} are accepted")


def err_input_kind(value: str) -> InvalidArgument:
    return _bad(KEY_INPUT_KIND, f"{KEY_INPUT_KIND} must be '{KIND_RAW}' or '{KIND_TENSOR}', "
                                f"got {_short(value)}")


def err_sequence_id() -> InvalidArgument:
    return _bad(KEY_SEQUENCE_ID, f"{KEY_SEQUENCE_ID} must be a non-empty string of at "
                                 f"most {MAX_SEQUENCE_ID_CHARS} characters")


def err_skip_needs_tensor() -> InvalidArgument:
    return _bad(KEY_PREPROCESS_SKIP, f"{KEY_PREPROCESS_SKIP}=true needs "
                                     f"{KEY_INPUT_KIND}={KIND_TENSOR}")


def err_skip_contradicts_tensor() -> InvalidArgument:
    return _bad(KEY_PREPROCESS_SKIP, f"tensor inputs are already preprocessed; "
                                     f"{KEY_PREPROCESS_SKIP}=false is contradictory")


def err_tensor_key_on_raw(key: str) -> InvalidArgument:
    return _bad(key, f"{key} is only valid with {KEY_INPUT_KIND}={KIND_TENSOR}")


def err_raw_preprocess_id(value: str, accepted: Iterable[str]) -> InvalidArgument:
    return _bad(KEY_PREPROCESS_ID, f"raw input is preprocessed with "
                                   f"{_names(accepted)}, not {_short(value)}")


def err_model_id(value: str, model_id: str) -> InvalidArgument:
    return _bad(KEY_MODEL_ID, f"{KEY_MODEL_ID} {_short(value)} does not match the task's "
                              f"model {model_id!r} (the task routes, never the model id)")


def err_model_version(value: str, model_version: str) -> InvalidArgument:
    return _bad(KEY_MODEL_VERSION, f"{KEY_MODEL_VERSION} {_short(value)} does not match the "
                                   f"task's model version {model_version!r}")


def err_required(key: str, accepted: Optional[Iterable[str]] = None) -> InvalidArgument:
    """A tensor-route key that is missing (``accepted``: what the task takes, when it helps)."""
    tail = "" if accepted is None else f"; accepted: {_names(accepted)}"
    return _bad(key, f"{key} is required for tensor input{tail}")


def err_dtype_unknown(value: str) -> InvalidArgument:
    return _bad(KEY_DTYPE, f"unknown dtype {_short(value)}; known: {_names(DTYPES)}")


def err_dtype_refused(dtype: str, accepted: Iterable[str]) -> InvalidArgument:
    return _bad(KEY_DTYPE, f"dtype {dtype} is not accepted by this task; accepted: "
                           f"{_names(accepted)}")


def err_layout_unknown(value: str) -> InvalidArgument:
    return _bad(KEY_LAYOUT, f"unknown layout {_short(value)}; known: {_names(LAYOUTS)}")


def err_layout_refused(layout: str, accepted: Iterable[str]) -> InvalidArgument:
    return _bad(KEY_LAYOUT, f"layout {layout} is not accepted by this task; accepted: "
                            f"{_names(accepted)}")


def err_layout_rank(layout: str, rank: int, shape: Sequence[int]) -> InvalidArgument:
    return _bad(KEY_LAYOUT, f"layout {layout} has rank {rank} but the shape "
                            f"{list(shape)} has rank {len(shape)}")


def err_payload(payload_nbytes: object, dtype: str, shape: Sequence[int],
                nbytes: int) -> InvalidArgument:
    return _bad(FIELD_PAYLOAD, f"payload is {payload_nbytes} bytes but {dtype} "
                               f"{list(shape)} needs exactly {nbytes}")


def err_preprocess_refused(value: str, accepted: Iterable[str]) -> InvalidArgument:
    return _bad(KEY_PREPROCESS_ID, f"preprocess id {_short(value)} is not accepted by this "
                                   f"task; accepted: {_names(accepted)}")


def err_batch_dim(shape: Sequence[int]) -> InvalidArgument:
    return _bad(KEY_SHAPE, f"the batch dimension of {list(shape)} must be 1: send many "
                           f"inputs as many requests, batching is the runtime's job")


def err_format(value: str) -> InvalidArgument:
    return _bad(KEY_FORMAT, f"{KEY_FORMAT} must be '{FORMAT_CONTIGUOUS}', got {_short(value)}")


def err_byte_order(value: str) -> InvalidArgument:
    return _bad(KEY_BYTE_ORDER, f"{KEY_BYTE_ORDER} must be '{BYTE_ORDER_LITTLE}', "
                                f"got {_short(value)}")


def err_no_signature(dtype: str, layout: str, preprocess_id: str,
                     specs: Iterable[Any]) -> InvalidArgument:
    return _bad(KEY_PREPROCESS_ID, f"no tensor signature of this task has dtype={dtype} "
                                   f"layout={layout} preprocess={preprocess_id}; accepted: "
                                   f"{[s.describe() for s in specs]}")


def err_dim(axis: int, shape: Sequence[int], lo: int, hi: int) -> InvalidArgument:
    want = str(lo) if lo == hi else (f"{lo} <= d" + ("" if hi == UNBOUNDED else f" <= {hi}"))
    return _bad(KEY_SHAPE, f"dimension {axis} of {list(shape)} is {shape[axis]}; "
                           f"this task needs {want}")


# --------------------------------------------------------------------------- value parsers
def parse_bool(key: str, value: str) -> bool:
    low = value.lower()
    if low in TRUE_SPELLINGS:
        return True
    if low in FALSE_SPELLINGS:
        return False
    raise _bad(key, f"{key} must be 'true' or 'false', got {_short(value)}")


def parse_uint(key: str, value: str, max_digits: int, what: str) -> int:
    """1..``max_digits`` ASCII digits as an int; ``what`` names the expected value."""
    if not value or len(value) > max_digits or not all("0" <= c <= "9" for c in value):
        raise _bad(key, f"{key} must be {what} (at most {max_digits} digits), got {_short(value)}")
    return int(value)


def parse_priority(value: str) -> int:
    """``lumen.priority``: an integer >= 1 (1 is the highest)."""
    priority = parse_uint(KEY_PRIORITY, value, MAX_PRIORITY_DIGITS, "an integer >= 1")
    if priority < 1:
        raise _bad(KEY_PRIORITY, f"{KEY_PRIORITY} must be >= 1 (1 is the highest)")
    return priority


def parse_timeout_ms(value: str) -> int:
    """``lumen.timeout_ms``: a positive number of milliseconds."""
    timeout = parse_uint(KEY_TIMEOUT_MS, value, MAX_TIMEOUT_DIGITS,
                         "a positive number of milliseconds")
    if timeout < 1:
        raise _bad(KEY_TIMEOUT_MS, f"{KEY_TIMEOUT_MS} must be >= 1")
    return timeout


def parse_shape(text: str) -> tuple[int, ...]:
    """Parse ``[d0, d1, ...]`` (or the same without the brackets, ``d0,d1,...``: a query
    string needs no ``curl -g`` then) into a tuple of non-negative ints; raise on anything
    else.

    Hand-written (not ``json.loads``) so the work is bounded and identical to the C parser.
    """
    if len(text) > MAX_SHAPE_CHARS:
        raise _bad(KEY_SHAPE, f"{KEY_SHAPE} is {len(text)} characters long; "
                              f"at most {MAX_SHAPE_CHARS} are accepted")
    ws = SHAPE_WHITESPACE
    n = len(text)
    i = 0
    while i < n and text[i] in ws:
        i += 1
    bracket = i < n and text[i] == "["
    if bracket:
        i += 1
    dims: list[int] = []
    while True:
        while i < n and text[i] in ws:
            i += 1
        if bracket and i < n and text[i] == "]" and not dims:
            i += 1
            break
        if i < n and text[i] == "-":
            raise _bad(KEY_SHAPE, f"{KEY_SHAPE} has a negative dimension: {_short(text)}")
        start = i
        while i < n and "0" <= text[i] <= "9":
            i += 1
        if i == start:
            raise _bad(KEY_SHAPE, f"{KEY_SHAPE} must be non-negative integers like [1,3,224,224] "
                                  f"or 1,3,224,224, got {_short(text)}")
        if i - start > MAX_DIM_DIGITS or int(text[start:i]) > INT64_MAX:
            raise _bad(KEY_SHAPE, f"{KEY_SHAPE} has a dimension that overflows int64: "
                                  f"{_short(text)}")
        if len(dims) == MAX_RANK:
            raise _bad(KEY_SHAPE, f"{KEY_SHAPE} has rank above {MAX_RANK}: {_short(text)}")
        dims.append(int(text[start:i]))
        while i < n and text[i] in ws:
            i += 1
        if i < n and text[i] == ",":
            i += 1
            continue
        if bracket and i < n and text[i] == "]":
            i += 1
            break
        if not bracket and i == n:
            break
        raise _bad(KEY_SHAPE, f"{KEY_SHAPE} must be a list of ints like [1,3,224,224] (or "
                              f"1,3,224,224), got {_short(text)}")
    while i < n and text[i] in ws:
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


# --------------------------------------------------------------------------- task options
def parse_embedding_dimensions(value: str, dim: int) -> int:
    """``lumen.embedding.dimensions``: an integer in ``1..dim`` (the task's embedding size)."""
    what = f"an integer in 1..{dim} (the embedding size)"
    d = parse_uint(KEY_EMBEDDING_DIMENSIONS, value, MAX_EMBEDDING_DIM_DIGITS, what)
    if not 1 <= d <= dim:
        raise _bad(KEY_EMBEDDING_DIMENSIONS, f"{KEY_EMBEDDING_DIMENSIONS} must be {what}, got {d}")
    return d


def parse_embedding_type(value: str) -> str:
    """``lumen.embedding.type``: one of ``EMBEDDING_TYPES``."""
    if value not in EMBEDDING_TYPES:
        raise _bad(KEY_EMBEDDING_TYPE, f"{KEY_EMBEDDING_TYPE} must be one of "
                                       f"{', '.join(EMBEDDING_TYPES)}, got {_short(value)}")
    return value


def embedding_options(meta: Optional[Mapping[str, Any]], dim: int) -> tuple[int, str]:
    """``(dimensions, type)`` a request asks of an embedding task: ``(0, "float")`` when it
    sets neither key (0: every component).  Runs after :func:`parse_meta` accepted ``meta``,
    so the values are ``str`` of bounded length."""
    if not meta:
        return 0, "float"
    d = meta.get(KEY_EMBEDDING_DIMENSIONS)
    t = meta.get(KEY_EMBEDDING_TYPE)
    return (0 if d is None else parse_embedding_dimensions(d, dim),
            "float" if t is None else parse_embedding_type(t))


# --------------------------------------------------------------------------- parse_meta
def parse_meta(meta: Optional[Mapping[str, Any]], payload_nbytes: int,
               contract: TensorContract = EMPTY_CONTRACT) -> Descriptor:
    """Validate ``meta`` against ``contract`` (pure-Python twin of the compiled parser)."""
    vals: dict[str, Any] = {}
    if meta:
        items = getattr(meta, "items", None)
        if items is None:
            raise err_meta_not_mapping(meta)
        for key, value in items():
            if not isinstance(key, str):
                raise err_key_not_str(key)
            if not key.startswith(RESERVED_PREFIX):
                continue
            if key not in RESERVED_KEYS:
                raise err_key_unknown(key)
            if not isinstance(value, str):
                raise err_value_not_str(key, value)
            if len(value) > MAX_META_VALUE_CHARS:
                raise err_value_too_long(key, len(value))
            vals[key] = value
    d = Descriptor()
    if not vals:
        return d
    get = vals.get
    _parse_request_keys(d, get)
    if d.kind == KIND_RAW:
        _check_raw(d, get, contract)
    else:
        _check_tensor(d, get, payload_nbytes, contract)
    return d


def _parse_request_keys(d: Descriptor, get: Callable[[str], Any]) -> None:
    kind = get(KEY_INPUT_KIND)
    if kind is not None:
        if kind not in (KIND_RAW, KIND_TENSOR):
            raise err_input_kind(kind)
        d.kind = kind
    v = get(KEY_PRIORITY)
    if v is not None:
        d.priority = parse_priority(v)
    v = get(KEY_TIMEOUT_MS)
    if v is not None:
        d.timeout_ms = parse_timeout_ms(v)
    v = get(KEY_SEQUENCE_ID)
    if v is not None:
        if not v or len(v) > MAX_SEQUENCE_ID_CHARS:
            raise err_sequence_id()
        d.sequence_id = v
    v = get(KEY_SEQUENCE_START)
    if v is not None:
        d.sequence_start = parse_bool(KEY_SEQUENCE_START, v)
    v = get(KEY_SEQUENCE_END)
    if v is not None:
        d.sequence_end = parse_bool(KEY_SEQUENCE_END, v)
    v = get(KEY_PREPROCESS_SKIP)
    if v is not None:
        skip = parse_bool(KEY_PREPROCESS_SKIP, v)
        if skip and d.kind == KIND_RAW:
            raise err_skip_needs_tensor()
        if not skip and d.kind == KIND_TENSOR:
            raise err_skip_contradicts_tensor()


def _check_model(d: Descriptor, get: Callable[[str], Any], contract: TensorContract) -> None:
    v = get(KEY_MODEL_ID)
    if v is not None:
        if v != contract.model_id:
            raise err_model_id(v, contract.model_id)
        d.model_id = v
    v = get(KEY_MODEL_VERSION)
    if v is not None:
        if v != contract.model_version:
            raise err_model_version(v, contract.model_version)
        d.model_version = v


def _check_raw(d: Descriptor, get: Callable[[str], Any], contract: TensorContract) -> None:
    for key in TENSOR_KEYS:
        if get(key) is not None:
            raise err_tensor_key_on_raw(key)
    v = get(KEY_PREPROCESS_ID)
    if v is not None:
        if v not in contract.raw_preprocess_ids:
            raise err_raw_preprocess_id(v, contract.raw_preprocess_ids)
        d.preprocess_id = v
    _check_model(d, get, contract)


def _check_tensor(d: Descriptor, get: Callable[[str], Any], payload_nbytes: int, contract: TensorContract) -> None:
    # 1. dtype
    dtype = get(KEY_DTYPE)
    if dtype is None:
        raise err_required(KEY_DTYPE)
    if dtype not in DTYPES:
        raise err_dtype_unknown(dtype)
    if dtype not in contract.dtypes:
        raise err_dtype_refused(dtype, contract.dtypes)
    # 2. shape
    text = get(KEY_SHAPE)
    if text is None:
        raise err_required(KEY_SHAPE)
    shape = parse_shape(text)
    nbytes = shape_nbytes(shape, DTYPE_SIZES[dtype])
    # 3. layout (left out, with the preprocess id: the task's only choice, if it has one)
    layout = get(KEY_LAYOUT)
    pp = get(KEY_PREPROCESS_ID)
    if layout is None or pp is None:
        layout, pp = contract.implied(dtype, len(shape), layout, pp)
    if layout is None:
        raise err_required(KEY_LAYOUT, contract.layouts)
    lay = LAYOUTS.get(layout)
    if lay is None:
        raise err_layout_unknown(layout)
    if layout not in contract.layouts:
        raise err_layout_refused(layout, contract.layouts)
    if lay.rank != len(shape):
        raise err_layout_rank(layout, lay.rank, shape)
    # 4. payload length
    if payload_nbytes != nbytes:
        raise err_payload(payload_nbytes, dtype, shape, nbytes)
    # 5. preprocess id
    if pp is None:
        raise err_required(KEY_PREPROCESS_ID, contract.preprocess_ids)
    if pp not in contract.preprocess_ids:
        raise err_preprocess_refused(pp, contract.preprocess_ids)
    # 6. no payload batches
    if lay.batch_axis is not None and shape[lay.batch_axis] != 1:
        raise err_batch_dim(shape)
    # 7. model id / version
    _check_model(d, get, contract)
    # 8. format / byte order
    v = get(KEY_FORMAT)
    if v is not None and v != FORMAT_CONTIGUOUS:
        raise err_format(v)
    v = get(KEY_BYTE_ORDER)
    if v is not None and v != BYTE_ORDER_LITTLE:
        raise err_byte_order(v)
    # 9. the task's per-dimension constraints
    idx = contract.index.get((dtype, layout, pp))
    if idx is None:
        raise err_no_signature(dtype, layout, pp, contract.specs)
    for axis, ((lo, hi), dim) in enumerate(zip(contract.specs[idx].dims, shape, strict=True)):
        if dim < lo or (hi != UNBOUNDED and dim > hi):
            raise err_dim(axis, shape, lo, hi)
    d.dtype = dtype
    d.shape = shape
    d.layout = layout
    d.preprocess_id = pp
    d.nbytes = nbytes
    d.spec_index = idx
