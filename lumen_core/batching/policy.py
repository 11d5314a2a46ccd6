"""Queue policy, shared by both batchers: admission, deadlines, cancellation, result delivery.

After Triton's ``PolicyQueue`` (``scheduler_utils.cc``): *policy* (who may queue, how long a
request may wait, what happens when its caller gives up) is kept apart from batch *formation*
(which queued requests run together), which each batcher does its own way (``dynamic.py``:
signature queues and priority levels; ``sequence.py``: sequences pinned to slots).

Threads.  Batches are formed by the engine workers themselves (``runner.Worker``), in their
own threads, as soon as they finish a batch: a busy engine never waits for the event loop.
Everything a worker and the loop both touch (queues, counters, entry states) is guarded by
``QueuePolicy.lock``, one ``threading.Lock`` per batcher, held only for list operations.  The
loop thread admits requests, arms deadline timers and answers callers; workers hand finished
batches back through a :class:`~lumen_core.batching.runner.CompletionQueue` that wakes the loop
once per batch (or per burst of batches), not once per request.

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
import logging
import threading
from typing import Any, Callable, Optional, Sequence

from .. import native
from ..contract import KEY_TIMEOUT_MS
from ..errors import (
    Cancelled,
    DeadlineExceeded,
    InternalError,
    InvalidArgument,
    LumenError,
    Overloaded,
    Unavailable,
)
from .runner import CompletionQueue, Worker

log = logging.getLogger("lumen.batching")

#: Retry-After hint (seconds) sent with ``Overloaded``
OVERLOAD_RETRY_AFTER_S = 1
#: the deadline error's field
DEADLINE_FIELD = KEY_TIMEOUT_MS

# the entry, its states and its answering are the per-request hot path: compiled twin or pure
_sched = native.scheduler
QUEUED, RUNNING, DONE = _sched.QUEUED, _sched.RUNNING, _sched.DONE
UNSET = _sched.UNSET
Entry = _sched.Entry
Group = _sched.Group
answer = _sched.answer


def group_too_large(task: str, n: int, max_queue_size: int) -> InvalidArgument:
    """The error of a call of ``n`` inputs that the task's whole queue cannot hold: never
    admitted, so not retryable (a 400, not a 429)."""
    return InvalidArgument(f"{n} inputs in one call exceed task {task!r}'s queue "
                           f"(batching.max_queue_size = {max_queue_size}); send at most "
                           f"{max_queue_size} per call or raise max_queue_size", "input")


class QueuePolicy:
    """Admission, deadlines, cancellation, delivery and draining for one batcher.

    ``_sched`` is the hot-path module whose entries this batcher makes and answers (the
    twin ``native`` chose; tests pin one twin by subclassing).

    Subclasses (the batchers) implement formation and two hooks: ``_unqueue(entry)`` (under
    the lock: a queued entry died; drop it from the formation structures) and ``_wake()``
    (under the lock: new work may be formable; wake an idle worker).
    """

    _sched = _sched
    #: the runtime's ``tracing.Tracing`` when tracing is on (set by the Runtime), else None
    _trace: Any = None

    def __init__(self, name: str, max_queue_size: int,
                 on_batch: Optional[Callable[[int, int], None]] = None):
        self.name = name
        self.max_queue_size = max_queue_size
        self.on_batch = on_batch  # (batch_size, compute_us) -> None, for metrics
        self.lock = threading.Lock()
        self._pending = 0  # live queued requests (admission)
        self._running = 0  # batches in flight
        self._closed = False
        self._idle: Optional[asyncio.Event] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    # -- workers (both batchers: one thread per runner, results back through one queue) -----
    def _init_workers(self, name: str, runners: Sequence[Any]) -> None:
        self.runners = list(runners)
        self._stopping = False
        self._done = CompletionQueue(self._deliver)
        self._workers = [Worker(r, self, f"{name}#{i}", i, self._done.flush)
                         for i, r in enumerate(self.runners)]
        self._started = False

    def start(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        """Bind to the running loop and start the worker threads (idempotent)."""
        if self._started:
            return
        self._loop = loop or asyncio.get_running_loop()
        self._done.attach(self._loop)
        self._started = True
        for w in self._workers:
            w.start()

    async def close(self) -> None:
        """Stop the workers (after ``drain``) and the hand-back; anything still queued (a close
        without a drain) is answered ``Unavailable``."""
        with self.lock:
            self._closed = True
            self._stopping = True
            self._wake_all()
        for w in self._workers:
            await asyncio.to_thread(w.join)
        self._stop_timers()
        with self.lock:
            left = self._queued()
            for e in left:
                self._kill(e)
        self._refuse(left)
        if self._started:
            self._done.close()

    def _wake_all(self) -> None:  # pragma: no cover - overridden
        """Under the lock: wake every worker waiting for work."""
        raise NotImplementedError

    def _queued(self) -> list:  # pragma: no cover - overridden
        """Under the lock: every entry still queued."""
        raise NotImplementedError

    def _stop_timers(self) -> None:
        """Loop thread, at close: cancel the batcher's own timers (none by default)."""

    # -- state ----------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Queued (not yet running) requests."""
        return self._pending

    @property
    def in_flight(self) -> int:
        """Batches running now."""
        return self._running

    # -- admission (caller holds the lock) ------------------------------------------------
    def _admit(self, n: int = 1) -> None:
        if self._closed:
            raise Unavailable(f"task {self.name!r} is shutting down; not accepting requests")
        if n > self.max_queue_size:
            raise group_too_large(self.name, n, self.max_queue_size)
        if self._pending + n > self.max_queue_size:
            raise Overloaded(f"task {self.name!r} queue is full ({self.max_queue_size} pending); "
                             f"retry later", None, OVERLOAD_RETRY_AFTER_S)

    # -- deadlines and cancellation (loop thread) ------------------------------------------
    def _arm_deadline(self, entries: Sequence[Entry], timeout_ms: int,
                      group: Optional[Group] = None) -> None:
        """One timer for ``entries`` (admitted together with the same deadline): the entry's
        own (cancelled when it is answered) or, for a group, the group's (cancelled when the
        whole group is answered)."""
        timer = self._loop.call_later(timeout_ms / 1000.0, self._expire, entries, timeout_ms)
        if group is not None:
            group.timers.append(timer)
        else:
            entries[0].timer = timer

    def _expire(self, entries: Sequence[Entry], timeout_ms: int) -> None:
        for e in entries:
            e.timer = None
            if e.outcome is not UNSET:
                continue
            with self.lock:
                state = e.state
                if state == QUEUED:
                    self._kill(e)
            # DONE here: formation already dropped it for its deadline, before it could run
            where = "while its batch was running" if state == RUNNING else "in the queue"
            self._sched.answer(e, DeadlineExceeded(f"deadline of {timeout_ms} ms expired {where}",
                                       DEADLINE_FIELD))
        self._maybe_idle()

    def cancel(self, entry: Entry) -> None:
        """The caller went away: drop a queued entry (a running one finishes unseen)."""
        if entry.outcome is not UNSET:
            return
        with self.lock:
            if entry.state == QUEUED:
                self._kill(entry)
        self._sched.answer(entry, Cancelled("the request was cancelled by its caller"))
        w = entry.waiter
        if isinstance(w, asyncio.Future) and w.done() and not w.cancelled():
            w.exception()  # a caller that went away never reads it: no "never retrieved" log
        self._maybe_idle()

    def cancel_group(self, entries: Sequence[Entry]) -> None:
        for e in entries:
            self.cancel(e)

    def _refuse(self, entries: Sequence[Entry]) -> None:
        """Loop thread: answer entries a closing batcher will never run."""
        for e in entries:
            self._sched.answer(e, Unavailable(f"task {self.name!r} shut down before this "
                                              f"request ran"))
        self._maybe_idle()

    def _kill(self, e: Entry) -> None:
        """Under the lock: a queued entry dies (it never runs)."""
        e.state = DONE
        self._pending -= 1
        self._unqueue(e)

    def _unqueue(self, e: Entry) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    # -- delivery (loop thread, one call per finished batch) --------------------------------
    def _deliver(self, entries: Sequence[Entry], results: Any, compute_us: int) -> None:
        with self.lock:
            self._running -= 1
        n = len(entries)
        if not isinstance(results, list):  # the worker itself failed: every item gets it
            err = results if isinstance(results, LumenError) else InternalError(
                f"worker failed: {results}")
            results = [err] * n
        # entries answered already (expired or cancelled while running) are skipped
        self._sched.deliver(entries, results, compute_us)
        if self._trace is not None:  # the batch span, here on the loop: workers do no OTel work
            try:
                self._trace.batch(self.name, entries, compute_us)
            except Exception:  # a tracing bug must never strand the batch's callers
                log.exception("batch tracing failed")
        if self.on_batch is not None:
            try:
                self.on_batch(n, compute_us)
            except Exception:  # a metrics bug must never strand the batch's callers
                log.exception("batch observer failed")
        self._maybe_idle()

    # -- draining ---------------------------------------------------------------------------
    async def drain(self) -> None:
        """Stop admitting, then wait until every queued and running request has finished."""
        with self.lock:
            self._closed = True
        while self._pending or self._running:
            # one event shared by every concurrent drainer
            if self._idle is None or self._idle.is_set():
                self._idle = asyncio.Event()
            await self._idle.wait()

    def _maybe_idle(self) -> None:
        if self._idle is not None and not self._pending and not self._running:
            self._idle.set()


