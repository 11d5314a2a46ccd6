# Declarations that compile lumen_core/request_path/latency.py (Cython's pure-Python mode) into
# lumen_core.request_path._latency: a batcher's latency guard as a C type, the figures its checks read C
# fields and its checks C calls.  The .py is the one source; this file only adds types.
# _scheduler.pxd cimports LatencyGuard (the admission queue asks it before queueing).
cimport cython


@cython.final
cdef class LatencyGuard:
    cdef readonly object name
    cdef public object cost
    cdef public long long target_ns, budget_ns
    cdef readonly long long learnt_ns, budget_at_ns
    cdef readonly bint cost_ready, probing
    cdef readonly double cost_fixed_ns, cost_item_ns, cost_token_ns, cost_tokens_per_item
    cdef readonly double batch_seen
    cdef readonly Py_ssize_t cost_batch
    cdef public Py_ssize_t cost_workers

    @cython.locals(b=Py_ssize_t, w=Py_ssize_t, ahead=Py_ssize_t, fixed=double, item=double,
                   batch_ns=double, wait=double, own=double)
    cpdef long long predicted_ns(self, Py_ssize_t k, Py_ssize_t length, Py_ssize_t running,
                                 Py_ssize_t running_items)
    @cython.locals(target="long long", b="long long", gap=double)
    cpdef long long budget_now(self, long long now, Py_ssize_t running)
    @cython.locals(extra=double)
    cpdef long long excess_ns(self, long long tokens, Py_ssize_t n)
    @cython.locals(limit="long long", wait="long long", drain="long long", retry="long long",
                   ahead=Py_ssize_t, now="long long", queued_extra="long long",
                   own_extra="long long")
    cpdef check(self, Py_ssize_t n, long long timeout_ns, int priority, Py_ssize_t length,
                long long tokens, Py_ssize_t pending, Py_ssize_t running,
                Py_ssize_t running_items, long long queued_tokens, Py_ssize_t levels,
                object queue)
