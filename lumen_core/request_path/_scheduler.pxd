# Declarations that compile lumen_core/request_path/scheduler.py (Cython's pure-Python mode) into
# lumen_core.request_path._scheduler: the batcher interface the dispatcher calls, a batcher's admission
# queue and its deadline heap as C types, their fields C fields and their methods C calls.
# Batcher's methods are cpdef: the batchers (Python classes) override start, and the sequence
# batcher and the ensemble override what they admit their own way.  The queue and the heap are
# final: fields readonly where Python only reads them, cdef the steps only C calls, plain
# methods the deadline callbacks the loop calls (expire_due, expire).  The .py is the one
# source; this file only adds types.  _dispatch.pxd cimports Batcher; the entries' types come
# from _entries.pxd, the latency guard's from _latency.pxd.
cimport cython

from lumen_core.request_path._entries cimport Entry, Group, SignatureQueue
from lumen_core.request_path._latency cimport LatencyGuard


cpdef check_room(object name, bint closed, Py_ssize_t pending, Py_ssize_t n,
                 Py_ssize_t max_queue_size)


cdef class Batcher:
    cdef readonly object name
    cdef readonly AdmissionQueue queue
    cdef readonly LatencyGuard guard

    @cython.locals(q=AdmissionQueue)
    cpdef Entry submit(self, object item, object desc=*, int priority=*, long long timeout_ms=*)
    @cython.locals(q=AdmissionQueue)
    cpdef tuple submit_many(self, object specs)
    cpdef cancel(self, Entry entry)
    cpdef cancel_group(self, object entries)
    cpdef refuse_late(self, int priority, long long timeout_ms)
    cpdef Py_ssize_t queue_limit(self)
    cpdef start(self, object loop=*)


@cython.final
cdef class DeadlineHeap:
    cdef readonly list heap
    cdef Py_ssize_t count, compact_at
    cdef readonly object timer
    cdef long long timer_ns
    cdef public object loop
    cdef object expire, after

    cpdef arm(self, Entry e)
    cdef set_timer(self, long long at_ns)
    cpdef stop(self)


@cython.final
cdef class AdmissionQueue:
    cdef readonly object name, lock, loop
    cdef public object trace, on_batch, idle_event, unqueued
    cdef readonly Py_ssize_t max_queue_size, levels, ready_live
    cdef public Py_ssize_t pending, running, running_items
    cdef public bint closed, stopping
    cdef readonly bint started
    cdef readonly dict queues
    cdef readonly list idle
    cdef readonly long long delay_ns
    cdef public long long queued_tokens
    cdef readonly DeadlineHeap deadlines
    cdef readonly LatencyGuard guard

    cpdef bind(self, object loop)
    cpdef admit(self, Py_ssize_t n)
    cpdef long long predicted_ns(self, Py_ssize_t k, Py_ssize_t length=*)
    cpdef check_latency(self, Py_ssize_t n, long long timeout_ns, int priority=*,
                        Py_ssize_t length=*, long long tokens=*)
    cdef refuse_late(self, int priority, long long timeout_ms)
    @cython.locals(k=Py_ssize_t, i=Py_ssize_t, q=SignatureQueue, levels=list, e=Entry)
    cpdef Py_ssize_t queued_up_to(self, int priority)
    @cython.locals(now="long long", e=Entry, length="long long", guard=LatencyGuard)
    cdef Entry submit(self, object item, int priority=*, long long timeout_ms=*)
    @cython.locals(now="long long", n=Py_ssize_t, k=Py_ssize_t, e=Entry, group=Group,
                   tokens="long long", guard=LatencyGuard)
    cdef tuple submit_many(self, object specs)
    @cython.locals(q=SignatureQueue)
    cdef enqueue(self, Entry e, object sig)
    cdef wake_if_formable(self, SignatureQueue q)
    cpdef wake_all(self)
    @cython.locals(got=bint)
    cpdef wait_for_work(self, object wake, double timeout, list idle)
    @cython.locals(q=SignatureQueue)
    cpdef kill(self, Entry e)
    @cython.locals(k="long long", e=Entry)
    cpdef dequeued_tokens(self, list entries)
    cpdef arm(self, Entry e)
    cpdef stop_timer(self)
    cdef cancel(self, Entry entry)
    cdef cancel_group(self, object entries)
    cpdef refuse(self, object entries)
    cpdef deliver_batch(self, list entries, object results, long long compute_us)
    cpdef maybe_idle(self)
