"""Dynamic batcher with Triton-class queue policy.

Design (after Triton's ``dynamic_batch_scheduler.cc``): one batcher per task, one queue per
execution signature, each queue holding one FIFO per priority level.  Queue *policy*
(admission, priorities, deadlines, cancellation) is kept apart from batch *formation*, which
happens only when an engine worker is free: under load batches grow by themselves, under light
load a lone request runs at once (``max_queue_delay_us = 0``) or after at most the delay.

The policy (admission, deadlines, cancellation, delivery) is ``policy.py``'s, on the compiled
``scheduler.Admission``, which also keeps the signature queues (``entries.SignatureQueue``);
this module only forms batches.  Formation runs in the engine workers' own threads
(``runner.Worker``): a worker that finishes a batch takes its next one at once under the
batcher's lock, so the engine never waits for the event loop.  A request costs the loop one
future and a deque append under that lock; an idle worker is woken only when the request makes
a batch formable (``Admission.wake_if_formable``).

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
import threading
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
    LoopTurn,
)
from .policy import QUEUED, RUNNING, UNSET, BatchResult, Entry, QueuePolicy
from .runner import Batch, Runner, Worker, run_split

log = logging.getLogger("lumen.batching")

#: length-aware formation looks at the oldest ``factor * max_batch_size`` live requests
LENGTH_WINDOW_FACTOR = 4
#: weight of the newest batch in the running mean of its items' size (``units_per_item``)
UNITS_EMA = 0.05
#: a request joins a length-aware batch while the padded slots it adds beyond its own length
#: stay within ``PAD_TOLERANCE * length + PAD_SLACK_TOKENS``.  On CPU a batch costs about its
#: padded slots and batching buys little beyond that (bench/HISTORY.md, text_embed: 0/4 beat
#: 0.1/8 and 0.25/16 on the length-mixed corpus), so only near-equal lengths share a batch; a
#: GPU, where rows are nearly free, would want a larger tolerance.
PAD_TOLERANCE = 0.0
PAD_SLACK_TOKENS = 4



def take_by_length(q: Any, n: int, max_tokens: int, window: int, policy: QueuePolicy,
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
                policy.kill(e)
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


def batch_units(entries: Sequence[Entry]) -> int:
    """What a batch's cost grows with beyond its rows (``DynamicBatcher.loop_fits``): the
    padded token slots of texts (``n`` x the longest ``length``), else the elements of dense
    items (``n`` x the item's elements: a batch has one signature, so one item shape), else
    0 (rows only)."""
    first = entries[0].item
    if getattr(first, "length", 0):
        return len(entries) * max(_item_length(e) for e in entries)
    shape = getattr(first, "item_shape", None)
    if not shape:
        return 0
    if isinstance(shape[0], tuple):  # one shape per input: their elements add up
        return len(entries) * sum(_elements(x) for x in shape)
    return len(entries) * _elements(shape)


def _elements(shape: Sequence[int]) -> int:
    k = 1
    for d in shape:
        k *= d
    return k


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


class DynamicBatcher(QueuePolicy):
    """Per-task dynamic batcher over a pool of runners (one worker thread each)."""

    def __init__(self, name: str, config: BatchingConfig, runners: Sequence[Runner],
                 on_batch: Optional[Callable[[int, int], None]] = None, max_batch_tokens: int = 0,
                 refuse: bool = True):
        """``max_batch_tokens > 0`` turns on length-aware formation for items with ``.length``
        (token budget per batch, padded slots counted); 0 keeps strict FIFO batches.
        ``config.latency_target_ms`` sizes batches to the target (``fit``) and, unless
        ``refuse`` is False (an ensemble's steps: their requests were admitted already),
        refuses at admission the requests that cannot make it (``Admission.check_latency``)."""
        preferred: tuple[int, ...] = tuple(config.preferred_batch_sizes)
        # a queue this long forms a batch at once, whatever max_queue_delay_us says
        ready = min(config.max_batch_size, preferred[-1]) if preferred else config.max_batch_size
        super().__init__(name, config.max_queue_size, on_batch, config.priority_levels,
                         config.max_queue_delay_us * 1000, ready)
        self.config = config
        self._max_batch = config.max_batch_size
        self._preferred = preferred
        self._max_tokens = max(0, int(max_batch_tokens))
        self._window = LENGTH_WINDOW_FACTOR * config.max_batch_size
        self._target_ns = config.latency_target_ms * 1_000_000
        if refuse:
            self.target_ns = self._target_ns
        self.batch_limit = config.max_batch_size
        self._init_workers(name, runners)
        #: loop execution (``LoopTurn``): batches that run within this run on the loop.  One
        #: engine instance only (several were asked for to run batches at once, which the
        #: loop cannot), and not with length-aware formation (a batch of long texts costs
        #: many times a batch of short ones: no typical batch time to judge it by)
        self.turn = (LoopTurn(self.workers[0], self) if config.loop_execution_us
                     and len(self.workers) == 1 and not self._max_tokens else None)
        self._loop_ns = config.loop_execution_us * 1000 if self.turn is not None else 0
        self.loop_runs = False  # under the lock: batches run on the loop (``_judge``)
        self.loop_batches = 0  # batches run on the loop since the last trial began
        self.loop_recent = [0] * LOOP_SAMPLES  # the newest ones' times (ns), a ring
        self.loop_median_ns = 0  # their median, judged once the ring is full
        self.loop_wait = 0  # worker batches before the next trial
        self.loop_backoff = LOOP_BACKOFF
        #: under the lock: a batch the loop formed but handed to the worker (``loop_fits``)
        self.handoff: Optional[Batch] = None
        #: running mean of a learnt batch's ``batch_units`` per row (0: none yet, or sizes
        #: unknown): the typical item's size, for ``loop_fits``
        self.units_per_item = 0.0

    def start(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        started = self.started
        super().start(loop)
        t = self.turn
        if not started and t is not None:
            try:
                here = asyncio.get_running_loop() is self.loop
            except RuntimeError:
                here = False
            t.loop = self.loop
            t.loop_thread = threading.get_ident() if here else 0

    async def close(self) -> None:
        t = self.turn
        if t is not None:  # a lent instance goes back to its worker, which drains and stops
            with self.lock:  # (directly: the loop that would run the turn may be gone)
                self.stopping = True
                if not t.running:
                    t.give_back()
        await super().close()

    def learnt(self, batch: Batch, results: Any, compute_us: int, on_loop: bool = False) -> None:
        """Under the lock, once per finished batch: learn its cost, steer the budget, judge
        where the next batches run (``on_loop``: this one ran on the loop)."""
        if not isinstance(results, BaseException):  # a failed run's time means nothing
            n = len(batch.entries)
            rows = 0.0
            if self._loop_ns:  # sizes matter: learnt per typical row (see ``loop_fits``)
                units = batch_units(batch.entries)
                if units:
                    per = self.units_per_item
                    if per > 0.0:
                        rows = max(float(n), units / per)
                    self.units_per_item = units / n if not per else (
                        per + UNITS_EMA * (units / n - per))
            self.learn(n, batch.extra or 0, compute_us, rows)
            if self.target_ns:  # its oldest request's wait steers the budget
                self.steer(time.monotonic_ns() - min(e.arrival_ns for e in batch.entries))
            if self._loop_ns:
                self._judge(compute_us * 1000, on_loop)

    def _judge(self, ns: int, on_loop: bool) -> None:
        """Loop execution's decision, once per batch (see ``LOOP_PROBE_FACTOR``).

        On the worker thread a batch's time includes its waits for the GIL, which the loop
        holds most of the time: the null model's batch of 32 measured 14 us alone and 33-106
        us (median, 90th percentile) beside a busy loop.  So the worker's time only says
        whether trying the loop is worth it (the learnt cost of the largest batch within
        ``LOOP_PROBE_FACTOR`` times the threshold); what the batches then take on the loop,
        where nothing competes, decides whether they stay there: the median of the last
        ``LOOP_SAMPLES`` must stay within ``loop_execution_us``.  A median, not a mean: a lone
        batch that a garbage collection or the OS held up for milliseconds is not the model's
        cost, while a model that slows down for good is back on its worker within
        ``LOOP_SAMPLES // 2`` batches.  A model that fails the trial goes back to its
        worker and is not tried again for ``loop_backoff`` batches (doubling)."""
        if on_loop:
            if ns > max(LOOP_OVERRUN_FACTOR * self._loop_ns, LOOP_OVERRUN_MIN_NS):
                self.back_to_worker()  # an overrun: at once, not after a median
                return
            k = self.loop_batches = self.loop_batches + 1
            recent = self.loop_recent
            recent[k % LOOP_SAMPLES] = ns
            if k >= LOOP_SAMPLES:
                self.loop_median_ns = median = sorted(recent)[LOOP_SAMPLES // 2]
                if median > self._loop_ns:
                    self.back_to_worker()
                elif k == LOOP_SETTLED:  # it held: a later trial starts from the first backoff
                    self.loop_backoff = LOOP_BACKOFF
        elif self.loop_wait:
            self.loop_wait -= 1
        elif self.cost_ready and not self.loop_runs:
            # (no token term: loop execution is never on with length-aware formation)
            if self.cost.predict_us(self._max_batch) * 1000 <= LOOP_PROBE_FACTOR * self._loop_ns:
                self.loop_runs = True
                self.loop_batches = 0
                self.loop_median_ns = 0

    def loop_fits(self, batch: Batch) -> bool:
        """Under the lock: whether ``batch`` may run on the loop: its predicted cost, from
        what formation knows of it, within the trial's reach of the threshold
        (``LOOP_PROBE_FACTOR``: the learnt cost mixes the worker's times, GIL waits included).
        The learnt cost is per row of the typical item; a batch counts as many typical rows
        as its size (``batch_units``: the elements or token slots its cost grows with) over
        the typical item's (``units_per_item``), at least its rows.  So items far larger than
        the ones learnt (one client's 8192-token rows after 4-token ones) are priced by their
        size, not by the rows of the batches that moved the task to the loop; and items over
        ``LOOP_ITEM_GROWTH`` times the typical size never run there: the loop was judged on
        items of that size, and a cost may grow faster than the elements (attention: as
        L^2), which no linear price foresees (issue 38 row 1).  The sizes are not a term of
        the cost model itself: a dense task's elements are its rows times a constant, and
        one warm-up batch of another shape would make that fit ill-posed."""
        m = self.cost
        if not m.samples:
            return True
        n = len(batch.entries)
        rows = float(n)
        per = self.units_per_item
        if per > 0.0:
            units = batch_units(batch.entries)
            if units > LOOP_ITEM_GROWTH * n * per:
                return False  # items far larger than those learnt: their cost may grow faster
            rows = max(rows, units / per)
        fixed, item = m.linear()
        return (fixed + item * rows) * 1000 <= LOOP_PROBE_FACTOR * self._loop_ns

    def back_to_worker(self) -> None:
        """Under the lock: end loop execution (a failed trial, a fault on the loop) and try
        again only after ``loop_backoff`` worker batches, doubled for the next time."""
        self.loop_runs = False
        self.loop_wait = self.loop_backoff
        self.loop_backoff = min(LOOP_BACKOFF_MAX, 2 * self.loop_backoff)

    def cost_figures(self) -> Optional[dict[str, Any]]:
        out = super().cost_figures()
        if out is not None:
            out["loop_execution"] = self.loop_runs
            out["loop_batch_us"] = self.loop_median_ns / 1000
        return out

    def lend(self, worker: Worker) -> bool:
        """Worker thread, holding the lock: lend this instance to the loop (``LoopTurn``)
        and park until the loop hands it back; return holding the lock again.  False (and
        nothing lent) when the loop is gone."""
        turn = self.turn
        if turn is None or turn.loop is None:  # the loop is gone: loop execution ends here
            self.loop_runs = False
            self._loop_ns = 0
            return False
        worker.flush()  # results waiting for the loop go before the instance does
        turn.lent = True
        if self.pending:
            turn.release()
        else:
            self.idle.append(turn)
        lock = self.lock
        lock.release()
        try:
            worker.wake.acquire()
        finally:
            lock.acquire()
        return True

    def queued(self) -> list[Entry]:
        return [e for q in self.queues.values() for lv in q.levels for e in lv
                if e.state == QUEUED]

    # -- formation (worker threads) ---------------------------------------------------------
    def next_batch(self, worker: Worker) -> Optional[Batch]:
        with self.lock:
            return self._next_locked(worker)

    def finished(self, worker: Worker, batch: Batch, results: Any,
                 compute_us: int) -> Optional[Batch]:
        with self.lock:
            self.learnt(batch, results, compute_us)
            # handed back after learning: a caller that has its answer sees its batch learnt
            self.completions.put(batch.entries, results, compute_us)
            return self._next_locked(worker)

    def _next_locked(self, worker: Worker) -> Optional[Batch]:
        while True:
            batch = self.handoff
            if batch is not None:  # the loop formed it, too large to run there (loop_fits)
                self.handoff = None
                return batch
            if self.loop_runs and not self.stopping and self.lend(worker):
                continue
            timeout = -1.0
            if self.pending:
                now = time.monotonic_ns()
                batch, wake_at = self.form(now)
                if batch is not None:
                    return batch
                if wake_at:
                    timeout = max(0, wake_at - now) / 1e9
            if self.stopping:
                return None
            worker.flush()  # results waiting for the loop must not wait for our next batch
            self.wait_for_work(worker.wake, timeout, self.idle)

    def _batch_size(self, live: int) -> int:
        cap = min(live, self._max_batch)
        if self._preferred:
            fits = [p for p in self._preferred if p <= cap]
            if fits and cap < self._max_batch:
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
        item = self.cost_item_ns
        if not self._target_ns or item <= 0.0:
            return self._max_batch
        budget = self.budget_ns or self._target_ns
        n = int((budget / 2 - self.cost_fixed_ns) // item)
        return max(1, min(self._max_batch, n))

    def _ready_at(self, q: Any, head: Entry) -> int:
        """Monotonic ns at which ``q`` may form a batch (0: now)."""
        if self.delay_ns == 0 or q.live >= self.ready_live:
            return 0
        return head.arrival_ns + self.delay_ns

    def form(self, now: int) -> tuple[Optional[Batch], int]:
        """(batch, 0) or (None, ns at which a queue becomes ready, 0 if none).  Under the lock."""
        while self.pending:
            best = None
            best_key = None
            wake_at = 0
            for q in self.queues.values():
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
            if self._target_ns and self.cost_ready:
                size = min(size, self.batch_cap)  # sized to the target (operating_batch)
            tokens = 0
            if self._max_tokens:
                entries = take_by_length(best, size, self._max_tokens, max(size, self._window),
                                         self, now)
                if entries:  # ascending lengths: the batch is padded to its last one's
                    tokens = len(entries) * _item_length(entries[-1])
            else:
                entries = best.take(size, now, self)
            if not entries:  # everything it looked at had expired: look again
                continue
            self.running += 1  # before pending drops: drain never sees both at 0 mid-handover
            self.pending -= len(entries)
            self.running_items += len(entries)
            if self.queued_tokens:  # (a latency target tracks the queued texts' lengths)
                self.dequeued_tokens(entries)
            return Batch(entries, [e.item for e in entries], tokens), 0
        return None, 0


__all__ = ["BatchResult", "DynamicBatcher", "LoopTurn", "UNSET", "run_split", "take_by_length"]
