"""Server logs: text or JSON lines, the HTTP access log, and the request's correlation id on
every line logged while a request is being served.

The correlation id lives in a context variable (:data:`CORRELATION_ID`).  :class:`RequestContext`
(the outermost ASGI layer of ``lumen serve``) sets it for each HTTP request from the
``X-Correlation-Id`` header, or makes one up (and adds it to the request's headers, so the
runtime answers under the same id, and to the response); asyncio copies the context into every
task the request starts, so a line logged anywhere on the request's path (the transport, the
runtime's admission and preparation, a watcher task) carries it.  :class:`CorrelationIdFilter`
copies it onto each record as ``record.correlation_id``; :func:`configure` puts that filter on
the one handler it installs.  Embedders with their own logging add the filter to their handler.

Lines logged by the engine workers' threads are about a batch, not one request, and carry no id.

Formats (``lumen serve --log-format``):

- ``text``: ``2026-01-02 10:11:12,345 INFO lumen.http: message cid=...`` (the id only when set);
- ``json``: one object a line: ``ts`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger``,
  ``message``, ``correlation_id`` (when set), ``exc`` (a traceback, when there is one), plus the
  access log's fields.

The access log (``--access-log``, logger ``lumen.access``, INFO) is one line per finished HTTP
request: ``client``, ``method``, ``path`` (no query string: it carries request meta),
``status``, ``task`` (the task in the path of ``/v1/infer/{task}`` and ``/v2/models/{task}/...``,
or the ``model`` of ``/v1/embeddings``; ``-`` for other routes), ``bytes`` (response body), ``bytes_in`` (request body), ``ms`` (first byte in to last
byte out) and ``correlation_id``.  Never a header or a body.

uvicorn's own logger carries neither: :func:`guard_uvicorn_logs` (called by the server) drops
the WebSocket library's DEBUG wire trace (headers and frames: API keys) and the query string
of uvicorn's WebSocket lines.
"""
from __future__ import annotations

import contextvars
import datetime
import json
import logging
import sys
import time
import uuid
from typing import Callable, Optional, TextIO, Union

#: the correlation id of the request being served in this context ("" outside any request)
CORRELATION_ID: contextvars.ContextVar[str] = contextvars.ContextVar("lumen_correlation_id",
                                                                     default="")
#: the access-log record of the HTTP request being served (None outside one)
_CURRENT: contextvars.ContextVar[Optional["AccessRecord"]] = contextvars.ContextVar(
    "lumen_access_record", default=None)

LOG_FORMATS = ("text", "json")
ACCESS_LOGGER = "lumen.access"
access_log = logging.getLogger(ACCESS_LOGGER)
#: the request header (lower case, as ASGI gives it) that carries the correlation id
CORRELATION_HEADER = b"x-correlation-id"
#: a client's correlation id longer than this is cut (it is echoed into logs and replies)
MAX_CORRELATION_ID = 128
#: the most characters of a path an access line carries
MAX_PATH = 200
#: routes whose path segment after the prefix is the task: /v1/infer/{task} and the Open
#: Inference Protocol's /v2/models/{task}[/versions/{v}][/infer|/ready]
_TASK_PREFIXES = ("/v1/infer/", "/v2/models/")
#: the fields an access line adds to a JSON line, in order
ACCESS_FIELDS = ("client", "method", "path", "status", "task", "bytes", "bytes_in", "ms",
                 "correlation_id")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def correlation_id() -> str:
    """The correlation id of the request being served here ("" outside a request)."""
    return CORRELATION_ID.get()


def note_task(task: str) -> None:
    """Record the task an HTTP request was routed to, for its access line (no-op outside a
    request).  ``/v1/infer/{task}`` is known from the path; the transport calls this when the
    task comes from the body (the ``model`` of ``/v1/embeddings``)."""
    rec = _CURRENT.get()
    if rec is not None:
        rec.task = task


class CorrelationIdFilter(logging.Filter):
    """Sets ``record.correlation_id`` from the context (unless the caller passed one in
    ``extra``); never drops a record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not hasattr(record, "correlation_id"):
            record.correlation_id = CORRELATION_ID.get()
        return True


class TextFormatter(logging.Formatter):
    """The classic line, plus `` cid=<id>`` when the record belongs to a request."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        cid = getattr(record, "correlation_id", "")
        if cid and record.name != ACCESS_LOGGER:  # the access line names it itself
            line += f" cid={cid}"
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object a line (see the module docstring for the keys)."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        obj: dict = {"ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                     "level": record.levelname, "logger": record.name,
                     "message": record.getMessage()}
        cid = getattr(record, "correlation_id", "")
        if cid:
            obj["correlation_id"] = cid
        if record.name == ACCESS_LOGGER:
            for key in ACCESS_FIELDS:
                if hasattr(record, key):
                    obj[key] = getattr(record, key)
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            obj["exc"] = record.exc_text
        if record.stack_info:
            obj["stack"] = self.formatStack(record.stack_info)
        return json.dumps(obj, ensure_ascii=False, default=str)


def formatter(fmt: str) -> logging.Formatter:
    if fmt == "json":
        return JsonFormatter()
    if fmt == "text":
        return TextFormatter()
    raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")


class _StderrHandler(logging.StreamHandler):
    """A StreamHandler on whatever ``sys.stderr`` is when a record is written (a test harness
    or a daemoniser may swap it), like logging's own last-resort handler."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        pass


_HANDLER_MARK = "_lumen_handler"


def configure(level: str = "warning", fmt: str = "text", access: bool = False,
              stream: Optional[TextIO] = None) -> Callable[[], None]:
    """Log to ``stream`` (default: stderr) in ``fmt`` at ``level``; the server's lifecycle
    lines (``lumen.serve``: the ready line) always, the access log when ``access``.

    Replaces the handler an earlier call installed and leaves any other handler alone.  The
    handler carries the correlation-id filter.  Returns a function that undoes the call (the
    handler removed, the levels it changed restored)."""
    handler = _StderrHandler() if stream is None else logging.StreamHandler(stream)
    handler.setFormatter(formatter(fmt))
    handler.addFilter(CorrelationIdFilter())
    setattr(handler, _HANDLER_MARK, True)
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, _HANDLER_MARK, False):
            root.removeHandler(old)
    touched = [root, logging.getLogger("lumen.serve"), access_log]
    saved = [(lg, lg.level) for lg in touched]
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    if root.level > logging.INFO:
        logging.getLogger("lumen.serve").setLevel(logging.INFO)
    if access:
        access_log.setLevel(logging.INFO)

    def undo() -> None:
        root.removeHandler(handler)
        for lg, lvl in saved:
            lg.setLevel(lvl)

    return undo


# ----------------------------------------------------------------------------- uvicorn's lines
#: the logger uvicorn writes its own lines to, and hands the WebSocket library for its trace
UVICORN_LOGGER = "uvicorn.error"
#: how the WebSocket library's wire trace begins: a header or frame received / sent
_WIRE_TRACE = ("< ", "> ")


class UvicornLogFilter(logging.Filter):
    """Keeps secrets and request options out of uvicorn's logger (:func:`guard_uvicorn_logs`).

    - drops the WebSocket library's wire trace (DEBUG lines ``< authorization: Bearer ...``,
      ``< TEXT '{"api_key": ...'``: every upgrade header and every frame's contents);
    - cuts the query string off the path in uvicorn's WebSocket lines (``"WebSocket
      /v1/stream/vad?..." [accepted]``), as the access log does for HTTP: it carries request
      options, or a key a client put in the URL (which the endpoint refuses)."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.msg
        if not isinstance(msg, str):
            return True
        if record.levelno <= logging.DEBUG and msg.startswith(_WIRE_TRACE):
            return False
        if "WebSocket %s" in msg and isinstance(record.args, tuple):
            record.args = tuple(a.split("?", 1)[0] if isinstance(a, str) and a.startswith("/")
                                else a for a in record.args)
        return True


def guard_uvicorn_logs() -> None:
    """Put :class:`UvicornLogFilter` on uvicorn's logger (once; the server calls it)."""
    logger = logging.getLogger(UVICORN_LOGGER)
    if not any(isinstance(f, UvicornLogFilter) for f in logger.filters):
        logger.addFilter(UvicornLogFilter())


# ----------------------------------------------------------------------------- the ASGI layer
class AccessRecord:
    """What one HTTP request's access line says, filled in as the request runs."""

    __slots__ = ("task", "status", "bytes_out", "bytes_in")

    def __init__(self, task: str) -> None:
        self.task = task
        self.status = 500  # an app that raises before answering
        self.bytes_out = 0
        self.bytes_in = 0


def _visible(text: str, limit: int) -> str:
    """Client-chosen text (a correlation id, a path, a task name) as a log line may carry it:
    cut to ``limit`` characters, anything but visible ASCII replaced by '?' (a space, a
    newline or a quote cannot forge a field or a line of a text log)."""
    text = text[:limit]
    if text.isascii() and text.isprintable() and " " not in text and '"' not in text:
        return text
    return "".join(c if "!" <= c <= "~" and c != '"' else "?" for c in text)


def client_correlation_id(value: Union[bytes, str]) -> str:
    """A client's correlation id as everything carries it -- the reply header and body, the
    runtime's request, gRPC replies, log lines: cut to :data:`MAX_CORRELATION_ID` characters,
    anything but visible ASCII replaced by '?'.  The one cut of every door."""
    if isinstance(value, bytes):
        value = value[:MAX_CORRELATION_ID].decode("latin-1")
    return _visible(value, MAX_CORRELATION_ID)


def scope_correlation_id(scope: dict) -> str:
    """The client's correlation id of an ASGI ``scope`` ("" when it sent none), cut
    (:func:`client_correlation_id`) and made the context's :data:`CORRELATION_ID`; a header the
    cut changed is replaced in ``scope``, so every reader of the request sees the cut id."""
    headers = scope["headers"]
    for i, (name, value) in enumerate(headers):
        if name == CORRELATION_HEADER:
            cid = client_correlation_id(value)
            if cid.encode("latin-1") != value:
                headers = list(headers)
                headers[i] = (CORRELATION_HEADER, cid.encode("latin-1"))
                scope["headers"] = headers
            CORRELATION_ID.set(cid)
            return cid
    return ""


def _new_correlation_id() -> str:
    return uuid.uuid4().hex


class RequestContext:
    """ASGI middleware: the correlation id of each HTTP request in :data:`CORRELATION_ID` (and
    in the request headers and the reply, made up when the client sent none), and, when
    ``access_log`` is on, one ``lumen.access`` line per finished request."""

    def __init__(self, app: Callable, access_log: bool = False) -> None:
        self.app = app
        self.access_log = access_log

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        scope = dict(scope)
        cid = scope_correlation_id(scope)
        if not cid:
            cid = _new_correlation_id()
            scope["headers"] = [*scope["headers"], (CORRELATION_HEADER, cid.encode())]
        token = CORRELATION_ID.set(cid)
        try:
            if self.access_log:
                await self._logged(scope, receive, send, cid)
            else:
                await self.app(scope, receive, _reply_with_id(send, cid))
        finally:
            CORRELATION_ID.reset(token)

    async def _logged(self, scope: dict, receive: Callable, send: Callable, cid: str) -> None:
        t0 = time.perf_counter()
        path = scope.get("path", "")
        rec = AccessRecord(_task_of_path(path))
        token = _CURRENT.set(rec)
        header = (b"x-correlation-id", cid.encode("latin-1"))

        async def counting_receive() -> dict:
            msg = await receive()
            body = msg.get("body")
            if body:
                rec.bytes_in += len(body)
            return msg

        async def counting_send(msg: dict) -> None:
            kind = msg["type"]
            if kind == "http.response.start":
                rec.status = msg["status"]
                msg = _with_header(msg, header)
            elif kind == "http.response.body":
                rec.bytes_out += len(msg.get("body", b""))
            await send(msg)

        try:
            await self.app(scope, counting_receive, counting_send)
        finally:
            _CURRENT.reset(token)
            ms = (time.perf_counter() - t0) * 1000
            client = scope.get("client")
            host = client[0] if client else "-"
            method = _visible(scope.get("method", "-"), 16)
            path = _visible(path, MAX_PATH)
            task = _visible(rec.task, MAX_PATH) or "-"
            access_log.info(
                '%s "%s %s" %d task=%s bytes=%d bytes_in=%d %.1fms cid=%s',
                host, method, path, rec.status, task, rec.bytes_out, rec.bytes_in, ms, cid,
                extra={"client": host, "method": method, "path": path, "status": rec.status,
                       "task": task, "bytes": rec.bytes_out, "bytes_in": rec.bytes_in,
                       "ms": round(ms, 3), "correlation_id": cid})


def _task_of_path(path: str) -> str:
    for prefix in _TASK_PREFIXES:
        if path.startswith(prefix):
            return path[len(prefix):].split("/", 1)[0]
    return ""


def _with_header(msg: dict, header: tuple) -> dict:
    """``msg`` (an http.response.start) with ``header`` unless it carries one of that name."""
    headers = msg.get("headers") or []
    name = header[0]
    for key, _ in headers:
        if key.lower() == name:
            return msg
    return dict(msg, headers=[*headers, header])


def _reply_with_id(send: Callable, cid: str) -> Callable:
    header = (b"x-correlation-id", cid.encode("latin-1"))

    async def reply(msg: dict) -> None:
        if msg["type"] == "http.response.start":
            msg = _with_header(msg, header)
        await send(msg)

    return reply
