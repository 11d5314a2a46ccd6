"""The batcher as parts it owns (issue 40 item 1): the dispatcher's ``Batcher`` interface, the
admission queue with its deadline heap, the latency guard, formation and loop execution; an
ensemble that implements the interface without a queue; entries that carry only what every
owner needs.  The parts are exercised on both twins (the ``scheduler`` / ``latency`` /
``entries`` fixtures) where they are compiled."""
from __future__ import annotations

import asyncio
import time

import pytest
from test_batching import FakeWorker, Item, cfg

from lumen_core import native
from lumen_core.batching.cost import CostModel
from lumen_core.batching.dynamic import DynamicBatcher, Formation
from lumen_core.batching.lanes import LiveSequence, SequenceEntry
from lumen_core.batching.loop import LoopExecution
from lumen_core.batching.pipeline import Pipeline, Step, StepSpec
from lumen_core.batching.policy import QueuePolicy
from lumen_core.errors import Overloaded


def test_a_dynamic_batcher_owns_its_parts():
    b = DynamicBatcher("t", cfg(max_batch_size=4, latency_target_ms=50), [FakeWorker()])
    s = native.scheduler
    assert isinstance(b, s.Batcher) and isinstance(b, QueuePolicy)
    assert type(b.queue) is s.AdmissionQueue and type(b.guard) is native.latency.LatencyGuard
    assert b.queue.guard is b.guard  # the queue asks the batcher's own guard
    assert type(b.queue.deadlines) is s.DeadlineHeap
    assert isinstance(b.formation, Formation) and b.formation.queue is b.queue
    assert isinstance(b.execution, LoopExecution) and b.execution.turn is not None
    assert b.execution.turn.b is b and not b.execution.loop_runs  # lent only once judged
    two = DynamicBatcher("t2", cfg(), [FakeWorker(), FakeWorker()])
    assert two.execution.turn is None and two.execution.loop_ns == 0  # two instances: off
    assert b.guard.target_ns == 50_000_000 and b.queue_limit() == b.queue.max_queue_size
    # an ensemble's step refuses nothing itself (its requests were admitted already), yet
    # formation still sizes its batches to the target
    step = DynamicBatcher("s", cfg(latency_target_ms=50), [FakeWorker()], refuse=False)
    assert step.guard.target_ns == 0 and step.formation.target_ns == 50_000_000


def test_a_pipeline_is_a_batcher_without_a_queue():
    async def flow(ctx, item):
        (out,) = await ctx.run("double", [item])
        return out

    step = Step(StepSpec("double", None, lambda o, i: o),
                DynamicBatcher("p.double", cfg(), [FakeWorker()]))
    p = Pipeline("p", cfg(max_queue_size=2), [step], flow)
    assert isinstance(p, native.scheduler.Batcher) and not isinstance(p, QueuePolicy)
    assert p.queue is None and p.guard is None and p.queue_limit() == 2

    async def main():
        e = p.submit(Item(3), None, 1, 0)
        assert p.pending == 1
        assert await e.waiter == 6
        assert p.pending == 0
        p.refuse_late(1, 0)  # no latency guard: nothing to refuse
        group, entries = p.submit_many([(Item(1), None, 1, 0), (Item(2), None, 1, 0)])
        with pytest.raises(Overloaded, match="queue is full"):
            p.submit(Item(5), None, 1, 0)  # two flows run: the queue limit holds
        await group.future
        assert [x.outcome for x in entries] == [2, 4]
        await p.drain()
        await p.close()

    asyncio.run(main())


def test_the_deadline_heap_expires_each_due_entry_once_then_calls_after(scheduler):
    """One timer for the earliest deadline; ``expire`` per unanswered due entry, ``after``
    once per timer that expired any; answered entries are skipped."""
    entries = scheduler._ent  # the twin it was built against

    async def main():
        loop = asyncio.get_running_loop()
        expired, after = [], []

        def expire(e):
            expired.append(e)
            entries.answer(e, "late")

        heap = scheduler.DeadlineHeap(expire, lambda: after.append(1))
        heap.loop = loop
        now = time.monotonic_ns()
        es = [entries.Entry(i, loop.create_future(), 1, now, None, now + ms * 1_000_000)
              for i, ms in enumerate((30, 10, 20))]
        for e in es:
            heap.arm(e)
        assert len(heap) == 3 and heap.timer is not None
        entries.answer(es[2], "done early")  # leaves the heap lazily, never expired
        await asyncio.sleep(0.08)
        assert [e.item for e in expired] == [1, 0] and len(after) >= 1
        assert heap.timer is None and len(heap) == 0
        heap.stop()

    asyncio.run(main())


def test_the_latency_guard_predicts_checks_and_probes(latency):
    g = latency.LatencyGuard("t", CostModel(), 10_000_000)
    assert not g.cost_ready and g.headroom == 1.0
    for _ in range(8):  # 1 ms a batch + 1 ms an item, batches of 2
        assert g.learn(2, 0, 3000.0) in (False, True)
    assert g.cost_ready
    g.sized(2)
    assert g.cost_batch == 2
    fixed, item = g.cost_fixed_ns, g.cost_item_ns
    assert fixed + 2 * item == pytest.approx(3e6, rel=0.02)  # what it learnt
    # 5th in line: two whole batches ahead, then its own of one
    assert g.predicted_ns(5, 0, 0, 0) == pytest.approx(2 * (fixed + 2 * item) + fixed + item,
                                                       abs=2)
    # running batches add half their time
    assert g.predicted_ns(1, 0, 1, 2) > g.predicted_ns(1, 0, 0, 0)

    class Queue:  # the queue's count of higher-priority requests (asked only then)
        def queued_up_to(self, priority):
            return 0

    g.check(1, 0, 1, 0, 0, 3, 0, 0, 0, 1, Queue())  # 4th: 2 x 3 ms ahead... + own: fits
    with pytest.raises(Overloaded, match="latency target of 10 ms") as err:
        g.check(1, 0, 1, 0, 0, 20, 0, 0, 0, 1, Queue())
    assert err.value.retry_after_s >= 1
    # a higher priority counts only the requests of its level or above
    g.check(1, 0, 1, 0, 0, 20, 0, 0, 0, 2, Queue())
    # the budget shrinks when answers run late, and the guard asks its owner to resize
    assert g.steer(9_000_000) is True and g.headroom < 1.0
    assert g.budget_now(0, 1) == g.budget_ns  # no recovery while a batch runs


def test_entries_carry_only_what_every_owner_needs(entries):
    e = entries.Entry("x", None, 1, 0)
    for owned_elsewhere in ("seq", "start", "end", "was_open", "span"):
        assert not hasattr(e, owned_elsewhere)
    assert e.route is None and e.t0 == 0  # the dispatcher's: read on every answer


def test_a_sequence_entry_keeps_the_sequence_batchers_bookkeeping():
    seq = LiveSequence("s1", "s1", 0)
    e = SequenceEntry("item", None, 5, seq, True, False, False)
    assert isinstance(e, native.entries.Entry)
    assert (e.seq, e.start, e.end, e.was_open, e.priority, e.arrival_ns) == (
        seq, True, False, False, 1, 5)


def test_lane_formation_takes_one_request_per_ready_sequence_of_one_signature():
    """The sequence batcher's formation strategy on its own: a free lane's ready sequences
    run together, one request each, oldest first; once two signatures were seen, a batch
    takes one of them."""
    from lumen_core.batching.lanes import Lane, LaneFormation

    guard = native.latency.LatencyGuard("t", CostModel())
    queue = native.scheduler.AdmissionQueue("t", 16, guard)
    form = LaneFormation(queue, 4, 0, 1.0, False)
    lane = Lane(0, 4, [])
    seqs = []
    for i, sig in enumerate(("a", "a", "b")):
        s = LiveSequence(f"s{i}", f"s{i}", 0)
        s.lane, s.slot = lane, i
        e = SequenceEntry(Item(i, sig), None, 10 + i, s, True, False, True)
        form.seen(sig)
        s.queue.append(e)
        lane.ready[s] = None
        seqs.append(s)
    queue.pending = 3
    assert form.multi_sig
    batch, due = form.form(lane, 100)
    assert due == 0 and [e.item.value for e in batch.entries] == [0, 1]  # signature "a"
    assert queue.pending == 1 and queue.running == 1 and lane.busy
    assert list(lane.ready) == [seqs[2]] and batch.items.start.tolist() == [True, True]


def test_a_batch_span_links_a_request_answered_while_its_batch_ran():
    """The request spans are the tracer's own: one cancelled while its batch runs ends at once
    (cancelled), and the batch, when it finishes, still links it; the tracer then holds
    nothing for either."""
    import threading
    from types import SimpleNamespace

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from lumen_core import tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = tracing.Tracing(provider)
    gate = threading.Event()
    worker = FakeWorker(gate)
    b = DynamicBatcher("t", cfg(), [worker])
    b.queue.trace = tracer

    async def main():
        kept = b.submit(Item(1))
        tracer.admitted(SimpleNamespace(name="t"), "tensor", kept)
        await asyncio.to_thread(worker.started.wait, 10)  # its batch runs
        gone = b.submit(Item(2))  # queued behind it: runs in the next batch
        tracer.admitted(SimpleNamespace(name="t"), "tensor", gone)
        b.cancel(kept)  # answered while its batch runs
        await asyncio.sleep(0)
        assert kept not in tracer.spans and kept in tracer.awaiting
        gate.set()
        assert await gone.waiter == 4
        await asyncio.sleep(0.01)
        await b.drain()
        await b.close()

    asyncio.run(main())
    spans = exporter.get_finished_spans()
    reqs = {s.context.span_id: s for s in spans if s.name == "lumen.request"}
    batches = [s for s in spans if s.name == "lumen.batch"]
    assert len(reqs) == 2 and len(batches) == 2
    linked = [link.context.span_id for bs in batches for link in bs.links]
    assert sorted(linked) == sorted(reqs)  # the cancelled one too, by its own batch
    assert tracer.spans == {} and tracer.awaiting == {}
