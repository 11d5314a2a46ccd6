"""What versions cost a request (issue 14): loop-thread CPU per request of a one-version task
against a two-version task (90/10 split drawn at random, sticky by ``lumen.route.key``, pinned
by ``lumen.model.version``), measured in the same run, interleaved, ``--rounds`` times; plus
the version choice alone (``Router.__call__``) per meta variant.

    python bench/bench_versions.py [--callers 256] [--requests 20480] [--rounds 3]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time

import harness  # noqa: E402  (bench/: quick mode, rounds, the result format)
import numpy as np

import lumen_core as lc  # noqa: E402
from lumen_core import native  # noqa: E402
from lumen_core import toy_graphs as M  # noqa: E402

D = 8
ROUTER_REPS = 200_000
VARIANTS = {"two, split": {}, "two, route key": {"lumen.route.key": "user-42"},
            "two, pinned": {"lumen.model.version": "2"}}


async def loop_cpu(rt, reqs: list, callers: int, bulk: bool) -> tuple:
    """(loop-thread CPU us per request, requests/s) of ``callers`` concurrent callers over
    ``reqs``, each awaiting ``rt.infer`` (or ``rt.infer_many`` of 32 with ``bulk``)."""
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


def config(path: str, callers: int) -> dict:
    batching = {"max_batch_size": 32, "max_queue_delay_us": 0, "max_queue_size": callers * 4}
    common = {"backend": "onnx", "intra_op_threads": 1, "batching": batching}
    return {"tasks": [
        {"name": "one", "model": path, **common},
        {"name": "two", **common, "versions": [{"version": "1", "model": path},
                                               {"version": "2", "model": path}],
         "traffic": {"1": 90, "2": 10}}]}


def requests(task: str, xs: np.ndarray, meta: dict) -> list:
    out = []
    for i in range(len(xs)):
        b = lc.new_infer_request(task).for_tensor_array(xs[i:i + 1], "NC", "none")
        for k, v in meta.items():
            b.with_meta(k, v)
        out.append(b.build())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--callers", type=int, default=256)
    ap.add_argument("--requests", type=int, default=20480)
    ap.add_argument("--rounds", type=int, default=3)
    harness.add_quick(ap, requests=4096, callers=64)
    a = harness.parse(ap)
    with tempfile.TemporaryDirectory() as d:
        path = M.mlp(os.path.join(d, "tiny.onnx"), D, 16, D)
        xs = np.random.default_rng(0).standard_normal((a.requests, D)).astype(np.float32)
        sets = {"one": requests("one", xs, {})}
        sets.update({name: requests("two", xs, meta) for name, meta in VARIANTS.items()})

        async def go():
            rows: dict = {k: [] for k in sets}
            async with lc.Runtime.from_dict(config(path, a.callers)) as rt:
                for reqs in sets.values():
                    await loop_cpu(rt, reqs[:2048], a.callers, False)  # warm
                for _ in range(a.rounds):
                    for name, reqs in sets.items():
                        rows[name].append((await loop_cpu(rt, reqs, a.callers, False))[0])
                router = rt.tasks["two"].router
                pick = {}
                for name, meta in VARIANTS.items():
                    t0 = time.perf_counter_ns()
                    for _ in range(ROUTER_REPS):
                        router(meta)
                    pick[name] = (time.perf_counter_ns() - t0) / ROUTER_REPS / 1000
            return rows, pick

        rows, pick = asyncio.run(go())
    print(f"extensions {native.using_extensions()}, {a.callers} callers, {a.requests} requests "
          f"x {a.rounds} rounds, load average {os.getloadavg()[0]:.2f}")
    figures = {}
    for name, us in rows.items():
        ratios = [u / o for u, o in zip(us, rows["one"], strict=True)]
        print(f"  {name:16s} loop CPU/request {min(us):6.2f}..{max(us):6.2f} us   "
              f"vs one version {min(ratios):.3f}..{max(ratios):.3f}")
        figures[f"{name}: loop CPU per request"] = harness.stat(us, "us")
        if name != "one":
            figures[f"{name} / one version"] = harness.stat(ratios, "x")
    for name, us in pick.items():
        print(f"  version choice alone, {name:16s} {us:.3f} us")
        figures[f"version choice alone, {name}"] = harness.value(us, "us")
    harness.emit(figures, args=a)


if __name__ == "__main__":
    main()
