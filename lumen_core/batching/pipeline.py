"""Ensembles: a task that is a pipeline of steps, each step a model behind its own batcher.

SPEC section 3: "a task may be a pipeline of steps (e.g. OCR: detect -> crop -> classify ->
recognise), each step its own batched model with its own execution signature, steps running as
soon as their inputs are ready; one request may fan out into many items (crops) that batch with
other requests' items; errors, deadlines, cancellation and priorities follow each request
through every step."

The shape is declarative: a backend lists its steps (:class:`StepSpec`: a name, a
``ModelSpec``, a postprocess, batching settings), and the runtime builds one ordinary
:class:`~lumen_core.batching.dynamic.DynamicBatcher` per step over that step's own engine
instances.  There is no second scheduler: every model run is formed, batched, timed out and
cancelled by a dynamic batcher exactly as for a single-model task.  What this module adds is
the per-request *flow*: the backend's coroutine ``flow(ctx, item)`` that says which step runs
on which items (``await ctx.run("rec", crops)``) and assembles the answer.  A flow waits on its
own items only, so a step starts for a request as soon as that request's input is ready, and
items of many requests meet in the step's queues (one request's 30 crops batch with another's
12, grouped by each step's execution signature).

:class:`Pipeline` implements the batcher interface the dispatcher calls
(``scheduler.Batcher``: ``submit``, ``submit_many``, ``cancel``, ``cancel_group``, ``start``)
and what the runtime reads (``drain``, ``close``, ``pending``, ``in_flight``) without a queue of
its own, so ``Runtime.infer`` / ``infer_many`` treat an ensemble like any task:

* **errors** stay with their request: a step item that fails (bad crop, model error isolated
  by ``run_split``) fails ``ctx.run`` of the request that owns it, and only that request;
* **deadlines**: the request's deadline is armed once (a loop timer that answers it and cancels
  its flow) and every step is submitted with the time that is left, so an expired request's
  items are dropped from the step queues and never reach a model;
* **cancellation**: cancelling the request cancels its flow, which cancels its queued items in
  whichever step they wait;
* **priorities**: every item is submitted with its request's priority;
* **metrics** per step (:meth:`Pipeline.step_stats`: batches, items, queue and compute time),
  and each step's batches reach the runtime's observer under ``<task>.<step>``.

Response stats: ``queue_us`` / ``compute_us`` of a request are summed over its steps (the
slowest item of each step), ``batch_size`` is the largest batch any of its items ran in.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Optional, Sequence

from .. import native
from ..config import BatchingConfig
from ..errors import (
    Cancelled,
    DeadlineExceeded,
    InternalError,
    LumenError,
    Unavailable,
)
from .dynamic import DynamicBatcher
from .policy import (
    DEADLINE_FIELD,
    QUEUE_FULL,
    ROOM,
    UNSET,
    Entry,
    Group,
    answer,
    check_room,
)

log = logging.getLogger("lumen.batching")


@dataclass(frozen=True)
class StepSpec:
    """One step of an ensemble, as a backend declares it.

    ``postprocess(outputs, items) -> list`` is the step's (per item: a result or a
    LumenError); it runs in the step's engine worker thread, so CPU work between models (DB
    post-process, crops) runs there, off the event loop.  ``batching`` defaults to the task's;
    ``instances`` / ``intra_op_threads`` (0: the task's) are the step's engine pool;
    ``batcher_options`` are extra ``DynamicBatcher`` arguments (e.g. ``max_batch_tokens``).
    """

    name: str
    model: Any
    postprocess: Callable[[dict[str, Any], Sequence[Any]], list[Any]]
    batching: Optional[BatchingConfig] = None
    instances: int = 1
    intra_op_threads: int = 0
    batcher_options: dict[str, Any] = field(default_factory=dict)


class StepStats:
    """Counters of one step (loop thread only)."""

    __slots__ = ("batches", "items", "requests", "queue_us", "compute_us", "max_batch")

    def __init__(self) -> None:
        self.batches = self.items = self.requests = self.queue_us = self.compute_us = 0
        self.max_batch = 0

    def as_dict(self) -> dict[str, Any]:
        """``queue_us`` sums, over the ``requests`` that ran this step, the wait of each one's
        slowest item in the step's queue (what the step added to that request's queue time)."""
        return {"batches": self.batches, "items": self.items, "requests": self.requests,
                "queue_us": self.queue_us,
                "compute_us": self.compute_us, "max_batch_size": self.max_batch,
                "mean_batch_size": self.items / self.batches if self.batches else 0.0}


class Step:
    """A built step: its spec, its batcher, its counters."""

    def __init__(self, spec: StepSpec, batcher: DynamicBatcher):
        self.spec = spec
        self.name = spec.name
        self.batcher = batcher
        self.stats = StepStats()

    def on_batch(self, n: int, compute_us: int) -> None:
        s = self.stats
        s.batches += 1
        s.items += n
        s.compute_us += compute_us
        if n > s.max_batch:
            s.max_batch = n


class StepContext:
    """What a flow gets for one request: ``await ctx.run(step, items)``."""

    __slots__ = ("pipeline", "entry", "priority", "deadline_ns", "timeout_ms", "queue_us",
                 "compute_us", "batch_size")

    def __init__(self, pipeline: "Pipeline", entry: Any, priority: int, timeout_ms: int):
        self.pipeline = pipeline
        self.entry = entry
        self.priority = priority
        self.timeout_ms = timeout_ms
        self.deadline_ns = entry.deadline_ns
        self.queue_us = self.compute_us = self.batch_size = 0

    def left_ms(self) -> int:
        """Milliseconds left before the request's deadline (0: none); raises when expired."""
        if not self.deadline_ns:
            return 0
        left = (self.deadline_ns - time.monotonic_ns()) // 1_000_000
        if left <= 0:
            raise DeadlineExceeded(f"deadline of {self.timeout_ms} ms expired between steps",
                                   DEADLINE_FIELD)
        return int(left)

    async def run(self, step: str, items: Sequence[Any]) -> list[Any]:
        """Run ``items`` through ``step`` (batched with every other request's items there);
        return their results in order, or raise the first item's error."""
        if not items:
            return []
        st = self.pipeline.steps[step]
        timeout_ms = self.left_ms()
        group, entries = st.batcher.submit_many([(it, None, self.priority, timeout_ms)
                                                 for it in items])
        try:
            await group.future
        except asyncio.CancelledError:
            st.batcher.cancel_group(entries)
            raise
        out = []
        q = c = 0
        for e in entries:
            res = e.outcome
            if isinstance(res, LumenError):
                raise res
            out.append(e.result())
            q = max(q, e.queue_us)
            c = max(c, e.compute_us)
            if e.batch_size > self.batch_size:
                self.batch_size = e.batch_size
        self.queue_us += q
        self.compute_us += c
        st.stats.queue_us += q
        st.stats.requests += 1
        return out


Flow = Callable[[StepContext, Any], Awaitable[Any]]


class Pipeline(native.scheduler.Batcher):
    """The batcher of an ensemble task (see the module docstring): the dispatcher's interface
    (``scheduler.Batcher``) over requests whose "formation" is a flow over the steps'
    batchers.  It queues nothing itself: it owns its admission count (``pending``: the flows
    running), a ``scheduler.DeadlineHeap`` for the requests' deadlines, and the steps."""

    def __init__(self, name: str, config: BatchingConfig, steps: Sequence[Step], flow: Flow):
        super().__init__(name)
        self.config = config
        self.levels = config.priority_levels
        self.max_queue_size = config.max_queue_size
        self.steps = {s.name: s for s in steps}
        if len(self.steps) != len(steps):
            raise ValueError(f"pipeline {name!r}: step names must be unique")
        self.flow = flow
        self._flows: dict[Any, Any] = {}  # entry -> its flow task
        self.pending = 0  # admitted requests whose flow has not finished
        self.closed = False
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.deadlines = native.scheduler.DeadlineHeap(self.expire)
        self._idle: Optional[asyncio.Event] = None  # while somebody drains

    @property
    def runners(self) -> list[Any]:
        return [r for s in self.steps.values() for r in s.batcher.runners]

    # -- lifecycle --------------------------------------------------------------------------
    def start(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        if self.loop is not None:
            return
        self.loop = self.deadlines.loop = loop or asyncio.get_running_loop()
        for s in self.steps.values():
            s.batcher.start(self.loop)

    @property
    def bound_loop(self) -> asyncio.AbstractEventLoop:
        loop = self.loop
        assert loop is not None, f"batcher {self.name!r} is not started"
        return loop

    async def drain(self) -> None:
        """Stop admitting, wait for every request's flow, then drain the steps."""
        self.closed = True
        while self.pending:
            if self._idle is None or self._idle.is_set():
                self._idle = asyncio.Event()
            await self._idle.wait()
        for s in self.steps.values():
            await s.batcher.drain()

    async def close(self) -> None:
        """Refuse what is left (a close without drain), then close every step."""
        self.closed = True
        self.deadlines.stop()
        for e, task in list(self._flows.items()):
            task.cancel()
            answer(e, Unavailable(f"task {self.name!r} shut down before this request "
                                  f"finished"))
        for s in self.steps.values():
            await s.batcher.close()

    def queue_limit(self) -> int:
        return self.max_queue_size

    def room(self, sequence_id: Optional[str] = None) -> int:
        """``QueuePolicy.room``'s hint: ``ROOM`` while one more flow would be admitted."""
        return ROOM if self.pending < self.max_queue_size else QUEUE_FULL

    @property
    def in_flight(self) -> int:
        """Batches running now, over every step."""
        return sum(s.batcher.in_flight for s in self.steps.values())

    def step_stats(self) -> dict[str, Any]:
        return {name: s.stats.as_dict() for name, s in self.steps.items()}

    def counters(self) -> dict[str, Any]:
        """Per-step batches, items, queue and compute times (``TaskBatcher.counters``)."""
        return {"steps": self.step_stats()}

    def cost_figures(self) -> Optional[dict[str, Any]]:
        """None: an ensemble runs no batches itself (each step's batcher learns its own)."""
        return None

    # -- admission (loop thread): ``pending`` counts the flows -------------------------------
    def admit(self, n: int) -> None:
        """Raise the precise error when ``n`` more flows cannot start now."""
        check_room(self.name, self.closed, self.pending, n, self.max_queue_size)

    def submit(self, item: Any, desc: Any = None, priority: int = 1, timeout_ms: int = 0) -> Any:
        """Admit one request; its ``waiter`` resolves with the flow's result or error."""
        if self.loop is None:
            self.start()
        self.admit(1)
        e = self._entry(item, self.bound_loop.create_future(), priority, timeout_ms)
        self._launch(e)
        return e

    def submit_many(self, specs: Sequence[tuple[Any, Any, int, int]]
                    ) -> tuple[Any, list[Entry]]:
        """``[(item, desc, priority, timeout_ms), ...]`` admitted as a unit: (group, entries)."""
        if self.loop is None:
            self.start()
        group = Group(self.bound_loop.create_future(), len(specs))
        if not specs:
            group.future.set_result(None)
            return group, []
        if any(not 1 <= p <= self.levels for _i, _d, p, _t in specs):
            raise ValueError(f"priorities must be 1..{self.levels}")
        self.admit(len(specs))
        entries = [self._entry(item, group, priority, t) for item, _d, priority, t in specs]
        for e in entries:
            self._launch(e)
        return group, entries

    def _entry(self, item: Any, waiter: Any, priority: int, timeout_ms: int) -> Any:
        now = time.monotonic_ns()
        return Entry(item, waiter, priority, now, None,
                     now + timeout_ms * 1_000_000 if timeout_ms > 0 else 0)

    def _launch(self, e: Any) -> None:
        ctx = StepContext(self, e, e.priority, e.timeout_ms)
        self.pending += 1
        self._flows[e] = self.bound_loop.create_task(self._run(ctx))
        if e.deadline_ns:
            self.deadlines.arm(e)

    async def _run(self, ctx: StepContext) -> None:
        e = ctx.entry
        try:
            outcome = await self.flow(ctx, e.item)
        except LumenError as exc:
            outcome = exc
        except asyncio.CancelledError:
            outcome = Cancelled("the request was cancelled by its caller")
        except Exception as exc:  # a flow bug answers its own request, never the others
            log.exception("pipeline %s: flow failed", self.name)
            outcome = InternalError(f"task {self.name!r} failed on this input: {exc}")
        finally:
            if self._flows.pop(e, None) is not None:
                self.pending -= 1
                if not self.pending and self._idle is not None:
                    self._idle.set()
        e.batch_size = ctx.batch_size
        e.compute_us = ctx.compute_us
        e.dispatch_ns = e.arrival_ns + ctx.queue_us * 1000 if ctx.queue_us else e.arrival_ns + 1
        answer(e, outcome)

    # -- deadlines and cancellation (loop thread) ------------------------------------------
    def expire(self, e: Any) -> None:
        """The request's deadline passed: it is answered now and its flow (with its queued
        step items) is cancelled."""
        answer(e, DeadlineExceeded(f"deadline of {e.timeout_ms} ms expired before every step "
                                   f"finished", DEADLINE_FIELD))
        task = self._flows.get(e)
        if task is not None:
            task.cancel()

    def cancel(self, entry: Any) -> None:
        """The caller went away: stop its flow (its queued step items are dropped)."""
        if entry.outcome is not UNSET:
            return
        answer(entry, Cancelled("the request was cancelled by its caller"))
        w = entry.waiter
        if isinstance(w, asyncio.Future) and w.done() and not w.cancelled():
            w.exception()
        task = self._flows.get(entry)
        if task is not None:
            task.cancel()

    def cancel_group(self, entries: Sequence[Any]) -> None:
        for e in entries:
            self.cancel(e)


def build_pipeline(name: str, config: BatchingConfig, specs: Sequence[StepSpec], flow: Flow,
                   make_runners: Callable[[StepSpec], list[Any]],
                   on_batch: Optional[Callable[[str, int, int], None]] = None) -> Pipeline:
    """One ``DynamicBatcher`` per step over ``make_runners(spec)``; ``on_batch(step, n,
    compute_us)`` sees every step's batches (metrics)."""
    steps = []
    for spec in specs:
        holder: list[Any] = []

        def step_batch(n: int, us: int, _h: list[Any] = holder, _name: str = spec.name) -> None:
            _h[0].on_batch(n, us)
            if on_batch is not None:
                on_batch(_name, n, us)

        batcher = DynamicBatcher(f"{name}.{spec.name}", spec.batching or config,
                                 make_runners(spec), on_batch=step_batch, refuse=False,
                                 **spec.batcher_options)
        step = Step(spec, batcher)
        holder.append(step)
        steps.append(step)
    return Pipeline(name, config, steps, flow)


__all__ = ["Pipeline", "Step", "StepContext", "StepSpec", "StepStats", "build_pipeline"]
