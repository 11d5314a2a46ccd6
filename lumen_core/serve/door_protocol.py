"""Lumen's own HTTP connections: the hot inference routes served from the parser's callbacks.

uvicorn serves a request by building an ASGI scope, a request/response cycle with its event,
and a task that runs the app, which receives the body as messages and sends the reply as two
more.  For ``POST /v1/infer/{task}``, ``POST /v2/models/{task}[/versions/{v}]/infer`` and
``POST /v1/embeddings`` (:func:`.door.call_of`) this connection does none of that: the headers are read into a
:class:`.door.Call` when the parser reports them complete (the API key, the draining state,
the declared length and the route's checks run then, before a body byte is kept), body
chunks are kept as they come (a body past ``[server] max_payload_bytes`` is answered 413 at
once), and when the message is complete the runtime's compiled ``admit`` queues the request
from that same callback.  The batch's answer completes the request's future, whose callback
settles it and writes the whole reply in one write.  No task and no coroutine per request.

Everything else is uvicorn's path, unchanged: other routes and methods, a request sent while
another is still being answered on the connection (pipelining keeps uvicorn's queue and
order), ``Expect: 100-continue``, upgrades, percent-encoded paths, tracing, the access log,
and a runtime without ``admit``.  A request the runtime cannot admit inline (prepared on the
preprocessing pool, or answered through a response cache) and an embeddings call with several
inputs (one ``infer_many`` group) get a task that awaits them, still without uvicorn's cycle.

Every guard of :mod:`.limits` still applies -- this class extends its protocol: header size,
read timeout, body deadline, transfer codings, connection cap -- and so do uvicorn's
keep-alive timeout, graceful shutdown (a request in flight finishes, then its connection
closes) and flow control (after a reply that filled the write buffer, the next request waits
for it to drain).  A client that hangs up cancels its queued request
(``Runtime.cancelled``), counted 499 as on every other carrier.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Optional

from ..errors import LumenError, PayloadTooLarge, Unavailable
from .door import CLIENT_CLOSED_STATUS, NO_FIXED, Call, call_of, too_large
from .limits import HttpLimits, response_head
from .limits import protocol_class as limits_protocol_class
from .logs import CORRELATION_ID

if TYPE_CHECKING:
    from .http import HttpApp
    from .runtime_api import AdmittingRuntime

log = logging.getLogger("lumen.http")

#: what the runtime must have for the callback path (``Runtime.admit`` and its two partners)
ADMITTING = ("admit", "settle", "cancelled")


class _NoEvent:
    """The ``message_event`` of a hot cycle: uvicorn sets a cycle's event on a disconnect;
    nothing waits on this one."""

    __slots__ = ()

    def set(self) -> None:
        return None


_NO_EVENT = _NoEvent()


class HotCycle:
    """The connection's request while the hot path serves it: the fields uvicorn's protocol
    and the limits read of a cycle (``response_complete``, ``keep_alive``, ...), its body
    chunks, and its runtime request and entry once admitted."""

    __slots__ = ("proto", "call", "chunks", "size", "keep_alive", "response_started",
                 "response_complete", "disconnected", "more_body", "req", "entry", "task",
                 "message_event", "scope", "completion_due")

    def __init__(self, proto: Any, call: Call, keep_alive: bool) -> None:
        self.proto = proto
        self.call = call
        self.chunks: list = []
        self.size = 0
        self.keep_alive = keep_alive
        self.response_started = False
        self.response_complete = False
        self.disconnected = False
        self.more_body = True
        self.req: Any = None
        self.entry: Any = None
        self.task: Optional[asyncio.Task] = None
        self.message_event = _NO_EVENT
        self.scope = None  # no ASGI scope (the limits compare a cycle's scope on an upgrade)
        #: answered before its body was in: the connection completes the request (keep-alive,
        #: the next pipelined one) once the body's last byte is read, not before
        self.completion_due = False

    def done(self, _future: Any) -> None:
        """The entry's future is done: answer the client."""
        self.proto.answered(self)


def protocol_class(limits: HttpLimits, app: Optional[HttpApp]) -> type:
    """The HTTP protocol class of a server of ``app``: :func:`.limits.protocol_class`'s,
    extended with the callback path for the hot inference routes when ``app``'s runtime can
    admit without an await (else the limits' class itself)."""
    base = limits_protocol_class(limits)
    if app is None or not hasattr(base, "_headers_in") or \
            not all(callable(getattr(app.runtime, n, None)) for n in ADMITTING):
        return base
    runtime: AdmittingRuntime = app.runtime  # type: ignore[assignment]  # checked just above
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

    door = app.door
    admit = runtime.admit
    settle = runtime.settle
    cancelled = runtime.cancelled
    http_app = app
    count = door.count
    max_body = app.max_body

    class DoorProtocol(base):  # type: ignore[misc, valid-type]
        """The limits' protocol with the hot routes served from the parser's callbacks."""

        cycle: Any  # uvicorn's RequestResponseCycle, or a HotCycle
        scope: Any  # the ASGI scope, made only for a request on uvicorn's path
        headers: list

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._hot: Optional[HotCycle] = None  # the admitted request awaiting its answer
            self._next_after_drain = False

        # -- the parser's callbacks ---------------------------------------------------
        def on_message_begin(self) -> None:
            # the ASGI scope is made only for a request that takes uvicorn's path
            self.url = b""
            self.expect_100_continue = False
            self.headers = []
            self.scope = None

        def on_headers_complete(self) -> None:
            # a request is in: no keep-alive timer until it is complete (one armed by a reply
            # completed earlier in this same read would close the connection under it)
            self._unset_keepalive_if_required()
            if not self._headers_in() or self._hot_begin():
                return
            url, headers, expect = self.url, self.headers, self.expect_100_continue
            HttpToolsProtocol.on_message_begin(self)  # the scope, as uvicorn makes it
            self.url, self.expect_100_continue = url, expect
            self.headers = self.scope["headers"] = headers
            self._asgi_cycle()

        def on_body(self, body: bytes) -> None:
            hot = self.cycle
            if type(hot) is not HotCycle:
                super().on_body(body)
                return
            hot.size += len(body)
            if hot.response_complete:  # answered before its body was in: dropped, up to the limit
                if hot.size > max_body:
                    self._close_lingering()
                return
            if hot.size > max_body:
                self._error(hot, too_large(max_body))
                return
            hot.chunks.append(body)

        def on_message_complete(self) -> None:
            hot = self.cycle
            if type(hot) is not HotCycle:
                super().on_message_complete()
                return
            self._message_in()
            hot.more_body = False
            if hot.response_complete:
                if hot.completion_due:  # answered early: now the request is complete
                    hot.completion_due = False
                    self._complete(hot)
                return
            chunks = hot.chunks
            hot.chunks = []
            self._hot_run(hot, chunks[0] if len(chunks) == 1 else b"".join(chunks))

        # -- the hot path -------------------------------------------------------------
        def _hot_begin(self) -> bool:
            """Serve the request whose headers are in on the hot path: True when it is one
            of the hot routes and nothing asks for uvicorn's path."""
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                return False  # pipelined behind a reply still being made: uvicorn's queue
            parser = self.parser
            if parser.get_method() != b"POST" or self.expect_100_continue or \
                    parser.should_upgrade() or not http_app.hot or runtime.tracing is not None \
                    or self.flow.write_paused or self._phase == "closed":
                return False  # (paused writes: uvicorn's send waits for the drain)
            path, _, query = self.url.partition(b"?")
            if b"%" in path or b"#" in self.url or not path.isascii():
                return False
            call = call_of(path.decode("ascii"), query)
            if call is None:
                return False
            call.read_headers(self.headers)
            client = self.client
            call.client = client[0] if client else None
            hot = HotCycle(self, call, parser.get_http_version() != "1.0"
                           and parser.should_keep_alive())
            token = CORRELATION_ID.set(call.cid) if call.cid else None
            try:
                if not door.begin(call):
                    return False  # a whole audio file: the app's own route
                self.cycle = hot
            except LumenError as exc:
                self.cycle = hot
                self._error(hot, exc)
            except Exception as exc:  # noqa: BLE001 - a bug must answer 500
                self.cycle = hot
                self._send(hot, NO_FIXED, *door.failure(call, exc))
            finally:
                if token is not None:
                    CORRELATION_ID.reset(token)
            return True

        def _hot_run(self, hot: HotCycle, body: bytes) -> None:
            """The body is in: admit the request; its future's callback answers."""
            call = hot.call
            token = CORRELATION_ID.set(call.cid) if call.cid else None
            try:
                req = door.request(call, body)
                # several embedding inputs run as one group; a heavy input is prepared off the
                # loop and a cached task answers through its cache: a task for those
                entry = admit(req) if type(req) is not list else None
                if entry is None:
                    task = self.loop.create_task(self._hot_await(hot, req))
                    hot.task = task
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
                else:
                    hot.req = req
                    hot.entry = entry
                    entry.waiter.add_done_callback(hot.done)
                self._hot = hot
            except LumenError as exc:
                self._error(hot, exc)
            except Exception as exc:  # noqa: BLE001 - a bug must answer 500
                self._send(hot, NO_FIXED, *door.failure(call, exc))
            finally:
                if token is not None:
                    CORRELATION_ID.reset(token)

        def answered(self, hot: HotCycle) -> None:
            """The admitted request's future is done: settle it and reply."""
            if hot.response_complete:
                return
            try:
                status, fixed, headers, body = door.reply(hot.call, settle(hot.req, hot.entry))
            except LumenError as exc:
                self._error(hot, exc)
            except asyncio.CancelledError:
                self._error(hot, Unavailable("the request was cancelled: the runtime is "
                                             "stopping or its version was unloaded; retry"))
            except Exception as exc:  # noqa: BLE001 - a bug must answer 500
                self._send(hot, NO_FIXED, *door.failure(hot.call, exc))
            else:
                self._send(hot, fixed, status, headers, body)

        async def _hot_await(self, hot: HotCycle, req: Any) -> None:
            try:
                status, fixed, headers, body = door.reply(hot.call,
                                                          await door.outcome(hot.call, req))
            except asyncio.CancelledError:
                if not hot.response_complete:  # not the client leaving (a forced shutdown)
                    self._error(hot, Unavailable("the request was cancelled: the server is "
                                                 "stopping; retry"))
                raise
            except LumenError as exc:
                self._error(hot, exc)
            except Exception as exc:  # noqa: BLE001 - a bug must answer 500
                self._send(hot, NO_FIXED, *door.failure(hot.call, exc))
            else:
                self._send(hot, fixed, status, headers, body)

        def _error(self, hot: HotCycle, exc: LumenError) -> None:
            if isinstance(exc, PayloadTooLarge):  # the rest of the body is not read
                hot.keep_alive = False
            self._send(hot, NO_FIXED, *door.error(hot.call, exc))

        def _send(self, hot: HotCycle, fixed: Any, status: int, headers: Any,
                  body: Any) -> None:
            """Write the whole reply and complete the request as uvicorn completes a cycle
            (keep-alive, the next pipelined request, or the close)."""
            if hot.response_complete:
                return
            hot.response_started = hot.response_complete = True
            if self._hot is hot:
                self._hot = None
            transport = self.transport
            if transport.is_closing() or self._phase == "closed":  # nothing can be sent
                if count is not None:
                    count(hot.call.route, CLIENT_CLOSED_STATUS)
                return
            head = response_head(STATUS_LINE[status], fixed[1],
                                 (*self.server_state.default_headers, *headers), hot.keep_alive)
            if head is None:  # a header value with a line break: never sent
                status, headers, body = door.failure(
                    hot.call, ValueError("a reply header value holds a line break"))
                head = response_head(STATUS_LINE[status], b"", headers, hot.keep_alive)
                assert head is not None
            if count is not None:
                count(hot.call.route, status)
            parts, keep_alive = head
            self.write_whole(parts, body)
            if not keep_alive:
                hot.keep_alive = False
                self.server_state.total_requests += 1
                if self._phase == "body":  # its body still arriving: read and drop it first
                    self._close_lingering()
                else:
                    transport.close()
                return  # nothing after it is started (uvicorn's cycle does the same)
            if hot.more_body:  # answered before its body was in: completed by its last byte
                hot.completion_due = True
            else:
                self._complete(hot)

        def _complete(self, hot: HotCycle) -> None:
            """The request is answered and read whole: as uvicorn's ``on_response_complete``,
            after the write buffer drains when the client reads slowly (reading paused
            meanwhile, so no further request is parsed)."""
            if self.flow.write_paused:
                self._next_after_drain = True
                self.flow.pause_reading()
            else:
                self.on_response_complete()

        # -- the connection -----------------------------------------------------------
        def resume_writing(self) -> None:
            super().resume_writing()
            if self._next_after_drain:
                self._next_after_drain = False
                self.on_response_complete()

        def connection_lost(self, exc: Optional[Exception]) -> None:
            try:
                hot = self._hot
                if hot is None and type(self.cycle) is HotCycle:
                    hot = self.cycle  # its body was still arriving
                if hot is not None and not hot.response_complete:
                    self._hot = None
                    hot.response_complete = True
                    entry = hot.entry
                    if entry is not None:  # queued or in a batch: cancel it there
                        entry.waiter.remove_done_callback(hot.done)
                        entry.waiter.cancel()
                        cancelled(entry)
                    elif hot.task is not None:
                        hot.task.cancel()
                    if count is not None:
                        count(hot.call.route, CLIENT_CLOSED_STATUS)
            finally:  # the connection leaves the server's set whatever happened above
                super().connection_lost(exc)

    return DoorProtocol
