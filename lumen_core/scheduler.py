"""The scheduler's per-request hot path (pure-Python twin of ``csrc/_scheduler.pyx``).

What every request pays on the event loop, in one place so it can be compiled: the queue
entry, admission into a dynamic batcher, answering a caller, delivering a finished batch, and
``Runtime.infer`` itself (validate -> prepare -> submit -> await -> respond).  Everything
around it (formation, deadlines, cancellation, sequences) stays in ``batching/``; this module
holds no policy of its own, only the straight-line code those modules would otherwise run per
request.  Both twins behave alike (tests run against both); the compiled one exists because
this glue is most of the runtime's per-request cost (``bench/bench_scheduler.py``).
"""
from __future__ import annotations

import asyncio
import time
from typing import Any

from . import native
from .contract import KEY_INPUT_KIND
from .descriptor import KIND_TENSOR
from .errors import LumenError
from .request import InferResponse, ResponseStats

#: the twin API (the constants QUEUED, RUNNING, DONE and UNSET are shared module attributes)
__all__ = ["Entry", "Group", "answer", "deliver", "enqueue", "infer"]

#: entry states (see ``batching/policy.py``)
QUEUED, RUNNING, DONE = 0, 1, 2


class _Unset:
    __slots__ = ()

    def __repr__(self) -> str:
        return "UNSET"


#: ``Entry.outcome`` before the entry is answered
UNSET: Any = _Unset()

_Future = asyncio.Future
_monotonic_ns = time.monotonic_ns
_perf_ns = time.perf_counter_ns


class Group:
    """One future for several entries (``infer_many``): resolves when all are answered."""

    __slots__ = ("future", "remaining", "timers")

    def __init__(self, future: asyncio.Future, n: int):
        self.future = future
        self.remaining = n
        self.timers: list = []  # deadline timers shared by the group's entries

    def one_done(self) -> None:
        self.remaining -= 1
        if self.remaining == 0:
            for t in self.timers:
                t.cancel()
            if not self.future.done():
                self.future.set_result(None)


class Entry:
    """A queued request: the item, who waits for it (an asyncio future or a ``Group``), its
    timing, and once answered its ``outcome`` (result or ``LumenError``).

    ``queue`` is the formation structure holding it (a dynamic batcher's signature queue);
    ``seq``, ``start``, ``end`` and ``was_open`` are the sequence batcher's; ``span`` the
    request's tracing span (None unless tracing is on).
    """

    __slots__ = ("item", "waiter", "priority", "arrival_ns", "dispatch_ns", "deadline_ns",
                 "timer", "state", "outcome", "batch_size", "compute_us", "queue", "seq",
                 "start", "end", "was_open", "span")

    def __init__(self, item: Any, waiter: Any, priority: int, arrival_ns: int,
                 queue: Any = None, deadline_ns: int = 0):
        self.item = item
        self.waiter = waiter
        self.priority = priority
        self.arrival_ns = arrival_ns
        self.dispatch_ns = 0
        self.deadline_ns = deadline_ns
        self.timer = None
        self.state = QUEUED
        self.outcome = UNSET
        self.batch_size = 0
        self.compute_us = 0
        self.queue = queue
        self.seq = None
        self.start = False
        self.end = False
        self.was_open = True
        self.span = None  # the request's OTel span when tracing is on (tracing.py)

    @property
    def queue_us(self) -> int:
        return (self.dispatch_ns - self.arrival_ns) // 1000 if self.dispatch_ns else 0


def answer(e: Entry, outcome: Any) -> None:
    """Answer ``e`` once (loop thread): a later answer for the same entry is dropped."""
    if e.outcome is not UNSET:
        return
    e.state = DONE
    e.outcome = outcome
    timer = e.timer
    if timer is not None:
        e.timer = None
        timer.cancel()
    w = e.waiter
    if type(w) is Group:
        w.one_done()
    elif not w.done():
        if isinstance(outcome, LumenError):
            w.set_exception(outcome)
        else:
            w.set_result(outcome)


def deliver(entries: list, results: list, compute_us: int) -> None:
    """Answer every entry of a finished batch that is still unanswered."""
    n = len(entries)  # one result per entry: run_split guarantees it
    for i in range(n):
        e = entries[i]
        if e.outcome is UNSET:
            e.batch_size = n
            e.compute_us = compute_us
            answer(e, results[i])


def route_of(meta: Any) -> str:
    """The metrics route a request claims (``tensor`` or ``raw``), before it is validated."""
    kind = meta.get(KEY_INPUT_KIND) if isinstance(meta, dict) else None
    return "tensor" if kind == KIND_TENSOR else "raw"


def enqueue(b: Any, item: Any, priority: int, timeout_ms: int) -> Entry:
    """Admit ``item`` into dynamic batcher ``b`` (loop thread); raise at once when the
    batcher is closed or full.  The deadline timer is ``b``'s to arm."""
    now = _monotonic_ns()
    sig = item.signature
    with b.lock:
        if b._closed or b._pending >= b.max_queue_size:
            b._admit(1)  # raises the precise error
        q = b._queues.get(sig)
        if q is None:
            q = b._new_queue(sig)
        e = Entry(item, _Future(loop=b._loop), priority, now, q,
                  now + timeout_ms * 1_000_000 if timeout_ms > 0 else 0)
        q.levels[priority - 1].append(e)
        q.live += 1
        b._pending += 1
        if b._waiting:
            b._cond.notify()
    if timeout_ms > 0:
        b._arm_deadline((e,), timeout_ms)
    return e


async def infer(rt: Any, req: Any) -> InferResponse:
    """``Runtime.infer``: route by task, validate, prepare, queue, await the batch, respond.

    The common case (a C-contiguous buffer within the payload limit, prepared inline, no
    observer) runs straight through; every other case calls back into the Runtime, which
    accepts or explains.
    """
    task = rt.tasks.get(req.task)
    if task is None or rt._closing:
        task = rt._route(req.task)
    observe = rt._observe
    t0 = _perf_ns() if observe is not None else 0
    route = "raw"
    if observe is not None:  # a request refused before its descriptor parses keeps its route
        route = route_of(req.meta)
    try:
        if task.router is not None:  # several versions: a pin or the split picks (versions.py)
            task = task.router(req.meta)
        backend = task.backend
        try:
            payload = memoryview(req.payload)
            nbytes = payload.nbytes
            if nbytes > rt._max_payload or not payload.c_contiguous:
                raise TypeError
        except TypeError:
            payload, nbytes = rt._payload(req.payload, backend)
        desc = native.descriptor.parse_meta(req.meta, nbytes, backend.contract)
        route = desc.kind
        if desc.priority or desc.timeout_ms:
            priority, timeout_ms = task.policy(desc)
        else:
            priority, timeout_ms = task.default_priority, task.default_timeout_ms
        if (backend.prepare_off_loop or nbytes > backend.inline_prepare_max_bytes) \
                and not backend.stateful:  # stateful: admitted in arrival order, inline
            # the bounded pool; the deadline covers the wait, the work and the queue after
            prepared, timeout_ms = await rt._prepare_off_loop(task, req, desc, nbytes, timeout_ms)
        else:
            try:
                prepared = backend.prepare(req, desc, payload)
            except LumenError:
                raise
            except Exception as exc:
                raise rt._prepare_failed(task, exc) from exc
        batcher = task.batcher
        entry = batcher.submit(prepared, desc, priority, timeout_ms)
        if rt._trace is not None:  # the one tracing check a request pays (tracing.py)
            rt._trace.admitted(task, route, entry)
        try:
            value = await entry.waiter
        except asyncio.CancelledError:
            batcher.cancel(entry)
            raise
    except LumenError as exc:
        if observe is not None:
            observe(task.name, route, exc.code, (_perf_ns() - t0) // 1000, 0, 0, task.version)
        raise
    except asyncio.CancelledError:
        if observe is not None:
            observe(task.name, route, "cancelled", (_perf_ns() - t0) // 1000, 0, 0,
                    task.version)
        raise
    queue_us = (entry.dispatch_ns - entry.arrival_ns) // 1000
    if observe is not None:
        observe(task.name, route, "ok", (_perf_ns() - t0) // 1000, queue_us, entry.compute_us,
                task.version)
    # a backend may attach response meta to its outputs (e.g. ``lumen.truncated``)
    return InferResponse(req.correlation_id, req.task, value, getattr(value, "meta", None),
                         ResponseStats(entry.batch_size, queue_us, entry.compute_us,
                                       prepared.length, task.version))
