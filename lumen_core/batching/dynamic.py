"""Dynamic batcher with Triton-class queue policy.

Design (after Triton's ``dynamic_batch_scheduler.cc``): one batcher per task, one queue per
execution signature, each queue holding one FIFO per priority level.  Queue *policy*
(admission, priorities, deadlines, cancellation) is kept apart from batch *formation*, which
happens only when an engine worker is free: under load batches grow by themselves, under light
load a lone request runs at once (``max_queue_delay_us = 0``) or after at most the delay.

The policy (admission, deadlines, cancellation, delivery) is ``policy.py``'s; this module only
forms batches.  Formation runs in the engine workers' own threads (``runner.Worker``): a worker
that finishes a batch takes its next one at once under the batcher's lock, so the engine never
waits for the event loop.  A request costs the loop one future and a deque append under that
lock; an idle worker is woken only when one is waiting.

Cancelled and expired requests are removed lazily (marked dead, skipped at batch formation) but
leave the admission count at once, so ``max_queue_size`` counts only live requests; formation
also refuses any request whose deadline has passed, even if its loop timer has not fired yet,
so no request ever runs after its deadline.

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
import threading
import time
from collections import deque
from typing import Any, Callable, Optional, Sequence

from ..config import BatchingConfig
from .policy import QUEUED, RUNNING, UNSET, Entry, QueuePolicy
from .runner import Batch, Runner, Worker, run_split

#: length-aware formation looks at the oldest ``factor * max_batch_size`` live requests
LENGTH_WINDOW_FACTOR = 4
#: a request joins a length-aware batch while the padded slots it adds beyond its own length
#: stay within ``PAD_TOLERANCE * length + PAD_SLACK_TOKENS``.  On CPU a batch costs about its
#: padded slots and batching buys little beyond that (bench/README.md, text_embed: 0/4 beat
#: 0.1/8 and 0.25/16 on the length-mixed corpus), so only near-equal lengths share a batch; a
#: GPU, where rows are nearly free, would want a larger tolerance.
PAD_TOLERANCE = 0.0
PAD_SLACK_TOKENS = 4


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
        return cls(e.outcome, e.batch_size, e.queue_us, e.compute_us)


class SignatureQueue:
    """Requests of one execution signature: one FIFO per priority level (index 0 = highest).

    Only touched under the batcher's lock.
    """

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

    def take(self, n: int, batcher: "DynamicBatcher", now: int) -> list:
        """Pop up to ``n`` live entries, highest priority first, FIFO within a level; an
        entry past its deadline is killed instead (its loop timer answers the caller)."""
        out: list = []
        for level in self.levels:
            while level and len(out) < n:
                e = level.popleft()
                if e.state == QUEUED:
                    if e.deadline_ns and e.deadline_ns <= now:
                        batcher._kill(e)
                    else:
                        out.append(e)
            if len(out) == n:
                break
        self.live -= len(out)
        return out

    def take_by_length(self, n: int, max_tokens: int, window: int, batcher: "DynamicBatcher",
                       now: int) -> list:
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
                if e.deadline_ns and e.deadline_ns <= now:
                    batcher._kill(e)
                    continue
                cands.append(e)
                if len(cands) == window:
                    break
        if not cands:
            return []
        head = cands[0]
        # stable: equal lengths keep arrival order
        cands.sort(key=_item_length)
        lengths = [_item_length(e) for e in cands]
        p = cands.index(head)
        lo, hi = _length_window(lengths, p, n, max_tokens)
        out = cands[lo:hi]
        for e in out:
            e.state = RUNNING  # the deques skip it from now on
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


class DynamicBatcher(QueuePolicy):
    """Per-task dynamic batcher over a pool of runners (one worker thread each)."""

    def __init__(self, name: str, config: BatchingConfig, runners: Sequence[Runner],
                 on_batch: Optional[Callable[[int, int], None]] = None, max_batch_tokens: int = 0):
        """``max_batch_tokens > 0`` turns on length-aware formation for items with ``.length``
        (token budget per batch, padded slots counted); 0 keeps strict FIFO batches."""
        super().__init__(name, config.max_queue_size, on_batch)
        self.config = config
        self._queues: dict = {}
        self._cond = threading.Condition(self.lock)
        self._waiting = 0  # workers blocked in ``next_batch``
        self._delay_ns = config.max_queue_delay_us * 1000
        self._max_batch = config.max_batch_size
        self._preferred = tuple(config.preferred_batch_sizes)
        self._levels = config.priority_levels
        self._max_tokens = max(0, int(max_batch_tokens))
        self._window = LENGTH_WINDOW_FACTOR * config.max_batch_size
        self._enqueue = self._sched.enqueue  # the compiled admission path (or its twin)
        self._init_workers(name, runners)

    # -- lifecycle (QueuePolicy: start, close) ----------------------------------------------
    def _wake_all(self) -> None:
        self._cond.notify_all()

    def _queued(self) -> list:
        return [e for q in self._queues.values() for lv in q.levels for e in lv
                if e.state == QUEUED]

    # -- admission (loop thread) ------------------------------------------------------------
    def submit(self, item: Any, desc: Any = None, priority: int = 1, timeout_ms: int = 0) -> Entry:
        """Admit ``item`` (must have ``.signature``); raise at once when closed or full.

        ``desc`` (the request's descriptor) is accepted for the common batcher shape and not
        needed here."""
        if not self._started:
            self.start()
        return self._enqueue(self, item, priority, timeout_ms)

    def _new_queue(self, sig: Any) -> "SignatureQueue":
        """Under the lock: the queue of a signature seen for the first time."""
        q = self._queues[sig] = SignatureQueue(sig, self._levels)
        return q

    def submit_many(self, specs: Sequence[tuple]) -> tuple:
        """Admit a group ``[(item, desc, priority, timeout_ms), ...]`` as a unit (all or
        none); return ``(group, entries)``: ``group.future`` resolves once every entry is
        answered, each entry's ``outcome`` holds its result or error."""
        if not self._started:
            self.start()
        loop = self._loop
        now = time.monotonic_ns()
        sched = self._sched
        group = sched.Group(loop.create_future(), len(specs))
        entries = []
        deadlines: dict = {}
        if not specs:
            group.future.set_result(None)
            return group, entries
        sigs = [item.signature for item, _d, _p, _t in specs]  # raises before anything queues
        if any(not 1 <= p <= self._levels for _i, _d, p, _t in specs):
            raise ValueError(f"priorities must be 1..{self._levels}")
        with self.lock:
            self._admit(len(specs))
            queues = self._queues
            for sig, (item, _desc, priority, timeout_ms) in zip(sigs, specs, strict=True):
                q = queues.get(sig)
                if q is None:
                    q = queues[sig] = SignatureQueue(sig, self._levels)
                e = sched.Entry(item, group, priority, now, q,
                                now + timeout_ms * 1_000_000 if timeout_ms > 0 else 0)
                q.levels[priority - 1].append(e)
                q.live += 1
                entries.append(e)
                if timeout_ms > 0:
                    deadlines.setdefault(timeout_ms, []).append(e)
            self._pending += len(entries)
            if self._waiting:
                self._cond.notify(self._waiting)
        for timeout_ms, es in deadlines.items():
            self._arm_deadline(es, timeout_ms, group)
        return group, entries

    async def infer(self, item: Any, desc: Any = None, priority: int = 1,
                    timeout_ms: int = 0) -> BatchResult:
        entry = self.submit(item, desc, priority, timeout_ms)
        try:
            await entry.waiter
        except asyncio.CancelledError:
            self.cancel(entry)
            raise
        return BatchResult.of(entry)

    def _unqueue(self, e: Entry) -> None:
        e.queue.live -= 1

    # -- formation (worker threads) ---------------------------------------------------------
    def next_batch(self, worker: Worker) -> Optional[Batch]:
        with self.lock:
            return self._next_locked(worker)

    def finished(self, worker: Worker, batch: Batch, results: Any,
                 compute_us: int) -> Optional[Batch]:
        self._done.put(batch.entries, results, compute_us)
        with self.lock:
            return self._next_locked(worker)

    def _next_locked(self, worker: Worker) -> Optional[Batch]:
        cond = self._cond
        while True:
            timeout = None
            if self._pending:
                now = time.monotonic_ns()
                batch, wake_at = self._form(now)
                if batch is not None:
                    return batch
                if wake_at:
                    timeout = max(0, wake_at - now) / 1e9
            if self._stopping:
                return None
            worker.flush()  # results waiting for the loop must not wait for our next batch
            self._waiting += 1
            try:
                cond.wait(timeout)
            finally:
                self._waiting -= 1

    def _batch_size(self, live: int) -> int:
        cap = min(live, self._max_batch)
        if self._preferred:
            fits = [p for p in self._preferred if p <= cap]
            if fits and cap < self._max_batch:
                return fits[-1]
        return cap

    def _ready_at(self, q: SignatureQueue, head: Entry) -> int:
        """Monotonic ns at which ``q`` may form a batch (0: now)."""
        if self._delay_ns == 0 or q.live >= self._max_batch:
            return 0
        if self._preferred and q.live >= self._preferred[-1]:
            return 0
        return head.arrival_ns + self._delay_ns

    def _form(self, now: int) -> tuple:
        """(batch, 0) or (None, ns at which a queue becomes ready, 0 if none).  Under the lock."""
        while self._pending:
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
                return None, wake_at
            size = self._batch_size(best.live)
            if self._max_tokens:
                entries = best.take_by_length(size, self._max_tokens, max(size, self._window),
                                              self, now)
            else:
                entries = best.take(size, self, now)
            if not entries:  # everything it looked at had expired: look again
                continue
            for e in entries:
                e.state = RUNNING
                e.dispatch_ns = now
            self._running += 1  # before pending drops: drain never sees both at 0 mid-handover
            self._pending -= len(entries)
            return Batch(entries, [e.item for e in entries]), 0
        return None, 0


__all__ = ["BatchResult", "DynamicBatcher", "SignatureQueue", "UNSET", "run_split"]
