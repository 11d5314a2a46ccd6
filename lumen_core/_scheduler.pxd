# Declarations that compile lumen_core/scheduler.py (Cython's pure-Python mode) into
# lumen_core._scheduler: a batcher's admission state as a C type, its fields C fields and its
# methods C calls (cpdef: Python subclasses may override them, e.g. the sequence batcher's
# submit).  The .py is the one source; this file only adds types.  _dispatch.pxd cimports
# Admission; the entries' types come from _entries.pxd.
cimport cython

from lumen_core._entries cimport Entry, Group, SignatureQueue


cdef class Admission:
    cdef public object name, lock, loop, timer, trace, on_batch, idle_event
    cdef public Py_ssize_t max_queue_size, levels, pending, running, running_items, ready_live
    cdef public Py_ssize_t deadline_count, compact_at
    cdef public bint closed, stopping, started
    cdef public dict queues
    cdef public list idle, deadlines
    cdef public long long delay_ns, timer_ns, target_ns, budget_ns
    cdef public bint cost_ready
    cdef public double cost_fixed_ns, cost_item_ns, cost_token_ns, cost_tokens_per_item
    cdef public Py_ssize_t cost_batch, cost_workers
    cdef public long long learnt_ns, budget_at_ns, queued_tokens
    cdef public bint probing

    cpdef admit(self, Py_ssize_t n)
    @cython.locals(b=Py_ssize_t, w=Py_ssize_t, ahead=Py_ssize_t, fixed=double, item=double,
                   batch_ns=double, wait=double, own=double)
    cpdef long long predicted_ns(self, Py_ssize_t k, Py_ssize_t length=*)
    @cython.locals(target="long long", b="long long", gap=double)
    cpdef long long budget_now(self, long long now)
    @cython.locals(extra=double)
    cpdef long long excess_ns(self, long long tokens, Py_ssize_t n)
    @cython.locals(limit="long long", wait="long long", drain="long long", retry="long long",
                   ahead=Py_ssize_t, now="long long", queued_extra="long long",
                   own_extra="long long")
    cpdef check_latency(self, Py_ssize_t n, long long timeout_ns, int priority=*,
                        Py_ssize_t length=*, long long tokens=*)
    cpdef refuse_late(self, int priority, long long timeout_ms)
    @cython.locals(k=Py_ssize_t, i=Py_ssize_t, q=SignatureQueue, levels=list, e=Entry)
    cpdef Py_ssize_t queued_up_to(self, int priority)
    @cython.locals(now="long long", e=Entry, length="long long")
    cpdef Entry submit(self, object item, object desc=*, int priority=*, long long timeout_ms=*)
    @cython.locals(now="long long", n=Py_ssize_t, k=Py_ssize_t, e=Entry, group=Group,
                   tokens="long long")
    cpdef tuple submit_many(self, object specs)
    @cython.locals(q=SignatureQueue)
    cpdef enqueue(self, Entry e, object sig)
    cpdef wake_if_formable(self, SignatureQueue q)
    cpdef wake_all(self)
    @cython.locals(got=bint)
    cpdef wait_for_work(self, object wake, double timeout, list idle)
    cpdef kill(self, Entry e)
    @cython.locals(k="long long", e=Entry)
    cpdef dequeued_tokens(self, list entries)
    @cython.locals(q=SignatureQueue)
    cpdef unqueue(self, Entry e)
    cpdef arm(self, Entry e)
    cpdef set_timer(self, long long at_ns)
    @cython.locals(now="long long", e=Entry, expired=bint, heap=list)
    cpdef expire_due(self)
    @cython.locals(state=int)
    cpdef expire(self, Entry e)
    cpdef stop_timer(self)
    cpdef cancel(self, Entry entry)
    cpdef cancel_group(self, object entries)
    cpdef refuse(self, object entries)
    cpdef deliver_batch(self, list entries, object results, long long compute_us)
    cpdef maybe_idle(self)
    cpdef start(self, object loop=*)
