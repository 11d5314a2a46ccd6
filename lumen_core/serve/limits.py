"""Connection-level limits for the HTTP server: what uvicorn/httptools do not bound themselves.

uvicorn bounds idle keep-alive connections (``timeout_keep_alive``) and h11 bounds its header
buffer (``h11_max_incomplete_event_size``), but with httptools (the parser Lumen runs on) a
header section of any size is buffered and parsed, a socket that never sends a byte -- or sends
half a header, or half a body -- stays open forever, and every accepted socket holds a file
descriptor.  :func:`protocol_class` returns an httptools protocol with three named limits:

- **header size** (:data:`DEFAULT_MAX_HEADER_BYTES`, ``[server] max_header_bytes``): the bytes
  of a request line plus header section are counted as they arrive, before the parser sees
  them; past the limit the connection answers ``431`` (the JSON error shape) and closes;
- **read timeout** (:data:`DEFAULT_READ_TIMEOUT_MS`, ``[server] read_timeout_ms``): a request's
  line and headers must arrive within it, counted from the connection opening (or from the
  first byte of a keep-alive request), however slowly they trickle in (slowloris); once the
  headers are in, each gap between body chunks must stay under it.  A request whose headers
  are late is answered ``408`` and closed; a body that stalls closes the connection, which
  the app sees as a client disconnect (its queued work is cancelled);
- **body deadline** (``[server] body_timeout_ms`` and ``body_min_rate``, Apache
  mod_reqtimeout's ``body=20,MinRate=500``): a body must be in within ``body_timeout_ms`` of
  its headers, extended by one second per ``body_min_rate`` bytes received, however steadily
  it trickles (a byte a second keeps every gap short); past it the request is answered ``408``
  (when nothing was answered yet) and the connection closed;
- **transfer codings**: a ``Transfer-Encoding`` other than ``chunked`` (``gzip, chunked``)
  is not decoded, so it is refused (``400``) and the connection closed rather than its body
  handed on still encoded;
- **connections** (:data:`DEFAULT_MAX_CONNECTIONS`, ``[server] max_connections``): a
  connection accepted while that many are open is answered ``503`` with ``Retry-After`` and
  closed at once, so its descriptor is freed; :func:`effective_max_connections` also keeps
  the cap under the process's descriptor limit.

Inference time is no read: once a request is fully read no timer runs until its response has
been sent (then uvicorn's keep-alive timeout applies).  Timers are armed only while a request
is incomplete after the bytes at hand (a request that arrives in one read never arms one), and
one body timer serves both the gap and the deadline (it re-arms itself when it fires early).

The connection also tells the app that its client went away: :func:`connection_of` gives the
request's connection, whose :meth:`watch` names the task awaiting the reply; a lost connection
cancels that task (one check per connection, not a watcher task per request).
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any, Optional

# the defaults live with the [server] keys: the most bytes of request line + header section
# (nginx allows 4 x 8 KiB, Node 16 KiB), ms a request's headers (or a gap between body chunks)
# may take to arrive, concurrently open HTTP connections (further ones get 503 and are closed)
from ..config import (
    DEFAULT_BODY_MIN_RATE,
    DEFAULT_BODY_TIMEOUT_MS,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_HEADER_BYTES,
    DEFAULT_READ_TIMEOUT_MS,
)

log = logging.getLogger("lumen.http")

#: seconds an error reply's connection keeps reading (and dropping) a client's bytes before it
#: closes, so that the reply is not lost to a reset (see _close_lingering)
LINGER_S = 1.0

#: descriptors kept free for everything but HTTP connections (model files, gRPC, logs)
RESERVED_FDS = 64
#: seconds a 503 for the connection cap tells the client to wait
CONNECTION_RETRY_AFTER_S = 1
_END_OF_HEADERS = b"\r\n\r\n"
#: the ASGI scope keys under which a request's connection and its request/response cycle are
#: found (:func:`connection_of`)
CONNECTION_KEY = "lumen.connection"
CYCLE_KEY = "lumen.cycle"
#: replies up to this size are written head and body in one write (one syscall)
ONE_WRITE_MAX = 64 * 1024
#: the one transfer coding the parser decodes
_CHUNKED = b"chunked"
_TRANSFER_ENCODING = b"transfer-encoding"


def connection_of(scope: dict) -> Any:
    """The connection serving ``scope`` when it is Lumen's protocol (None otherwise: another
    server, or an in-process test transport), with ``watch(task)`` / ``unwatch()``,
    ``watch_fired`` (True when a lost connection cancelled the watched task) and ``reply``
    (a whole response in one write)."""
    return scope.get(CONNECTION_KEY)


@dataclass(frozen=True)
class HttpLimits:
    max_header_bytes: int = DEFAULT_MAX_HEADER_BYTES
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_MS / 1000.0
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_MS / 1000.0
    body_min_rate: int = DEFAULT_BODY_MIN_RATE

    @classmethod
    def from_config(cls, server_cfg: Any) -> "HttpLimits":
        return cls(server_cfg.max_header_bytes, server_cfg.read_timeout_ms / 1000.0,
                   effective_max_connections(server_cfg.max_connections),
                   server_cfg.body_timeout_ms / 1000.0, server_cfg.body_min_rate)


def effective_max_connections(configured: int) -> int:
    """``configured``, lowered to fit the process's open-file limit (minus RESERVED_FDS)."""
    try:
        import resource

        soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (ImportError, OSError, ValueError):  # pragma: no cover - not POSIX
        return configured
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return configured
    fit = max(1, soft - RESERVED_FDS)
    if fit < configured:
        log.warning("server.max_connections %d lowered to %d to fit the open-file limit (%d); "
                    "raise it with `ulimit -n`", configured, fit, soft)
        return fit
    return configured


def error_bytes(status: int, reason: str, code: str, message: str, field: Optional[str],
                extra_headers: tuple = ()) -> bytes:
    """A complete ``Connection: close`` HTTP/1.1 response with the JSON error shape."""
    body = json.dumps({"error": {"code": code, "message": message, "field": field}}).encode()
    head = [f"HTTP/1.1 {status} {reason}", "content-type: application/json",
            f"content-length: {len(body)}", "connection: close", *extra_headers]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


def response_head(status_line: bytes, fixed: bytes, headers: Any,
                  keep_alive: bool) -> Optional[tuple]:
    """(the head of a response as a list of bytes, whether the connection stays open): the
    status line, the header lines ``fixed`` (already formatted), the pairs ``headers`` (which
    must include content-length), ``connection: close`` when the connection closes after it.
    None when a header value holds a line break (nothing may be sent with it)."""
    parts = [status_line, fixed]
    for name, value in headers:
        if b"\n" in value or b"\r" in value:
            return None
        if name == b"connection" and b"close" in value.lower():
            keep_alive = False
        parts += (name, b": ", value, b"\r\n")
    if not keep_alive:
        parts.append(b"connection: close\r\n")
    parts.append(b"\r\n")
    return parts, keep_alive


def protocol_class(limits: HttpLimits) -> type:
    """An httptools-based uvicorn protocol class enforcing ``limits`` (uvicorn instantiates
    the class per connection); h11's own protocol when httptools is not installed."""
    try:
        from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol
    except ImportError:  # pragma: no cover - httptools is part of the [serve] extra
        from uvicorn.protocols.http.h11_impl import H11Protocol

        log.warning("httptools is not installed: only the header-size limit applies (h11)")
        return H11Protocol

    max_header = limits.max_header_bytes
    timeout_s = limits.read_timeout_s
    max_conns = limits.max_connections
    body_timeout_s = limits.body_timeout_s
    min_rate = limits.body_min_rate

    class LimitedHttpToolsProtocol(HttpToolsProtocol):
        """httptools + header-size cap, read timeout and connection cap."""

        # phases: "headers" (reading a request line + headers), "body" (headers in, body
        # incomplete), "idle" (request complete: no read timer; keep-alive applies)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._phase = "headers"
            self._header_bytes = 0
            self._read_timer: Optional[asyncio.TimerHandle] = None
            self._refused = False
            self._body_start = 0.0  # loop time the body's headers were complete
            self._body_bytes = 0  # body bytes received so far (chunks, framing included)
            self._last_data = 0.0  # loop time of the latest body bytes
            self._watched: Optional[asyncio.Task] = None
            self.watch_fired = False

        # -- connection ---------------------------------------------------------------
        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            if len(self.connections) >= max_conns:
                self._refused = True
                self.transport = transport
                transport.write(error_bytes(
                    503, "Service Unavailable", "unavailable",
                    f"the server has {max_conns} open connections, its limit "
                    f"(server.max_connections); retry shortly", None,
                    (f"retry-after: {CONNECTION_RETRY_AFTER_S}",)))
                transport.close()
                return
            super().connection_made(transport)
            self._arm(self._headers_late)

        def connection_lost(self, exc: Optional[Exception]) -> None:
            self._disarm()
            if self._refused:
                return
            watched = self._watched
            if watched is not None:  # the client hung up while its reply was being made
                self._watched = None
                self.watch_fired = True
                watched.cancel()
            super().connection_lost(exc)

        # -- the app's disconnect watch ---------------------------------------------------
        def watch(self, task: "asyncio.Task") -> bool:
            """Cancel ``task`` if the connection is lost before :meth:`unwatch`; False when it
            is already lost (nothing to wait for)."""
            if self.transport.is_closing():
                return False
            self.watch_fired = False
            self._watched = task
            return True

        def unwatch(self) -> None:
            self._watched = None

        def reply(self, scope: dict, status: int, headers: Any, body: Any,
                  fixed: bytes = b"") -> bool:
            """Send a whole response for the request of ``scope`` -- the status line, the
            header lines ``fixed`` (already formatted), ``headers`` (pairs of bytes, which
            must include content-length), then ``body`` -- in one write, and complete its
            cycle as uvicorn's own ``send`` does (keep-alive, pipelining, ``Connection:
            close``).  False, having sent nothing, when the reply must take the ASGI ``send``
            instead (a HEAD request, a paused writer, a started or disconnected cycle, a header
            value with a line break)."""
            cycle = scope.get(CYCLE_KEY)
            if (cycle is None or cycle.response_started or cycle.disconnected
                    or self.flow.write_paused or scope["method"] == "HEAD"):
                return False
            head = response_head(STATUS_LINE[status], fixed, (*cycle.default_headers, *headers),
                                 cycle.keep_alive)
            if head is None:
                return False
            cycle.keep_alive = head[1]
            cycle.response_started = True
            cycle.waiting_for_100_continue = False
            self.write_whole(head[0], body)
            cycle.response_complete = True
            cycle.message_event.set()
            if not cycle.keep_alive:
                self.transport.close()
            cycle.on_response()
            return True

        def write_whole(self, parts: list, body: Any) -> None:
            """Write a response head (``parts``, from :func:`response_head`) and ``body``: in
            one write up to :data:`ONE_WRITE_MAX` bytes of body."""
            if len(body) <= ONE_WRITE_MAX:
                parts.append(body)
                self.transport.write(b"".join(parts))
            else:
                self.transport.write(b"".join(parts))
                self.transport.write(body)

        # -- timers -------------------------------------------------------------------
        def _arm(self, handler: Any) -> None:
            self._disarm()
            self._read_timer = self.loop.call_later(timeout_s, handler)

        def _disarm(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _headers_late(self) -> None:
            self._read_timer = None
            if self.transport.is_closing():
                return
            if self.cycle is None or self.cycle.response_complete:
                self.transport.write(error_bytes(
                    408, "Request Timeout", "deadline_exceeded",
                    f"the request line and headers did not arrive within {timeout_s:g} s "
                    f"(server.read_timeout_ms)", "headers"))
            self._close_lingering()

        def _close_lingering(self) -> None:
            """Close after an error reply to a client that may still be sending: end our side
            (the reply, then EOF), read and drop its bytes for :data:`LINGER_S`, then close.
            Closing at once with its bytes unread makes the kernel answer them with a reset,
            which can destroy the reply before the client reads it (nginx's lingering_close)."""
            self._phase = "closed"  # data_received drops what still comes
            transport = self.transport
            if transport.is_closing():
                return
            if transport.can_write_eof():
                transport.write_eof()
                self.loop.call_later(LINGER_S, transport.close)
            else:
                transport.close()

        def _body_due(self) -> None:
            """The body timer: a stalled body closes the connection (the app sees
            http.disconnect); a body past its deadline is answered 408 and closed; else the
            timer is set again for whichever comes first."""
            self._read_timer = None
            if self._phase != "body" or self.transport.is_closing():
                return
            now = self.loop.time()
            stall_at = self._last_data + timeout_s
            deadline = self._body_start + body_timeout_s + (
                self._body_bytes / min_rate if min_rate else 0.0)
            if now >= stall_at:
                log.info("closing a connection whose request body stalled for %g s", timeout_s)
                self.transport.close()
            elif now >= deadline:
                log.info("closing a connection whose request body was still arriving after "
                         "%.1f s (%d bytes)", now - self._body_start, self._body_bytes)
                if self.cycle is None or not self.cycle.response_started:
                    self.transport.write(error_bytes(
                        408, "Request Timeout", "deadline_exceeded",
                        f"the request body did not arrive within {body_timeout_s:g} s plus "
                        f"one second per {min_rate} bytes received (server.body_timeout_ms, "
                        f"server.body_min_rate)", "body"))
                if self.cycle is not None:
                    self.cycle.disconnected = True  # the app's next receive: http.disconnect
                    self.cycle.message_event.set()
                self._close_lingering()
            else:
                self._read_timer = self.loop.call_later(min(stall_at, deadline) - now,
                                                        self._body_due)

        # -- data -----------------------------------------------------------------------
        def data_received(self, data: bytes) -> None:
            phase = self._phase
            if self._refused or phase == "closed":
                return
            if phase == "idle":
                phase = self._phase = "headers"
                self._header_bytes = 0
            elif phase == "body":
                self._body_bytes += len(data)
                self._last_data = self.loop.time()
            if phase == "headers":
                before = self._header_bytes
                self._header_bytes += len(data)
                if self._header_bytes > max_header:
                    end = data.find(_END_OF_HEADERS)
                    if end < 0 or before + end + len(_END_OF_HEADERS) > max_header:
                        self._too_large()
                        return
            super().data_received(data)
            # a timer only for a request still incomplete after these bytes
            if self._read_timer is None:
                if self._phase == "headers":  # from its first byte; not reset by more
                    self._read_timer = self.loop.call_later(timeout_s, self._headers_late)
                elif self._phase == "body":
                    self._read_timer = self.loop.call_later(timeout_s, self._body_due)

        def _too_large(self) -> None:
            self._disarm()
            self._phase = "closed"
            if self.cycle is None or self.cycle.response_complete:
                self.transport.write(error_bytes(
                    431, "Request Header Fields Too Large", "payload_too_large",
                    f"the request line and headers exceed {max_header} bytes "
                    f"(server.max_header_bytes)", "headers"))
            self._close_lingering()

        def on_headers_complete(self) -> None:
            if self._headers_in():
                self._asgi_cycle()

        def _headers_in(self) -> bool:
            """The header section is complete: refuse a transfer coding the parser does not
            decode (False: answered and closing), else start the body's phase.  A request
            the parser reads on a connection already closing (in the same read as the one
            refused) is ignored: False, nothing runs, nothing is answered."""
            if self._phase == "closed":
                return False
            for name, value in self.headers:
                if name == _TRANSFER_ENCODING and not _decoded(value):
                    self._not_decoded(value)
                    return False
            self._disarm()  # the header timer; the body's is set when a body is incomplete
            self._phase = "body"
            self._body_start = self._last_data = self.loop.time()
            self._body_bytes = 0
            return True

        def _asgi_cycle(self) -> None:
            """uvicorn's request/response cycle for the request whose headers are in, with
            this connection and the cycle in its scope (:func:`connection_of`)."""
            scope = self.scope
            scope[CONNECTION_KEY] = self  # type: ignore[literal-required]
            super().on_headers_complete()
            cycle = self.cycle
            if cycle is not None and cycle.scope is scope:  # (not a WebSocket upgrade)
                scope[CYCLE_KEY] = cycle  # type: ignore[literal-required]

        def _not_decoded(self, value: bytes) -> None:
            self._disarm()
            self._phase = "closed"
            coding = value.decode("latin-1")[:80]
            if self.cycle is None or self.cycle.response_complete:
                self.transport.write(error_bytes(
                    400, "Bad Request", "invalid_argument",
                    f"Transfer-Encoding {coding!r} is not supported: the server decodes only "
                    f"'chunked' (send the body unencoded, or as Content-Encoding where the "
                    f"route takes one)", "Transfer-Encoding"))
            self._close_lingering()

        def on_message_complete(self) -> None:
            self._message_in()
            super().on_message_complete()

        def _message_in(self) -> None:
            """The request is complete: no read timer until the next one begins (a connection
            already closing stays so: the parser may still finish the request it refused)."""
            if self._phase != "closed":
                self._phase = "idle"
            self._disarm()

    return LimitedHttpToolsProtocol


def _decoded(value: bytes) -> bool:
    """True when every transfer coding in a ``Transfer-Encoding`` value is one the parser
    decodes (``chunked``)."""
    return all(part.strip().lower() == _CHUNKED for part in value.split(b","))
