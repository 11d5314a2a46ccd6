"""Loop execution (``[tasks.batching] loop_execution_us``): a one-instance task whose batches
cost less than handing them to a worker thread and back runs them on the event loop.

:class:`LoopTurn` is the instance lent to the loop; ``DynamicBatcher`` (``dynamic.py``) decides
when it is lent (``_judge``), which batch may run there (``loop_fits``) and when it goes back
(``back_to_worker``).  The thresholds below are theirs.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Optional

from .runner import Worker, run_split

if TYPE_CHECKING:
    from .dynamic import DynamicBatcher

log = logging.getLogger("lumen.batching")

# Loop execution (``LoopTurn``, ``DynamicBatcher._judge``): a model whose batches take less
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
#: a batch the prediction (``DynamicBatcher.loop_fits``) did not see coming stalls every
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


class LoopTurn:
    """A worker's engine instance, lent to the event loop (loop execution).

    While loop execution holds (``DynamicBatcher._judge``: the batches run within
    ``loop_execution_us``), the worker thread of a one-instance batcher parks
    (``DynamicBatcher.lend``) and this turn stands in the batcher's idle list in its place: a
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
        idle = self.b.idle
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
        with self.b.lock:
            self.unidle()
            self.release()

    def step(self) -> None:
        """On the loop: form one batch, run it, answer it; then the next, after the loop's
        other callbacks; or wait in the idle list; or hand the instance back."""
        self.scheduled = False
        fired, self.fired = self.fired, False
        b = self.b
        try:
            with b.lock:
                if not self.lent:
                    return
                self.unidle()
                if b.stopping or not b.loop_runs:
                    self.give_back()
                    return
                now = time.monotonic_ns()
                batch, wake_at = b.form(now) if b.pending else (None, 0)
                if batch is not None and not b.loop_fits(batch):
                    # predicted past the threshold (larger items than the loop's batches so
                    # far): the worker runs this one, then lends the instance back
                    b.handoff = batch
                    self.give_back()
                    return
                if batch is None:
                    b.idle.append(self)
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
                with b.lock:  # batch is answered, the worker takes its instance back, and
                    self.running = False  # the exception goes on to whoever runs the loop
                    b.back_to_worker()
                    self.give_back()
                b.deliver_batch(batch.entries, exc, 0)
                raise
            us = (time.perf_counter_ns() - t0) // 1000
            try:
                with b.lock:
                    self.running = False
                    b.learnt(batch, results, us, True)
            finally:  # whatever learning did, the batch's callers get their answers
                b.deliver_batch(batch.entries, results, us)
            self.release()  # the next batch, after the loop's other callbacks
        except Exception:  # a formation bug: logged, and the worker takes its instance back
            log.exception("loop execution of %s: error between batches; back to the worker",
                          b.name)
            with b.lock:
                self.running = False
                b.back_to_worker()  # and keeps it for a backoff: no ping-pong on a fault
                self.give_back()


__all__ = ["LOOP_BACKOFF", "LOOP_BACKOFF_MAX", "LOOP_ITEM_GROWTH", "LOOP_OVERRUN_FACTOR", "LOOP_OVERRUN_MIN_NS",
           "LOOP_PROBE_FACTOR", "LOOP_SAMPLES", "LOOP_SETTLED", "LOOP_TIMER_FLOOR_NS", "LoopTurn"]
