# cython: annotation_typing=False
"""The request path's queue side: the typed homes of a request once it is admitted.

One source, two builds.  Cython compiles this file with the declarations of
``lumen_core/_scheduler.pxd`` (its pure-Python mode) into ``lumen_core._scheduler``: the classes
below become ``cdef class``es with C fields and their methods C calls.  Run as plain Python
(``LUMEN_NO_EXTENSIONS=1``, or no compiler) the same file is the pure-Python twin.  Nothing here
is written twice.  ``dispatch.py`` (compiled the same way) is the side before admission: routes,
validation, preparation, ``Runtime.infer``.

- :class:`Prepared` -- a request ready for batching (execution signature, payload buffers);
- :class:`Admission` -- a batcher's admission state: its lock, counters, the signature queues
  of a dynamic batcher, the idle workers, and every deadline of the batcher in one heap with
  one loop timer for the earliest (as Triton's ``PolicyQueue``), not a timer per request;
- :class:`SignatureQueue` -- one execution signature's queue, one FIFO per priority level;
- :class:`Entry` / :class:`Group` -- a queued request and who waits for it;
- :class:`Rows` -- a finished batch's outputs, split once: a request's result is its row.

``batching/policy.py`` builds the batchers' shared policy on :class:`Admission` (draining,
closing, start-up), ``batching/dynamic.py`` and ``batching/sequence.py`` their formation.
"""
from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections import deque as _deque
from threading import Lock as _Lock
from typing import Any, Callable, Optional, Sequence

from .contract import KEY_TIMEOUT_MS
from .errors import (
    Cancelled,
    DeadlineExceeded,
    InternalError,
    InvalidArgument,
    LumenError,
    Overloaded,
    Unavailable,
)

log = logging.getLogger("lumen.batching")

#: the twin API (``lumen_core._scheduler`` exports the same names)
__all__ = ["Admission", "Entry", "Group", "Prepared", "Rows", "SignatureQueue", "answer",
           "deliver", "group_too_large"]

#: entry states: queued -> running (taken into a batch, under the batcher's lock) -> done
QUEUED, RUNNING, DONE = 0, 1, 2
#: Retry-After hint (seconds) sent with ``Overloaded``
OVERLOAD_RETRY_AFTER_S = 1
#: the deadline error's field
DEADLINE_FIELD = KEY_TIMEOUT_MS
#: the deadline heap is rebuilt without answered entries once it holds this many and at least
#: twice what it held after the last rebuild (answered entries leave it lazily)
DEADLINE_COMPACT_MIN = 256
#: the metrics routes a request may take
RAW, TENSOR = "raw", "tensor"


class _Unset:
    __slots__ = ()

    def __repr__(self) -> str:
        return "UNSET"


#: ``Entry.outcome`` before the entry is answered
UNSET: Any = _Unset()

_Future = asyncio.Future
_CancelledError = asyncio.CancelledError
_monotonic_ns = time.monotonic_ns
_perf_ns = time.perf_counter_ns
_heappush = heapq.heappush
_heappop = heapq.heappop


# ------------------------------------------------------------------------------ entries
class Group:
    """One future for several entries (``infer_many``, a pipeline step's items): it resolves
    once every entry is answered; each entry's ``outcome`` holds its own result or error."""

    __slots__ = ("future", "remaining")

    def __init__(self, future: asyncio.Future, n: int):
        self.future = future
        self.remaining = n

    def one_done(self) -> None:
        self.remaining -= 1
        if self.remaining == 0 and not self.future.done():
            self.future.set_result(None)


class Entry:
    """A queued request: the item, who waits for it (a future or a :class:`Group`), its
    timing, and once answered its ``outcome`` (a result, :class:`Rows` with ``row``, or a
    ``LumenError``).

    ``queue`` is the dynamic batcher's :class:`SignatureQueue` holding it; ``seq``, ``start``,
    ``end`` and ``was_open`` are the sequence batcher's; ``span`` the request's tracing span
    (None unless tracing is on); ``route``, ``kind`` and ``t0`` the dispatcher's.
    """

    __slots__ = ("item", "waiter", "priority", "arrival_ns", "dispatch_ns", "deadline_ns",
                 "state", "outcome", "row", "batch_size", "compute_us", "queue", "seq", "start",
                 "end", "was_open", "span", "route", "kind", "t0")

    def __init__(self, item: Any, waiter: Any, priority: int, arrival_ns: int,
                 queue: Any = None, deadline_ns: int = 0):
        self.item = item
        self.waiter = waiter
        self.priority = priority
        self.arrival_ns = arrival_ns
        self.dispatch_ns = 0
        self.deadline_ns = deadline_ns
        self.state = QUEUED
        self.outcome = UNSET
        self.row = -1
        self.batch_size = 0
        self.compute_us = 0
        self.queue = queue
        self.seq: Any = None
        self.start = False
        self.end = False
        self.was_open = True
        self.span: Any = None
        self.route: Any = None  # the Route (task version) the Dispatcher admitted it for
        self.kind: str = RAW  # its metrics route
        self.t0 = 0  # when the Dispatcher took it (monotonic ns; observed requests only)

    @property
    def queue_us(self) -> int:
        return (self.dispatch_ns - self.arrival_ns) // 1000 if self.dispatch_ns else 0

    @property
    def timeout_ms(self) -> int:
        """The deadline the entry was admitted with (0: none)."""
        return (self.deadline_ns - self.arrival_ns) // 1_000_000 if self.deadline_ns else 0

    def result(self) -> Any:
        """The answered result as a mapping of outputs (a batch row is split out here)."""
        out = self.outcome
        if type(out) is Rows:
            return out.row(self.row)
        return out


def answer(e: Entry, outcome: Any) -> None:
    """Answer ``e`` once (loop thread): a later answer for the same entry is dropped."""
    if e.outcome is not UNSET:
        return
    e.state = DONE
    e.outcome = outcome
    w = e.waiter
    if type(w) is Group:
        w.one_done()
    elif not w.done():
        if isinstance(outcome, LumenError):
            w.set_exception(outcome)
        else:
            w.set_result(outcome)


def deliver(entries: list, results: Any, compute_us: int) -> None:
    """Answer every entry of a finished batch that is still unanswered: with its own result,
    or (``results`` a :class:`Rows`) with the batch's outputs and its row."""
    n = len(entries)
    i = 0
    if type(results) is Rows:
        for i in range(n):
            e = entries[i]
            if e.outcome is UNSET:
                e.batch_size = n
                e.compute_us = compute_us
                e.row = i
                answer(e, results)
        return
    for i in range(n):  # one result per entry: run_split guarantees it
        e = entries[i]
        if e.outcome is UNSET:
            e.batch_size = n
            e.compute_us = compute_us
            answer(e, results[i])


class Rows:
    """A finished batch's outputs, split once for the whole batch: item ``i``'s result is
    ``{name: array[i]}`` (made only when someone reads it, :meth:`row`)."""

    __slots__ = ("arrays", "n")

    def __init__(self, arrays: dict, n: int):
        self.arrays = arrays
        self.n = n

    def row(self, i: int) -> dict:
        # views, never copies (a batch's outputs are never recycled); 0-d for a 1-D output
        return {k: v[i, ...] for k, v in self.arrays.items()}

    def __len__(self) -> int:
        return self.n


# ------------------------------------------------------------------------------ items
class Prepared:
    """One request ready for batching (``engine.plan.PreparedModelRequest``).

    ``signature`` is the execution signature: only items with equal signatures share a batch.
    ``tensors`` holds the per-input payload buffers (indexed by the plan's ``slot``),
    ``item_shape`` the per-item shape of dense inputs (no batch axis), ``length`` the token
    count of ragged inputs (length-aware batching).
    """

    __slots__ = ("signature", "tensors", "item_shape", "length")

    def __init__(self, signature: Any, tensors: tuple, item_shape: tuple = (), length: int = 0):
        self.signature = signature
        self.tensors = tensors
        self.item_shape = item_shape
        self.length = length


# ------------------------------------------------------------------------------ queues
class SignatureQueue:
    """Requests of one execution signature: one FIFO per priority level (index 0 = highest).
    Only touched under the batcher's lock."""

    __slots__ = ("signature", "levels", "live")

    def __init__(self, signature: Any, levels: int):
        self.signature = signature
        self.levels: list[_deque] = [_deque() for _ in range(levels)]
        self.live = 0

    def head(self) -> Optional[Entry]:
        """The oldest live entry of the highest non-empty level (dead ones are dropped)."""
        for level in self.levels:
            while level and level[0].state != QUEUED:
                level.popleft()
            if level:
                return level[0]
        return None

    def take(self, n: int, now: int, policy: "Admission") -> list:
        """Pop up to ``n`` live entries, highest priority first, FIFO within a level, and mark
        them running; an entry past its deadline is killed instead (never run)."""
        out = []
        k = 0
        for level in self.levels:
            while level and k < n:
                e = level.popleft()
                if e.state == QUEUED:
                    if e.deadline_ns and e.deadline_ns <= now:
                        policy.kill(e)
                    else:
                        e.state = RUNNING
                        e.dispatch_ns = now
                        out.append(e)
                        k += 1
            if k == n:
                break
        self.live -= k
        return out


# ------------------------------------------------------------------------------ admission
def group_too_large(task: str, n: int, max_queue_size: int) -> InvalidArgument:
    """The error of a call of ``n`` inputs that the task's whole queue cannot hold: never
    admitted, so not retryable (a 400, not a 429)."""
    return InvalidArgument(f"{n} inputs in one call exceed task {task!r}'s queue "
                           f"(batching.max_queue_size = {max_queue_size}); send at most "
                           f"{max_queue_size} per call or raise max_queue_size", "input")


class Admission:
    """A batcher's admission state and the policy every request meets on the loop thread:
    admission (``max_queue_size``), the signature queues of a dynamic batcher, waking an idle
    worker when a batch can form, deadlines, cancellation and the delivery of finished
    batches.  ``batching/policy.QueuePolicy`` adds the life cycle (start, drain, close).

    Threads: ``lock`` guards the queues, the counters and entry states; workers take batches
    under it.  Deadlines: every deadline of the batcher sits in one heap (``deadlines``) with
    one loop timer for the earliest; an entry answered before its deadline leaves the heap
    lazily.  An idle worker waits on its own lock (:meth:`wait_for_work`); a request wakes one
    only when it makes a batch formable: the first pending request, a queue reaching its
    ready size, or any request when ``max_queue_delay_us`` is 0.
    """

    __slots__ = ("name", "max_queue_size", "levels", "lock", "pending", "running",
                 "running_items", "closed",
                 "stopping", "started", "loop", "queues", "idle", "delay_ns", "ready_live",
                 "deadlines", "deadline_count", "compact_at", "timer", "timer_ns", "trace",
                 "on_batch", "idle_event", "target_ns", "budget_ns", "cost_ready",
                 "cost_fixed_ns", "cost_item_ns", "cost_token_ns", "cost_tokens_per_item",
                 "cost_batch", "cost_workers")

    def __init__(self, name: str, max_queue_size: int, levels: int = 1, delay_ns: int = 0,
                 ready_live: int = 1, on_batch: Optional[Callable[[int, int], None]] = None):
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
        self.queues: dict[Any, SignatureQueue] = {}
        self.idle: list = []  # the wake locks of workers waiting for work
        self.delay_ns = delay_ns
        self.ready_live = ready_live  # a queue this long forms a batch without waiting
        self.deadlines: list[tuple] = []
        self.deadline_count = 0
        self.compact_at = DEADLINE_COMPACT_MIN
        self.timer: Optional[asyncio.TimerHandle] = None
        self.timer_ns = 0
        self.trace: Any = None  # the runtime's tracing.Tracing when tracing is on
        self.on_batch = on_batch  # (batch_size, compute_us) -> None, for metrics
        self.idle_event: Optional[asyncio.Event] = None  # asyncio.Event while somebody drains
        # latency target (issue 30): 0 = none.  With one, a request whose predicted completion
        # falls past the target's budget (or its deadline) is refused at admission
        # (check_latency).  ``budget_ns`` is what admission plans for: the target, less the
        # headroom QueuePolicy.steer takes while answers run late (0: the whole target).
        # The cost_* fields are the task's learnt cost (batching/cost.py), written once per
        # finished batch by QueuePolicy.learn: a batch of n costs cost_fixed_ns + n *
        # cost_item_ns (an item of the typical cost_tokens_per_item token slots; each slot
        # more or less costs cost_token_ns), batches run cost_batch at a time on
        # cost_workers engine instances
        self.target_ns = 0
        self.budget_ns = 0
        self.cost_ready = False
        self.cost_fixed_ns = 0.0
        self.cost_item_ns = 0.0
        self.cost_token_ns = 0.0
        self.cost_tokens_per_item = 0.0
        self.cost_batch = 1
        self.cost_workers = 1

    # -- admission (loop thread) ------------------------------------------------------------
    def admit(self, n: int) -> None:
        """Raise the precise error when ``n`` more requests cannot be admitted now."""
        if self.closed:
            raise Unavailable(f"task {self.name!r} is shutting down; not accepting requests")
        if n > self.max_queue_size:
            raise group_too_large(self.name, n, self.max_queue_size)
        if self.pending + n > self.max_queue_size:
            raise Overloaded(f"task {self.name!r} queue is full ({self.max_queue_size} pending); "
                             f"retry later", None, OVERLOAD_RETRY_AFTER_S)

    def predicted_ns(self, k: int, length: int = 0) -> int:
        """Under the lock: ns until the ``k``-th request in line (counting every pending one)
        would be answered, at the learnt cost: the whole batches ahead of its own, run
        ``cost_workers`` at a time, then its own (partial) batch, after what is left of the
        batches running now (half of each, on average: ``running`` batches of ``running_items``
        requests in all).  ``length`` (> 0: the request's own token count) prices its own
        batch at that length instead of the typical one (the cost per token slot, learnt):
        length-aware formation batches it with texts of about its length, so a long text's
        batch costs what long texts cost (``cost_batch`` follows the batches formed, a few
        texts each when lengths are mixed)."""
        b = self.cost_batch
        fixed = self.cost_fixed_ns
        item = self.cost_item_ns
        batch_ns = fixed + b * item
        ahead = (k - 1) // b  # whole batches before the one it runs in
        w = self.cost_workers
        own = item
        if length > 0 and self.cost_token_ns > 0.0:
            own = item + self.cost_token_ns * (length - self.cost_tokens_per_item)
            if own < 0.0:
                own = 0.0
        wait = ahead * batch_ns / w + fixed + (k - ahead * b) * own
        if self.running:
            wait += (self.running * fixed + self.running_items * item) / (2 * w)
        return int(wait)

    def check_latency(self, n: int, timeout_ns: int, priority: int = 1,
                      length: int = 0) -> None:
        """Under the lock, with a latency target: raise ``Overloaded`` (429, Retry-After the
        predicted drain time) when ``n`` more requests of ``priority`` (of ``length`` tokens
        each, when known: see :meth:`predicted_ns`) would be answered past the target's
        budget or past ``timeout_ns`` (their deadline, 0: none).  Admitted requests are never
        dropped for them: the refusal happens before anything is queued."""
        limit = self.budget_ns if 0 < self.budget_ns < self.target_ns else self.target_ns
        what = "latency target"
        if 0 < timeout_ns < limit:
            limit = timeout_ns
            what = "deadline"
        ahead = self.pending
        wait = self.predicted_ns(ahead + n, length)
        if wait <= limit:
            return
        if priority < self.levels:  # only requests of its level or above run before it
            ahead = self.queued_up_to(priority)
            wait = self.predicted_ns(ahead + n, length)
            if wait <= limit:
                return
        drain = self.predicted_ns(ahead) if ahead else wait
        retry = max(1, (drain + 999_999_999) // 1_000_000_000)  # whole seconds, rounded up
        if what == "deadline":
            what = f"deadline of {limit // 1_000_000} ms"
        elif limit < self.target_ns:  # the budget: answers have been running late
            what = (f"latency target of {self.target_ns // 1_000_000} ms (admitting to "
                    f"{limit // 1_000_000} ms while answers run late)")
        else:
            what = f"latency target of {limit // 1_000_000} ms"
        raise Overloaded(f"task {self.name!r} cannot answer within its {what}: "
                         f"{ahead} requests queued ahead drain "
                         f"in about {(drain + 500_000) // 1_000_000} ms at the learnt rate, so "
                         f"this one would finish in about {(wait + 500_000) // 1_000_000} ms; "
                         f"refused at once (nothing was queued), retry in {retry} s", None, retry)

    def refuse_late(self, priority: int, timeout_ms: int) -> None:
        """Loop thread, before a request is prepared (tokenised, decoded): refuse it now if
        :meth:`check_latency` would refuse it at submit whatever its length (priced at one
        token: its length is not known yet), so a refusal under overload costs the parsing
        and no more (the preparation of a text or an image is most of what a request costs
        the loop, and on a small box the loop shares the cores with the model).  Only when
        the cost is learnt; ``submit`` checks again under the same lock, with its length."""
        if not self.cost_ready:
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

    def submit(self, item: Any, desc: Any = None, priority: int = 1,
               timeout_ms: int = 0) -> Entry:
        """Admit ``item`` (it has ``.signature``) into its signature queue; raise at once when
        closed or full.  ``desc`` (the request's descriptor) is the sequence batcher's."""
        if not self.started:
            self.start()
        if not 1 <= priority <= self.levels:
            raise ValueError(f"priority must be 1..{self.levels}")
        now = _monotonic_ns()
        sig = item.signature
        e = Entry(item, _Future(loop=self.loop), priority, now, None,
                  now + timeout_ms * 1_000_000 if timeout_ms > 0 else 0)
        lock = self.lock
        lock.acquire()
        try:
            if self.closed or self.pending >= self.max_queue_size:
                self.admit(1)
            if self.target_ns and self.cost_ready:
                self.check_latency(1, timeout_ms * 1_000_000, priority,
                                   getattr(item, "length", 0) or 0)
            self.enqueue(e, sig)
            self.pending += 1
            self.wake_if_formable(e.queue)
        finally:
            lock.release()
        if timeout_ms > 0:
            self.arm(e)
        return e

    def submit_many(self, specs: Sequence[tuple]) -> tuple:
        """Admit a group ``[(item, desc, priority, timeout_ms), ...]`` as a unit (all or
        none); return ``(group, entries)``: ``group.future`` resolves once every entry is
        answered, each entry's ``outcome`` holds its result or error."""
        if not self.started:
            self.start()
        n = len(specs)
        group = Group(_Future(loop=self.loop), n)
        entries: list[Entry] = []
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
            entries.append(Entry(item, group, priority, now, None,
                                 now + timeout_ms * 1_000_000 if timeout_ms > 0 else 0))
        lock = self.lock
        lock.acquire()
        try:
            self.admit(n)
            if self.target_ns and self.cost_ready:
                self.check_latency(n, min([s[3] for s in specs if s[3] > 0] or [0]) * 1_000_000,
                                   max([s[2] for s in specs]))
            for k in range(n):
                self.enqueue(entries[k], sigs[k])
            self.pending += n
            self.wake_if_formable(None)
        finally:
            lock.release()
        for e in entries:
            if e.deadline_ns:
                self.arm(e)
        return group, entries

    def enqueue(self, e: Entry, sig: Any) -> None:
        """Under the lock: queue ``e`` in the signature queue of ``sig``."""
        q = self.queues.get(sig)
        if q is None:
            q = self.queues[sig] = SignatureQueue(sig, self.levels)
        q.levels[e.priority - 1].append(e)
        q.live += 1
        e.queue = q

    def wake_if_formable(self, q: Optional[SignatureQueue]) -> None:
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

    def wait_for_work(self, wake: Any, timeout: float, idle: list) -> None:
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
    def kill(self, e: Entry) -> None:
        """Under the lock: a queued entry dies (it never runs)."""
        e.state = DONE
        self.pending -= 1
        self.unqueue(e)

    def unqueue(self, e: Entry) -> None:
        """Under the lock: drop a dead entry from the formation structures (it leaves its
        deque lazily); the sequence batcher overrides this."""
        q = e.queue
        if q is not None:
            q.live -= 1

    # -- deadlines (loop thread) -----------------------------------------------------------
    def arm(self, e: Entry) -> None:
        """Put ``e``'s deadline in the heap; re-arm the one timer when it is the earliest."""
        self.deadline_count += 1
        _heappush(self.deadlines, (e.deadline_ns, self.deadline_count, e))
        if len(self.deadlines) >= self.compact_at:
            self.deadlines = [d for d in self.deadlines if d[2].outcome is UNSET]
            heapq.heapify(self.deadlines)
            self.compact_at = max(DEADLINE_COMPACT_MIN, 2 * len(self.deadlines))
        if self.timer is None or e.deadline_ns < self.timer_ns:
            self.set_timer(e.deadline_ns)

    def set_timer(self, at_ns: int) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer_ns = at_ns
        loop = self.loop
        assert loop is not None  # started: the first submit binds the loop
        self.timer = loop.call_later(max(0, at_ns - _monotonic_ns()) / 1e9,
                                          self.expire_due)

    def expire_due(self) -> None:
        """The timer: answer every entry whose deadline has passed, then re-arm."""
        self.timer = None
        heap = self.deadlines
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
        if expired:
            self.maybe_idle()

    def expire(self, e: Entry) -> None:
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
        answer(e, DeadlineExceeded(f"deadline of {e.timeout_ms} ms expired {where}",
                                   DEADLINE_FIELD))

    def stop_timer(self) -> None:
        """Loop thread, at close: no more deadline callbacks."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    # -- cancellation (loop thread) --------------------------------------------------------
    def cancel(self, entry: Entry) -> None:
        """The caller went away: drop a queued entry (a running one finishes unseen)."""
        if entry.outcome is not UNSET:
            return
        lock = self.lock
        lock.acquire()
        if entry.state == QUEUED:
            self.kill(entry)
        lock.release()
        answer(entry, Cancelled("the request was cancelled by its caller"))
        w = entry.waiter
        if type(w) is not Group and w.done() and not w.cancelled():
            w.exception()  # a caller that went away never reads it: no "never retrieved" log
        self.maybe_idle()

    def cancel_group(self, entries: Sequence[Entry]) -> None:
        for e in entries:
            self.cancel(e)

    def refuse(self, entries: Sequence[Entry]) -> None:
        """Loop thread: answer entries a closing batcher will never run."""
        for e in entries:
            answer(e, Unavailable(f"task {self.name!r} shut down before this request ran"))
        self.maybe_idle()

    # -- delivery (loop thread, one call per finished batch) ---------------------------------
    def deliver_batch(self, entries: list, results: Any, compute_us: int) -> None:
        lock = self.lock
        lock.acquire()
        self.running -= 1
        self.running_items -= len(entries)
        lock.release()
        if type(results) is not list and type(results) is not Rows:
            # the worker itself failed: every item gets it
            err = results if isinstance(results, LumenError) else InternalError(
                f"worker failed: {results}")
            results = [err] * len(entries)
        # entries answered already (expired or cancelled while running) are skipped
        deliver(entries, results, compute_us)
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

    # -- what subclasses provide -------------------------------------------------------------
    def start(self, loop: Any = None) -> None:  # pragma: no cover - QueuePolicy's
        raise NotImplementedError

    # -- state ------------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Batches running now."""
        return self.running
