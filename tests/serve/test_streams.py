"""``serve/streams.py``: the one stream engine of both gRPC services (``InferStream`` and OIP's
``ModelStreamInfer``): a window bounded in requests and bytes, reading paused while it is full,
replies as they finish, counts that balance, and everything cancelled when the call ends."""
from __future__ import annotations

import asyncio

from lumen_core.serve.streams import StreamWindow, windowed_replies


class _Counts:
    def __init__(self):
        self.requests = self.nbytes = self.peak_requests = self.peak_bytes = 0

    def admitted(self, n):
        self.requests += 1
        self.nbytes += n
        self.peak_requests = max(self.peak_requests, self.requests)
        self.peak_bytes = max(self.peak_bytes, self.nbytes)

    def answered(self, n):
        self.requests -= 1
        self.nbytes -= n


async def _source(msgs, read):
    for m in msgs:
        read.append(m)
        yield m


def _no_bytes(reply) -> int:
    """The size of a test's reply (an int): nothing against the byte budget."""
    return 0


def test_window_bounds_requests_and_bytes_and_every_reply_comes():
    async def main():
        counts, read, gate, first_gate = _Counts(), [], asyncio.Event(), asyncio.Event()

        async def handle(msg):
            await (gate if msg["id"] else first_gate).wait()
            return msg["id"]

        window = StreamWindow(max_requests=8, max_bytes=100)
        msgs = [{"id": i, "n": 30} for i in range(20)]  # 3 fit the byte budget at a time
        gen = windowed_replies(_source(msgs, read), window, lambda m: m["n"], handle,
                               counts.admitted, counts.answered, _no_bytes)
        pending = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.02)
        # until a first reply tells the size of replies, one request at a time
        assert counts.requests == 1 and len(read) == 2
        first_gate.set()
        first = await pending
        await asyncio.sleep(0.05)
        # 3 admitted (90 bytes: the first's room is free once the reader asks for the next
        # reply); the 4th was read and waits for room; nothing more is read
        assert counts.requests == 3 and len(read) == 4
        gate.set()
        got = [first] + [r async for r in gen]
        assert sorted(got) == list(range(20))
        assert counts.peak_bytes <= 100 and counts.peak_requests <= 3
        assert counts.requests == 0 and counts.nbytes == 0
        assert window.requests == 0 and window.nbytes == 0

    asyncio.run(main())


def test_a_message_larger_than_the_byte_budget_runs_alone():
    async def main():
        counts = _Counts()

        async def handle(msg):
            return msg["id"]

        window = StreamWindow(max_requests=8, max_bytes=10)
        msgs = [{"id": i, "n": 50} for i in range(5)]
        got = [r async for r in windowed_replies(_source(msgs, []), window, lambda m: m["n"],
                                                  handle, counts.admitted, counts.answered,
                                                  _no_bytes)]
        assert sorted(got) == list(range(5)) and counts.peak_requests == 1

    asyncio.run(main())


def test_closing_early_cancels_what_runs_and_leaves_the_unanswered_in_the_window():
    async def main():
        counts, started, cancelled = _Counts(), [], []

        async def handle(msg):
            started.append(msg["id"])
            if msg["id"] == 0:
                return 0
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.append(msg["id"])
                raise

        window = StreamWindow(max_requests=4, max_bytes=1 << 20)
        gen = windowed_replies(_source([{"id": i, "n": 1} for i in range(10)], []), window,
                               lambda m: m["n"], handle, counts.admitted, counts.answered,
                               _no_bytes)
        assert await gen.__anext__() == 0
        await asyncio.sleep(0.02)
        await gen.aclose()  # the caller went away
        await asyncio.sleep(0)
        assert sorted(cancelled) == sorted(i for i in started if i != 0) and cancelled
        # admitted and never answered: the caller takes these off its own counts
        assert window.requests == counts.requests == len(cancelled)

    asyncio.run(main())


def test_replies_waiting_for_a_slow_reader_are_held_within_the_byte_budget():
    """Issue 25: ``ModelStreamInfer`` with a reader slower than the model grew the server by
    270 MB: a window of 256 small requests whose 1 MiB replies all waited to be sent.  A
    reply ready and not yet handed on counts against the byte budget (and, until a request's
    own reply is ready, the largest reply seen so far stands for it), so a stream whose replies
    dwarf its requests is held to the budget too; nothing is read meanwhile."""
    async def main():
        counts, read = _Counts(), []

        async def handle(msg):
            return b"r" * msg["reply"]

        window = StreamWindow(max_requests=64, max_bytes=100)
        msgs = [{"id": i, "n": 1, "reply": 30} for i in range(40)]
        gen = windowed_replies(_source(msgs, read), window, lambda m: m["n"], handle,
                               counts.admitted, counts.answered, reply_size=len)
        got = [await gen.__anext__()]  # the reader takes one reply, then is slow
        await asyncio.sleep(0.05)
        assert window.nbytes + window.reply_bytes <= window.max_bytes
        assert len(read) <= 5 and counts.requests <= 4  # not the 40 the count would allow
        got += [r async for r in gen]
        assert got == [b"r" * 30] * 40
        assert window.requests == window.nbytes == window.reply_bytes == 0
        assert counts.requests == counts.nbytes == 0

    asyncio.run(main())


def test_a_message_waits_for_room_in_its_queue_and_nothing_more_is_read():
    """Issue 38 row 4: the stream window (256) was larger than a task's queue, so a fast
    stream's chunks past the queue were refused mid-sequence.  ``room(msg)`` now holds a
    message until its task has room (QUEUE_FULL), and while one is held nothing more is read;
    a message whose sequence waits for a slot (AWAITING_SLOT) is held likewise.  Every
    message is handled, in order, and only when it had room."""
    from lumen_core.serve import streams as st

    async def main():
        counts, read = _Counts(), []
        state = {"room": st.QUEUE_FULL}
        handled = []

        def room(msg):
            return state["room"]

        async def handle(msg):
            assert state["room"] == st.ROOM  # admitted only with room
            handled.append(msg)
            return msg

        window = StreamWindow(max_requests=256, max_bytes=1 << 30)
        gen = windowed_replies(_source(list(range(50)), read), window, lambda m: 1, handle,
                               counts.admitted, counts.answered, _no_bytes, room=room)
        pending = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.05)
        assert handled == [] and len(read) == 1  # held: the window's 256 do not matter
        state["room"] = st.AWAITING_SLOT
        await asyncio.sleep(0.05)
        assert handled == [] and len(read) == 1
        state["room"] = st.ROOM
        got = [await pending] + [r async for r in gen]
        return got, handled, counts

    got, handled, counts = asyncio.run(main())
    assert sorted(got) == handled == list(range(50))
    assert counts.requests == counts.nbytes == 0


def test_a_stream_stops_waiting_for_a_slot_after_a_bound(monkeypatch):
    """A message whose sequence waits for a slot is admitted after STREAM_SLOT_WAIT_S (a
    stream whose own sequences hold every slot must not wait for itself); a full queue
    holds it for as long as it is full."""
    from lumen_core.serve import streams as st

    monkeypatch.setattr(st, "STREAM_SLOT_WAIT_S", 0.05)

    async def main():
        counts, read = _Counts(), []

        async def handle(msg):
            return msg

        gen = windowed_replies(_source([1, 2], read), StreamWindow(8, 1 << 20), lambda m: 1,
                               handle, counts.admitted, counts.answered, _no_bytes,
                               room=lambda m: st.AWAITING_SLOT)
        return [r async for r in gen]

    assert sorted(asyncio.run(asyncio.wait_for(main(), 10))) == [1, 2]
