"""gRPC plumbing both services share; bidirectional streams, for both services (``lumen.v1.Inference/InferStream`` and the
Open Inference Protocol's ``ModelStreamInfer``): one window rule, one reading loop.

A stream's requests run concurrently (so a client can pipeline), but each stream is bounded by
its own :class:`StreamWindow` (requests admitted and not yet answered, their payload bytes and
their replies' bytes): while it is full the stream is not read further, so a fast writer is
slowed by HTTP/2 flow control instead of filling the server's memory, and a slow reader leaves
at most the window's bytes of replies waiting for it.

A stream is also paced by its task's queue, as the WebSocket route is (issue 38 row 4): a
message is admitted only when its task has room for it (``Runtime.room``), and until then it
is held and nothing more is read, so a fast stream is slowed, never refused mid-sequence (a
lost chunk corrupts a stateful sequence's state for good).  A message whose sequence waits
in the backlog for a slot is held too (up to ``STREAM_SLOT_WAIT_S``: a stream whose own other
sequences hold every slot must not wait for itself), so streams beyond the slots do not fill
the queue with chunks that cannot run.
"""
from __future__ import annotations

import asyncio
import functools
import time
from typing import Any, AsyncGenerator, AsyncIterator, Awaitable, Callable, Optional

#: ``room(msg)``'s answers (``batching.policy``'s ROOM, QUEUE_FULL, AWAITING_SLOT)
ROOM, QUEUE_FULL, AWAITING_SLOT = 0, 1, 2
#: a held message looks for room again after this long, doubling up to the max (the queue
#: frees room as batches form, in worker threads: there is no event on the loop to wait for)
STREAM_POLL_S = 0.001
STREAM_POLL_MAX_S = 0.02
#: the longest a message waits for its sequence's slot before it is admitted into the
#: backlog anyway (while its queue has room)
STREAM_SLOT_WAIT_S = 5.0


async def wait_for_room(room: Callable[[Any], int], msg: Any) -> None:
    """Return once ``room(msg)`` says ``msg`` may be admitted (see the module docstring); no
    suspension after the last look, so the caller's admission follows it at once."""
    r = room(msg)
    if r == ROOM:
        return
    delay = STREAM_POLL_S
    give_up = time.monotonic() + STREAM_SLOT_WAIT_S
    while r == QUEUE_FULL or (r == AWAITING_SLOT and time.monotonic() < give_up):
        await asyncio.sleep(delay)
        delay = min(STREAM_POLL_MAX_S, 2 * delay)
        r = room(msg)


def call_metadata(context: Any) -> dict:
    """A call's invocation metadata as a dict (the W3C trace context carrier)."""
    return {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}


class StreamWindow:
    """The requests of one stream admitted and not yet answered, bounded in count and bytes.

    The bytes are the requests' (``nbytes``, what the server's in-flight counts take) plus
    their replies' (``reply_bytes``): a reply ready and not yet handed to gRPC (a reader slower
    than the model) is held here, and counts at its real size; until its own reply is ready,
    a request is charged the largest reply seen on the stream so far, and before any reply
    was seen only one request is let in.  So a stream whose replies dwarf its requests (a
    small input, a large output) is held to the budget too, not to ``max_requests`` of its
    replies.  ``acquire`` waits while the window is full; one request is always let in when
    the window is empty, so a message larger than the byte budget still runs (alone)."""

    __slots__ = ("max_requests", "max_bytes", "requests", "nbytes", "reply_bytes",
                 "reply_guess", "_freed")

    def __init__(self, max_requests: int, max_bytes: int):
        self.max_requests = max_requests
        self.max_bytes = max_bytes
        self.requests = 0
        self.nbytes = 0
        self.reply_bytes = 0
        #: the largest reply seen on the stream (None: none yet)
        self.reply_guess: Optional[int] = None
        self._freed = asyncio.Event()

    def _full(self, nbytes: int) -> bool:
        if self.requests == 0:
            return False
        guess = self.reply_guess
        return (guess is None or self.requests >= self.max_requests
                or self.nbytes + self.reply_bytes + nbytes + guess > self.max_bytes)

    async def acquire(self, nbytes: int) -> int:
        """Wait for room for a request of ``nbytes``; returns what its reply is charged until
        it is ready (pass it to :meth:`reply_ready`)."""
        while self._full(nbytes):
            self._freed.clear()
            await self._freed.wait()
        guess = self.reply_guess or 0
        self.requests += 1
        self.nbytes += nbytes
        self.reply_bytes += guess
        return guess

    def reply_ready(self, charged: int, reply_nbytes: int) -> None:
        """A request's reply is ready (``charged``: what :meth:`acquire` returned): it is held
        at its real size from now until :meth:`release`."""
        self.reply_bytes += reply_nbytes - charged
        if self.reply_guess is None or reply_nbytes > self.reply_guess:
            self.reply_guess = reply_nbytes
        self._freed.set()

    def release(self, nbytes: int, reply_nbytes: int = 0) -> None:
        self.requests -= 1
        self.nbytes -= nbytes
        self.reply_bytes -= reply_nbytes
        self._freed.set()


def message_bytes(msg: Any) -> int:
    """The serialized size of a protobuf message (a reply, for the window's byte budget)."""
    return msg.ByteSize()


async def windowed_replies(requests: AsyncIterator, window: StreamWindow,
                           size_of: Callable[[Any], int], handle: Callable[[Any], Awaitable],
                           admitted: Callable[[int], None],
                           answered: Callable[[int], None],
                           reply_size: Callable[[Any], int] = message_bytes,
                           room: Optional[Callable[[Any], int]] = None
                           ) -> AsyncGenerator[Any, None]:
    """The engine of a bidirectional stream (both gRPC services): read a message only while
    ``window`` has room for it, run ``handle(msg)`` for each concurrently, yield the replies as
    they finish (a reply waiting to be taken counts against the window at ``reply_size(reply)``
    bytes); ``admitted(nbytes)`` / ``answered(nbytes)`` keep the server's in-flight counts
    (a reply is answered once handed on; what is left in ``window`` when the generator ends was
    admitted and never answered: the caller takes it off its counts).  ``handle`` must answer
    every request itself (errors as replies).  Leaving early (the caller went away, the stream broke)
    cancels what is still running; close the generator (``aclose``) to leave at once.

    Tasks start in creation order and ``Runtime.infer`` admits a request before it first
    suspends, so a stream's requests reach their batcher in arrival order (sequences rely on
    it).  ``room(msg)`` (None: no pacing) holds each message until its task has room for it
    (``wait_for_room``, in the message's own task, which the reader waits for before it reads
    on: the last look and the admission happen in one step, so no other stream slips in)."""
    replies: asyncio.Queue = asyncio.Queue()  # (reply, payload bytes, reply bytes); None: no more
    running: set = set()

    def finished(nbytes: int, charged: int, task: asyncio.Task) -> None:
        running.discard(task)
        if not task.cancelled():
            reply = task.result()
            held = reply_size(reply)
            window.reply_ready(charged, held)
            replies.put_nowait((reply, nbytes, held))

    async def paced(msg: Any, started: asyncio.Future) -> Any:
        try:
            await wait_for_room(room, msg)  # type: ignore[arg-type]
        finally:
            if not started.done():
                started.set_result(None)
        return await handle(msg)  # admitted in this same step

    async def read() -> None:
        try:
            async for msg in requests:
                nbytes = size_of(msg)
                # backpressure: no read while the window is full
                charged = await window.acquire(nbytes)
                admitted(nbytes)
                started = None
                if room is None:
                    task = asyncio.ensure_future(handle(msg))
                else:
                    started = asyncio.get_running_loop().create_future()
                    task = asyncio.ensure_future(paced(msg, started))
                running.add(task)
                task.add_done_callback(functools.partial(finished, nbytes, charged))
                if started is not None:
                    await started  # no read while the message waits for room
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
                window.release(item[1], item[2])  # handed to gRPC, or the call is over
                answered(item[1])
        await reader  # surfaces a broken request stream as the call's error
    finally:
        reader.cancel()
        for task in list(running):
            task.cancel()
