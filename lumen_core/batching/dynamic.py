"""Dynamic batcher with Triton-class queue policy.

Design (after Triton's ``dynamic_batch_scheduler.cc``): one batcher per task, one queue per
execution signature, each queue holding one FIFO per priority level.  Queue *policy*
(admission, priorities, deadlines, cancellation) is kept apart from batch *formation*, which
happens only when an engine worker is free: under load batches grow by themselves, under light
load a lone request runs at once (``max_queue_delay_us = 0``) or after at most the delay.

The policy (admission, deadlines, cancellation, delivery) is the batcher's compiled admission
queue (``scheduler.AdmissionQueue``, owned through ``policy.QueuePolicy``), which also keeps the
signature queues (``entries.SignatureQueue``); this module's :class:`Formation` only forms
batches from them.  Formation runs in the engine workers' own threads (``runner.Worker``): a
worker that finishes a batch takes its next one at once under the batcher's lock, so the
engine never waits for the event loop.  A request costs the loop one future and a deque append
under that lock; an idle worker is woken only when the request makes a batch formable
(``AdmissionQueue.wake_if_formable``).

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
import logging
import time
from typing import Any, Callable, Optional, Sequence

from ..config import BatchingConfig
from .loop import (
    LOOP_BACKOFF,
    LOOP_BACKOFF_MAX,
    LOOP_ITEM_GROWTH,
    LOOP_OVERRUN_FACTOR,
    LOOP_OVERRUN_MIN_NS,
    LOOP_PROBE_FACTOR,
    LOOP_SAMPLES,
    LOOP_SETTLED,
    LoopExecution,
    LoopTurn,
)
from .policy import QUEUED, RUNNING, UNSET, BatchResult, Entry, QueuePolicy
from .runner import Batch, Runner, Worker, run_split

log = logging.getLogger("lumen.batching")

#: length-aware formation looks at the oldest ``factor * max_batch_size`` live requests
LENGTH_WINDOW_FACTOR = 4
#: a request joins a length-aware batch while the padded slots it adds beyond its own length
#: stay within ``PAD_TOLERANCE * length + PAD_SLACK_TOKENS``.  On CPU a batch costs about its
#: padded slots and batching buys little beyond that (bench/HISTORY.md, text_embed: 0/4 beat
#: 0.1/8 and 0.25/16 on the length-mixed corpus), so only near-equal lengths share a batch; a
#: GPU, where rows are nearly free, would want a larger tolerance.
PAD_TOLERANCE = 0.0
PAD_SLACK_TOKENS = 4



def take_by_length(q: Any, n: int, max_tokens: int, window: int, queue: Any,
                   now: int) -> list[Entry]:
    """Pop up to ``n`` live entries of ``q`` (a ``SignatureQueue``) of similar length (see
    the module docstring).

    Candidates are the oldest ``window`` live entries of the highest non-empty priority
    level; the chosen ones are marked running in place (the deques drop them lazily, like
    cancelled entries), so nothing is copied or rebuilt.
    """
    level = None
    for lv in q.levels:
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
                queue.kill(e)  # past its deadline: dies queued (the admission queue's)
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
        e.dispatch_ns = now
    q.live -= len(out)
    return out


def _item_length(entry: Entry) -> int:
    return max(1, getattr(entry.item, "length", 0) or 0)

def _length_window(lengths: Sequence[int], p: int, n: int,
                   max_tokens: int) -> tuple[int, int]:
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


class Formation:
    """Dynamic batch formation (the module docstring), the strategy a ``DynamicBatcher``
    owns: which queued requests run together, and how large a batch may be.  It reads and
    takes from the batcher's admission queue (``scheduler.AdmissionQueue``: the signature
    queues, the counts) under its lock; the latency guard's learnt cost sizes its batches
    (:meth:`operating_batch`).

    ``batch_cap`` is the size batches are formed at with a latency target (``operating_batch``,
    set once per finished batch); ``target_ns`` the target formation sizes to (also for an
    ensemble's steps, whose requests are never refused here: ``refuse=False``)."""

    def __init__(self, queue: Any, guard: Any, config: BatchingConfig, max_tokens: int):
        self.queue = queue
        self.guard = guard
        self.max_batch = config.max_batch_size
        self.preferred: tuple[int, ...] = tuple(config.preferred_batch_sizes)
        self.max_tokens = max(0, int(max_tokens))
        self.window = LENGTH_WINDOW_FACTOR * config.max_batch_size
        self.target_ns = config.latency_target_ms * 1_000_000
        self.batch_cap = 1

    def queued(self) -> list[Entry]:
        """Under the lock: every entry still queued."""
        return [e for q in self.queue.queues.values() for lv in q.levels for e in lv
                if e.state == QUEUED]

    def batch_size(self, live: int) -> int:
        cap = min(live, self.max_batch)
        if self.preferred:
            fits = [p for p in self.preferred if p <= cap]
            if fits and cap < self.max_batch:
                return fits[-1]
        return cap

    def operating_batch(self) -> int:
        """With a latency target: the largest batch (up to ``max_batch_size``) that keeps a
        request within the budget in the worst case formation allows, when it arrives just
        as a batch of that size starts: it waits for that one, then runs in its own, so two
        batches must fit, ``2 * (fixed + n * item) <= budget``.  Without a target (or before
        the cost is learnt), ``max_batch_size``.

        Sized once per finished batch from the learnt cost, not per batch from the oldest
        request's wait: shrinking each batch to what its head can still make turned, under
        overload, into ever smaller and less efficient batches (measured: MiniLM at 1.5x its
        capacity ran batches of 3.4 on average and fell to 0.58x of it).  A budget that runs
        late shrinks through ``steer`` instead."""
        g = self.guard
        item = g.cost_item_ns
        if not self.target_ns or item <= 0.0:
            return self.max_batch
        budget = g.budget_ns or self.target_ns
        n = int((budget / 2 - g.cost_fixed_ns) // item)
        return max(1, min(self.max_batch, n))

    def ready_at(self, q: Any, head: Entry) -> int:
        """Monotonic ns at which ``q`` may form a batch (0: now)."""
        queue = self.queue
        if queue.delay_ns == 0 or q.live >= queue.ready_live:
            return 0
        return int(head.arrival_ns + queue.delay_ns)

    def form(self, now: int) -> tuple[Optional[Batch], int]:
        """(batch, 0) or (None, ns at which a queue becomes ready, 0 if none).  Under the lock."""
        queue = self.queue
        while queue.pending:
            best = None
            best_key = None
            wake_at = 0
            for q in queue.queues.values():
                if not q.live:
                    continue
                head = q.head()
                if head is None:
                    continue
                ready = self.ready_at(q, head)
                if ready > now:
                    wake_at = ready if not wake_at else min(wake_at, ready)
                    continue
                key = (head.priority, head.arrival_ns)
                if best_key is None or key < best_key:
                    best, best_key = q, key
            if best is None:
                return None, wake_at
            size = self.batch_size(best.live)
            if self.target_ns and self.guard.cost_ready:
                size = min(size, self.batch_cap)  # sized to the target (operating_batch)
            tokens = 0
            if self.max_tokens:
                entries = take_by_length(best, size, self.max_tokens, max(size, self.window),
                                         queue, now)
                if entries:  # ascending lengths: the batch is padded to its last one's
                    tokens = len(entries) * _item_length(entries[-1])
            else:
                entries = best.take(size, now, queue)
            if not entries:  # everything it looked at had expired: look again
                continue
            queue.running += 1  # before pending drops: drain never sees both at 0 mid-handover
            queue.pending -= len(entries)
            queue.running_items += len(entries)
            if queue.queued_tokens:  # (a latency target tracks the queued texts' lengths)
                queue.dequeued_tokens(entries)
            return Batch(entries, [e.item for e in entries], tokens), 0
        return None, 0


class DynamicBatcher(QueuePolicy):
    """Per-task dynamic batcher over a pool of runners (one worker thread each): the queue
    policy's parts (``QueuePolicy``: the admission queue, the latency guard, the workers)
    with dynamic :class:`Formation` and :class:`~lumen_core.batching.loop.LoopExecution`."""

    def __init__(self, name: str, config: BatchingConfig, runners: Sequence[Runner],
                 on_batch: Optional[Callable[[int, int], None]] = None, max_batch_tokens: int = 0,
                 refuse: bool = True):
        """``max_batch_tokens > 0`` turns on length-aware formation for items with ``.length``
        (token budget per batch, padded slots counted); 0 keeps strict FIFO batches.
        ``config.latency_target_ms`` sizes batches to the target (``operating_batch``) and,
        unless ``refuse`` is False (an ensemble's steps: their requests were admitted
        already), refuses at admission the requests that cannot make it
        (``LatencyGuard.check``)."""
        preferred: tuple[int, ...] = tuple(config.preferred_batch_sizes)
        # a queue this long forms a batch at once, whatever max_queue_delay_us says
        ready = min(config.max_batch_size, preferred[-1]) if preferred else config.max_batch_size
        super().__init__(name, config.max_queue_size, on_batch, config.priority_levels,
                         config.max_queue_delay_us * 1000, ready,
                         config.latency_target_ms * 1_000_000 if refuse else 0)
        self.config = config
        self.formation = Formation(self.queue, self.guard, config, max_batch_tokens)
        self._init_workers(name, runners)
        #: loop execution: batches that run within ``loop_execution_us`` run on the loop
        self.execution = LoopExecution(self, config.loop_execution_us)

    def start(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        started = self.queue.started
        super().start(loop)
        if not started:
            self.execution.bind(self.queue.loop)

    async def close(self) -> None:
        self.execution.close()
        await super().close()

    def size_batches(self) -> None:
        f = self.formation
        f.batch_cap = max(1, f.operating_batch())
        self.guard.sized(f.batch_cap)

    def cap(self) -> int:
        return int(self.formation.batch_cap)

    def learnt(self, batch: Batch, results: Any, compute_us: int, on_loop: bool = False) -> None:
        """Under the lock, once per finished batch: learn its cost, steer the budget, judge
        where the next batches run (``on_loop``: this one ran on the loop)."""
        if not isinstance(results, BaseException):  # a failed run's time means nothing
            x = self.execution
            rows = x.rows(batch.entries)
            self.learn(len(batch.entries), batch.extra or 0, compute_us, rows)
            if self.guard.target_ns:  # its oldest request's wait steers the budget
                self.steer(time.monotonic_ns() - min(e.arrival_ns for e in batch.entries))
            if x.loop_ns:
                x.judge(compute_us * 1000, on_loop)

    def cost_figures(self) -> Optional[dict[str, Any]]:
        out = super().cost_figures()
        if out is not None:
            out["loop_execution"] = self.execution.loop_runs
            out["loop_batch_us"] = self.execution.loop_median_ns / 1000
        return out

    def queued(self) -> list[Entry]:
        return self.formation.queued()

    # -- formation (worker threads) ---------------------------------------------------------
    def next_batch(self, worker: Worker) -> Optional[Batch]:
        with self.queue.lock:
            return self._next_locked(worker)

    def finished(self, worker: Worker, batch: Batch, results: Any,
                 compute_us: int) -> Optional[Batch]:
        with self.queue.lock:
            self.learnt(batch, results, compute_us)
            # handed back after learning: a caller that has its answer sees its batch learnt
            self.completions.put(batch.entries, results, compute_us)
            return self._next_locked(worker)

    def _next_locked(self, worker: Worker) -> Optional[Batch]:
        q = self.queue
        x = self.execution
        while True:
            batch = x.handoff
            if batch is not None:  # the loop formed it, too large to run there (fits)
                x.handoff = None
                return batch
            if x.loop_runs and not q.stopping and x.lend(worker):
                continue
            timeout = -1.0
            if q.pending:
                now = time.monotonic_ns()
                batch, wake_at = self.formation.form(now)
                if batch is not None:
                    return batch
                if wake_at:
                    timeout = max(0, wake_at - now) / 1e9
            if q.stopping:
                return None
            worker.flush()  # results waiting for the loop must not wait for our next batch
            q.wait_for_work(worker.wake, timeout, q.idle)


__all__ = ["LOOP_BACKOFF", "LOOP_BACKOFF_MAX", "LOOP_ITEM_GROWTH", "LOOP_OVERRUN_FACTOR",
           "LOOP_OVERRUN_MIN_NS", "LOOP_PROBE_FACTOR", "LOOP_SAMPLES", "LOOP_SETTLED",
           "BatchResult", "DynamicBatcher", "Formation", "LoopExecution", "LoopTurn", "UNSET", "run_split", "take_by_length"]
