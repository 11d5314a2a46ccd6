"""Loop execution against the engine worker: what handing each batch to a thread costs.

``[tasks.batching] loop_execution_us`` (default 100) lets a dynamic batcher whose batches are
cheaper than a hand-over run them on the event loop (``batching/dynamic.py``, ``LoopTurn``).
This measures the two ways on the null model (``bench_null.py``'s: the 16x16 MatMul, one
instance of one ORT thread, batches of 32), one process per run, alternating:

* ``worker``: ``loop_execution_us = 0``: the event loop admits, the engine worker thread
  forms, runs and splits each batch and hands it back (the GIL changes hands every batch);
* ``loop``: the default: once the cost is learnt, the loop forms, runs and answers each batch
  itself and the worker thread is parked.

Both entry points, driven as ``bench_null.py`` drives them: ``infer`` (256 callers, one request
each at a time) and ``infer_many`` (8 callers x groups of 32).  Per run: process CPU per item, each thread's share
(``/proc/self/task/*/stat``, 10 ms ticks) and voluntary context switches per batch.  The
ratio loop / worker is taken per round (the box drifts between rounds, not within one).
``python bench/bench_loop.py --rounds 3``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

import harness  # noqa: E402  (bench/: quick mode, rounds, the result format)
from bench_null import (  # the same null model, driven the same way
    BATCH,
    drive,
    null_config,
    null_model,
    null_requests,
    ran_on,
)

#: in-process callers (bench_null's): 256 awaiting one request each, or 8 awaiting groups of 32
CALLERS = 256
MODES = ("worker", "loop")
PATHS = ("infer", "infer_many")


def _threads() -> dict:
    out = {}
    for t in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{t}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/self/task/{t}/status") as f:
            vcs = next(int(ln.split()[1]) for ln in f if ln.startswith("voluntary_ctxt"))
        name = "loop" if int(t) == os.getpid() else "other"  # the loop: the main thread
        out[t] = (name, int(fields[11]) + int(fields[12]), vcs)
    return out


def child(mode: str, path: str, n: int) -> dict:
    import lumen_core as lc

    reqs = null_requests(n)
    cfg = null_config(null_model(), n)
    if mode == "worker":
        cfg["tasks"][0]["batching"]["loop_execution_us"] = 0

    async def main() -> dict:
        async with lc.Runtime.from_dict(cfg) as rt:
            send, items = drive(rt, reqs, path, CALLERS)
            await send()  # warm-up: the cost learnt, the batches where they will stay
            a, c0 = _threads(), time.process_time()
            await send()
            c1, b = time.process_time(), _threads()
            on_loop = ran_on(rt) == "loop"
        split: dict = {}
        for t, (name, ticks, vcs) in b.items():
            if t in a:
                s = split.setdefault(name, {"cpu_us": 0.0, "switches_per_batch": 0.0})
                s["cpu_us"] += (ticks - a[t][1]) * 1e4 / items
                s["switches_per_batch"] += (vcs - a[t][2]) / (items / BATCH)
        return {"cpu_us": (c1 - c0) / items * 1e6, "threads": split, "on_loop": on_loop}

    return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32768)
    ap.add_argument("--child", nargs=2, metavar=("MODE", "PATH"))
    harness.add_quick(ap, requests=8192)
    a = harness.parse(ap)
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], a.requests)))
        return
    runs: dict = {(m, p): [] for m in MODES for p in PATHS}
    for r in range(a.rounds):
        for path in PATHS:
            order = MODES if r % 2 == 0 else MODES[::-1]
            for mode in order:
                out = subprocess.run([sys.executable, __file__, "--child", mode, path,
                                      "--requests", str(a.requests)],
                                     capture_output=True, text=True, check=True)
                res = json.loads(out.stdout.strip().splitlines()[-1])
                runs[(mode, path)].append(res)
                threads = ", ".join(f"{k} {v['cpu_us']:.2f} us ({v['switches_per_batch']:.2f} "
                                    f"switches/batch)" for k, v in res["threads"].items())
                print(f"round {r + 1} {path:10s} {mode:6s}: {res['cpu_us']:.2f} us/item "
                      f"(on the loop at the end: {res['on_loop']}); {threads}", flush=True)
    print(f"\nnull model, {a.requests} requests, {a.rounds} rounds; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    figures: dict = {}
    for path in PATHS:
        for mode in MODES:
            v = [x["cpu_us"] for x in runs[(mode, path)]]
            print(f"  {path:10s} {mode:6s} {statistics.median(v):.2f} us per item "
                  f"[{min(v):.2f}-{max(v):.2f}]")
        ratio = [lp["cpu_us"] / w["cpu_us"] for lp, w in
                 zip(runs[("loop", path)], runs[("worker", path)], strict=True)]
        print(f"  {path:10s} loop / worker per round: median {statistics.median(ratio):.2f} "
              f"[{min(ratio):.2f}-{max(ratio):.2f}]")
        for mode in MODES:
            figures[f"{path} {mode} CPU per item"] = harness.stat(
                [x["cpu_us"] for x in runs[(mode, path)]], "us")
        figures[f"{path} loop / worker"] = harness.stat(ratio, "x")
    harness.emit(figures, args=a)


if __name__ == "__main__":
    main()
