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
  comes from a ``content_type`` parameter (input or request) or the task's ``default_mime`` (else its first raw mime);
- request parameters ``sequence_id`` / ``sequence_start`` / ``sequence_end`` (Triton's sequence
  extension), ``priority`` and ``timeout`` (microseconds) map to ``lumen.*`` keys; ``lumen.*``
  parameters pass as they are; other scalar parameters go to the task as plain options.

Errors are ``{"error": "<message>"}`` with the status of Lumen's error table, the shape every
OIP client reads.  The protocol-neutral half (metadata, request building, output encoding) lives in
:mod:`.oip_mapping`, shared with the gRPC ``GRPCInferenceService`` (:mod:`.oip_grpc`), which
so never imports Starlette.
"""
from __future__ import annotations

import math
import zlib
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from ..contract import DTYPES, KEY_MODEL_VERSION
from ..errors import (
    InvalidArgument,
    LumenError,
    PayloadTooLarge,
    Unavailable,
    UnsupportedMediaType,
)
from . import codec, shm
from .door import OIP_ROUTE, OIP_VERSION_ROUTE
from .oip_mapping import (
    HEADER_LENGTH,
    JSON,
    MAX_BYTES_ELEMENTS,
    MAX_ECHO,
    OCTET_STREAM,
    P_BINARY,
    P_BINARY_OUTPUT,
    P_BINARY_SIZE,
    P_SHM_BYTE_SIZE,
    P_SHM_REGION,
    _output_bytes,
    _shape,
    build_request,
    bytes_elements,
    bytes_items,
    bytes_tensor,
    check_inputs,
    check_model,
    input_datatype,
    model_metadata,
    one_element_error,
    output_arrays,
    response_parameters,
    server_metadata,
)

if TYPE_CHECKING:  # typing only: the runtime as the doors use it
    from .http import HttpApp


# --------------------------------------------------------------------------- errors
def error_response(exc: LumenError) -> Response:
    headers = {}
    retry = getattr(exc, "retry_after_s", None)
    if retry is not None:
        headers["Retry-After"] = str(retry)
    if exc.http_status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return Response(codec.dumps({"error": exc.message}), status_code=exc.http_status,
                    headers=headers, media_type=JSON)


# --------------------------------------------------------------------------- REST
class OipRoutes:
    """The ``/v2`` endpoints of one :class:`~lumen_core.serve.http.HttpApp` (its body limit,
    disconnect watching, API keys and draining state are reused)."""

    def __init__(self, app: HttpApp):
        self.app = app
        self.rt = app.runtime
        self.shm = shm.registry_for(self.rt)

    def routes(self) -> list:
        def ep(name: str, fn: Callable) -> Callable:  # OIP's error shape, 401 included
            return self.app.endpoint(name, fn, error_response)

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
    @staticmethod
    def _caller(request: Request) -> shm.Caller:
        """The shared-memory caller: the request's key scope, and whether it is local."""
        client = request.client
        return shm.http_caller(request.state.key_scope, client.host if client else None,
                               request.headers.keys())

    async def shm_status(self, request: Request) -> Response:
        return self._json(self.shm.status(self._caller(request),
                                          request.path_params.get("name", "")))

    async def shm_register(self, request: Request) -> Response:
        caller = self._caller(request)
        obj, _ = _split_body(await self.app.read_body(request, "body"), None)
        self.shm.register(caller, request.path_params["name"], obj.get("key"),
                          obj.get("offset", 0), obj.get("byte_size"))
        return Response(b"", media_type=JSON)

    async def shm_unregister(self, request: Request) -> Response:
        self.shm.unregister(self._caller(request), request.path_params.get("name", ""))
        return Response(b"", media_type=JSON)

    async def infer(self, request: Request) -> Response:
        """``POST .../infer``: the hot door's (door.py) steps, from the Starlette app."""
        route = OIP_VERSION_ROUTE if "version" in request.path_params else OIP_ROUTE
        return await self.app.door.answer(request, route)

    # -- the two halves the hot door runs (door.py), whoever carries the request -----------
    def call_request(self, call: Any, body: bytes) -> Any:
        """The ``InferRequest`` of an infer call (a :class:`.door.Call` whose model
        ``check_model`` already found: ``call.contract``) with ``body``; what its reply needs
        is kept on ``call.state``."""
        if call.encoding:
            body = _decompress(body, call.encoding.decode("latin-1"), self.app.max_body)
        obj, binary = _split_body(body, call.binlen.decode("latin-1")
                                  if call.binlen is not None else None)
        params = obj.get("parameters") or {}
        if not isinstance(params, dict):
            raise InvalidArgument("'parameters' must be an object", "parameters")
        inputs = obj.get("inputs")
        check_inputs(inputs)
        inp = inputs[0]
        if not isinstance(inp, dict):
            raise InvalidArgument("each input must be an object", "inputs")
        name = str(inp.get("name", ""))[:MAX_ECHO]
        datatype = input_datatype(inp.get("datatype"), name)
        shape = _shape(inp.get("shape"), name)
        ip = inp.get("parameters") or {}
        if not isinstance(ip, dict):
            raise InvalidArgument(f"input {name!r}: 'parameters' must be an object", "parameters")
        caller = shm.Caller(call.key_scope, call.local())
        data = _input_data(inp, name, datatype, shape, ip, binary, self.shm, caller)
        rid = obj.get("id") or ""
        if not isinstance(rid, str):
            raise InvalidArgument("'id' must be a string", "id")
        key_scope = call.key_scope
        req = build_request(self.rt, call.task, name, datatype, shape, data, params, ip, rid,
                            lambda m: self.app.keys.scoped_meta(m, key_scope))
        if call.version:  # /versions/{v} pins the version (check_model knows it is loaded)
            req.meta[KEY_MODEL_VERSION] = call.version
        call.state = (obj, params, rid, caller)
        return req

    def call_reply(self, call: Any, resp: Any) -> tuple:
        """(content type, body, extra header pairs) of the reply to an infer call."""
        obj, params, rid, caller = call.state
        served = resp.stats.version if resp.stats is not None else ""
        return self._reply(resp, obj, params, served or call.contract.model_version, rid,
                           caller)

    def _reply(self, resp: Any, obj: dict, params: dict, version: str, rid: str,
               caller: shm.Caller) -> tuple:
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
                n = shm.output_write(self.shm, caller, shm_for[name], _output_bytes(arr, dt))
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
            return _JSON_TYPE, text, ()
        return _OCTET_TYPE, b"".join([text, *chunks]), (
            (_HEADER_LENGTH_BYTES, b"%d" % len(text)),)


_JSON_TYPE = JSON.encode()
_OCTET_TYPE = OCTET_STREAM.encode()
_HEADER_LENGTH_BYTES = HEADER_LENGTH.lower().encode()


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
        # digits first, and no more of them than the body's length has (int() of thousands
        # of digits is slow, and past 4,300 a ValueError)
        if (not (header_len.isascii() and header_len.isdigit())
                or len(header_len) > len(str(len(body))) or int(header_len) > len(body)):
            raise InvalidArgument(f"Inference-Header-Content-Length {header_len[:40]!r} is not "
                                  f"a length within the body ({len(body)} bytes)",
                                  "Inference-Header-Content-Length")
        n = int(header_len)
        head, binary = view[:n], view[n:]
    else:
        head, binary = view, view[:0]
    obj = codec.loads(bytes(head), "the request's JSON", "body")
    if not isinstance(obj, dict):
        raise InvalidArgument("the request must be a JSON object", "body")
    return obj, binary


def _input_data(inp: dict, name: str, datatype: Any, shape: tuple, ip: dict,
                binary: memoryview, registry: Optional[shm.ShmRegistry],
                caller: shm.Caller) -> Any:
    """The input's tensor bytes (numeric) or its elements (BYTES), from a shared-memory
    region (``caller``'s), the binary part or ``data``."""
    view = shm.input_view(registry, caller, ip)
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
        if len(flat) > MAX_BYTES_ELEMENTS:
            raise one_element_error(name, f"{len(flat)} in 'data'")
        if not all(isinstance(x, str) for x in flat):
            raise InvalidArgument(f"input {name!r}: BYTES data in JSON are strings", "data")
        return flat
    dtype = codec.OIP_TO_DTYPE.get(datatype)
    if dtype is None:
        return b""  # tensor_request names the bad datatype
    arr = _json_tensor(_flatten(data), name, datatype, DTYPES[dtype])
    if arr.size != math.prod(shape):
        raise InvalidArgument(f"input {name!r}: 'data' has {arr.size} elements, shape "
                              f"{list(shape)} needs {math.prod(shape)}", "data")
    return arr


#: the JSON values each kind of numeric datatype takes: an integer datatype takes integers
#: only (a float or a string is refused, never truncated or parsed into one), a float datatype
#: numbers, BOOL booleans (``bool`` is an ``int`` to Python, so it is named apart)
_JSON_TYPES: dict[str, tuple[set[type], str]] = {"i": ({int}, "integers"), "u": ({int}, "integers"),
               "f": ({int, float}, "numbers"), "b": ({bool}, "booleans")}


def _json_tensor(flat: list, name: str, datatype: str, dtype: np.dtype) -> np.ndarray:
    """JSON ``data`` (flattened) as an array of ``dtype``; the values must be of its kind and
    in its range (OverflowError from numpy)."""
    allowed, what = _JSON_TYPES[dtype.kind]
    odd = set(map(type, flat)) - allowed
    try:
        if odd:
            raise TypeError
        return np.asarray(flat, dtype=dtype)
    except (TypeError, ValueError, OverflowError):
        got = f", got {', '.join(sorted(t.__name__ for t in odd))}" if odd else " in its range"
        raise InvalidArgument(f"input {name!r}: 'data' must be {datatype} {what}{got}",
                              "data") from None


def _flatten(data: Any) -> list:
    """Nested JSON arrays as one flat list, without recursion (nesting is the client's)."""
    if not isinstance(data, list):
        return [data]
    if not any(isinstance(x, list) for x in data):
        return data
    out: list = []
    stack = [iter(data)]
    while stack:
        for x in stack[-1]:
            if isinstance(x, list):
                stack.append(iter(x))
                break
            out.append(x)
        else:
            stack.pop()
    return out
