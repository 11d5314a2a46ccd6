# cython: annotation_typing=False
"""A request once admitted, in its typed homes: queue entries, their queues, their answers.

One source, two builds, like ``scheduler.py``: Cython compiles this file with the
declarations of ``lumen_core/request_path/_entries.pxd`` into ``lumen_core.request_path._entries``; run as plain Python
it is the pure-Python twin.  ``_scheduler.pxd`` (admission, deadlines, delivery) and
``_dispatch.pxd`` cimport these types.

- :class:`Prepared` -- a request ready for batching (execution signature, payload buffers);
- :class:`Entry` / :class:`Group` -- a queued request and who waits for it; :func:`answer`
  settles one, :func:`deliver` a finished batch's;
- :class:`Rows` -- a finished batch's outputs, split once: a request's result is its row;
- :class:`SignatureQueue` -- one execution signature's queue, one FIFO per priority level.
"""
from __future__ import annotations

import asyncio
from collections import deque as _deque
from typing import Any, Optional

from ..errors import LumenError

#: the twin API (``lumen_core.request_path._entries`` exports the same names)
__all__ = ["Entry", "Group", "Prepared", "Rows", "SignatureQueue", "answer", "deliver"]

#: entry states: queued -> running (taken into a batch, under the batcher's lock) -> done
QUEUED, RUNNING, DONE = 0, 1, 2
#: the metrics routes a request may take
RAW, TENSOR = "raw", "tensor"


class _Unset:
    __slots__ = ()

    def __repr__(self) -> str:
        return "UNSET"


#: ``Entry.outcome`` before the entry is answered
UNSET: Any = _Unset()


# ------------------------------------------------------------------------------ entries
class Group:
    """One future for several entries (``infer_many``, a pipeline step's items): it resolves
    once every entry is answered; each entry's ``outcome`` holds its own result or error."""

    __slots__ = ("future", "remaining")

    def __init__(self, future: asyncio.Future[Any], n: int):
        self.future = future
        self.remaining = n

    def one_done(self) -> None:
        self.remaining -= 1
        if self.remaining == 0 and not self.future.done():
            self.future.set_result(None)


class Entry:
    """A queued request: the item, who waits for it (a future or a :class:`Group`), its
    timing, and once answered its ``outcome`` (a result, :class:`Rows` with ``row``, or a
    ``LumenError``).

    What every owner of a request needs: the scheduler's (the item, its waiter, priority,
    timing, state and answer; ``queue``, the dynamic batcher's :class:`SignatureQueue` holding
    it) and the dispatcher's (``route``, ``kind``, ``t0``: it reads them on every answer, to
    observe it and make the response, so they ride on the entry rather than in a map).
    Per-owner bookkeeping lives with its owner: the sequence batcher's in its own entries
    (``batching/lanes.SequenceEntry``), the tracer's spans in its own map (``tracing.py``).
    """

    __slots__ = ("item", "waiter", "priority", "arrival_ns", "dispatch_ns", "deadline_ns",
                 "state", "outcome", "row", "batch_size", "compute_us", "queue", "route",
                 "kind", "t0")

    def __init__(self, item: Any, waiter: Any, priority: int, arrival_ns: int,
                 queue: Any = None, deadline_ns: int = 0):
        self.item = item
        self.waiter = waiter
        self.priority = priority
        self.arrival_ns = arrival_ns
        self.dispatch_ns = 0
        self.deadline_ns = deadline_ns
        self.state = QUEUED
        self.outcome = UNSET
        self.row = -1
        self.batch_size = 0
        self.compute_us = 0
        self.queue = queue
        self.route: Any = None  # the Route (task version) the Dispatcher admitted it for
        self.kind: str = RAW  # its metrics route
        self.t0 = 0  # when the Dispatcher took it (monotonic ns; observed requests only)

    @property
    def queue_us(self) -> int:
        return (self.dispatch_ns - self.arrival_ns) // 1000 if self.dispatch_ns else 0

    @property
    def timeout_ms(self) -> int:
        """The deadline the entry was admitted with (0: none)."""
        return (self.deadline_ns - self.arrival_ns) // 1_000_000 if self.deadline_ns else 0

    def result(self) -> Any:
        """The answered result as a mapping of outputs (a batch row is split out here)."""
        out = self.outcome
        if type(out) is Rows:
            return out.row(self.row)
        return out


def answer(e: Entry, outcome: Any) -> None:
    """Answer ``e`` once (loop thread): a later answer for the same entry is dropped."""
    if e.outcome is not UNSET:
        return
    e.state = DONE
    e.outcome = outcome
    w = e.waiter
    if type(w) is Group:
        w.one_done()
    elif not w.done():
        if isinstance(outcome, LumenError):
            w.set_exception(outcome)
        else:
            w.set_result(outcome)


def deliver(entries: list[Entry], results: Any, compute_us: int) -> None:
    """Answer every entry of a finished batch that is still unanswered: with its own result,
    or (``results`` a :class:`Rows`) with the batch's outputs and its row."""
    n = len(entries)
    i = 0
    if type(results) is Rows:
        for i in range(n):
            e = entries[i]
            if e.outcome is UNSET:
                e.batch_size = n
                e.compute_us = compute_us
                e.row = i
                answer(e, results)
        return
    for i in range(n):  # one result per entry: run_split guarantees it
        e = entries[i]
        if e.outcome is UNSET:
            e.batch_size = n
            e.compute_us = compute_us
            answer(e, results[i])


class Rows:
    """A finished batch's outputs, split once for the whole batch: item ``i``'s result is
    ``{name: array[i]}`` (made only when someone reads it, :meth:`row`)."""

    __slots__ = ("arrays", "n")

    def __init__(self, arrays: dict[str, Any], n: int):
        self.arrays = arrays
        self.n = n

    def row(self, i: int) -> dict[str, Any]:
        # views, never copies (a batch's outputs are never recycled); 0-d for a 1-D output
        return {k: v[i, ...] for k, v in self.arrays.items()}

    def __len__(self) -> int:
        return self.n


# ------------------------------------------------------------------------------ items
class Prepared:
    """One request ready for batching (``engine.plan.PreparedModelRequest``).

    ``signature`` is the execution signature: only items with equal signatures share a batch.
    ``tensors`` holds the per-input payload buffers (indexed by the plan's ``slot``),
    ``item_shape`` the per-item shape of dense inputs (no batch axis), ``length`` the token
    count of ragged inputs (length-aware batching).
    """

    __slots__ = ("signature", "tensors", "item_shape", "length")

    def __init__(self, signature: Any, tensors: tuple[Any, ...], item_shape: tuple[int, ...] = (),
                 length: int = 0):
        self.signature = signature
        self.tensors = tensors
        self.item_shape = item_shape
        self.length = length


# ------------------------------------------------------------------------------ queues
class SignatureQueue:
    """Requests of one execution signature: one FIFO per priority level (index 0 = highest).
    Only touched under the batcher's lock."""

    __slots__ = ("signature", "levels", "live")

    def __init__(self, signature: Any, levels: int):
        self.signature = signature
        self.levels: list[_deque[Entry]] = [_deque() for _ in range(levels)]
        self.live = 0

    def head(self) -> Optional[Entry]:
        """The oldest live entry of the highest non-empty level (dead ones are dropped)."""
        for level in self.levels:
            while level and level[0].state != QUEUED:
                level.popleft()
            if level:
                return level[0]
        return None

    def take(self, n: int, now: int, policy: Any) -> list[Entry]:
        """Pop up to ``n`` live entries, highest priority first, FIFO within a level, and mark
        them running; an entry past its deadline is killed instead (never run) by ``policy``
        (the batcher's ``scheduler.AdmissionQueue``)."""
        out = []
        k = 0
        for level in self.levels:
            while level and k < n:
                e = level.popleft()
                if e.state == QUEUED:
                    if e.deadline_ns and e.deadline_ns <= now:
                        policy.kill(e)
                    else:
                        e.state = RUNNING
                        e.dispatch_ns = now
                        out.append(e)
                        k += 1
            if k == n:
                break
        self.live -= k
        return out
