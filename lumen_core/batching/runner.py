"""Running batches: the one engine protocol, the worker threads, the hand-back to the loop.

- :class:`BatchRunner` composes assemble -> run -> postprocess -> commit for one engine
  instance.  Both batchers use it; the engine only runs assembled inputs, the task's
  postprocess turns outputs into per-item results, stateful plans commit their state after a
  successful run.  :func:`run_split` isolates a failing item by halving the batch.
- :class:`Worker` is one engine instance's thread.  It asks its batcher for the next batch
  itself, as soon as it finishes one (``source.finished`` hands the results back and forms
  the next batch in one call, under the batcher's lock), so a busy engine never waits for the
  event loop, and it holds the GIL once per batch: between two model runs it never gives it up.
- :class:`CompletionQueue` carries finished batches to the event loop: a deque plus one byte
  on a pipe the loop watches, written only when the loop is not already signalled, so a
  burst of batches costs one loop wake-up.  The byte is written by ``native.notify.wake``
  and read back by ``native.notify.drain``: the compiled twins hold the GIL for the syscall
  (a microsecond; releasing the GIL for it would hand it to the other thread, and getting it
  back costs the thread that let go far more: bench/HISTORY.md, round 3).
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Sequence, cast

from .. import native
from ..engine.state import StatefulPlan
from ..errors import InternalError, LumenError

if TYPE_CHECKING:  # the queue entries (the twin: the compiled type mirrors it)
    from ..request_path.entries import Entry

log = logging.getLogger("lumen.batching")

#: a worker that hit an error between batches waits this long before it tries again
ERROR_BACKOFF_S = 0.01


class Runner(Protocol):
    """What a worker runs: one batch of items in, one result (or LumenError) per item out."""

    def execute(self, items: Sequence[Any]) -> list[Any]:
        """Run one batch; return one result (or LumenError) per item, in order."""


class _HookedRunner(Runner, Protocol):
    """A runner that calls ``before_run`` just before its model runs (``BatchRunner``)."""

    before_run: Optional[Callable[[], None]]


class BatchRunner:
    """assemble -> run -> postprocess -> commit, on one engine instance (worker thread only).

    ``postprocess(outputs, items) -> list`` is the task's; stateful plans (implicit state,
    context windows) among the model's inputs commit after a run whose postprocess succeeded,
    so a failed run changes no state.  ``stats`` accumulates the plans' counters (e.g. real
    and padded token slots) over successful runs.
    """

    def __init__(self, engine: Any,
                 postprocess: Callable[[dict[str, Any], Sequence[Any]], list[Any]]):
        self.engine = engine
        self.spec = engine.spec
        self.postprocess = postprocess
        self._plans = tuple(self.spec.inputs)
        self._commits = tuple(p for p in self._plans if isinstance(p, StatefulPlan))
        self.stats: dict[str, Any] = {}
        #: called once the inputs are assembled, just before the model runs (the worker sets
        #: it to wake the loop for the previous batch's results: see the module docstring)
        self.before_run: Optional[Callable[[], None]] = None

    @property
    def name(self) -> str:
        name: str = self.engine.name
        return name

    def execute(self, items: Sequence[Any]) -> list[Any]:
        stats: dict[str, Any] = {}
        arena = self.engine.next_arena()
        feeds: dict[str, Any] = {}
        for plan in self._plans:
            feeds.update(plan.assemble(items, arena, stats))
        if self.before_run is not None:
            self.before_run()
        outputs = self.engine.run(feeds, len(items))
        results = self.postprocess(outputs, items)
        if len(results) != len(items):  # before any commit: a retry must not commit twice
            raise InternalError(f"postprocess returned {len(results)} results for "
                                f"{len(items)} items")
        for plan in self._commits:  # stateful plans: ``items`` is their SequenceBatch
            plan.commit(cast(Any, items), outputs)
        if stats:
            total = self.stats
            for k, v in stats.items():
                total[k] = total.get(k, 0) + v
        return results

    def close(self) -> None:
        self.engine.close()


def run_split(execute: Callable[[Sequence[Any]], list[Any]],
              items: Sequence[Any]) -> list[Any]:
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
        return _per_item(run_split(execute, items[:mid])) + _per_item(
            run_split(execute, items[mid:]))


def _per_item(results: Any) -> list[Any]:
    """A half's results as one per item (a half that ran whole may answer with its rows)."""
    if isinstance(results, list):
        return results
    return [results.row(i) for i in range(len(results))]


class Batch:
    """A formed batch: the entries (policy side) and the items the runner gets."""

    __slots__ = ("entries", "items", "extra")

    def __init__(self, entries: list[Entry], items: Sequence[Any], extra: Any = None):
        self.entries = entries
        self.items = items
        self.extra = extra  # formation's own bookkeeping (e.g. the sequence batcher's lane)


class BatchSource(Protocol):
    """A batcher as its workers see it."""

    def next_batch(self, worker: "Worker") -> Optional[Batch]:
        """Block until a batch is due for ``worker``; None when the batcher stops."""

    def finished(self, worker: "Worker", batch: Batch, results: Any,
                 compute_us: int) -> Optional[Batch]:
        """Hand ``results`` back, then (same lock) the next batch, as ``next_batch``."""


class Worker:
    """One engine instance's thread: take a batch, run it, hand it back, repeat."""

    def __init__(self, runner: Runner, source: BatchSource, name: str, index: int,
                 flush: Callable[[], None]):
        self.runner = runner
        self.source = source
        self.index = index
        self.flush = flush
        #: held by the worker except while it waits for work: releasing it wakes the worker
        #: (``AdmissionQueue.wait_for_work``; a C lock, where a Condition costs Python frames)
        self.wake = threading.Lock()
        self.wake.acquire()
        # a runner that cannot call back before its run gets the flush before execute
        self._hooked = hasattr(runner, "before_run")
        if self._hooked:
            cast(_HookedRunner, runner).before_run = flush
        self.thread = threading.Thread(target=self._main, name=f"lumen-{name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout: Optional[float] = None) -> None:
        if self.thread.ident is not None:
            self.thread.join(timeout)

    def _main(self) -> None:
        src = self.source
        execute = self.runner.execute
        flush = None if self._hooked else self.flush
        clock = time.perf_counter_ns
        batch = None
        while True:
            try:
                batch = src.next_batch(self) if batch is None else batch
                if batch is None:
                    return
                t0 = clock()
                if flush is not None:
                    flush()
                try:
                    results: Any = run_split(execute, batch.items)
                except BaseException as exc:  # noqa: BLE001 - never strand a batch's callers
                    results = exc
                batch = src.finished(self, batch, results, (clock() - t0) // 1000)
                if batch is None:
                    return
            except Exception:  # a formation or hand-back bug: logged, and the worker lives on
                log.exception("worker %s: error between batches; continuing", self.thread.name)
                batch = None
                time.sleep(ERROR_BACKOFF_S)  # a persistent fault must not spin a core
                try:
                    self.flush()
                except Exception:  # the loop is gone: nothing left to hand back to
                    return


class CompletionQueue:
    """Finished batches, from worker threads to the event loop (see the module docstring)."""

    def __init__(self, deliver: Callable[..., None]):
        self._deliver = deliver
        self._items: deque[Any] = deque()
        self._signalled = False
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._r = self._w = -1
        self._wake = native.notify.wake
        self._read = native.notify.drain

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._loop is not None:
            return
        self._loop = loop
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        try:
            loop.add_reader(r, self._drain)
        except NotImplementedError:  # a loop without readers (e.g. Windows' proactor)
            os.close(r)
            os.close(w)
            return
        self._r, self._w = r, w

    def put(self, *batch: Any) -> None:
        """Worker thread: queue one finished batch (the arguments of ``deliver``); the loop
        learns of it at the next :meth:`flush`."""
        self._items.append(batch)

    def flush(self) -> None:
        """Worker thread: wake the loop if batches wait and it was not woken for them yet.
        Workers call it just before a model run and before going idle."""
        if self._items and not self._signalled:
            self._signalled = True
            if self._w >= 0:
                self._wake(self._w)
            else:
                try:
                    if self._loop is None:
                        raise RuntimeError("not attached")
                    self._loop.call_soon_threadsafe(self._drain)
                except RuntimeError:  # the loop closed: nobody waits for these results
                    self._items.clear()

    def _drain(self) -> None:
        if self._r >= 0:
            self._read(self._r)
        # cleared before popping: a batch queued from here on signals again
        self._signalled = False
        items = self._items
        deliver = self._deliver
        while items:
            deliver(*items.popleft())

    def close(self) -> None:
        """Deliver what is left, stop watching the pipe, close it."""
        self._drain()
        if self._r >= 0:
            try:
                if self._loop is not None:
                    self._loop.remove_reader(self._r)
            except (RuntimeError, ValueError):  # the loop is already closed
                pass
            os.close(self._r)
            os.close(self._w)
            self._r = self._w = -1
        self._loop = None
