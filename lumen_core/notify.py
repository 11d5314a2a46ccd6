"""Wake the event loop from a worker thread (pure-Python twin of ``csrc/_notify.pyx``).

``os.write`` / ``os.read`` release the GIL for the syscall; the compiled twin does not (see
its docstring): both wake the loop and drain the pipe, the compiled one without handing the
GIL to the other thread at every wake-up.
"""
from __future__ import annotations

import os

__all__ = ["drain", "wake"]

#: bytes read from the wake-up pipe per drain (any number of pending wake-ups)
DRAIN_BYTES = 4096


def wake(fd: int) -> int:
    """Write one byte to the non-blocking pipe ``fd``; -1 when it is full (a wake-up is
    pending anyway)."""
    try:
        return os.write(fd, b"\x01")
    except BlockingIOError:
        return -1


def drain(fd: int) -> int:
    """Read and drop what the non-blocking pipe ``fd`` holds (up to :data:`DRAIN_BYTES`);
    return the bytes read (0: nothing was pending)."""
    try:
        return len(os.read(fd, DRAIN_BYTES))
    except BlockingIOError:
        return 0
