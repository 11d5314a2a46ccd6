"""Queue policy, shared by every batcher: admission, deadlines, cancellation, result delivery,
and the life cycle around them (start, drain, close).

After Triton's ``PolicyQueue`` (``scheduler_utils.cc``): *policy* (who may queue, how long a
request may wait, what happens when its caller gives up) is kept apart from batch *formation*
(which queued requests run together), which each batcher does its own way (``dynamic.py``:
signature queues and priority levels; ``sequence.py``: sequences pinned to slots;
``pipeline.py``: a flow per request over the steps' batchers).

A batcher is parts it owns (as Triton's batcher owns a ``PolicyQueue``), each its own typed
class: what a request pays on the loop thread is the compiled
:class:`~lumen_core.request_path.scheduler.AdmissionQueue` (``scheduler.py``: the counters, the lock, the
signature queues, one :class:`~lumen_core.request_path.scheduler.DeadlineHeap` with one timer, the idle
workers, delivery), which asks the batcher's compiled
:class:`~lumen_core.request_path.latency.LatencyGuard` (``latency.py``: the learnt cost; predict, check,
steer) before it queues; the dispatcher calls only the batcher's compiled base,
:class:`~lumen_core.request_path.scheduler.Batcher`.  :class:`QueuePolicy` composes the queue and the guard
with what runs once per batcher: starting the worker threads, draining, closing.  Each batcher
adds its formation (``dynamic.Formation``; the sequence batcher's lanes) and, for the dynamic
batcher, its loop execution (``loop.LoopExecution``).

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
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence

from .. import native
from .cost import CostModel
from .runner import Batch, CompletionQueue, Worker

if TYPE_CHECKING:  # the parts' types (the twins: the compiled ones mirror them)
    from ..request_path.latency import LatencyGuard
    from ..request_path.scheduler import AdmissionQueue

# the entry, its states, the admission queue and the latency guard are the request path's
# compiled homes
_sched = native.scheduler
_lat = native.latency
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
#: the admission errors (closed, a group past the whole queue, a full queue)
check_room = _sched.check_room
#: latency-target steering (``LatencyGuard.steer``: see ``latency.py``)
STEER_HIGH = _lat.STEER_HIGH
STEER_LOW = _lat.STEER_LOW
STEER_DOWN = _lat.STEER_DOWN
STEER_UP = _lat.STEER_UP
STEER_MIN = _lat.STEER_MIN
#: ``QueuePolicy.room``: a request may be admitted now / the queue is full / its sequence
#: waits for a slot (a stream stops reading on either of the last two: serve/streams.py)
ROOM, QUEUE_FULL, AWAITING_SLOT = 0, 1, 2


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


class TaskBatcher(Protocol):
    """A task's batcher as the runtime uses it (the dispatcher calls only its compiled base,
    ``scheduler.Batcher``): a :class:`QueuePolicy` or an ensemble's ``Pipeline``."""

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


class QueuePolicy(_sched.Batcher):
    """A batcher that queues its requests: the parts it owns and their life cycle.

    Parts: ``queue`` (``scheduler.AdmissionQueue``: admission, the signature queues, the
    deadline heap, cancellation, delivery), ``guard`` (``latency.LatencyGuard``: the learnt
    cost and the latency target) and the worker threads, one per runner, which hand finished
    batches back through one ``CompletionQueue``.  The dispatcher's calls (``submit``,
    ``cancel``, ``refuse_late``) are ``scheduler.Batcher``'s, handed to the queue in C.  Here:
    starting the workers, draining, closing, and learning from each finished batch.

    The batchers (``DynamicBatcher``, ``SequenceBatcher``) add formation, their own way, and
    two hooks: ``queued()`` (under the lock: every entry still queued, for a close without
    drain), ``size_batches()`` and ``cap()`` (the cost model moved: size batches to it).
    """

    queue: AdmissionQueue  # never None here
    guard: LatencyGuard  # never None here

    def __init__(self, name: str, max_queue_size: int,
                 on_batch: Optional[Callable[[int, int], None]] = None, levels: int = 1,
                 delay_ns: int = 0, ready_live: int = 1, target_ns: int = 0):
        guard = _lat.LatencyGuard(name, CostModel(), target_ns)
        super().__init__(name, _sched.AdmissionQueue(name, max_queue_size, guard, levels,
                                                     delay_ns, ready_live, on_batch), guard)

    # -- workers (one thread per runner, results back through one queue) --------------------
    def _init_workers(self, name: str, runners: Sequence[Any]) -> None:
        self._runners = list(runners)
        self.guard.cost_workers = max(1, len(self._runners))
        self.completions = CompletionQueue(self.queue.deliver_batch)
        self.workers = [Worker(r, self, f"{name}#{i}", i, self.completions.flush)
                        for i, r in enumerate(self._runners)]

    def start(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        """Bind to the running loop and start the worker threads (idempotent)."""
        q = self.queue
        if q.started:
            return
        bound = loop or asyncio.get_running_loop()
        q.bind(bound)
        self.completions.attach(bound)
        for w in self.workers:
            w.start()

    def wake_workers(self) -> None:
        """Under the lock: wake every waiting worker (closing)."""
        self.queue.wake_all()

    def stop_timers(self) -> None:
        """Loop thread, at close: no more deadline (or other timer) callbacks."""
        self.queue.stop_timer()

    async def close(self) -> None:
        """Stop the workers (after ``drain``) and the hand-back; anything still queued (a close
        without a drain) is answered ``Unavailable``."""
        q = self.queue
        with q.lock:
            q.closed = True
            q.stopping = True
            self.wake_workers()
        for w in self.workers:
            await asyncio.to_thread(w.join)
        self.stop_timers()
        with q.lock:
            left = self.queued()
            for e in left:
                q.kill(e)
        q.refuse(left)
        if q.started:
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

    # -- state ------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Requests queued now (live: cancelled and expired ones leave at once)."""
        n: int = self.queue.pending
        return n

    @property
    def in_flight(self) -> int:
        """Batches running now."""
        n: int = self.queue.running
        return n

    @property
    def runners(self) -> list[Any]:
        """The runners (one per engine instance) the batcher's workers drive."""
        return self._runners

    @property
    def bound_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop the batcher runs on (bound by ``start``, i.e. the first submit)."""
        loop: Optional[asyncio.AbstractEventLoop] = self.queue.loop
        assert loop is not None, f"batcher {self.name!r} is not started"
        return loop

    def room(self, sequence_id: Optional[str] = None) -> int:
        """Loop thread, a hint without the lock (workers only make room): ``ROOM`` when one
        more request would be admitted past the queue limit now, else ``QUEUE_FULL``.  A
        stream asks before it reads on (``serve/streams.py``: paced, never refused)."""
        q = self.queue
        return ROOM if q.pending < q.max_queue_size else QUEUE_FULL

    def counters(self) -> dict[str, Any]:
        """See :class:`TaskBatcher`: none beyond ``pending`` and ``in_flight`` by default."""
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

    # -- the cost model (issue 30): the guard's, once per finished batch ----------------------
    def learn(self, n: int, tokens: int, compute_us: float, rows: float = 0.0) -> None:
        """Under the lock, once per finished batch (never per request): the guard learns its
        compute time (``LatencyGuard.learn``); once its model is ready, batches are sized to
        it (``size_batches``)."""
        if self.guard.learn(n, tokens, compute_us, rows):
            self.size_batches()

    def steer(self, waited_ns: int) -> None:
        """Under the lock, once per finished batch with a latency target: its oldest request
        waited ``waited_ns`` (``LatencyGuard.steer``); batches are sized to a moved budget."""
        if self.guard.steer(waited_ns):
            self.size_batches()

    def size_batches(self) -> None:  # pragma: no cover - each batcher's formation
        """Under the lock: the cost model or the budget moved: formation sizes its batches
        to it and tells the guard its cap (``LatencyGuard.sized``)."""
        raise NotImplementedError

    def cap(self) -> int:  # pragma: no cover - each batcher's formation
        """Formation's cap on a batch now (1 until the cost model sized it)."""
        raise NotImplementedError

    def cost_figures(self) -> Optional[dict[str, Any]]:
        """See :class:`TaskBatcher`: the model's snapshot, the batch size predictions assume,
        formation's cap, the engine instances, the latency target (ms; 0: none)."""
        out: dict[str, Any] = self.guard.figures(self.cap(), self.queue.running)
        return out

    # -- draining ---------------------------------------------------------------------------
    async def drain(self) -> None:
        """Stop admitting, then wait until every queued and running request has finished."""
        q = self.queue
        with q.lock:
            q.closed = True
        while q.pending or q.running:
            # one event shared by every concurrent drainer
            if q.idle_event is None or q.idle_event.is_set():
                q.idle_event = asyncio.Event()
            await q.idle_event.wait()


__all__ = ["AWAITING_SLOT", "QUEUE_FULL", "ROOM", "BatchResult", "TaskBatcher", "DEADLINE_FIELD", "check_room", "group_too_large", "DONE", "OVERLOAD_RETRY_AFTER_S", "QUEUED", "RUNNING", "STEER_DOWN", "STEER_HIGH", "STEER_LOW", "STEER_MIN", "STEER_UP", "UNSET",
           "Entry", "Group", "QueuePolicy", "answer"]
