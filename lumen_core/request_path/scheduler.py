# cython: annotation_typing=False
"""The request path's queue side: what the dispatcher calls, and a batcher's admission queue.

One source, two builds.  Cython compiles this file with the declarations of
``lumen_core/request_path/_scheduler.pxd`` (its pure-Python mode) into ``lumen_core.request_path._scheduler``: the classes
below become ``cdef class``es with C fields and their methods C calls.  Run as plain Python
(``LUMEN_NO_EXTENSIONS=1``, or no compiler) the same file is the pure-Python twin.  Nothing here
is written twice.  ``entries.py`` (compiled the same way, its types cimported here) holds what
is admitted: entries, their queues and answers; ``latency.py`` the latency guard (the learnt
cost: predict, check, steer); ``dispatch.py`` is the side before admission: routes,
validation, preparation, ``Runtime.infer``.

- :class:`Batcher` -- the small interface the dispatcher calls (``Route.batcher``): submit one
  request or a group, cancel, refuse late, start.  A batcher that queues requests
  (``batching/policy.QueuePolicy``: the dynamic and sequence batchers) owns an
  :class:`AdmissionQueue` and a ``latency.LatencyGuard`` and hands the calls to them; an
  ensemble (``batching/pipeline.Pipeline``) implements them over its steps' batchers.
- :class:`AdmissionQueue` -- a batcher's admission state: its lock, counts, the signature queues
  of a dynamic batcher, the idle workers, its :class:`DeadlineHeap`, and the delivery of
  finished batches.
- :class:`DeadlineHeap` -- every deadline of a batcher in one heap with one loop timer for the
  earliest (as Triton's ``PolicyQueue``), not a timer per request.
"""
from __future__ import annotations

import asyncio
import heapq
import logging
import time
from threading import Lock as _Lock
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

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

if TYPE_CHECKING:  # the entries' and the guard's types (compiled: cimported by _scheduler.pxd)
    from . import entries as entry_types
    from . import latency as latency_types

log = logging.getLogger("lumen.batching")

#: the twin API (``lumen_core.request_path._scheduler`` exports the same names)
__all__ = ["AdmissionQueue", "Batcher", "DeadlineHeap", "check_room", "group_too_large"]

# the entries of this module's own kind, by a visible import: the compiled module
# (``_scheduler``) works with the compiled ones, whose C types it cimports (_scheduler.pxd)
if __name__.endswith("._scheduler"):
    from . import _entries as _ent  # type: ignore[attr-defined]
else:
    from . import entries as _ent
_Entry = _ent.Entry
_Group = _ent.Group
_SignatureQueue = _ent.SignatureQueue
_Rows = _ent.Rows
_answer = _ent.answer
_deliver = _ent.deliver
#: entry states and the unanswered outcome (entries.py's)
QUEUED, RUNNING, DONE, UNSET = _ent.QUEUED, _ent.RUNNING, _ent.DONE, _ent.UNSET

_Future = asyncio.Future
_monotonic_ns = time.monotonic_ns
_heappush = heapq.heappush
_heappop = heapq.heappop

#: Retry-After hint (seconds) sent with ``Overloaded``
OVERLOAD_RETRY_AFTER_S = 1
#: the deadline error's field
DEADLINE_FIELD: str = KEY_TIMEOUT_MS
#: the deadline heap is rebuilt without answered entries once it holds this many and at least
#: twice what it held after the last rebuild (answered entries leave it lazily)
DEADLINE_COMPACT_MIN = 256


# ------------------------------------------------------------------------------ admission
def group_too_large(task: str, n: int, max_queue_size: int) -> InvalidArgument:
    """The error of a call of ``n`` inputs that the task's whole queue cannot hold: never
    admitted, so not retryable (a 400, not a 429)."""
    return InvalidArgument(f"{n} inputs in one call exceed task {task!r}'s queue "
                           f"(batching.max_queue_size = {max_queue_size}); send at most "
                           f"{max_queue_size} per call or raise max_queue_size", "input")


def check_room(name: str, closed: bool, pending: int, n: int, max_queue_size: int) -> None:
    """Raise the precise error when ``n`` more requests cannot be admitted to task ``name``
    now: shutting down (``Unavailable``), more than the whole queue (``group_too_large``: a
    400), or past ``max_queue_size`` with ``pending`` queued (``Overloaded``: retry later)."""
    if closed:
        raise Unavailable(f"task {name!r} is shutting down; not accepting requests")
    if n > max_queue_size:
        raise group_too_large(name, n, max_queue_size)
    if pending + n > max_queue_size:
        raise Overloaded(f"task {name!r} queue is full ({max_queue_size} pending); "
                         f"retry later", None, OVERLOAD_RETRY_AFTER_S)


class Batcher:
    """What the dispatcher calls on a task's batcher (``routes.Route.batcher``), and nothing
    more: ``submit`` / ``submit_many`` (admit, or raise the precise error at once),
    ``cancel`` / ``cancel_group`` (the caller went away), ``refuse_late`` (a latency check
    before a request is prepared) and ``start`` (bind to the loop).  ``guard`` is the task's
    latency guard (None: no latency target, an ensemble's), which the dispatcher reads to skip
    ``refuse_late`` when there is no target.

    The methods here serve a batcher that owns an :class:`AdmissionQueue` (``queue``): they
    hand the call to it, starting the batcher on its first request.  A batcher without one (an
    ensemble: ``batching/pipeline.Pipeline``) overrides them; ``start`` is every batcher's own.
    """

    __slots__ = ("name", "queue", "guard")

    def __init__(self, name: str, queue: Optional[AdmissionQueue] = None,
                 guard: Optional[latency_types.LatencyGuard] = None):
        self.name = name
        self.queue = queue
        self.guard = guard

    def submit(self, item: Any, desc: Any = None, priority: int = 1,
               timeout_ms: int = 0) -> entry_types.Entry:
        """Admit ``item`` (it has ``.signature``); raise at once when it cannot be admitted.
        ``desc`` (the request's descriptor) is the sequence batcher's."""
        q = self.queue
        assert q is not None  # a batcher without a queue overrides this
        if not q.started:
            self.start()
        return q.submit(item, priority, timeout_ms)

    def submit_many(self, specs: Sequence[tuple[Any, Any, int, int]]
                    ) -> tuple[entry_types.Group, list[entry_types.Entry]]:
        """Admit a group ``[(item, desc, priority, timeout_ms), ...]`` as a unit (all or
        none); return ``(group, entries)``: ``group.future`` resolves once every entry is
        answered, each entry's ``outcome`` holds its result or error."""
        q = self.queue
        assert q is not None
        if not q.started:
            self.start()
        return q.submit_many(specs)

    def cancel(self, entry: entry_types.Entry) -> None:
        """The caller went away: drop a queued entry (a running one finishes unseen)."""
        q = self.queue
        assert q is not None
        q.cancel(entry)

    def cancel_group(self, entries: Sequence[entry_types.Entry]) -> None:
        q = self.queue
        assert q is not None
        q.cancel_group(entries)

    def refuse_late(self, priority: int, timeout_ms: int) -> None:
        """Loop thread, before a request is prepared: refuse it now if the latency guard would
        refuse it at submit whatever its length (:meth:`AdmissionQueue.refuse_late`)."""
        q = self.queue
        if q is not None:
            q.refuse_late(priority, timeout_ms)

    def queue_limit(self) -> int:
        """The most requests the batcher admits at once (``batching.max_queue_size``)."""
        q = self.queue
        assert q is not None
        return q.max_queue_size

    def start(self, loop: Any = None) -> None:  # pragma: no cover - every batcher's own
        raise NotImplementedError


class DeadlineHeap:
    """Every deadline of one batcher in one heap, with one loop timer for the earliest; an
    entry answered before its deadline leaves the heap lazily (it is rebuilt without them once
    it grows: ``DEADLINE_COMPACT_MIN``).  ``expire(entry)`` is its owner's, called on the loop
    for each entry whose deadline passed while unanswered; ``after()`` (or None) once after a
    timer expired any.  ``loop`` is bound when the owner starts."""

    __slots__ = ("heap", "count", "compact_at", "timer", "timer_ns", "loop", "expire", "after")

    def __init__(self, expire: Callable[[Any], None],
                 after: Optional[Callable[[], None]] = None):
        self.heap: list[tuple[int, int, entry_types.Entry]] = []
        self.count = 0
        self.compact_at = DEADLINE_COMPACT_MIN
        self.timer: Optional[asyncio.TimerHandle] = None
        self.timer_ns = 0
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.expire = expire
        self.after = after

    def arm(self, e: entry_types.Entry) -> None:
        """Put ``e``'s deadline in the heap; re-arm the one timer when it is the earliest."""
        self.count += 1
        _heappush(self.heap, (e.deadline_ns, self.count, e))
        if len(self.heap) >= self.compact_at:
            self.heap = [d for d in self.heap if d[2].outcome is UNSET]
            heapq.heapify(self.heap)
            self.compact_at = max(DEADLINE_COMPACT_MIN, 2 * len(self.heap))
        if self.timer is None or e.deadline_ns < self.timer_ns:
            self.set_timer(e.deadline_ns)

    def set_timer(self, at_ns: int) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer_ns = at_ns
        loop = self.loop
        assert loop is not None  # started: the first submit binds the loop
        self.timer = loop.call_later(max(0, at_ns - _monotonic_ns()) / 1e9, self.expire_due)

    def expire_due(self) -> None:
        """The timer: expire every entry whose deadline has passed, then re-arm."""
        self.timer = None
        heap = self.heap
        now = _monotonic_ns()
        expired = False
        while heap and heap[0][0] <= now:
            e = _heappop(heap)[2]
            if e.outcome is UNSET:
                self.expire(e)
                expired = True
        while heap and heap[0][2].outcome is not UNSET:
            _heappop(heap)
        if heap:
            self.set_timer(heap[0][0])
        if expired and self.after is not None:
            self.after()

    def stop(self) -> None:
        """Loop thread, at close: no more deadline callbacks."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def __len__(self) -> int:
        return len(self.heap)


class AdmissionQueue:
    """A batcher's admission state and the policy every request meets on the loop thread:
    admission (``max_queue_size``, then the latency ``guard``), the signature queues of a
    dynamic batcher, waking an idle worker when a batch can form, deadlines
    (:class:`DeadlineHeap`), cancellation and the delivery of finished batches.  The batchers
    (``batching/policy.py``) own one and form their batches from it.

    Threads: ``lock`` guards the queues, the counters and entry states; workers take batches
    under it.  An idle worker waits on its own lock (:meth:`wait_for_work`); a request wakes
    one only when it makes a batch formable: the first pending request, a queue reaching its
    ready size, or any request when ``max_queue_delay_us`` is 0.  ``unqueued`` (None: the
    signature queues' live count) is formation's hook for a queued entry that died, when it
    keeps its own structures (the sequence batcher).
    """

    __slots__ = ("name", "max_queue_size", "levels", "lock", "pending", "running",
                 "running_items", "closed", "stopping", "started", "loop", "queues", "idle",
                 "delay_ns", "ready_live", "deadlines", "trace", "on_batch", "idle_event",
                 "guard", "queued_tokens", "unqueued")

    def __init__(self, name: str, max_queue_size: int, guard: latency_types.LatencyGuard,
                 levels: int = 1, delay_ns: int = 0, ready_live: int = 1,
                 on_batch: Optional[Callable[[int, int], None]] = None):
        self.name = name
        self.max_queue_size = max_queue_size
        self.levels = levels
        self.lock = _Lock()
        self.pending = 0  # live queued requests (admission)
        self.running = 0  # batches in flight
        self.running_items = 0  # the requests in them (formation adds, delivery takes away)
        self.closed = False
        self.stopping = False
        self.started = False
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.queues: dict[Any, entry_types.SignatureQueue] = {}
        #: waiting workers: their wake locks, or a LoopTurn in a parked one's place (loop.py)
        self.idle: list[Any] = []
        self.delay_ns = delay_ns
        self.ready_live = ready_live  # a queue this long forms a batch without waiting
        self.deadlines = DeadlineHeap(self.expire, self.maybe_idle)
        self.trace: Any = None  # the runtime's tracing.Tracing when tracing is on
        self.on_batch = on_batch  # (batch_size, compute_us) -> None, for metrics
        self.idle_event: Optional[asyncio.Event] = None  # asyncio.Event while somebody drains
        #: the latency guard: with a target (``guard.target_ns``), a request whose predicted
        #: completion falls past the budget (or its deadline) is refused at admission
        self.guard = guard
        #: the token count of the queued requests (those with a ``length``), tracked while
        #: there is a target: a queue of long texts is priced at their lengths (issue 38 row 3)
        self.queued_tokens = 0
        self.unqueued: Optional[Callable[[Any], None]] = None

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """The owner starts: bind the loop the deadlines and answers run on."""
        self.loop = loop
        self.deadlines.loop = loop
        self.started = True

    # -- admission (loop thread) ------------------------------------------------------------
    def admit(self, n: int) -> None:
        """Raise the precise error when ``n`` more requests cannot be admitted now."""
        check_room(self.name, self.closed, self.pending, n, self.max_queue_size)

    def predicted_ns(self, k: int, length: int = 0) -> int:
        """Under the lock: the guard's prediction for the ``k``-th request in line, with the
        batches running now (``LatencyGuard.predicted_ns``)."""
        return self.guard.predicted_ns(k, length, self.running, self.running_items)

    def check_latency(self, n: int, timeout_ns: int, priority: int = 1,
                      length: int = 0, tokens: int = 0) -> None:
        """Under the lock, with a latency target: the guard's check of ``n`` more requests
        against this queue's load (``LatencyGuard.check``: raises ``Overloaded``)."""
        self.guard.check(n, timeout_ns, priority, length, tokens, self.pending, self.running,
                         self.running_items, self.queued_tokens, self.levels, self)

    def refuse_late(self, priority: int, timeout_ms: int) -> None:
        """Loop thread, before a request is prepared (tokenised, decoded): refuse it now if
        :meth:`check_latency` would refuse it at submit whatever its length (priced at one
        token: its length is not known yet), so a refusal under overload costs the parsing
        and no more (the preparation of a text or an image is most of what a request costs
        the loop, and on a small box the loop shares the cores with the model).  Only when
        the cost is learnt; ``submit`` checks again under the same lock, with its length."""
        if not self.guard.cost_ready:
            return
        lock = self.lock
        lock.acquire()
        try:
            self.check_latency(1, timeout_ms * 1_000_000, priority, 1)
        finally:
            lock.release()

    def queued_up_to(self, priority: int) -> int:
        """Under the lock: live queued requests of priority ``priority`` or higher (a scan:
        only a refusal check of a request above the lowest level pays it)."""
        k = 0
        for q in self.queues.values():
            levels = q.levels
            for i in range(priority):
                for e in levels[i]:
                    if e.state == QUEUED:
                        k += 1
        return k

    def submit(self, item: Any, priority: int = 1, timeout_ms: int = 0) -> entry_types.Entry:
        """Admit ``item`` (it has ``.signature``) into its signature queue; raise at once when
        closed or full (the owner started it: :meth:`bind`)."""
        if not 1 <= priority <= self.levels:
            raise ValueError(f"priority must be 1..{self.levels}")
        now = _monotonic_ns()
        sig = item.signature
        e: entry_types.Entry = _Entry(item, _Future(loop=self.loop), priority, now, None,
                                      now + timeout_ms * 1_000_000 if timeout_ms > 0 else 0)
        guard = self.guard
        lock = self.lock
        lock.acquire()
        try:
            if self.closed or self.pending >= self.max_queue_size:
                self.admit(1)
            length = 0
            if guard.target_ns:
                length = getattr(item, "length", 0) or 0
                if guard.cost_ready:
                    self.check_latency(1, timeout_ms * 1_000_000, priority, length)
            self.enqueue(e, sig)
            self.pending += 1
            self.queued_tokens += length
            self.wake_if_formable(e.queue)
        finally:
            lock.release()
        if timeout_ms > 0:
            self.deadlines.arm(e)
        return e

    def submit_many(self, specs: Sequence[tuple[Any, Any, int, int]]
                    ) -> tuple[entry_types.Group, list[entry_types.Entry]]:
        """Admit a group ``[(item, desc, priority, timeout_ms), ...]`` as a unit (all or
        none): ``Batcher.submit_many``."""
        n = len(specs)
        group = _Group(_Future(loop=self.loop), n)
        entries: list[entry_types.Entry] = []
        if not n:
            group.future.set_result(None)
            return group, entries
        now = _monotonic_ns()
        sigs = []
        for spec in specs:  # signatures and priorities first: raise before anything queues
            item, _desc, priority, timeout_ms = spec
            if not 1 <= priority <= self.levels:
                raise ValueError(f"priorities must be 1..{self.levels}")
            sigs.append(item.signature)
            entries.append(_Entry(item, group, priority, now, None,
                                 now + timeout_ms * 1_000_000 if timeout_ms > 0 else 0))
        guard = self.guard
        tokens = 0
        if guard.target_ns:  # each item at its own length, as a single request is priced
            for spec in specs:
                tokens += getattr(spec[0], "length", 0) or 0
        lock = self.lock
        lock.acquire()
        try:
            self.admit(n)
            if guard.target_ns and guard.cost_ready:
                self.check_latency(n, min([s[3] for s in specs if s[3] > 0] or [0]) * 1_000_000,
                                   max([s[2] for s in specs]), 0, tokens)
            for k in range(n):
                self.enqueue(entries[k], sigs[k])
            self.pending += n
            self.queued_tokens += tokens
            self.wake_if_formable(None)
        finally:
            lock.release()
        for e in entries:
            if e.deadline_ns:
                self.deadlines.arm(e)
        return group, entries

    def enqueue(self, e: entry_types.Entry, sig: Any) -> None:
        """Under the lock: queue ``e`` in the signature queue of ``sig``."""
        q = self.queues.get(sig)
        if q is None:
            q = self.queues[sig] = _SignatureQueue(sig, self.levels)
        q.levels[e.priority - 1].append(e)
        q.live += 1
        e.queue = q

    def wake_if_formable(self, q: Optional[entry_types.SignatureQueue]) -> None:
        """Under the lock, after admitting into ``q`` (None: several queues): wake one idle
        worker if a batch can form now or a worker must start timing the queue delay."""
        if self.idle and (self.delay_ns == 0 or q is None or self.pending == 1
                          or q.live >= self.ready_live):
            self.idle.pop().release()

    def wake_all(self) -> None:
        """Under the lock: wake every idle worker (closing, or work they must re-examine)."""
        idle = self.idle
        while idle:
            idle.pop().release()

    def wait_for_work(self, wake: Any, timeout: float, idle: list[Any]) -> None:
        """Worker thread, holding the lock: wait (the lock released) until a request wakes
        this worker through its own lock ``wake`` (held by it while it is not waiting) or
        ``timeout`` seconds pass (-1: no limit); return holding the lock again.  ``idle`` is
        the list a waker pops it from (``self.idle``; a sequence lane keeps its own)."""
        idle.append(wake)
        lock = self.lock
        lock.release()
        try:
            got = wake.acquire(True, timeout)
        finally:
            lock.acquire()
        if not got:
            try:
                idle.remove(wake)  # timed out, nobody woke it
            except ValueError:  # woken just after the timeout: take back the release
                wake.acquire(False)

    # -- dead entries (under the lock) -------------------------------------------------------
    def kill(self, e: entry_types.Entry) -> None:
        """Under the lock: a queued entry dies (it never runs)."""
        e.state = DONE
        self.pending -= 1
        if self.queued_tokens:
            self.dequeued_tokens([e])
        if self.unqueued is not None:
            self.unqueued(e)
        else:  # it leaves its signature queue's deque lazily
            q = e.queue
            if q is not None:
                q.live -= 1

    def dequeued_tokens(self, entries: list[entry_types.Entry]) -> None:
        """Under the lock: ``entries`` left the queue (formed into a batch, or dead): their
        lengths leave ``queued_tokens`` (which an empty queue resets, so it cannot drift)."""
        if not self.pending:
            self.queued_tokens = 0
            return
        k = 0
        for e in entries:
            k += getattr(e.item, "length", 0) or 0
        self.queued_tokens = max(0, self.queued_tokens - k)

    # -- deadlines (loop thread) -----------------------------------------------------------
    def arm(self, e: entry_types.Entry) -> None:
        """``e``'s deadline into the heap (:meth:`DeadlineHeap.arm`)."""
        self.deadlines.arm(e)

    def expire(self, e: entry_types.Entry) -> None:
        """``e``'s deadline passed: it dies if still queued; its caller gets the error now
        (a running entry reached the model: its batch's late result is dropped)."""
        lock = self.lock
        lock.acquire()
        state = e.state
        if state == QUEUED:
            self.kill(e)
        lock.release()
        # DONE here: formation already dropped it for its deadline, before it could run
        where = "while its batch was running" if state == RUNNING else "in the queue"
        _answer(e, DeadlineExceeded(f"deadline of {e.timeout_ms} ms expired {where}",
                                   DEADLINE_FIELD))

    def stop_timer(self) -> None:
        """Loop thread, at close: no more deadline callbacks."""
        self.deadlines.stop()

    # -- cancellation (loop thread) --------------------------------------------------------
    def cancel(self, entry: entry_types.Entry) -> None:
        """The caller went away: drop a queued entry (a running one finishes unseen)."""
        if entry.outcome is not UNSET:
            return
        lock = self.lock
        lock.acquire()
        if entry.state == QUEUED:
            self.kill(entry)
        lock.release()
        _answer(entry, Cancelled("the request was cancelled by its caller"))
        w = entry.waiter
        if type(w) is not _Group and w.done() and not w.cancelled():
            w.exception()  # a caller that went away never reads it: no "never retrieved" log
        self.maybe_idle()

    def cancel_group(self, entries: Sequence[entry_types.Entry]) -> None:
        for e in entries:
            self.cancel(e)

    def refuse(self, entries: Sequence[entry_types.Entry]) -> None:
        """Loop thread: answer entries a closing batcher will never run."""
        for e in entries:
            _answer(e, Unavailable(f"task {self.name!r} shut down before this request ran"))
        self.maybe_idle()

    # -- delivery (loop thread, one call per finished batch) ---------------------------------
    def deliver_batch(self, entries: list[entry_types.Entry], results: Any,
                      compute_us: int) -> None:
        lock = self.lock
        lock.acquire()
        self.running -= 1
        self.running_items -= len(entries)
        lock.release()
        if type(results) is not list and type(results) is not _Rows:
            # the worker itself failed: every item gets it
            err = results if isinstance(results, LumenError) else InternalError(
                f"worker failed: {results}")
            results = [err] * len(entries)
        # entries answered already (expired or cancelled while running) are skipped
        _deliver(entries, results, compute_us)
        if self.trace is not None:  # the batch span, here on the loop: workers do no OTel work
            try:
                self.trace.batch(self.name, entries, compute_us)
            except Exception:  # a tracing bug must never strand the batch's callers
                log.exception("batch tracing failed")
        if self.on_batch is not None:
            try:
                self.on_batch(len(entries), compute_us)
            except Exception:  # a metrics bug must never strand the batch's callers
                log.exception("batch observer failed")
        if self.idle_event is not None:
            self.maybe_idle()

    def maybe_idle(self) -> None:
        if self.idle_event is not None and not self.pending and not self.running:
            self.idle_event.set()
