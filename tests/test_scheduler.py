"""The scheduler's per-request hot path on both twins (``lumen_core.scheduler`` and the
compiled ``lumen_core._scheduler``): entries, answering, batch delivery, admission, infer."""
from __future__ import annotations

import asyncio

import numpy as np
import onnx_models as M
import pytest

import lumen_core as lc
from lumen_core.batching.dynamic import DynamicBatcher
from lumen_core.config import BatchingConfig
from lumen_core.errors import Overloaded, Unavailable


def test_answer_settles_a_future_once(scheduler):
    async def main():
        loop = asyncio.get_running_loop()
        e = scheduler.Entry("item", loop.create_future(), 1, 10)
        assert e.state == scheduler.QUEUED and e.outcome is scheduler.UNSET and e.queue_us == 0
        scheduler.answer(e, {"y": 1})
        scheduler.answer(e, lc.InternalError("late"))  # dropped: answered already
        assert e.state == scheduler.DONE and await e.waiter == {"y": 1}
        err = scheduler.Entry("item", loop.create_future(), 1, 10)
        scheduler.answer(err, lc.InvalidArgument("bad", "payload"))
        with pytest.raises(lc.InvalidArgument):
            await err.waiter
    asyncio.run(main())


def test_deliver_skips_answered_entries_and_counts_groups(scheduler):
    async def main():
        loop = asyncio.get_running_loop()
        group = scheduler.Group(loop.create_future(), 3)
        es = [scheduler.Entry(i, group, 1, 0) for i in range(3)]
        for e in es:
            e.state = scheduler.RUNNING
            e.dispatch_ns = 5_000
        scheduler.answer(es[1], lc.DeadlineExceeded("late", "lumen.timeout_ms"))
        scheduler.deliver(es, [10, 11, 12], 42)
        await asyncio.wait_for(group.future, 1)
        assert [e.outcome for e in (es[0], es[2])] == [10, 12]
        assert isinstance(es[1].outcome, lc.DeadlineExceeded) and es[1].batch_size == 0
        assert es[0].batch_size == 3 and es[0].compute_us == 42 and es[0].queue_us == 5
    asyncio.run(main())


class _Item:
    __slots__ = ("signature",)

    def __init__(self, sig="s"):
        self.signature = sig


def test_enqueue_admits_refuses_and_arms_deadlines(scheduler):
    async def main():
        pinned = type("Pinned", (DynamicBatcher,), {"_sched": scheduler})  # entries of this twin
        b = pinned("t", BatchingConfig(max_batch_size=1, max_queue_size=2,
                                       max_queue_delay_us=10_000_000), [])
        b.start()
        e1 = scheduler.enqueue(b, _Item(), 1, 0)
        e2 = scheduler.enqueue(b, _Item("other"), 1, 50)
        assert b.pending == 2 and e1.timer is None and e2.timer is not None
        assert e2.deadline_ns > e2.arrival_ns
        with pytest.raises(Overloaded):
            scheduler.enqueue(b, _Item(), 1, 0)
        with pytest.raises(lc.DeadlineExceeded):
            await e2.waiter
        b.cancel(e1)
        assert b.pending == 0
        await b.close()
        with pytest.raises(Unavailable):
            scheduler.enqueue(b, _Item(), 1, 0)
    asyncio.run(main())


def test_infer_runs_a_request_end_to_end(scheduler, tmp_path):
    path = M.mlp(tmp_path / "mlp.onnx")
    cfg = {"tasks": [{"name": "mlp", "backend": "onnx", "model": str(path),
                      "batching": {"max_batch_size": 8, "max_queue_delay_us": 0}}]}
    xs = np.random.default_rng(3).standard_normal((12, 16)).astype(np.float32)

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            reqs = [lc.new_infer_request("mlp").for_tensor_array(x.reshape(1, -1), "NC", "none")
                    .build() for x in xs]
            res = await asyncio.gather(*[scheduler.infer(rt, r) for r in reqs])
            with pytest.raises(lc.TaskNotFound):
                await scheduler.infer(rt, lc.InferRequest("nope", b""))
            with pytest.raises(lc.InvalidArgument):
                await scheduler.infer(rt, lc.InferRequest("mlp", object()))
            return res

    res = asyncio.run(main())
    np.testing.assert_allclose(np.stack([r.outputs["y"] for r in res]), M.mlp_reference(xs),
                               atol=1e-5)
    assert all(1 <= r.stats.batch_size <= 8 for r in res)
