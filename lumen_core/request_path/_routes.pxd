# Declarations that compile lumen_core/request_path/routes.py (Cython's pure-Python mode) into
# lumen_core.request_path._routes: a task version's route and its C preparations as C types,
# cimported by _dispatch.pxd.  The .py is the one source; this file only adds types.
cimport cython

from lumen_core.request_path._entries cimport Prepared
from lumen_core.request_path._scheduler cimport Batcher


cdef class DenseTensor:
    cdef readonly object make_signature
    cdef dict signatures
    cdef Py_ssize_t max_cached
    cpdef Prepared prepare(self, object desc, object payload)


cdef class TextPrep:
    cdef readonly object encode
    cdef public object signature
    cdef object mimes
    cdef public Py_ssize_t max_tokens
    cdef Py_ssize_t max_chars
    @cython.locals(n=Py_ssize_t)
    cpdef Prepared prepare(self, object req, object payload)


cdef class Route:
    cdef public object name, version, contract, router, cache
    cdef readonly object backend
    cdef public DenseTensor dense
    cdef readonly TextPrep text
    cdef public Batcher batcher
    cdef public Py_ssize_t holds
    cdef readonly Py_ssize_t priority_levels
    cdef Py_ssize_t default_priority
    cdef public long long default_timeout_ms
    cdef long long inline_max
    cdef bint off_loop
    cdef readonly bint stateful
    cpdef tuple policy(self, object desc)
    cdef bint prepares_off_loop(self, Py_ssize_t nbytes)
    cpdef object prepare(self, object req, object desc, object payload)
