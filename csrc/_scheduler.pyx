# cython: language_level=3
"""Compiled twin of ``lumen_core/scheduler.py``: the scheduler's per-request hot path.

The same functions and the same behaviour (tests run against both); here the entry is a C
struct-backed extension type, and admission, answering, batch delivery and ``Runtime.infer``
run as C code instead of bytecode.  Cold paths (errors, closed or full batchers, observers,
off-loop preparation) call back into the Python objects exactly as the twin does.
"""
import asyncio
import time

from lumen_core import native
from lumen_core.errors import LumenError
from lumen_core.request import InferResponse, ResponseStats
from lumen_core.scheduler import UNSET, route_of

#: the twin API (the constants QUEUED, RUNNING, DONE and UNSET are shared module attributes)
__all__ = ["Entry", "Group", "answer", "deliver", "enqueue", "infer"]

QUEUED, RUNNING, DONE = 0, 1, 2
cdef enum:
    C_QUEUED = 0
    C_DONE = 2

cdef object _Future = asyncio.Future
cdef object _CancelledError = asyncio.CancelledError
cdef object _monotonic_ns = time.monotonic_ns
cdef object _perf_ns = time.perf_counter_ns
cdef object _UNSET = UNSET
cdef object _native = native


cdef class Group:
    """One future for several entries (``infer_many``): resolves when all are answered."""

    cdef public object future
    cdef public Py_ssize_t remaining
    cdef public list timers

    def __init__(self, future, Py_ssize_t n):
        self.future = future
        self.remaining = n
        self.timers = []

    def one_done(self):
        self.remaining -= 1
        if self.remaining == 0:
            for t in self.timers:
                t.cancel()
            if not self.future.done():
                self.future.set_result(None)


cdef class Entry:
    """A queued request (see the twin for the fields)."""

    cdef public object item, waiter, timer, outcome, queue, seq, span
    cdef public int priority, state, batch_size
    cdef public long long arrival_ns, dispatch_ns, deadline_ns, compute_us
    cdef public bint start, end, was_open

    def __init__(self, item, waiter, int priority, long long arrival_ns, queue=None,
                 long long deadline_ns=0):
        self.item = item
        self.waiter = waiter
        self.priority = priority
        self.arrival_ns = arrival_ns
        self.dispatch_ns = 0
        self.deadline_ns = deadline_ns
        self.timer = None
        self.state = C_QUEUED
        self.outcome = _UNSET
        self.batch_size = 0
        self.compute_us = 0
        self.queue = queue
        self.seq = None
        self.start = False
        self.end = False
        self.was_open = True
        self.span = None

    @property
    def queue_us(self):
        return (self.dispatch_ns - self.arrival_ns) // 1000 if self.dispatch_ns else 0


cdef inline void _answer(Entry e, object outcome) except *:
    if e.outcome is not _UNSET:
        return
    e.state = C_DONE
    e.outcome = outcome
    cdef object timer = e.timer
    if timer is not None:
        e.timer = None
        timer.cancel()
    cdef object w = e.waiter
    if type(w) is Group:
        (<Group>w).one_done()
    elif not w.done():
        if isinstance(outcome, LumenError):
            w.set_exception(outcome)
        else:
            w.set_result(outcome)


def answer(Entry e, outcome):
    """Answer ``e`` once (loop thread): a later answer for the same entry is dropped."""
    _answer(e, outcome)


def deliver(list entries, list results, long long compute_us):
    """Answer every entry of a finished batch that is still unanswered."""
    cdef Py_ssize_t n = len(entries), i
    cdef Entry e
    for i in range(n):
        e = <Entry>entries[i]
        if e.outcome is _UNSET:
            e.batch_size = <int>n
            e.compute_us = compute_us
            _answer(e, results[i])


def enqueue(b, item, int priority, long long timeout_ms):
    """Admit ``item`` into dynamic batcher ``b`` (loop thread); raise at once when the
    batcher is closed or full.  The deadline timer is ``b``'s to arm."""
    cdef long long now = _monotonic_ns()
    cdef object sig = item.signature
    cdef object lock = b.lock
    cdef Entry e
    lock.acquire()
    try:
        if b._closed or b._pending >= b.max_queue_size:
            b._admit(1)  # raises the precise error
        q = b._queues.get(sig)
        if q is None:
            q = b._new_queue(sig)
        e = Entry(item, _Future(loop=b._loop), priority, now, q,
                  now + timeout_ms * 1000000 if timeout_ms > 0 else 0)
        q.levels[priority - 1].append(e)
        q.live += 1
        b._pending += 1
        if b._waiting:
            b._cond.notify()
    finally:
        lock.release()
    if timeout_ms > 0:
        b._arm_deadline((e,), timeout_ms)
    return e


async def infer(rt, req):
    """``Runtime.infer``: route by task, validate, prepare, queue, await the batch, respond."""
    task = rt.tasks.get(req.task)
    if task is None or rt._closing:
        task = rt._route(req.task)
    observe = rt._observe
    cdef long long t0 = _perf_ns() if observe is not None else 0
    cdef object route = "raw"
    if observe is not None:  # a request refused before its descriptor parses keeps its route
        route = route_of(req.meta)
    cdef Py_ssize_t nbytes
    cdef Entry entry
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
        desc = _native.descriptor.parse_meta(req.meta, nbytes, backend.contract)
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
        except _CancelledError:
            batcher.cancel(entry)
            raise
    except LumenError as exc:
        if observe is not None:
            observe(task.name, route, exc.code, (_perf_ns() - t0) // 1000, 0, 0, task.version)
        raise
    except _CancelledError:
        if observe is not None:
            observe(task.name, route, "cancelled", (_perf_ns() - t0) // 1000, 0, 0,
                    task.version)
        raise
    cdef long long queue_us = (entry.dispatch_ns - entry.arrival_ns) // 1000
    if observe is not None:
        observe(task.name, route, "ok", (_perf_ns() - t0) // 1000, queue_us, entry.compute_us,
                task.version)
    # a backend may attach response meta to its outputs (e.g. ``lumen.truncated``)
    return InferResponse(req.correlation_id, req.task, value, getattr(value, "meta", None),
                         ResponseStats(entry.batch_size, queue_us, entry.compute_us,
                                       prepared.length, task.version))
