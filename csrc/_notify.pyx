# cython: language_level=3
"""Compiled twin of ``lumen_core/notify.py``: wake the event loop from a worker thread.

``wake(fd)`` writes one byte to a non-blocking pipe *while holding the GIL*.  The write is a
microsecond; releasing the GIL around it (as ``os.write`` does) lets the event loop thread take
the GIL, and the worker then waits up to the interpreter's switch interval (5 ms) to get it
back before it can start the next model run.  ``drain(fd)`` is the loop's side, for the same
reason: ``os.read`` would hand a waiting worker the GIL at every wake-up, and the loop would
then wait for it back.
"""
from posix.unistd cimport read, write

from lumen_core import notify as _py

__all__ = list(_py.__all__)

DRAIN_BYTES = _py.DRAIN_BYTES


def wake(int fd):
    """Write one byte to ``fd``; return what write(2) returned (-1 when the pipe is full: a
    wake-up is pending anyway)."""
    cdef char b = 1
    return write(fd, &b, 1)


def drain(int fd):
    """Read and drop what the non-blocking pipe ``fd`` holds (up to DRAIN_BYTES); return the
    bytes read (0: nothing was pending)."""
    cdef char buf[4096]  # DRAIN_BYTES (checked at import below)
    cdef Py_ssize_t got = read(fd, buf, sizeof(buf))
    return got if got > 0 else 0


if DRAIN_BYTES != 4096:  # the buffer above is sized for the twin's constant
    raise ImportError("lumen_core._notify: DRAIN_BYTES disagrees with lumen_core.notify")
