"""The runtime's own CPU per request, on a null model (issue 24).

A null model (a 16x16 MatMul, one instance with one intra-op thread, batches of 32) costs ORT
next to nothing, so whatever CPU a request costs is the runtime's: on a GPU this is the figure
that bounds throughput (the model's work leaves the CPU, the runtime's does not).  Three paths,
each with ``CALLERS`` in-process callers over the same pre-built requests:

* **floor**: plain asyncio, each caller awaiting one future per request, a server task
  resolving them 32 at a time (what any awaitable API costs at least);
* **infer**: ``await rt.infer(req)``;
* **infer_many**: ``await rt.infer_many(32 requests)``.

The figure is the *process's* CPU time (every thread: event loop, engine worker, ORT's) per
request, which a noisy box disturbs far less than wall time.  Each round runs the compiled
twins and the pure-Python ones (``LUMEN_NO_EXTENSIONS=1``) in child processes, one after the
other, so the rounds interleave; every figure is the median over rounds with its spread.

    python bench/bench_null.py [--rounds 3] [--requests 65536] [--callers 256] [--uvloop]
    python bench/bench_null.py --stages           # the per-stage split of one request
    python bench/bench_null.py --child            # one round of the running implementation
    python bench/bench_null.py --baseline DIR     # A/B: this tree against another, interleaved

It uses only the public API (``Runtime.infer`` / ``infer_many``), so the same script measures
an older tree in the same session: ``PYTHONPATH=<old checkout, extensions built in place>
python bench/bench_null.py``.  Where the CPU goes: ``py-spy record --threads -r 500 -f raw
-o out.txt -- python bench/bench_null.py --child`` (``--native`` with ``LUMEN_DEBUG_BUILD=1
python setup.py build_ext --inplace`` shows the compiled frames), or ``perf record -e
cpu-clock`` on a build with symbols.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

import harness  # noqa: E402  (bench/, beside this script)

D = 16
BATCH = 32
PATHS = ("floor", "infer", "infer_many")


def null_model() -> str:
    """The null model's file (a DxD MatMul, made in a fresh temporary directory)."""
    from lumen_core import toy_graphs as M

    return M.matmul(os.path.join(tempfile.mkdtemp(), "null.onnx"), D)


def null_requests(n: int) -> list:
    """``n`` tensor requests of one row each for the null model (seeded)."""
    import lumen_core as lc

    xs = np.random.default_rng(0).standard_normal((n, D)).astype(np.float32)
    return [lc.new_infer_request("null").for_tensor_array(xs[i:i + 1], "NC", "none").build()
            for i in range(n)]


def null_config(path: str, max_queue_size: int) -> dict:
    """The runtime config every null-model benchmark runs: one instance of one ORT thread,
    batches of ``BATCH`` formed at once (no queue delay)."""
    return {"tasks": [{"name": "null", "backend": "onnx", "model": path, "instances": 1,
                       "intra_op_threads": 1,
                       "batching": {"max_batch_size": BATCH, "max_queue_delay_us": 0,
                                    "max_queue_size": max_queue_size}}]}


async def _timed(coro_fn, n: int) -> dict:
    c0, t0 = time.process_time(), time.perf_counter()
    await coro_fn()
    dc, dt = time.process_time() - c0, time.perf_counter() - t0
    return {"cpu_us": dc / n * 1e6, "items_s": n / dt}


async def floor(n: int, callers: int) -> dict:
    """Plain asyncio: ``callers`` coroutines each awaiting one future per request; a server
    task resolves the waiting futures ``BATCH`` at a time (one wake-up per batch)."""
    loop = asyncio.get_running_loop()
    waiting: list = []
    wake = asyncio.Event()
    per = n // callers
    done = [0]

    async def caller() -> None:
        for _ in range(per):
            f = loop.create_future()
            waiting.append(f)
            if len(waiting) >= BATCH:
                wake.set()
            await f
        done[0] += 1
        wake.set()

    async def server() -> None:
        while done[0] < callers:
            await wake.wait()
            wake.clear()
            while len(waiting) >= BATCH or (waiting and done[0] + len(waiting) >= callers):
                batch = waiting[:BATCH]
                del waiting[:BATCH]
                for f in batch:
                    f.set_result(None)
                await asyncio.sleep(0)

    async def go() -> None:
        srv = asyncio.ensure_future(server())
        await asyncio.gather(*[caller() for _ in range(callers)])
        wake.set()
        await srv

    return await _timed(go, per * callers)


def drive(rt, reqs: list, path: str, callers: int) -> tuple:
    """``(send, items)``: the coroutine function that sends ``reqs`` through ``rt`` one way,
    and how many items it sends.  ``infer``: ``callers`` coroutines, each awaiting one request
    at a time; ``infer_many``: as many items in flight, ``callers / BATCH`` coroutines each
    awaiting groups of ``BATCH``."""
    if path == "infer":
        per = len(reqs) // callers

        async def one(k: int) -> None:
            for r in reqs[k * per:(k + 1) * per]:
                await rt.infer(r)

        n, caller = callers, one
    else:
        n = callers // BATCH or 1
        per = len(reqs) // n

        async def many(k: int) -> None:
            mine = reqs[k * per:(k + 1) * per]
            for i in range(0, len(mine), BATCH):
                await rt.infer_many(mine[i:i + BATCH])

        caller = many

    async def send() -> None:
        await asyncio.gather(*[caller(k) for k in range(n)])

    return send, per * n


def ran_on(rt) -> str:
    """Where the null task's batches ran at the end (loop execution), or "" (a tree without)."""
    on = rt.load()["null"].get("cost", {}).get("loop_execution")
    return "" if on is None else ("loop" if on else "worker")


async def runtime_paths(path: str, reqs: list, callers: int) -> dict:
    import lumen_core as lc

    cfg = null_config(path, callers * BATCH * 2)
    out = {}
    async with lc.Runtime.from_dict(cfg) as rt:
        single, n_single = drive(rt, reqs, "infer", callers)
        bulk, n_bulk = drive(rt, reqs, "infer_many", callers)
        await _timed(single, len(reqs))  # warm-up: lazy imports, arena, ORT's first runs
        out["infer"] = await _timed(single, n_single)
        out["infer"]["ran"] = ran_on(rt)
        out["infer_many"] = await _timed(bulk, n_bulk)
        out["infer_many"]["ran"] = ran_on(rt)
    return out


def _ran(res: dict) -> str:
    return f" on the {res['ran']}" if res.get("ran") else ""


def child(a: argparse.Namespace) -> dict:
    from lumen_core import native

    # the parent builds the model with its own tree, so an older tree (--baseline) needs none
    path = a.model or null_model()
    reqs = null_requests(a.requests)
    run = asyncio.run
    if a.uvloop:
        import uvloop

        run = uvloop.run
    res = {"floor": run(floor(a.requests, a.callers))}
    res.update(run(runtime_paths(path, reqs, a.callers)))
    res["compiled"] = all(native.using_extensions().values())
    return res


STAGE_REPS = 50_000


def wall_us(fn, n: int = STAGE_REPS) -> float:
    """Microseconds of one call of ``fn``: the best of 3 x ``n`` calls, wall time."""
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter_ns() - t0) / n / 1000)
    return best


async def stages(path: str) -> dict:
    """Single-caller split of one request (microseconds each, best of 3 x STAGE_REPS)."""
    import lumen_core as lc
    from lumen_core import native

    req = null_requests(1)[0]
    loop = asyncio.get_running_loop()
    out: dict = {}

    def timed(name: str, fn) -> None:
        out[name] = wall_us(fn)

    async with lc.Runtime.from_dict(null_config(path, 1024)) as rt:
        route = rt.tasks["null"]
        payload = memoryview(req.payload)
        desc = native.descriptor.parse_meta(req.meta, payload.nbytes, route.contract)
        item = route.prepare(req, desc, payload)
        rows = native.entries.Rows({"y": np.zeros((BATCH, D), np.float32)}, BATCH)
        timed("empty call (the loop's own cost)", lambda: None)
        timed("payload memoryview", lambda: memoryview(req.payload))
        timed("parse_meta", lambda: native.descriptor.parse_meta(req.meta, payload.nbytes,
                                                                 route.contract))
        timed("prepare (dense tensor, C)", lambda: route.prepare(req, desc, payload))
        timed("queue entry + future", lambda: native.entries.Entry(
            item, asyncio.Future(loop=loop), 1, 0))
        timed("response", lambda: native.messages.respond(req, rows, 3, BATCH, 0, 0, 0, "1"))
        n = 5000
        t0 = time.perf_counter_ns()
        for _ in range(n):
            await rt.infer(req)
        out["whole infer, one caller (wall)"] = (time.perf_counter_ns() - t0) / n / 1000
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=65536)
    ap.add_argument("--callers", type=int, default=256)
    ap.add_argument("--uvloop", action="store_true")
    ap.add_argument("--impls", default="c,py", help="which twins: c, py or both")
    ap.add_argument("--stages", action="store_true", help="the per-stage split of one request")
    ap.add_argument("--baseline", default=None,
                    help="another checkout (its extensions built in place): compiled twins of "
                         "both trees in alternating order each round, and the ratio per round")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    harness.add_quick(ap, rounds=3, requests=8192, callers=64)
    a = harness.parse(ap)
    if a.baseline:
        ab(a)
        return
    if a.child:
        print(json.dumps(child(a)))
        return
    if a.stages:
        from lumen_core import native
        from lumen_core import toy_graphs as M

        path = M.matmul(os.path.join(tempfile.mkdtemp(), "null.onnx"), D)
        print(f"extensions {native.using_extensions()}")
        for k, v in asyncio.run(stages(path)).items():
            print(f"  {k:34s} {v:7.3f} us")
        return
    impls = a.impls.split(",")
    model = null_model()
    runs: dict = {impl: [] for impl in impls}
    for r in range(a.rounds):
        for impl in impls:
            env = dict(os.environ)
            env.pop("LUMEN_NO_EXTENSIONS", None)
            if impl == "py":
                env["LUMEN_NO_EXTENSIONS"] = "1"
            cmd = [sys.executable, __file__, "--child", "--requests", str(a.requests),
                   "--callers", str(a.callers), "--model", model] + (["--uvloop"] if a.uvloop else [])
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            res = json.loads(out.stdout.strip().splitlines()[-1])
            if impl == "c" and not res["compiled"]:
                raise SystemExit("the compiled extensions are not built: pip install .")
            runs[impl].append(res)
            print(f"round {r + 1} {impl:2s}: " + ", ".join(
                f"{p} {res[p]['cpu_us']:.2f} us ({res[p]['items_s'] / 1000:.1f}k/s"
                f"{_ran(res[p])})" for p in PATHS), flush=True)
    load = os.getloadavg()
    print(f"\nnull model (16x16 MatMul, 1 instance x 1 thread, batches of {BATCH}), "
          f"{a.callers} callers, {a.requests} requests, "
          f"{'uvloop' if a.uvloop else 'asyncio'}, {a.rounds} rounds; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print("process CPU per request, median [min-max] over rounds; items/s median")
    figures: dict = {}
    for impl in impls:
        for p in PATHS:
            cpu = [x[p]["cpu_us"] for x in runs[impl]]
            ips = [x[p]["items_s"] for x in runs[impl]]
            ratio = [x[p]["cpu_us"] / x["floor"]["cpu_us"] for x in runs[impl]]
            print(f"  {impl:2s} {p:10s} {statistics.median(cpu):6.2f} us "
                  f"[{min(cpu):.2f}-{max(cpu):.2f}]  {statistics.median(ips) / 1000:7.1f}k/s  "
                  f"x floor {statistics.median(ratio):.2f} [{min(ratio):.2f}-{max(ratio):.2f}]")
            figures[f"{impl} {p} CPU per request"] = harness.stat(cpu, "us")
            if p != "floor":
                figures[f"{impl} {p} / floor"] = harness.stat(ratio, "x")
    harness.emit(figures, args=a)


def ab(a: argparse.Namespace) -> None:
    """This tree against ``a.baseline``, the compiled twins of both, in alternating order each
    round (the machine drifts between rounds; within one the ratio holds better)."""
    here = os.path.abspath(os.path.join(HERE, ".."))
    trees = {"this": here, "baseline": os.path.abspath(a.baseline)}
    model = null_model()
    runs: dict = {k: [] for k in trees}
    for r in range(a.rounds):
        order = list(trees) if r % 2 == 0 else list(reversed(trees))
        for name in order:
            env = dict(os.environ, PYTHONPATH=trees[name])
            env.pop("LUMEN_NO_EXTENSIONS", None)
            cmd = [sys.executable, __file__, "--child", "--requests", str(a.requests),
                   "--callers", str(a.callers), "--model", model] + (["--uvloop"] if a.uvloop else [])
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            res = json.loads(out.stdout.strip().splitlines()[-1])
            if not res["compiled"]:
                raise SystemExit(f"{trees[name]}: extensions not built in place")
            runs[name].append(res)
            print(f"round {r + 1} {name:8s}: " + ", ".join(
                f"{p} {res[p]['cpu_us']:.2f} us{_ran(res[p])}" for p in PATHS), flush=True)
    load = os.getloadavg()
    print(f"\nthis tree against {trees['baseline']}, {a.rounds} interleaved rounds, "
          f"{a.requests} requests, {a.callers} callers; load average {load[0]:.2f} "
          f"{load[1]:.2f} {load[2]:.2f}")
    for p in PATHS:
        mine = [x[p]["cpu_us"] for x in runs["this"]]
        base = [x[p]["cpu_us"] for x in runs["baseline"]]
        ratio = [m / b for m, b in zip(mine, base, strict=True)]
        print(f"  {p:10s} this {statistics.median(mine):6.2f} us [{min(mine):.2f}-{max(mine):.2f}]"
              f"  baseline {statistics.median(base):6.2f} us [{min(base):.2f}-{max(base):.2f}]"
              f"  this/baseline per round {statistics.median(ratio):.2f} "
              f"[{min(ratio):.2f}-{max(ratio):.2f}]")


if __name__ == "__main__":
    main()
