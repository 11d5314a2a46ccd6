"""The wire encoding every front door shares: output tensors as bytes, JSON and base64.

HTTP (JSON and raw tensor replies, ``/v1/embeddings``), gRPC (``Tensor`` messages) and the
CLI's in-process ``lumen infer`` print the same thing for the same output, so the encoding lives
here once and each of them imports this module instead of another transport.  It depends on
numpy and :mod:`lumen_core.contract` only (no Starlette, no grpcio), so importing it is cheap.

- dtype names come from :data:`lumen_core.contract.DTYPE_NAMES`, the one dtype table; a numpy
  dtype that has no lumen name (a generic model may return one) is reported by numpy's name;
- bytes are little-endian and C-contiguous (the only byte order the tensor route takes in, so
  the one it gives out); a native little-endian contiguous array is not copied;
- JSON carries ``{"dtype", "shape", "data"}`` with ``data`` flattened in C order.
"""
from __future__ import annotations

import base64
import json
from typing import Any, Mapping

import numpy as np

from ..contract import DTYPE_NAMES
from ..errors import InvalidArgument

_JSON_SEPARATORS = (",", ":")

#: the media type of every JSON reply and request body (HTTP, OIP, OpenAI, admin)
JSON = "application/json"
#: the media type of raw tensor bodies (the tensor route, OIP's binary extension)
OCTET_STREAM = "application/octet-stream"


def loads(data: Any, what: str, field: str) -> Any:
    """A client's JSON (a body, a header part, a WebSocket message) as Python; bad JSON, or
    JSON nested past the decoder's recursion limit (it recurses once per level: 8,000
    brackets), is an InvalidArgument naming ``what`` and ``field``, never a server fault."""
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"{what} is not valid JSON: {exc}", field) from None
    except RecursionError:
        raise InvalidArgument(f"{what} is nested too deeply", field) from None


#: lumen dtype name -> the Open Inference Protocol's (KServe v2 / Triton) datatype name
OIP_DATATYPES: dict[str, str] = {"fp32": "FP32", "fp16": "FP16", "uint8": "UINT8",
                                 "int64": "INT64", "int32": "INT32", "int8": "INT8",
                                 "bool": "BOOL"}
#: the OIP datatype of variable-length byte strings (text, images sent as bytes)
OIP_BYTES = "BYTES"
#: OIP datatype -> lumen dtype name
OIP_TO_DTYPE: dict[str, str] = {v: k for k, v in OIP_DATATYPES.items()}


def oip_datatype(arr: np.ndarray) -> str:
    """The OIP datatype of ``arr`` (``BYTES`` for object / string arrays)."""
    if arr.dtype.kind in "OSU":
        return OIP_BYTES
    name = dtype_name(arr)
    found = OIP_DATATYPES.get(name)
    return found if found is not None else str(arr.dtype).upper()


#: numpy dtype -> its lumen name, filled as dtypes are seen (``newbyteorder`` makes a new
#: dtype object on every call: a microsecond a reply)
_DTYPE_NAME_MEMO: dict[Any, str] = {}


def dtype_name(arr: np.ndarray) -> str:
    """The lumen name of ``arr``'s dtype (``fp32``, ``int64``, ...), whatever its byte order."""
    dt = arr.dtype
    name = _DTYPE_NAME_MEMO.get(dt)
    if name is None:
        name = DTYPE_NAMES.get(dt.newbyteorder("="), str(dt))
        if len(_DTYPE_NAME_MEMO) < 256:
            _DTYPE_NAME_MEMO[dt] = name
    return name


def little_endian(arr: np.ndarray) -> np.ndarray:
    """``arr`` as a C-contiguous little-endian array (the same object when it already is)."""
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return np.ascontiguousarray(arr)


def tensor_view(arr: np.ndarray) -> memoryview:
    """The little-endian bytes of ``arr`` as a flat ``uint8`` memoryview, without a copy when
    ``arr`` is already little-endian and contiguous.  A ``uint8`` view rather than
    ``memoryview.cast``: ``cast`` refuses a zero-size array (an empty output)."""
    return memoryview(little_endian(arr).reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def tensor_bytes(arr: np.ndarray) -> bytes:
    """The little-endian bytes of ``arr`` as a ``bytes`` object (what protobuf fields take)."""
    return little_endian(arr).tobytes()


def shape_text(shape: Any) -> str:
    """A shape as the compact JSON array the tensor route's shape key takes: ``[1,384]``."""
    if type(shape) is tuple:
        text = _SHAPE_TEXTS.get(shape)
        if text is None:
            text = "[" + ",".join(str(int(d)) for d in shape) + "]"
            if len(_SHAPE_TEXTS) < MAX_SHAPE_TEXTS:
                _SHAPE_TEXTS[shape] = text
        return text
    return "[" + ",".join(str(int(d)) for d in shape) + "]"


#: the most shapes whose text is remembered (clients send a handful of distinct shapes)
MAX_SHAPE_TEXTS = 1024
_SHAPE_TEXTS: dict[tuple[int, ...], str] = {}


def tensor_json(arr: np.ndarray) -> dict[str, Any]:
    """One output as ``{"dtype", "shape", "data"}`` (``data`` flat, C order)."""
    return {"dtype": dtype_name(arr), "shape": list(arr.shape), "data": arr.reshape(-1).tolist()}


def outputs_json(outputs: Mapping[str, np.ndarray]) -> dict[str, Any]:
    return {name: tensor_json(arr) for name, arr in outputs.items()
            if isinstance(arr, np.ndarray)}


#: the gRPC ``Tensor.dtype`` of a structured output (its ``data`` is UTF-8 JSON)
STRUCTURED_DTYPE = "json"


def structured_outputs(outputs: Mapping[str, Any]) -> dict[str, Any]:
    """The outputs that are not tensors but JSON values (e.g. the ``ocr`` task's ``lines``:
    a list of ``{"text", "score", "box"}``)."""
    return {name: v for name, v in outputs.items() if not isinstance(v, np.ndarray)}


def response_json(resp: Any) -> dict[str, Any]:
    """An :class:`~lumen_core.request.InferResponse` as the JSON object of SPEC section 6:
    ``{"correlation_id", "task", "outputs": {name: tensor_json}, "meta"}``; a structured
    output sits at the top level under its own name (``{"lines": [...], ...}``)."""
    return {"correlation_id": resp.correlation_id, "task": resp.task,
            **structured_outputs(resp.outputs),
            "outputs": outputs_json(resp.outputs), "meta": resp.meta}


def b64_tensor(arr: np.ndarray, dtype: Any = None) -> str:
    """Base64 of ``arr``'s little-endian bytes (after a cast to ``dtype`` when given), as the
    OpenAI API's ``encoding_format: base64`` sends embeddings (float32)."""
    if dtype is not None:
        arr = arr.astype(dtype, copy=False)
    return base64.b64encode(tensor_view(arr)).decode("ascii")


def dumps(obj: Any) -> bytes:
    """Compact JSON bytes; NaN / infinity are refused (results are validated finite first, so
    one reaching here is a bug that must fail loudly rather than emit invalid JSON)."""
    return json.dumps(obj, separators=_JSON_SEPARATORS, allow_nan=False).encode()
