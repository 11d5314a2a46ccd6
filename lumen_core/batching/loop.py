"""Loop execution (``[tasks.batching] loop_execution_us``): a one-instance task whose batches
cost less than handing them to a worker thread and back runs them on the event loop.

:class:`LoopExecution` is the strategy a ``DynamicBatcher`` (``dynamic.py``) owns: it decides
when the instance is lent (:meth:`~LoopExecution.judge`), which batch may run there
(:meth:`~LoopExecution.fits`) and when it goes back (:meth:`~LoopExecution.back_to_worker`);
:class:`LoopTurn` is the instance lent to the loop.  The thresholds below are theirs.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Optional, Sequence

from .runner import Batch, Worker, run_split

if TYPE_CHECKING:
    from .dynamic import DynamicBatcher

log = logging.getLogger("lumen.batching")

# Loop execution (``LoopTurn``, ``LoopExecution.judge``): a model whose batches take less
# than handing them to a worker thread and back costs (``loop_execution_us``) runs them on
# the event loop.  A trial starts when the worker's learnt cost of the largest batch is within
# this factor of the threshold (the worker's times include its waits for the GIL) ...
LOOP_PROBE_FACTOR = 4
#: ... and is judged on the median of the last this many batches' times on the loop
LOOP_SAMPLES = 8
#: worker batches before a failed trial is tried again; doubled per failure, up to the max
LOOP_BACKOFF = 64
LOOP_BACKOFF_MAX = 65536
#: batches on the loop after which a trial counts as held (the backoff starts over)
LOOP_SETTLED = 4096
#: one batch on the loop that took this many times the threshold (and at least
#: ``LOOP_OVERRUN_MIN_NS``) sends the task back to its worker at once, whatever the median:
#: a batch the prediction (``LoopExecution.fits``) did not see coming stalls every
#: connection for its whole run, and the next one may too (issue 38 row 1)
LOOP_OVERRUN_FACTOR = 16
LOOP_OVERRUN_MIN_NS = 2_000_000
#: a batch whose items are over this many times the typical item's size (elements, or token
#: slots: the cost model's running mean) runs on the worker, whatever its predicted cost
LOOP_ITEM_GROWTH = 8
#: a queue-delay timer that fired before the queue was due is set again for at least this
#: long: uvloop rounds a timer to whole milliseconds (and its clock to the loop iteration), so
#: a timer for the last fraction of a millisecond fires at once, again and again (300-400
#: times over a 1.5 ms wait, measured), where the worker's lock timeout waits exactly.  So a
#: batch may form up to this late on such a loop, once per queue delay.
LOOP_TIMER_FLOOR_NS = 1_000_000
#: weight of the newest batch in the running mean of its items' size (``units_per_item``)
UNITS_EMA = 0.05


def batch_units(entries: Sequence[Any]) -> int:
    """What a batch's cost grows with beyond its rows (:meth:`LoopExecution.fits`): the
    padded token slots of texts (``n`` x the longest ``length``), else the elements of dense
    items (``n`` x the item's elements: a batch has one signature, so one item shape), else
    0 (rows only)."""
    first = entries[0].item
    if getattr(first, "length", 0):
        return len(entries) * max(max(1, getattr(e.item, "length", 0) or 0) for e in entries)
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


class LoopExecution:
    """Where a dynamic batcher's batches run: on its worker thread, or lent to the event loop
    (:class:`LoopTurn`).  One engine instance only (several were asked for to run batches at
    once, which the loop cannot), and not with length-aware formation (a batch of long texts
    costs many times a batch of short ones: no typical batch time to judge it by); otherwise
    ``turn`` is None and ``loop_ns`` 0 (off).  Its fields are touched under the batcher's
    lock.

    ``loop_runs``: batches run on the loop; ``loop_batches`` since the last trial began,
    ``loop_recent`` the newest ones' times (ns, a ring) and ``loop_median_ns`` their median;
    ``loop_wait`` worker batches before the next trial, ``loop_backoff`` the next wait;
    ``handoff`` a batch the loop formed but handed to the worker (:meth:`fits`);
    ``units_per_item`` the running mean of a learnt batch's :func:`batch_units` per row (0:
    none yet, or sizes unknown): the typical item's size."""

    def __init__(self, batcher: DynamicBatcher, loop_execution_us: int):
        self.batcher = batcher
        self.queue = batcher.queue
        self.guard = batcher.guard
        workers = batcher.workers
        self.turn = (LoopTurn(workers[0], batcher) if loop_execution_us and len(workers) == 1
                     and not batcher.formation.max_tokens else None)
        self.loop_ns = loop_execution_us * 1000 if self.turn is not None else 0
        self.loop_runs = False
        self.loop_batches = 0
        self.loop_recent = [0] * LOOP_SAMPLES
        self.loop_median_ns = 0
        self.loop_wait = 0
        self.loop_backoff = LOOP_BACKOFF
        self.handoff: Optional[Batch] = None
        self.units_per_item = 0.0

    def bind(self, loop: Optional[asyncio.AbstractEventLoop]) -> None:
        """The batcher started on ``loop``: the turn runs there."""
        t = self.turn
        if t is not None:
            try:
                here = asyncio.get_running_loop() is loop
            except RuntimeError:
                here = False
            t.loop = loop
            t.loop_thread = threading.get_ident() if here else 0

    def close(self) -> None:
        """Loop thread, closing: a lent instance goes back to its worker, which drains and
        stops (directly: the loop that would run the turn may be gone)."""
        t = self.turn
        if t is not None:
            with self.queue.lock:
                self.queue.stopping = True
                if not t.running:
                    t.give_back()

    def rows(self, entries: Sequence[Any]) -> float:
        """Under the lock, a finished batch: what it counts as in typical rows for the cost
        model (0.0: its ``n``), and the typical item's size learnt from it.  Sizes matter
        only while loop execution is on (see :meth:`fits`)."""
        if not self.loop_ns:
            return 0.0
        n = len(entries)
        rows = 0.0
        units = batch_units(entries)
        if units:
            per = self.units_per_item
            if per > 0.0:
                rows = max(float(n), units / per)
            self.units_per_item = units / n if not per else (
                per + UNITS_EMA * (units / n - per))
        return rows

    def judge(self, ns: int, on_loop: bool) -> None:
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
            if ns > max(LOOP_OVERRUN_FACTOR * self.loop_ns, LOOP_OVERRUN_MIN_NS):
                self.back_to_worker()  # an overrun: at once, not after a median
                return
            k = self.loop_batches = self.loop_batches + 1
            recent = self.loop_recent
            recent[k % LOOP_SAMPLES] = ns
            if k >= LOOP_SAMPLES:
                self.loop_median_ns = median = sorted(recent)[LOOP_SAMPLES // 2]
                if median > self.loop_ns:
                    self.back_to_worker()
                elif k == LOOP_SETTLED:  # it held: a later trial starts from the first backoff
                    self.loop_backoff = LOOP_BACKOFF
        elif self.loop_wait:
            self.loop_wait -= 1
        elif self.guard.cost_ready and not self.loop_runs:
            # (no token term: loop execution is never on with length-aware formation)
            max_batch = self.batcher.formation.max_batch
            if self.guard.cost.predict_us(max_batch) * 1000 <= LOOP_PROBE_FACTOR * self.loop_ns:
                self.loop_runs = True
                self.loop_batches = 0
                self.loop_median_ns = 0

    def fits(self, batch: Batch) -> bool:
        """Under the lock: whether ``batch`` may run on the loop: its predicted cost, from
        what formation knows of it, within the trial's reach of the threshold
        (``LOOP_PROBE_FACTOR``: the learnt cost mixes the worker's times, GIL waits included).
        The learnt cost is per row of the typical item; a batch counts as many typical rows
        as its size (:func:`batch_units`: the elements or token slots its cost grows with) over
        the typical item's (``units_per_item``), at least its rows.  So items far larger than
        the ones learnt (one client's 8192-token rows after 4-token ones) are priced by their
        size, not by the rows of the batches that moved the task to the loop; and items over
        ``LOOP_ITEM_GROWTH`` times the typical size never run there: the loop was judged on
        items of that size, and a cost may grow faster than the elements (attention: as
        L^2), which no linear price foresees (issue 38 row 1).  The sizes are not a term of
        the cost model itself: a dense task's elements are its rows times a constant, and
        one warm-up batch of another shape would make that fit ill-posed."""
        m = self.guard.cost
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
        fits: bool = (fixed + item * rows) * 1000 <= LOOP_PROBE_FACTOR * self.loop_ns
        return fits

    def back_to_worker(self) -> None:
        """Under the lock: end loop execution (a failed trial, a fault on the loop) and try
        again only after ``loop_backoff`` worker batches, doubled for the next time."""
        self.loop_runs = False
        self.loop_wait = self.loop_backoff
        self.loop_backoff = min(LOOP_BACKOFF_MAX, 2 * self.loop_backoff)

    def lend(self, worker: Worker) -> bool:
        """Worker thread, holding the lock: lend this instance to the loop (``LoopTurn``)
        and park until the loop hands it back; return holding the lock again.  False (and
        nothing lent) when the loop is gone."""
        turn = self.turn
        if turn is None or turn.loop is None:  # the loop is gone: loop execution ends here
            self.loop_runs = False
            self.loop_ns = 0
            return False
        worker.flush()  # results waiting for the loop go before the instance does
        turn.lent = True
        q = self.queue
        if q.pending:
            turn.release()
        else:
            q.idle.append(turn)
        lock = q.lock
        lock.release()
        try:
            worker.wake.acquire()
        finally:
            lock.acquire()
        return True


class LoopTurn:
    """A worker's engine instance, lent to the event loop (loop execution).

    While loop execution holds (:meth:`LoopExecution.judge`: the batches run within
    ``loop_execution_us``), the worker thread of a one-instance batcher parks
    (:meth:`LoopExecution.lend`) and this turn stands in the batcher's idle list in its place: a
    request that makes a batch formable "wakes" it by scheduling :meth:`step` on the loop,
    which forms the batch, runs it and answers its callers there, then schedules itself again
    after the loop's other callbacks (so I/O and admissions interleave with batches, and a
    burst of callers fills the next batch).  No thread hands a batch over and the GIL never
    changes hands.  When the batches' times on the loop grow past the threshold, a fault hits
    the loop, or the batcher stops, the turn hands the instance back: it releases the parked
    thread, which goes on as a worker.  The loop and the thread never use the instance at once.
    """

    __slots__ = ("worker", "b", "loop", "loop_thread", "lent", "scheduled", "running", "timer",
                 "fired")

    def __init__(self, worker: Worker, batcher: "DynamicBatcher"):
        self.worker = worker
        self.b = batcher
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.loop_thread = 0  # the loop's thread, once known (0: call it thread-safely)
        self.lent = False  # under the lock: the loop holds the instance, the thread is parked
        self.scheduled = False  # a step is on the loop's ready queue (loop thread only)
        self.running = False  # under the lock: a step is running a batch
        self.timer: Optional[asyncio.TimerHandle] = None
        self.fired = False  # this step comes from the queue-delay timer

    def release(self) -> None:
        """The batcher's wake-up (under its lock from any thread, or from the loop's own
        step): schedule a step."""
        if self.scheduled:
            return
        self.scheduled = True
        loop = self.loop
        try:
            if loop is None:
                raise RuntimeError("no loop")
            if threading.get_ident() == self.loop_thread:
                loop.call_soon(self.step)
            else:
                loop.call_soon_threadsafe(self.step)
        except RuntimeError:  # the loop is closed: the thread takes its instance back for good
            self.scheduled = False
            self.loop = None
            self.give_back()

    def unidle(self) -> None:
        """Under the lock: out of the batcher's idle list, if it waits there."""
        idle = self.b.queue.idle
        if self in idle:
            idle.remove(self)

    def give_back(self) -> None:
        """Under the lock: the parked thread takes its instance back."""
        if self.lent:
            self.lent = False
            self.unidle()
            if self.timer is not None:
                self.timer.cancel()
                self.timer = None
            self.worker.wake.release()

    def _fire(self) -> None:
        self.timer = None
        self.fired = True
        with self.b.queue.lock:
            self.unidle()
            self.release()

    def step(self) -> None:
        """On the loop: form one batch, run it, answer it; then the next, after the loop's
        other callbacks; or wait in the idle list; or hand the instance back."""
        self.scheduled = False
        fired, self.fired = self.fired, False
        b = self.b
        q = b.queue
        x = b.execution
        try:
            with q.lock:
                if not self.lent:
                    return
                self.unidle()
                if q.stopping or not x.loop_runs:
                    self.give_back()
                    return
                now = time.monotonic_ns()
                batch, wake_at = b.formation.form(now) if q.pending else (None, 0)
                if batch is not None and not x.fits(batch):
                    # predicted past the threshold (larger items than the loop's batches so
                    # far): the worker runs this one, then lends the instance back
                    x.handoff = batch
                    self.give_back()
                    return
                if batch is None:
                    q.idle.append(self)
                    if wake_at:  # a queue delay runs: come back when it is due
                        if self.timer is not None:
                            self.timer.cancel()
                        loop = self.loop
                        assert loop is not None
                        delay = max(0, wake_at - now)
                        if fired:  # the timer came early: a loop whose timers round to
                            delay = max(delay, LOOP_TIMER_FLOOR_NS)  # whole ms (uvloop)
                        self.timer = loop.call_at(loop.time() + delay / 1e9, self._fire)
                    return
                self.running = True
            t0 = time.perf_counter_ns()
            try:
                results: Any = run_split(self.worker.runner.execute, batch.items)
            except Exception as exc:  # noqa: BLE001 - never strand a batch's callers
                results = exc
            except BaseException as exc:  # Ctrl-C or an exit on the loop's own thread: the
                with q.lock:  # batch is answered, the worker takes its instance back, and
                    self.running = False  # the exception goes on to whoever runs the loop
                    x.back_to_worker()
                    self.give_back()
                q.deliver_batch(batch.entries, exc, 0)
                raise
            us = (time.perf_counter_ns() - t0) // 1000
            try:
                with q.lock:
                    self.running = False
                    b.learnt(batch, results, us, True)
            finally:  # whatever learning did, the batch's callers get their answers
                q.deliver_batch(batch.entries, results, us)
            self.release()  # the next batch, after the loop's other callbacks
        except Exception:  # a formation bug: logged, and the worker takes its instance back
            log.exception("loop execution of %s: error between batches; back to the worker",
                          b.name)
            with q.lock:
                self.running = False
                x.back_to_worker()  # and keeps it for a backoff: no ping-pong on a fault
                self.give_back()


__all__ = ["UNITS_EMA", "LoopExecution", "batch_units", "LOOP_BACKOFF", "LOOP_BACKOFF_MAX", "LOOP_ITEM_GROWTH", "LOOP_OVERRUN_FACTOR", "LOOP_OVERRUN_MIN_NS",
           "LOOP_PROBE_FACTOR", "LOOP_SAMPLES", "LOOP_SETTLED", "LOOP_TIMER_FLOOR_NS", "LoopTurn"]
