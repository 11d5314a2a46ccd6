"""The front door's hot path: the inference routes as plain ASGI, in front of the Starlette app.

A request to ``POST /v1/infer/{task}``, ``POST /v2/models/{task}[/versions/{v}]/infer`` or
``POST /v1/embeddings`` (``/embeddings``) costs the server what it must, once: one match of the
path (no middleware stack, no router), one pass over the raw headers for the few the route
reads, the query string parsed only on the native route (which reads it: it is the request's
meta) and remembered per distinct string, no correlation id unless the client sends one (the
native JSON reply's ``correlation_id`` is the runtime's, made when read), a disconnect noticed by
the connection (:mod:`.limits`) instead of a watcher task per request, tensor reply headers
built once per (task, output, dtype, shape) as bytes, and the transport counter a dict
increment folded into Prometheus at scrape time (:mod:`.metrics`).

Every guard still applies: the header-size, read-timeout, body-deadline and connection limits
are the connection's (:mod:`.limits`), the body limit is :func:`.body.read_body`'s, the API key
is checked before the body is read, a draining server answers 503, and errors keep their JSON
shapes (Lumen's, or the Open Inference Protocol's on ``/v2``).  What is not here runs the
Starlette app (:class:`.http.HttpApp`), unchanged: every other route, and the hot routes too
when the access log or tracing is on (both are per-request work by nature: the access line and
the span are made where they always were), or when a proxy root path is set.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable, Optional
from urllib.parse import parse_qsl

import numpy as np
from starlette.requests import Request

from ..errors import InternalError, LumenError
from ..request import InferRequest
from . import audio, codec
from .auth import unscope_error
from .body import ClientGone, receive_body
from .limits import connection_of
from .logs import CORRELATION_HEADER, CORRELATION_ID, client_correlation_id, scope_correlation_id

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


#: what the query memo holds for a whole audio file (its own route)
_AUDIO_FILE: dict = {}


def _json_head(n: int, cid: str) -> list:
    headers = [(b"content-type", _JSON), (b"content-length", b"%d" % n)]
    if cid:
        headers.append((CORRELATION_HEADER, cid.encode("latin-1")))
    return headers


async def respond(scope: dict, send: Callable, status: int, headers: Any, body: Any,
                  fixed: Any = ((), b"")) -> None:
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
    """The hot routes of ``app`` (an :class:`.http.HttpApp`); :meth:`handler` says whether a
    request is one of them."""

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
        self.add_route("/v1/embeddings", EMBEDDINGS_ROUTE)
        self.add_route("/embeddings", EMBEDDINGS_ROUTE)

    def add_route(self, path: str, route: str) -> None:
        """Serve ``POST path`` on the hot path by the handler the app guards as ``route`` (a
        route template the app registered with :meth:`.http.HttpApp.guard`, e.g. TEI's
        ``/embed``): the same guard, errors and counting, without the stack and the router."""
        self.app.guarded(route)  # a route the app does not guard is a KeyError here, at start

        async def serve(scope: dict, receive: Callable, send: Callable) -> None:
            await self.guarded(scope, receive, send, route)

        self.exact[path] = serve

    def handler(self, scope: dict) -> Optional[Callable]:
        """The coroutine function serving ``scope`` on the hot path, or None (the app's)."""
        if scope["method"] != "POST" or scope.get("root_path"):
            return None
        path = scope["path"]
        if path.startswith(_INFER_PREFIX):
            task = path[len(_INFER_PREFIX):]
            if task and "/" not in task:
                scope["path_params"] = {"task": task}
                return self.infer
        elif path.startswith(_OIP_PREFIX) and path.endswith(_OIP_SUFFIX):
            rest = path[len(_OIP_PREFIX):-len(_OIP_SUFFIX)]
            task, sep, version = rest.partition(_VERSIONS)
            if task and "/" not in task and (not sep or (version and "/" not in version)):
                scope["path_params"] = {"task": task, "version": version} if sep else \
                    {"task": task}
                return self.oip_versioned if sep else self.oip
        else:
            serve = self.exact.get(path)
            if serve is not None:
                scope["path_params"] = {}
                return serve
        return None

    # -- the native route ---------------------------------------------------------------------
    async def infer(self, scope: dict, receive: Callable, send: Callable) -> None:
        ctype = accept = auth = output = length = None
        cid = ""
        for name, value in scope["headers"]:
            if name == b"content-type":
                ctype = value
            elif name == b"content-length":
                length = value
            elif name == b"accept":
                accept = value
            elif name == b"authorization":
                auth = value
            elif name == CORRELATION_HEADER:
                cid = client_correlation_id(value)
                CORRELATION_ID.set(cid)
            elif name == b"lumen-output":
                output = value
        app = self.app
        task = scope["path_params"]["task"]
        key_scope = None
        try:
            if self.needs_key:
                key_scope = self.keys.check(auth.decode("latin-1") if auth is not None else None)
            app.check_open()
            mime = ctype.decode("latin-1") if ctype is not None else ""
            meta = self.meta(task, scope["query_string"], mime)
            if meta is None:  # a whole audio file: its own route (audio.py)
                await self.cold(scope, receive, send)
                return
            body = await receive_body(receive, length.decode("latin-1") if length is not None
                                      else None, app.max_body, "payload")
            if key_scope is not None:
                meta = self.keys.scoped_meta(meta, key_scope)
            resp = await until_done_or_gone(
                scope, receive, self.runtime.infer(InferRequest(task, body, mime, meta, cid)))
            extra = getattr(resp.outputs, "meta", None)
            if extra:
                resp.meta.update(extra)
            if accept is not None and _OCTET in accept and _JSON not in accept:
                status = await self.tensor_reply(scope, send, resp, task, output, cid)
            else:
                out = codec.dumps(codec.response_json(resp))
                await respond(scope, send, 200, _json_head(len(out), resp.correlation_id), out)
                status = 200
        except LumenError as exc:
            status = await self.error(scope, receive, send, exc, key_scope, cid,
                                      app.errors_of(INFER_ROUTE))
        except ClientGone:
            status = app.client_closed_status
        except Exception as exc:  # noqa: BLE001 - a bug must answer 500, not drop the socket
            log.exception("unhandled error on %s", INFER_ROUTE)
            status = await self.error(scope, receive, send,
                                      InternalError(f"internal server error: {exc}"), None, cid,
                                      app.errors_of(INFER_ROUTE))
        if self.count is not None:
            self.count(INFER_ROUTE, status)

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

    async def tensor_reply(self, scope: dict, send: Callable, resp: Any, task: str,
                           output: Optional[bytes], cid: str) -> int:
        """The raw tensor reply: its fixed headers made once per (task, output, dtype, shape),
        the response meta (batch figures) added as ``lumen-meta-*`` headers."""
        wanted = output.decode("latin-1") if output is not None else None
        outs = resp.outputs
        head = None
        if wanted is None and len(outs) == 1:
            name, arr = next(iter(outs.items()))
            key = (task, name, arr.dtype, arr.shape) if type(arr) is np.ndarray else None
            head = self.tensor_heads.get(key)
        if head is None:
            name, arr, pairs = self.app.tensor_head(resp, wanted)
            head = (pairs, header_lines(pairs))
            if wanted is None:
                if len(self.tensor_heads) >= MAX_MEMO:
                    self.tensor_heads.clear()
                self.tensor_heads[(task, name, arr.dtype, arr.shape)] = head
        extra = meta_headers(resp.meta) if resp.meta else []
        if cid:
            extra.append((CORRELATION_HEADER, cid.encode("latin-1")))
        await respond(scope, send, 200, extra, codec.tensor_view(arr), head)
        return 200

    # -- the routes whose handlers are the app's -----------------------------------------
    async def oip(self, scope: dict, receive: Callable, send: Callable) -> None:
        await self.guarded(scope, receive, send, OIP_ROUTE)

    async def oip_versioned(self, scope: dict, receive: Callable, send: Callable) -> None:
        await self.guarded(scope, receive, send, OIP_VERSION_ROUTE)

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

    async def cold(self, scope: dict, receive: Callable, send: Callable) -> None:
        await self.app.cold(scope, receive, send)

    @staticmethod
    async def error(scope: dict, receive: Callable, send: Callable, exc: LumenError,
                    key_scope: Optional[str], cid: str, errors: Callable) -> int:
        resp = errors(unscope_error(exc, key_scope))
        if cid:
            resp.headers[CORRELATION_HEADER.decode()] = cid
        await respond(scope, send, resp.status_code, resp.raw_headers, resp.body)
        return resp.status_code



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
