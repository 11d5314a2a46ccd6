"""The HTTP API (SPEC section 6): a small Starlette app over one running :class:`Runtime`.

Why Starlette on uvicorn: it is a thin routing layer over raw ASGI (no validation framework, no
dependency injection on the hot path), and ASGI gives the two things this server must control
itself -- the request body as it streams in (so an oversized payload is refused with 413 before
it is all read) and the ``http.disconnect`` event (so a caller that hangs up cancels its queued
request instead of occupying a batch slot).

Routes::

    POST /v1/infer/{task}   body = payload, Content-Type = payload mime, query = meta
    POST /v1/embeddings     OpenAI-compatible; one runtime request per input item; ``model``
                            picks the embedding task; ``dimensions``, and the extensions
                            ``embedding_type``, ``truncate`` and ``normalize``
    POST /v1/tokenize       TEI's /tokenize: tokens, ids and character offsets per text
    GET  /v1/tasks          each task's contract;  GET /v1/models  (OpenAI model list)
    GET  /healthz           live, plus which compiled extensions are in use
    GET  /readyz  /metrics

Every error is ``{"error": {"code", "message", "field"}}`` with the status of SPEC section 2.
The body is read once and handed to the runtime as the ``bytes`` object the server produced
(joined only when it arrived in several chunks); tensor replies are sent from a memoryview of
the output array, so neither direction copies a payload in Python.  The app translates between
HTTP and ``InferRequest`` / ``InferResponse`` and nothing more: what it needs to know about
tasks it asks the runtime's query API (``task_names``, ``describe``, ``token_ids_request``,
``text_request``, ``extensions``), and outputs are encoded by :mod:`.codec`.
"""
from __future__ import annotations

import asyncio
import difflib
import logging
import re
import time
from typing import Any, Awaitable, Callable, Optional

import numpy as np
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute

from ..contract import EMBEDDING_TYPES as EMBEDDING_TYPE_DTYPES
from ..contract import KEY_EMBEDDING_DIMENSIONS, KEY_EMBEDDING_TYPE, RESERVED_PREFIX
from ..errors import (
    InternalError,
    InvalidArgument,
    LumenError,
    Overloaded,
    PayloadTooLarge,
    TaskNotFound,
    Unavailable,
    UnsupportedMediaType,
)
from ..request import InferRequest
from . import audio, codec, ws
from .admin import AdminRoutes
from .auth import ApiKeys, Unauthenticated, unscope_error
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import PrometheusObserver
from .oip import OipRoutes

log = logging.getLogger("lumen.http")
#: one line per finished request when the access log is on (never a header or a body)
access_log = logging.getLogger("lumen.access")

JSON = "application/json"
OCTET_STREAM = "application/octet-stream"
#: the most inputs one /v1/embeddings call may carry (OpenAI's own limit)
MAX_EMBEDDING_INPUTS = 2048
#: status reported (and counted) for a request whose client went away; nginx's convention
CLIENT_CLOSED_STATUS = 499
#: the output /v1/embeddings returns when a task has several
EMBEDDING_OUTPUT = "embedding"
#: header that picks one output for a raw tensor reply when a task has several
OUTPUT_HEADER = "lumen-output"
ENCODING_FORMATS = ("float", "base64")
#: ``embedding_type`` values of /v1/embeddings (``lumen.embedding.type`` on the native route)
EMBEDDING_TYPES = tuple(EMBEDDING_TYPE_DTYPES)
#: the boolean plain options of /v1/embeddings and /v1/tokenize, sent to the task as meta
OPT_TRUNCATE = "truncate"
OPT_NORMALIZE = "normalize"
#: the most characters of a request path quoted back in a routing error
MAX_PATH_ECHO = 200
#: what a routing error suggests instead
ROUTES_HINT = ("the API is POST /v1/infer/{task}, POST /v1/embeddings, POST /v1/tokenize, "
               "GET /v1/tasks, /v1/admin/tasks, /v1/models, /healthz, /readyz, /metrics, "
               "the WebSocket /v1/stream/{task}, and the Open Inference Protocol under /v2 "
               "(GET /v2, /v2/models/{task}, POST /v2/models/{task}/infer)")
#: the error code of a 405 (a known path, another method); the Allow header names the methods
METHOD_NOT_ALLOWED = "method_not_allowed"
#: how alike an unknown query key and a task's option must be to be suggested (difflib ratio)
OPTION_MATCH_CUTOFF = 0.75
#: the one endpoint that never needs an API key (a liveness probe carries no secret)
ALWAYS_OPEN = frozenset({"/healthz", "/v2/health/live"})
#: a lone UTF-16 surrogate (JSON can carry one as \ud800): no encoding can represent it
_SURROGATE = re.compile("[\ud800-\udfff]")


class ClientGone(Exception):
    """The client disconnected before its reply was ready (nothing can be sent)."""


def json_response(obj: Any, status: int = 200, headers: Optional[dict] = None) -> Response:
    return Response(codec.dumps(obj), status_code=status, headers=headers, media_type=JSON)


def error_response(exc: LumenError) -> Response:
    """The JSON error body with the status of the error table (429 carries Retry-After; 413
    closes the connection so the unread rest of the body is not drained into the server)."""
    headers = {}
    if isinstance(exc, Overloaded):
        headers["Retry-After"] = str(exc.retry_after_s)
    elif isinstance(exc, PayloadTooLarge):
        headers["Connection"] = "close"
    elif isinstance(exc, Unauthenticated):
        headers["WWW-Authenticate"] = "Bearer"
    return json_response({"error": exc.to_dict()}, exc.http_status, headers)


async def routing_error(request: Request, exc: HTTPException) -> Response:
    """The router's own 404 / 405 in the JSON error shape every other error has (SPEC 6)."""
    code = {404: TaskNotFound.code, 405: METHOD_NOT_ALLOWED}.get(exc.status_code,
                                                                InvalidArgument.code)
    path = request.url.path[:MAX_PATH_ECHO]
    msg = f"{exc.detail}: {request.method} {path}; {ROUTES_HINT}"
    return json_response({"error": {"code": code, "message": msg, "field": None}},
                         exc.status_code, exc.headers)


class HttpApp:
    """ASGI application serving one runtime.

    ``draining`` is set by the server on SIGTERM: from then on inference routes and ``/readyz``
    answer 503 while requests already admitted run to completion.
    """

    def __init__(self, runtime: Any, observer: Optional[PrometheusObserver] = None,
                 max_body_bytes: Optional[int] = None, keys: Optional[ApiKeys] = None,
                 access_log: bool = False, version: str = ""):
        self.runtime = runtime
        self.observer = observer
        self.max_body = max_body_bytes or runtime.config.server.max_payload_bytes
        self.keys = keys if keys is not None else ApiKeys()
        self.access_log = access_log
        self.version = version
        self.draining = False
        ep = self._endpoint
        self.app = Starlette(routes=[
            Route("/v1/infer/{task}", ep("/v1/infer/{task}", self.infer), methods=["POST"]),
            Route("/v1/embeddings", ep("/v1/embeddings", self.embeddings), methods=["POST"]),
            Route("/embeddings", ep("/v1/embeddings", self.embeddings), methods=["POST"]),
            Route("/v1/tokenize", ep("/v1/tokenize", self.tokenize), methods=["POST"]),
            Route("/tokenize", ep("/v1/tokenize", self.tokenize), methods=["POST"]),
            Route("/v1/tasks", ep("/v1/tasks", self.tasks), methods=["GET"]),
            Route("/v1/models", ep("/v1/models", self.models), methods=["GET"]),
            Route("/healthz", ep("/healthz", self.healthz), methods=["GET"]),
            Route("/readyz", ep("/readyz", self.readyz), methods=["GET"]),
            Route("/metrics", ep("/metrics", self.metrics), methods=["GET"]),
            *OipRoutes(self).routes(),  # the Open Inference Protocol under /v2 (oip.py)
            *AdminRoutes(self).routes(),  # versions, reloads, traffic (admin.py)
            # live speech segments over a WebSocket (ws.py)
            WebSocketRoute("/v1/stream/{task}", ws.StreamEndpoint(
                runtime, self.keys, lambda: self.draining,
                runtime.config.server.read_timeout_ms / 1000.0)),
        ], exception_handlers={HTTPException: routing_error})

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        await self.app(scope, receive, send)

    # -- plumbing -------------------------------------------------------------------------
    def _endpoint(self, name: str, fn: Callable[[Request], Awaitable[Response]],
                  errors: Callable[[LumenError], Response] = error_response) -> Callable:
        """Wrap a route: check the API key, LumenError -> JSON error (``errors`` makes the
        body: a protocol of its own, such as OIP's, keeps its shape for a missing key too),
        anything else -> logged 500, count it (and log it when the access log is on)."""
        observer = self.observer
        keys = self.keys
        needs_key = keys.enabled and name not in ALWAYS_OPEN and name not in keys.open_endpoints

        async def endpoint(request: Request) -> Response:
            tr = getattr(self.runtime, "tracing", None)
            if tr is None:
                return await handle(request)
            # the transport span: a child of the caller's W3C traceparent, when it sends one
            with tr.server_span(f"{request.method} {name}", request.headers,
                                {"http.request.method": request.method, "http.route": name,
                                 "url.path": request.url.path[:MAX_PATH_ECHO],
                                 "lumen.transport": "http"}) as span:
                resp = await handle(request)
                span.set_attribute("http.response.status_code", resp.status_code)
                if resp.status_code >= 500:
                    tr.set_error(span, str(resp.status_code))
                return resp

        async def handle(request: Request) -> Response:
            t0 = time.perf_counter()
            scope = None
            try:
                if needs_key:
                    scope = keys.check(request.headers.get("authorization"))
                request.state.key_scope = scope
                resp = await fn(request)
            except LumenError as exc:
                resp = errors(unscope_error(exc, scope))
            except ClientGone:
                resp = Response(status_code=CLIENT_CLOSED_STATUS)
            except Exception as exc:  # noqa: BLE001 - a bug must answer 500, not drop the socket
                log.exception("unhandled error on %s", name)
                resp = errors(InternalError(f"internal server error: {exc}"))
            if observer is not None:
                observer.transport_request("http", name, str(resp.status_code))
            if self.access_log:
                client = request.client
                access_log.info("%s %s %s %d %.1fms", client.host if client else "-",
                                request.method, request.url.path[:MAX_PATH_ECHO],
                                resp.status_code, (time.perf_counter() - t0) * 1000)
            return resp

        return endpoint

    async def _read_body(self, request: Request, field: str) -> bytes:
        """The whole body, refused with 413 as soon as it is known to exceed the limit: from
        Content-Length before reading anything, else while counting the streamed chunks."""
        limit = self.max_body
        declared = request.headers.get("content-length")
        if declared is not None:
            if not (declared.isascii() and declared.isdigit()):  # isdigit alone takes '\u00b2'
                raise InvalidArgument(f"bad Content-Length header {declared[:40]!r}", "Content-Length")
            if int(declared) > limit:
                raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {limit} "
                                      f"(server.max_payload_bytes)", field)
        receive = request.receive
        chunks: list = []
        total = 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise ClientGone()
            chunk = msg.get("body", b"")
            if chunk:
                total += len(chunk)
                if total > limit:
                    raise PayloadTooLarge(f"request body exceeds the limit of {limit} bytes "
                                          f"(server.max_payload_bytes)", field)
                chunks.append(chunk)
            if not msg.get("more_body", False):
                break
        if len(chunks) == 1:
            return chunks[0]
        return b"".join(chunks)

    async def _until_done_or_gone(self, request: Request, work: Awaitable) -> Any:
        """Await ``work`` while watching for ``http.disconnect``; a client that hangs up
        cancels it (and with it the queued runtime request(s)), raising ClientGone.

        The watcher cancels this task only while it is suspended in ``work`` (``waiting``),
        so a disconnect that races with completion can never cancel the reply path."""
        task = asyncio.current_task()
        state = {"waiting": True, "gone": False}
        receive = request.receive

        async def watch() -> None:
            while True:
                msg = await receive()
                if msg["type"] == "http.disconnect":
                    if state["waiting"]:
                        state["gone"] = True
                        task.cancel()
                    return

        watcher = asyncio.ensure_future(watch())
        try:
            return await work
        except asyncio.CancelledError:
            if state["gone"]:
                task.uncancel()
                raise ClientGone() from None
            raise
        finally:
            state["waiting"] = False
            watcher.cancel()

    def _check_open(self) -> None:
        if self.draining:
            raise Unavailable("the server is shutting down; not accepting new requests")

    # -- inference ------------------------------------------------------------------------
    async def infer(self, request: Request) -> Response:
        self._check_open()
        task = request.path_params["task"]
        headers = request.headers
        params = request.query_params
        if audio.wants_file(self.runtime, task, headers.get("content-type", ""),
                            params):  # a whole audio file -> segments (audio.py)
            self._check_options(task, params, audio.FILE_OPTIONS)
            return await audio.file_reply(self, request, task)
        if params:
            self._check_options(task, params)
        body = await self._read_body(request, "payload")
        meta = self.keys.scoped_meta(dict(request.query_params), request.state.key_scope)
        req = InferRequest(task, body, headers.get("content-type", ""), meta,
                           headers.get("x-correlation-id", ""))
        resp = await self._until_done_or_gone(request, self.runtime.infer(req))
        _merge_task_meta(resp)
        accept = headers.get("accept", "")
        if OCTET_STREAM in accept and JSON not in accept:
            return self._tensor_reply(resp, headers.get(OUTPUT_HEADER))
        return json_response(codec.response_json(resp),
                             headers={"X-Correlation-Id": resp.correlation_id})

    def _check_options(self, task: str, params: Any, route_options: Optional[dict] = None) -> None:
        """A plain (non-``lumen.*``) query key that ``task`` does not read is a 400 naming the
        options it does read (a typo such as ``normalise`` would otherwise be ignored);
        ``lumen.*`` keys are checked by the request contract."""
        plain = [k for k in params if not k.startswith(RESERVED_PREFIX)]
        if not plain or not self.runtime.has_task(task):  # an unknown task answers 404 later
            return
        known = {**self.runtime.request_options(task), **(route_options or {})}
        for key in plain:
            if key not in known:
                raise unknown_option(task, key, known)

    @staticmethod
    def _tensor_reply(resp: Any, wanted: Optional[str]) -> Response:
        outs = resp.outputs
        if wanted is not None:
            if wanted not in outs:
                raise InvalidArgument(f"task {resp.task!r} has no output {wanted!r} "
                                      f"(outputs: {', '.join(outs)})", "Lumen-Output")
            name = wanted
        elif len(outs) == 1:
            name = next(iter(outs))
        else:
            raise InvalidArgument(f"task {resp.task!r} has {len(outs)} outputs "
                                  f"({', '.join(outs)}); pick one with the Lumen-Output header "
                                  f"or accept application/json", "Accept")
        arr = outs[name]
        if not isinstance(arr, np.ndarray):
            raise InvalidArgument(f"output {name!r} of task {resp.task!r} is JSON, not a "
                                  f"tensor; accept application/json", "Accept")
        headers = {"Lumen-Tensor-Dtype": codec.dtype_name(arr),
                   "Lumen-Tensor-Shape": codec.shape_text(arr.shape),
                   "Lumen-Output": name, "X-Correlation-Id": resp.correlation_id}
        for k, v in resp.meta.items():
            headers["Lumen-Meta-" + k] = v
        return Response(codec.tensor_view(arr), headers=headers, media_type=OCTET_STREAM)

    async def _json_body(self, request: Request, route: str) -> Any:
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != JSON:
            raise UnsupportedMediaType(f"{route} takes a JSON body; send "
                                       f"'Content-Type: application/json', not {ctype!r}",
                                       "Content-Type")
        return codec.loads(await self._read_body(request, "body"), "the body", "body")

    def _embedding_tasks(self) -> dict:
        """``{task: its description}`` of the tasks that produce embeddings."""
        return {name: d for name, d in self.runtime.describe().items() if embeds(d)}

    def _embedding_task(self, model: str) -> Optional[dict]:
        """The description of embedding task ``model``; None when no such task is loaded (the
        runtime answers that: 404, or 503 while it is not running); 400 for a task that does
        not embed, naming those that do."""
        rt = self.runtime
        if not rt.has_task(model):
            return None
        try:
            desc = rt.describe(model)
        except TaskNotFound:  # removed meanwhile
            return None
        if not embeds(desc):
            names = sorted(self._embedding_tasks())
            raise InvalidArgument(f"task {model!r} does not produce embeddings; the models that "
                                  f"embed are: {', '.join(names) or 'none on this server'}",
                                  "model")
        return desc

    async def embeddings(self, request: Request) -> Response:
        self._check_open()
        obj = await self._json_body(request, "/v1/embeddings")
        model, items, fmt, meta = self._parse_embeddings(obj)
        desc = self._embedding_task(model)
        if desc is not None and (KEY_EMBEDDING_DIMENSIONS in meta or KEY_EMBEDDING_TYPE in meta) \
                and not isinstance(desc.get("embedding"), dict):
            field = "dimensions" if KEY_EMBEDDING_DIMENSIONS in meta else "embedding_type"
            raise InvalidArgument(f"task {model!r} returns its embedding as the model gives it; "
                                  f"it takes no {field!r} (omit the field)", field)
        if desc is not None and KEY_EMBEDDING_DIMENSIONS in meta:
            dim = embedding_dim(desc)
            if dim is not None and not 1 <= obj["dimensions"] <= dim:
                raise InvalidArgument(f"'dimensions' must be in 1..{dim} (the embedding size of "
                                      f"{model!r}), got {obj['dimensions']}", "dimensions")
        cid = request.headers.get("x-correlation-id", "")
        reqs = [self._embedding_request(model, item, f"{cid}-{i}" if cid else "",
                                        "input" if len(items) == 1 else f"input[{i}]")
                for i, item in enumerate(items)]
        if meta:
            for r in reqs:
                r.meta.update(meta)
        rt = self.runtime
        try:
            if len(reqs) == 1:
                try:
                    results = [await self._until_done_or_gone(request, rt.infer(reqs[0]))]
                except LumenError as exc:
                    if exc.field == "payload":  # the body's name for the text
                        exc.field = "input"
                    raise
            else:
                # each item is its own request (batched by the runtime) and has its own
                # outcome; the first error in index order answers the call, as one bad input
                # fails an OpenAI request, naming the item
                results = await self._until_done_or_gone(request, rt.infer_many(reqs))
                for i, res in enumerate(results):
                    if isinstance(res, LumenError):
                        if res.field == "payload":
                            res.field = f"input[{i}]"
                            res.message = f"input[{i}]: {res.message}"
                        raise res
        except TaskNotFound as exc:
            raise TaskNotFound(exc.message, "model") from None
        except InvalidArgument as exc:  # the task's name for an option -> the body's field
            if exc.field in _OPTION_FIELDS:
                raise InvalidArgument(exc.message, _OPTION_FIELDS[exc.field]) from None
            raise
        data = []
        tokens = 0
        for i, res in enumerate(results):
            vec = self._embedding_output(res)
            emb: Any = (codec.b64_tensor(vec) if fmt == "base64"
                        else vec.reshape(-1).tolist())
            data.append({"object": "embedding", "index": i, "embedding": emb})
            if res.stats is not None:
                tokens += res.stats.tokens
        return json_response({"object": "list", "data": data, "model": model,
                              "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    def _parse_embeddings(self, obj: Any) -> tuple:
        if not isinstance(obj, dict):
            raise InvalidArgument("the body must be a JSON object", "body")
        model = obj.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidArgument("'model' must name a task, e.g. \"text_embed\"", "model")
        fmt = obj.get("encoding_format") or "float"
        if fmt not in ENCODING_FORMATS:
            raise InvalidArgument(f"'encoding_format' must be one of {', '.join(ENCODING_FORMATS)}, "
                                  f"got {fmt!r}", "encoding_format")
        meta: dict = {}
        dims = obj.get("dimensions")
        if dims is not None:
            if not isinstance(dims, int) or isinstance(dims, bool):
                raise InvalidArgument(f"'dimensions' must be an integer from 1 to the model's "
                                      f"embedding size, got {dims!r}", "dimensions")
            meta[KEY_EMBEDDING_DIMENSIONS] = str(dims)
        etype = obj.get("embedding_type")
        if etype is not None and etype != "float":
            if etype not in EMBEDDING_TYPES:
                raise InvalidArgument(f"'embedding_type' must be one of "
                                      f"{', '.join(EMBEDDING_TYPES)}, got {etype!r}",
                                      "embedding_type")
            if fmt == "base64":
                # a base64 string reads as float32 to every OpenAI client (the official one
                # asks for base64 by default and decodes it so): integers would be misread
                raise InvalidArgument(f"embedding_type {etype!r} returns integers; send "
                                      f"\"encoding_format\": \"float\" with it (base64 is "
                                      f"float32 only, and the openai client asks for base64 "
                                      f"unless told otherwise)", "encoding_format")
            meta[KEY_EMBEDDING_TYPE] = etype
        for key in (OPT_TRUNCATE, OPT_NORMALIZE):  # TEI's /embed flags, extensions here
            flag = obj.get(key)
            if flag is not None:
                if not isinstance(flag, bool):
                    raise InvalidArgument(f"'{key}' must be true or false, got {flag!r}", key)
                meta[key] = "true" if flag else "false"
        inp = obj.get("input")
        if isinstance(inp, str):
            items: list = [inp]
        elif isinstance(inp, list) and inp and all(isinstance(t, int) and not isinstance(t, bool)
                                                    for t in inp):
            items = [inp]  # one input given as token ids
        elif isinstance(inp, list) and inp:
            items = inp
        else:
            raise InvalidArgument("'input' must be a string, a non-empty array of strings, or "
                                  "token ids", "input")
        if len(items) > MAX_EMBEDDING_INPUTS:
            raise InvalidArgument(f"'input' has {len(items)} items; at most "
                                  f"{MAX_EMBEDDING_INPUTS} per call", "input")
        return model, items, fmt, meta

    async def tokenize(self, request: Request) -> Response:
        """TEI's ``/tokenize``: ``{"inputs": str | [str], "model"?, "truncate"?}`` -> per text
        a list of ``{"id", "text", "special", "start", "stop"}`` (character offsets), cut as
        the task cuts what it embeds unless ``truncate`` is false.  ``model`` may be left out
        when one task tokenizes."""
        self._check_open()
        obj = await self._json_body(request, "/v1/tokenize")
        if not isinstance(obj, dict):
            raise InvalidArgument("the body must be a JSON object", "body")
        inp = obj.get("inputs", obj.get("input"))
        if isinstance(inp, str):
            texts = [inp]
        elif isinstance(inp, list) and inp and all(isinstance(t, str) for t in inp):
            texts = inp
        else:
            raise InvalidArgument("'inputs' must be a string or a non-empty array of strings",
                                  "inputs")
        if len(texts) > MAX_EMBEDDING_INPUTS:
            raise InvalidArgument(f"'inputs' has {len(texts)} items; at most "
                                  f"{MAX_EMBEDDING_INPUTS} per call", "inputs")
        for i, text in enumerate(texts):
            bad = None if text.isascii() else _SURROGATE.search(text)
            if bad is not None:
                raise InvalidArgument(f"inputs[{i}] holds a lone UTF-16 surrogate "
                                      f"(U+{ord(bad.group()):04X}): not a valid Unicode string",
                                      "inputs")
        truncate = obj.get("truncate", True)
        if not isinstance(truncate, bool):
            raise InvalidArgument(f"'truncate' must be true or false, got {truncate!r}", "truncate")
        rt = self.runtime
        tokenizers = sorted(n for n, d in rt.describe().items() if d.get("tokenizer"))
        model = obj.get("model")
        if model is None:
            if len(tokenizers) != 1:
                raise InvalidArgument(f"name the task in 'model': the tasks that tokenize are "
                                      f"{', '.join(tokenizers) or 'none on this server'}", "model")
            model = tokenizers[0]
        elif not isinstance(model, str) or not rt.has_task(model):
            raise TaskNotFound(f"unknown model {str(model)[:MAX_PATH_ECHO]!r}; the tasks that "
                               f"tokenize are {', '.join(tokenizers) or 'none'}", "model")
        elif model not in tokenizers:
            raise InvalidArgument(f"task {model!r} does not tokenize text; the tasks that do "
                                  f"are {', '.join(tokenizers) or 'none on this server'}", "model")
        return json_response(await rt.tokenize(model, texts, truncate))

    def _embedding_request(self, model: str, item: Any, cid: str, field: str) -> InferRequest:
        """A text goes as the ``str`` itself (no encode here, no decode in the task); token ids
        go through the tensor route under the preprocess id the task declares for them (the
        tokenizer contract stays the task's: the runtime builds that request)."""
        rt = self.runtime
        if isinstance(item, str):
            if not item.isascii():
                bad = _SURROGATE.search(item)
                if bad is not None:
                    raise InvalidArgument(f"{field} holds a lone UTF-16 surrogate "
                                          f"(U+{ord(bad.group()):04X}) at character {bad.start()}:"
                                          f" not a valid Unicode string", field)
            return rt.text_request(model, item, cid)
        if isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool)
                                                   for t in item):
            if not rt.has_task(model):
                # no contract to ask: infer answers it like any request for an unknown task
                # (404, or 503 while the runtime is not running)
                return rt.text_request(model, "", cid)
            return rt.token_ids_request(model, item, cid, "input")
        raise InvalidArgument("each 'input' item must be a string or an array of token ids", "input")

    @staticmethod
    def _embedding_output(res: Any) -> np.ndarray:
        outs = res.outputs
        if EMBEDDING_OUTPUT in outs:
            return outs[EMBEDDING_OUTPUT]
        if len(outs) == 1:
            return next(iter(outs.values()))
        raise InvalidArgument(f"task {res.task!r} has no {EMBEDDING_OUTPUT!r} output "
                              f"(outputs: {', '.join(outs)}); use /v1/infer/{res.task}", "model")

    # -- introspection --------------------------------------------------------------------
    async def tasks(self, request: Request) -> Response:
        return json_response({"tasks": self.runtime.describe()})

    async def models(self, request: Request) -> Response:
        created = int(time.time())
        described = self.runtime.describe()
        data = []
        for name in self.runtime.task_names():
            entry: dict = {"id": name, "object": "model", "created": created, "owned_by": "lumen"}
            d = described.get(name)
            if d is not None and embeds(d):
                entry["capabilities"] = ["embed"]
                dim = embedding_dim(d)
                if dim is not None:
                    entry["embedding_dim"] = dim
                card = d.get("model_card")
                if isinstance(card, dict):  # what the model is and measured (the task's card)
                    entry["description"] = card.get("summary", "")
                    entry["model_card"] = card
            else:
                entry["capabilities"] = []
            data.append(entry)
        return json_response({"object": "list", "data": data})

    async def healthz(self, request: Request) -> Response:
        """Live (no runtime state needed), and which compiled extensions this build runs, so
        an operator can tell a build without them (``LUMEN_NO_EXTENSIONS=1``) from a fast one."""
        ext = self.runtime.extensions()
        return json_response({"status": "ok", "version": self.version,
                              "compiled_extensions": bool(ext) and all(ext.values()),
                              "extensions": ext})

    async def readyz(self, request: Request) -> Response:
        if self.draining:
            raise Unavailable("the server is shutting down")
        if not self.runtime.ready:
            raise Unavailable("the runtime is still loading and warming up its tasks")
        return json_response({"status": "ready", "tasks": self.runtime.task_names()})

    async def metrics(self, request: Request) -> Response:
        if self.observer is None:
            raise TaskNotFound("metrics are not enabled on this server", None)
        return Response(self.observer.exposition(), media_type=METRICS_CONTENT_TYPE)


#: a task's option names (its error fields) -> the /v1/embeddings body fields that set them
_OPTION_FIELDS = {KEY_EMBEDDING_DIMENSIONS: "dimensions", KEY_EMBEDDING_TYPE: "embedding_type"}


def unknown_option(task: str, key: str, known: Any) -> InvalidArgument:
    """The 400 for a query key ``task`` does not read: the closest option it does read (by
    spelling, or by the last part of a ``lumen.*`` name: ``dimensions`` ->
    ``lumen.embedding.dimensions``), then all of them."""
    by_tail = {name.rsplit(".", 1)[-1]: name for name in sorted(known)}
    close = difflib.get_close_matches(key, list(by_tail), n=1, cutoff=OPTION_MATCH_CUTOFF)
    hint = f" (did you mean {by_tail[close[0]]!r}?)" if close else ""
    options = ", ".join(sorted(known)) or "none"
    return InvalidArgument(f"task {task!r} has no option {key[:MAX_PATH_ECHO]!r}{hint}; its "
                           f"options are: {options}, and the lumen.* request keys of every "
                           f"task (GET /v1/tasks lists each task's request_options)",
                           key[:MAX_PATH_ECHO])


def embeds(desc: dict) -> bool:
    """Whether a task (by its description) produces embeddings: it says so (``embedding``),
    or it has an ``embedding`` output."""
    if desc.get("embedding") or desc.get("output") == EMBEDDING_OUTPUT:
        return True
    outs = desc.get("outputs")
    return isinstance(outs, dict) and EMBEDDING_OUTPUT in outs


def embedding_dim(desc: dict) -> Optional[int]:
    """The embedding size a task declares, when it declares one."""
    emb = desc.get("embedding")
    if isinstance(emb, dict) and isinstance(emb.get("dim"), int):
        return emb["dim"]
    outs = desc.get("outputs")
    spec = outs.get(EMBEDDING_OUTPUT) if isinstance(outs, dict) else None
    if isinstance(spec, (list, tuple)) and len(spec) == 2 and isinstance(spec[1], list) \
            and len(spec[1]) == 1 and isinstance(spec[1][0], int):
        return spec[1][0]
    return None


def _merge_task_meta(resp: Any) -> None:
    """Response meta a task attached to its outputs (``outputs.meta``, e.g.
    ``lumen.truncated``) into the response's meta."""
    extra = getattr(resp.outputs, "meta", None)
    if extra:
        resp.meta.update(extra)
