"""Bounded threads for CPU-heavy preprocessing (image decode, tokenising large texts).

Why not ``asyncio.to_thread``: its executor is unbounded in queue length and first come, first
served, so six 8 MB texts in it make a 6 KB request wait for all of them, and a request whose
deadline passed while it waited is still preprocessed.  Here:

- requests wait in a heap ordered by payload size (smallest first; arrival order breaks ties);
- one of the threads only ever takes inputs of at most ``small_bytes``, so a run of large inputs
  can occupy the other threads but never starve small ones;
- at most ``max_pending`` requests wait (past that: ``Overloaded`` with Retry-After, at once);
- a request's deadline covers its wait and its preprocessing: one that expired while waiting is
  never started, and its caller is answered at the deadline even if the work is still running
  (the result is then dropped).
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import threading
import time
from typing import Any, Callable, Optional

from .contract import KEY_TIMEOUT_MS
from .errors import DeadlineExceeded, Overloaded, Unavailable

log = logging.getLogger("lumen")

#: general preprocessing threads (the 2-core reference box: one per core)
DEFAULT_THREADS = 2
#: the reserved thread's limit: inputs up to this size always find a free thread
DEFAULT_SMALL_BYTES = 64 * 1024
#: requests that may wait for a preprocessing thread
DEFAULT_MAX_PENDING = 256
#: Retry-After hint (seconds) when the pool is full
RETRY_AFTER_S = 1


def _settle(fut: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if fut.done():
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


class PreparePool:
    """See the module docstring.  ``start`` before use, ``stop`` to end the threads."""

    def __init__(self, threads: int = DEFAULT_THREADS, small_bytes: int = DEFAULT_SMALL_BYTES,
                 max_pending: int = DEFAULT_MAX_PENDING):
        self.small_bytes = small_bytes
        self.max_pending = max_pending
        self._cond = threading.Condition()
        #: (nbytes, sequence, fn, future, loop, deadline): smallest first, then oldest
        self._heap: list[tuple[int, int, Any, Any, Any, Any]] = []
        self._seq = itertools.count()
        self._stopping = False
        self._threads = [threading.Thread(target=self._work, args=(False,), daemon=True,
                                          name=f"lumen-prepare-{i}") for i in range(threads)]
        self._threads.append(threading.Thread(target=self._work, args=(True,), daemon=True,
                                              name="lumen-prepare-small"))
        self._started = False

    @property
    def pending(self) -> int:
        return len(self._heap)

    def start(self) -> None:
        if not self._started:
            self._started = True
            for t in self._threads:
                t.start()

    def stop(self) -> None:
        """End the threads; inputs still waiting are answered ``Unavailable``."""
        with self._cond:
            self._stopping = True
            left, self._heap = self._heap, []
            self._cond.notify_all()
        for _n, _s, _fn, fut, loop, _d in left:
            try:
                loop.call_soon_threadsafe(_settle, fut, False, Unavailable(
                    "the runtime shut down before this input was preprocessed"))
            except RuntimeError:  # its loop is closed: nobody waits any more
                pass
        if self._started:
            for t in self._threads:
                t.join()

    async def run(self, fn: Callable[[], Any], nbytes: int, timeout_ms: int = 0) -> Any:
        """``fn()`` on a pool thread; ``DeadlineExceeded`` once ``timeout_ms`` (0: none) has
        passed, whether the work is waiting, running or done too late."""
        if not self._started:
            self.start()
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        deadline = time.monotonic_ns() + timeout_ms * 1_000_000 if timeout_ms > 0 else 0
        with self._cond:
            if len(self._heap) >= self.max_pending:
                raise Overloaded(f"{len(self._heap)} large inputs are waiting for preprocessing "
                                 f"(the limit is {self.max_pending}); retry later", None,
                                 RETRY_AFTER_S)
            heapq.heappush(self._heap, (nbytes, next(self._seq), fn, fut, loop, deadline))
            self._cond.notify_all()
        if not timeout_ms:
            return await fut
        try:
            return await asyncio.wait_for(fut, timeout_ms / 1000.0)
        except asyncio.TimeoutError:
            raise DeadlineExceeded(f"deadline of {timeout_ms} ms expired during preprocessing",
                                   KEY_TIMEOUT_MS) from None

    def _take(self, small_only: bool) -> Optional[tuple[int, int, Any, Any, Any, Any]]:
        with self._cond:
            while True:
                if self._stopping:
                    return None
                heap = self._heap
                if heap and (not small_only or heap[0][0] <= self.small_bytes):
                    return heapq.heappop(heap)
                self._cond.wait()

    def _work(self, small_only: bool) -> None:
        while True:
            item = self._take(small_only)
            if item is None:
                return
            _n, _s, fn, fut, loop, deadline = item
            if fut.done():  # its caller gave up or its deadline passed while it waited
                continue
            if deadline and time.monotonic_ns() >= deadline:
                continue  # never started; ``run`` answers the caller at the deadline
            try:
                ok, value = True, fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                ok, value = False, exc
            try:
                loop.call_soon_threadsafe(_settle, fut, ok, value)
            except RuntimeError:  # the loop closed meanwhile: nobody waits any more
                log.debug("prepare result dropped: the event loop is closed")
