"""What a request costs when no thread hands a batch to another: a bound, not a product mode.

Issue 24's ``infer_many`` target (<= 3 us of CPU per item on the null model) asks for a cost
below what the runtime's two threads pay to hand a batch over (bench_handover.py).  This
measures how far the hand-over is from the whole story, in one process, alternating:

* ``thread``: the runtime as it ships (``bench_null.py``'s ``infer_many``: 8 callers x groups
  of 32, the 16x16 MatMul, one instance, batches of 32): the event loop admits, the engine
  worker thread forms, runs and splits each batch.
* ``inline``: the same runtime, except that each batch is formed and run on the event loop's
  own thread, as soon as the loop is free (no worker thread, no hand-over, no GIL traffic).
  This is an experiment: it blocks the loop for every model run, so it is only a bound on
  what the runtime's own Python work costs per item, whatever design carries it.  It reaches
  into the batcher's formation (``_form``, ``idle``) to do so; nothing in ``lumen_core`` uses it.

Per round: process CPU per item and each thread's share (``/proc/self/task/*/stat``, 10 ms
ticks) and voluntary context switches per batch.  ``python bench/bench_bound.py --rounds 3``.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

from bench_null import BATCH, null_config, null_model, null_requests  # the same null model

#: in-process callers, each sending groups of BATCH (bench_null.py's infer_many)
GROUPS = 8


def _inline() -> None:
    """Replace the dynamic batcher's worker threads by formation and execution on the loop."""
    from lumen_core.batching import dynamic
    from lumen_core.batching.runner import CompletionQueue, run_split

    class LoopWorker:
        def __init__(self, runner, batcher):
            self.runner, self.b, self.loop, self.scheduled = runner, batcher, None, False

        # the batcher wakes an idle worker by releasing its "lock": here, a loop callback
        def release(self) -> None:
            if not self.scheduled:
                self.scheduled = True
                self.loop.call_soon(self.step)

        def start(self) -> None:
            self.loop = self.b.loop
            with self.b.lock:
                self.b.idle.append(self)

        def join(self, timeout=None) -> None:
            pass

        def step(self) -> None:
            self.scheduled = False
            b = self.b
            with b.lock:
                batch = b._form(time.monotonic_ns())[0] if b.pending else None
                if batch is None:
                    b.idle.append(self)
                    return
            t0 = time.perf_counter_ns()
            results = run_split(self.runner.execute, batch.items)
            us = (time.perf_counter_ns() - t0) // 1000
            with b.lock:
                b.learn(len(batch.entries), batch.extra or 0, us)
            b.deliver_batch(batch.entries, results, us)
            self.release()  # the next batch after the loop's other callbacks

    def init_workers(self, name, runners):
        self._runners = list(runners)
        self.cost_workers = max(1, len(self._runners))
        self.completions = CompletionQueue(self.deliver_batch)
        self.workers = [LoopWorker(r, self) for r in self._runners]

    dynamic.DynamicBatcher._init_workers = init_workers


def _threads() -> dict:
    out = {}
    for t in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{t}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/self/task/{t}/status") as f:
            vcs = next(int(ln.split()[1]) for ln in f if ln.startswith("voluntary_ctxt"))
        name = "loop" if int(t) == os.getpid() else f"thread {t}"  # the loop: the main thread
        out[t] = (name, int(fields[11]) + int(fields[12]), vcs)
    return out


def child(mode: str, n: int) -> dict:
    import lumen_core as lc

    if mode == "inline":
        _inline()
    reqs = null_requests(n)
    cfg = null_config(null_model(), n)
    per = n // GROUPS

    async def main() -> dict:
        async with lc.Runtime.from_dict(cfg) as rt:
            async def caller(k: int) -> None:
                mine = reqs[k * per:(k + 1) * per]
                for i in range(0, len(mine), BATCH):
                    await rt.infer_many(mine[i:i + BATCH])

            await asyncio.gather(*[caller(k) for k in range(GROUPS)])  # warm-up
            a, c0 = _threads(), time.process_time()
            await asyncio.gather(*[caller(k) for k in range(GROUPS)])
            c1, b = time.process_time(), _threads()
        items = per * GROUPS
        split = {}
        for t, (name, ticks, vcs) in b.items():
            if t in a and ticks > a[t][1]:
                split[name] = {"cpu_us": (ticks - a[t][1]) * 1e4 / items,
                               "switches_per_batch": (vcs - a[t][2]) / (items / BATCH)}
        return {"cpu_us": (c1 - c0) / items * 1e6, "threads": split}

    return asyncio.run(main())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=32768)
    ap.add_argument("--child", choices=("thread", "inline"))
    a = ap.parse_args()
    if a.child:
        import json

        print(json.dumps(child(a.child, a.requests)))
        return
    import json

    runs: dict = {"thread": [], "inline": []}
    for r in range(a.rounds):
        order = ("thread", "inline") if r % 2 == 0 else ("inline", "thread")
        for mode in order:
            out = subprocess.run([sys.executable, __file__, "--child", mode, "--requests",
                                  str(a.requests)], capture_output=True, text=True, check=True)
            res = json.loads(out.stdout.strip().splitlines()[-1])
            runs[mode].append(res)
            threads = ", ".join(f"{k} {v['cpu_us']:.2f} us ({v['switches_per_batch']:.2f} "
                                f"switches/batch)" for k, v in res["threads"].items())
            print(f"round {r + 1} {mode:6s}: {res['cpu_us']:.2f} us/item; {threads}", flush=True)
    print(f"\ninfer_many, null model, {a.requests} requests, {a.rounds} rounds; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for mode, rs in runs.items():
        v = [x["cpu_us"] for x in rs]
        print(f"  {mode:6s} {statistics.median(v):.2f} us per item [{min(v):.2f}-{max(v):.2f}]")
    ratio = [i["cpu_us"] / t["cpu_us"] for i, t in zip(runs["inline"], runs["thread"],
                                                        strict=True)]
    print(f"  inline / thread per round: median {statistics.median(ratio):.2f} "
          f"[{min(ratio):.2f}-{max(ratio):.2f}]")


if __name__ == "__main__":
    main()
