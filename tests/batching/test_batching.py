"""Dynamic batcher policy tests with fake workers (deterministic: gates, not sleeps).

Nothing here asserts an absolute time; "on time" is checked by ordering (the deadline error
arrives while the batch is provably still running).
"""
from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from lumen_core.batching.dynamic import DynamicBatcher, run_split
from lumen_core.config import BatchingConfig
from lumen_core.errors import Cancelled, DeadlineExceeded, InternalError, Overloaded, Unavailable


class Item:
    __slots__ = ("signature", "value")

    def __init__(self, value, signature="s"):
        self.value = value
        self.signature = signature


class FakeWorker:
    """Doubles values; ``gate`` (threading.Event) blocks every run until set; values in
    ``fail`` make the whole batch raise, like a model that chokes on one input."""

    def __init__(self, gate: threading.Event | None = None, fail=()):
        self.executor = ThreadPoolExecutor(1)
        self.gate = gate
        self.fail = set(fail)
        self.batches: list = []
        self.started = threading.Event()

    def execute(self, items):
        self.batches.append([(it.signature, it.value) for it in items])
        self.started.set()
        if self.gate is not None:
            self.gate.wait(10)
        if any(it.value in self.fail for it in items):
            raise RuntimeError("model failed")
        return [it.value * 2 for it in items]

    def seen(self):
        return [v for b in self.batches for _, v in b]


def cfg(**kw) -> BatchingConfig:
    kw.setdefault("max_queue_delay_us", 0)
    return BatchingConfig(**kw)


async def wait_started(worker: FakeWorker):
    await asyncio.to_thread(worker.started.wait, 10)


def test_thousand_concurrent_callers_get_their_own_result():
    async def main():
        workers = [FakeWorker(), FakeWorker()]
        b = DynamicBatcher("t", cfg(max_batch_size=16, max_queue_size=2000), workers)
        res = await asyncio.gather(*[b.infer(Item(i)) for i in range(1000)])
        assert [r.value for r in res] == [2 * i for i in range(1000)]
        sizes = [len(x) for w in workers for x in w.batches]
        assert max(sizes) <= 16 and sum(sizes) == 1000
        assert max(sizes) > 1  # batches grew under load
    asyncio.run(main())


def test_queue_full_is_refused_at_once():
    async def main():
        gate = threading.Event()
        w = FakeWorker(gate)
        b = DynamicBatcher("t", cfg(max_batch_size=1, max_queue_size=3), [w])
        running = asyncio.ensure_future(b.infer(Item(0)))
        await wait_started(w)
        queued = [asyncio.ensure_future(b.infer(Item(i))) for i in (1, 2, 3)]
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as ei:
            b.submit(Item(4))
        assert ei.value.code == "resource_exhausted" and ei.value.retry_after_s >= 1
        gate.set()
        assert [r.value for r in await asyncio.gather(running, *queued)] == [0, 2, 4, 6]
    asyncio.run(main())


def test_deadline_fires_while_batch_is_running():
    async def main():
        gate = threading.Event()
        w = FakeWorker(gate)
        b = DynamicBatcher("t", cfg(max_batch_size=4), [w])
        fut = asyncio.ensure_future(b.infer(Item(1), timeout_ms=30))
        with pytest.raises(DeadlineExceeded) as ei:
            await fut
        assert not gate.is_set() and w.started.is_set()  # the batch was still running
        assert ei.value.field == "lumen.timeout_ms" and "running" in ei.value.message
        gate.set()
        await b.drain()
    asyncio.run(main())


def test_expired_request_never_reaches_the_model():
    async def main():
        gate = threading.Event()
        w = FakeWorker(gate)
        b = DynamicBatcher("t", cfg(max_batch_size=1), [w])
        first = asyncio.ensure_future(b.infer(Item(0)))
        await wait_started(w)
        with pytest.raises(DeadlineExceeded):
            await b.infer(Item(99), timeout_ms=20)
        assert b.pending == 0
        gate.set()
        await first
        await b.drain()
        assert 99 not in w.seen()
    asyncio.run(main())


def test_cancelled_caller_is_removed_from_the_queue():
    async def main():
        gate = threading.Event()
        w = FakeWorker(gate)
        b = DynamicBatcher("t", cfg(max_batch_size=1), [w])
        first = asyncio.ensure_future(b.infer(Item(0)))
        await wait_started(w)
        victim = asyncio.ensure_future(b.infer(Item(77)))
        keep = asyncio.ensure_future(b.infer(Item(5)))
        await asyncio.sleep(0)
        assert b.pending == 2
        victim.cancel()
        with pytest.raises(asyncio.CancelledError):
            await victim
        assert b.pending == 1
        gate.set()
        assert (await keep).value == 10
        await first
        assert 77 not in w.seen()
    asyncio.run(main())


def test_cancel_entry_directly_reports_cancelled():
    async def main():
        gate = threading.Event()
        w = FakeWorker(gate)
        b = DynamicBatcher("t", cfg(max_batch_size=1), [w])
        first = asyncio.ensure_future(b.infer(Item(0)))
        await wait_started(w)
        entry = b.submit(Item(3))
        b.cancel(entry)
        with pytest.raises(Cancelled):
            await entry.waiter
        gate.set()
        await first
        assert 3 not in w.seen()
    asyncio.run(main())


def test_priority_order():
    async def main():
        gate = threading.Event()
        w = FakeWorker(gate)
        b = DynamicBatcher("t", cfg(max_batch_size=1, priority_levels=3), [w])
        first = asyncio.ensure_future(b.infer(Item(0)))
        await wait_started(w)
        futs = [asyncio.ensure_future(b.infer(Item(v), priority=p))
                for v, p in ((30, 3), (31, 3), (20, 2), (10, 1), (11, 1))]
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(first, *futs)
        assert w.seen() == [0, 10, 11, 20, 30, 31]
    asyncio.run(main())


def test_full_low_priority_batch_never_jumps_a_later_high_priority_request():
    # worker-side formation: the worker picks its next batch the moment it finishes one, so
    # a high-priority request that arrived after a whole low-priority batch still goes first
    async def main():
        gate = threading.Event()
        w = FakeWorker(gate)
        b = DynamicBatcher("t", cfg(max_batch_size=4, priority_levels=2), [w])
        first = asyncio.ensure_future(b.infer(Item(0), priority=2))
        await wait_started(w)
        low = [asyncio.ensure_future(b.infer(Item(v), priority=2)) for v in range(1, 9)]
        await asyncio.sleep(0)
        high = asyncio.ensure_future(b.infer(Item(100), priority=1))
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(first, high, *low)
        # the high-priority request leads the next batch, which fills up in FIFO order
        assert [[v for _, v in batch] for batch in w.batches] == [[0], [100, 1, 2, 3],
                                                                   [4, 5, 6, 7], [8]]
    asyncio.run(main())


def test_priority_order_holds_with_many_callers_and_a_busy_worker():
    async def main():
        gate = threading.Event()
        w = FakeWorker(gate)
        b = DynamicBatcher("t", cfg(max_batch_size=4, priority_levels=3, max_queue_size=500), [w])
        first = asyncio.ensure_future(b.infer(Item(-1)))
        await wait_started(w)
        import random

        rng = random.Random(4)
        prios = [rng.randint(1, 3) for _ in range(200)]
        futs = [asyncio.ensure_future(b.infer(Item(i), priority=p)) for i, p in enumerate(prios)]
        await asyncio.sleep(0)
        gate.set()
        res = await asyncio.gather(first, *futs)
        assert [r.value for r in res[1:]] == [2 * i for i in range(200)]
        seen = w.seen()[1:]
        assert seen == sorted(range(200), key=lambda i: (prios[i], i))
    asyncio.run(main())


def test_preferred_batch_sizes():
    async def main():
        gate = threading.Event()
        w = FakeWorker(gate)
        b = DynamicBatcher("t", cfg(max_batch_size=8, preferred_batch_sizes=(4,)), [w])
        first = asyncio.ensure_future(b.infer(Item(0)))
        await wait_started(w)
        futs = [asyncio.ensure_future(b.infer(Item(i))) for i in range(1, 7)]
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(first, *futs)
        assert [len(x) for x in w.batches] == [1, 4, 2]
    asyncio.run(main())


def test_max_batch_size_caps_batches():
    async def main():
        gate = threading.Event()
        w = FakeWorker(gate)
        b = DynamicBatcher("t", cfg(max_batch_size=5), [w])
        first = asyncio.ensure_future(b.infer(Item(0)))
        await wait_started(w)
        futs = [asyncio.ensure_future(b.infer(Item(i))) for i in range(1, 13)]
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(first, *futs)
        assert [len(x) for x in w.batches] == [1, 5, 5, 2]
    asyncio.run(main())


def test_lone_request_runs_at_once_without_delay():
    async def main():
        w = FakeWorker()
        b = DynamicBatcher("t", cfg(max_batch_size=32, max_queue_delay_us=0), [w])
        r = await b.infer(Item(4))
        assert r.value == 8 and r.batch_size == 1
    asyncio.run(main())


def test_queue_delay_collects_a_batch_and_bounds_the_wait():
    async def main():
        w = FakeWorker()
        delay_us = 50_000
        b = DynamicBatcher("t", cfg(max_batch_size=32, max_queue_delay_us=delay_us), [w])
        first = asyncio.ensure_future(b.infer(Item(1)))
        await asyncio.sleep(0.005)
        second = asyncio.ensure_future(b.infer(Item(2)))
        r1, r2 = await asyncio.gather(first, second)
        assert w.batches == [[("s", 1), ("s", 2)]]  # waited for company, within the delay
        assert r1.batch_size == 2
        assert r1.queue_us >= delay_us * 0.9  # held until the delay expired, not longer than needed
        # a lone request under light load is dispatched when its delay expires
        r3 = await b.infer(Item(3))
        assert r3.batch_size == 1 and r3.queue_us >= delay_us * 0.9
    asyncio.run(main())


def test_full_batch_does_not_wait_for_the_delay():
    async def main():
        w = FakeWorker()
        b = DynamicBatcher("t", cfg(max_batch_size=4, max_queue_delay_us=10_000_000), [w])
        res = await asyncio.wait_for(asyncio.gather(*[b.infer(Item(i)) for i in range(4)]), 5)
        assert [r.batch_size for r in res] == [4] * 4
    asyncio.run(main())


def test_signatures_never_mix():
    async def main():
        workers = [FakeWorker(), FakeWorker()]
        b = DynamicBatcher("t", cfg(max_batch_size=8, max_queue_size=1000), workers)
        items = [Item(i, signature=("sig", i % 3)) for i in range(300)]
        res = await asyncio.gather(*[b.infer(it) for it in items])
        assert [r.value for r in res] == [2 * i for i in range(300)]
        for w in workers:
            for batch in w.batches:
                assert len({sig for sig, _ in batch}) == 1
    asyncio.run(main())


def test_failing_item_fails_alone_after_split():
    async def main():
        gate = threading.Event()
        w = FakeWorker(gate, fail={13})
        b = DynamicBatcher("t", cfg(max_batch_size=8), [w])
        first = asyncio.ensure_future(b.infer(Item(0)))
        await wait_started(w)
        futs = [asyncio.ensure_future(b.infer(Item(i))) for i in range(10, 18)]
        await asyncio.sleep(0)
        gate.set()
        res = await asyncio.gather(first, *futs, return_exceptions=True)
        for i, r in zip([0] + list(range(10, 18)), res, strict=True):
            if i == 13:
                assert isinstance(r, InternalError) and "model failed" in r.message
            else:
                assert r.value == 2 * i
    asyncio.run(main())


def test_run_split_isolates_every_bad_item():
    calls = []

    def execute(items):
        calls.append(len(items))
        if any(v < 0 for v in items):
            raise ValueError("negative")
        return [v + 1 for v in items]

    out = run_split(execute, [1, -2, 3, 4, -5, 6, 7, 8])
    assert [o if isinstance(o, int) else "err" for o in out] == [2, "err", 4, 5, "err", 7, 8, 9]
    assert all(isinstance(o, InternalError) for o in (out[1], out[4]))


def test_drain_finishes_in_flight_then_refuses():
    async def main():
        gate = threading.Event()
        w = FakeWorker(gate)
        b = DynamicBatcher("t", cfg(max_batch_size=2), [w])
        futs = [asyncio.ensure_future(b.infer(Item(i))) for i in range(5)]
        await wait_started(w)
        drain = asyncio.ensure_future(b.drain())
        await asyncio.sleep(0.01)
        assert not drain.done()
        with pytest.raises(Unavailable):
            b.submit(Item(9))
        gate.set()
        await drain
        assert [r.value for r in await asyncio.gather(*futs)] == [0, 2, 4, 6, 8]
    asyncio.run(main())


def test_worker_returning_wrong_count_is_an_internal_error_not_a_hang():
    class Broken(FakeWorker):
        def execute(self, items):
            return []

    async def main():
        b = DynamicBatcher("t", cfg(max_batch_size=4), [Broken()])
        with pytest.raises(InternalError):
            await asyncio.wait_for(b.infer(Item(1)), 5)
    asyncio.run(main())


def test_request_past_its_deadline_never_runs_even_when_its_timer_is_late():
    # the worker forms batches in its own thread: a request whose deadline passed while the
    # loop was too busy to fire its timer must still be refused at formation, never run
    async def main():
        gate = threading.Event()
        w = FakeWorker(gate)
        b = DynamicBatcher("t", cfg(max_batch_size=4), [w])
        first = asyncio.ensure_future(b.infer(Item(0)))
        await wait_started(w)
        victim = asyncio.ensure_future(b.infer(Item(42), timeout_ms=1))
        keep = asyncio.ensure_future(b.infer(Item(7)))
        await asyncio.sleep(0)  # both queued behind the running batch
        time.sleep(0.02)  # the loop is busy: the 1 ms timer cannot fire
        w.started.clear()
        gate.set()
        await asyncio.to_thread(w.started.wait, 10)  # the worker formed and ran the next batch
        with pytest.raises(DeadlineExceeded, match="in the queue"):
            await victim
        assert (await keep).value == 14 and (await first).value == 0
        await b.drain()
        assert w.seen() == [0, 7]
    asyncio.run(main())


def test_concurrent_drains_all_return():
    # two shutdown paths (e.g. a server's lifespan and an explicit stop) may drain at once;
    # each must wake when the work is done, not only the last one to start waiting
    async def main():
        gate = threading.Event()
        w = FakeWorker(gate)
        b = DynamicBatcher("t", cfg(max_batch_size=1), [w])
        futs = [asyncio.ensure_future(b.infer(Item(i))) for i in range(3)]
        await wait_started(w)
        first = asyncio.ensure_future(b.drain())
        await asyncio.sleep(0)
        second = asyncio.ensure_future(b.drain())
        await asyncio.sleep(0)
        gate.set()
        await asyncio.wait_for(asyncio.gather(first, second), 5)
        assert [r.value for r in await asyncio.gather(*futs)] == [0, 2, 4]
    asyncio.run(main())


def test_a_failing_batch_observer_does_not_strand_callers():
    def observer(n, us):
        raise RuntimeError("metrics bug")

    async def main():
        b = DynamicBatcher("t", cfg(max_batch_size=4), [FakeWorker()], on_batch=observer)
        res = await asyncio.wait_for(asyncio.gather(*[b.infer(Item(i)) for i in range(6)]), 5)
        assert [r.value for r in res] == [0, 2, 4, 6, 8, 10]
    asyncio.run(main())


def test_close_without_drain_answers_queued_requests_and_groups_are_atomic():
    async def main():
        b = DynamicBatcher("t", cfg(max_batch_size=4, max_queue_delay_us=10_000_000), [FakeWorker()])
        e = b.submit(Item(1))
        with pytest.raises(ValueError, match="priorities"):
            b.submit_many([(Item(2), None, 1, 0), (Item(3), None, 9, 0)])  # nothing queued
        assert b.pending == 1
        group, entries = b.submit_many([])
        assert group.future.done() and entries == []
        await b.close()
        with pytest.raises(Unavailable):
            await e.waiter
        assert b.pending == 0
    asyncio.run(main())
