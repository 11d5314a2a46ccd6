# cython: annotation_typing=False
"""The request path's latency guard: a batcher's learnt cost and what it decides with it.

One source, two builds, as ``scheduler.py``: Cython compiles this file with the declarations
of ``lumen_core/request_path/_latency.pxd`` into ``lumen_core.request_path._latency`` (a ``cdef class`` with C fields,
its checks C calls); run as plain Python it is the pure-Python twin.

:class:`LatencyGuard` is one part of a batcher (``batching/policy.py`` composes it with the
admission queue, ``scheduler.AdmissionQueue``, which asks it before queueing): the cost model
(``batching/cost.CostModel``, learnt once per finished batch), the latency target (issue 30)
and the budget admission plans for.  Three jobs: *predict* when the ``k``-th request in line
would be answered (:meth:`~LatencyGuard.predicted_ns`), *check* a request against the budget
or its deadline at admission (:meth:`~LatencyGuard.check`: ``Overloaded`` before anything is
queued), and *steer* the budget from the waits of finished batches
(:meth:`~LatencyGuard.steer`).  It keeps no queue: the queue hands it its load figures
(pending, running, queued token counts) with each question.
"""
from __future__ import annotations

import time
from typing import Any

from ..errors import Overloaded

__all__ = ["LatencyGuard"]

_monotonic_ns = time.monotonic_ns

#: after the last batch finished, an idle batcher (nothing queued, nothing running) admits one
#: request whatever the prediction says, as a probe: the learnt cost and the budget move only
#: when a batch finishes, so a cost learnt under contention (another process on the cores)
#: would otherwise refuse an idle server forever (issue 38 row 2)
PROBE_IDLE_NS = 500_000_000
#: while nothing runs, a budget shrunk by late answers (``budget_ns`` < ``target_ns``) grows
#: back toward the target, halving the gap every this many ns (no batch finishes to steer it)
BUDGET_HALF_LIFE_NS = 100_000_000
#: a probe whose batch ran in under ``1 / PROBE_STALE`` of its predicted time shows a stale
#: cost model: it starts over (:meth:`LatencyGuard.forget`)
PROBE_STALE = 2
#: weight of the newest batch in the running mean of formed batch sizes (``batch_seen``)
BATCH_SEEN_EMA = 0.05
# Latency-target steering (:meth:`LatencyGuard.steer`): once per finished batch, the wait of
# its oldest request (admission to answer) is held against the target.  Past ``STEER_HIGH`` of
# it (what the server itself may spend: the rest is the transport's, before admission and
# after the answer) the budget admission and formation plan for shrinks by ``STEER_DOWN``;
# under ``STEER_LOW`` of it the budget grows back by ``STEER_UP``, never past the target nor
# under ``STEER_MIN`` of it.  Shrinking fast and growing slowly is the usual AIMD-like shape: a
# burst of late answers is corrected within a few batches, a quiet spell is not trusted at once.
STEER_HIGH = 0.75
STEER_LOW = 0.55
STEER_DOWN = 0.95
STEER_UP = 1.01
STEER_MIN = 0.25


class LatencyGuard:
    """One batcher's cost model and latency target (module docstring).

    ``target_ns`` is the latency target (0: none, nothing is refused for latency);
    ``budget_ns`` what admission plans for: the target, less the headroom :meth:`steer` takes
    while answers run late (0: the whole target).  The ``cost_*`` fields are the learnt cost
    (:meth:`learn`, once per finished batch), as C fields for the checks: a batch of n costs
    ``cost_fixed_ns + n * cost_item_ns`` (an item of the typical ``cost_tokens_per_item``
    token slots; each slot more or less costs ``cost_token_ns``), batches run ``cost_batch``
    at a time on ``cost_workers`` engine instances.  ``learnt_ns``: when the last batch was
    learnt (the probe's idle time counts from it); ``budget_at_ns``: when ``budget_ns`` was
    last set (its recovery counts from it); ``probing``: a probe was admitted.
    """

    __slots__ = ("name", "cost", "target_ns", "budget_ns", "learnt_ns", "budget_at_ns",
                 "cost_ready", "probing", "cost_fixed_ns", "cost_item_ns", "cost_token_ns",
                 "cost_tokens_per_item", "batch_seen", "cost_batch", "cost_workers")

    def __init__(self, name: str, cost: Any, target_ns: int = 0, workers: int = 1):
        self.name = name
        self.cost = cost  # batching.cost.CostModel: the fit behind the cost_* figures
        self.target_ns = target_ns
        self.budget_ns = 0
        self.learnt_ns = 0
        self.budget_at_ns = 0
        self.cost_ready = False
        self.probing = False
        self.cost_fixed_ns = 0.0
        self.cost_item_ns = 0.0
        self.cost_token_ns = 0.0
        self.cost_tokens_per_item = 0.0
        #: the size batches turn out (running mean: length-aware formation forms smaller ones
        #: when few queued texts are of a length); predictions count batches of it
        self.batch_seen = 0.0
        self.cost_batch = 1
        self.cost_workers = workers

    # -- predict (under the queue's lock) ----------------------------------------------------
    def predicted_ns(self, k: int, length: int, running: int, running_items: int) -> int:
        """ns until the ``k``-th request in line (counting every pending one) would be
        answered, at the learnt cost: the whole batches ahead of its own, run ``cost_workers``
        at a time, then its own (partial) batch, after what is left of the batches running now
        (half of each, on average: ``running`` batches of ``running_items`` requests in all).
        ``length`` (> 0: the request's own token count) prices its own batch at that length
        instead of the typical one (the cost per token slot, learnt): length-aware formation
        batches it with texts of about its length, so a long text's batch costs what long
        texts cost (``cost_batch`` follows the batches formed, a few texts each when lengths
        are mixed)."""
        b = self.cost_batch
        fixed = self.cost_fixed_ns
        item = self.cost_item_ns
        batch_ns = fixed + b * item
        ahead = (k - 1) // b  # whole batches before the one it runs in
        w = self.cost_workers
        own = item
        if length > 0 and self.cost_token_ns > 0.0:
            own = item + self.cost_token_ns * (length - self.cost_tokens_per_item)
            if own < 0.0:
                own = 0.0
        wait = ahead * batch_ns / w + fixed + (k - ahead * b) * own
        if running:
            wait += (running * fixed + running_items * item) / (2 * w)
        return int(wait)

    def budget_now(self, now: int, running: int) -> int:
        """The budget admission plans for at ``now``: ``budget_ns`` (0: the target), grown
        back toward the target while nothing runs (``running`` batches in flight: 0) at
        ``BUDGET_HALF_LIFE_NS``: with nothing running no batch finishes to steer it, and a
        budget shrunk under contention would otherwise stay low on an idle server (issue 38
        row 2)."""
        target = self.target_ns
        b = self.budget_ns
        if not b or b >= target:
            return target
        if running or now <= self.budget_at_ns:
            return b
        gap = (target - b) * 0.5 ** ((now - self.budget_at_ns) / BUDGET_HALF_LIFE_NS)
        return target - int(gap)

    def excess_ns(self, tokens: int, n: int) -> int:
        """What ``n`` requests of ``tokens`` tokens in all cost beyond ``n`` typical ones (the
        learnt cost per token slot, ``cost_tokens_per_item`` a request); never below 0 (a
        queue of short texts is priced as typical ones)."""
        if tokens <= 0 or self.cost_token_ns <= 0.0:
            return 0
        extra = self.cost_token_ns * (tokens - n * self.cost_tokens_per_item)
        return int(extra / self.cost_workers) if extra > 0.0 else 0

    # -- check (under the queue's lock) ------------------------------------------------------
    def check(self, n: int, timeout_ns: int, priority: int, length: int, tokens: int,
              pending: int, running: int, running_items: int, queued_tokens: int,
              levels: int, queue: Any) -> None:
        """Raise ``Overloaded`` (429, Retry-After the predicted drain time) when ``n`` more
        requests of ``priority`` (of ``length`` tokens each, when known: see
        :meth:`predicted_ns`; or of ``tokens`` tokens in all, a group's own lengths) would be
        answered past the target's budget or past ``timeout_ns`` (their deadline, 0: none).
        The queue's load comes with the question: ``pending`` requests queued (of
        ``queued_tokens`` tokens), ``running`` batches of ``running_items``, ``levels``
        priority levels, and ``queue`` itself for the rare count of the requests of a higher
        level (``queue.queued_up_to``).  Admitted requests are never dropped for them: the
        refusal happens before anything is queued.

        An idle batcher whose last batch finished ``PROBE_IDLE_NS`` ago admits one request
        (no deadline tighter than the target) whatever the prediction: a probe, whose batch
        teaches the cost model what the idle server costs now."""
        now = _monotonic_ns()
        limit = self.budget_now(now, running)
        if limit != self.budget_ns and self.budget_ns:  # fold the recovery in (it compounds)
            self.budget_ns = limit
            self.budget_at_ns = now
        what = "latency target"
        if 0 < timeout_ns < limit:
            limit = timeout_ns
            what = "deadline"
        elif (n == 1 and not pending and not running
              and now - self.learnt_ns >= PROBE_IDLE_NS):
            self.probing = True
            return  # the probe
        ahead = pending
        queued_extra = self.excess_ns(queued_tokens, ahead)  # long texts queued ahead
        own_extra = self.excess_ns(tokens, n)  # a group's own long texts
        wait = self.predicted_ns(ahead + n, length, running, running_items) + queued_extra \
            + own_extra
        if wait <= limit:
            return
        if priority < levels:  # only requests of its level or above run before it
            ahead = queue.queued_up_to(priority)
            queued_extra = 0
            wait = self.predicted_ns(ahead + n, length, running, running_items) + own_extra
            if wait <= limit:
                return
        drain = (self.predicted_ns(ahead, 0, running, running_items) + queued_extra
                 if ahead else wait)
        retry = max(1, (drain + 999_999_999) // 1_000_000_000)  # whole seconds, rounded up
        if what == "deadline":
            what = f"deadline of {limit // 1_000_000} ms"
        elif limit < self.target_ns:  # the budget: answers have been running late
            what = (f"latency target of {self.target_ns // 1_000_000} ms (admitting to "
                    f"{limit // 1_000_000} ms while answers run late)")
        else:
            what = f"latency target of {limit // 1_000_000} ms"
        raise Overloaded(f"task {self.name!r} cannot answer within its {what}: "
                         f"{ahead} requests queued ahead drain "
                         f"in about {(drain + 500_000) // 1_000_000} ms at the learnt rate, so "
                         f"this one would finish in about {(wait + 500_000) // 1_000_000} ms; "
                         f"refused at once (nothing was queued), retry in {retry} s", None, retry)

    # -- learn and steer (under the queue's lock, once per finished batch) --------------------
    def learn(self, n: int, tokens: int, compute_us: float, rows: float = 0.0) -> bool:
        """Learn a finished batch's compute time, then set the figures :meth:`check` reads
        (C fields).  ``rows`` (> 0): what the batch counts as in typical rows (a batch of
        items larger than the typical one: ``loop.LoopExecution``); else its ``n``.  True
        when the model is ready (the owner sizes its batches from it)."""
        m = self.cost
        x = rows or n
        if self.probing:  # the first batch after an idle batcher admitted a probe
            self.probing = False
            if m.ready and compute_us * PROBE_STALE < m.predict_us(x, tokens):
                m = self.forget()
        m.update(x, tokens, compute_us)
        self.learnt_ns = _monotonic_ns()  # an idle batcher probes from here (check)
        ready: bool = m.ready
        if ready:
            fixed_us, item_us = m.linear()
            self.cost_fixed_ns = fixed_us * 1000.0
            self.cost_item_ns = item_us * 1000.0
            self.cost_token_ns = max(0.0, m.theta[2]) * 1000.0
            self.cost_tokens_per_item = m.tokens_per_item
            self.cost_ready = True
        self.batch_seen = n if not self.batch_seen else (
            self.batch_seen + BATCH_SEEN_EMA * (n - self.batch_seen))
        return ready

    def forget(self) -> Any:
        """A probe ran in under ``1 / PROBE_STALE`` of its predicted time, so the learnt cost
        is stale (learnt while other processes held the cores): start over, with the whole
        target as the budget; nothing is refused until the new model is ready
        (``COST_MIN_SAMPLES`` batches), as at start-up."""
        m = self.cost = self.cost.fresh()
        self.cost_ready = False
        self.budget_ns = 0
        return m

    def sized(self, cap: int) -> None:
        """Formation forms batches of at most ``cap``: predictions count batches of the size
        they turn out (``batch_seen``), within it."""
        self.cost_batch = max(1, min(cap, int(self.batch_seen + 0.5)))

    def steer(self, waited_ns: int) -> bool:
        """With a latency target: a finished batch's oldest request waited ``waited_ns`` from
        admission to its answer.  Shrink the budget (``budget_ns``: what admission refuses
        against, and the batch size that fits it) when that runs past ``STEER_HIGH`` of the
        target; grow it back slowly under ``STEER_LOW``.  True when the budget moved and the
        cost is learnt (the owner sizes its batches again)."""
        target = self.target_ns
        if not target:
            return False
        was = h = self.headroom
        if waited_ns > STEER_HIGH * target:
            h = max(STEER_MIN, h * STEER_DOWN)
        elif waited_ns < STEER_LOW * target:
            h = min(1.0, h * STEER_UP)
        else:
            return False
        if h == was:
            return False
        self.budget_ns = int(target * h)
        self.budget_at_ns = _monotonic_ns()  # it grows back from here while idle
        ready: bool = self.cost_ready
        return ready

    @property
    def headroom(self) -> float:
        """The share of the latency target admission and formation plan for (:meth:`steer`):
        ``budget_ns`` over ``target_ns`` (1.0 without a target, or before the budget moved)."""
        if not self.target_ns or not self.budget_ns:
            return 1.0
        return float(self.budget_ns) / float(self.target_ns)  # (C integers: true division)

    def figures(self, batch_cap: int, running: int) -> dict[str, Any]:
        """The model's snapshot, the batch size predictions assume, formation's cap
        (``batch_cap``, the owner's), the engine instances, the latency target (ms; 0: none)
        and the budget now (``running`` batches in flight)."""
        out: dict[str, Any] = self.cost.snapshot()
        out["batch_size"] = self.cost_batch
        out["batch_cap"] = batch_cap
        out["workers"] = self.cost_workers
        out["latency_target_ms"] = self.target_ns // 1_000_000
        out["latency_budget_ms"] = self.budget_now(_monotonic_ns(), running) / 1e6
        return out

