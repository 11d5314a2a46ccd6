"""The gRPC API: service ``lumen.v1.Inference`` (``proto/lumen.proto``) on ``grpc.aio``.

``Infer`` is unary; ``InferStream`` is bidirectional, the natural transport for sequences (a
VAD client streams its audio chunks on one call and reads probabilities back on the same one).

Errors are gRPC statuses mapped by the table in :mod:`lumen_core.errors`, with trailing
metadata ``lumen-error-code`` / ``lumen-error-field`` so a client can rebuild the exact
:class:`~lumen_core.errors.LumenError` (``errors.from_code``).  On a stream a failed request
yields an ``error`` message and the stream stays open: one bad chunk must not end a session.

A stream translates, nothing more.  Each message is handed to ``Runtime.infer`` as it arrives,
in arrival order; the runtime admits a request before it first yields to the event loop, so
requests of one sequence reach the task's sequence batcher in the order they were sent, and
the sequence batcher runs them in that order (one in flight per sequence, each seeing the
state its predecessor left).  The stream keeps no queue of its own: every request counts
against the task's queue limits as soon as it arrives, and one past ``max_queue_size`` gets an
``Overloaded`` (``resource_exhausted``) error message on the stream.  What the stream does
bound is itself: at most :data:`STREAM_MAX_IN_FLIGHT` of its requests (and
:data:`STREAM_MAX_IN_FLIGHT_BYTES` of their payload and of their replies waiting to be sent)
are admitted and not yet answered, and no further message is read while that window is full,
so a client that sends faster than the server answers, or reads slower, is slowed by HTTP/2
flow control instead of growing the server's memory.
Responses carry the request's ``correlation_id`` and may interleave
across sequences.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable, Optional

import grpc
import numpy as np

from ..contract import KEY_SEQUENCE_ID, KEY_VAD_EVENTS
from ..errors import InternalError, LumenError, Overloaded, PayloadTooLarge, Unavailable
from ..request import InferRequest
from . import audio, codec
from .auth import ApiKeys, unscope_error
from .logs import client_correlation_id
from .metrics import PrometheusObserver
from .oip_grpc import OipServicer
from .options import check_options
from .proto import lumen_pb2, lumen_pb2_grpc
from .streams import StreamWindow, call_metadata, windowed_replies

if TYPE_CHECKING:  # typing only: the runtime as the doors use it
    from .runtime_api import RuntimeQueries

log = logging.getLogger("lumen.grpc")

#: headroom over ``max_payload_bytes`` for the rest of a request message (meta, names)
MESSAGE_OVERHEAD_BYTES = 64 * 1024
#: gRPC's own receive limit is this many times Lumen's message limit, so a message over
#: Lumen's limit still reaches the servicer and is answered INVALID_ARGUMENT
#: ``payload_too_large`` (a client reads grpc's RESOURCE_EXHAUSTED as "retry"); only one over
#: this multiple gets grpc's own status, and it is never parsed
OVERSIZE_ANSWER_FACTOR = 4
#: replies carry whole output tensors; allow well above the default 4 MiB
MAX_SEND_MESSAGE_BYTES = 256 * 1024 * 1024
ERROR_CODE_KEY = "lumen-error-code"
ERROR_FIELD_KEY = "lumen-error-field"
RETRY_AFTER_KEY = "retry-after"
#: the most requests of one ``InferStream`` call admitted and not yet answered (their reply
#: not yet handed to gRPC); past it the stream is not read until one is answered.  Enough for
#: one stream to fill batches of a few hundred interleaved sequences (one chunk each)
STREAM_MAX_IN_FLIGHT = 256
#: the most bytes of one stream in that state: its requests' payloads and the replies ready and
#: not yet sent (a slow reader's backlog; streams.StreamWindow); one message is always
#: admitted, however large (``max_payload_bytes`` bounds it).  It bounds a stream's memory
STREAM_MAX_IN_FLIGHT_BYTES = 32 * 1024 * 1024


class Oversized:
    """What the request deserializer hands the servicer for a message over the limit (it is
    never parsed)."""

    __slots__ = ("nbytes", "limit", "correlation_id", "payload")

    def __init__(self, nbytes: int, limit: int):
        self.nbytes = nbytes
        self.limit = limit
        self.correlation_id = ""
        self.payload = b""

    def error(self) -> PayloadTooLarge:
        return PayloadTooLarge(f"the request message is {self.nbytes} bytes; the limit is "
                               f"{self.limit} (server.max_payload_bytes + "
                               f"{MESSAGE_OVERHEAD_BYTES} bytes for the rest of the message)",
                               "payload")


def request_deserializer(limit: int) -> Any:
    parse = lumen_pb2.InferRequest.FromString

    def deserialize(data: bytes) -> Any:
        if len(data) > limit:
            return Oversized(len(data), limit)
        return parse(data)

    return deserialize


def to_request(msg: Any, scope: Optional[str] = None) -> InferRequest:
    """Proto -> runtime request; ``payload`` stays the message's ``bytes`` object (no copy)."""
    meta = ApiKeys.scoped_meta(dict(msg.meta), scope)
    return InferRequest(msg.task, msg.payload, msg.payload_mime, meta,
                        client_correlation_id(msg.correlation_id))


def stream_target(msg: Any, scope: Optional[str]) -> tuple:
    """``(task, sequence id as the batcher knows it)`` of a stream message, for the pacing;
    ``("", None)`` for one that will be refused whatever the queue (oversized, a bad id)."""
    if isinstance(msg, Oversized):
        return "", None
    sid = msg.meta.get(KEY_SEQUENCE_ID) or None
    if sid is not None and scope is not None:
        try:
            sid = ApiKeys.scoped_meta({KEY_SEQUENCE_ID: sid}, scope)[KEY_SEQUENCE_ID]
        except LumenError:
            return "", None
    return msg.task, sid


def to_proto(resp: Any) -> Any:
    out = lumen_pb2.InferResponse(correlation_id=resp.correlation_id, task=resp.task)
    for name, arr in resp.outputs.items():
        t = out.outputs[name]
        if not isinstance(arr, np.ndarray):  # a structured output (ocr lines): JSON bytes
            t.dtype = codec.STRUCTURED_DTYPE
            t.data = codec.dumps(arr)
            continue
        t.dtype = codec.dtype_name(arr)
        t.shape.extend(arr.shape)
        t.data = codec.tensor_bytes(arr)
    out.meta.update(resp.meta)
    return out


def error_proto(exc: LumenError) -> Any:
    return lumen_pb2.Error(code=exc.code, message=exc.message, field=exc.field or "")


def error_metadata(exc: LumenError) -> tuple:
    md = [(ERROR_CODE_KEY, exc.code), (ERROR_FIELD_KEY, exc.field or "")]
    if isinstance(exc, Overloaded):
        md.append((RETRY_AFTER_KEY, str(exc.retry_after_s)))
    return tuple(md)


class InferenceServicer(lumen_pb2_grpc.InferenceServicer):
    """Implements ``lumen.v1.Inference`` over one running runtime.

    ``stream_in_flight`` / ``stream_in_flight_bytes``: requests (payload bytes) of all open
    streams admitted and not yet answered, each stream's share bounded by ``stream_window``
    (requests) and ``stream_window_bytes``."""

    def __init__(self, runtime: RuntimeQueries, observer: Optional[PrometheusObserver] = None,
                 stream_window: int = STREAM_MAX_IN_FLIGHT,
                 stream_window_bytes: int = STREAM_MAX_IN_FLIGHT_BYTES,
                 keys: Optional[ApiKeys] = None):
        self.runtime = runtime
        self.observer = observer
        self.keys = keys if keys is not None else ApiKeys()
        self.draining = False
        self.stream_window = stream_window
        self.stream_window_bytes = stream_window_bytes
        self.stream_in_flight = 0
        self.stream_in_flight_bytes = 0

    # -- shared with the Open Inference Protocol's servicer (oip_grpc.py) ------------------
    def count_call(self, method: str, status: str) -> None:
        """Count one finished call of ``method`` with its gRPC status (``/metrics``)."""
        if self.observer is not None:
            self.observer.transport_request("grpc", method, status)

    def key_scope(self, context: grpc.aio.ServicerContext) -> Optional[str]:
        """The caller's key scope (None when keys are off); Unauthenticated without a key."""
        if not self.keys.enabled:
            return None
        auth = None
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                auth = value
        return self.keys.check(auth)

    async def _infer(self, msg: Any, scope: Optional[str] = None) -> Any:
        if self.draining:
            raise Unavailable("the server is shutting down; not accepting new requests")
        if isinstance(msg, Oversized):
            raise msg.error()
        try:
            check_options(self.runtime, msg.task, msg.meta)  # the HTTP route's rule
            return await self.runtime.infer(to_request(msg, scope))
        except LumenError as exc:
            raise unscope_error(exc, scope) from None
        except Exception as exc:  # noqa: BLE001 - a bug answers INTERNAL, never kills the server
            log.exception("unhandled error in Infer")
            raise InternalError(f"internal server error: {exc}") from exc

    async def Infer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        tr = getattr(self.runtime, "tracing", None)
        if tr is None:
            return await self._unary(request, context)
        # the transport span: a child of the caller's W3C traceparent metadata, if any
        with tr.rpc_span("lumen.v1.Inference", "Infer", call_metadata(context)):
            return await self._unary(request, context)

    async def _unary(self, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            resp = await self._infer(request, self.key_scope(context))
        except LumenError as exc:
            self.count_call("Infer", exc.grpc_status)
            context.set_trailing_metadata(error_metadata(exc))
            await context.abort(grpc.StatusCode[exc.grpc_status], exc.message)
        self.count_call("Infer", "OK")
        return to_proto(resp)

    async def _stream_one(self, msg: Any, scope: Optional[str],
                          events: Optional[audio.SequenceEvents] = None,
                          carrier: Optional[dict] = None) -> Any:
        """One stream message -> its reply message (a response or an error, never a raise);
        ``events``: the call's speech-segment trackers (``lumen.vad.events``, audio.py);
        ``carrier``: the call's metadata, for the trace parent when tracing is on."""
        tr = getattr(self.runtime, "tracing", None)
        if tr is None:
            return await self._stream_reply(msg, scope, events)
        with tr.rpc_span("lumen.v1.Inference", "InferStream", carrier):
            return await self._stream_reply(msg, scope, events)

    async def _stream_reply(self, msg: Any, scope: Optional[str],
                            events: Optional[audio.SequenceEvents]) -> Any:
        cid = client_correlation_id(msg.correlation_id)
        ticket = None
        if events is not None and not isinstance(msg, Oversized):
            ticket = events.admit(msg.task, msg.meta)
        try:
            resp = await self._infer(msg, scope)
            reply = lumen_pb2.InferStreamResponse(correlation_id=cid, response=to_proto(resp))
            if ticket is not None and events is not None:
                settled = events.settle(ticket, resp)
                if settled:
                    reply.response.meta[KEY_VAD_EVENTS] = settled
        except LumenError as exc:
            if ticket is not None and events is not None:
                events.settle(ticket, None)
            self.count_call("InferStream", exc.grpc_status)
            return lumen_pb2.InferStreamResponse(correlation_id=cid, error=error_proto(exc))
        except Exception as exc:  # noqa: BLE001 - one bad reply must not stall the stream
            log.exception("unhandled error in InferStream")
            err = InternalError(f"internal server error: {exc}")
            self.count_call("InferStream", err.grpc_status)
            return lumen_pb2.InferStreamResponse(correlation_id=cid, error=error_proto(err))
        self.count_call("InferStream", "OK")
        return reply

    def stream_admitted(self, nbytes: int) -> None:
        """A stream admitted a request of ``nbytes`` (the servicer's in-flight counts)."""
        self.stream_in_flight += 1
        self.stream_in_flight_bytes += nbytes

    def stream_answered(self, nbytes: int) -> None:
        """A stream answered a request admitted with ``nbytes``."""
        self.stream_in_flight -= 1
        self.stream_in_flight_bytes -= nbytes

    async def stream(self, request_iterator: AsyncIterator, size_of: Callable[[Any], int],
                     handle: Callable[[Any], Awaitable],
                     target: Optional[Callable[[Any], tuple]] = None) -> AsyncIterator:
        """A bidirectional stream of either service (this one's ``InferStream``, OIP's
        ``ModelStreamInfer``): one window rule, one pacing rule and one in-flight count for
        both; ``target(msg)`` names a message's ``(task, scoped sequence id or None)`` for the
        pacing (``streams.wait_for_room``).  When the caller goes away (or the stream fails)
        what is still queued is cancelled and the stream's remaining share leaves the counts."""
        window = StreamWindow(self.stream_window, self.stream_window_bytes)
        rt = self.runtime
        room = None
        if target is not None:
            def room(msg: Any) -> int:
                task, sid = target(msg)
                return rt.room(task, sid) if task else 0
        replies = windowed_replies(request_iterator, window, size_of, handle,
                                   self.stream_admitted, self.stream_answered, room=room)
        try:
            async for reply in replies:
                yield reply
        finally:
            await replies.aclose()
            self.stream_in_flight -= window.requests
            self.stream_in_flight_bytes -= window.nbytes

    async def InferStream(self, request_iterator: AsyncIterator,  # noqa: N802
                          context: grpc.aio.ServicerContext) -> AsyncIterator:
        try:
            scope = self.key_scope(context)
        except LumenError as exc:
            self.count_call("InferStream", exc.grpc_status)
            context.set_trailing_metadata(error_metadata(exc))
            await context.abort(grpc.StatusCode[exc.grpc_status], exc.message)
        events = audio.SequenceEvents(self.runtime)
        carrier = call_metadata(context) if getattr(self.runtime, "tracing", None) else None
        async for reply in self.stream(request_iterator, lambda msg: len(msg.payload),
                                       lambda msg: self._stream_one(msg, scope, events, carrier),
                                       lambda msg: stream_target(msg, scope)):
            yield reply


class GrpcServer:
    """A ``grpc.aio`` server for one runtime; ``port`` is the bound port (0 picks one)."""

    def __init__(self, runtime: RuntimeQueries, observer: Optional[PrometheusObserver], host: str, port: int,
                 max_payload_bytes: int, keys: Optional[ApiKeys] = None,
                 tls: Optional[tuple] = None):
        self.servicer = InferenceServicer(runtime, observer, keys=keys)
        #: the Open Inference Protocol's service on the same server (oip_grpc.py)
        self.oip = OipServicer(self.servicer)
        self.host = host
        self.requested_port = port
        self.port = 0
        self._max_recv = max_payload_bytes + MESSAGE_OVERHEAD_BYTES
        self._tls = tls  # (cert PEM bytes, key PEM bytes) or None
        self._server: Optional[grpc.aio.Server] = None

    def _add_handlers(self, server: Any) -> None:
        """The generated registration, but with a deserializer that answers an oversized
        message instead of parsing it (see :class:`Oversized`)."""
        s = self.servicer
        deserialize = request_deserializer(self._max_recv)
        handlers = {
            "Infer": grpc.unary_unary_rpc_method_handler(
                s.Infer, request_deserializer=deserialize,
                response_serializer=lumen_pb2.InferResponse.SerializeToString),
            "InferStream": grpc.stream_stream_rpc_method_handler(
                s.InferStream, request_deserializer=deserialize,
                response_serializer=lumen_pb2.InferStreamResponse.SerializeToString),
        }
        service = "lumen.v1.Inference"
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        server.add_registered_method_handlers(service, handlers)
        self.oip.add_to(server, self._max_recv)

    async def start(self) -> None:
        server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", self._max_recv * OVERSIZE_ANSWER_FACTOR),
            ("grpc.max_send_message_length", MAX_SEND_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ])
        self._add_handlers(server)
        host = f"[{self.host}]" if ":" in self.host else self.host
        address = f"{host}:{self.requested_port}"
        try:
            if self._tls is not None:
                creds = grpc.ssl_server_credentials([(self._tls[1], self._tls[0])])
                self.port = server.add_secure_port(address, creds)
            else:
                self.port = server.add_insecure_port(address)
        except RuntimeError:  # grpc >= 1.5x raises instead of returning 0
            self.port = 0
        if not self.port:
            raise OSError(f"gRPC cannot listen on {self.host}:{self.requested_port}: the address "
                          f"is in use or not available; pick another port with --grpc-port "
                          f"([server] grpc_port; 0 disables gRPC)")
        await server.start()
        self._server = server

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls at once; give calls in flight ``grace_s`` seconds to finish."""
        self.servicer.draining = True
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
