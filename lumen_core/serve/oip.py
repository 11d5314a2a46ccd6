"""The Open Inference Protocol (KServe v2, Triton's HTTP API) on the HTTP server, model = task.

Routes (all under ``/v2``; ``{task}`` is the model name, ``/versions/{v}`` forms accepted where
the protocol has them, ``v`` must be the task's model version)::

    GET  /v2/health/live   /v2/health/ready   GET /v2   (server metadata)
    GET  /v2/models/{task}[/versions/{v}]            model metadata from the task's contract
    GET  /v2/models/{task}[/versions/{v}]/ready
    POST /v2/models/{task}[/versions/{v}]/infer      JSON tensors and the binary tensor extension

Mapping an OIP request onto Lumen's two routes (one input per request: batching is the
runtime's job, as on every other front door):

- a numeric input goes the **tensor route**: its datatype and shape become the descriptor; the
  layout and preprocess id are implied when the task's contract leaves one choice (the input's
  name may also be a preprocess id), else taken from ``lumen.*`` request parameters;
- a ``BYTES`` input of one element goes the **raw route**: the element is the payload, the mime
  comes from a ``content_type`` parameter (input or request) or the task's first raw mime;
- request parameters ``sequence_id`` / ``sequence_start`` / ``sequence_end`` (Triton's sequence
  extension), ``priority`` and ``timeout`` (microseconds) map to ``lumen.*`` keys; ``lumen.*``
  parameters pass as they are; other scalar parameters go to the task as plain options.

Errors are ``{"error": "<message>"}`` with the status of Lumen's error table, the shape every
OIP client reads.  The protocol-neutral half (metadata, request building, output encoding) is
shared with the gRPC ``GRPCInferenceService``.
"""
from __future__ import annotations

import json
import math
import struct
import zlib
from typing import Any, Callable, Optional

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..contract import (
    DEFAULT_LAYOUT_FOR_RANK,
    DTYPES,
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
    LumenError,
    PayloadTooLarge,
    TaskNotFound,
    Unavailable,
    UnsupportedMediaType,
)
from ..request import InferRequest
from . import codec, shm

JSON = "application/json"
OCTET_STREAM = "application/octet-stream"
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


# --------------------------------------------------------------------------- errors
def error_response(exc: LumenError) -> Response:
    headers = {}
    retry = getattr(exc, "retry_after_s", None)
    if retry is not None:
        headers["Retry-After"] = str(retry)
    return Response(codec.dumps({"error": exc.message}), status_code=exc.http_status,
                    headers=headers, media_type=JSON)


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


def check_model(rt: Any, task: str, version: str = "") -> Any:
    """The task's contract; TaskNotFound for an unknown task or a version it does not serve."""
    if not rt.has_task(task):
        raise TaskNotFound(f"unknown model {task[:MAX_ECHO]!r}; this server serves "
                           f"{', '.join(rt.task_names()) or 'no models'}")
    contract = rt.contract(task)
    if version and version != contract.model_version:
        raise TaskNotFound(f"model {task!r} has no version {version[:MAX_ECHO]!r}; it serves "
                           f"version {contract.model_version!r}")
    return contract


def _dim(lo: int, hi: int) -> int:
    return lo if lo == hi else -1


def model_metadata(rt: Any, task: str, version: str = "") -> dict:
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
                            "datatype": codec.OIP_DATATYPES.get(dtype, codec.OIP_BYTES),
                            "shape": [-1 if not isinstance(d, int) or d == UNBOUNDED else d
                                      for d in shape]})
    return {"name": task, "versions": [contract.model_version],
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


def _shape(shape: Any, name: str) -> tuple:
    if not isinstance(shape, (list, tuple)) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise InvalidArgument(f"input {name!r}: 'shape' must be an array of non-negative "
                              f"integers, got {str(shape)[:MAX_ECHO]}", "shape")
    return tuple(int(d) for d in shape)


def tensor_request(rt: Any, task: str, name: str, datatype: str, shape: tuple, payload: Any,
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
    specs = [s for s in contract.specs if s.dtype == dtype and len(s.dims) == len(shape)
             and (pre is None or pre in s.preprocess_ids)] or list(contract.specs)
    if pre is None:
        ids = {p for s in specs for p in s.preprocess_ids}
        if len(ids) != 1:
            raise InvalidArgument(f"model {task!r} takes {datatype} input under several "
                                  f"preprocess ids ({', '.join(sorted(ids)) or 'none'}); name "
                                  f"one in the parameter {KEY_PREPROCESS_ID!r} or as the input "
                                  f"name", KEY_PREPROCESS_ID)
        pre = ids.pop()
    layout = meta.get(KEY_LAYOUT)
    if layout is None:
        layouts = {s.layout for s in specs if len(s.dims) == len(shape)}
        layout = layouts.pop() if len(layouts) == 1 else DEFAULT_LAYOUT_FOR_RANK.get(len(shape), "")
    meta.update({KEY_INPUT_KIND: "tensor", KEY_DTYPE: dtype, KEY_SHAPE: codec.shape_text(shape),
                 KEY_LAYOUT: layout, KEY_PREPROCESS_ID: pre})
    return InferRequest(task, payload, OCTET_STREAM, meta, request_id)


#: (id(runtime), task) -> (the contract it was read under, the task's first raw mime or None);
#: ``describe`` builds a dict per call, and a reload gives the task a new contract object
_DEFAULT_MIMES: dict = {}


def _default_mime(rt: Any, task: str) -> str:
    contract = rt.contract(task)
    hit = _DEFAULT_MIMES.get((id(rt), task))
    if hit is None or hit[0] is not contract:
        mimes = rt.describe(task).get("raw_mimes") or []
        hit = (contract, mimes[0] if mimes else None)
        if len(_DEFAULT_MIMES) > 4096:
            _DEFAULT_MIMES.clear()
        _DEFAULT_MIMES[(id(rt), task)] = hit
    if hit[1] is None:
        raise InvalidArgument(f"model {task!r} takes no BYTES input (it has no raw route); "
                              f"send a numeric tensor", "datatype")
    return hit[1]


def raw_request(rt: Any, task: str, name: str, element: Any, mime: Optional[str], meta: dict,
                request_id: str) -> InferRequest:
    """A raw-route request for a one-element BYTES input."""
    if not mime:
        mime = _default_mime(rt, task)
    if isinstance(element, str) and not mime.lower().startswith("text/"):
        element = element.encode("utf-8")
    return InferRequest(task, element, mime, meta, request_id)


def bytes_elements(buf: Any, name: str) -> list:
    """The elements of a BYTES tensor in the binary encoding (each a little-endian uint32
    length, then that many bytes), as memoryviews of ``buf``."""
    view = memoryview(buf).cast("B") if not isinstance(buf, memoryview) else buf
    out = []
    pos, end = 0, len(view)
    while pos < end:
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


def build_request(rt: Any, task: str, name: str, datatype: str, shape: tuple, data: Any,
                  params: Optional[dict], inp_params: Optional[dict],
                  request_id: str, scoped: Callable[[dict], dict]) -> InferRequest:
    """The runtime request for one OIP input.  ``data`` is the tensor's bytes (a buffer) for a
    numeric input, or the list of its elements for BYTES."""
    meta = scoped(request_meta(params, inp_params))
    if datatype == codec.OIP_BYTES:
        if len(data) != 1 or math.prod(shape) != 1:
            raise InvalidArgument(f"input {name!r}: a BYTES input carries one element (one "
                                  f"text, image or audio clip per request), got "
                                  f"{len(data)} for shape {list(shape)}", "shape")
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


# --------------------------------------------------------------------------- REST
class OipRoutes:
    """The ``/v2`` endpoints of one :class:`~lumen_core.serve.http.HttpApp` (its body limit,
    disconnect watching, API keys and draining state are reused)."""

    def __init__(self, app: Any):
        self.app = app
        self.rt = app.runtime
        self.shm = shm.registry_for(self.rt)

    def routes(self) -> list:
        ep = self.app._endpoint
        r = []
        for suffix in ("", "/versions/{version}"):
            base = "/v2/models/{task}" + suffix
            r += [Route(base, ep(base, self._wrap(self.metadata)), methods=["GET"]),
                  Route(base + "/ready", ep(base + "/ready", self._wrap(self.model_ready)),
                        methods=["GET"]),
                  Route(base + "/infer", ep(base + "/infer", self._wrap(self.infer)),
                        methods=["POST"])]
        r += [Route("/v2/health/live", ep("/v2/health/live", self._wrap(self.live)),
                    methods=["GET"]),
              Route("/v2/health/ready", ep("/v2/health/ready", self._wrap(self.ready)),
                    methods=["GET"]),
              Route("/v2", ep("/v2", self._wrap(self.server)), methods=["GET"])]
        base = "/v2/systemsharedmemory"
        for path, fn, method in (
                (base + "/status", self.shm_status, "GET"),
                (base + "/region/{name}/status", self.shm_status, "GET"),
                (base + "/region/{name}/register", self.shm_register, "POST"),
                (base + "/unregister", self.shm_unregister, "POST"),
                (base + "/region/{name}/unregister", self.shm_unregister, "POST")):
            r.append(Route(path, ep(path, self._wrap(fn)), methods=[method]))
        # an unknown /v2 path is the router's 404 in Lumen's error shape (SPEC 6: the router's
        # own errors keep one shape; tests/serve/test_http.py checks /v2/nothing-here)
        return r

    @staticmethod
    def _wrap(fn: Callable) -> Callable:
        """A LumenError answers ``{"error": message}`` (the OIP shape) instead of Lumen's."""
        async def handler(request: Request) -> Response:
            try:
                return await fn(request)
            except LumenError as exc:
                from .auth import unscope_error

                return error_response(unscope_error(exc, getattr(request.state, "key_scope",
                                                                 None)))

        return handler

    @staticmethod
    def _json(obj: Any, status: int = 200) -> Response:
        return Response(codec.dumps(obj), status_code=status, media_type=JSON)

    async def live(self, request: Request) -> Response:
        return self._json({"live": True})

    async def ready(self, request: Request) -> Response:
        if self.app.draining or not self.rt.ready:
            raise Unavailable("the server is not ready (loading, or shutting down)")
        return self._json({"ready": True})

    async def server(self, request: Request) -> Response:
        return self._json(server_metadata(self.app.version, self.shm.enabled))

    async def metadata(self, request: Request) -> Response:
        p = request.path_params
        return self._json(model_metadata(self.rt, p["task"], p.get("version", "")))

    async def model_ready(self, request: Request) -> Response:
        p = request.path_params
        check_model(self.rt, p["task"], p.get("version", ""))
        if self.app.draining or not self.rt.ready:
            raise Unavailable(f"model {p['task']!r} is not ready")
        return self._json({"name": p["task"], "ready": True})

    # -- system shared memory -------------------------------------------------------------
    async def shm_status(self, request: Request) -> Response:
        return self._json(self.shm.status(request.path_params.get("name", "")))

    async def shm_register(self, request: Request) -> Response:
        obj, _ = _split_body(await self.app._read_body(request, "body"), None)
        self.shm.register(request.path_params["name"], obj.get("key"), obj.get("offset", 0),
                          obj.get("byte_size"))
        return Response(b"", media_type=JSON)

    async def shm_unregister(self, request: Request) -> Response:
        self.shm.unregister(request.path_params.get("name", ""))
        return Response(b"", media_type=JSON)

    async def infer(self, request: Request) -> Response:
        app = self.app
        app._check_open()
        task = request.path_params["task"]
        contract = check_model(self.rt, task, request.path_params.get("version", ""))
        body = await app._read_body(request, "payload")
        encoding = request.headers.get("content-encoding")
        if encoding:
            body = _decompress(body, encoding, app.max_body)
        obj, binary = _split_body(body, request.headers.get(HEADER_LENGTH))
        params = obj.get("parameters") or {}
        if not isinstance(params, dict):
            raise InvalidArgument("'parameters' must be an object", "parameters")
        inputs = obj.get("inputs")
        check_inputs(inputs)
        inp = inputs[0]
        if not isinstance(inp, dict):
            raise InvalidArgument("each input must be an object", "inputs")
        name = str(inp.get("name", ""))[:MAX_ECHO]
        datatype = inp.get("datatype")
        shape = _shape(inp.get("shape"), name)
        ip = inp.get("parameters") or {}
        if not isinstance(ip, dict):
            raise InvalidArgument(f"input {name!r}: 'parameters' must be an object", "parameters")
        data = _input_data(inp, name, datatype, shape, ip, binary, self.shm)
        rid = obj.get("id") or ""
        if not isinstance(rid, str):
            raise InvalidArgument("'id' must be a string", "id")
        key_scope = request.state.key_scope
        req = build_request(self.rt, task, name, datatype, shape, data, params, ip, rid,
                            lambda m: app.keys.scoped_meta(m, key_scope))
        resp = await app._until_done_or_gone(request, self.rt.infer(req))
        return self._reply(resp, obj, params, contract.model_version, rid)

    def _reply(self, resp: Any, obj: dict, params: dict, version: str, rid: str) -> Response:
        wanted = obj.get("outputs")
        if wanted is not None and not isinstance(wanted, list):
            raise InvalidArgument("'outputs' must be an array", "outputs")
        binary_default = params.get(P_BINARY_OUTPUT) is True
        binary_for: dict = {}
        shm_for: dict = {}  # output name -> its parameters, when they name a region
        names = None
        if wanted:
            names = []
            for o in wanted:
                if not isinstance(o, dict) or not isinstance(o.get("name"), str):
                    raise InvalidArgument("each requested output must be an object with a "
                                          "'name'", "outputs")
                names.append(o["name"])
                op = o.get("parameters") or {}
                if not isinstance(op, dict):
                    raise InvalidArgument("an output's 'parameters' must be an object",
                                          "outputs")
                binary_for[o["name"]] = op.get(P_BINARY, binary_default) is True
                if P_SHM_REGION in op:
                    shm_for[o["name"]] = op
        chunks: list = []
        outs = []
        for name, arr in output_arrays(resp, names):
            dt = codec.oip_datatype(arr)
            entry: dict = {"name": name, "datatype": dt, "shape": list(arr.shape)}
            if name in shm_for:
                n = shm.output_write(self.shm, shm_for[name], _output_bytes(arr, dt))
                entry["parameters"] = {P_SHM_REGION: shm_for[name][P_SHM_REGION],
                                       P_SHM_BYTE_SIZE: n}
            elif binary_for.get(name, binary_default):
                data = bytes_tensor(arr) if dt == codec.OIP_BYTES else codec.tensor_view(arr)
                entry["parameters"] = {P_BINARY_SIZE: len(data)}
                chunks.append(data)
            elif dt == codec.OIP_BYTES:
                entry["data"] = [b.decode("utf-8", "replace") for b in bytes_items(arr)]
            else:
                entry["data"] = arr.reshape(-1).tolist()
            outs.append(entry)
        head = {"model_name": resp.task, "model_version": version, "outputs": outs,
                "parameters": response_parameters(resp)}
        if rid:
            head["id"] = rid
        text = codec.dumps(head)
        if not chunks:
            return Response(text, media_type=JSON)
        return Response(b"".join([text, *chunks]), media_type=OCTET_STREAM,
                        headers={"Inference-Header-Content-Length": str(len(text))})


#: Content-Encoding -> zlib wbits (tritonclient's request_compression_algorithm)
_ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS, "identity": None}


def _decompress(body: bytes, encoding: str, limit: int) -> bytes:
    """The body decoded, refused with 413 once it inflates past ``limit`` (a small body must
    not expand into gigabytes)."""
    enc = encoding.strip().lower()
    if enc not in _ENCODINGS:
        raise UnsupportedMediaType(f"Content-Encoding {encoding[:40]!r} is not supported; send "
                                   f"gzip, deflate or none", "Content-Encoding")
    wbits = _ENCODINGS[enc]
    if wbits is None:
        return body
    d = zlib.decompressobj(wbits)
    try:
        out = d.decompress(body, limit + 1)
    except zlib.error as exc:
        raise InvalidArgument(f"the body is not valid {enc} data: {exc}",
                              "Content-Encoding") from None
    if len(out) > limit or d.unconsumed_tail:
        raise PayloadTooLarge(f"the decompressed body exceeds the limit of {limit} bytes "
                              f"(server.max_payload_bytes)", "payload")
    if not d.eof:
        raise InvalidArgument(f"the {enc} body is truncated", "Content-Encoding")
    return out


def _split_body(body: bytes, header_len: Optional[str]) -> tuple:
    """(the JSON object, the binary part as a memoryview)."""
    view = memoryview(body)
    if header_len is not None:
        if not (header_len.isascii() and header_len.isdigit()) or int(header_len) > len(body):
            raise InvalidArgument(f"Inference-Header-Content-Length {header_len[:40]!r} is not "
                                  f"a length within the body ({len(body)} bytes)",
                                  "Inference-Header-Content-Length")
        n = int(header_len)
        head, binary = view[:n], view[n:]
    else:
        head, binary = view, view[:0]
    try:
        obj = json.loads(bytes(head))
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidArgument(f"the request's JSON is not valid: {exc}", "body") from None
    except RecursionError:
        raise InvalidArgument("the request's JSON is nested too deeply", "body") from None
    if not isinstance(obj, dict):
        raise InvalidArgument("the request must be a JSON object", "body")
    return obj, binary


def _input_data(inp: dict, name: str, datatype: Any, shape: tuple, ip: dict,
                binary: memoryview, registry: Optional[shm.ShmRegistry] = None) -> Any:
    """The input's tensor bytes (numeric) or its elements (BYTES), from a shared-memory
    region, the binary part or ``data``."""
    view = shm.input_view(registry, ip)
    if view is not None:
        if len(binary) or inp.get("data") is not None:
            raise InvalidArgument(f"input {name!r} names a shared memory region and also "
                                  f"carries data; send one of them", "shared_memory_region")
        return bytes_elements(view, name) if datatype == codec.OIP_BYTES else view
    size = ip.get(P_BINARY_SIZE)
    if size is not None:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or size != len(binary):
            raise InvalidArgument(f"input {name!r}: binary_data_size {size!r} does not match "
                                  f"the {len(binary)} bytes after the JSON header",
                                  P_BINARY_SIZE)
        if datatype == codec.OIP_BYTES:
            return bytes_elements(binary, name)
        return binary
    if len(binary):
        raise InvalidArgument(f"{len(binary)} bytes follow the JSON header but no input names "
                              f"them with binary_data_size", P_BINARY_SIZE)
    data = inp.get("data")
    if data is None:
        raise InvalidArgument(f"input {name!r} has neither 'data' nor binary_data_size", "data")
    if datatype == codec.OIP_BYTES:
        flat = _flatten(data)
        if not all(isinstance(x, str) for x in flat):
            raise InvalidArgument(f"input {name!r}: BYTES data in JSON are strings", "data")
        return flat
    dtype = codec.OIP_TO_DTYPE.get(datatype)
    if dtype is None:
        return b""  # tensor_request names the bad datatype
    try:
        arr = np.asarray(_flatten(data), dtype=DTYPES[dtype])
    except (TypeError, ValueError, OverflowError):
        raise InvalidArgument(f"input {name!r}: 'data' must be {datatype} numbers", "data") from None
    if arr.size != math.prod(shape):
        raise InvalidArgument(f"input {name!r}: 'data' has {arr.size} elements, shape "
                              f"{list(shape)} needs {math.prod(shape)}", "data")
    return arr


def _flatten(data: Any) -> list:
    if not isinstance(data, list):
        return [data]
    if not any(isinstance(x, list) for x in data):
        return data
    out: list = []
    for x in data:
        out.extend(_flatten(x))
    return out
