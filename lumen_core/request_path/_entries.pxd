# Declarations that compile lumen_core/request_path/entries.py (Cython's pure-Python mode) into
# lumen_core.request_path._entries: a request once admitted as C types, their fields C fields and their
# methods C calls.  The .py is the one source; this file only adds types.  _scheduler.pxd and
# _dispatch.pxd cimport these types.
cimport cython


cdef class Group:
    cdef public object future
    cdef public Py_ssize_t remaining
    cpdef one_done(self)


cdef class Entry:
    cdef public object item, waiter, outcome, queue, route, kind
    cdef public int priority, state
    cdef public Py_ssize_t row, batch_size
    cdef public long long arrival_ns, dispatch_ns, deadline_ns, compute_us, t0


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
    cpdef list take(self, Py_ssize_t n, long long now, object policy)
