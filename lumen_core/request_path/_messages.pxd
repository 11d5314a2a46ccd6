# Declarations that compile lumen_core/request_path/messages.py (Cython's pure-Python mode) into
# lumen_core.request_path._messages: the request path's messages as C types with C fields.
cimport cython

cdef class InferRequest:
    cdef public object task, payload, payload_mime, meta
    cdef object _cid

cdef class ResponseStats:
    cdef public object batch_size, queue_us, compute_us, tokens, version

cdef class InferResponse:
    cdef public object task
    cdef object _cid, _req, _outputs, _meta, _stats, _version
    cdef Py_ssize_t _row
    cdef long long _batch_size, _queue_us, _compute_us, _tokens

@cython.locals(r=InferResponse, rq=InferRequest)
cpdef InferResponse respond(object req, object outcome, Py_ssize_t row, long long batch_size,
                            long long queue_us, long long compute_us, long long tokens,
                            object version)
