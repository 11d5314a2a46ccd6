"""Per-request cost of the scheduler itself, in loop-thread CPU microseconds (issue 11).

A tiny model (MLP 8-16-8, a few microseconds per batch) makes the engine nearly free, so what
is left is the Python around it.  The figure is CPU time of the event-loop thread
(``time.thread_time``) per request, which a noisy box disturbs far less than wall time, plus
the stage split of one request measured with a single caller (each stage timed over many
repetitions with ``perf_counter_ns``).

    python bench/bench_scheduler.py [--callers 256] [--requests 40000] [--uvloop]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import onnx_models as M  # noqa: E402

import lumen_core as lc  # noqa: E402
from lumen_core import native  # noqa: E402

D = 8
STAGE_REPS = 20000


def config(path: str, callers: int) -> dict:
    return {"tasks": [{"name": "tiny", "backend": "onnx", "model": path, "intra_op_threads": 1,
                       "batching": {"max_batch_size": 32, "max_queue_delay_us": 0,
                                    "max_queue_size": callers * 4}}]}


async def loop_cpu(rt, reqs: list, callers: int, bulk: bool) -> tuple:
    per = len(reqs) // callers

    async def caller(k: int) -> None:
        mine = reqs[k * per:(k + 1) * per]
        if bulk:
            for i in range(0, len(mine), 32):
                await rt.infer_many(mine[i:i + 32])
        else:
            for r in mine:
                await rt.infer(r)

    c0, t0 = time.thread_time(), time.perf_counter()
    await asyncio.gather(*[caller(k) for k in range(callers)])
    dc, dt = time.thread_time() - c0, time.perf_counter() - t0
    n = per * callers
    return dc / n * 1e6, n / dt


async def stages(rt, req) -> dict:
    """Single-caller split of one request: the stages of ``Runtime.infer``."""
    task = rt.tasks["tiny"]
    backend = task.backend
    clock = time.perf_counter_ns
    out = {}
    payload = memoryview(req.payload)
    t0 = clock()
    for _ in range(STAGE_REPS):
        rt._payload(req.payload, backend)
    out["payload check"] = (clock() - t0) / STAGE_REPS / 1000
    t0 = clock()
    for _ in range(STAGE_REPS):
        desc = native.descriptor.parse_meta(req.meta, payload.nbytes, backend.contract)
    out["parse_meta"] = (clock() - t0) / STAGE_REPS / 1000
    t0 = clock()
    for _ in range(STAGE_REPS):
        task.policy(desc)
    out["policy"] = (clock() - t0) / STAGE_REPS / 1000
    t0 = clock()
    for _ in range(STAGE_REPS):
        prepared = backend.prepare(req, desc, payload)
    out["prepare"] = (clock() - t0) / STAGE_REPS / 1000
    t0 = clock()
    for _ in range(STAGE_REPS):
        lc.InferResponse(req.correlation_id, req.task, {}, None,
                         lc.request.ResponseStats(32, 10, 10, prepared.length))
    out["response"] = (clock() - t0) / STAGE_REPS / 1000
    n = 2000
    t0 = clock()
    for _ in range(n):
        await rt.infer(req)
    out["whole infer, one caller (wall)"] = (clock() - t0) / n / 1000
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--callers", type=int, default=256)
    ap.add_argument("--requests", type=int, default=40960)
    ap.add_argument("--uvloop", action="store_true")
    a = ap.parse_args()
    run = asyncio.run
    if a.uvloop:
        import uvloop

        run = uvloop.run
    with tempfile.TemporaryDirectory() as d:
        path = M.mlp(os.path.join(d, "tiny.onnx"), D, 16, D)
        xs = np.random.default_rng(0).standard_normal((a.requests, D)).astype(np.float32)
        reqs = [lc.new_infer_request("tiny").for_tensor_array(xs[i:i + 1], "NC", "none").build()
                for i in range(len(xs))]

        async def go():
            async with lc.Runtime.from_dict(config(path, a.callers)) as rt:
                await loop_cpu(rt, reqs[:4096], a.callers, False)  # warm
                single = await loop_cpu(rt, reqs, a.callers, False)
                bulk = await loop_cpu(rt, reqs, a.callers // 8 or 1, True)
                st = await stages(rt, reqs[0])
            return single, bulk, st

        single, bulk, st = run(go())
    print(f"extensions {native.using_extensions()}, loop {'uvloop' if a.uvloop else 'asyncio'}, "
          f"load average {os.getloadavg()[0]:.2f}")
    print(f"infer, {a.callers} callers: {single[0]:.2f} us loop CPU per request, "
          f"{single[1]:,.0f} req/s")
    print(f"infer_many (groups of 32): {bulk[0]:.2f} us loop CPU per request, {bulk[1]:,.0f} req/s")
    for k, v in st.items():
        print(f"  {k:32s} {v:7.2f} us")


if __name__ == "__main__":
    main()
