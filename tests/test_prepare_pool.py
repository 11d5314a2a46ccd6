"""The bounded preprocessing pool: smallest first, small inputs never starved, deadlines cover
the wait and the work, a full pool refuses at once (issue 12 item 5)."""
from __future__ import annotations

import asyncio
import threading

import numpy as np
import onnx_models as M
import pytest

import lumen_core as lc
from lumen_core.prepare_pool import PreparePool

WAIT_S = 10


def test_small_inputs_are_never_starved_by_large_ones():
    async def main():
        pool = PreparePool(threads=1, small_bytes=1000)
        gate = threading.Event()
        try:
            big = [asyncio.ensure_future(pool.run(lambda: gate.wait(WAIT_S), 10**7))
                   for _ in range(3)]
            await asyncio.sleep(0.05)
            small = await asyncio.wait_for(pool.run(lambda: "small", 10), WAIT_S)
            assert small == "small" and not any(f.done() for f in big)
            gate.set()
            assert await asyncio.gather(*big) == [True] * 3
        finally:
            gate.set()
            pool.stop()
    asyncio.run(main())


def test_smallest_waiting_input_goes_first():
    async def main():
        pool = PreparePool(threads=1, small_bytes=0)  # the reserved thread takes nothing
        gate = threading.Event()
        order: list = []
        running = threading.Event()

        def block():
            running.set()
            return gate.wait(WAIT_S)

        try:
            first = asyncio.ensure_future(pool.run(block, 5))
            await asyncio.to_thread(running.wait, WAIT_S)  # the only general thread is busy
            rest = [asyncio.ensure_future(pool.run(lambda n=n: order.append(n), n))
                    for n in (300, 100, 200)]
            await asyncio.sleep(0)
            gate.set()
            await asyncio.gather(first, *rest)
            assert order == [100, 200, 300]
        finally:
            gate.set()
            pool.stop()
    asyncio.run(main())


def test_a_deadline_covers_the_wait_and_expired_work_never_starts():
    async def main():
        pool = PreparePool(threads=1, small_bytes=0)
        gate = threading.Event()
        ran: list = []
        try:
            busy = asyncio.ensure_future(pool.run(lambda: gate.wait(WAIT_S), 10))
            await asyncio.sleep(0.05)
            with pytest.raises(lc.DeadlineExceeded, match="during preprocessing"):
                await pool.run(lambda: ran.append(1), 10, timeout_ms=30)
            gate.set()
            await busy
            await asyncio.sleep(0.05)
            assert ran == []  # expired while waiting: never started
        finally:
            gate.set()
            pool.stop()
    asyncio.run(main())


def test_a_full_pool_refuses_at_once_with_retry_after():
    async def main():
        pool = PreparePool(threads=1, small_bytes=0, max_pending=2)
        gate = threading.Event()
        running = threading.Event()

        def first():
            running.set()
            return gate.wait(WAIT_S)

        try:
            futs = [asyncio.ensure_future(pool.run(first, 10))]
            await asyncio.to_thread(running.wait, WAIT_S)  # the only thread is busy now
            futs += [asyncio.ensure_future(pool.run(lambda: gate.wait(WAIT_S), 10))
                     for _ in range(2)]  # these two wait: the pool is full
            await asyncio.sleep(0.05)
            with pytest.raises(lc.Overloaded) as info:
                await pool.run(lambda: None, 10)
            assert info.value.retry_after_s >= 1
            gate.set()
            await asyncio.gather(*futs)
        finally:
            gate.set()
            pool.stop()
    asyncio.run(main())


def test_runtime_deadline_covers_slow_preprocessing(tmp_path, monkeypatch):
    # a backend whose prepare is heavy (off the loop) and slow: the request's deadline is
    # answered during preprocessing, not after it, and the runtime keeps serving
    from lumen_core.tasks.onnx import OnnxBackend

    path = M.mlp(tmp_path / "mlp.onnx")
    cfg = {"tasks": [{"name": "mlp", "backend": "onnx", "model": str(path),
                      "batching": {"max_batch_size": 4, "max_queue_delay_us": 0}}]}
    slow = threading.Event()
    real = OnnxBackend.prepare_tensor

    def prepare_tensor(self, req, desc, payload):
        if req.meta.get("x-slow"):
            slow.wait(WAIT_S)
        return real(self, req, desc, payload)

    monkeypatch.setattr(OnnxBackend, "prepare_off_loop", True)
    monkeypatch.setattr(OnnxBackend, "dense_tensor", None)  # no C fast path: prepare_tensor runs
    monkeypatch.setattr(OnnxBackend, "prepare_tensor", prepare_tensor)
    x = np.zeros((1, 16), np.float32)

    async def main():
        async with lc.Runtime.from_dict(cfg) as rt:
            req = (lc.new_infer_request("mlp").for_tensor_array(x, "NC", "none")
                   .with_meta("lumen.timeout_ms", 50).with_meta("x-slow", "1").build())
            with pytest.raises(lc.DeadlineExceeded, match="during preprocessing"):
                await rt.infer(req)
            slow.set()
            ok = await rt.infer(lc.new_infer_request("mlp").for_tensor_array(x, "NC", "none")
                                .with_meta("lumen.timeout_ms", 5000).build())
            return ok

    try:
        assert asyncio.run(main()).outputs["y"].shape == (8,)
    finally:
        slow.set()


def test_stop_answers_inputs_still_waiting():
    async def main():
        pool = PreparePool(threads=1, small_bytes=0)
        gate = threading.Event()
        running = threading.Event()

        def block():
            running.set()
            return gate.wait(WAIT_S)

        busy = asyncio.ensure_future(pool.run(block, 10))
        await asyncio.to_thread(running.wait, WAIT_S)
        waiting = asyncio.ensure_future(pool.run(lambda: "never", 10))
        await asyncio.sleep(0.02)
        stopper = asyncio.ensure_future(asyncio.to_thread(pool.stop))
        with pytest.raises(lc.Unavailable):
            await asyncio.wait_for(waiting, WAIT_S)
        gate.set()
        await stopper
        assert await busy is True

    asyncio.run(main())
