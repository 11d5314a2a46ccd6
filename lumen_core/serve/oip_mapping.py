"""The protocol-neutral half of the Open Inference Protocol (KServe v2): server and model
metadata from a task's contract, one OIP input -> one ``InferRequest`` (tensor or raw route),
outputs -> OIP datatypes and bytes.  Shared by the REST routes (:mod:`.oip`) and the gRPC
service (:mod:`.oip_grpc`); it imports neither Starlette nor grpcio, so the gRPC front door
does not load the HTTP stack.
"""
from __future__ import annotations

import json
import math
import struct
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from ..contract import (
    DEFAULT_LAYOUT_FOR_RANK,
    KEY_DTYPE,
    KEY_INPUT_KIND,
    KEY_LAYOUT,
    KEY_PREPROCESS_ID,
    KEY_PRIORITY,
    KEY_SEQUENCE_END,
    KEY_SEQUENCE_ID,
    KEY_SEQUENCE_START,
    KEY_SHAPE,
    KEY_TIMEOUT_MS,
    UNBOUNDED,
)
from ..errors import (
    InvalidArgument,
    TaskNotFound,
)
from ..request import InferRequest
from . import codec

if TYPE_CHECKING:  # typing only: the runtime as the doors use it
    from .runtime_api import RuntimeQueries

JSON, OCTET_STREAM = codec.JSON, codec.OCTET_STREAM
#: the binary tensor extension's header: the JSON part's length, binary tensors follow it
HEADER_LENGTH = "inference-header-content-length"
SERVER_NAME = "lumen-core"
#: the protocol extensions this server implements (names as Triton reports them)
EXTENSIONS = ("binary_tensor_data", "parameters", "sequence")
#: listed too when [server] system_shared_memory is on
SHM_EXTENSION = "system_shared_memory"
# OIP parameter names
P_BINARY_SIZE = "binary_data_size"
P_BINARY = "binary_data"
P_BINARY_OUTPUT = "binary_data_output"
P_CONTENT_TYPE = "content_type"
P_SHM_REGION = "shared_memory_region"
P_SHM_BYTE_SIZE = "shared_memory_byte_size"
P_SEQUENCE_ID = "sequence_id"
P_SEQUENCE_START = "sequence_start"
P_SEQUENCE_END = "sequence_end"
P_PRIORITY = "priority"
P_TIMEOUT = "timeout"
#: parameters the protocol layer consumes (never forwarded to the task)
_PROTOCOL_PARAMS = frozenset({P_BINARY_SIZE, P_BINARY, P_BINARY_OUTPUT, P_CONTENT_TYPE,
                              "classification", "shared_memory_region",
                              "shared_memory_byte_size", "shared_memory_offset", "headers"})
#: the bytes of a BYTES element's length prefix (little-endian uint32)
_LEN = struct.Struct("<I")
#: the most characters of a name quoted back in an error
MAX_ECHO = 200
#: the elements of a BYTES input: one text, image or audio clip per request (the runtime
#: batches requests); an input carrying more is refused at the next one, before it is built
MAX_BYTES_ELEMENTS = 1


# --------------------------------------------------------------------------- metadata
def package_version() -> str:
    """The installed lumen-core version ("" when not installed as a distribution)."""
    from importlib import metadata

    try:
        return metadata.version("lumen-core")
    except metadata.PackageNotFoundError:
        return ""


def server_metadata(version: str, shared_memory: bool = False) -> dict:
    ext = list(EXTENSIONS) + ([SHM_EXTENSION] if shared_memory else [])
    return {"name": SERVER_NAME, "version": version, "extensions": ext}


def check_model(rt: RuntimeQueries, task: str, version: str = "") -> Any:
    """The task's contract; TaskNotFound for an unknown task or a version it does not serve
    (``/versions/{v}`` may name any loaded version of the task: ``lumen.model.version``)."""
    if not rt.has_task(task):
        raise TaskNotFound(f"unknown model {task[:MAX_ECHO]!r}; this server serves "
                           f"{', '.join(rt.task_names()) or 'no models'}")
    contract = rt.contract(task)
    if version:
        served = rt.versions(task)
        if version not in served:
            raise TaskNotFound(f"model {task!r} has no version {version[:MAX_ECHO]!r}; it serves "
                               f"{', '.join(repr(v) for v in served)}")
    return contract


def _dim(lo: int, hi: int) -> int:
    return lo if lo == hi else -1


def model_metadata(rt: RuntimeQueries, task: str, version: str = "") -> dict:
    """``{name, versions, platform, inputs, outputs}``: one input per tensor signature (named by
    its preprocess id), one ``BYTES`` ``[1]`` input ``raw`` for a task with a raw route; the
    outputs the task declares.  A variable dimension is -1."""
    contract = check_model(rt, task, version)
    desc = rt.describe(task)
    inputs = []
    for i, spec in enumerate(contract.specs):
        ids = sorted(spec.preprocess_ids)
        inputs.append({"name": ids[0] if len(ids) == 1 else f"input_{i}",
                       "datatype": codec.OIP_DATATYPES[spec.dtype],
                       "shape": [_dim(lo, hi) for lo, hi in spec.dims],
                       "parameters": {KEY_LAYOUT: spec.layout,
                                      KEY_PREPROCESS_ID: ",".join(ids)}})
    mimes = desc.get("raw_mimes") or []
    if mimes:
        inputs.append({"name": "raw", "datatype": codec.OIP_BYTES, "shape": [1],
                       "parameters": {P_CONTENT_TYPE: ",".join(mimes)}})
    outputs = []
    declared = desc.get("outputs")
    if isinstance(declared, dict):
        for name, spec in declared.items():
            dtype, shape = (spec if isinstance(spec, (list, tuple)) and len(spec) == 2
                            else (None, []))
            outputs.append({"name": name,
                            "datatype": (codec.OIP_DATATYPES.get(dtype, codec.OIP_BYTES) if dtype is not None
                                         else codec.OIP_BYTES),
                            "shape": [-1 if not isinstance(d, int) or d == UNBOUNDED else d
                                      for d in shape]})
    return {"name": task, "versions": rt.versions(task),
            "platform": f"lumen_{desc.get('backend', '')}", "inputs": inputs,
            "outputs": outputs}


# --------------------------------------------------------------------------- requests
def _param_text(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, str)):
        return str(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    raise InvalidArgument(f"parameter {key[:MAX_ECHO]!r} must be a string, integer or boolean, "
                          f"got {type(value).__name__}", key)


def request_meta(params: Optional[dict], inp_params: Optional[dict] = None) -> dict:
    """Lumen meta from the request's (and the input's) OIP parameters."""
    meta: dict = {}
    for src in (params, inp_params):
        if not src:
            continue
        for key, value in src.items():
            if key in _PROTOCOL_PARAMS:
                continue
            if key == P_SEQUENCE_ID:
                if value == 0 or value == "":
                    continue  # Triton's "no sequence"
                meta[KEY_SEQUENCE_ID] = _param_text(key, value)
            elif key == P_SEQUENCE_START:
                meta[KEY_SEQUENCE_START] = "true" if _flag(key, value) else "false"
            elif key == P_SEQUENCE_END:
                meta[KEY_SEQUENCE_END] = "true" if _flag(key, value) else "false"
            elif key == P_PRIORITY:
                if value not in (0, "0"):  # 0: the task's default level
                    meta[KEY_PRIORITY] = _param_text(key, value)
            elif key == P_TIMEOUT:
                us = _param_text(key, value)
                if not us.isdigit():
                    raise InvalidArgument(f"'timeout' must be microseconds (an integer >= 0), "
                                          f"got {us[:40]!r}", key)
                if int(us):
                    meta[KEY_TIMEOUT_MS] = str(max(1, math.ceil(int(us) / 1000)))
            else:
                meta[key] = _param_text(key, value)
    return meta


def _flag(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if value in ("true", "false"):
        return value == "true"
    raise InvalidArgument(f"parameter {key!r} must be true or false, got {value!r}", key)


def input_datatype(datatype: Any, name: str) -> str:
    """An input's ``datatype`` as sent: a string (which one, ``tensor_request`` checks)."""
    if not isinstance(datatype, str):
        raise InvalidArgument(f"input {name!r}: 'datatype' must be a string such as 'FP32' or "
                              f"'BYTES', got {type(datatype).__name__}", "datatype")
    return datatype


def _shape(shape: Any, name: str) -> tuple:
    if not isinstance(shape, (list, tuple)) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise InvalidArgument(f"input {name!r}: 'shape' must be an array of non-negative "
                              f"integers, got {str(shape)[:MAX_ECHO]}", "shape")
    return tuple(int(d) for d in shape)


def tensor_request(rt: RuntimeQueries, task: str, name: str, datatype: str, shape: tuple, payload: Any,
                   meta: dict, request_id: str) -> InferRequest:
    """A tensor-route request for a numeric input: dtype and shape from the input, layout and
    preprocess id from ``meta`` or implied by the task's contract."""
    dtype = codec.OIP_TO_DTYPE.get(datatype)
    if dtype is None:
        raise InvalidArgument(f"input {name!r}: datatype {str(datatype)[:40]!r} is not "
                              f"supported; use BYTES (raw input) or one of "
                              f"{', '.join(codec.OIP_DATATYPES.values())}", "datatype")
    contract = rt.contract(task)
    pre = meta.get(KEY_PREPROCESS_ID)
    if pre is None and name in contract.preprocess_ids:
        pre = name
    layout, implied = contract.implied(dtype, len(shape), meta.get(KEY_LAYOUT), pre)
    if pre is None:
        if implied is None:
            specs = [s for s in contract.specs if s.dtype == dtype and len(s.dims) == len(shape)
                     and (layout is None or s.layout == layout)] or list(contract.specs)
            ids = {p for s in specs for p in s.preprocess_ids}
            raise InvalidArgument(f"model {task!r} takes {datatype} input under several "
                                  f"preprocess ids ({', '.join(sorted(ids)) or 'none'}); name "
                                  f"one in the parameter {KEY_PREPROCESS_ID!r} or as the input "
                                  f"name", KEY_PREPROCESS_ID)
        pre = implied
    if layout is None:
        layout = DEFAULT_LAYOUT_FOR_RANK.get(len(shape), "")
    meta.update({KEY_INPUT_KIND: "tensor", KEY_DTYPE: dtype, KEY_SHAPE: codec.shape_text(shape),
                 KEY_LAYOUT: layout, KEY_PREPROCESS_ID: pre})
    return InferRequest(task, payload, OCTET_STREAM, meta, request_id)


#: (id(runtime), task) -> (the contract it was read under, the task's first raw mime or None);
#: ``describe`` builds a dict per call, and a reload gives the task a new contract object
_DEFAULT_MIMES: dict = {}


def _default_mime(rt: RuntimeQueries, task: str) -> str:
    contract = rt.contract(task)
    hit = _DEFAULT_MIMES.get((id(rt), task))
    if hit is None or hit[0] is not contract:
        desc = rt.describe(task)
        mimes = desc.get("raw_mimes") or []
        # the task's default_mime (a full media type, e.g. vad's audio/L16;rate=16000) when it
        # declares one, else its first raw mime
        hit = (contract, (desc.get("default_mime") or mimes[0]) if mimes else None)
        if len(_DEFAULT_MIMES) > 4096:
            _DEFAULT_MIMES.clear()
        _DEFAULT_MIMES[(id(rt), task)] = hit
    if hit[1] is None:
        raise InvalidArgument(f"model {task!r} takes no BYTES input (it has no raw route); "
                              f"send a numeric tensor", "datatype")
    return hit[1]


def raw_request(rt: RuntimeQueries, task: str, name: str, element: Any, mime: Optional[str], meta: dict,
                request_id: str) -> InferRequest:
    """A raw-route request for a one-element BYTES input."""
    if not mime:
        mime = _default_mime(rt, task)
    if isinstance(element, str) and not mime.lower().startswith("text/"):
        element = element.encode("utf-8")
    return InferRequest(task, element, mime, meta, request_id)


def one_element_error(name: str, got: str) -> InvalidArgument:
    """The error for a BYTES input of other than one element (``got``: what it has)."""
    return InvalidArgument(f"input {name!r}: a BYTES input carries one element (one text, "
                           f"image or audio clip per request), got {got}", "shape")


def bytes_elements(buf: Any, name: str, limit: int = MAX_BYTES_ELEMENTS) -> list:
    """The elements of a BYTES tensor in the binary encoding (each a little-endian uint32
    length, then that many bytes), as memoryviews of ``buf``; InvalidArgument at element
    ``limit + 1``, so a buffer of millions of empty elements costs nothing to refuse."""
    view = memoryview(buf).cast("B") if not isinstance(buf, memoryview) else buf
    out: list = []
    pos, end = 0, len(view)
    while pos < end:
        if len(out) == limit:
            raise one_element_error(name, f"more than {limit} in {end} bytes")
        if end - pos < _LEN.size:
            raise InvalidArgument(f"input {name!r}: BYTES data ends inside an element's "
                                  f"4-byte length", "binary_data_size")
        (n,) = _LEN.unpack_from(view, pos)
        pos += _LEN.size
        if n > end - pos:
            raise InvalidArgument(f"input {name!r}: a BYTES element declares {n} bytes but "
                                  f"only {end - pos} remain", "binary_data_size")
        out.append(view[pos:pos + n])
        pos += n
    return out


def build_request(rt: RuntimeQueries, task: str, name: str, datatype: str, shape: tuple, data: Any,
                  params: Optional[dict], inp_params: Optional[dict],
                  request_id: str, scoped: Callable[[dict], dict]) -> InferRequest:
    """The runtime request for one OIP input.  ``data`` is the tensor's bytes (a buffer) for a
    numeric input, or the list of its elements for BYTES."""
    meta = scoped(request_meta(params, inp_params))
    if datatype == codec.OIP_BYTES:
        if len(data) != 1 or math.prod(shape) != 1:
            raise one_element_error(name, f"{len(data)} for shape {str(list(shape))[:MAX_ECHO]}")
        mime = (inp_params or {}).get(P_CONTENT_TYPE) or (params or {}).get(P_CONTENT_TYPE)
        if mime is not None and not isinstance(mime, str):
            raise InvalidArgument("'content_type' must be a string such as 'text/plain'",
                                  P_CONTENT_TYPE)
        return raw_request(rt, task, name, data[0], mime, meta, request_id)
    return tensor_request(rt, task, name, datatype, shape, data, meta, request_id)


def check_inputs(inputs: Any) -> None:
    if not isinstance(inputs, list) or len(inputs) != 1:
        n = len(inputs) if isinstance(inputs, list) else 0
        raise InvalidArgument(f"a request carries exactly one input (one item: the runtime "
                              f"batches requests), got {n}", "inputs")


# --------------------------------------------------------------------------- outputs
def output_arrays(resp: Any, wanted: Optional[list]) -> list:
    """``[(name, array)]`` of the requested outputs (all when ``wanted`` is None)."""
    outs = resp.outputs
    if not wanted:
        return [(k, _as_array(v)) for k, v in outs.items()]
    res = []
    for name in wanted:
        if name not in outs:
            raise InvalidArgument(f"model {resp.task!r} has no output {str(name)[:MAX_ECHO]!r} "
                                  f"(outputs: {', '.join(outs)})", "outputs")
        res.append((name, _as_array(outs[name])))
    return res


def _as_array(value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        return value
    arr = np.empty(1, dtype=object)  # a structured output (segments, OCR lines): JSON text
    arr[0] = json.dumps(value, separators=(",", ":"), default=str)
    return arr


def bytes_items(arr: np.ndarray) -> list:
    """A BYTES output's elements as ``bytes``."""
    out = []
    for v in arr.reshape(-1):
        if isinstance(v, bytes):
            out.append(v)
        elif isinstance(v, str):
            out.append(v.encode("utf-8"))
        else:
            out.append(json.dumps(v, separators=(",", ":"), default=str).encode("utf-8"))
    return out


def bytes_tensor(arr: np.ndarray) -> bytes:
    """A BYTES output in the binary encoding (length-prefixed elements)."""
    return b"".join(_LEN.pack(len(b)) + b for b in bytes_items(arr))


def _output_bytes(arr: np.ndarray, datatype: str) -> Any:
    return bytes_tensor(arr) if datatype == codec.OIP_BYTES else codec.tensor_view(arr)


def response_parameters(resp: Any) -> dict:
    extra = getattr(resp.outputs, "meta", None)
    return {**resp.meta, **extra} if extra else dict(resp.meta)
