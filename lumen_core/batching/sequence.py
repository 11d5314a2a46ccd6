"""Sequence batcher for stateful tasks (Triton's sequence batcher semantics, SPEC section 3).

Every request names its sequence (``lumen.sequence.id``); the first one carries
``lumen.sequence.start=true``, the last ``lumen.sequence.end=true``.  A sequence is pinned to
a *slot* of one engine instance (a *lane*) from its start until it ends or idles past
``max_sequence_idle_us``; the slot indexes the instance's :class:`SlotStore`, where the runtime
keeps the sequence's implicit state between requests.

Strategies:

- ``direct``: each lane has ``max_batch_size`` slots; a batch is every sequence of the lane
  that has a request ready (so it never exceeds the slot count);
- ``oldest``: each lane has ``max_candidate_sequences`` slots; a batch is up to
  ``max_batch_size`` ready sequences, oldest request first.

Both: at most one request per sequence is in flight (a lane runs one batch at a time and a
sequence lives on one lane), so order within a sequence is preserved and request i+1 always
sees the state request i produced.  A lane forms a batch when it is free and either the batch
is full, ``minimum_slot_utilization`` of the sequences it holds have a request ready (default
1.0: all of them), or the oldest ready request has waited ``max_queue_delay_us`` (default 0:
form a batch at once, whatever is ready) *since the lane became free*: time spent behind a
running batch does not count, otherwise a request that arrived during a long batch would
always leave alone right after it and a closed loop would lock into batches of 1 and N-1.  Waiting for most streams of a closed loop makes
full batches; a utilization of about 0.5 lets two halves alternate, so the event loop answers
one half while the engine computes the other.  With no free slot anywhere a new
sequence waits in a FIFO backlog; the backlog is bounded by ``batching.max_queue_size``, which
counts every queued request of the task (past it: ``Overloaded``), except that a sequence
holding a slot may always queue one request, so the requests that end sequences and free slots
are never locked out by a full backlog.

Semantics chosen where Triton leaves room (documented for callers):

- ``start=true`` on an *active* id restarts it in place: the request queues behind the
  sequence's earlier requests (order is kept), and when it runs START is 1 and the state is
  reset to its initial value.  A start on an ended or idled-out id begins a new sequence.
- A request without ``start`` for an unknown, ended or idled-out id is ``InvalidArgument``
  (the idle case names ``max_sequence_idle_us``); so is a missing ``lumen.sequence.id``.
- A cancelled or expired *queued* request is dropped without touching the state: the next
  request continues from the state left by the last request that ran.  When it was the
  sequence's first (start) request, the next one still begins from the initial state.  A
  cancelled ``end`` request re-opens the sequence; a cancelled restart of an ended id leaves
  it ended (its slot is freed).  A request that expires or is cancelled
  *while its batch runs* has reached the model: the state advances, the caller gets the error.
- If the model fails for a request (after split-and-retry isolates it), that request's state
  update is dropped: the sequence continues from the state before it (after a failed start
  request: from the initial state, never from the slot's previous occupant).
- ``lumen.priority`` is accepted but does not reorder sequences (Triton has no priorities in
  its sequence batcher either).
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from functools import partial
from typing import Any, Callable, Optional, Sequence

import numpy as np

from ..config import SequenceConfig, TaskConfig
from ..contract import KEY_SEQUENCE_ID, KEY_SEQUENCE_START
from ..engine.state import SequenceBatch, SlotStore, StatefulPlan, corrid_kind
from ..errors import (
    Cancelled,
    DeadlineExceeded,
    InvalidArgument,
    LumenError,
    Overloaded,
    Unavailable,
)
from .dynamic import (
    DONE,
    OVERLOAD_RETRY_AFTER_S,
    QUEUED,
    RUNNING,
    BatcherLifecycle,
    BatchResult,
    Entry,
    run_split,
)

#: how many ended / idled-out ids are remembered for a precise error message
MAX_REMEMBERED_IDS = 4096
#: the idle sweep runs this many times per ``max_sequence_idle_us`` (detection within +25%)
IDLE_SWEEPS_PER_TIMEOUT = 4
#: but not more often than this (ns)
MIN_SWEEP_INTERVAL_NS = 1_000_000
UINT64_MAX = (1 << 64) - 1
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
ENDED, IDLED = "ended", "idled"


class SeqEntry(Entry):
    """A queued request of a sequence."""

    __slots__ = ("seq", "start", "end", "was_open")

    def __init__(self, item: Any, future: asyncio.Future, arrival_ns: int, seq: "_Sequence",
                 start: bool, end: bool):
        super().__init__(item, future, 1, arrival_ns)
        self.seq = seq
        self.start = start
        self.end = end
        self.was_open = True  # the sequence's ``open`` flag before this request was accepted


class _Sequence:
    """One live sequence: its slot (once placed), its queued requests, its flags."""

    __slots__ = ("sid", "corrid", "lane", "slot", "queue", "running", "open", "fresh",
                 "last_ns", "ready_ns")

    def __init__(self, sid: str, corrid: Any, now: int):
        self.sid = sid
        self.corrid = corrid
        self.lane: Optional[_Lane] = None
        self.slot = -1
        self.queue: deque = deque()
        self.running = False
        self.open = True  # False once an end request was accepted
        self.fresh = True  # the next request that runs starts from the initial state
        self.last_ns = now
        self.ready_ns = now


class _Lane:
    """One engine instance: its slots, the sequences it holds and which of them are ready."""

    __slots__ = ("engine", "index", "free", "nseq", "ready", "busy", "free_ns", "store", "timer",
                 "timer_at")

    def __init__(self, engine: Any, index: int, capacity: int, plans: Sequence[Any]):
        self.engine = engine
        self.index = index
        self.free = list(range(capacity - 1, -1, -1))  # pop() hands out slot 0 first
        self.nseq = 0
        self.ready: dict = {}  # _Sequence -> None, in the order they became ready
        self.busy = False
        self.free_ns = 0  # when the lane last finished a batch
        self.store = SlotStore(capacity, plans)
        self.timer: Optional[asyncio.TimerHandle] = None
        self.timer_at = 0.0


class SequenceBatcher(BatcherLifecycle):
    """Per-task sequence batcher over the task's engine instances (see the module docstring).

    Public surface as :class:`~lumen_core.batching.dynamic.DynamicBatcher`: ``infer``,
    ``drain``, ``pending``, ``in_flight``; plus ``active_sequences`` and ``backlog``.
    """

    def __init__(self, name: str, config: TaskConfig, instances: Sequence[Any], backend: Any,
                 on_batch: Optional[Callable[[int, int], None]] = None):
        super().__init__()
        self.name = name
        self.config = config
        self.backend = backend
        self.on_batch = on_batch
        seq = config.sequence or SequenceConfig()
        self.seq_config = seq
        self.strategy = seq.strategy
        self.max_batch = config.batching.max_batch_size
        self.max_queue = config.batching.max_queue_size
        if seq.strategy == "oldest":
            self.capacity = max(seq.max_candidate_sequences or self.max_batch, self.max_batch)
        else:
            self.capacity = self.max_batch
        spec = instances[0].spec
        self._stateful = [p for p in spec.inputs if isinstance(p, StatefulPlan)]
        self._corrid = corrid_kind(spec.inputs)
        self._corrid_dtype = next((p.dtype for p in spec.inputs
                                   if getattr(p, "kind", None) == "CORRID"), None)
        self._lanes = [_Lane(inst, i, self.capacity, spec.inputs) for i, inst in enumerate(instances)]
        self._seqs: dict = {}
        self._backlog: deque = deque()
        self._gone: OrderedDict = OrderedDict()  # sid -> ENDED | IDLED
        self._sweep: Optional[asyncio.TimerHandle] = None
        self._idle_ns = seq.max_sequence_idle_us * 1000
        self._sweep_s = max(self._idle_ns // IDLE_SWEEPS_PER_TIMEOUT, MIN_SWEEP_INTERVAL_NS) / 1e9
        self._delay_ns = seq.max_queue_delay_us * 1000
        self._min_util = seq.minimum_slot_utilization
        self._sig0: Any = None
        self._multi_sig = False

    # -- public ---------------------------------------------------------------------------
    @property
    def active_sequences(self) -> int:
        """Sequences holding a slot."""
        return len(self._seqs) - len(self._backlog)

    @property
    def backlog(self) -> int:
        """Sequences waiting for a free slot."""
        return len(self._backlog)

    async def infer(self, item: Any, desc: Any, priority: int = 1, timeout_ms: int = 0) -> BatchResult:
        """Queue ``item`` on its sequence (``desc.sequence_id/start/end``) and await its result."""
        entry = self.submit(item, desc, timeout_ms)
        try:
            return await entry.future
        except asyncio.CancelledError:
            self.cancel(entry)
            raise

    def submit(self, item: Any, desc: Any, timeout_ms: int = 0) -> SeqEntry:
        """Admit one request of a sequence; raise at once when it cannot be accepted."""
        if self._closed:
            raise Unavailable(f"task {self.name!r} is shutting down; not accepting requests")
        sid = desc.sequence_id
        if sid is None:
            raise InvalidArgument(f"task {self.name!r} is stateful: every request needs "
                                  f"{KEY_SEQUENCE_ID} (and {KEY_SEQUENCE_START}=true on the first)",
                                  KEY_SEQUENCE_ID)
        seq = self._seqs.get(sid)
        if self._pending >= self.max_queue and (seq is None or seq.lane is None or seq.queue):
            # A sequence that holds a slot may always queue one request, so a full backlog
            # can never block the requests (e.g. an end) that would free a slot for it.
            raise Overloaded(f"task {self.name!r} queue is full ({self.max_queue} pending, "
                             f"{len(self._backlog)} sequences waiting for a slot); retry later",
                             None, OVERLOAD_RETRY_AFTER_S)
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        now = time.monotonic_ns()
        start = desc.sequence_start
        if seq is None:
            if not start:
                raise self._unknown(sid)
            seq = _Sequence(sid, self._corrid_value(sid), now)
            self._seqs[sid] = seq
            self._gone.pop(sid, None)
            self._place(seq)
            if self._sweep is None:
                self._sweep = loop.call_later(self._sweep_s, self._sweep_idle)
        elif not start and not seq.open:
            raise InvalidArgument(f"sequence {sid!r} has ended (its end request was accepted); "
                                  f"begin a new one with {KEY_SEQUENCE_START}=true",
                                  KEY_SEQUENCE_START)
        was_open = seq.open
        seq.open = not desc.sequence_end
        sig = item.signature
        if self._sig0 is None:
            self._sig0 = sig
        elif not self._multi_sig and sig != self._sig0:
            self._multi_sig = True
        entry = SeqEntry(item, loop.create_future(), now, seq, start, desc.sequence_end)
        entry.was_open = was_open
        seq.queue.append(entry)
        seq.last_ns = now
        self._pending += 1
        if timeout_ms > 0:
            entry.timer = loop.call_later(timeout_ms / 1000.0, self._expire, entry, timeout_ms)
        lane = seq.lane
        if lane is not None and not seq.running and len(seq.queue) == 1:
            seq.ready_ns = now
            lane.ready[seq] = None
            if not lane.busy:
                self._dispatch(lane)
        return entry

    def cancel(self, entry: SeqEntry) -> None:
        """The caller went away: drop a queued entry (a running one finishes unseen)."""
        if entry.state == QUEUED:
            self._kill(entry)
        if not entry.future.done():
            entry.future.set_exception(Cancelled("the request was cancelled by its caller"))
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None

    async def drain(self) -> None:
        """Stop admitting, wait for every queued (backlog included) and running request, then
        stop the idle sweep and the lanes' delay timers."""
        await super().drain()
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for lane in self._lanes:
            if lane.timer is not None:
                lane.timer.cancel()
                lane.timer = None

    # -- sequences ------------------------------------------------------------------------
    def _unknown(self, sid: str) -> InvalidArgument:
        why = self._gone.get(sid)
        if why == IDLED:
            return InvalidArgument(
                f"sequence {sid!r} was released after idling longer than max_sequence_idle_us "
                f"({self.seq_config.max_sequence_idle_us} us) and its state is gone; begin it "
                f"again with {KEY_SEQUENCE_START}=true", KEY_SEQUENCE_ID)
        if why == ENDED:
            return InvalidArgument(f"sequence {sid!r} has ended; begin a new one with "
                                   f"{KEY_SEQUENCE_START}=true", KEY_SEQUENCE_START)
        return InvalidArgument(f"unknown sequence {sid!r}: the first request of a sequence must "
                               f"carry {KEY_SEQUENCE_START}=true", KEY_SEQUENCE_START)

    def _corrid_value(self, sid: str) -> Any:
        """The CORRID control value of a new sequence (its id, as the declared dtype)."""
        if self._corrid != "int":
            return sid
        kind = self._corrid_dtype.kind
        lo, hi = (0, UINT64_MAX) if kind == "u" else (INT64_MIN, INT64_MAX)
        try:
            value = int(sid, 10)
        except ValueError:
            value = None
        if value is None or not lo <= value <= hi:
            raise InvalidArgument(f"task {self.name!r} passes the sequence id to its model as a "
                                  f"{self._corrid_dtype.name} CORRID: {KEY_SEQUENCE_ID} must be an "
                                  f"integer in {lo}..{hi}, got {sid[:40]!r}", KEY_SEQUENCE_ID)
        return value

    def _place(self, seq: _Sequence) -> None:
        """Give ``seq`` a slot on the lane with the most free slots, or queue it in the backlog."""
        lane = max(self._lanes, key=lambda ln: len(ln.free))
        if not lane.free:
            self._backlog.append(seq)
            return
        self._assign(seq, lane)

    def _assign(self, seq: _Sequence, lane: _Lane) -> None:
        seq.lane = lane
        seq.slot = lane.free.pop()
        seq.fresh = True
        lane.nseq += 1

    def _release(self, seq: _Sequence, why: str) -> None:
        """Free ``seq``'s slot (its state is reset when the slot's next sequence starts)."""
        del self._seqs[seq.sid]
        self._gone[seq.sid] = why
        if len(self._gone) > MAX_REMEMBERED_IDS:
            self._gone.popitem(last=False)
        lane = seq.lane
        if lane is None:
            self._backlog.remove(seq)
            return
        lane.ready.pop(seq, None)
        lane.free.append(seq.slot)
        lane.nseq -= 1
        seq.lane = None
        while self._backlog and lane.free:
            nxt = self._backlog.popleft()
            self._assign(nxt, lane)
            if nxt.queue:
                nxt.ready_ns = time.monotonic_ns()
                lane.ready[nxt] = None

    def _sweep_idle(self) -> None:
        self._sweep = None
        now = time.monotonic_ns()
        limit = self._idle_ns
        touched = set()
        for seq in list(self._seqs.values()):
            if not seq.running and not seq.queue and now - seq.last_ns > limit:
                if seq.lane is not None:
                    touched.add(seq.lane)
                self._release(seq, IDLED)
        for lane in touched:
            if not lane.busy:
                self._dispatch(lane)
        if self._seqs:  # also while draining: backlogged sequences may need the slots
            self._sweep = self._loop.call_later(self._sweep_s, self._sweep_idle)

    # -- queue policy ---------------------------------------------------------------------
    def _kill(self, entry: SeqEntry) -> None:
        entry.state = DONE
        self._pending -= 1
        seq = entry.seq
        q = seq.queue
        if entry.end or entry.start:
            for e in reversed(q):
                if e is entry:  # it never ran and nothing live follows: undo its effect on
                    seq.open = entry.was_open  # ``open`` (a cancelled end re-opens, a
                    break                      # cancelled restart after an end re-closes)
                if e.state == QUEUED:
                    break
        while q and q[0].state != QUEUED:
            q.popleft()
        lane = seq.lane
        if not q and lane is not None:
            lane.ready.pop(seq, None)
        if not q and not seq.open and not seq.running:
            self._release(seq, ENDED)  # its end already ran: free the slot now
            if lane is not None and not lane.busy:
                self._dispatch(lane)
        self._maybe_idle()

    def _expire(self, entry: SeqEntry, timeout_ms: int) -> None:
        entry.timer = None
        if entry.state == DONE or entry.future.done():
            return
        where = "in the queue" if entry.state == QUEUED else "while its batch was running"
        if entry.state == QUEUED:
            self._kill(entry)
        entry.future.set_exception(DeadlineExceeded(
            f"deadline of {timeout_ms} ms expired {where}", "lumen.timeout_ms"))

    # -- batch formation ------------------------------------------------------------------
    def _dispatch(self, lane: _Lane) -> None:
        """Form and start one batch on ``lane`` if it is free and a batch is due."""
        if lane.busy or not lane.ready:
            return
        ready = lane.ready
        n = len(ready)
        if self._delay_ns and n < self.max_batch and n < self._min_util * min(lane.nseq,
                                                                                self.max_batch):
            due = max(next(iter(ready)).ready_ns, lane.free_ns) + self._delay_ns
            if due > time.monotonic_ns():
                self._arm_timer(lane, due)
                return
        if n <= self.max_batch and not self._multi_sig:
            seqs = list(ready)
            ready.clear()
        else:
            seqs = self._pick(ready)
        self._start(lane, seqs)

    def _pick(self, ready: dict) -> list:
        """Up to ``max_batch_size`` ready sequences of one signature, oldest request first."""
        cands = sorted(ready, key=lambda s: s.queue[0].arrival_ns)
        if self._multi_sig:
            sig = cands[0].queue[0].item.signature
            cands = [s for s in cands if s.queue[0].item.signature == sig]
        seqs = cands[:self.max_batch]
        for s in seqs:
            del ready[s]
        return seqs

    def _arm_timer(self, lane: _Lane, at_ns: int) -> None:
        loop = self._loop
        when = loop.time() + max(0, at_ns - time.monotonic_ns()) / 1e9
        if lane.timer is not None:
            if lane.timer_at <= when:
                return
            lane.timer.cancel()
        lane.timer_at = when
        lane.timer = loop.call_at(when, self._on_timer, lane)

    def _on_timer(self, lane: _Lane) -> None:
        lane.timer = None
        self._dispatch(lane)

    def _start(self, lane: _Lane, seqs: list) -> None:
        n = len(seqs)
        now = time.monotonic_ns()
        entries = []
        slots = np.empty(n, dtype=np.intp)
        start = np.empty(n, dtype=bool)
        end = np.empty(n, dtype=bool)
        corrid = [] if self._corrid else None
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
        self._pending -= n
        self._running += 1
        lane.busy = True
        batch = SequenceBatch([e.item for e in entries], slots, start, end, corrid, lane.store)
        fut = self._loop.run_in_executor(lane.engine.executor, self._run, lane.engine, batch)
        fut.add_done_callback(partial(self._finish, lane, seqs, entries, start))

    # -- worker thread --------------------------------------------------------------------
    def _execute(self, engine: Any, batch: SequenceBatch) -> list:
        """Run one (sub-)batch, then commit its state; a failure commits nothing."""
        outputs = engine.run(batch)
        results = engine.postprocess(outputs, batch)
        for plan in self._stateful:
            plan.commit(batch, outputs)
        return results

    def _run(self, engine: Any, batch: SequenceBatch) -> tuple:
        t0 = time.perf_counter_ns()
        results = run_split(partial(self._execute, engine), batch)
        return results, (time.perf_counter_ns() - t0) // 1000

    # -- completion (event loop) ----------------------------------------------------------
    def _finish(self, lane: _Lane, seqs: list, entries: list, starts: np.ndarray,
                fut: asyncio.Future) -> None:
        self._running -= 1
        lane.busy = False
        lane.free_ns = time.monotonic_ns()
        n = len(entries)
        results, compute_us = self._outcome(fut, n)
        now = lane.free_ns
        ready = lane.ready
        for s, e, res, started in zip(seqs, entries, results, starts, strict=True):
            s.running = False
            s.last_ns = now
            if started and isinstance(res, LumenError):
                # a failed run committed no state: the slot may still hold the previous
                # sequence's (or the pre-restart) state, so the next request starts afresh
                s.fresh = True
            self._resolve(e, res, n, compute_us)
            if s.queue:
                s.ready_ns = now
                ready[s] = None
            elif e.end and not s.open:
                self._release(s, ENDED)
        self._dispatch(lane)
        self._maybe_idle()
