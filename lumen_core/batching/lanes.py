"""The sequence batcher's records (:mod:`lumen_core.batching.sequence`): one
:class:`LiveSequence` per open sequence (its slot, queued requests and flags), one
:class:`Lane` per engine instance (its free slots, the sequences it holds, which are ready, and
the instance's :class:`~lumen_core.engine.state.SlotStore`), the queued request of a sequence
(:class:`SequenceEntry`), and the rules for sequence ids: what the model's CORRID control receives
and the error for an id that holds no sequence.  The batcher's logic (admission, slot
assignment, formation) stays in ``sequence.py``; these are only touched under its lock.
"""
from __future__ import annotations

from collections import deque
from typing import Any, Optional, Sequence

import numpy as np

from ..contract import KEY_SEQUENCE_ID, KEY_SEQUENCE_START
from ..engine.state import SequenceBatch, SlotStore
from ..errors import InvalidArgument
from .policy import QUEUED, RUNNING, Entry
from .runner import Batch

UINT64_MAX = (1 << 64) - 1
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
#: what became of a released sequence id (``unknown_sequence`` names it)
ENDED, IDLED = "ended", "idled"


class SequenceEntry(Entry):
    """A queued request of a sequence: an :class:`~lumen_core.request_path.entries.Entry` with the sequence
    batcher's own bookkeeping, which no other owner of a request reads: its sequence
    (``seq``), its ``start`` / ``end`` flags, and ``was_open`` (the sequence's ``open`` flag
    before this request was accepted: a cancelled end re-opens it)."""

    __slots__ = ("seq", "start", "end", "was_open")

    def __init__(self, item: Any, waiter: Any, arrival_ns: int, seq: "LiveSequence",
                 start: bool, end: bool, was_open: bool):
        super().__init__(item, waiter, 1, arrival_ns)
        self.seq = seq
        self.start = start
        self.end = end
        self.was_open = was_open


class LiveSequence:
    """One live sequence: its slot (once placed), its queued requests, its flags."""

    __slots__ = ("sid", "corrid", "lane", "slot", "queue", "running", "open", "fresh",
                 "last_ns", "ready_ns")

    def __init__(self, sid: str, corrid: Any, now: int):
        self.sid = sid
        self.corrid = corrid
        self.lane: Optional[Lane] = None
        self.slot = -1
        self.queue: deque[SequenceEntry] = deque()
        self.running = False
        self.open = True  # False once an end request was accepted
        self.fresh = True  # the next request that runs starts from the initial state
        self.last_ns = now
        self.ready_ns = now


class Lane:
    """One engine instance: its slots, the sequences it holds and which of them are ready."""

    __slots__ = ("index", "free", "nseq", "ready", "busy", "free_ns", "store", "idle")

    def __init__(self, index: int, capacity: int, plans: Sequence[Any]):
        self.index = index
        self.free = list(range(capacity - 1, -1, -1))  # pop() hands out slot 0 first
        self.nseq = 0
        self.ready: dict[Any, None] = {}  # LiveSequence -> None, in the order they became ready
        self.busy = False
        self.free_ns = 0  # when the lane last finished a batch
        self.store = SlotStore(capacity, plans)
        self.idle: list[Any] = []  # the wake lock of the lane's worker while it waits for work

    def wake(self) -> None:
        """Under the lock: new work may be formable on this lane."""
        if self.idle:
            self.idle.pop().release()


class LaneFormation:
    """The sequence batcher's formation strategy (``sequence.py``: its module docstring says
    when a lane forms a batch): which ready sequences of a free lane run together, oldest
    request first, one request each.  It takes from the batcher's admission queue
    (``scheduler.AdmissionQueue``: the counts; ``kill`` for a request past its deadline) under
    its lock.  ``max_batch`` sequences a batch at most; ``delay_ns`` and ``min_util`` the
    wait for more ready sequences; ``corrid``: the model takes the sequence ids (CORRID);
    ``multi_sig``: the requests have come in more than one signature (a batch then takes one)."""

    def __init__(self, queue: Any, max_batch: int, delay_ns: int, min_util: float,
                 corrid: bool):
        self.queue = queue
        self.max_batch = max_batch
        self.delay_ns = delay_ns
        self.min_util = min_util
        self.corrid = corrid
        self.sig0: Any = None
        self.multi_sig = False

    def seen(self, sig: Any) -> None:
        """Under the lock, at admission: a request of signature ``sig`` was queued."""
        if self.sig0 is None:
            self.sig0 = sig
        elif not self.multi_sig and sig != self.sig0:
            self.multi_sig = True

    def form(self, lane: Lane, now: int) -> tuple[Optional[Batch], int]:
        """(batch, 0), or (None, ns when a batch falls due) when the lane should wait."""
        ready = lane.ready
        expired = [s for s in ready if s.queue and s.queue[0].deadline_ns
                   and s.queue[0].deadline_ns <= now]
        for s in expired:  # past its deadline: never run (its loop timer answers the caller)
            while s.queue and s.queue[0].deadline_ns and s.queue[0].deadline_ns <= now \
                    and s.queue[0].state == QUEUED:
                self.queue.kill(s.queue[0])
        n = len(ready)
        if not n:
            return None, 0
        if self.delay_ns and n < self.max_batch and n < self.min_util * min(lane.nseq,
                                                                                self.max_batch):
            due = max(next(iter(ready)).ready_ns, lane.free_ns) + self.delay_ns
            if due > now:
                return None, due
        if n <= self.max_batch and not self.multi_sig:
            seqs = list(ready)
            ready.clear()
        else:
            seqs = self.pick(ready)
        return self.start(lane, seqs, now), 0

    def pick(self, ready: dict[Any, None]) -> list[Any]:
        """Up to ``max_batch_size`` ready sequences of one signature, oldest request first."""
        cands = sorted(ready, key=lambda s: s.queue[0].arrival_ns)
        if self.multi_sig:
            sig = cands[0].queue[0].item.signature
            cands = [s for s in cands if s.queue[0].item.signature == sig]
        seqs = cands[:self.max_batch]
        for s in seqs:
            del ready[s]
        return seqs

    def start(self, lane: Lane, seqs: list[Any], now: int) -> Batch:
        """Under the lock: the next request of each of ``seqs`` runs, in their slots."""
        n = len(seqs)
        entries = []
        slots = np.empty(n, dtype=np.intp)
        start = np.empty(n, dtype=bool)
        end = np.empty(n, dtype=bool)
        corrid: Optional[list[Any]] = [] if self.corrid else None
        for i, s in enumerate(seqs):
            q = s.queue
            e = q.popleft()
            while q and q[0].state != QUEUED:
                q.popleft()
            e.state = RUNNING
            e.dispatch_ns = now
            entries.append(e)
            s.running = True
            slots[i] = s.slot
            start[i] = e.start or s.fresh
            s.fresh = False
            end[i] = e.end
            if corrid is not None:
                corrid.append(s.corrid)
        queue = self.queue
        queue.running += 1  # before pending drops: drain never sees both at 0 mid-handover
        queue.pending -= n
        queue.running_items += n
        lane.busy = True
        items = SequenceBatch([e.item for e in entries], slots, start, end, corrid, lane.store)
        return Batch(entries, items, (seqs, start))


def unknown_sequence(sid: str, why: Optional[str], idle_us: int) -> InvalidArgument:
    """The error for a request without ``start`` whose id holds no sequence: ``why`` is what
    became of the id (``ENDED``, ``IDLED`` or None: never seen or forgotten), ``idle_us`` the
    task's ``max_sequence_idle_us`` (the idle case names it)."""
    if why == IDLED:
        return InvalidArgument(
            f"sequence {sid!r} was released after idling longer than max_sequence_idle_us "
            f"({idle_us} us) and its state is gone; begin it "
            f"again with {KEY_SEQUENCE_START}=true", KEY_SEQUENCE_ID)
    if why == ENDED:
        return InvalidArgument(f"sequence {sid!r} has ended; begin a new one with "
                               f"{KEY_SEQUENCE_START}=true", KEY_SEQUENCE_START)
    return InvalidArgument(f"unknown sequence {sid!r}: the first request of a sequence must "
                           f"carry {KEY_SEQUENCE_START}=true", KEY_SEQUENCE_START)


def corrid_value(task: str, sid: str, kind: Optional[str], dtype: Optional[np.dtype]) -> Any:
    """The CORRID control value of a new sequence of ``task`` (its id, as the declared dtype):
    ``kind`` is ``engine.state.corrid_kind`` of the model's inputs, ``dtype`` the CORRID
    control's dtype (declared when ``kind`` is 'int')."""
    if kind != "int":
        return sid
    assert dtype is not None  # an integer CORRID control declares its dtype
    lo, hi = (0, UINT64_MAX) if dtype.kind == "u" else (INT64_MIN, INT64_MAX)
    try:
        value = int(sid, 10)
    except ValueError:
        value = None
    if value is None or not lo <= value <= hi:
        raise InvalidArgument(f"task {task!r} passes the sequence id to its model as a "
                              f"{dtype.name} CORRID: {KEY_SEQUENCE_ID} must be an "
                              f"integer in {lo}..{hi}, got {sid[:40]!r}", KEY_SEQUENCE_ID)
    return value
