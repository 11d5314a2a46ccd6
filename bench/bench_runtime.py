"""In-process runtime efficiency (issue 3): 256 concurrent callers vs the ideal offline loop.

The ideal loop feeds ORT perfectly batched inputs (pre-stacked batches of ``max_batch_size``)
with the same session settings; the ratio ours / ideal is the runtime's efficiency, and
``1/ours - 1/ideal`` is the per-request overhead it adds.  Both run in this one process, one
after the other, so the ratio is measured under the same machine conditions.

    python bench/bench_runtime.py [--callers 256] [--requests 20000] [--threads 2]
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
from lumen_core.engine.session import session_options  # noqa: E402

D_IN, D_HIDDEN, D_OUT = 768, 1536, 384  # ~0.1 ms per single call on this machine class


def ideal(path: str, xs: np.ndarray, batch: int, threads: int) -> float:
    import onnxruntime as ort

    sess = ort.InferenceSession(path, session_options(threads, False),
                                providers=["CPUExecutionProvider"])
    batches = [np.ascontiguousarray(xs[i:i + batch]) for i in range(0, len(xs), batch)]
    for b in batches[:5]:
        sess.run(["y"], {"x": b})
    t0 = time.perf_counter()
    for b in batches:
        sess.run(["y"], {"x": b})
    return len(xs) / (time.perf_counter() - t0)


def single_call_us(path: str, xs: np.ndarray, threads: int) -> float:
    import onnxruntime as ort

    sess = ort.InferenceSession(path, session_options(threads, False),
                                providers=["CPUExecutionProvider"])
    n = 2000
    for i in range(50):
        sess.run(["y"], {"x": xs[i:i + 1]})
    t0 = time.perf_counter()
    for i in range(n):
        sess.run(["y"], {"x": xs[i:i + 1]})
    return (time.perf_counter() - t0) / n * 1e6


async def ours(path: str, xs: np.ndarray, callers: int, batch: int, threads: int,
               instances: int = 1) -> tuple:
    cfg = {"tasks": [{"name": "mlp", "backend": "onnx", "model": path, "intra_op_threads": threads,
                      "instances": instances,
                      "batching": {"max_batch_size": batch, "max_queue_delay_us": 0,
                                   "max_queue_size": callers * 2}}]}
    reqs = [lc.new_infer_request("mlp").for_tensor_array(xs[i:i + 1], "NC", "none").build()
            for i in range(len(xs))]
    async with lc.Runtime.from_dict(cfg) as rt:
        for r in reqs[:batch * 4]:
            await rt.infer(r)
        per = len(reqs) // callers
        sizes: list = []
        task = rt.tasks["mlp"]
        busy_us: list = []  # the workers' time per batch (assemble + run + postprocess)
        task.batcher.on_batch = lambda n, us: busy_us.append(us)
        runs_ns: list = []  # the model run alone, inside the runtime
        for engine in task.instances:
            def timed(feeds, n, _run=engine.run):
                t = time.perf_counter_ns()
                out = _run(feeds, n)
                runs_ns.append(time.perf_counter_ns() - t)
                return out
            engine.run = timed

        async def caller(k: int) -> None:
            for r in reqs[k * per:(k + 1) * per]:
                resp = await rt.infer(r)
                sizes.append(resp.stats.batch_size)

        c0 = time.thread_time()
        t0 = time.perf_counter()
        await asyncio.gather(*[caller(k) for k in range(callers)])
        dt = time.perf_counter() - t0
        loop_cpu = time.thread_time() - c0
    diag = {"busy": sum(busy_us) / 1e6 / dt / instances, "run_us": float(np.mean(runs_ns)) / 1000,
            "loop_cpu_us": loop_cpu / (per * callers) * 1e6}
    return per * callers / dt, float(np.mean(sizes)), diag


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--callers", type=int, default=256)
    ap.add_argument("--requests", type=int, default=20480)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = M.mlp(os.path.join(d, "mlp.onnx"), D_IN, D_HIDDEN, D_OUT)
        xs = np.random.default_rng(0).standard_normal((a.requests, D_IN)).astype(np.float32)
        single = single_call_us(path, xs, a.threads)
        best_ideal = ideal(path, xs, a.batch, a.threads)
        got, mean_batch, diag = asyncio.run(ours(path, xs, a.callers, a.batch, a.threads))
        ideal_run_us = a.batch / best_ideal * 1e6
        got_uv = None
        try:
            import uvloop
        except ImportError:
            uvloop = None
        if uvloop is not None:
            got_uv, mean_uv, _ = uvloop.run(ours(path, xs, a.callers, a.batch, a.threads))
        best_ideal = max(best_ideal, ideal(path, xs, a.batch, a.threads))
    print(f"model: MLP {D_IN}-{D_HIDDEN}-{D_OUT} fp32, single call {single:.0f} us, "
          f"ORT intra-op threads {a.threads}, spinning off; extensions {native.using_extensions()}")
    print(f"ideal offline loop (batches of {a.batch}): {best_ideal:,.0f} items/s (best of 2)")
    print(f"runtime, {a.callers} concurrent callers:  {got:,.0f} items/s, mean batch {mean_batch:.1f}")
    print(f"ratio runtime / ideal: {got / best_ideal:.3f}")
    if got_uv is not None:
        print(f"runtime under uvloop:  {got_uv:,.0f} items/s, mean batch {mean_uv:.1f}, "
              f"ratio {got_uv / best_ideal:.3f}, overhead {(1 / got_uv - 1 / best_ideal) * 1e6:.1f} us")
    print(f"per-request overhead: {(1 / got - 1 / best_ideal) * 1e6:.1f} us")
    print(f"where it goes: worker busy {diag['busy']:.0%} of the wall time; model run inside the "
          f"runtime {diag['run_us']:.0f} us per batch vs {ideal_run_us:.0f} us in the ideal loop; "
          f"event loop CPU {diag['loop_cpu_us']:.1f} us per request; load average "
          f"{os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
