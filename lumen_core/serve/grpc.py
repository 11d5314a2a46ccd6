"""The gRPC API: service ``lumen.v1.Inference`` (``proto/lumen.proto``) on ``grpc.aio``.

``Infer`` is unary; ``InferStream`` is bidirectional, the natural transport for sequences (a
VAD client streams its audio chunks on one call and reads probabilities back on the same one).

Errors are gRPC statuses mapped by the table in :mod:`lumen_core.errors`, with trailing
metadata ``lumen-error-code`` / ``lumen-error-field`` so a client can rebuild the exact
:class:`~lumen_core.errors.LumenError` (``errors.from_code``).  On a stream a failed request
yields an ``error`` message and the stream stays open: one bad chunk must not end a session.

Ordering on a stream: requests that share ``lumen.sequence.id`` are submitted strictly in the
order they arrived (each waits for its predecessor to finish), because a stateful model's state
is carried from one chunk to the next; requests of different sequences (or none) run
concurrently and are batched together.  Responses carry the request's ``correlation_id``.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, AsyncIterator, Optional

import grpc

from ..contract import KEY_SEQUENCE_ID
from ..errors import InternalError, LumenError, Overloaded, Unavailable
from ..request import InferRequest
from .http import dtype_name
from .metrics import PrometheusObserver
from .proto import lumen_pb2, lumen_pb2_grpc

log = logging.getLogger("lumen.grpc")

SERVICE_NAME = "lumen.v1.Inference"
#: headroom over ``max_payload_bytes`` for the rest of a request message (meta, names)
MESSAGE_OVERHEAD_BYTES = 64 * 1024
#: replies carry whole output tensors; allow well above the default 4 MiB
MAX_SEND_MESSAGE_BYTES = 256 * 1024 * 1024
ERROR_CODE_KEY = "lumen-error-code"
ERROR_FIELD_KEY = "lumen-error-field"
RETRY_AFTER_KEY = "retry-after"


def to_request(msg: Any) -> InferRequest:
    """Proto -> runtime request; ``payload`` stays the message's ``bytes`` object (no copy)."""
    return InferRequest(msg.task, msg.payload, msg.payload_mime, dict(msg.meta), msg.correlation_id)


def to_proto(resp: Any) -> Any:
    out = lumen_pb2.InferResponse(correlation_id=resp.correlation_id, task=resp.task)
    for name, arr in resp.outputs.items():
        t = out.outputs[name]
        t.dtype = dtype_name(arr)
        t.shape.extend(arr.shape)
        t.data = arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes()
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
    """Implements ``lumen.v1.Inference`` over one running runtime."""

    def __init__(self, runtime: Any, observer: Optional[PrometheusObserver] = None):
        self.runtime = runtime
        self.observer = observer
        self.draining = False

    def _count(self, method: str, status: str) -> None:
        if self.observer is not None:
            self.observer.transport_request("grpc", method, status)

    async def _infer(self, msg: Any) -> Any:
        if self.draining:
            raise Unavailable("the server is shutting down; not accepting new requests")
        try:
            return await self.runtime.infer(to_request(msg))
        except LumenError:
            raise
        except Exception as exc:  # noqa: BLE001 - a bug answers INTERNAL, never kills the server
            log.exception("unhandled error in Infer")
            raise InternalError(f"internal server error: {exc}") from exc

    async def Infer(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        try:
            resp = await self._infer(request)
        except LumenError as exc:
            self._count("Infer", exc.grpc_status)
            context.set_trailing_metadata(error_metadata(exc))
            await context.abort(grpc.StatusCode[exc.grpc_status], exc.message)
        self._count("Infer", "OK")
        return to_proto(resp)

    async def InferStream(self, request_iterator: AsyncIterator,  # noqa: N802
                          context: grpc.aio.ServicerContext) -> AsyncIterator:
        replies: asyncio.Queue = asyncio.Queue()
        tails: dict = {}  # sequence id -> the task of its latest request
        running: set = set()

        async def one(msg: Any, before: Optional[asyncio.Task]) -> None:
            if before is not None:
                await asyncio.wait((before,))
            try:
                reply = lumen_pb2.InferStreamResponse(correlation_id=msg.correlation_id,
                                                      response=to_proto(await self._infer(msg)))
                self._count("InferStream", "OK")
            except LumenError as exc:
                reply = lumen_pb2.InferStreamResponse(correlation_id=msg.correlation_id,
                                                      error=error_proto(exc))
                self._count("InferStream", exc.grpc_status)
            replies.put_nowait(reply)

        async def read() -> None:
            try:
                async for msg in request_iterator:
                    seq = msg.meta.get(KEY_SEQUENCE_ID, "")
                    before = tails.get(seq) if seq else None
                    task = asyncio.ensure_future(one(msg, before))
                    running.add(task)
                    task.add_done_callback(running.discard)
                    if seq:
                        tails[seq] = task
                        task.add_done_callback(
                            lambda t, s=seq: tails.pop(s, None) if tails.get(s) is t else None)
                if running:
                    await asyncio.wait(set(running))
            finally:
                replies.put_nowait(None)

        reader = asyncio.ensure_future(read())
        try:
            while True:
                reply = await replies.get()
                if reply is None:
                    break
                yield reply
            await reader  # surfaces a broken request stream as the call's error
        finally:
            # the caller went away (or the stream failed): cancel what is still queued
            reader.cancel()
            for task in list(running):
                task.cancel()


class GrpcServer:
    """A ``grpc.aio`` server for one runtime; ``port`` is the bound port (0 picks one)."""

    def __init__(self, runtime: Any, observer: Optional[PrometheusObserver], host: str, port: int,
                 max_payload_bytes: int):
        self.servicer = InferenceServicer(runtime, observer)
        self.host = host
        self.requested_port = port
        self.port = 0
        self._max_recv = max_payload_bytes + MESSAGE_OVERHEAD_BYTES
        self._server: Optional[grpc.aio.Server] = None

    async def start(self) -> None:
        server = grpc.aio.server(options=[
            ("grpc.max_receive_message_length", self._max_recv),
            ("grpc.max_send_message_length", MAX_SEND_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ])
        lumen_pb2_grpc.add_InferenceServicer_to_server(self.servicer, server)
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.port = server.add_insecure_port(f"{host}:{self.requested_port}")
        if not self.port:
            raise OSError(f"gRPC could not bind {self.host}:{self.requested_port}")
        await server.start()
        self._server = server

    async def stop(self, grace_s: float) -> None:
        """Refuse new calls at once; give calls in flight ``grace_s`` seconds to finish."""
        self.servicer.draining = True
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None
