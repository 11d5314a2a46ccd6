# Declarations that compile lumen_core/scheduler.py (Cython's pure-Python mode) into
# lumen_core._scheduler: the request path's queue side as C types, their fields C fields and
# their methods C calls (cpdef: Python subclasses may override them, e.g. the sequence
# batcher's submit).  The .py is the one source; this file only adds types.  _dispatch.pxd
# cimports these types.
cimport cython


cdef class Group:
    cdef public object future
    cdef public Py_ssize_t remaining
    cpdef one_done(self)


cdef class Entry:
    cdef public object item, waiter, outcome, queue, seq, span, route, kind
    cdef public int priority, state
    cdef public Py_ssize_t row, batch_size
    cdef public long long arrival_ns, dispatch_ns, deadline_ns, compute_us, t0
    cdef public bint start, end, was_open


@cython.locals(w=object)
cpdef answer(Entry e, object outcome)

@cython.locals(n=Py_ssize_t, i=Py_ssize_t, e=Entry)
cpdef deliver(list entries, object results, long long compute_us)


@cython.freelist(64)
cdef class Rows:
    cdef public dict arrays
    cdef public Py_ssize_t n
    cpdef dict row(self, Py_ssize_t i)


@cython.freelist(256)
cdef class Prepared:
    cdef public object signature, tensors, item_shape
    cdef public Py_ssize_t length


cdef class SignatureQueue:
    cdef public object signature
    cdef public list levels
    cdef public Py_ssize_t live
    cpdef Entry head(self)
    @cython.locals(out=list, k=Py_ssize_t, e=Entry)
    cpdef list take(self, Py_ssize_t n, long long now, Admission policy)


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

    cpdef admit(self, Py_ssize_t n)
    @cython.locals(b=Py_ssize_t, w=Py_ssize_t, ahead=Py_ssize_t, fixed=double, item=double,
                   batch_ns=double, wait=double, own=double)
    cpdef long long predicted_ns(self, Py_ssize_t k, Py_ssize_t length=*)
    @cython.locals(limit="long long", wait="long long", drain="long long", retry="long long",
                   ahead=Py_ssize_t)
    cpdef check_latency(self, Py_ssize_t n, long long timeout_ns, int priority=*,
                        Py_ssize_t length=*)
    cpdef refuse_late(self, int priority, long long timeout_ms)
    @cython.locals(k=Py_ssize_t, i=Py_ssize_t, q=SignatureQueue, levels=list, e=Entry)
    cpdef Py_ssize_t queued_up_to(self, int priority)
    @cython.locals(now="long long", e=Entry)
    cpdef Entry submit(self, object item, object desc=*, int priority=*, long long timeout_ms=*)
    @cython.locals(now="long long", n=Py_ssize_t, k=Py_ssize_t, e=Entry, group=Group)
    cpdef tuple submit_many(self, object specs)
    @cython.locals(q=SignatureQueue)
    cpdef enqueue(self, Entry e, object sig)
    cpdef wake_if_formable(self, SignatureQueue q)
    cpdef wake_all(self)
    @cython.locals(got=bint)
    cpdef wait_for_work(self, object wake, double timeout, list idle)
    cpdef kill(self, Entry e)
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
