"""Loop execution (``[tasks.batching] loop_execution_us``): a model whose batches cost less than
handing them to a worker thread runs them on the event loop; anything slower stays on (or goes
back to) its worker.  Where a batch ran is read from the thread that ran it, not from timings;
the only times the fake models take are their own sleeps, far from the threshold either way.
"""
from __future__ import annotations

import asyncio
import threading
import time

import pytest
from test_batching import Item

from lumen_core.batching.cost import COST_MIN_SAMPLES
from lumen_core.batching.dynamic import (
    LOOP_BACKOFF,
    LOOP_OVERRUN_FACTOR,
    LOOP_PROBE_FACTOR,
    LOOP_SAMPLES,
    DynamicBatcher,
)
from lumen_core.config import BatchingConfig, parse_config
from lumen_core.errors import ConfigError, DeadlineExceeded, InternalError, Unavailable


class Model:
    """Doubles values and records, per batch, its size and whether it ran on the loop's
    thread.  ``cost_s`` (a callable of the batch number) sleeps in each run; values in
    ``fail`` make a whole batch raise."""

    def __init__(self, cost_s=lambda k: 0.0, fail=()):
        self.cost_s = cost_s
        self.fail = set(fail)
        self.runs: list = []  # (size, on the main thread)
        self.values: list = []

    def execute(self, items):
        k = len(self.runs)
        self.runs.append((len(items), threading.current_thread() is threading.main_thread()))
        self.values.extend(it.value for it in items)
        s = self.cost_s(k)
        if s:
            time.sleep(s)
        if any(it.value in self.fail for it in items):
            raise RuntimeError("model failed")
        return [it.value * 2 for it in items]

    def on_loop(self, since=0):
        return [loop for _, loop in self.runs[since:]]


def cfg(**kw) -> BatchingConfig:
    """The mechanics tests' batcher: batches of 8 at once, and the largest threshold allowed,
    so that where a fake model (a few microseconds a batch) runs does not depend on how fast
    or loaded the box is; the tests of the threshold itself set their own."""
    kw.setdefault("max_queue_delay_us", 0)
    kw.setdefault("max_batch_size", 8)
    kw.setdefault("max_queue_size", 4096)
    kw.setdefault("loop_execution_us", 1000)
    return BatchingConfig(**kw)


def run(model, n_rounds, **config):
    """``n_rounds`` bursts of 8 requests through a fresh batcher over ``model``; its cost
    figures at the end."""
    async def main():
        b = DynamicBatcher("t", cfg(**config), [model])
        await rounds(b, n_rounds)
        figures = b.cost_figures()
        await b.close()
        return figures

    return asyncio.run(main())


async def rounds(b, n_rounds, per_round=8, start=0):
    """``n_rounds`` bursts of ``per_round`` concurrent requests; their values, in order."""
    out = []
    v = start
    for _ in range(n_rounds):
        res = await asyncio.gather(*[b.infer(Item(v + i)) for i in range(per_round)])
        out.extend(r.value for r in res)
        v += per_round
    return out


def test_a_model_cheaper_than_a_hand_over_runs_its_batches_on_the_loop():
    async def main():
        m = Model()
        b = DynamicBatcher("t", cfg(loop_execution_us=100), [m])  # the default
        got = await rounds(b, 40)
        assert got == [2 * v for v in range(320)]
        figures = b.cost_figures()
        await b.close()
        return m, figures

    m, figures = asyncio.run(main())
    assert not any(m.on_loop()[:COST_MIN_SAMPLES])  # nothing learnt yet: the worker ran them
    assert all(m.on_loop(len(m.runs) - 10))  # and then the loop did
    assert figures["loop_execution"] is True and figures["loop_batch_us"] > 0
    assert sorted(m.values) == list(range(320))  # each request ran exactly once


def test_zero_keeps_every_batch_on_the_worker():
    m = Model()
    figures = run(m, 40, loop_execution_us=0)
    assert len(m.runs) == 40 and not any(m.on_loop()) and figures["loop_execution"] is False


def test_a_model_far_over_the_threshold_is_never_tried_on_the_loop():
    # 4 ms a batch: 40x the default 100 us threshold, 10x past the trial's reach
    m = Model(cost_s=lambda k: 0.004)
    figures = run(m, 30, loop_execution_us=100)
    assert len(m.runs) == 30 and not any(m.on_loop()) and figures["loop_execution"] is False


def test_several_instances_or_length_aware_batches_keep_their_workers():
    async def main(b, models):
        res = await rounds(b, 30)
        await b.close()
        return res

    models = [Model(), Model()]
    b = DynamicBatcher("t", cfg(), models)
    assert asyncio.run(main(b, models)) == [2 * v for v in range(240)]
    assert b.execution.turn is None and not any(loop for m in models for loop in m.on_loop())
    m = Model()
    b = DynamicBatcher("t", cfg(), [m], max_batch_tokens=4096)
    assert asyncio.run(main(b, [m])) == [2 * v for v in range(240)]
    assert b.execution.turn is None and not any(m.on_loop())


def test_a_model_that_slows_down_goes_back_to_its_worker():
    # cheap for 40 batches, then 6 ms a batch (past the trial's reach of 4 x 1 ms, so it is
    # not tried again): the loop gives it back once most of its last LOOP_SAMPLES batches
    # were slow (their median crosses the threshold)
    slow_from = 40
    m = Model(cost_s=lambda k: 0.006 if k >= slow_from else 0.0)
    figures = run(m, 80)
    assert all(m.on_loop(COST_MIN_SAMPLES + LOOP_SAMPLES)[:slow_from - 20])  # cheap: on it
    slow_on_loop = sum(m.on_loop(slow_from))
    assert slow_on_loop == LOOP_SAMPLES // 2  # held the loop for a few slow batches ...
    assert not any(m.on_loop(slow_from + slow_on_loop))  # ... then the worker ran every one
    assert figures["loop_execution"] is False


def test_a_lone_slow_batch_does_not_send_the_model_back():
    # a garbage collection or the OS holding one batch up for 8 ms is not the model's cost
    m = Model(cost_s=lambda k: 0.008 if k in (30, 45, 60) else 0.0)
    figures = run(m, 80)
    assert all(m.on_loop(25)) and figures["loop_execution"] is True


def test_a_trial_that_fails_backs_off():
    # 2 ms a batch against a 1 ms threshold: within the trial's reach (4 x 1 ms), over the
    # threshold.  A trial runs LOOP_SAMPLES batches on the loop; the next one waits
    # LOOP_BACKOFF worker batches, and the one after twice as many.
    async def main():
        m = Model(cost_s=lambda k: 0.002)
        b = DynamicBatcher("t", cfg(max_batch_size=1), [m])
        for i in range(COST_MIN_SAMPLES + LOOP_SAMPLES + LOOP_BACKOFF + LOOP_SAMPLES + 100):
            await b.infer(Item(i))
        await b.close()
        return m

    m = asyncio.run(main())
    on = m.on_loop()
    starts = [i for i in range(1, len(on)) if on[i] and not on[i - 1]]
    assert len(starts) == 2  # one trial once the cost was learnt, one after the backoff
    for s in starts:
        assert on[s:s + LOOP_SAMPLES] == [True] * LOOP_SAMPLES and not on[s + LOOP_SAMPLES]
    # the trial, the backoff's worker batches, and the worker batch whose cost starts the next
    assert starts[1] - starts[0] == LOOP_SAMPLES + LOOP_BACKOFF + 1
    assert 2000 <= LOOP_PROBE_FACTOR * 1000  # the premise: within reach


def test_a_failing_item_fails_alone_on_the_loop_too():
    async def main():
        m = Model(fail={1003})
        b = DynamicBatcher("t", cfg(), [m])
        await rounds(b, 20)  # now on the loop
        since = len(m.runs)
        res = await asyncio.gather(*[b.infer(Item(1000 + i)) for i in range(8)],
                                   return_exceptions=True)
        await b.close()
        return m, since, res

    m, since, res = asyncio.run(main())
    assert len(m.runs) > since + 1 and all(m.on_loop(since))  # the whole split, on the loop
    assert isinstance(res[3], InternalError)
    assert [r.value for i, r in enumerate(res) if i != 3] == [2 * (1000 + i) for i in range(8)
                                                              if i != 3]


def test_a_fault_between_batches_sends_the_instance_back_once_not_back_and_forth():
    async def main():
        m = Model()
        b = DynamicBatcher("t", cfg(), [m])
        await rounds(b, 20)
        assert b.execution.loop_runs
        form = b.formation.form
        calls = [0]

        def broken(now):
            calls[0] += threading.current_thread() is threading.main_thread()
            raise RuntimeError("formation bug")

        b.formation.form = broken  # the next formation on the loop fails
        stuck = asyncio.ensure_future(b.infer(Item(5)))
        await asyncio.sleep(0.05)
        b.formation.form = form  # the worker forms it now
        r = await asyncio.wait_for(stuck, 5)
        loop_runs, calls_seen = b.execution.loop_runs, calls[0]
        await b.close()
        return r, loop_runs, calls_seen

    r, loop_runs, calls_seen = asyncio.run(main())
    assert loop_runs is False  # backed off, not lent again at once
    assert calls_seen == 1  # the loop tried once; the worker retried on its own backoff
    assert r.value == 10

def test_deadlines_queue_delay_drain_and_close_hold_on_the_loop():
    async def main():
        m = Model()
        delay_us = 20_000
        b = DynamicBatcher("t", cfg(max_queue_delay_us=delay_us), [m])
        await rounds(b, 20)  # full batches form at once, delay or not: now on the loop
        assert b.execution.loop_runs and m.on_loop(len(m.runs) - 1) == [True]
        # a lone request waits for company up to the delay (the loop's timer), then runs
        r = await b.infer(Item(7))
        assert r.batch_size == 1 and r.queue_us >= delay_us * 0.9
        assert m.on_loop(len(m.runs) - 1) == [True]
        # a request whose deadline passes while it waits for company never runs
        seen = len(m.values)
        with pytest.raises(DeadlineExceeded):
            await b.infer(Item(99), timeout_ms=5)
        assert 99 not in m.values[seen:]
        # drain answers what is queued, then refuses; close joins the parked worker
        queued = [asyncio.ensure_future(b.infer(Item(500 + i))) for i in range(3)]
        await asyncio.sleep(0)
        await asyncio.wait_for(b.drain(), 5)
        assert [f.result().value for f in queued] == [1000, 1002, 1004]
        with pytest.raises(Unavailable):
            await b.infer(Item(1))
        await asyncio.wait_for(b.close(), 5)
        assert not b.workers[0].thread.is_alive()

    asyncio.run(main())


def test_a_queue_delay_on_uvloop_waits_without_spinning():
    # uvloop rounds timers to whole milliseconds: a timer for the last fraction of one fires
    # at once, again and again (hundreds of times over a 1.5 ms wait) unless it is set again
    # for at least LOOP_TIMER_FLOOR_NS
    uvloop = pytest.importorskip("uvloop")
    delay_us = 1500

    async def main():
        m = Model()
        b = DynamicBatcher("t", cfg(max_queue_delay_us=delay_us), [m])
        await rounds(b, 20)  # full batches form at once: now on the loop
        assert b.execution.loop_runs
        form = b.formation.form
        calls = [0]

        def counted(now):
            calls[0] += 1
            return form(now)

        b.formation.form = counted
        waits = []
        for i in range(5):  # lone requests: each waits out the delay for company
            r = await b.infer(Item(i))
            assert r.batch_size == 1 and r.queue_us >= delay_us * 0.9
            waits.append(r.queue_us)
        b.formation.form = form
        await b.close()
        return calls[0], m, waits

    calls, m, waits = uvloop.run(main())
    assert all(m.on_loop(len(m.runs) - 5))
    # per request: the formation at admission, at most one early timer and the due one, and on
    # a loaded box now and then one more (a worker's look at the queue as it wakes): spinning,
    # the bug, is hundreds of calls (one seen in three full pure-twin runs at 16 of 15)
    assert calls <= 5 * 4, (calls, waits)


def test_close_without_drain_gives_the_instance_back_and_answers_everything():
    async def main():
        m = Model()
        b = DynamicBatcher("t", cfg(max_queue_delay_us=10_000_000, max_batch_size=64), [m])
        await rounds(b, 20, per_round=64)  # full batches: on the loop
        assert b.execution.loop_runs
        waiting = [asyncio.ensure_future(b.infer(Item(i))) for i in range(5)]
        await asyncio.sleep(0.01)  # they wait for company (10 s delay)
        await asyncio.wait_for(b.close(), 5)
        res = await asyncio.gather(*waiting, return_exceptions=True)
        assert not b.workers[0].thread.is_alive()
        return res

    res = asyncio.run(main())
    # each is answered: run by the worker as it drains at close, or refused Unavailable
    assert all((isinstance(r, Unavailable) or r.value == 2 * i) for i, r in enumerate(res))


def test_many_callers_each_get_their_own_result_on_the_loop():
    async def main():
        m = Model()
        b = DynamicBatcher("t", cfg(max_batch_size=16), [m])
        vals = list(range(4000))
        res = await asyncio.gather(*[b.infer(Item(v)) for v in vals])
        assert [r.value for r in res] == [2 * v for v in vals]
        since = len(m.runs)
        res = await rounds(b, 50, per_round=16, start=10_000)
        assert res == [2 * v for v in range(10_000, 10_800)]
        await b.close()
        return m, since

    m, since = asyncio.run(main())
    assert sorted(m.values) == sorted(list(range(4000)) + list(range(10_000, 10_800)))
    assert all(m.on_loop(since))


@pytest.mark.parametrize("value, ok", [(0, True), (50, True), (1000, True), (-1, False),
                                       (1001, False), ("50", False)])
def test_config_reads_and_bounds_loop_execution_us(value, ok):
    base = {"name": "t", "backend": "text_embedding", "model": "m.onnx"}
    doc = {"tasks": [dict(base, batching={"loop_execution_us": value})]}
    if ok:
        assert parse_config(doc).tasks[0].batching.loop_execution_us == value
    else:
        with pytest.raises(ConfigError, match="loop_execution_us"):
            parse_config(doc)
    assert parse_config({"tasks": [base]}).tasks[0].batching.loop_execution_us == 100


def test_the_worker_is_parked_while_the_loop_runs_its_batches():
    async def main():
        m = Model()
        b = DynamicBatcher("t", cfg(), [m])
        await rounds(b, 20)
        turn, worker = b.execution.turn, b.workers[0]
        # lent: the worker thread waits on its own lock, which only the turn releases, and
        # the turn waits in the idle list (or is about to run) in its place
        assert b.execution.loop_runs and turn.lent and (turn in b.queue.idle or turn.scheduled)
        assert worker.thread.is_alive() and worker.wake not in b.queue.idle
        since = len(m.runs)
        await rounds(b, 200)
        assert turn.lent
        await b.close()
        assert not worker.thread.is_alive()
        return m, since

    m, since = asyncio.run(main())
    assert len(m.runs) == since + 200 and all(m.on_loop(since))


@pytest.mark.parametrize("step_queued", [False, True])
def test_a_loop_that_is_gone_gives_the_instance_back(step_queued):
    # the loop closes without closing the batcher: between steps, or with a step still on
    # its ready queue; a close from another loop must still stop the parked worker
    async def main():
        m = Model()
        b = DynamicBatcher("t", cfg(), [m])
        await rounds(b, 20)
        if step_queued:
            b.submit(Item(1))  # formable at once: a step is scheduled, and never runs
            assert b.execution.turn.scheduled
        return b

    loop = asyncio.new_event_loop()
    b = loop.run_until_complete(main())
    loop.close()
    turn, worker = b.execution.turn, b.workers[0]
    assert turn.lent and worker.thread.is_alive()
    if not step_queued:
        with b.queue.lock:
            turn.release()  # a wake-up that cannot reach the closed loop ...
        assert not turn.lent and turn.loop is None  # ... hands the instance back
    asyncio.run(asyncio.wait_for(b.close(), 10))
    assert not turn.lent and not worker.thread.is_alive()


def test_a_real_model_through_the_runtime_moves_to_the_loop_and_answers_right(tmp_path):
    # the small MLP (16 -> 64 -> 8), one ORT thread: a batch of 8 costs tens of microseconds
    # (more in the pure twins, whose assembly is Python), so the threshold is the largest
    # allowed, to make the test about the runtime's path, not about this box's speed
    import numpy as np
    import onnx_models as M

    import lumen_core as lc

    path = M.mlp(tmp_path / "mlp.onnx")
    cfg = {"tasks": [{"name": "mlp", "backend": "onnx", "model": str(path), "instances": 1,
                      "intra_op_threads": 1,
                      "batching": {"max_batch_size": 8, "max_queue_delay_us": 0,
                                   "loop_execution_us": 1000}}]}
    xs = np.random.default_rng(3).standard_normal((64, 16)).astype(np.float32)
    ref = M.mlp_reference(xs)

    def req(i):
        return lc.new_infer_request("mlp").for_tensor_array(
            xs[i].reshape(1, -1), layout="NC", preprocess_id="none").build()

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            for _ in range(30):
                out = await asyncio.gather(*[rt.infer(req(i)) for i in range(64)])
            load = rt.load()["mlp"]["cost"]
            many = await rt.infer_many([req(i) for i in range(64)])
            return out, many, load

    out, many, load = asyncio.run(main())
    assert load["loop_execution"] is True
    for i in range(64):
        np.testing.assert_allclose(out[i].outputs["y"], ref[i], atol=1e-5)
        np.testing.assert_allclose(many[i].outputs["y"], ref[i], atol=1e-5)


# -- issue 38 row 1: one client's huge batches never run on the loop --------------------------
class Dense(Item):
    """A dense request as the onnx task prepares it: its per-item shape (no batch axis) is
    part of its signature, so rows of one length batch together."""

    __slots__ = ("item_shape",)

    def __init__(self, value, item_shape):
        super().__init__(value, ("x", item_shape))
        self.item_shape = item_shape


class SizedModel(Model):
    """``Model`` whose batches of large items (more than ``big`` elements each) sleep
    ``big_s``; small ones cost what the fake costs."""

    def __init__(self, big=100_000, big_s=0.2):
        super().__init__()
        self.big, self.big_s = big, big_s

    def execute(self, items):
        out = super().execute(items)
        if items[0].item_shape[0] * items[0].item_shape[1] > self.big:
            time.sleep(self.big_s)
        return out


def test_a_batch_of_huge_items_runs_on_the_worker_not_the_loop():
    """Issue 38 row 1: x [N, L, 32], batches of L = 1 moved the task to the loop; then two
    rows of L = 65536 ran there as one batch, stalling every connection for the whole run
    (the trial judges a median of 8 batches; the prediction counted rows, not elements).  The
    loop now prices each batch by its elements (learnt per element, and at least the typical
    item's cost per element) and hands one predicted past the threshold to the worker."""
    async def main():
        m = SizedModel()
        b = DynamicBatcher("t", cfg(), [m])
        small = (1, 32)
        for r in range(40):
            await asyncio.gather(*[b.infer(Dense(8 * r + i, small)) for i in range(8)])
        assert b.cost_figures()["loop_execution"] is True and m.on_loop()[-1]
        before = len(m.runs)
        big = await asyncio.gather(*[b.infer(Dense(1000 + i, (65536, 32))) for i in range(2)])
        after = await asyncio.gather(*[b.infer(Dense(2000 + i, small)) for i in range(8)])
        await b.close()
        return m, before, [r.value for r in big + after]

    m, before, values = asyncio.run(main())
    assert values == [2000, 2002] + [4000 + 2 * i for i in range(8)]
    assert m.runs[before] == (2, False)  # the huge batch ran on the worker thread
    assert m.on_loop()[-1]  # and the loop has the instance back for the small ones


def test_one_batch_that_overruns_the_loop_sends_the_task_back_at_once():
    """Issue 38 row 1: a batch on the loop that took LOOP_OVERRUN_FACTOR times the threshold
    (here 50 ms against 1 ms: a stall of every connection) sends the task to its worker at
    once, not when the median of the last LOOP_SAMPLES batches crosses the threshold."""
    m = Model(cost_s=lambda k: 0.05 if k == 30 else 0.0)
    run(m, 80)
    on = m.on_loop()
    assert all(on[25:31])  # on the loop, the overrun included
    assert not any(on[31:31 + LOOP_BACKOFF])  # then the worker, for a backoff
    assert 50_000 > LOOP_OVERRUN_FACTOR * 1000  # the premise: an overrun


def test_a_real_attention_model_keeps_its_long_rows_off_the_loop(tmp_path):
    """The issue's reproduction at a test scale: an onnx task x [N, L, 32] (one attention
    layer, cost ~ L^2), one instance, loop execution on: short rows move it to the loop (on a
    box too loaded for its trial to hold, the test puts it there); a few long rows are then
    run by the worker thread (the loop stays free for every other connection), and every
    answer is right."""
    import numpy as np
    import onnx_models as M

    import lumen_core as lc

    path = M.attention(tmp_path / "att.onnx")
    conf = {"tasks": [{"name": "att", "backend": "onnx", "model": str(path), "instances": 1,
                       "intra_op_threads": 1, "options": {"layout": "NLC"},
                       "batching": {"max_batch_size": 8, "max_queue_delay_us": 0,
                                    "loop_execution_us": 1000}}]}
    rng = np.random.default_rng(5)
    short = rng.standard_normal((64, 1, 4, 32)).astype(np.float32)
    long_ = rng.standard_normal((2, 1, 1024, 32)).astype(np.float32)

    def req(x):
        return lc.new_infer_request("att").for_tensor_array(x, layout="NLC",
                                                            preprocess_id="none").build()

    async def main():
        async with lc.Runtime.from_dict(conf) as rt:
            # where each batch ran: its postprocess runs in the thread that ran it
            runner = rt.tasks["att"].batcher.workers[0].runner
            ran = []
            post = runner.postprocess

            def recording(outputs, items):
                ran.append((items[0].item_shape[0], threading.current_thread()
                            is threading.main_thread()))
                return post(outputs, items)

            runner.postprocess = recording
            for _ in range(40):
                out = await asyncio.gather(*[rt.infer(req(x)) for x in short])
            on_loop = rt.load()["att"]["cost"]["loop_execution"]
            if not on_loop:  # a box too loaded for the trial to hold: the loop gets it anyway
                b = rt.tasks["att"].batcher
                with b.queue.lock:
                    b.execution.loop_runs = True
                    b.execution.loop_batches = 0
            big = await asyncio.gather(*[rt.infer(req(x)) for x in long_])
            await asyncio.gather(*[rt.infer(req(x)) for x in short[:8]])
            return out, big, ran

    out, big, ran = asyncio.run(main())
    assert any(loop for length, loop in ran if length == 4)  # short rows ran on the loop
    long_runs = [loop for length, loop in ran if length == 1024]
    assert long_runs and not any(long_runs)  # on the worker thread
    for x, r in zip(short, out, strict=True):  # (the last warm-up round)
        np.testing.assert_allclose(r.outputs["y"], M.attention_reference(x)[0], atol=1e-4)
    for x, r in zip(long_, big, strict=True):
        np.testing.assert_allclose(r.outputs["y"], M.attention_reference(x)[0], atol=1e-4)
