"""The ``lumen.*`` metadata contract (SPEC section 2), defined once: the tables.

This module is the single home of the reserved keys, the limits, the dtype and layout tables
and the ``TensorContract`` a task declares.  The rules that check a request's ``meta`` against
them live in :mod:`lumen_core.request_path.descriptor` (``parse_meta``, the pure-Python twin) and
``csrc/_descriptor.pyx`` (compiled); both read every table from here, so no second list of
keys, dtypes or layouts exists anywhere else.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import numpy as np

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
#: sticky key of a task's traffic split: the same key lands on the same version while the
#: split is unchanged (lumen_core/versions.py)
KEY_ROUTE_KEY = "lumen.route.key"
#: embedding tasks: keep the first D components, then L2-normalise again
KEY_EMBEDDING_DIMENSIONS = "lumen.embedding.dimensions"
#: embedding tasks: the element type of the returned vector (see ``EMBEDDING_TYPES``)
KEY_EMBEDDING_TYPE = "lumen.embedding.type"
#: vad segment options (lumen_core/tasks/vad_segments.py checks their values)
KEY_VAD_THRESHOLD = "lumen.vad.threshold"
KEY_VAD_MIN_SPEECH_DURATION_MS = "lumen.vad.min_speech_duration_ms"
KEY_VAD_MIN_SILENCE_DURATION_MS = "lumen.vad.min_silence_duration_ms"
KEY_VAD_SPEECH_PAD_MS = "lumen.vad.speech_pad_ms"
KEY_VAD_MAX_SPEECH_DURATION_S = "lumen.vad.max_speech_duration_s"
#: ``true`` on a sequence's start request (gRPC InferStream): replies carry the segment events
#: each chunk settles, as JSON, under the same key of their meta
KEY_VAD_EVENTS = "lumen.vad.events"
VAD_KEYS = frozenset({KEY_VAD_THRESHOLD, KEY_VAD_MIN_SPEECH_DURATION_MS,
                      KEY_VAD_MIN_SILENCE_DURATION_MS, KEY_VAD_SPEECH_PAD_MS,
                      KEY_VAD_MAX_SPEECH_DURATION_S, KEY_VAD_EVENTS})

#: ``field`` used when the payload length disagrees with dtype x shape.
FIELD_PAYLOAD = "payload"

RESERVED_KEYS = frozenset(
    {
        KEY_INPUT_KIND, KEY_DTYPE, KEY_SHAPE, KEY_LAYOUT, KEY_FORMAT, KEY_BYTE_ORDER,
        KEY_PREPROCESS_ID, KEY_PREPROCESS_SKIP, KEY_MODEL_ID, KEY_MODEL_VERSION,
        KEY_SEQUENCE_ID, KEY_SEQUENCE_START, KEY_SEQUENCE_END, KEY_PRIORITY, KEY_TIMEOUT_MS,
        KEY_EMBEDDING_DIMENSIONS, KEY_EMBEDDING_TYPE, KEY_ROUTE_KEY,
    }
) | VAD_KEYS
#: keys that only make sense on the tensor route
TENSOR_KEYS = (KEY_DTYPE, KEY_SHAPE, KEY_LAYOUT, KEY_FORMAT, KEY_BYTE_ORDER)
RESERVED_PREFIX = "lumen."

# Response meta keys written by the runtime.
RESP_BATCH_SIZE = "lumen.batch.size"
RESP_QUEUE_US = "lumen.queue_us"
RESP_COMPUTE_US = "lumen.compute_us"
#: the input's token count (ragged inputs); the OpenAI-compatible ``usage`` sums it
RESP_TOKENS = "lumen.tokens"
#: ``"true"`` when the input was cut to the task's token limit (absent otherwise)
RESP_TRUNCATED = "lumen.truncated"
#: the version of the task that served the request (every response carries it)
RESP_MODEL_VERSION = "lumen.model.version"
#: on a task with ``[tasks.cache]``: ``hit`` (served from the cache), ``miss`` (computed and
#: stored) or ``coalesced`` (waited for an identical computation); see cache.py
RESP_CACHE = "lumen.cache"

# --------------------------------------------------------------------------- limits
MAX_META_VALUE_CHARS = 1024  # any lumen.* value; bounds the work on hostile input
MAX_SHAPE_CHARS = 256  # a rank-8 shape of 19-digit dims fits comfortably
MAX_RANK = 8
MAX_DIM_DIGITS = 19
MAX_PRIORITY_DIGITS = 9
MAX_TIMEOUT_DIGITS = 12
MAX_SEQUENCE_ID_CHARS = 256
MAX_EMBEDDING_DIM_DIGITS = 9
INT64_MAX = (1 << 63) - 1

# --------------------------------------------------------------------------- embeddings
#: ``lumen.embedding.type`` values -> the dtype name of the vector returned (infinity's set):
#: ``float`` fp32; ``int8`` / ``uint8`` scalar quantisation over ``EMBEDDING_QUANT_RANGE``;
#: ``binary`` / ``ubinary`` the sign bits (x > 0) packed MSB first, ceil(D / 8) bytes
#: (``binary`` = ``ubinary`` - 128 as int8, as sentence-transformers and infinity define it)
EMBEDDING_TYPES: dict[str, str] = {"float": "fp32", "int8": "int8", "uint8": "uint8",
                                   "binary": "int8", "ubinary": "uint8"}
#: the fixed range of int8 / uint8 quantisation: every component of an L2-normalised vector
#: lies in it, so none saturates; 256 levels of width (hi - lo) / 255 (see tasks/embedding_output.py)
EMBEDDING_QUANT_RANGE = (-1.0, 1.0)

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
#: dtypes a CORRID control input may have (Triton's), beyond the tensor dtypes: the sequence id
#: as an unsigned or signed 64-bit integer, or as a string
CORRID_DTYPES: dict[str, np.dtype] = {"uint64": np.dtype("<u8"), "int64": np.dtype("<i8"),
                                      "string": np.dtype(object)}
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


#: the most distinct (dtype, rank, layout, preprocess id) keys a contract remembers
MAX_IMPLIED_MEMO = 256


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
    #: (dtype, rank, layout, preprocess id) -> what :meth:`implied` found (the contract is
    #: immutable; a client sends a handful of distinct keys)
    implied_memo: dict = field(init=False, repr=False, compare=False)

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
        object.__setattr__(self, "implied_memo", {})

    def implied(self, dtype: str, rank: int, layout: Optional[str] = None,
                preprocess_id: Optional[str] = None) -> tuple:
        """``(layout, preprocess id)`` for a tensor of ``dtype`` and ``rank`` that leaves them
        out: see :func:`implied_signature`."""
        key = (dtype, rank, layout, preprocess_id)
        memo = self.implied_memo
        found = memo.get(key)
        if found is None:
            found = implied_signature(((s.dtype, s.layout, len(s.dims), s.preprocess_ids)
                                       for s in self.specs), dtype, rank, layout, preprocess_id)
            if len(memo) < MAX_IMPLIED_MEMO:
                memo[key] = found
        return found

    def describe(self) -> dict:
        return {"model_id": self.model_id, "model_version": self.model_version,
                "tensor_signatures": [s.describe() for s in self.specs],
                "raw_preprocess_ids": sorted(self.raw_preprocess_ids)}


def implied_signature(signatures: Iterable, dtype: str, rank: int,
                      layout: Optional[str] = None,
                      preprocess_id: Optional[str] = None) -> tuple:
    """``(layout, preprocess id)`` a task's tensor signatures leave one choice of, for a tensor
    of ``dtype`` and ``rank``: each the given one, else the only one the signatures of that
    dtype and rank (and of the other, when given) have, else None (several choices, or none;
    a layout left open counts every layout's ids).

    The one home of this rule: the tensor route's parser (``descriptor.parse_meta`` and its
    compiled twin) applies it to a request that leaves a key out, OIP to an input without
    ``lumen.*`` parameters, ``lumen infer`` to a ``.npy`` file (over ``/v1/tasks``, as
    ``(dtype, layout, rank, preprocess ids)`` tuples), so ``curl`` needs neither key when the
    task accepts one of each.
    """
    sigs = [(lay, ids) for dt, lay, rk, ids in signatures
            if dt == dtype and rk == rank and (layout is None or lay == layout)
            and (preprocess_id is None or preprocess_id in ids)]
    if layout is None:
        layouts = {lay for lay, _ in sigs}
        layout = layouts.pop() if len(layouts) == 1 else None
    if preprocess_id is None:
        found = {p for lay, ids in sigs if layout is None or lay == layout for p in ids}
        preprocess_id = found.pop() if len(found) == 1 else None
    return layout, preprocess_id


#: the contract of a task that accepts no tensor input (``parse_meta``'s default)
EMPTY_CONTRACT = TensorContract()
