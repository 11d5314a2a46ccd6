# Declarations that compile lumen_core/request_path/dispatch.py (Cython's pure-Python mode) into
# lumen_core.request_path._dispatch: routes and the dispatcher as C types, calling the queue side
# (lumen_core.request_path._scheduler, lumen_core.request_path._latency and lumen_core.request_path._entries, cimported) as C.  The .py is the one source; this file only adds types.
cimport cython

from lumen_core.request_path._entries cimport Entry, Prepared, Rows
from lumen_core.request_path._latency cimport LatencyGuard
from lumen_core.request_path._routes cimport Route
from lumen_core.request_path._scheduler cimport Batcher


cdef class Dispatcher:
    cdef public dict routes
    cdef public bint ready, closing
    cdef Py_ssize_t max_payload
    cdef public object observe, trace, pool

    cpdef Route route(self, object name)
    cpdef Route routed(self, object req)
    cpdef tuple payload(self, object payload, Route route)
    @cython.locals(priority=int, timeout_ms="long long", guard=LatencyGuard)
    cdef tuple checked(self, Route route, object desc, bint late)
    cdef observed(self, Route route, object kind, str code, long long t0, Entry e=*)
    @cython.locals(route=Route, entry=Entry, nbytes=Py_ssize_t, priority=int,
                   timeout_ms="long long", t0="long long", guard=LatencyGuard)
    cpdef Entry admit(self, object req, bint cached=*)
    cpdef Entry admitted(self, Entry entry, Route route, object kind, long long t0)
    cpdef settle(self, object req, Entry entry)
    cpdef failed(self, Entry entry, object exc)
    cpdef cancelled(self, Entry entry)
    cpdef finish(self, object req, Entry entry)
    @cython.locals(late=list, i=Py_ssize_t, head=Route)
    cdef list many_prepare(self, object requests, list out, dict groups, list cached,
                            long long t0)
    @cython.locals(route=Route, items=_Items, nbytes=Py_ssize_t)
    cdef object many_item(self, object req, Py_ssize_t i, list out, dict groups, long long t0)
    cdef _Items items_of(self, Route route, dict groups)
    @cython.locals(items=_Items, k=Py_ssize_t)
    cdef list many_submit(self, dict groups, list out, long long t0)
    @cython.locals(items=_Items, route=Route, entries=list, k=Py_ssize_t, i=Py_ssize_t, e=Entry)
    cdef many_respond(self, object requests, list submitted, list out, long long t0)


cdef class _Items:
    cdef public Route route
    cdef public list index, specs
    cdef list kinds
    cdef public object group, entries
    cpdef add(self, Py_ssize_t i, object kind, object prepared, object desc, int priority,
              long long timeout_ms)


cpdef respond(object req, Route route, Entry e)
