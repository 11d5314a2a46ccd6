"""Dynamic batcher with Triton-class queue policy.

Design (after Triton's ``dynamic_batch_scheduler.cc``): one batcher per task, one queue per
execution signature, each queue holding one FIFO per priority level.  Queue *policy*
(admission, priorities, deadlines, cancellation) is kept apart from batch *formation*, which
happens only when an engine worker is free: under load batches grow by themselves, under light
load a lone request runs at once (``max_queue_delay_us = 0``) or after at most the delay.

Everything runs on the event loop thread except ``Worker.execute``, which runs in the worker's
own thread (ONNX Runtime releases the GIL).  There is no scheduler task: dispatch is a plain
function called when a request arrives, when a worker frees up and when a delay timer fires, so
a request costs one future and a deque append, not a task switch.

Cancelled and expired requests are removed lazily (marked dead, skipped at batch formation) but
leave the admission count at once, so ``max_queue_size`` counts only live requests.

Length-aware formation (``max_batch_tokens > 0``, for ragged inputs such as token ids): a batch
is padded to its longest item, so mixing a 200-token text into a batch of 15-token texts makes
the whole batch pay for 200 tokens per row (and attention for 200^2).  Instead of length buckets
in the signature (which split the queue into small per-bucket batches and still pad up to 2x
inside a bucket) the batcher sorts the oldest ``LENGTH_WINDOW_FACTOR * max_batch_size`` live
requests of the head's priority level by length when a worker frees up and takes a contiguous
run of that order which contains the oldest request (so nothing starves and FIFO progress is
kept), grown from it one neighbour at a time while the batch stays within ``max_batch_size``,
the token budget ``n * max_len <= max_batch_tokens`` (text-embeddings-inference's knob: it bounds
a batch's memory and run time), and each newcomer adds little padding beyond its own length
(``PAD_TOLERANCE``, ``PAD_SLACK_TOKENS``).  On CPU a batch costs about its padded slots, so a
long text that would make 31 short rows pay for its length runs in a batch of long texts
instead, one batch later.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from typing import Any, Callable, Optional, Protocol, Sequence

from ..config import BatchingConfig
from ..errors import Cancelled, DeadlineExceeded, InternalError, LumenError, Overloaded, Unavailable

log = logging.getLogger("lumen.batching")

QUEUED, RUNNING, DONE = 0, 1, 2
#: Retry-After hint (seconds) sent with ``Overloaded``
OVERLOAD_RETRY_AFTER_S = 1
#: length-aware formation looks at the oldest ``factor * max_batch_size`` live requests
LENGTH_WINDOW_FACTOR = 4
#: a request joins a length-aware batch while the padded slots it adds beyond its own length
#: stay within ``PAD_TOLERANCE * length + PAD_SLACK_TOKENS``.  On CPU a batch costs about its
#: padded slots and batching buys little beyond that (bench/README.md, text_embed: 0/4 beat
#: 0.1/8 and 0.25/16 on the length-mixed corpus), so only near-equal lengths share a batch; a
#: GPU, where rows are nearly free, would want a larger tolerance.
PAD_TOLERANCE = 0.0
PAD_SLACK_TOKENS = 4


class Worker(Protocol):
    """One engine instance as the batcher sees it."""

    executor: Any  # a concurrent.futures.Executor with one thread

    def execute(self, items: Sequence[Any]) -> list:
        """Run one batch; return one result (or LumenError) per item, in order."""


class Entry:
    """A queued request: the item, its caller's future, and its timing."""

    __slots__ = ("item", "future", "priority", "arrival_ns", "dispatch_ns", "timer", "state")

    def __init__(self, item: Any, future: asyncio.Future, priority: int, arrival_ns: int):
        self.item = item
        self.future = future
        self.priority = priority
        self.arrival_ns = arrival_ns
        self.dispatch_ns = 0
        self.timer: Optional[asyncio.TimerHandle] = None
        self.state = QUEUED


class BatchResult:
    """What a caller's future resolves to."""

    __slots__ = ("value", "batch_size", "queue_us", "compute_us")

    def __init__(self, value: Any, batch_size: int, queue_us: int, compute_us: int):
        self.value = value
        self.batch_size = batch_size
        self.queue_us = queue_us
        self.compute_us = compute_us


class SignatureQueue:
    """Requests of one execution signature: one FIFO per priority level (index 0 = highest)."""

    __slots__ = ("signature", "levels", "live")

    def __init__(self, signature: Any, levels: int):
        self.signature = signature
        self.levels = [deque() for _ in range(levels)]
        self.live = 0

    def head(self) -> Optional[Entry]:
        for level in self.levels:
            while level and level[0].state != QUEUED:
                level.popleft()
            if level:
                return level[0]
        return None

    def take(self, n: int) -> list:
        """Pop up to ``n`` live entries, highest priority first, FIFO within a level."""
        out: list = []
        for level in self.levels:
            while level and len(out) < n:
                e = level.popleft()
                if e.state == QUEUED:
                    out.append(e)
            if len(out) == n:
                break
        self.live -= len(out)
        return out

    def take_by_length(self, n: int, max_tokens: int, window: int) -> list:
        """Pop up to ``n`` live entries of similar length (see the module docstring).

        Candidates are the oldest ``window`` live entries of the highest non-empty priority
        level; the chosen ones are marked running in place (the deques drop them lazily, like
        cancelled entries), so nothing is copied or rebuilt.
        """
        level = None
        for lv in self.levels:
            while lv and lv[0].state != QUEUED:
                lv.popleft()
            if lv:
                level = lv
                break
        if level is None:
            return []
        cands = []
        for e in level:
            if e.state == QUEUED:
                cands.append(e)
                if len(cands) == window:
                    break
        head = cands[0]
        # stable: equal lengths keep arrival order
        cands.sort(key=_item_length)
        lengths = [_item_length(e) for e in cands]
        p = cands.index(head)
        lo, hi = _length_window(lengths, p, n, max_tokens)
        out = cands[lo:hi]
        for e in out:
            e.state = RUNNING  # the caller (_start) stamps dispatch time; deques skip it
        self.live -= len(out)
        return out


def _item_length(entry: Entry) -> int:
    return max(1, getattr(entry.item, "length", 0) or 0)


def _length_window(lengths: Sequence[int], p: int, n: int, max_tokens: int) -> tuple:
    """``(lo, hi)``: a slice of the ascending ``lengths`` around ``p`` (the oldest request).

    Grown greedily from ``[p, p + 1)`` by the neighbour that adds the fewest padded slots
    beyond its own length, while (a) the slice holds fewer than ``n`` items, (b) ``size *
    max_len <= max_tokens`` and (c) that excess is at most ``PAD_TOLERANCE * length +
    PAD_SLACK_TOKENS``: a request joins only if it costs the batch about what it would cost in
    a batch of its own length.  The excess only grows further out, so the first refusal on a
    side is final for that side.
    """
    m = len(lengths)
    lo, hi = p, p + 1
    top = lengths[p]
    while hi - lo < n:
        size = hi - lo
        left = right = None
        if lo > 0:
            x = lengths[lo - 1]  # shorter: pads up to ``top``
            excess = top - x
            if excess <= PAD_TOLERANCE * x + PAD_SLACK_TOKENS and (size + 1) * top <= max_tokens:
                left = excess
        if hi < m:
            x = lengths[hi]  # longer: every row already in pads up to ``x``
            excess = size * (x - top)
            if excess <= PAD_TOLERANCE * x + PAD_SLACK_TOKENS and (size + 1) * x <= max_tokens:
                right = excess
        if left is None and right is None:
            break
        if right is None or (left is not None and left <= right):
            lo -= 1
        else:
            top = lengths[hi]
            hi += 1
    return lo, hi


def run_split(execute: Callable[[Sequence[Any]], list], items: Sequence[Any]) -> list:
    """Run a batch; if the whole run fails, split it in halves and retry, so the error lands
    only on the item(s) that cause it and every other item still gets its result."""
    try:
        results = execute(items)
        if len(results) != len(items):
            raise InternalError(f"worker returned {len(results)} results for {len(items)} items")
        return results
    except Exception as exc:  # noqa: BLE001 - any model failure is isolated, never propagated
        if len(items) == 1:
            if isinstance(exc, LumenError):
                return [exc]
            return [InternalError(f"model execution failed for this input: {exc}")]
        mid = len(items) // 2
        return run_split(execute, items[:mid]) + run_split(execute, items[mid:])


class BatcherLifecycle:
    """Admission counters and draining, shared by the dynamic and the sequence batcher."""

    def __init__(self) -> None:
        self._pending = 0  # live queued requests (admission control)
        self._running = 0  # batches in flight
        self._closed = False
        self._idle: Optional[asyncio.Event] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None

    @property
    def pending(self) -> int:
        """Queued (not yet running) requests."""
        return self._pending

    @property
    def in_flight(self) -> int:
        """Batches running now."""
        return self._running

    async def drain(self) -> None:
        """Stop admitting, then wait until every queued and running request has finished."""
        self._closed = True
        while self._pending or self._running:
            # one event shared by every concurrent drainer (a fresh one per caller would
            # leave all but the last waiting forever)
            if self._idle is None or self._idle.is_set():
                self._idle = asyncio.Event()
            await self._idle.wait()

    def _maybe_idle(self) -> None:
        if self._idle is not None and not self._pending and not self._running:
            self._idle.set()

    def _outcome(self, fut: asyncio.Future, n: int) -> tuple:
        """(results, compute_us) of a finished batch; a broken worker fails every item."""
        try:
            results, compute_us = fut.result()
        except BaseException as exc:  # noqa: BLE001 - a broken worker must not lose callers
            err = exc if isinstance(exc, LumenError) else InternalError(f"worker failed: {exc}")
            results, compute_us = [err] * n, 0
        if self.on_batch is not None:
            try:
                self.on_batch(n, compute_us)
            except Exception:  # a metrics bug must never strand the batch's callers
                log.exception("batch observer failed")
        return results, compute_us

    @staticmethod
    def _resolve(e: "Entry", res: Any, n: int, compute_us: int) -> None:
        """Hand one item's result (or error) to its caller, unless it already gave up."""
        e.state = DONE
        if e.timer is not None:
            e.timer.cancel()
            e.timer = None
        if e.future.done():
            return
        if isinstance(res, LumenError):
            e.future.set_exception(res)
        else:
            e.future.set_result(BatchResult(res, n, (e.dispatch_ns - e.arrival_ns) // 1000,
                                            compute_us))


class DynamicBatcher(BatcherLifecycle):
    """Per-task dynamic batcher over a pool of workers."""

    def __init__(self, name: str, config: BatchingConfig, workers: Sequence[Worker],
                 on_batch: Optional[Callable[[int, int], None]] = None, max_batch_tokens: int = 0):
        """``max_batch_tokens > 0`` turns on length-aware formation for items with ``.length``
        (token budget per batch, padded slots counted); 0 keeps strict FIFO batches."""
        super().__init__()
        self.name = name
        self.config = config
        self.workers = list(workers)
        self.on_batch = on_batch  # (batch_size, compute_us) -> None, for metrics
        self._free = list(reversed(self.workers))
        self._queues: dict = {}
        self._timer: Optional[asyncio.TimerHandle] = None
        self._timer_at = 0.0
        self._delay_ns = config.max_queue_delay_us * 1000
        self._preferred = tuple(config.preferred_batch_sizes)
        self._levels = config.priority_levels
        self._max_tokens = max(0, int(max_batch_tokens))
        self._window = LENGTH_WINDOW_FACTOR * config.max_batch_size

    # -- public ---------------------------------------------------------------------------
    def submit(self, item: Any, priority: int = 1, timeout_ms: int = 0) -> Entry:
        """Admit ``item`` (must have ``.signature``); raise at once when closed or full."""
        if self._closed:
            raise Unavailable(f"task {self.name!r} is shutting down; not accepting requests")
        if self._pending >= self.config.max_queue_size:
            raise Overloaded(f"task {self.name!r} queue is full ({self.config.max_queue_size} "
                             f"pending); retry later", None, OVERLOAD_RETRY_AFTER_S)
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        entry = Entry(item, loop.create_future(), priority, time.monotonic_ns())
        sig = item.signature
        q = self._queues.get(sig)
        if q is None:
            q = self._queues[sig] = SignatureQueue(sig, self._levels)
        q.levels[priority - 1].append(entry)
        q.live += 1
        self._pending += 1
        if timeout_ms > 0:
            entry.timer = loop.call_later(timeout_ms / 1000.0, self._expire, entry, q, timeout_ms)
        self._dispatch()
        return entry

    async def infer(self, item: Any, priority: int = 1, timeout_ms: int = 0) -> BatchResult:
        entry = self.submit(item, priority, timeout_ms)
        try:
            return await entry.future
        except asyncio.CancelledError:
            self.cancel(entry)
            raise

    def cancel(self, entry: Entry) -> None:
        """The caller went away: drop a queued entry (a running one finishes unseen)."""
        if entry.state == QUEUED:
            self._kill(entry, self._queues.get(entry.item.signature))
        if not entry.future.done():
            entry.future.set_exception(Cancelled("the request was cancelled by its caller"))
        if entry.timer is not None:
            entry.timer.cancel()

    # -- policy ---------------------------------------------------------------------------
    def _kill(self, entry: Entry, q: Optional[SignatureQueue]) -> None:
        entry.state = DONE
        self._pending -= 1
        if q is not None:
            q.live -= 1
        self._maybe_idle()

    def _expire(self, entry: Entry, q: SignatureQueue, timeout_ms: int) -> None:
        entry.timer = None
        if entry.state == DONE or entry.future.done():
            return
        where = "in the queue" if entry.state == QUEUED else "while its batch was running"
        if entry.state == QUEUED:
            self._kill(entry, q)
        entry.future.set_exception(DeadlineExceeded(
            f"deadline of {timeout_ms} ms expired {where}", "lumen.timeout_ms"))

    # -- batch formation ------------------------------------------------------------------
    def _batch_size(self, live: int) -> int:
        cap = min(live, self.config.max_batch_size)
        if self._preferred:
            fits = [p for p in self._preferred if p <= cap]
            if fits and cap < self.config.max_batch_size:
                return fits[-1]
        return cap

    def _ready_at(self, q: SignatureQueue, head: Entry) -> int:
        """Monotonic ns at which ``q`` may form a batch (0: now)."""
        if self._delay_ns == 0 or q.live >= self.config.max_batch_size:
            return 0
        if self._preferred and q.live >= self._preferred[-1]:
            return 0
        return head.arrival_ns + self._delay_ns

    def _dispatch(self) -> None:
        while self._free and self._pending:
            now = time.monotonic_ns()
            best = None
            best_key = None
            wake_at = 0
            for q in self._queues.values():
                if not q.live:
                    continue
                head = q.head()
                if head is None:
                    continue
                ready = self._ready_at(q, head)
                if ready > now:
                    wake_at = ready if not wake_at else min(wake_at, ready)
                    continue
                key = (head.priority, head.arrival_ns)
                if best_key is None or key < best_key:
                    best, best_key = q, key
            if best is None:
                if wake_at:
                    self._arm_timer(wake_at)
                return
            size = self._batch_size(best.live)
            if self._max_tokens:
                entries = best.take_by_length(size, self._max_tokens, max(size, self._window))
            else:
                entries = best.take(size)
            self._start(best, entries, now)

    def _arm_timer(self, at_ns: int) -> None:
        loop = self._loop
        when = loop.time() + max(0, at_ns - time.monotonic_ns()) / 1e9
        if self._timer is not None:
            if self._timer_at <= when:
                return
            self._timer.cancel()
        self._timer_at = when
        self._timer = loop.call_at(when, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        self._dispatch()

    def _start(self, q: SignatureQueue, entries: list, now: int) -> None:
        self._pending -= len(entries)
        for e in entries:
            e.state = RUNNING
            e.dispatch_ns = now
        worker = self._free.pop()
        self._running += 1
        fut = self._loop.run_in_executor(worker.executor, _timed_run, worker.execute, entries)
        fut.add_done_callback(lambda f: self._finish(worker, entries, f))

    def _finish(self, worker: Worker, entries: list, fut: asyncio.Future) -> None:
        self._running -= 1
        self._free.append(worker)
        n = len(entries)
        results, compute_us = self._outcome(fut, n)
        for e, res in zip(entries, results, strict=True):
            self._resolve(e, res, n, compute_us)
        self._dispatch()
        self._maybe_idle()


def _timed_run(execute: Callable, entries: list) -> tuple:
    """Worker-thread side of a batch: run the entries whose callers still wait.

    An entry that expired or was cancelled between batch formation and the worker picking the
    batch up (its future is done) is left out, so it never reaches the model; its result slot
    is None (``_finish`` skips done futures).
    """
    t0 = time.perf_counter_ns()
    live = [e for e in entries if not e.future.done()]
    if len(live) == len(entries):
        results = run_split(execute, [e.item for e in entries])
    else:
        ran = iter(run_split(execute, [e.item for e in live]) if live else ())
        results = [next(ran) if e in live else None for e in entries]
    return results, (time.perf_counter_ns() - t0) // 1000
