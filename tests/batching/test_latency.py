"""Latency targets (issue 30): the learnt cost model, target-sized formation and early refusal.

Deterministic: the cost model is fed known cost curves directly (``CostModel.update`` /
``QueuePolicy.learn``), and the refusal arithmetic reads only the admission's state (pending,
running, the learnt figures): the clock cancels out of "predicted completion past the target",
so a gated fake worker (one batch provably running) makes every refusal exact.
"""
from __future__ import annotations

import asyncio
import random
import re
import threading

import numpy as np
import pytest
from test_batching import FakeWorker, Item, cfg, wait_started
from test_sequence import _register, accumulator_model, config, req  # noqa: F401 - _register: autouse

import lumen_core as lc
from lumen_core.batching.cost import COST_MIN_SAMPLES, CostModel
from lumen_core.batching.dynamic import DynamicBatcher
from lumen_core.config import ConfigError, parse_config
from lumen_core.errors import DeadlineExceeded, Overloaded


def curve(n, tokens):
    """A known cost curve (us): 2 ms a batch, 300 us an item, 5 us a padded token slot."""
    return 2000.0 + 300.0 * n + 5.0 * tokens


# ----------------------------------------------------------------------------- the cost model
def test_cost_model_converges_on_a_known_curve():
    rng = random.Random(7)
    m = CostModel()
    for _ in range(60):
        n = rng.randint(1, 32)
        tokens = n * rng.randint(5, 200)
        m.update(n, tokens, curve(n, tokens) * (1 + rng.uniform(-0.01, 0.01)))
    a, b, c = m.theta
    assert a == pytest.approx(2000, rel=0.1)
    assert b == pytest.approx(300, rel=0.1)
    assert c == pytest.approx(5, rel=0.03)
    for n, tokens in ((1, 10), (16, 16 * 40), (32, 32 * 200)):
        assert m.predict_us(n, tokens) == pytest.approx(curve(n, tokens), rel=0.02)
    assert m.ready


def test_cost_model_follows_a_drifting_curve_and_never_winds_up_on_one_size():
    m = CostModel()
    for _ in range(200):  # every batch the same size: the fit is exact where batches are
        m.update(32, 0, 10_000.0)
    assert m.predict_us(32) == pytest.approx(10_000, rel=1e-3)
    assert m.theta[2] == 0.0  # no tokens seen: no token term
    for i in range(800):  # the engine slows down 2x: the model follows (forgetting)
        n = 1 + i % 32
        m.update(n, 0, 2 * (1000.0 + 280.0 * n))
    assert m.predict_us(32) == pytest.approx(2 * (1000 + 280 * 32), rel=0.01)
    assert m.predict_us(1) == pytest.approx(2 * 1280, rel=0.05)
    fixed, item = m.linear()
    assert fixed == pytest.approx(2000, rel=0.05) and item == pytest.approx(560, rel=0.01)


def test_batcher_learns_once_per_batch_and_reports_it():
    async def main():
        w = FakeWorker()
        b = DynamicBatcher("t", cfg(max_batch_size=4), [w])
        await asyncio.gather(*[b.infer(Item(i)) for i in range(10)])
        await b.drain()
        await b.close()
        return b, w

    b, w = asyncio.run(main())
    assert b.guard.cost.samples == len(w.batches)  # one update per finished batch
    assert b.queue.running == b.queue.running_items == 0  # what formation added, delivery took away
    fig = b.cost_figures()
    assert fig["samples"] == len(w.batches) and fig["latency_target_ms"] == 0
    assert fig["batch_size"] == b.guard.cost_batch and fig["workers"] == 1


def learnt(b, n_samples=COST_MIN_SAMPLES, fixed_us=2000.0, item_us=1000.0, full=4):
    """Feed ``b`` a noise-free linear curve (sizes 1..4) as its workers would, then batches
    of ``full`` until the running mean of formed sizes (``batch_seen``) is ``full``."""
    with b.queue.lock:
        for i in range(n_samples * 4):
            n = 1 + i % 4
            b.learn(n, 0, fixed_us + item_us * n)
        for _ in range(200):
            b.learn(full, 0, fixed_us + item_us * full)


def test_learn_hands_admission_the_curve():
    b = DynamicBatcher("t", cfg(max_batch_size=4, latency_target_ms=12), [FakeWorker()])
    with b.queue.lock:
        b.learn(2, 0, 4000)
    assert not b.guard.cost_ready  # too few batches: nothing is refused yet
    learnt(b)
    assert b.guard.cost_ready
    assert b.guard.cost_fixed_ns == pytest.approx(2e6, rel=1e-3)
    assert b.guard.cost_item_ns == pytest.approx(1e6, rel=1e-3)
    assert b.guard.cost_batch == 4 and b.formation.batch_cap == 4 and b.guard.target_ns == 12_000_000
    assert b.cost_figures()["batch_cap"] == 4 and b.cost_figures()["latency_budget_ms"] == 12


def test_predictions_count_the_batches_formation_actually_makes():
    """Length-aware formation may form smaller batches than the cap (few texts of a length
    queued): predictions count batches of the size seen, each paying the fixed cost."""
    b = DynamicBatcher("t", cfg(max_batch_size=4, latency_target_ms=12), [FakeWorker()])
    learnt(b, full=2)
    assert b.formation.batch_cap == 4 and b.guard.cost_batch == 2
    # k = 5 behind batches of 2: two whole batches ahead (2 x 4 ms), then 2 + 1 ms
    assert b.queue.predicted_ns(5) / 1e6 == pytest.approx(11.0, rel=1e-4)


def test_a_long_text_is_priced_at_its_own_length():
    """The cost per token slot is learnt (``a + b n + c tokens``): a request's own batch is
    priced at its length, so a long text behind the same queue predicts a later answer."""
    b = DynamicBatcher("t", cfg(max_batch_size=4, latency_target_ms=1000), [FakeWorker()])
    with b.queue.lock:  # 2 ms a batch, 100 us an item, 10 us a token slot; texts of 20 or 60
        for i in range(400):
            n, length = 1 + i % 4, (20, 60)[i % 2]
            b.learn(n, n * length, 2000 + 100 * n + 10 * n * length)
    assert b.guard.cost_token_ns == pytest.approx(10_000, rel=1e-3)
    typical = b.queue.predicted_ns(1)
    # (a whole token count: within one slot of the typical)
    assert b.queue.predicted_ns(1, round(b.guard.cost_tokens_per_item)) == pytest.approx(typical, abs=1e4)
    # 400 tokens: its own item costs (400 - typical) x 10 us more
    assert b.queue.predicted_ns(1, 400) - typical == pytest.approx(
        (400 - b.guard.cost_tokens_per_item) * 10_000, rel=1e-3)
    assert b.queue.predicted_ns(1, 1) < typical
    # before a request is prepared its length is unknown: the early check prices it at one
    # token, so it refuses only what submit would refuse whatever the length
    b.guard.target_ns = (typical + b.queue.predicted_ns(1, 1)) // 2
    b.refuse_late(1, 0)  # a one-token text could make it: not refused yet
    with pytest.raises(Overloaded):
        with b.queue.lock:
            b.queue.check_latency(1, 0, 1, round(b.guard.cost_tokens_per_item))  # a typical one cannot
    b.guard.target_ns = b.queue.predicted_ns(1, 1) - 1
    with pytest.raises(Overloaded):
        b.refuse_late(1, 0)  # not even one token makes it: refused before preparing


# ----------------------------------------------------------------------------- formation
def test_operating_batch_fits_two_batches_in_the_budget():
    """A request arriving just as a batch starts waits for it, then runs in its own: the
    operating batch is the largest ``n`` with ``2 * (fixed + n * item) <= budget``."""
    b = DynamicBatcher("t", cfg(max_batch_size=32, latency_target_ms=10), [FakeWorker()])
    learnt(b, fixed_us=1500.0)  # a batch of n: 1.5 ms + n ms
    assert b.formation.operating_batch() == 3  # 2 x (1.5 + 3) <= 10 ms
    assert b.formation.batch_cap == 3
    wide = DynamicBatcher("w", cfg(max_batch_size=32, latency_target_ms=40), [FakeWorker()])
    learnt(wide, fixed_us=1500.0)
    assert wide.formation.operating_batch() == 18  # 2 x (1.5 + 18) <= 40 ms
    small = DynamicBatcher("s", cfg(max_batch_size=4, latency_target_ms=40), [FakeWorker()])
    learnt(small, fixed_us=1500.0)
    assert small.formation.operating_batch() == 4  # never above max_batch_size
    plain = DynamicBatcher("p", cfg(max_batch_size=32), [FakeWorker()])
    learnt(plain)
    assert plain.formation.operating_batch() == 32 and plain.guard.target_ns == 0


def test_late_answers_shrink_the_budget_and_on_time_ones_grow_it_back():
    """``steer``: an oldest wait past STEER_HIGH of the target shrinks the budget (and the
    operating batch with it) by STEER_DOWN, down to STEER_MIN; under STEER_LOW it grows back
    by STEER_UP, never past the target; in between nothing moves."""
    from lumen_core.batching import policy as P

    b = DynamicBatcher("t", cfg(max_batch_size=32, latency_target_ms=40), [FakeWorker()])
    learnt(b, fixed_us=1500.0)
    ms = 1_000_000
    assert b.guard.budget_ns == 0 and b.formation.batch_cap == 18
    with b.queue.lock:
        b.steer(int(0.95 * 40 * ms))  # late
    assert b.guard.headroom == pytest.approx(P.STEER_DOWN)
    assert b.guard.budget_ns == int(40 * ms * P.STEER_DOWN) and b.formation.batch_cap == 17  # 2 x 18.5 > 38
    with pytest.raises(Overloaded, match=r"latency target of 40 ms \(admitting to 38 ms"):
        with b.queue.lock:
            b.queue.pending = 100
            try:
                b.queue.check_latency(1, 0)
            finally:
                b.queue.pending = 0
    with b.queue.lock:
        for _ in range(200):
            b.steer(40 * ms)
    assert b.guard.headroom == pytest.approx(P.STEER_MIN)  # never below
    with b.queue.lock:
        b.steer(int((P.STEER_HIGH + P.STEER_LOW) / 2 * 40 * ms))  # in between: unchanged
    assert b.guard.headroom == pytest.approx(P.STEER_MIN)
    with b.queue.lock:
        for _ in range(1000):
            b.steer(0)  # on time
    assert b.guard.headroom == 1.0 and b.guard.budget_ns == 40 * ms and b.formation.batch_cap == 18


def test_a_batcher_without_a_target_never_steers():
    b = DynamicBatcher("p", cfg(max_batch_size=32), [FakeWorker()])
    learnt(b)
    with b.queue.lock:
        b.steer(10**12)
    assert b.guard.headroom == 1.0 and b.guard.budget_ns == 0 and b.formation.batch_cap == 32


def test_target_sized_batches_under_a_queue():
    async def main():
        gate = threading.Event()
        w = FakeWorker(gate)
        # refuse=False (as an ensemble's steps): formation alone, nothing refused
        b = DynamicBatcher("t", cfg(max_batch_size=16, latency_target_ms=60_000), [w],
                           refuse=False)
        # 1 s a batch + 10 s an item: two batches of 2 fit a 60 s target.  No forgetting and
        # many batches, so the fake worker's own (tiny) batch times barely move the fit
        b.guard.cost = CostModel(forgetting=1.0)
        with b.queue.lock:
            for i in range(2000):
                b.learn(1 + i % 4, 0, 1e6 + 1e7 * (1 + i % 4))
        first = asyncio.ensure_future(b.infer(Item(0)))
        await wait_started(w)
        rest = [asyncio.ensure_future(b.infer(Item(i))) for i in range(1, 13)]
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(first, *rest)
        await b.close()
        return w

    w = asyncio.run(main())
    assert [len(x) for x in w.batches] == [1, 2, 2, 2, 2, 2, 2]


# ----------------------------------------------------------------------------- refusal
async def one_running(target_ms, max_batch_size=4, levels=1, priority=1, **curve):
    """A batcher with a latency target and a learnt cost (``learnt(b, **curve)``) whose one
    worker holds a batch of one request running until ``gate`` is set: (batcher, worker,
    gate, the running request's future).  The refusal arithmetic then reads a known state."""
    gate = threading.Event()
    w = FakeWorker(gate)
    b = DynamicBatcher("t", cfg(max_batch_size=max_batch_size, priority_levels=levels,
                                latency_target_ms=target_ms), [w])
    learnt(b, **curve)
    running = asyncio.ensure_future(b.infer(Item(0), priority=priority))
    await wait_started(w)
    return b, w, gate, running


def test_refusal_is_exact_and_immediate_and_admitted_requests_all_run():
    """Target 12 ms, a batch of n costs 2 + n ms, batches of 4 (2 x 6 ms fit the target), one
    batch of 1 running (half of its 3 ms still ahead, on average): the k-th queued request is
    predicted at ((k-1)//4)*6 + 2 + (k - 4*((k-1)//4)) + 1.5 ms, so k = 1..6 (4.5..11.5 ms)
    are admitted and the 7th (12.5 ms) is refused."""
    async def main():
        b, w, gate, running = await one_running(12)
        assert [b.queue.predicted_ns(k) / 1e6 for k in (1, 2, 3, 4, 5, 6, 7)] == pytest.approx(
            [4.5, 5.5, 6.5, 7.5, 10.5, 11.5, 12.5], rel=1e-4)
        admitted = [asyncio.ensure_future(b.infer(Item(i))) for i in range(1, 7)]
        await asyncio.sleep(0)
        assert b.pending == 6
        with pytest.raises(Overloaded) as refused:
            await b.infer(Item(7))
        assert b.pending == 6  # refused before anything was queued
        gate.set()
        res = await asyncio.gather(running, *admitted)
        await b.close()
        return refused.value, res

    refused, res = asyncio.run(main())
    assert [r.value for r in res] == [0, 2, 4, 6, 8, 10, 12]  # admitted: never dropped
    assert refused.http_status == 429 and refused.code == "resource_exhausted"
    assert refused.retry_after_s == 1  # the 6 queued drain in 11.5 ms: 1 s, at least
    assert "latency target of 12 ms" in refused.message
    # 11.5 and 12.5 ms, learnt to within a ppm: either rounding
    assert re.search(r"6 requests queued ahead drain in about 1[12] ms", refused.message)
    assert re.search(r"this one would finish in about 1[23] ms", refused.message)


def test_retry_after_is_the_predicted_drain_rounded_up():
    async def main():
        # a batch of n: 1.2 + n s
        b, _w, gate, running = await one_running(4000, fixed_us=1.2e6, item_us=1e6)
        first = b.submit(Item(1))  # 1.2 + 1 + (1.2 + 1) / 2 = 3.3 s
        with pytest.raises(Overloaded) as refused:
            b.submit(Item(2))  # 4.3 s
        gate.set()
        await asyncio.gather(running, first.waiter)
        await b.close()
        return refused.value

    assert asyncio.run(main()).retry_after_s == 4  # the one queued drains in 3.3 s


def test_a_deadline_tighter_than_the_target_is_refused_on_the_deadline():
    async def main():
        b, _w, gate, running = await one_running(1000)
        queued = [asyncio.ensure_future(b.infer(Item(i))) for i in (1, 2)]
        await asyncio.sleep(0)
        # k = 3: 2 + 3 + 1.5 = 6.5 ms
        with pytest.raises(Overloaded) as late:
            b.submit(Item(3), None, 1, 6)
        ok = b.submit(Item(4), None, 1, 7)
        assert b.pending == 3
        gate.set()
        await asyncio.gather(running, *queued, ok.waiter, return_exceptions=True)
        await b.close()
        return late.value

    late = asyncio.run(main())
    assert "deadline of 6 ms" in late.message


def test_a_high_priority_request_is_predicted_behind_its_level_only():
    """A backlog of low-priority requests refuses more low-priority ones, not a request of a
    higher level: formation runs it first, so only its level and above count ahead of it."""
    async def main():
        b, w, gate, running = await one_running(12, levels=2, priority=2)
        low = [asyncio.ensure_future(b.infer(Item(i), priority=2)) for i in range(1, 7)]
        await asyncio.sleep(0)
        with pytest.raises(Overloaded) as refused:
            b.submit(Item(7), None, 2, 0)  # 7th low one: 12.5 ms
        high = b.submit(Item(8), None, 1, 0)  # first of its level: 4.5 ms
        assert b.pending == 7
        gate.set()
        await asyncio.gather(running, *low, high.waiter)
        await b.close()
        return w, refused.value

    w, refused = asyncio.run(main())
    assert w.seen()[:2] == [0, 8]  # the high one ran first
    assert "6 requests queued ahead" in refused.message


def test_groups_are_refused_whole():
    async def main():
        b, w, gate, running = await one_running(12)
        with pytest.raises(Overloaded):
            b.submit_many([(Item(i), None, 1, 0) for i in range(7)])  # the 7th would be late
        assert b.pending == 0
        group, entries = b.submit_many([(Item(i), None, 1, 0) for i in range(6)])
        gate.set()
        await asyncio.gather(running, group.future)
        await b.close()
        return [e.result() for e in entries]

    assert asyncio.run(main()) == [0, 2, 4, 6, 8, 10]


def test_deadlines_priorities_and_cancellation_keep_their_semantics_with_a_target():
    async def main():
        # cheap: nothing here is refused
        b, w, gate, running = await one_running(3_600_000, max_batch_size=1, levels=2,
                                                priority=2, fixed_us=0.0, item_us=1.0)
        low = asyncio.ensure_future(b.infer(Item(1), priority=2))
        high = asyncio.ensure_future(b.infer(Item(2), priority=1))
        doomed = asyncio.ensure_future(b.infer(Item(3), priority=2, timeout_ms=20))
        gone = asyncio.ensure_future(b.infer(Item(4), priority=2))
        await asyncio.sleep(0)
        gone.cancel()
        with pytest.raises(DeadlineExceeded):
            await doomed
        gate.set()
        await asyncio.gather(running, low, high)
        with pytest.raises(asyncio.CancelledError):
            await gone
        await b.close()
        return w

    w = asyncio.run(main())
    assert w.seen() == [0, 2, 1]  # high before low; the expired and the cancelled never ran


# ----------------------------------------------------------------------------- config
def test_latency_target_config():
    base = {"name": "t", "backend": "text_embedding", "model": "m.onnx"}
    c = parse_config({"tasks": [dict(base, batching={"latency_target_ms": 500})]})
    assert c.tasks[0].batching.latency_target_ms == 500
    assert parse_config({"tasks": [base]}).tasks[0].batching.latency_target_ms == 0
    with pytest.raises(ConfigError, match="latency_target_ms"):
        parse_config({"tasks": [dict(base, batching={"latency_target_ms": -1})]})


# ----------------------------------------------------------------------------- sequences
@pytest.fixture(scope="module")
def acc_path(tmp_path_factory):
    return accumulator_model(tmp_path_factory.mktemp("seq") / "acc.onnx")


def test_a_started_sequence_is_never_refused_only_a_new_start(acc_path):
    cfg_ = config(acc_path, max_batch_size=4)
    cfg_["tasks"][0]["batching"]["latency_target_ms"] = 1
    x = np.ones(4, np.float32)

    async def main():
        async with lc.Runtime.from_dict(cfg_) as rt:
            b = rt.tasks["acc"].batcher
            await rt.infer(req(1, x, start=True))
            learnt(b, fixed_us=1e6, item_us=1e6)  # 1 s a batch: past the 1 ms target
            assert b.guard.cost_ready
            mid = [await rt.infer(req(1, x)) for _ in range(3)]  # mid-stream: never refused
            with pytest.raises(Overloaded):
                await rt.infer(req(2, x, start=True))  # a new sequence: refused
            assert not b.holds_sequence("2")
            end = await rt.infer(req(1, x, end=True))
            return mid, end

    mid, end = asyncio.run(main())
    np.testing.assert_allclose(end.outputs["y"], 5 * np.ones(4))
    assert len(mid) == 3


# ----------------------------------------------------------------------------- the request path
def test_a_request_that_would_be_late_is_refused_before_it_is_prepared(tmp_path):
    """``Dispatcher.admit`` asks the batcher first (``refuse_late``): under overload a refusal
    costs the request's parsing, not its preparation (tokenising a text, decoding an image),
    and nothing is queued.  A request that fits is prepared and runs as usual."""
    import onnx_models as M

    from lumen_core import native

    path = M.matmul(str(tmp_path / "mm.onnx"), 4)
    conf = {"tasks": [{"name": "mm", "backend": "onnx", "model": path,
                       "batching": {"max_batch_size": 4, "latency_target_ms": 12}}]}
    x = np.ones((1, 4), np.float32)

    class Counting(native.routes.DenseTensor):
        calls = 0

        def prepare(self, desc, payload):
            Counting.calls += 1
            return super().prepare(desc, payload)

    async def main():
        async with lc.Runtime.from_dict(conf) as rt:
            route = rt.tasks["mm"]
            route.dense = Counting(route.dense.make_signature)
            ok = await rt.infer(lc.new_infer_request("mm").for_tensor_array(x, "NC", "none")
                                .build())
            assert Counting.calls == 1
            b = route.batcher
            learnt(b, fixed_us=1e6, item_us=1e6)  # 1 s a batch: past the 12 ms target
            with pytest.raises(Overloaded, match="latency target of 12 ms"):
                await rt.infer(lc.new_infer_request("mm").for_tensor_array(x, "NC", "none")
                               .build())
            assert Counting.calls == 1 and b.pending == 0  # never prepared, nothing queued
            b.guard.cost = CostModel()  # forget it (the model would take ~100 batches to)
            learnt(b, fixed_us=10.0, item_us=10.0)  # cheap again: admitted
            again = await rt.infer(lc.new_infer_request("mm").for_tensor_array(x, "NC", "none")
                                   .build())
            assert Counting.calls == 2
            return ok, again

    ok, again = asyncio.run(main())
    np.testing.assert_allclose(ok.outputs["y"], again.outputs["y"])


# ----------------------------------------------------------------------------- issue 38 rows 2, 3
def contended(target_ms=100, lone_ms=60.0):
    """A batcher whose cost was learnt under contention (a lone request predicted at
    ``lone_ms``) and whose budget late answers shrank (to STEER_MIN of the target)."""
    from lumen_core.batching import policy as P

    b = DynamicBatcher("t", cfg(max_batch_size=4, latency_target_ms=target_ms), [FakeWorker()])
    learnt(b, fixed_us=lone_ms * 1000 - 1000.0, item_us=1000.0, full=1)
    with b.queue.lock:
        for _ in range(100):
            b.steer(10 * target_ms * 1_000_000)
    assert b.guard.headroom == pytest.approx(P.STEER_MIN)
    return b


def test_an_idle_server_grows_its_budget_back_without_traffic():
    """Issue 38 row 2: the budget moved only when a batch finished, so after contention an
    idle server refused a lone request (predicted 90 ms, budget 25 ms of a 100 ms target)
    forever: nothing finished because everything was refused.  While nothing runs the
    budget now grows back (halving the gap every BUDGET_HALF_LIFE_NS), with no request."""
    import time

    from lumen_core.request_path import latency as SC

    async def main():
        b = contended(lone_ms=90.0)
        with pytest.raises(Overloaded, match=r"admitting to \d+ ms"):
            b.submit(Item(1))  # at once (the budget needs 3 half-lives to reach 90 ms): refused
        now = time.monotonic_ns()
        half = b.guard.budget_now(now + SC.BUDGET_HALF_LIFE_NS, b.queue.running) - b.guard.budget_now(now, b.queue.running)
        assert half == pytest.approx((100e6 - b.guard.budget_now(now, b.queue.running)) / 2, rel=0.05)
        await asyncio.sleep(1.0)  # idle: no batch, no request
        assert b.cost_figures()["latency_budget_ms"] > 99
        e = b.submit(Item(2))  # admitted on the budget, within the target
        await e.waiter
        await b.close()
        return e.result()

    assert asyncio.run(main()) == 4


def test_an_idle_server_probes_a_cost_learnt_under_contention():
    """Issue 38 row 2: a cost learnt while other processes took the cores (a lone request
    predicted at 300 ms, past the whole 100 ms target) refused an idle server forever.  An
    idle batcher whose last batch finished PROBE_IDLE_NS ago admits one request as a probe;
    its batch teaches the model the idle cost, after which requests are admitted again."""
    async def main():
        b = contended(lone_ms=300.0)
        with pytest.raises(Overloaded):
            b.submit(Item(1))
        await asyncio.sleep(1.0)  # idle
        with pytest.raises(Overloaded):  # a group is never a probe
            b.submit_many([(Item(i), None, 1, 0) for i in range(2)])
        gate = b.workers[0].runner.gate = threading.Event()
        probe = b.submit(Item(2))  # the probe
        with pytest.raises(Overloaded):
            b.submit(Item(3))  # one probe at a time: the first is queued or running
        gate.set()
        await probe.waiter
        b.workers[0].runner.gate = None
        for i in range(400):  # the fake model's real (tiny) cost is learnt
            await b.infer(Item(i))
        got = await b.infer(Item(21))
        await b.close()
        return probe.result(), got.value

    assert asyncio.run(main()) == (4, 42)


class Text(Item):
    __slots__ = ("length",)

    def __init__(self, value, length):
        super().__init__(value)
        self.length = length


def text_cost(b):
    """2 ms a batch, 100 us an item, 10 us a token slot, learnt on texts of 10 and 30
    tokens (20 on average)."""
    with b.queue.lock:
        for i in range(400):
            n, length = 1 + i % 4, (10, 30)[i // 4 % 2]
            b.learn(n, n * length, 2000 + 100 * n + 10 * n * length)
    assert b.guard.cost_token_ns == pytest.approx(10_000, rel=1e-3)
    assert 15 < b.guard.cost_tokens_per_item < 25


def test_a_group_is_priced_at_its_items_own_lengths_and_queued_long_texts_count():
    """Issue 38 row 3: ``submit_many`` priced every item of a group at the typical item, so
    40 max-length texts (cost learnt on short ones) were admitted and pushed every request
    behind them far past the target.  A group's items are priced at their own lengths, and
    the queue's texts at theirs (``queued_tokens``), as a single request's own batch is."""
    async def main():
        gate = threading.Event()
        w = FakeWorker(gate)
        b = DynamicBatcher("t", cfg(max_batch_size=4, latency_target_ms=200), [w])
        text_cost(b)
        running = asyncio.ensure_future(b.infer(Text(0, 20)))
        await wait_started(w)
        # 40 texts of 512 tokens: about 40 x 5 ms of token slots alone, past 200 ms
        with pytest.raises(Overloaded):
            b.submit_many([(Text(i, 512), None, 1, 0) for i in range(40)])
        assert b.pending == 0 and b.queue.queued_tokens == 0
        # 40 typical texts fit (about 40 x 0.3 ms + 10 batches x 2 ms)
        short, short_entries = b.submit_many([(Text(i, 20), None, 1, 0) for i in range(40)])
        assert b.queue.queued_tokens == 40 * 20
        # 20 long ones fit (about 20 x 5 ms) behind them ...
        long_, long_entries = b.submit_many([(Text(i, 512), None, 1, 0) for i in range(20)])
        assert b.queue.queued_tokens == 40 * 20 + 20 * 512
        excess = b.guard.excess_ns(b.queue.queued_tokens, b.pending)
        assert excess == pytest.approx(
            (40 * 20 + 20 * 512 - 60 * b.guard.cost_tokens_per_item) * 10_000, rel=1e-3)
        # ... and a short request from another client is predicted behind their real cost
        wait = b.queue.predicted_ns(b.pending + 1, 20) + excess
        with pytest.raises(Overloaded) as refused:
            for i in range(1000):  # admitted while it fits, then refused
                b.submit(Text(100 + i, 20))
        admitted = b.pending - 60
        assert wait <= 200e6 and admitted < 60  # the typical pricing admitted 1000 - 60 more
        assert "would finish" in refused.value.message
        gate.set()
        await asyncio.gather(running, short.future, long_.future)
        await b.drain()
        assert b.queue.queued_tokens == 0  # formation took every length back out
        await b.close()
        return [e.result() for e in long_entries]

    assert asyncio.run(main()) == [2 * i for i in range(20)]
