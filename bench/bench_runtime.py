"""In-process runtime efficiency (issue 3, 11): 256 concurrent callers vs the ideal offline loop.

The ideal loop feeds ORT perfectly batched inputs (pre-stacked batches of ``max_batch_size``)
with the same session settings.  It is measured in every engine layout the runtime can use on
this box: one session with 1 or 2 intra-op threads, and two 1-thread sessions driven by two
threads at once (the offline twin of ``instances = 2``); the **best** of them is the ideal.
The runtime runs in each layout too (``instances x intra_op_threads``), under asyncio and
uvloop.  Everything is measured in this one process, round after round, each round's ratios
against that round's best ideal, so a ratio compares runs a few seconds apart; the spread
over rounds is printed at the end.  ``1/ours - 1/ideal`` is the per-request overhead.

    python bench/bench_runtime.py [--rounds 3] [--callers 256] [--requests 20480]
        [--layouts 1x2,2x1] [--no-uvloop]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import threading
import time

import harness  # noqa: E402  (bench/: quick mode, rounds, the result format)
import numpy as np

import lumen_core as lc  # noqa: E402
from lumen_core import native  # noqa: E402
from lumen_core import toy_graphs as M  # noqa: E402
from lumen_core.engine.session import cpu_session  # noqa: E402

D_IN, D_HIDDEN, D_OUT = 768, 1536, 384  # ~0.1 ms per single call on this machine class
#: offline layouts (sessions x intra-op threads) the ideal is the best of
IDEAL_LAYOUTS = ((1, 1), (1, 2), (2, 1))


def ideal(path: str, xs: np.ndarray, batch: int, sessions: int, threads: int) -> float:
    """items/s of the offline loop: ``sessions`` sessions of ``threads`` intra-op threads, each
    driven by its own Python thread over its share of the pre-stacked batches."""
    sess = [cpu_session(path, threads) for _ in range(sessions)]
    batches = [np.ascontiguousarray(xs[i:i + batch]) for i in range(0, len(xs), batch)]
    for s in sess:
        for b in batches[:5]:
            s.run(["y"], {"x": b})

    def work(k: int) -> None:
        run = sess[k].run
        for b in batches[k::sessions]:
            run(["y"], {"x": b})

    t0 = time.perf_counter()
    if sessions == 1:
        work(0)
    else:
        threads_ = [threading.Thread(target=work, args=(k,)) for k in range(sessions)]
        for t in threads_:
            t.start()
        for t in threads_:
            t.join()
    return len(xs) / (time.perf_counter() - t0)


def single_call_us(path: str, xs: np.ndarray, threads: int) -> float:
    sess = cpu_session(path, threads)
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
        task.batcher.queue.on_batch = lambda n, us: busy_us.append(us)
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

        p0 = time.process_time()  # every thread of the process: loop, workers, ORT's pool
        c0 = time.thread_time()
        t0 = time.perf_counter()
        await asyncio.gather(*[caller(k) for k in range(callers)])
        dt = time.perf_counter() - t0
        loop_cpu = time.thread_time() - c0
        worker_cpu = time.process_time() - p0 - loop_cpu
    diag = {"busy": sum(busy_us) / 1e6 / dt / instances, "run_us": float(np.mean(runs_ns)) / 1000,
            "loop_cpu_us": loop_cpu / (per * callers) * 1e6, "mean_batch": float(np.mean(sizes)),
            "worker_cpu_us": worker_cpu / (per * callers) * 1e6,
            "idle": max(0.0, 1 - (loop_cpu + worker_cpu) / (dt * (os.cpu_count() or 1)))}
    return per * callers / dt, diag


def spread(values: list) -> str:
    return (f"median {statistics.median(values):.3f} (min {min(values):.3f}, "
            f"max {max(values):.3f})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--callers", type=int, default=256)
    ap.add_argument("--requests", type=int, default=20480)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layouts", default="1x2,2x1",
                    help="runtime layouts instances x intra-op threads, comma-separated")
    ap.add_argument("--no-uvloop", action="store_true")
    harness.add_quick(ap, requests=4096, callers=64, layouts="1x2")
    a = harness.parse(ap)
    layouts = [tuple(int(v) for v in s.split("x")) for s in a.layouts.split(",")]
    runners = [("asyncio", asyncio.run)]
    if not a.no_uvloop:
        try:
            import uvloop
            runners.append(("uvloop", uvloop.run))
        except ImportError:
            pass
    ratios: dict = {}
    with tempfile.TemporaryDirectory() as d:
        path = M.mlp(os.path.join(d, "mlp.onnx"), D_IN, D_HIDDEN, D_OUT)
        xs = np.random.default_rng(0).standard_normal((a.requests, D_IN)).astype(np.float32)
        print(f"model: MLP {D_IN}-{D_HIDDEN}-{D_OUT} fp32, single call "
              f"{single_call_us(path, xs, 1):.0f} us (1 thread); {a.callers} callers, batches of "
              f"{a.batch}; spinning off; extensions {native.using_extensions()}")
        for rnd in range(1, a.rounds + 1):
            ideals = {lay: ideal(path, xs, a.batch, *lay) for lay in IDEAL_LAYOUTS}
            got = {}
            for inst, th in layouts:
                for name, run in runners:
                    got[(inst, th, name)] = run(ours(path, xs, a.callers, a.batch, th, inst))
            # the ideal again after ours, so a drift of the box during the round shows
            for lay in IDEAL_LAYOUTS:
                ideals[lay] = max(ideals[lay], ideal(path, xs, a.batch, *lay))
            best_lay = max(ideals, key=ideals.get)
            best = ideals[best_lay]
            one = max(ideals[(1, 1)], ideals[(1, 2)])  # the single-session ideal loop
            print(f"round {rnd}: ideal items/s " + ", ".join(
                f"{s}x{t} {v:,.0f}" for (s, t), v in ideals.items())
                + f"; best {best_lay[0]}x{best_lay[1]}; load average {os.getloadavg()[0]:.2f}")
            for (inst, th, name), (rate, diag) in got.items():
                r, r1 = rate / best, rate / one
                # the same layout's offline run time per batch (each session runs 1/inst)
                same = (f"{a.batch * inst / ideals[(inst, th)] * 1e6:.0f}"
                        if (inst, th) in ideals else "not measured")
                ratios.setdefault((inst, th, name), []).append(r)
                ratios.setdefault((inst, th, name, "one"), []).append(r1)
                print(f"  runtime {inst}x{th} {name:7s} {rate:9,.0f} items/s  ratio {r:.3f} "
                      f"(vs the single-session ideal {r1:.3f})  overhead "
                      f"{(1 / rate - 1 / best) * 1e6:5.1f} us/request; worker busy "
                      f"{diag['busy']:.0%}, model run {diag['run_us']:.0f} us per batch (ideal "
                      f"{same}), "
                      f"CPU per request: loop {diag['loop_cpu_us']:.1f} us, workers and ORT "
                      f"{diag['worker_cpu_us']:.1f} us (the same layout offline: "
                      f"{inst * th * 1e6 / ideals[(inst, th)] if (inst, th) in ideals else float('nan'):.1f} core-us); "
                      f"cores not used by this process {diag['idle']:.0%}; mean batch {diag['mean_batch']:.1f}")
    print(f"over {a.rounds} rounds, ours / best ideal:")
    figures = {}
    for key, vals in ratios.items():
        if len(key) == 3:
            inst, th, name = key
            print(f"  {inst}x{th} {name:7s} {spread(vals)}; vs the single-session ideal "
                  f"{spread(ratios[key + ('one',)])}")
            figures[f"runtime {inst}x{th} {name} / best ideal"] = harness.stat(vals, "x")
            figures[f"runtime {inst}x{th} {name} / single-session ideal"] = harness.stat(
                ratios[key + ("one",)], "x")
    harness.emit(figures, args=a)


if __name__ == "__main__":
    main()
