"""gRPC plumbing both services share; bidirectional streams, for both services (``lumen.v1.Inference/InferStream`` and the
Open Inference Protocol's ``ModelStreamInfer``): one window rule, one reading loop.

A stream's requests run concurrently (so a client can pipeline), but each stream is bounded by
its own :class:`StreamWindow` (requests and payload bytes admitted and not yet answered): while
it is full the stream is not read further, so a fast writer is slowed by HTTP/2 flow control
instead of filling the server's memory.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable


def call_metadata(context: Any) -> dict:
    """A call's invocation metadata as a dict (the W3C trace context carrier)."""
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


class StreamWindow:
    """The requests of one stream admitted and not yet answered, bounded in count and bytes.

    ``acquire`` waits while the window is full; one request is always let in when the window
    is empty, so a message larger than the byte budget still runs (alone)."""

    __slots__ = ("max_requests", "max_bytes", "requests", "nbytes", "_freed")

    def __init__(self, max_requests: int, max_bytes: int):
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self.requests = 0
        self.nbytes = 0
        self._freed = asyncio.Event()

    def _full(self, nbytes: int) -> bool:
        return self.requests > 0 and (self.requests >= self.max_requests
                                      or self.nbytes + nbytes > self.max_bytes)

    async def acquire(self, nbytes: int) -> None:
        while self._full(nbytes):
            self._freed.clear()
            await self._freed.wait()
        self.requests += 1
        self.nbytes += nbytes

    def release(self, nbytes: int) -> None:
        self.requests -= 1
        self.nbytes -= nbytes
        self._freed.set()


async def windowed_replies(requests: AsyncIterator, window: StreamWindow,
                           size_of: Callable[[Any], int], handle: Callable[[Any], Awaitable],
                           admitted: Callable[[int], None],
                           answered: Callable[[int], None]) -> AsyncIterator:
    """The engine of a bidirectional stream (both gRPC services): read a message only while
    ``window`` has room for it, run ``handle(msg)`` for each concurrently, yield the replies as
    they finish; ``admitted(nbytes)`` / ``answered(nbytes)`` keep the server's in-flight counts
    (a reply is answered once handed on; what is left in ``window`` when the generator ends was
    admitted and never answered: the caller takes it off its counts).  ``handle`` must answer
    every request itself (errors as replies).  Leaving early (the caller went away, the stream broke)
    cancels what is still running; close the generator (``aclose``) to leave at once.

    Tasks start in creation order and ``Runtime.infer`` admits a request before it first
    suspends, so a stream's requests reach their batcher in arrival order (sequences rely on
    it)."""
    replies: asyncio.Queue = asyncio.Queue()  # (reply, payload bytes); None: no more
    running: set = set()

    def finished(nbytes: int, task: asyncio.Task) -> None:
        running.discard(task)
        if not task.cancelled():
            replies.put_nowait((task.result(), nbytes))

    async def read() -> None:
        try:
            async for msg in requests:
                nbytes = size_of(msg)
                await window.acquire(nbytes)  # backpressure: no read while the window is full
                admitted(nbytes)
                task = asyncio.ensure_future(handle(msg))
                running.add(task)
                task.add_done_callback(lambda t, n=nbytes: finished(n, t))
            if running:
                await asyncio.wait(set(running))
        finally:
            replies.put_nowait(None)

    reader = asyncio.ensure_future(read())
    try:
        while True:
            item = await replies.get()
            if item is None:
                break
            try:
                yield item[0]
            finally:
                window.release(item[1])  # handed to gRPC, or the call is over
                answered(item[1])
        await reader  # surfaces a broken request stream as the call's error
    finally:
        reader.cancel()
        for task in list(running):
            task.cancel()
