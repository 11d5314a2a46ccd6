"""Wake the event loop from a worker thread (pure-Python twin of ``csrc/_notify.pyx``).

``os.write`` releases the GIL for the write; the compiled twin does not (see its docstring):
both wake the loop, the compiled one without handing the loop the GIL mid-batch.
"""
from __future__ import annotations

import os

__all__ = ["wake"]


def wake(fd: int) -> int:
    """Write one byte to the non-blocking pipe ``fd``; -1 when it is full (a wake-up is
    pending anyway)."""
    try:
        return os.write(fd, b"\x01")
    except BlockingIOError:
        return -1
