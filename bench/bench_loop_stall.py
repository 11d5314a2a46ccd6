"""Issue 38 row 1: how long one client's long rows stall the event loop under loop execution.

An ``onnx`` task over a one-layer attention encoder (x ``[N, L, 32]``, ``L`` symbolic, cost
~L^2), one instance and ``loop_execution_us`` as given (the default 100): rounds of 64 short
rows (L = 4) move its batches onto the event loop; then ``--long-requests`` concurrent rows of
``--long`` arrive.  A ticker on the loop (1 ms sleeps) records the longest gap between its
ticks while they run: the stall every other connection (``/healthz``, gRPC, other tasks) sees.

    PYTHONPATH=$PWD python bench/bench_loop_stall.py [--long 2048] [--rounds 3]

Run it on two checkouts (before and after a change) and compare; it prints the load average,
since the box is shared.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time

import harness  # noqa: E402  (bench/: quick mode, rounds, the result format)


async def one_round(path: str, long_len: int, n_long: int, threshold_us: int) -> tuple:
    import numpy as np

    import lumen_core as lc

    conf = {"tasks": [{"name": "att", "backend": "onnx", "model": path, "instances": 1,
                       "intra_op_threads": 1, "options": {"layout": "NLC"},
                       "batching": {"max_batch_size": 8, "max_queue_delay_us": 0,
                                    "loop_execution_us": threshold_us}}]}
    rng = np.random.default_rng(1)
    short = rng.standard_normal((64, 1, 4, 32)).astype(np.float32)
    longs = rng.standard_normal((n_long, 1, long_len, 32)).astype(np.float32)

    def req(x):
        return lc.new_infer_request("att").for_tensor_array(x, layout="NLC",
                                                            preprocess_id="none").build()

    async with lc.Runtime.from_dict(conf) as rt:
        for _ in range(40):
            await asyncio.gather(*[rt.infer(req(x)) for x in short])
        cost = rt.load()["att"]["cost"]
        on_loop = cost["loop_execution"]
        if os.environ.get("BENCH_DEBUG"):
            print(cost)
        gaps = [0.0]
        done = False

        async def ticker():
            last = time.perf_counter()
            while not done:
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.ensure_future(ticker())
        await asyncio.sleep(0.01)
        t0 = time.perf_counter()
        await asyncio.gather(*[rt.infer(req(x)) for x in longs])
        took = time.perf_counter() - t0
        done = True
        await tick
    return on_loop, max(gaps) * 1000, took * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--long", type=int, default=2048, help="L of the long rows")
    ap.add_argument("--long-requests", type=int, default=4)
    ap.add_argument("--threshold-us", type=int, default=100, help="loop_execution_us")
    ap.add_argument("--rounds", type=int, default=3)
    harness.add_quick(ap, long=1024)
    args = harness.parse(ap)
    from lumen_core import toy_graphs as M

    print(f"load average: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        path = M.attention(os.path.join(tmp, "att.onnx"))
        stalls, tooks = [], []
        for r in range(args.rounds):
            on_loop, stall, took = asyncio.run(one_round(path, args.long, args.long_requests,
                                                         args.threshold_us))
            stalls.append(stall)
            tooks.append(took)
            print(f"round {r}: loop execution before the long rows: {on_loop}; longest loop "
                  f"stall {stall:.1f} ms; the {args.long_requests} long rows took {took:.0f} ms")
    print(f"stall ms: median {statistics.median(stalls):.1f} (min {min(stalls):.1f}, "
          f"max {max(stalls):.1f}); long rows ms: median {statistics.median(tooks):.0f}")
    harness.emit({"longest loop stall": harness.stat(stalls, "ms"),
                  "long rows took": harness.stat(tooks, "ms")}, args=args)


if __name__ == "__main__":
    main()
