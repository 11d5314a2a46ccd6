"""The HTTP API (SPEC section 6): a small Starlette app over one running :class:`Runtime`.

Why Starlette on uvicorn: it is a thin routing layer over raw ASGI (no validation framework, no
dependency injection on the hot path), and ASGI gives the two things this server must control
itself -- the request body as it streams in (so an oversized payload is refused with 413 before
it is all read) and the ``http.disconnect`` event (so a caller that hangs up cancels its queued
request instead of occupying a batch slot).

Routes::

    POST /v1/infer/{task}   body = payload, Content-Type = payload mime, query = meta
    GET  /v1/tasks          each task's contract
    GET  /healthz           live, plus which compiled extensions are in use
    GET  /readyz  /metrics

and, each from its own routes class over this app's public helpers (``endpoint``,
``read_body``, ``json_body``, ``until_done_or_gone``, ``check_open``): the OpenAI and TEI
routes (``/v1/embeddings``, ``/v1/tokenize``, ``/v1/models``: :mod:`.openai`), the Open
Inference Protocol under ``/v2`` (:mod:`.oip`), the admin API (:mod:`.admin`), and the
WebSocket streams (:mod:`.ws`).  Request bodies are read by :func:`.body.read_body`.

Every error is ``{"error": {"code", "message", "field"}}`` with the status of SPEC section 2.
The body is read once and handed to the runtime as the ``bytes`` object the server produced
(joined only when it arrived in several chunks); tensor replies are sent from a memoryview of
the output array, so neither direction copies a payload in Python.  The app translates between
HTTP and ``InferRequest`` / ``InferResponse`` and nothing more: what it needs to know about
tasks it asks the runtime's query API (``task_names``, ``describe``, ``token_ids_request``,
``text_request``, ``extensions``), and outputs are encoded by :mod:`.codec`.
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Mapping, Optional

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route, WebSocketRoute

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
from . import audio, codec, ws
from .admin import AdminRoutes
from .auth import ApiKeys, Unauthenticated, unscope_error
from .body import ClientGone, read_body
from .door import CLIENT_CLOSED_STATUS, INFER_ROUTE, HotDoor, until_done_or_gone
from .logs import RequestContext
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .metrics import PrometheusObserver
from .oip import OipRoutes
from .openai import OpenAiRoutes
from .options import check_options
from .rerank import RerankRoutes
from .tei import TeiRoutes

if TYPE_CHECKING:  # typing only: the runtime as the doors use it
    from .runtime_api import ServedRuntime

log = logging.getLogger("lumen.http")
#: POST routes with a fixed path that the hot door serves beside the native, OIP and OpenAI ones
TEI_HOT_ROUTES = ("/embed", "/", "/rerank", "/v1/rerank")
#: one line per finished request when the access log is on (never a header or a body)
access_log = logging.getLogger("lumen.access")

JSON, OCTET_STREAM = codec.JSON, codec.OCTET_STREAM
#: the most characters of a request path quoted back in a routing error
MAX_PATH_ECHO = 200
#: what a routing error suggests instead
ROUTES_HINT = ("the API is POST /v1/infer/{task}, POST /v1/embeddings, POST /v1/tokenize, "
               "POST /v1/rerank, TEI's POST /embed, /rerank and GET /info, "
               "GET /v1/tasks, /v1/admin/tasks, /v1/models, /healthz, /readyz, /metrics, "
               "the WebSocket /v1/stream/{task}, and the Open Inference Protocol under /v2 "
               "(GET /v2, /v2/models/{task}, POST /v2/models/{task}/infer)")
#: the error code of a 405 (a known path, another method); the Allow header names the methods
METHOD_NOT_ALLOWED = "method_not_allowed"
#: the one endpoint that never needs an API key (a liveness probe carries no secret)
ALWAYS_OPEN = frozenset({"/healthz", "/v2/health/live"})


def json_response(obj: Any, status: int = 200,
                  headers: Optional[Mapping[str, str]] = None) -> Response:
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

    def __init__(self, runtime: ServedRuntime, observer: Optional[PrometheusObserver] = None,
                 max_body_bytes: Optional[int] = None, keys: Optional[ApiKeys] = None,
                 access_log: bool = False, version: str = ""):
        self.runtime = runtime
        self.observer = observer
        self.max_body = max_body_bytes or runtime.config.server.max_payload_bytes
        self.keys = keys if keys is not None else ApiKeys()
        self.access_log = access_log
        self.version = version
        self.draining = False
        #: route template -> the guarded handler of its endpoint (the hot door calls them)
        self.handlers: dict = {}
        self.error_shapes: dict = {}
        ep = self.endpoint
        #: the Open Inference Protocol's routes (the hot door runs its infer call's halves)
        self.oip = OipRoutes(self)
        #: the OpenAI routes (the hot door runs the embeddings call's halves)
        self.openai = OpenAiRoutes(self)
        self.app = Starlette(routes=[
            Route("/v1/infer/{task}", ep("/v1/infer/{task}", self.infer), methods=["POST"]),
            Route("/v1/tasks", ep("/v1/tasks", self.tasks), methods=["GET"]),
            Route("/healthz", ep("/healthz", self.healthz), methods=["GET"]),
            Route("/readyz", ep("/readyz", self.readyz), methods=["GET"]),
            Route("/metrics", ep("/metrics", self.metrics), methods=["GET"]),
            *self.openai.routes(),  # embeddings, tokenize, models (openai.py)
            *TeiRoutes(self).routes(),  # TEI's /embed, / and /info (tei.py)
            *RerankRoutes(self).routes(),  # /rerank (TEI), /v1/rerank (Cohere) (rerank.py)
            *self.oip.routes(),  # the Open Inference Protocol under /v2 (oip.py)
            *AdminRoutes(self).routes(),  # versions, reloads, traffic (admin.py)
            # live speech segments over a WebSocket (ws.py)
            WebSocketRoute("/v1/stream/{task}", ws.StreamEndpoint(
                runtime, self.keys, lambda: self.draining,
                runtime.config.server.read_timeout_ms / 1000.0)),
        ], exception_handlers={HTTPException: routing_error})  # type: ignore[dict-item]
        # an unknown path is the JSON 404, never a redirect built from the Host header
        self.app.router.redirect_slashes = False
        #: what serves a request the hot door does not (door.py): the Starlette app, under
        #: the request context when the server asks for one (:meth:`with_context`)
        self.cold: Callable = self.app
        #: the inference routes' steps (door.py), on whichever carrier the request takes
        self.door = HotDoor(self, observer)
        for path in TEI_HOT_ROUTES:  # TEI's and the rerank routes: the hot path too
            self.door.add_route(path, path)
        #: whether the hot carriers serve (off with the access log: each endpoint's guard
        #: writes its line, so every request takes the Starlette app)
        self.hot = not access_log

    def with_context(self, access_log: bool) -> "HttpApp":
        """Serve the cold routes under :class:`.logs.RequestContext` (a correlation id on
        every request, the access log when ``access_log``); with the access log on, the hot
        routes take the cold path too (each line needs the request's record)."""
        self.cold = RequestContext(self.app, access_log=access_log)
        if access_log:
            self.hot = False
        return self

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if self.hot and scope["type"] == "http" and \
                getattr(self.runtime, "tracing", None) is None:
            hot = self.door.asgi(scope)
            if hot is not None:
                await hot(scope, receive, send)
                return
        await self.cold(scope, receive, send)

    # -- plumbing: the public helpers every routes class (openai.py, oip.py, admin.py,
    # audio.py's whole files) uses ------------------------------------------------------------
    def endpoint(self, name: str, fn: Callable[[Request], Awaitable[Response]],
                  errors: Callable[[LumenError], Response] = error_response,
                  admin: bool = False) -> Callable:
        """Wrap a route: :meth:`guard` it, and open the transport span when tracing is on."""
        handle = self.guard(name, fn, errors, admin)

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

        return endpoint

    def guard(self, name: str, fn: Callable[[Request], Awaitable[Response]],
              errors: Callable[[LumenError], Response] = error_response,
              admin: bool = False) -> Callable[[Request], Awaitable[Response]]:
        """``fn`` under its guard: check the API key (an admin key when ``admin``),
        LumenError -> JSON error (``errors`` makes the body: a protocol of its own, such as
        OIP's, keeps its shape for a missing key too), anything else -> logged 500, count it
        (and log it when the access log is on).  Remembered by route template for the hot
        door (:meth:`guarded`)."""
        observer = self.observer
        keys = self.keys
        needs_admin = admin and keys.admin_enabled
        needs_key = (not admin and keys.enabled and name not in ALWAYS_OPEN
                     and name not in keys.open_endpoints)

        async def handle(request: Request) -> Response:
            t0 = time.perf_counter()
            scope = None
            try:
                if needs_key:
                    scope = keys.check(request.headers.get("authorization"))
                elif needs_admin:
                    keys.check_admin(request.headers.get("authorization"))
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
                observer.http_request(name, resp.status_code)
            if self.access_log:
                client = request.client
                access_log.info("%s %s %s %d %.1fms", client.host if client else "-",
                                request.method, request.url.path[:MAX_PATH_ECHO],
                                resp.status_code, (time.perf_counter() - t0) * 1000)
            return resp

        self.handlers.setdefault(name, handle)
        self.error_shapes.setdefault(name, errors)
        return handle

    def guarded(self, name: str) -> Callable[[Request], Awaitable[Response]]:
        """The guarded handler of route template ``name`` (:meth:`guard`)."""
        return self.handlers[name]

    def errors_of(self, name: str) -> Callable[[LumenError], Response]:
        """The error shape of route template ``name``."""
        return self.error_shapes.get(name, error_response)

    #: the status a request whose client went away is counted under
    client_closed_status = CLIENT_CLOSED_STATUS

    async def read_body(self, request: Request, field: str) -> bytes:
        """The whole body under ``[server] max_payload_bytes`` (:func:`.body.read_body`)."""
        return await read_body(request, self.max_body, field)

    def until_done_or_gone(self, request: Request, work: Awaitable) -> Awaitable:
        """Await ``work`` while watching for ``http.disconnect``; a client that hangs up
        cancels it (and with it the queued runtime request(s)), raising ClientGone.

        The watcher cancels this task only while it is suspended in ``work`` (``waiting``),
        so a disconnect that races with completion can never cancel the reply path.  On
        Lumen's own connections (limits.py) the connection does the watching: no task."""
        return until_done_or_gone(request.scope, request.receive, work)

    def check_open(self) -> None:
        """503 once the server is draining (SIGTERM): no new inference request."""
        if self.draining:
            raise Unavailable("the server is shutting down; not accepting new requests")

    # -- inference ------------------------------------------------------------------------
    async def infer(self, request: Request) -> Response:
        """``POST /v1/infer/{task}``: the hot door's steps (door.py), from the Starlette app."""
        return await self.door.answer(request, INFER_ROUTE)

    async def audio_file(self, request: Request, task: str) -> Response:
        """A whole audio file posted to the native route of a speech task -> its segments."""
        self.check_options(task, request.query_params, audio.FILE_OPTIONS)
        return await audio.file_reply(self, request, task)

    def check_options(self, task: str, params: Any, route_options: Optional[dict] = None) -> None:
        """A plain query key that ``task`` does not read is a 400 (``options.check_options``:
        the same rule as gRPC's meta)."""
        check_options(self.runtime, task, params, route_options)

    async def json_body(self, request: Request, route: str) -> Any:
        """The JSON body of a route that takes one (415 for another Content-Type)."""
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype != JSON:
            raise UnsupportedMediaType(f"{route} takes a JSON body; send "
                                       f"'Content-Type: application/json', not {ctype!r}",
                                       "Content-Type")
        return codec.loads(await self.read_body(request, "body"), "the body", "body")

    # -- introspection --------------------------------------------------------------------
    async def tasks(self, request: Request) -> Response:
        return json_response({"tasks": self.runtime.describe()})

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

