# Declarations that compile lumen_core/request_path/dispatch.py (Cython's pure-Python mode) into
# lumen_core.request_path._dispatch: routes and the dispatcher as C types, calling the queue side
# (lumen_core.request_path._scheduler, lumen_core.request_path._latency and lumen_core.request_path._entries, cimported) as C.  The .py is the one source; this file only adds types.
cimport cython

from lumen_core.request_path._entries cimport Entry, Prepared, Rows
from lumen_core.request_path._latency cimport LatencyGuard
from lumen_core.request_path._scheduler cimport Batcher


cdef class DenseTensor:
    cdef public object make_signature
    cdef public dict signatures
    cdef public Py_ssize_t max_cached
    cpdef Prepared prepare(self, object desc, object payload)


cdef class TextPrep:
    cdef public object encode, signature, mimes
    cdef public Py_ssize_t max_tokens, max_chars
    @cython.locals(n=Py_ssize_t)
    cpdef Prepared prepare(self, object req, object payload)


cdef class Route:
    cdef public object name, version, backend, contract, router, cache
    cdef public DenseTensor dense
    cdef public TextPrep text
    cdef public Batcher batcher
    cdef public Py_ssize_t holds, priority_levels, default_priority
    cdef public long long default_timeout_ms, inline_max
    cdef public bint off_loop, stateful
    cpdef tuple policy(self, object desc)
    cpdef bint prepares_off_loop(self, Py_ssize_t nbytes)
    cpdef object prepare(self, object req, object desc, object payload)


cdef class Dispatcher:
    cdef public dict routes
    cdef public bint ready, closing
    cdef public Py_ssize_t max_payload
    cdef public object observe, trace, pool

    cpdef Route route(self, object name)
    cpdef Route routed(self, object req)
    cpdef tuple payload(self, object payload, Route route)
    @cython.locals(priority=int, timeout_ms="long long", guard=LatencyGuard)
    cpdef tuple checked(self, Route route, object desc, bint late)
    cpdef observed(self, Route route, object kind, str code, long long t0, Entry e=*)
    @cython.locals(route=Route, entry=Entry, nbytes=Py_ssize_t, priority=int,
                   timeout_ms="long long", t0="long long", guard=LatencyGuard)
    cpdef Entry admit(self, object req, bint cached=*)
    cpdef Entry admitted(self, Entry entry, Route route, object kind, long long t0)
    cpdef settle(self, object req, Entry entry)
    cpdef failed(self, Entry entry, object exc)
    cpdef cancelled(self, Entry entry)
    cpdef finish(self, object req, Entry entry)
    @cython.locals(late=list, i=Py_ssize_t, head=Route)
    cpdef list many_prepare(self, object requests, list out, dict groups, list cached,
                            long long t0)
    @cython.locals(route=Route, items=_Items, nbytes=Py_ssize_t)
    cpdef object many_item(self, object req, Py_ssize_t i, list out, dict groups, long long t0)
    cpdef _Items items_of(self, Route route, dict groups)
    @cython.locals(items=_Items, k=Py_ssize_t)
    cpdef list many_submit(self, dict groups, list out, long long t0)
    @cython.locals(items=_Items, route=Route, entries=list, k=Py_ssize_t, i=Py_ssize_t, e=Entry)
    cpdef many_respond(self, object requests, list submitted, list out, long long t0)


cdef class _Items:
    cdef public Route route
    cdef public list index, kinds, specs
    cdef public object group, entries
    cpdef add(self, Py_ssize_t i, object kind, object prepared, object desc, int priority,
              long long timeout_ms)


cpdef respond(object req, Route route, Entry e)
