"""Request model (SPEC section 1): InferRequest, TensorDescriptor, InferResponse, the builder.

The request is deliberately plain: a task name (the only routing key), a payload buffer, its
mime type and a ``dict[str, str]`` of metadata.  The builder only writes ``meta``, so a request
built by hand and one built with the builder are indistinguishable to the runtime, and the
HTTP / gRPC layers can build the same object from query parameters.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence

import numpy as np

from . import contract as C

MIME_OCTET_STREAM = "application/octet-stream"


def _meta_str(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


class InferRequest:
    """One logical input for one task.

    ``payload`` may be any C-contiguous buffer (bytes, bytearray, memoryview, numpy array); it is
    kept as given, never copied.
    """

    __slots__ = ("correlation_id", "task", "payload", "payload_mime", "meta")

    def __init__(self, task: str, payload: Any = b"", payload_mime: str = "",
                 meta: Optional[Dict[str, str]] = None, correlation_id: str = ""):
        self.task = task
        self.payload = payload
        self.payload_mime = payload_mime
        self.meta = {} if meta is None else meta
        self.correlation_id = correlation_id or uuid.uuid4().hex

    def __repr__(self) -> str:
        try:
            n = memoryview(self.payload).nbytes
        except TypeError:
            n = "?"
        return (f"InferRequest(task={self.task!r}, payload=<{n} bytes>, "
                f"payload_mime={self.payload_mime!r}, meta={self.meta!r}, "
                f"correlation_id={self.correlation_id!r})")


@dataclass(frozen=True)
class TensorDescriptor:
    """The caller's description of a tensor payload; becomes ``lumen.*`` meta keys."""

    dtype: str
    shape: Sequence[int]
    layout: str
    preprocess_id: Optional[str] = None
    model_id: Optional[str] = None
    model_version: Optional[str] = None

    def to_meta(self) -> Dict[str, str]:
        meta = {
            C.KEY_INPUT_KIND: "tensor",
            C.KEY_DTYPE: self.dtype,
            C.KEY_SHAPE: "[" + ",".join(str(int(d)) for d in self.shape) + "]",
            C.KEY_LAYOUT: self.layout,
        }
        if self.preprocess_id is not None:
            meta[C.KEY_PREPROCESS_ID] = self.preprocess_id
        if self.model_id is not None:
            meta[C.KEY_MODEL_ID] = self.model_id
        if self.model_version is not None:
            meta[C.KEY_MODEL_VERSION] = self.model_version
        return meta


class ResponseStats:
    """Typed per-response figures: batch size, queue and compute time, token count, and the
    version of the task that served it.

    Transports read these as ints; the ``lumen.*`` response meta strings are derived from them
    only when someone asks for ``InferResponse.meta`` (most callers never do).
    """

    __slots__ = ("batch_size", "queue_us", "compute_us", "tokens", "version")

    def __init__(self, batch_size: int = 0, queue_us: int = 0, compute_us: int = 0,
                 tokens: int = 0, version: str = ""):
        self.batch_size = batch_size
        self.queue_us = queue_us
        self.compute_us = compute_us
        self.tokens = tokens
        self.version = version

    def to_meta(self) -> Dict[str, str]:
        meta = {C.RESP_BATCH_SIZE: str(self.batch_size), C.RESP_QUEUE_US: str(self.queue_us),
                C.RESP_COMPUTE_US: str(self.compute_us)}
        if self.tokens:
            meta[C.RESP_TOKENS] = str(self.tokens)
        if self.version:
            meta[C.RESP_MODEL_VERSION] = self.version
        return meta

    def __repr__(self) -> str:
        return (f"ResponseStats(batch_size={self.batch_size}, queue_us={self.queue_us}, "
                f"compute_us={self.compute_us}, tokens={self.tokens}, "
                f"version={self.version!r})")


class InferResponse:
    """One request's outputs.  ``meta`` (``dict[str, str]``, SPEC section 1) holds the
    ``lumen.*`` response keys built from ``stats`` on first access, plus any explicit entries."""

    __slots__ = ("correlation_id", "task", "outputs", "stats", "_meta")

    def __init__(self, correlation_id: str, task: str, outputs: Dict[str, np.ndarray],
                 meta: Optional[Dict[str, str]] = None, stats: Optional[ResponseStats] = None):
        self.correlation_id = correlation_id
        self.task = task
        self.outputs = outputs
        self.stats = stats
        self._meta = meta

    @property
    def meta(self) -> Dict[str, str]:
        meta = self._meta
        if meta is None or (self.stats is not None and C.RESP_BATCH_SIZE not in meta):
            built = self.stats.to_meta() if self.stats is not None else {}
            if meta:
                built.update(meta)
            meta = self._meta = built
        return meta

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, InferResponse):
            return NotImplemented
        return (self.correlation_id, self.task, self.outputs, self.meta) == (
            other.correlation_id, other.task, other.outputs, other.meta)

    def __repr__(self) -> str:
        return (f"InferResponse(correlation_id={self.correlation_id!r}, task={self.task!r}, "
                f"outputs={sorted(self.outputs)}, meta={self.meta!r})")


class InferRequestBuilder:
    """Fluent builder; every method returns ``self``.  Only ``meta`` is written."""

    __slots__ = ("_task", "_payload", "_mime", "_meta", "_cid")

    def __init__(self, task: str):
        self._task = task
        self._payload: Any = b""
        self._mime = ""
        self._meta: Dict[str, str] = {}
        self._cid = ""

    def for_raw_input(self, payload: Any, mime: str) -> "InferRequestBuilder":
        self._payload = payload
        self._mime = mime
        self._meta.pop(C.KEY_INPUT_KIND, None)
        for key in C.TENSOR_KEYS:
            self._meta.pop(key, None)
        return self

    def for_tensor_input(self, payload: Any, desc: TensorDescriptor) -> "InferRequestBuilder":
        self._payload = payload
        self._mime = MIME_OCTET_STREAM
        self._meta.update(desc.to_meta())
        return self

    def for_tensor_array(self, arr: np.ndarray, layout: str, preprocess_id: Optional[str] = None,
                         model_id: Optional[str] = None,
                         model_version: Optional[str] = None) -> "InferRequestBuilder":
        """Describe ``arr`` from its own dtype and shape; it is sent without a copy when it is
        already C-contiguous and little-endian."""
        arr = np.asarray(arr)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        arr = np.ascontiguousarray(arr)
        name = C.DTYPE_NAMES.get(arr.dtype.newbyteorder("="))
        if name is None:
            raise ValueError(f"numpy dtype {arr.dtype} has no lumen dtype; "
                             f"supported: {', '.join(C.DTYPES)}")
        desc = TensorDescriptor(name, arr.shape, layout, preprocess_id, model_id, model_version)
        return self.for_tensor_input(arr, desc)

    def with_meta(self, key: str, value: Any) -> "InferRequestBuilder":
        self._meta[key] = _meta_str(value)
        return self

    def with_metas(self, meta: Mapping[str, Any]) -> "InferRequestBuilder":
        for k, v in meta.items():
            self.with_meta(k, v)
        return self

    def with_correlation_id(self, correlation_id: str) -> "InferRequestBuilder":
        self._cid = correlation_id
        return self

    def build(self) -> InferRequest:
        return InferRequest(self._task, self._payload, self._mime, dict(self._meta), self._cid)


def new_infer_request(task: str) -> InferRequestBuilder:
    return InferRequestBuilder(task)
