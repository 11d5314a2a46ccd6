"""The front door's hot routes: the inference routes' steps, whoever carries the request.

``POST /v1/infer/{task}``, ``POST /v2/models/{task}[/versions/{v}]/infer`` and
``POST /v1/embeddings`` (``/embeddings``) are served by four steps on a :class:`Call` (what the route read of the request line and headers):
:meth:`HotDoor.begin` once the headers are in (the API key, before any body is read; the
draining state; the native route's query meta, or the OIP model), :meth:`HotDoor.request` once
the body is in (the ``InferRequest``), then :meth:`HotDoor.reply` or :meth:`HotDoor.error`
(status, header pairs, body).  Three carriers run them, so each route is written once:

- Lumen's own HTTP connections (:mod:`.door_protocol`): no ASGI scope, cycle or task per
  request; the runtime's compiled ``admit`` queues the request from the parser's callback and
  the batch's answer writes the reply from the future's callback;
- :meth:`HotDoor.serve`: the same routes as plain ASGI in front of the Starlette app, for a
  request that reaches the ASGI app (another server, an in-process test client, a pipelined
  request) -- no middleware stack, no router, no watcher task per request;
- :meth:`HotDoor.answer`: the Starlette endpoints of these routes (taken when the access log or
  tracing is on, each a per-request record by nature, or under a proxy root path).

On every carrier: one pass over the raw headers for the few a route reads, the query string
parsed only on the native route (it is the request's meta) and remembered per distinct string,
no correlation id unless the client sends one (the native JSON reply's ``correlation_id`` is
the runtime's, made when read), tensor reply headers built once per (task, output, dtype,
shape) as bytes, and the transport counter a dict increment folded into Prometheus at scrape
time (:mod:`.metrics`).  Every guard still applies: the header-size, read-timeout,
body-deadline and connection limits are the connection's (:mod:`.limits`), the body limit is
checked from Content-Length and while the body arrives, the API key before the body is read, a
draining server answers 503, and errors keep their JSON shapes (Lumen's, or the Open Inference
Protocol's on ``/v2``).

TEI's and the rerank routes (:meth:`HotDoor.add_route`) run their app handler under its guard
on the ASGI carrier, without the stack and the router.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional
from urllib.parse import parse_qsl

import numpy as np
from starlette.requests import Request
from starlette.responses import Response

from ..errors import (
    InternalError,
    InvalidArgument,
    LumenError,
    PayloadTooLarge,
    UnsupportedMediaType,
)
from ..request import InferRequest
from . import audio, codec
from .auth import unscope_error
from .body import ClientGone, check_declared, receive_body
from .limits import connection_of
from .logs import CORRELATION_HEADER, CORRELATION_ID, client_correlation_id, scope_correlation_id
from .oip_mapping import check_model
from .shm import FORWARDING_HEADERS, is_loopback

if TYPE_CHECKING:  # typing only: the runtime as the doors use it
    from .http import HttpApp

log = logging.getLogger("lumen.http")

#: the most distinct query strings (and tensor reply header sets) remembered; past it the
#: memo is emptied (a client sending ever-new strings pays the parse, nothing more)
MAX_MEMO = 512
_OCTET = b"application/octet-stream"
_JSON = b"application/json"
_START = "http.response.start"
_BODY = "http.response.body"
_INFER_PREFIX = "/v1/infer/"
_OIP_PREFIX = "/v2/models/"
_OIP_SUFFIX = "/infer"
_VERSIONS = "/versions/"
#: the route templates the transport counter and the error log name
INFER_ROUTE = "/v1/infer/{task}"
OIP_ROUTE = "/v2/models/{task}/infer"
OIP_VERSION_ROUTE = "/v2/models/{task}/versions/{version}/infer"
EMBEDDINGS_ROUTE = "/v1/embeddings"
#: the status a request whose client went away is counted under (nginx's convention)
CLIENT_CLOSED_STATUS = 499
#: header pairs and their lines, when a reply has no fixed part
NO_FIXED: tuple = ((), b"")
#: forwarding headers: a request that carries one came through a proxy (not local for shm)
_FORWARDING = frozenset(h.encode() for h in FORWARDING_HEADERS)
#: what the query memo holds for a whole audio file (its own route)
_AUDIO_FILE: dict = {}


class Call:
    """One request on a hot route: the route template, the task (and version) from its path,
    its query string, the headers the routes read, and what the steps found (key scope, meta,
    the OIP model's contract, ``state`` for the reply)."""

    __slots__ = ("route", "task", "version", "query", "ctype", "length", "accept", "auth",
                 "cid", "output", "encoding", "binlen", "proxied", "client", "key_scope",
                 "meta", "contract", "state")

    def __init__(self, route: str, task: str, version: str, query: bytes) -> None:
        self.route = route
        self.task = task
        self.version = version
        self.query = query
        self.ctype: Optional[bytes] = None
        self.length: Optional[bytes] = None
        self.accept: Optional[bytes] = None
        self.auth: Optional[bytes] = None
        self.output: Optional[bytes] = None
        self.encoding: Optional[bytes] = None
        self.binlen: Optional[bytes] = None
        self.cid = ""
        self.proxied = False
        self.client: Optional[str] = None
        self.key_scope: Optional[str] = None
        self.meta: Any = None
        self.contract: Any = None
        self.state: Any = None

    def read_headers(self, headers: Any) -> None:
        """One pass over the raw (lower-case name, value) pairs for the ones a route reads."""
        for name, value in headers:
            if name == b"content-type":
                self.ctype = value
            elif name == b"content-length":
                self.length = value
            elif name == b"accept":
                self.accept = value
            elif name == b"authorization":
                self.auth = value
            elif name == CORRELATION_HEADER:
                self.cid = client_correlation_id(value)
            elif name == b"lumen-output":
                self.output = value
            elif name == b"content-encoding":
                self.encoding = value
            elif name == b"inference-header-content-length":
                self.binlen = value
            elif name in _FORWARDING:
                self.proxied = True

    @property
    def mime(self) -> str:
        return self.ctype.decode("latin-1") if self.ctype is not None else ""

    def local(self) -> bool:
        """Whether the caller is on this machine and came through no proxy (shared memory)."""
        return is_loopback(self.client) and not self.proxied


#: the paths of OpenAI's embeddings route (OpenAI clients call it with and without ``/v1``)
EMBEDDINGS_PATHS = frozenset({"/v1/embeddings", "/embeddings"})


def call_of(path: str, query: bytes) -> Optional[Call]:
    """The :class:`Call` of a POST to ``path`` when it is a hot inference route, else None."""
    if path in EMBEDDINGS_PATHS:
        return Call(EMBEDDINGS_ROUTE, "", "", query)
    if path.startswith(_INFER_PREFIX):
        task = path[len(_INFER_PREFIX):]
        if task and "/" not in task:
            return Call(INFER_ROUTE, task, "", query)
    elif path.startswith(_OIP_PREFIX) and path.endswith(_OIP_SUFFIX):
        rest = path[len(_OIP_PREFIX):-len(_OIP_SUFFIX)]
        task, sep, version = rest.partition(_VERSIONS)
        if task and "/" not in task and (not sep or (version and "/" not in version)):
            return Call(OIP_VERSION_ROUTE if sep else OIP_ROUTE, task, version, query)
    return None


def _json_head(n: int, cid: str) -> list:
    headers = [(b"content-type", _JSON), (b"content-length", b"%d" % n)]
    if cid:
        headers.append((CORRELATION_HEADER, cid.encode("latin-1")))
    return headers


async def respond(scope: dict, send: Callable, status: int, headers: Any, body: Any,
                  fixed: Any = NO_FIXED) -> None:
    """Send a whole response: in one write on Lumen's own connections (``reply`` of
    :mod:`.limits`), else as the two ASGI messages.  ``fixed``: header pairs and the same
    headers formatted as lines, made once by the caller."""
    conn = connection_of(scope)
    if conn is not None and conn.reply(scope, status, headers, body, fixed[1]):
        return
    await send({"type": _START, "status": status, "headers": [*fixed[0], *headers]})
    await send({"type": _BODY, "body": body})


def header_lines(headers: Any) -> bytes:
    """Header pairs as the lines of a response head."""
    return b"".join(b"%s: %s\r\n" % (k, v) for k, v in headers)


class HotDoor:
    """The hot routes of ``app`` (an :class:`.http.HttpApp`): the steps of a :class:`Call`,
    and the ASGI carriers (:meth:`asgi`, :meth:`answer`)."""

    def __init__(self, app: HttpApp, observer: Any) -> None:
        self.app = app
        self.runtime = app.runtime
        self.keys = app.keys
        self.count = observer.http_request if observer is not None else None
        self.queries: dict = {}  # (task, query string) -> meta (checked against the task)
        self.tensor_heads: dict = {}  # (task, output, dtype, shape) -> header list
        self.needs_key = app.keys.enabled
        #: POST path -> the coroutine serving it: routes with a fixed path whose handler is
        #: the app's, under their endpoint's guard (:meth:`add_route`)
        self.exact: dict = {}

    def add_route(self, path: str, route: str) -> None:
        """Serve ``POST path`` on the hot path by the handler the app guards as ``route`` (a
        route template the app registered with :meth:`.http.HttpApp.guard`, e.g. TEI's
        ``/embed``): the same guard, errors and counting, without the stack and the router."""
        self.app.guarded(route)  # a route the app does not guard is a KeyError here, at start

        async def serve(scope: dict, receive: Callable, send: Callable) -> None:
            await self.guarded(scope, receive, send, route)

        self.exact[path] = serve

    # -- the steps ------------------------------------------------------------------------
    def begin(self, call: Call, keyed: bool = False) -> bool:
        """The request line and headers are in: check the API key (unless the caller did:
        ``keyed``), the draining state, the body's declared length, and the native route's
        query meta or the OIP route's model.  False: a native request for a whole audio file
        (its own route: the app's).  Raises the LumenError to answer."""
        if self.needs_key and not keyed:
            auth = call.auth
            call.key_scope = self.keys.check(auth.decode("latin-1") if auth is not None
                                             else None)
        self.app.check_open()
        if call.length is not None:
            check_declared(call.length.decode("latin-1"), self.app.max_body, "payload")
        route = call.route
        if route is INFER_ROUTE:
            meta = self.meta(call.task, call.query, call.mime)
            if meta is None:
                return False
            if call.key_scope is not None:
                meta = self.keys.scoped_meta(meta, call.key_scope)
            call.meta = meta
        elif route is EMBEDDINGS_ROUTE:
            mime = call.mime.split(";")[0].strip().lower()
            if mime != codec.JSON:
                raise UnsupportedMediaType(f"{EMBEDDINGS_ROUTE} takes a JSON body; send "
                                           f"'Content-Type: application/json', not {mime!r}",
                                           "Content-Type")
        else:
            call.contract = check_model(self.runtime, call.task, call.version)
        return True

    def request(self, call: Call, body: bytes) -> Any:
        """The body is in: the runtime request (a list of them for an embeddings call with
        several inputs: :meth:`outcome` runs them as one group)."""
        route = call.route
        if route is INFER_ROUTE:
            return InferRequest(call.task, body, call.mime, call.meta, call.cid)
        if route is EMBEDDINGS_ROUTE:
            return self.app.openai.call_request(call, body)
        return self.app.oip.call_request(call, body)

    async def outcome(self, call: Call, req: Any) -> Any:
        """The runtime's answer to :meth:`request`'s request(s), awaited: a response, or a
        list of them (the first item error in index order raised)."""
        if type(req) is list:
            return self.app.openai.call_results(await self.runtime.infer_many(req))
        return await self.runtime.infer(req)

    def reply(self, call: Call, resp: Any) -> tuple:
        """(status, fixed headers, header pairs, body) of the answer ``resp``."""
        if call.route is INFER_ROUTE:
            extra = getattr(resp.outputs, "meta", None)
            if extra:
                resp.meta.update(extra)
            accept = call.accept
            if accept is not None and _OCTET in accept and _JSON not in accept:
                return self.tensor_reply(call, resp)
            out = codec.dumps(codec.response_json(resp))
            return 200, NO_FIXED, _json_head(len(out), resp.correlation_id), out
        if call.route is EMBEDDINGS_ROUTE:
            out = self.app.openai.call_reply(call, resp if type(resp) is list else [resp])
            ctype, headers = _JSON, ()
        else:
            ctype, out, headers = self.app.oip.call_reply(call, resp)
        pairs = [(b"content-type", ctype), (b"content-length", b"%d" % len(out)), *headers]
        if call.cid:
            pairs.append((CORRELATION_HEADER, call.cid.encode("latin-1")))
        return 200, NO_FIXED, pairs, out

    def error(self, call: Call, exc: LumenError) -> tuple:
        """(status, header pairs, body) of the error ``exc`` in the route's shape."""
        if call.route is EMBEDDINGS_ROUTE:
            exc = self.app.openai.call_error(exc)
        resp = self.app.errors_of(call.route)(unscope_error(exc, call.key_scope))
        if call.cid:
            resp.headers[CORRELATION_HEADER.decode()] = call.cid
        return resp.status_code, resp.raw_headers, resp.body

    def failure(self, call: Call, exc: BaseException) -> tuple:
        """:meth:`error` of an unexpected exception: logged, answered 500."""
        log.error("unhandled error on %s", call.route, exc_info=exc)
        return self.error(call, InternalError(f"internal server error: {exc}"))

    # -- the native route's meta and tensor replies -----------------------------------------
    def meta(self, task: str, query: bytes, mime: str) -> Optional[dict]:
        """The request meta of ``query`` (a fresh dict: the runtime may add to it), its plain
        keys checked against ``task``'s options; None for a whole audio file.  Remembered per
        (task, query string, content type) while the task's head version stays the one it
        was checked against (a reload or a load clears the memo at the next request)."""
        try:
            head = self.runtime.tasks.get(task)
        except AttributeError:  # a runtime stand-in without a task table: nothing remembered
            head = None
        key = (task, query, mime)
        memo = self.queries.get(key)
        if memo is not None:
            if memo[0] is head:
                meta = memo[1]
                if meta is _AUDIO_FILE:
                    return None
                return dict(meta) if meta else {}
            self.queries.clear()  # the task changed: nothing remembered holds it alive
        meta = dict(parse_qsl(query.decode("latin-1"), keep_blank_values=True)) \
            if query else {}
        if audio.wants_file(self.runtime, task, mime, meta):
            if head is not None:
                self.remember(key, head, _AUDIO_FILE)
            return None
        if meta:
            self.app.check_options(task, meta)
        if head is not None:  # an unknown task is refused later, and never remembered
            self.remember(key, head, dict(meta))
        return meta

    def remember(self, key: tuple, head: Any, meta: dict) -> None:
        if len(self.queries) >= MAX_MEMO:
            self.queries.clear()
        self.queries[key] = (head, meta)

    def tensor_reply(self, call: Call, resp: Any) -> tuple:
        """The raw tensor reply: its fixed headers made once per (task, output, dtype, shape),
        the response meta (batch figures) added as ``lumen-meta-*`` headers."""
        output = call.output
        wanted = output.decode("latin-1") if output is not None else None
        outs = resp.outputs
        head = None
        if wanted is None and len(outs) == 1:
            name, arr = next(iter(outs.items()))
            key = (call.task, name, arr.dtype, arr.shape) if type(arr) is np.ndarray else None
            head = self.tensor_heads.get(key)
        if head is None:
            name, arr, pairs = tensor_head(resp, wanted)
            head = (pairs, header_lines(pairs))
            if wanted is None:
                if len(self.tensor_heads) >= MAX_MEMO:
                    self.tensor_heads.clear()
                self.tensor_heads[(call.task, name, arr.dtype, arr.shape)] = head
        extra = meta_headers(resp.meta) if resp.meta else []
        if call.cid:
            extra.append((CORRELATION_HEADER, call.cid.encode("latin-1")))
        return 200, head, extra, codec.tensor_view(arr)

    # -- the ASGI carriers ------------------------------------------------------------------
    def asgi(self, scope: dict) -> Optional[Callable]:
        """The coroutine function serving ``scope`` on the hot path, or None (the app's)."""
        if scope["method"] != "POST" or scope.get("root_path"):
            return None
        path = scope["path"]
        call = call_of(path, scope["query_string"])
        if call is not None:
            scope["lumen.call"] = call
            return self.serve
        serve = self.exact.get(path)
        if serve is not None:
            scope["path_params"] = {}
        return serve

    async def serve(self, scope: dict, receive: Callable, send: Callable) -> None:
        """A hot inference route as plain ASGI."""
        call: Call = scope["lumen.call"]
        call.read_headers(scope["headers"])
        if call.cid:
            CORRELATION_ID.set(call.cid)
        client = scope.get("client")
        call.client = client[0] if client else None
        try:
            if not self.begin(call):  # a whole audio file: the app's route
                await self.app.cold(scope, receive, send)
                return
            body = await receive_body(receive, None, self.app.max_body, "payload")
            resp = await until_done_or_gone(scope, receive,
                                            self.outcome(call, self.request(call, body)))
            status, fixed, headers, out = self.reply(call, resp)
            await respond(scope, send, status, headers, out, fixed)
        except LumenError as exc:
            status, headers, out = self.error(call, exc)
            await respond(scope, send, status, headers, out)
        except ClientGone:
            status = CLIENT_CLOSED_STATUS
        except Exception as exc:  # noqa: BLE001 - a bug must answer 500, not drop the socket
            status, headers, out = self.failure(call, exc)
            await respond(scope, send, status, headers, out)
        if self.count is not None:
            self.count(call.route, status)

    async def answer(self, request: Request, route: str) -> Response:
        """Hot inference route ``route`` (:data:`INFER_ROUTE`, :data:`OIP_ROUTE`,
        :data:`OIP_VERSION_ROUTE`) as a Starlette endpoint (inside its guard: the key is
        checked, errors are shaped and counted there)."""
        scope = request.scope
        p = request.path_params
        call = Call(route, p.get("task", ""), p.get("version", ""), scope["query_string"])
        call.read_headers(scope["headers"])
        client = request.client
        call.client = client.host if client else None
        call.key_scope = getattr(request.state, "key_scope", None)
        if not self.begin(call, keyed=True):
            return await self.app.audio_file(request, call.task)
        body = await receive_body(request.receive, None, self.app.max_body, "payload")
        resp = await until_done_or_gone(scope, request.receive,
                                        self.outcome(call, self.request(call, body)))
        status, fixed, headers, out = self.reply(call, resp)
        reply = Response(out, status)
        reply.raw_headers = [*fixed[0], *headers]
        return reply

    async def guarded(self, scope: dict, receive: Callable, send: Callable, route: str) -> None:
        """A route served by its handler in the app, under the same guard (key, errors,
        counting) its Starlette endpoint has, without the middleware stack and the router."""
        cid = scope_correlation_id(scope)
        resp = await self.app.guarded(route)(Request(scope, receive))
        if cid:
            resp.headers[CORRELATION_HEADER.decode()] = cid
        body = getattr(resp, "body", None)
        if body is None or resp.background is not None:  # streamed, or work after the reply
            await resp(scope, receive, send)
            return
        await respond(scope, send, resp.status_code, resp.raw_headers, body)


def tensor_head(resp: Any, wanted: Optional[str]) -> tuple:
    """(output name, array, raw header list) of a raw tensor reply (its response meta and
    correlation id aside): the output ``wanted`` (the Lumen-Output header), else the only one."""
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
    head = [(b"content-type", _OCTET),
            (b"lumen-tensor-dtype", codec.dtype_name(arr).encode()),
            (b"lumen-tensor-shape", codec.shape_text(arr.shape).encode()),
            (b"lumen-output", name.encode("latin-1")),
            (b"content-length", b"%d" % arr.nbytes)]
    return name, arr, head


#: meta key -> its reply header name (``lumen-meta-<key>``), as bytes
_META_NAMES: dict = {}


def meta_headers(meta: dict) -> list:
    """The response meta of a raw tensor reply as ``lumen-meta-<key>`` headers."""
    out = []
    names = _META_NAMES
    for k, v in meta.items():
        name = names.get(k)
        if name is None:
            name = ("lumen-meta-" + k).lower().encode("latin-1")
            if len(names) < MAX_MEMO:
                names[k] = name
        out.append((name, str(v).encode("latin-1")))
    return out


def too_large(limit: int) -> PayloadTooLarge:
    """The 413 of a body that grew past ``limit`` while it arrived."""
    return PayloadTooLarge(f"request body exceeds the limit of {limit} bytes "
                           f"(server.max_payload_bytes)", "payload")


def until_done_or_gone(scope: Any, receive: Callable, work: Awaitable) -> Awaitable:
    """Await ``work`` (the runtime call) while watching for the client leaving: a client that
    hangs up cancels it (and with it the queued runtime request(s)), raising ClientGone.  On
    Lumen's own connections the connection watches (:func:`.limits.connection_of`: no task);
    elsewhere a watcher task reads ``http.disconnect`` from ``receive``.  Either cancels only
    while the request is suspended in ``work``, so a disconnect that races with completion can
    never cancel the reply path."""
    task = asyncio.current_task()
    assert task is not None  # a route runs in its request's task
    conn = connection_of(scope)
    if conn is not None:
        return _watched_by(conn, task, work)
    return _watched_by_task(receive, task, work)


async def _watched_by(conn: Any, task: "asyncio.Task", work: Awaitable) -> Any:
    if not conn.watch(task):  # already lost
        if asyncio.iscoroutine(work):
            work.close()
        raise ClientGone()
    try:
        return await work
    except asyncio.CancelledError:
        if conn.watch_fired:
            task.uncancel()
            raise ClientGone() from None
        raise
    finally:
        conn.unwatch()


async def _watched_by_task(receive: Callable, task: "asyncio.Task", work: Awaitable) -> Any:
    state = {"waiting": True, "gone": False}

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
