# cython: annotation_typing=False
"""The request path's queue side: a batcher's admission state.

One source, two builds.  Cython compiles this file with the declarations of
``lumen_core/_scheduler.pxd`` (its pure-Python mode) into ``lumen_core._scheduler``: the class
below becomes a ``cdef class`` with C fields and its methods C calls.  Run as plain Python
(``LUMEN_NO_EXTENSIONS=1``, or no compiler) the same file is the pure-Python twin.  Nothing here
is written twice.  ``entries.py`` (compiled the same way, its types cimported here) holds what
is admitted: entries, their queues and answers; ``dispatch.py`` is the side before admission:
routes, validation, preparation, ``Runtime.infer``.

- :class:`Admission` -- a batcher's admission state: its lock, counters, the signature queues
  of a dynamic batcher, the idle workers, and every deadline of the batcher in one heap with
  one loop timer for the earliest (as Triton's ``PolicyQueue``), not a timer per request.

``batching/policy.py`` builds the batchers' shared policy on :class:`Admission` (draining,
closing, start-up), ``batching/dynamic.py`` and ``batching/sequence.py`` their formation.
"""
from __future__ import annotations

import asyncio
import heapq
import logging
import time
from threading import Lock as _Lock
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from . import native
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

if TYPE_CHECKING:  # the entries' types (compiled: cimported by _scheduler.pxd)
    from . import entries as entry_types

log = logging.getLogger("lumen.batching")

#: the twin API (``lumen_core._scheduler`` exports the same names)
__all__ = ["Admission", "group_too_large"]

#: the entries of this module's own kind (compiled with compiled: the C types it cimports)
_ent = native.kin(__name__, "entries")
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
#: after the last batch finished, an idle batcher (nothing queued, nothing running) admits one
#: request whatever the prediction says, as a probe: the learnt cost and the budget move only
#: when a batch finishes, so a cost learnt under contention (another process on the cores)
#: would otherwise refuse an idle server forever (issue 38 row 2)
PROBE_IDLE_NS = 500_000_000
#: while nothing runs, a budget shrunk by late answers (``budget_ns`` < ``target_ns``) grows
#: back toward the target, halving the gap every this many ns (no batch finishes to steer it)
BUDGET_HALF_LIFE_NS = 100_000_000
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
                 "cost_batch", "cost_workers", "learnt_ns", "budget_at_ns", "queued_tokens", "probing")

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
        self.queues: dict[Any, entry_types.SignatureQueue] = {}
        #: waiting workers: their wake locks, or a LoopTurn in a parked one's place (dynamic.py)
        self.idle: list[Any] = []
        self.delay_ns = delay_ns
        self.ready_live = ready_live  # a queue this long forms a batch without waiting
        self.deadlines: list[tuple[int, int, entry_types.Entry]] = []
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
        # when the last batch was learnt (QueuePolicy.learn; the probe's idle time counts from
        # it), when budget_ns was last set (its recovery counts from it: budget_now), and the
        # token count of the queued requests (those with a ``length``), tracked while there is
        # a target: a queue of long texts is priced at their lengths (issue 38 row 3)
        self.learnt_ns = 0
        self.budget_at_ns = 0
        self.queued_tokens = 0
        self.probing = False  # a probe was admitted (check_latency); QueuePolicy.learn reads it

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

    def budget_now(self, now: int) -> int:
        """Under the lock: the budget admission plans for at ``now``: ``budget_ns`` (0: the
        target), grown back toward the target while nothing runs (``BUDGET_HALF_LIFE_NS``):
        with nothing running no batch finishes to steer it, and a budget shrunk under
        contention would otherwise stay low on an idle server (issue 38 row 2)."""
        target = self.target_ns
        b = self.budget_ns
        if not b or b >= target:
            return target
        if self.running or now <= self.budget_at_ns:
            return b
        gap = (target - b) * 0.5 ** ((now - self.budget_at_ns) / BUDGET_HALF_LIFE_NS)
        return target - int(gap)

    def excess_ns(self, tokens: int, n: int) -> int:
        """Under the lock: what ``n`` requests of ``tokens`` tokens in all cost beyond ``n``
        typical ones (the learnt cost per token slot, ``cost_tokens_per_item`` a request);
        never below 0 (a queue of short texts is priced as typical ones)."""
        if tokens <= 0 or self.cost_token_ns <= 0.0:
            return 0
        extra = self.cost_token_ns * (tokens - n * self.cost_tokens_per_item)
        return int(extra / self.cost_workers) if extra > 0.0 else 0

    def check_latency(self, n: int, timeout_ns: int, priority: int = 1,
                      length: int = 0, tokens: int = 0) -> None:
        """Under the lock, with a latency target: raise ``Overloaded`` (429, Retry-After the
        predicted drain time) when ``n`` more requests of ``priority`` (of ``length`` tokens
        each, when known: see :meth:`predicted_ns`; or of ``tokens`` tokens in all, a group's
        own lengths) would be answered past the target's budget or past ``timeout_ns``
        (their deadline, 0: none).  The queued requests count at their own lengths too
        (``queued_tokens``).  Admitted requests are never dropped for them: the refusal
        happens before anything is queued.

        An idle batcher whose last batch finished ``PROBE_IDLE_NS`` ago admits one request
        (no deadline tighter than the target) whatever the prediction: a probe, whose batch
        teaches the cost model what the idle server costs now."""
        now = _monotonic_ns()
        limit = self.budget_now(now)
        if limit != self.budget_ns and self.budget_ns:  # fold the recovery in (it compounds)
            self.budget_ns = limit
            self.budget_at_ns = now
        what = "latency target"
        if 0 < timeout_ns < limit:
            limit = timeout_ns
            what = "deadline"
        elif (n == 1 and not self.pending and not self.running
              and now - self.learnt_ns >= PROBE_IDLE_NS):
            self.probing = True
            return  # the probe
        ahead = self.pending
        queued_extra = self.excess_ns(self.queued_tokens, ahead)  # long texts queued ahead
        own_extra = self.excess_ns(tokens, n)  # a group's own long texts
        wait = self.predicted_ns(ahead + n, length) + queued_extra + own_extra
        if wait <= limit:
            return
        if priority < self.levels:  # only requests of its level or above run before it
            ahead = self.queued_up_to(priority)
            queued_extra = 0
            wait = self.predicted_ns(ahead + n, length) + own_extra
            if wait <= limit:
                return
        drain = self.predicted_ns(ahead) + queued_extra if ahead else wait
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
               timeout_ms: int = 0) -> entry_types.Entry:
        """Admit ``item`` (it has ``.signature``) into its signature queue; raise at once when
        closed or full.  ``desc`` (the request's descriptor) is the sequence batcher's."""
        if not self.started:
            self.start()
        if not 1 <= priority <= self.levels:
            raise ValueError(f"priority must be 1..{self.levels}")
        now = _monotonic_ns()
        sig = item.signature
        e: entry_types.Entry = _Entry(item, _Future(loop=self.loop), priority, now, None,
                                      now + timeout_ms * 1_000_000 if timeout_ms > 0 else 0)
        lock = self.lock
        lock.acquire()
        try:
            if self.closed or self.pending >= self.max_queue_size:
                self.admit(1)
            length = 0
            if self.target_ns:
                length = getattr(item, "length", 0) or 0
                if self.cost_ready:
                    self.check_latency(1, timeout_ms * 1_000_000, priority, length)
            self.enqueue(e, sig)
            self.pending += 1
            self.queued_tokens += length
            self.wake_if_formable(e.queue)
        finally:
            lock.release()
        if timeout_ms > 0:
            self.arm(e)
        return e

    def submit_many(self, specs: Sequence[tuple[Any, Any, int, int]]
                    ) -> tuple[entry_types.Group, list[entry_types.Entry]]:
        """Admit a group ``[(item, desc, priority, timeout_ms), ...]`` as a unit (all or
        none); return ``(group, entries)``: ``group.future`` resolves once every entry is
        answered, each entry's ``outcome`` holds its result or error."""
        if not self.started:
            self.start()
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
        tokens = 0
        if self.target_ns:  # each item at its own length, as a single request is priced
            for spec in specs:
                tokens += getattr(spec[0], "length", 0) or 0
        lock = self.lock
        lock.acquire()
        try:
            self.admit(n)
            if self.target_ns and self.cost_ready:
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
                self.arm(e)
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
        self.unqueue(e)

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

    def unqueue(self, e: entry_types.Entry) -> None:
        """Under the lock: drop a dead entry from the formation structures (it leaves its
        deque lazily); the sequence batcher overrides this."""
        q = e.queue
        if q is not None:
            q.live -= 1

    # -- deadlines (loop thread) -----------------------------------------------------------
    def arm(self, e: entry_types.Entry) -> None:
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
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

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

    # -- what subclasses provide -------------------------------------------------------------
    def start(self, loop: Any = None) -> None:  # pragma: no cover - QueuePolicy's
        raise NotImplementedError

    # -- state ------------------------------------------------------------------------------
    @property
    def in_flight(self) -> int:
        """Batches running now."""
        return self.running
