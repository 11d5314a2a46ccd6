"""Queue policy, shared by every batcher: admission, deadlines, cancellation, result delivery,
and the life cycle around them (start, drain, close).

After Triton's ``PolicyQueue`` (``scheduler_utils.cc``): *policy* (who may queue, how long a
request may wait, what happens when its caller gives up) is kept apart from batch *formation*
(which queued requests run together), which each batcher does its own way (``dynamic.py``:
signature queues and priority levels; ``sequence.py``: sequences pinned to slots;
``pipeline.py``: a flow per request over the steps' batchers).

What a request pays on the loop thread is the compiled :class:`~lumen_core.scheduler.Admission`
(``scheduler.py``): the counters, the lock, the signature queues, one deadline heap with one
timer, the idle workers, delivery.  :class:`QueuePolicy` builds on it with what runs once per
batcher: starting the worker threads, draining, closing.

Threads.  Batches are formed by the engine workers themselves (``runner.Worker``), in their
own threads, as soon as they finish a batch: a busy engine never waits for the event loop.
Everything a worker and the loop both touch (queues, counters, entry states) is guarded by
``lock``, one ``threading.Lock`` per batcher, held only for list operations.  The loop thread
admits requests, keeps the deadlines and answers callers; workers hand finished batches back
through a :class:`~lumen_core.batching.runner.CompletionQueue` that wakes the loop once per
batch (or per burst of batches), not once per request.

Entry states: ``QUEUED`` -> ``RUNNING`` (a worker took it into a batch, under the lock) ->
``DONE`` (answered, on the loop).  A queued entry that expires or is cancelled goes straight
to ``DONE`` under the lock and leaves the admission count at once, so ``max_queue_size`` counts
live requests only; formation skips dead entries lazily.  An entry that expires or is
cancelled *while its batch runs* has reached the model: its caller is answered at once and the
batch's late result for it is dropped.

Waiters.  A single request's caller awaits one asyncio future.  A group (``infer_many``) has
one future for all its entries: each entry's outcome is stored on the entry and the group's
future resolves when the last one is answered, so a list of N inputs costs one future and one
task wake-up, not N.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable, Optional, Protocol, Sequence

from .. import native
from .cost import CostModel
from .runner import Batch, CompletionQueue, Worker

# the entry, its states and the admission state are the request path's compiled homes
_sched = native.scheduler
_ent = native.entries
QUEUED, RUNNING, DONE = _ent.QUEUED, _ent.RUNNING, _ent.DONE
UNSET = _ent.UNSET
Entry = _ent.Entry
Group = _ent.Group
answer = _ent.answer
#: Retry-After hint (seconds) sent with ``Overloaded``
OVERLOAD_RETRY_AFTER_S = _sched.OVERLOAD_RETRY_AFTER_S
#: the deadline error's field
DEADLINE_FIELD = _sched.DEADLINE_FIELD
#: the error of a call that the task's whole queue cannot hold (a 400, never a 429)
group_too_large = _sched.group_too_large

# Latency-target steering (``QueuePolicy.steer``): once per finished batch, the wait of its
# oldest request (admission to answer) is held against the target.  Past ``STEER_HIGH`` of it
# (what the server itself may spend: the rest is the transport's, before admission and after
# the answer) the budget admission and formation plan for shrinks by ``STEER_DOWN``; under
# ``STEER_LOW`` of it the budget grows back by ``STEER_UP``, never past the target nor under
# ``STEER_MIN`` of it.  Shrinking fast and growing slowly is the usual AIMD-like shape: a
# burst of late answers is corrected within a few batches, a quiet spell is not trusted at once.
STEER_HIGH = 0.75
STEER_LOW = 0.55
STEER_DOWN = 0.95
STEER_UP = 1.01
STEER_MIN = 0.25
#: ``QueuePolicy.room``: a request may be admitted now / the queue is full / its sequence
#: waits for a slot (a stream stops reading on either of the last two: serve/streams.py)
ROOM, QUEUE_FULL, AWAITING_SLOT = 0, 1, 2
#: a probe (``scheduler.PROBE_IDLE_NS``) whose batch ran in under ``1 / PROBE_STALE`` of its
#: predicted time shows a stale cost model: it starts over (``forget_cost``)
PROBE_STALE = 2
#: weight of the newest batch in the running mean of formed batch sizes (``batch_seen``)
BATCH_SEEN_EMA = 0.05


class BatchResult:
    """What ``DynamicBatcher.infer`` returns (in-process callers of a bare batcher)."""

    __slots__ = ("value", "batch_size", "queue_us", "compute_us")

    def __init__(self, value: Any, batch_size: int, queue_us: int, compute_us: int):
        self.value = value
        self.batch_size = batch_size
        self.queue_us = queue_us
        self.compute_us = compute_us

    @classmethod
    def of(cls, e: Entry) -> "BatchResult":
        return cls(e.result(), e.batch_size, e.queue_us, e.compute_us)


class Batcher(Protocol):
    """A task's batcher as the runtime and the request path use it (every batcher is a
    :class:`QueuePolicy`; ``dispatch.Route.batcher`` is typed as its compiled base)."""

    name: str
    pending: int

    @property
    def in_flight(self) -> int: ...

    def submit(self, item: Any, desc: Any = None, priority: int = 1,
               timeout_ms: int = 0) -> Any: ...

    def submit_many(self, specs: Sequence[tuple[Any, Any, int, int]]
                    ) -> tuple[Any, list[Any]]: ...

    def cancel(self, entry: Any) -> None: ...

    def cancel_group(self, entries: Sequence[Any]) -> None: ...

    def start(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None: ...

    async def drain(self) -> None: ...

    async def close(self) -> None: ...

    def counters(self) -> dict[str, Any]:
        """Load figures of this kind of batcher beyond ``pending`` / ``in_flight``: numbers
        (summed over a task's versions) or, for an ensemble, a per-step table."""
        ...

    def cost_figures(self) -> Optional[dict[str, Any]]:
        """The learnt cost model and the latency target (``QueuePolicy.cost_figures``); None
        for a batcher that runs no batches itself (an ensemble: its steps do)."""
        ...


class QueuePolicy(_sched.Admission):
    """Admission, deadlines, cancellation, delivery (``Admission``) and draining for one
    batcher.

    Subclasses (the batchers) implement formation and two hooks: ``queued()`` (under the lock:
    every entry still queued, for a close without drain) and, where formation keeps its own
    structures, ``unqueue(entry)`` (under the lock: a queued entry died).
    """

    def __init__(self, name: str, max_queue_size: int,
                 on_batch: Optional[Callable[[int, int], None]] = None, levels: int = 1,
                 delay_ns: int = 0, ready_live: int = 1):
        super().__init__(name, max_queue_size, levels, delay_ns, ready_live, on_batch)
        #: compute time per batch, learnt from the batches this batcher runs (cost.py)
        self.cost = CostModel()
        #: the batch size a full queue forms (``operating_batch``), for the predictions
        self.batch_limit = 1
        #: the size batches are formed at (formation's cap, ``operating_batch``) and the size
        #: they turn out (running mean: length-aware formation forms smaller ones when few
        #: queued texts are of a length); predictions count batches of the smaller
        self.batch_cap = 1
        self.batch_seen = 0.0

    # -- workers (one thread per runner, results back through one queue) --------------------
    def _init_workers(self, name: str, runners: Sequence[Any]) -> None:
        self._runners = list(runners)
        self.cost_workers = max(1, len(self._runners))
        self.completions = CompletionQueue(self.deliver_batch)
        self.workers = [Worker(r, self, f"{name}#{i}", i, self.completions.flush)
                        for i, r in enumerate(self._runners)]

    def start(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        """Bind to the running loop and start the worker threads (idempotent)."""
        if self.started:
            return
        self.loop = loop or asyncio.get_running_loop()
        self.completions.attach(self.loop)
        self.started = True
        for w in self.workers:
            w.start()

    async def close(self) -> None:
        """Stop the workers (after ``drain``) and the hand-back; anything still queued (a close
        without a drain) is answered ``Unavailable``."""
        with self.lock:
            self.closed = True
            self.stopping = True
            self.wake_all()
        for w in self.workers:
            await asyncio.to_thread(w.join)
        self.stop_timer()
        with self.lock:
            left = self.queued()
            for e in left:
                self.kill(e)
        self.refuse(left)
        if self.started:
            self.completions.close()

    def queued(self) -> list[Entry]:  # pragma: no cover - overridden
        """Under the lock: every entry still queued."""
        raise NotImplementedError

    # -- formation (the workers' side: runner.BatchSource), each batcher its own way ----------
    def next_batch(self, worker: Worker) -> Optional[Batch]:  # pragma: no cover - overridden
        """Block until a batch is due for ``worker``; None when the batcher stops."""
        raise NotImplementedError

    def finished(self, worker: Worker, batch: Batch, results: Any,
                 compute_us: int) -> Optional[Batch]:  # pragma: no cover - overridden
        """Hand ``results`` back, then (same lock) the next batch, as ``next_batch``."""
        raise NotImplementedError

    @property
    def runners(self) -> list[Any]:
        """The runners (one per engine instance) the batcher's workers drive."""
        return self._runners

    @property
    def bound_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the batcher runs on (bound by ``start``, i.e. the first submit)."""
        loop = self.loop
        assert loop is not None, f"batcher {self.name!r} is not started"
        return loop

    def room(self, sequence_id: Optional[str] = None) -> int:
        """Loop thread, a hint without the lock (workers only make room): ``ROOM`` when one
        more request would be admitted past the queue limit now, else ``QUEUE_FULL``.  A
        stream asks before it reads on (``serve/streams.py``: paced, never refused)."""
        return ROOM if self.pending < self.max_queue_size else QUEUE_FULL

    def counters(self) -> dict[str, Any]:
        """See :class:`Batcher`: none beyond ``pending`` and ``in_flight`` by default."""
        return {}

    async def infer(self, item: Any, desc: Any = None, priority: int = 1,
                    timeout_ms: int = 0) -> BatchResult:
        """Queue ``item`` and await it (in-process callers of a bare batcher; the runtime's
        request path submits through its ``Dispatcher`` instead)."""
        entry = self.submit(item, desc, priority, timeout_ms)
        try:
            await entry.waiter
        except asyncio.CancelledError:
            self.cancel(entry)
            raise
        return BatchResult.of(entry)

    # -- the cost model (issue 30) -----------------------------------------------------------
    def learn(self, n: int, tokens: int, compute_us: int, rows: float = 0.0) -> None:
        """Under the lock, once per finished batch (never per request): learn its compute
        time, then hand admission the figures its latency check reads (C fields).  ``rows``
        (> 0): what the batch counts as in typical rows for the cost model (a batch of items
        larger than the typical one: ``DynamicBatcher.loop_fits``); else its ``n``."""
        m = self.cost
        x = rows or n
        if self.probing:  # the first batch after an idle batcher admitted a probe
            self.probing = False
            if m.ready and compute_us * PROBE_STALE < m.predict_us(x, tokens):
                m = self.forget_cost()
        m.update(x, tokens, compute_us)
        self.learnt_ns = time.monotonic_ns()  # an idle batcher probes from here (check_latency)
        if m.ready:
            fixed_us, item_us = m.linear()
            self.cost_fixed_ns = fixed_us * 1000.0
            self.cost_item_ns = item_us * 1000.0
            self.cost_token_ns = max(0.0, m.theta[2]) * 1000.0
            self.cost_tokens_per_item = m.tokens_per_item
            self.cost_ready = True
        self.batch_seen = n if not self.batch_seen else (
            self.batch_seen + BATCH_SEEN_EMA * (n - self.batch_seen))
        if m.ready:
            self._size_batches()

    def forget_cost(self) -> CostModel:
        """Under the lock: a probe ran in under ``1 / PROBE_STALE`` of its predicted time, so
        the learnt cost is stale (learnt while other processes held the cores): start over,
        with the whole target as the budget; nothing is refused until the new model is ready
        (``COST_MIN_SAMPLES`` batches), as at start-up."""
        m = self.cost = CostModel(self.cost.forgetting)
        self.cost_ready = False
        self.budget_ns = 0
        return m

    def _size_batches(self) -> None:
        """Formation's cap and the batch size predictions count (see ``batch_seen``)."""
        self.batch_cap = cap = max(1, self.operating_batch())
        self.cost_batch = max(1, min(cap, int(self.batch_seen + 0.5)))

    def operating_batch(self) -> int:
        """The batch a full queue forms for a request that just arrived (formation's size)."""
        return self.batch_limit

    def steer(self, waited_ns: int) -> None:
        """Under the lock, once per finished batch with a latency target: its oldest request
        waited ``waited_ns`` from admission to its answer.  Shrink the budget (``budget_ns``:
        what admission refuses against, and the batch size that fits it) when that runs past
        ``STEER_HIGH`` of the target; grow it back slowly under ``STEER_LOW``."""
        target = self.target_ns
        if not target:
            return
        was = h = self.headroom
        if waited_ns > STEER_HIGH * target:
            h = max(STEER_MIN, h * STEER_DOWN)
        elif waited_ns < STEER_LOW * target:
            h = min(1.0, h * STEER_UP)
        else:
            return
        if h != was:
            self.budget_ns = int(target * h)
            self.budget_at_ns = time.monotonic_ns()  # it grows back from here while idle
            if self.cost_ready:
                self._size_batches()

    @property
    def headroom(self) -> float:
        """The share of the latency target admission and formation plan for (``steer``):
        ``budget_ns`` over ``target_ns`` (1.0 without a target, or before the budget moved)."""
        return self.budget_ns / self.target_ns if self.target_ns and self.budget_ns else 1.0

    def cost_figures(self) -> Optional[dict[str, Any]]:
        """See :class:`Batcher`: the model's snapshot, the batch size predictions assume,
        the engine instances, the latency target (ms; 0: none)."""
        out = self.cost.snapshot()
        out["batch_size"] = self.cost_batch
        out["batch_cap"] = self.batch_cap
        out["workers"] = self.cost_workers
        out["latency_target_ms"] = self.target_ns // 1_000_000
        out["latency_budget_ms"] = self.budget_now(time.monotonic_ns()) / 1e6
        return out

    # -- draining ---------------------------------------------------------------------------
    async def drain(self) -> None:
        """Stop admitting, then wait until every queued and running request has finished."""
        with self.lock:
            self.closed = True
        while self.pending or self.running:
            # one event shared by every concurrent drainer
            if self.idle_event is None or self.idle_event.is_set():
                self.idle_event = asyncio.Event()
            await self.idle_event.wait()


__all__ = ["AWAITING_SLOT", "QUEUE_FULL", "ROOM", "BatchResult", "Batcher", "DEADLINE_FIELD", "group_too_large", "DONE", "OVERLOAD_RETRY_AFTER_S", "QUEUED", "RUNNING", "UNSET",
           "Entry", "Group", "QueuePolicy", "answer"]
