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

Threads: as in the dynamic batcher, each lane's worker forms its own next batch as soon as it
finishes one (under the batcher's lock, shared with the policy in ``policy.py``), and finished
batches reach the event loop through one wake-up per batch.  Slots, the backlog and sequence
flags are only touched under that lock; a lane's state store only by its worker.  The records
of sequences and lanes, and the sequence-id rules (CORRID value, unknown-id errors), are in
``lanes.py``.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from typing import Any, Callable, Optional, Sequence, cast

from ..config import BatchingConfig, SequenceConfig
from ..contract import KEY_SEQUENCE_ID, KEY_SEQUENCE_START
from ..engine.state import corrid_kind
from ..errors import InvalidArgument, LumenError, Overloaded
from .lanes import (
    ENDED,
    IDLED,
    Lane,
    LaneFormation,
    LiveSequence,
    SequenceEntry,
    corrid_value,
    unknown_sequence,
)
from .policy import (
    AWAITING_SLOT,
    OVERLOAD_RETRY_AFTER_S,
    QUEUE_FULL,
    QUEUED,
    ROOM,
    Entry,
    Group,
    QueuePolicy,
)
from .runner import Batch, BatchRunner, Worker

#: how many ended / idled-out ids are remembered for a precise error message
MAX_REMEMBERED_IDS = 4096
#: the idle sweep runs this many times per ``max_sequence_idle_us`` (detection within +25%)
IDLE_SWEEPS_PER_TIMEOUT = 4
#: but not more often than this (ns)
MIN_SWEEP_INTERVAL_NS = 1_000_000


class SequenceBatcher(QueuePolicy):
    """Per-task sequence batcher over the task's runners, one lane each (module docstring).

    Public surface as :class:`~lumen_core.batching.dynamic.DynamicBatcher`: ``submit``,
    ``submit_many``, ``infer``, ``cancel``, ``drain``, ``close``, ``pending``, ``in_flight``;
    plus ``active_sequences`` and ``backlog``.  ``runners`` expose ``spec`` (the model's input
    plans: state, controls) and ``execute(SequenceBatch)``.
    """

    def __init__(self, name: str, batching: BatchingConfig, sequence: Optional[SequenceConfig],
                 runners: Sequence[BatchRunner], on_batch: Optional[Callable[[int, int], None]] = None):
        # a latency target refuses only the start of a new sequence (check_latency): a
        # sequence once started is never refused mid-stream for latency
        super().__init__(name, batching.max_queue_size, on_batch,
                         target_ns=batching.latency_target_ms * 1_000_000)
        self.queue.unqueued = self._unqueued  # its queued requests wait in their sequences
        seq = sequence or SequenceConfig()
        self.seq_config = seq
        self.strategy = seq.strategy
        self.max_batch = batching.max_batch_size
        self.max_queue = batching.max_queue_size
        if seq.strategy == "oldest":
            self.capacity = max(seq.max_candidate_sequences or self.max_batch, self.max_batch)
        else:
            self.capacity = self.max_batch
        self.batch_cap = 1  # a batch's most sequences, for the predictions (size_batches)
        spec = runners[0].spec
        self._corrid = corrid_kind(spec.inputs)
        self._corrid_dtype = next((p.dtype for p in spec.inputs
                                   if getattr(p, "kind", None) == "CORRID"), None)
        self._lanes = [Lane(i, self.capacity, spec.inputs)
                       for i in range(len(runners))]
        self._seqs: dict[Any, Any] = {}
        self._backlog: deque[Any] = deque()
        self._gone: OrderedDict[Any, Any] = OrderedDict()  # sid -> ENDED | IDLED
        self._sweep: Optional[asyncio.TimerHandle] = None
        self._idle_ns = seq.max_sequence_idle_us * 1000
        self._sweep_s = max(self._idle_ns // IDLE_SWEEPS_PER_TIMEOUT, MIN_SWEEP_INTERVAL_NS) / 1e9
        #: which ready sequences of a lane run together (lanes.LaneFormation)
        self.formation = LaneFormation(self.queue, self.max_batch, seq.max_queue_delay_us * 1000,
                                       seq.minimum_slot_utilization, bool(self._corrid))
        self._init_workers(name, runners)

    # -- lifecycle (QueuePolicy: start, close) ----------------------------------------------
    def wake_workers(self) -> None:
        for lane in self._lanes:
            lane.wake()

    def size_batches(self) -> None:
        self.batch_cap = max(1, self.max_batch)
        self.guard.sized(self.batch_cap)

    def cap(self) -> int:
        return self.batch_cap

    def queued(self) -> list[Entry]:
        return [e for s in list(self._seqs.values()) for e in s.queue if e.state == QUEUED]

    def stop_timers(self) -> None:
        super().stop_timers()
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None

    # -- public ---------------------------------------------------------------------------
    @property
    def active_sequences(self) -> int:
        """Sequences holding a slot."""
        return len(self._seqs) - len(self._backlog)

    @property
    def backlog(self) -> int:
        """Sequences waiting for a free slot."""
        return len(self._backlog)

    def counters(self) -> dict[str, Any]:
        """Sequences holding a slot and those waiting for one (``TaskBatcher.counters``)."""
        return {"active_sequences": self.active_sequences, "backlog": self.backlog}

    def room(self, sequence_id: Optional[str] = None) -> int:
        """See ``QueuePolicy.room``, with ``_enqueue``'s rule (a sequence holding a slot may
        always queue one request); ``AWAITING_SLOT`` while ``sequence_id`` waits in the
        backlog for a slot: its stream reads nothing more until it has one (issue 38 row 4:
        streams beyond the slots filled the queue with chunks that could not run)."""
        seq = self._seqs.get(sequence_id) if sequence_id else None
        if self.queue.pending >= self.max_queue and (seq is None or seq.lane is None or seq.queue):
            return QUEUE_FULL  # what _enqueue would refuse now
        return AWAITING_SLOT if seq is not None and seq.lane is None else ROOM

    def holds_sequence(self, sid: str) -> bool:
        """True while sequence ``sid`` is open here (a draining version keeps its sequences
        until they end or idle out: lumen_core/versions.py)."""
        return sid in self._seqs

    def submit(self, item: Any, desc: Any = None, priority: int = 1, timeout_ms: int = 0) -> Entry:
        """Admit one request of a sequence; raise at once when it cannot be accepted."""
        if not self.queue.started:
            self.start()
        loop = self.bound_loop
        now = time.monotonic_ns()
        with self.queue.lock:
            entry = self._enqueue(item, desc, loop.create_future(), now, timeout_ms)
            if timeout_ms > 0:  # formation refuses it once this passes, even if its timer is late
                entry.deadline_ns = now + timeout_ms * 1_000_000
            new_seq = self._sweep is None and self._seqs
        if new_seq:
            self._sweep = loop.call_later(self._sweep_s, self._sweep_idle)
        if timeout_ms > 0:
            self.queue.arm(entry)
        return entry

    def submit_many(self, specs: Sequence[tuple[Any, Any, int, int]]
                    ) -> tuple[Any, list[Entry]]:
        """Admit ``[(item, desc, priority, timeout_ms), ...]`` in order, as one group: the
        first request that cannot be accepted raises and un-admits the ones before it."""
        if not self.queue.started:
            self.start()
        loop = self.bound_loop
        group = Group(loop.create_future(), len(specs))
        entries: list[Entry] = []
        if not specs:
            group.future.set_result(None)
            return group, entries
        now = time.monotonic_ns()
        with self.queue.lock:
            if len(specs) > self.max_queue:
                self.queue.admit(len(specs))  # raises: the group can never fit
            created: list[Any] = []  # (sequence, its _gone entry) of sequences this group started
            try:
                for item, desc, _priority, timeout_ms in specs:
                    known = desc.sequence_id in self._seqs
                    gone = self._gone.get(desc.sequence_id)
                    e = self._enqueue(item, desc, group, now, timeout_ms)
                    if timeout_ms > 0:
                        e.deadline_ns = now + timeout_ms * 1_000_000
                    entries.append(e)
                    if not known:
                        created.append((e.seq, gone))
            except BaseException:
                for dead in reversed(entries):
                    self.queue.kill(dead)
                for seq, gone in created:  # a refused group leaves no sequence behind
                    if seq.sid in self._seqs and not seq.queue and not seq.running:
                        self._release(seq, ENDED)
                    if gone is None:
                        self._gone.pop(seq.sid, None)
                    else:
                        self._gone[seq.sid] = gone
                raise
            new_seq = self._sweep is None and self._seqs
        if new_seq:
            self._sweep = loop.call_later(self._sweep_s, self._sweep_idle)
        for armed in entries:
            if armed.deadline_ns:
                self.queue.arm(armed)
        return group, entries

    def _enqueue(self, item: Any, desc: Any, waiter: Any, now: int,
                 timeout_ms: int = 0) -> SequenceEntry:
        """Under the lock: admission, sequence lookup / start, queueing, lane wake-up."""
        if self.queue.closed:
            self.queue.admit(1)  # raises Unavailable
        sid = desc.sequence_id
        if sid is None:
            raise InvalidArgument(f"task {self.name!r} is stateful: every request needs "
                                  f"{KEY_SEQUENCE_ID} (and {KEY_SEQUENCE_START}=true on the first)",
                                  KEY_SEQUENCE_ID)
        seq = self._seqs.get(sid)
        if self.queue.pending >= self.max_queue and (seq is None or seq.lane is None or seq.queue):
            # A sequence that holds a slot may always queue one request, so a full backlog
            # can never block the requests (e.g. an end) that would free a slot for it.
            raise Overloaded(f"task {self.name!r} queue is full ({self.max_queue} pending, "
                             f"{len(self._backlog)} sequences waiting for a slot); retry later",
                             None, OVERLOAD_RETRY_AFTER_S)
        start = desc.sequence_start
        if seq is None:
            if not start:
                raise unknown_sequence(sid, self._gone.get(sid),
                                       self.seq_config.max_sequence_idle_us)
            if self.guard.target_ns and self.guard.cost_ready:  # only a new sequence may be refused
                self.queue.check_latency(1, timeout_ms * 1_000_000)
            seq = LiveSequence(sid, corrid_value(self.name, sid, self._corrid, self._corrid_dtype),
                               now)
            self._seqs[sid] = seq
            self._gone.pop(sid, None)
            self._place(seq)
        elif not start and not seq.open:
            raise InvalidArgument(f"sequence {sid!r} has ended (its end request was accepted); "
                                  f"begin a new one with {KEY_SEQUENCE_START}=true",
                                  KEY_SEQUENCE_START)
        was_open = seq.open
        seq.open = not desc.sequence_end
        self.formation.seen(item.signature)
        entry = SequenceEntry(item, waiter, now, seq, start, desc.sequence_end, was_open)
        seq.queue.append(entry)
        seq.last_ns = now
        self.queue.pending += 1
        lane = seq.lane
        if lane is not None and not seq.running and len(seq.queue) == 1:
            seq.ready_ns = now
            lane.ready[seq] = None
            lane.wake()
        return entry

    async def drain(self) -> None:
        """Stop admitting, wait for every queued (backlog included) and running request, then
        stop the idle sweep."""
        await super().drain()
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None

    # -- sequences ------------------------------------------------------------------------
    def _place(self, seq: LiveSequence) -> None:
        """Give ``seq`` a slot on the lane with the most free slots, or queue it in the backlog."""
        lane = max(self._lanes, key=lambda ln: len(ln.free))
        if not lane.free:
            self._backlog.append(seq)
            return
        self._assign(seq, lane)

    def _assign(self, seq: LiveSequence, lane: Lane) -> None:
        seq.lane = lane
        seq.slot = lane.free.pop()
        seq.fresh = True
        lane.nseq += 1

    def _release(self, seq: LiveSequence, why: str) -> None:
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
                lane.wake()

    def _sweep_idle(self) -> None:
        """Loop timer: release sequences idle past ``max_sequence_idle_us``."""
        self._sweep = None
        now = time.monotonic_ns()
        limit = self._idle_ns
        with self.queue.lock:
            for seq in list(self._seqs.values()):
                if not seq.running and not seq.queue and now - seq.last_ns > limit:
                    self._release(seq, IDLED)
            again = bool(self._seqs)  # also while draining: backlogged ones may need slots
        if again:
            self._sweep = self.bound_loop.call_later(self._sweep_s, self._sweep_idle)

    # -- queue policy (under the lock) ------------------------------------------------------
    def _unqueued(self, entry: SequenceEntry) -> None:
        """The admission queue's hook (``AdmissionQueue.unqueued``): ``entry`` died queued."""
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
        if not q and not seq.open and not seq.running and seq.sid in self._seqs:
            self._release(seq, ENDED)  # its end already ran: free the slot now

    # -- batch formation (worker threads) ---------------------------------------------------
    def next_batch(self, worker: Worker) -> Optional[Batch]:
        with self.queue.lock:
            return self._next_locked(worker, self._lanes[worker.index])

    def finished(self, worker: Worker, batch: Batch, results: Any,
                 compute_us: int) -> Optional[Batch]:
        lane = self._lanes[worker.index]
        with self.queue.lock:
            if not isinstance(results, BaseException):  # a failed worker's time means nothing
                self.learn(len(batch.entries), 0, compute_us)
            self.completions.put(batch.entries, results, compute_us)  # after learning
            self._settle(lane, batch, results)
            return self._next_locked(worker, lane)

    def _settle(self, lane: Lane, batch: Batch, results: Any) -> None:
        """After a run: sequences become ready again or end; the lane is free."""
        lane.busy = False
        now = lane.free_ns = time.monotonic_ns()
        ready = lane.ready
        failed = isinstance(results, BaseException)  # the worker itself failed
        per_item = isinstance(results, list)  # else the batch's rows: every item succeeded
        seqs, starts = batch.extra
        for i, (s, e) in enumerate(zip(seqs, batch.entries, strict=True)):
            s.running = False
            s.last_ns = now
            if starts[i] and (failed or (per_item and isinstance(results[i], LumenError))):
                # a failed run committed no state: the slot may still hold the previous
                # sequence's (or the pre-restart) state, so the next request starts afresh
                s.fresh = True
            if s.queue:
                s.ready_ns = now
                ready[s] = None
            elif cast(SequenceEntry, e).end and not s.open and s.sid in self._seqs:
                self._release(s, ENDED)

    def _next_locked(self, worker: Worker, lane: Lane) -> Optional[Batch]:
        while True:
            timeout = -1.0
            if lane.ready:
                now = time.monotonic_ns()
                batch, due = self.formation.form(lane, now)
                if batch is not None:
                    return batch
                if due:
                    timeout = max(0, due - now) / 1e9
            if self.queue.stopping:
                return None
            worker.flush()  # results waiting for the loop must not wait for our next batch
            self.queue.wait_for_work(worker.wake, timeout, lane.idle)
