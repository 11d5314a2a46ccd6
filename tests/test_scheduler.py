"""The request path's typed homes on both twins (``lumen_core.request_path.entries`` / ``scheduler`` /
``messages`` and the compiled ``lumen_core.request_path._entries`` / ``_scheduler`` / ``_messages``, one
source each): entries, answering, batch rows, admission with its deadline heap, the
dispatcher's infer and infer_many."""
from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

import lumen_core as lc
from lumen_core import native
from lumen_core.batching.cost import CostModel
from lumen_core.errors import Overloaded, Unavailable


def test_answer_settles_a_future_once(entries):
    async def main():
        loop = asyncio.get_running_loop()
        e = entries.Entry("item", loop.create_future(), 1, 10)
        assert e.state == entries.QUEUED and e.outcome is entries.UNSET and e.queue_us == 0
        entries.answer(e, {"y": 1})
        entries.answer(e, lc.InternalError("late"))  # dropped: answered already
        assert e.state == entries.DONE and await e.waiter == {"y": 1}
        err = entries.Entry("item", loop.create_future(), 1, 10)
        entries.answer(err, lc.InvalidArgument("bad", "payload"))
        with pytest.raises(lc.InvalidArgument):
            await err.waiter
    asyncio.run(main())


def test_deliver_skips_answered_entries_and_counts_groups(entries):
    async def main():
        loop = asyncio.get_running_loop()
        group = entries.Group(loop.create_future(), 3)
        es = [entries.Entry(i, group, 1, 0) for i in range(3)]
        for e in es:
            e.state = entries.RUNNING
            e.dispatch_ns = 5_000
        entries.answer(es[1], lc.DeadlineExceeded("late", "lumen.timeout_ms"))
        entries.deliver(es, [10, 11, 12], 42)
        await asyncio.wait_for(group.future, 1)
        assert [e.outcome for e in (es[0], es[2])] == [10, 12]
        assert isinstance(es[1].outcome, lc.DeadlineExceeded) and es[1].batch_size == 0
        assert es[0].batch_size == 3 and es[0].compute_us == 42 and es[0].queue_us == 5
    asyncio.run(main())


def test_rows_split_once_and_deliver_a_row_each(messages, entries):
    async def main():
        loop = asyncio.get_running_loop()
        es = [entries.Entry(i, loop.create_future(), 1, 0) for i in range(3)]
        y = np.arange(6).reshape(3, 2)
        rows = entries.Rows({"y": y, "p": np.arange(3.0)}, 3)
        assert len(rows) == 3 and rows.row(2)["y"].tolist() == [4, 5]
        # rows are views of the batch's arrays (never copies); a 1-D output gives 0-d views
        assert np.shares_memory(rows.row(1)["y"], y) and rows.row(1)["p"].shape == ()
        entries.answer(es[0], lc.Cancelled("gone"))
        entries.deliver(es, rows, 7)
        assert [e.row for e in es] == [-1, 1, 2] and es[1].outcome is rows
        assert es[2].result()["y"].tolist() == [4, 5] and es[2].batch_size == 3
        # the response holds the rows and its row; outputs are split out on first read
        req = messages.InferRequest("t", b"", "", {}, "cid-1")
        resp = messages.respond(req, rows, 1, 3, 10, 7, 0, "2")
        assert resp.outputs["y"].tolist() == [2, 3] and resp.correlation_id == "cid-1"
        assert resp.meta == {"lumen.batch.size": "3", "lumen.queue_us": "10",
                             "lumen.compute_us": "7", "lumen.model.version": "2"}
        assert resp.stats.batch_size == 3 and resp.stats.version == "2"
    asyncio.run(main())


def test_route_of_reads_the_claimed_route(routes):
    assert routes.route_of({"lumen.input.kind": "tensor"}) == "tensor"
    assert routes.route_of({}) == routes.route_of(None) == "raw"
    assert routes.route_of({"lumen.input.kind": ["tensor"]}) == "raw"  # not yet validated


def test_correlation_ids_are_made_when_read(messages):
    req = messages.InferRequest("t", b"x")
    resp = messages.respond(req, {"y": 1}, -1, 1, 0, 0, 0, "")
    cid = resp.correlation_id  # generated now, once, and shared with the request
    assert len(cid) == 32 and req.correlation_id == cid and resp.correlation_id == cid
    assert messages.InferRequest("t", b"x", "", None, "mine").correlation_id == "mine"
    assert messages.InferResponse("c", "t", {"y": 1}).stats is None


class _Item:
    __slots__ = ("signature", "length")

    def __init__(self, sig="s"):
        self.signature = sig
        self.length = 0


def _batcher(scheduler, levels=1, max_queue_size=4, delay_ns=0, ready_live=1):
    """A Batcher of one twin over its AdmissionQueue, whose "worker" answers what is queued on
    the next loop turn (every entry with its row of one batch), or never when ``hold`` is
    set."""
    twin = (native.compiled("latency") if scheduler.__name__.endswith("._scheduler") else native.pure("latency"))
    guard = twin.LatencyGuard("t", CostModel())

    class Inline(scheduler.Batcher):
        hold = False

        def start(self, loop=None):
            self.queue.bind(loop or asyncio.get_running_loop())

        def submit(self, item, desc=None, priority=1, timeout_ms=0):
            e = super().submit(item, desc, priority, timeout_ms)
            if not self.hold:
                self.queue.loop.call_soon(self.run)
            return e

        def submit_many(self, specs):
            out = super().submit_many(specs)
            if not self.hold:
                self.queue.loop.call_soon(self.run)
            return out

        def run(self):
            q = self.queue
            with q.lock:
                now = time.monotonic_ns()
                batch = [e for sq in q.queues.values() for e in sq.take(64, now, q)]
                q.pending -= len(batch)
                q.running += 1
            if batch:
                xs = np.array([e.item.x for e in batch], np.float32)
                q.deliver_batch(batch, scheduler._ent.Rows(
                    {"y": xs * 2}, len(batch)), 5)
            else:
                with q.lock:
                    q.running -= 1

    queue = scheduler.AdmissionQueue("t", max_queue_size, guard, levels, delay_ns, ready_live)
    return Inline("t", queue, guard)


def test_admission_refuses_at_once_and_keeps_one_deadline_timer(scheduler):
    async def main():
        b = _batcher(scheduler, max_queue_size=2)
        b.hold = True
        e1 = b.submit(_Item(), None, 1, 0)
        e2 = b.submit(_Item("other"), None, 1, 50)
        assert b.queue.pending == 2 and len(b.queue.queues) == 2 and b.queue.deadlines.timer is not None
        with pytest.raises(Overloaded):
            b.submit(_Item(), None, 1, 0)
        with pytest.raises(lc.InvalidArgument, match="max_queue_size"):
            b.submit_many([(_Item(), None, 1, 0)] * 3)  # larger than the whole queue
        first = b.queue.deadlines.timer
        e3 = None
        b.cancel(e1)  # leaves the count at once
        e3 = b.submit(_Item(), None, 1, 10)  # an earlier deadline re-arms the one timer
        assert b.queue.deadlines.timer is not first and len(b.queue.deadlines) == 2
        with pytest.raises(lc.DeadlineExceeded, match="10 ms expired in the queue"):
            await e3.waiter
        with pytest.raises(lc.DeadlineExceeded, match="50 ms"):
            await e2.waiter
        with pytest.raises(lc.Cancelled):
            await e1.waiter
        assert b.queue.pending == 0 and b.queue.deadlines.timer is None
        b.queue.closed = True
        with pytest.raises(Unavailable):
            b.submit(_Item(), None, 1, 0)
    asyncio.run(main())


def test_deadline_heap_drops_answered_entries(scheduler):
    async def main():
        b = _batcher(scheduler, max_queue_size=10_000)
        b.hold = True
        for _ in range(scheduler.DEADLINE_COMPACT_MIN * 3):
            e = b.submit(_Item(), None, 1, 60_000)
            b.cancel(e)
        # answered entries leave the heap when it is rebuilt: it stays within a bound
        assert len(b.queue.deadlines) < scheduler.DEADLINE_COMPACT_MIN + 2
        b.queue.stop_timer()
    asyncio.run(main())


class _X:
    __slots__ = ("signature", "length", "x")

    def __init__(self, x):
        self.signature = "s"
        self.length = 0
        self.x = x


def test_dispatcher_infer_and_infer_many_end_to_end(impl):
    scheduler, dispatch = impl.scheduler, impl.dispatch
    class Backend:
        contract = lc.TensorContract()
        stateful = prepare_off_loop = accepts_text = False
        inline_prepare_max_bytes = 1 << 20

        def prepare(self, req, desc, payload):
            if bytes(payload) == b"boom":
                raise RuntimeError("a backend bug")
            return _X(float(len(payload)))

    async def main():
        d = dispatch.Dispatcher(1024, None)
        route = impl.routes.Route("t", "3", Backend(), _batcher(scheduler, max_queue_size=64))
        d.routes = {"t": route}
        d.ready = True
        resp = await d.infer(lc.InferRequest("t", b"abc"))
        assert resp.outputs["y"].tolist() == 6.0 and resp.meta["lumen.model.version"] == "3"
        out = await d.infer_many([lc.InferRequest("t", b"ab"), lc.InferRequest("nope", b""),
                                  lc.InferRequest("t", b"boom"), "not a request",
                                  lc.InferRequest("t", b"x" * 2000)])
        assert out[0].outputs["y"] == 4.0 and out[0].stats.batch_size == 1
        assert isinstance(out[1], lc.TaskNotFound) and isinstance(out[2], lc.InternalError)
        assert isinstance(out[3], lc.InvalidArgument) and out[3].field == "requests"
        assert isinstance(out[4], lc.PayloadTooLarge)
        with pytest.raises(lc.TaskNotFound):
            await d.infer(lc.InferRequest("nope", b""))
        with pytest.raises(lc.InvalidArgument, match="C-contiguous"):
            await d.infer(lc.InferRequest("t", np.zeros((4, 4))[:, ::2]))
        d.closing = True
        with pytest.raises(Unavailable):
            await d.infer(lc.InferRequest("t", b"abc"))
        assert route.holds == 0
    asyncio.run(main())


def test_check_room_names_why_a_request_cannot_be_admitted(scheduler):
    """The admission errors every batcher raises (its AdmissionQueue, or an ensemble's own
    count): closed, a group past the whole queue, a full queue; room: nothing raised."""
    scheduler.check_room("t", False, 3, 1, 4)
    with pytest.raises(Unavailable, match="'t' is shutting down"):
        scheduler.check_room("t", True, 0, 1, 4)
    with pytest.raises(lc.InvalidArgument, match="max_queue_size = 4"):
        scheduler.check_room("t", False, 0, 5, 4)
    with pytest.raises(Overloaded, match=r"queue is full \(4 pending\)") as err:
        scheduler.check_room("t", False, 4, 1, 4)
    assert err.value.retry_after_s == 1


def test_a_group_larger_than_the_queue_is_a_400_naming_the_limit(scheduler):
    err = scheduler.group_too_large("t", 12, 8)
    assert isinstance(err, lc.InvalidArgument) and err.field == "input"
    assert "12 inputs" in err.message and "max_queue_size = 8" in err.message


def test_text_prep_takes_only_plain_short_text(routes):
    class Enc:
        def __init__(self, text):
            self.ids = [101] + [ord(c) for c in text] + [102]

    prep = routes.TextPrep(Enc, "sig", 6, 10, frozenset({"text/plain"}))
    item = prep.prepare(lc.InferRequest("t", "abc", "text/plain"), "abc")
    assert item.length == 5 and item.signature == "sig" and item.tensors[0].dtype == np.int64
    assert prep.prepare(lc.InferRequest("t", b"ab", "text/plain"), memoryview(b"ab")).length == 4
    for req, payload in ((lc.InferRequest("t", "abc", "text/html"), "abc"),  # other mime
                         (lc.InferRequest("t", "abc", ["text/plain"]), "abc"),  # not hashable
                         (lc.InferRequest("t", "abc", "text/plain", {"k": "v"}), "abc"),
                         (lc.InferRequest("t", "abcdefg", "text/plain"), "abcdefg"),  # > 6 ids
                         (lc.InferRequest("t", "", "text/plain"), ""),
                         (lc.InferRequest("t", b"\xff", "text/plain"), memoryview(b"\xff"))):
        assert prep.prepare(req, payload) is None  # the backend's to prepare (or refuse)
