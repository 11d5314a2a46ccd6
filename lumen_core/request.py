"""Request model (SPEC section 1): InferRequest, TensorDescriptor, InferResponse, the builder.

The request is deliberately plain: a task name (the only routing key), a payload buffer, its
mime type and a ``dict[str, str]`` of metadata.  The builder only writes ``meta``, so a request
built by hand and one built with the builder are indistinguishable to the runtime, and the
HTTP / gRPC layers can build the same object from query parameters.

``InferRequest``, ``InferResponse`` and ``ResponseStats`` are defined in ``messages.py`` (they
are per-request objects, compiled with the request path) and re-exported here as the twin
``native`` chose, so every import of them names the class the runtime makes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence

import numpy as np

from . import contract as C
from . import native

InferRequest = native.messages.InferRequest
InferResponse = native.messages.InferResponse
ResponseStats = native.messages.ResponseStats

MIME_OCTET_STREAM = "application/octet-stream"


def _meta_str(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


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
