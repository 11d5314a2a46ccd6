# cython: language_level=3
"""Compiled twin of ``lumen_core/notify.py``: wake the event loop from a worker thread.

``wake(fd)`` writes one byte to a non-blocking pipe *while holding the GIL*.  The write is a
microsecond; releasing the GIL around it (as ``os.write`` does) lets the event loop thread take
the GIL, and the worker then waits up to the interpreter's switch interval (5 ms) to get it
back before it can start the next model run.
"""
from posix.unistd cimport write

from lumen_core import notify as _py

__all__ = list(_py.__all__)


def wake(int fd):
    """Write one byte to ``fd``; return what write(2) returned (-1 when the pipe is full: a
    wake-up is pending anyway)."""
    cdef char b = 1
    return write(fd, &b, 1)
