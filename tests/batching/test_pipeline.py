"""Ensembles (batching/pipeline.py) on tiny generated models: fan-out, cross-request batching,
errors that stay with their request, deadlines and cancellation through the steps."""
from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import onnx_models
import pytest

from lumen_core.batching.pipeline import StepSpec, build_pipeline
from lumen_core.batching.runner import BatchRunner
from lumen_core.batching.signature import signature
from lumen_core.config import BatchingConfig
from lumen_core.engine.ort import make_instances
from lumen_core.engine.plan import DenseInput, ModelSpec, OutputSpec, PreparedModelRequest
from lumen_core.errors import Cancelled, DeadlineExceeded, InternalError, Overloaded

D = 4
SIG = {s: signature(f"t.{s}", "m", "1", "fp32", (D,), "NC", "id") for s in ("a", "b")}


def item(step: str, x: np.ndarray) -> PreparedModelRequest:
    return PreparedModelRequest(SIG[step], (np.ascontiguousarray(x, np.float32),), (D,))


def make(tmp_path, slow_s: float = 0.0, delay_us: int = 20_000, max_queue: int = 64,
         levels: int = 1):
    path = onnx_models.scale(tmp_path / "scale.onnx", dims=("N", D))
    spec = ModelSpec(path, [DenseInput("x", np.float32)], [OutputSpec("y", np.float32, (D,))])
    seen: dict = {"b_batches": []}

    def post_a(outputs, items):
        return [outputs["y"][i].copy() for i in range(len(items))]

    def post_b(outputs, items):
        if slow_s:
            time.sleep(slow_s)
        seen["b_batches"].append(len(items))
        out = []
        for i in range(len(items)):
            y = outputs["y"][i]
            out.append(InternalError("poisoned item") if y[0] < 0 else float(y.sum()))
        return out

    def make_runners(step):
        return [BatchRunner(inst, step.postprocess)
                for inst in make_instances(step.model, f"t.{step.name}", "cpu", 1, 1, False)]

    cfg = BatchingConfig(max_batch_size=32, max_queue_delay_us=delay_us, max_queue_size=max_queue,
                         priority_levels=levels)

    async def flow(ctx, req):
        x, k = req
        (y,) = await ctx.run("a", [item("a", x)])
        seen.setdefault("priorities", []).append(ctx.priority)
        return await ctx.run("b", [item("b", y * (i + 1)) for i in range(k)])

    step_cfg = BatchingConfig(max_batch_size=32, max_queue_delay_us=delay_us,
                              max_queue_size=4096, priority_levels=levels)
    steps = [StepSpec("a", spec, post_a, step_cfg), StepSpec("b", spec, post_b, step_cfg)]
    return build_pipeline("t", cfg, steps, flow, make_runners), seen


def expected(x: np.ndarray, k: int) -> list:
    return [float((x * 2 * (i + 1) * 2).sum()) for i in range(k)]


async def _serve(pipe, fn):
    pipe.start(asyncio.get_running_loop())
    try:
        return await fn()
    finally:
        await pipe.drain()
        await pipe.close()


def test_fan_out_batches_across_requests(tmp_path):
    pipe, seen = make(tmp_path)
    rng = np.random.default_rng(0)
    reqs = [(rng.random(D).astype(np.float32), int(k)) for k in rng.integers(1, 9, 48)]

    async def go():
        async def one(r):
            e = pipe.submit(r, None, 1, 0)
            return await e.waiter
        return await asyncio.gather(*[one(r) for r in reqs])

    res = asyncio.run(_serve(pipe, go))
    for (x, k), got in zip(reqs, res, strict=True):
        assert got == pytest.approx(expected(x, k), rel=1e-6)
    stats = pipe.step_stats()
    assert stats["a"]["items"] == 48
    assert stats["a"]["requests"] == stats["b"]["requests"] == 48  # each request once per step
    assert stats["b"]["queue_us"] >= 0 and stats["b"]["compute_us"] > 0
    assert stats["b"]["items"] == sum(k for _x, k in reqs)
    # fan-out items of different requests shared batches: more than any request's own k
    assert max(seen["b_batches"]) > 8
    assert stats["b"]["batches"] < stats["b"]["items"]


def test_failing_item_fails_only_its_request(tmp_path):
    pipe, _ = make(tmp_path)
    good = np.ones(D, np.float32)
    bad = -np.ones(D, np.float32)
    reqs = [(bad if i % 5 == 0 else good, 3) for i in range(20)]

    async def go():
        group, entries = pipe.submit_many([(r, None, 1, 0) for r in reqs])
        await group.future
        return [e.outcome for e in entries]

    res = asyncio.run(_serve(pipe, go))
    for i, out in enumerate(res):
        if i % 5 == 0:
            assert isinstance(out, InternalError) and "poisoned" in out.message
        else:
            assert out == pytest.approx(expected(good, 3))


def test_deadline_through_steps_and_cancel(tmp_path):
    pipe, _ = make(tmp_path, slow_s=0.15, delay_us=0)
    x = np.ones(D, np.float32)

    async def go():
        slow = [pipe.submit((x, 2), None, 1, 0) for _ in range(3)]  # keep step b busy
        late = pipe.submit((x, 2), None, 1, 120)
        gone = pipe.submit((x, 2), None, 1, 0)
        await asyncio.sleep(0.05)
        pipe.cancel(gone)
        with pytest.raises(DeadlineExceeded):
            await late.waiter
        with pytest.raises(Cancelled):
            await gone.waiter
        return [await e.waiter for e in slow]

    res = asyncio.run(_serve(pipe, go))
    assert all(r == pytest.approx(expected(x, 2)) for r in res)
    assert pipe.pending == 0


def test_admission_and_priorities(tmp_path):
    pipe, seen = make(tmp_path, max_queue=4, levels=2)
    x = np.ones(D, np.float32)

    async def go():
        es = [pipe.submit((x, 1), None, 2, 0) for _ in range(3)]
        es.append(pipe.submit((x, 1), None, 1, 0))
        with pytest.raises(Overloaded):
            pipe.submit((x, 1), None, 1, 0)
        return [await e.waiter for e in es]

    res = asyncio.run(_serve(pipe, go))
    assert all(r == pytest.approx(expected(x, 1)) for r in res)
    assert sorted(seen["priorities"]) == [1, 2, 2, 2]


def test_many_threads_sync_callers(tmp_path):
    """64 callers from threads through a loop thread: every answer is its own."""
    pipe, _ = make(tmp_path)
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        loop.call_soon_threadsafe(pipe.start, loop)

        async def one(r):
            return await pipe.submit(r, None, 1, 0).waiter

        rng = np.random.default_rng(1)
        reqs = [(rng.random(D).astype(np.float32), int(k)) for k in rng.integers(1, 5, 64)]
        futs = [asyncio.run_coroutine_threadsafe(one(r), loop) for r in reqs]
        for (x, k), f in zip(reqs, futs, strict=True):
            assert f.result(30) == pytest.approx(expected(x, k), rel=1e-6)
        asyncio.run_coroutine_threadsafe(pipe.drain(), loop).result(30)
        asyncio.run_coroutine_threadsafe(pipe.close(), loop).result(30)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(10)
        loop.close()
