"""What a GIL hand-over costs, and the CPU engine's run against IO binding (issue 24).

Three measurements, each ``--rounds`` times in alternating order, medians with the spread:

* **hand-over**: a thread that only lets the GIL go and takes it back (``time.sleep(0)``), its
  CPU per iteration (``time.thread_time``) alone and beside a main thread running Python;
* **execute**: a worker's whole batch (assemble, run, split: ``BatchRunner.execute`` of the
  null model, 32 items), its thread's CPU per batch alone and beside a busy main thread;
* **run**: one null-model batch of 32 through ``InferenceSession.run`` and through IO binding
  (what ``engine/ort.py`` ran before round 3), wall time per call in one thread.

    python bench/bench_handover.py [--rounds 3] [--seconds 1.0]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import threading
import time

import harness  # noqa: E402  (bench/: quick mode, rounds, the result format)
import numpy as np
from bench_null import (  # the same null model, timed the same way
    BATCH,
    D,
    null_config,
    null_model,
    null_requests,
    wall_us,
)


def thread_cpu_us(fn, seconds: float, busy: bool) -> float:
    """CPU per call of ``fn`` in a second thread, alone or beside a main thread running
    Python for ``seconds``."""
    stop = threading.Event()
    out: dict = {}

    def worker() -> None:
        n, t0 = 0, time.thread_time_ns()
        while not stop.is_set():
            fn()
            n += 1
        out["us"] = (time.thread_time_ns() - t0) / max(n, 1) / 1000

    t = threading.Thread(target=worker)
    t.start()
    t_end = time.perf_counter() + seconds
    if busy:
        x = 0
        while time.perf_counter() < t_end:
            d = {"a": x}
            x += len(d)
    else:
        time.sleep(seconds)
    stop.set()
    t.join()
    return out["us"]


async def null_runner():
    import lumen_core as lc
    from lumen_core import native

    path = null_model()
    reqs = null_requests(BATCH)
    xs = np.concatenate([np.asarray(r.payload) for r in reqs])  # the batch, for the bare runs
    rt = lc.Runtime.from_dict(null_config(path, BATCH))
    await rt.start()
    route = rt.tasks["null"]
    items = []
    for r in reqs:
        payload = memoryview(r.payload)
        desc = native.descriptor.parse_meta(r.meta, payload.nbytes, route.contract)
        items.append(route.prepare(r, desc, payload))
    return rt, route.runners[0], route.instances[0], items, xs, path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=1.0)
    harness.add_quick(ap, seconds=0.3)
    a = harness.parse(ap)
    import onnxruntime as ort

    from lumen_core.engine.session import session_options

    loop = asyncio.new_event_loop()
    rt, runner, engine, items, xs, path = loop.run_until_complete(null_runner())
    sess = ort.InferenceSession(path, session_options(1, False),
                                providers=["CPUExecutionProvider"])
    iname, oname = sess.get_inputs()[0].name, sess.get_outputs()[0].name
    io = sess.io_binding()

    def bound() -> None:
        io.clear_binding_inputs()
        io.clear_binding_outputs()
        io.bind_cpu_input(iname, xs)
        out = np.empty((BATCH, D), np.float32)
        io.bind_output(oname, "cpu", 0, out.dtype, out.shape, out.ctypes.data)
        sess.run_with_iobinding(io)

    def plain() -> None:
        sess.run([oname], {iname: xs})

    def execute() -> None:
        runner.execute(items)

    cases = {
        "hand-over alone (us CPU)": lambda: thread_cpu_us(lambda: time.sleep(0), a.seconds, False),
        "hand-over beside busy main": lambda: thread_cpu_us(lambda: time.sleep(0), a.seconds, True),
        "execute alone (us CPU/batch)": lambda: thread_cpu_us(execute, a.seconds, False),
        "execute beside busy main": lambda: thread_cpu_us(execute, a.seconds, True),
        "run, IO binding (us/call)": lambda: wall_us(bound, 20000),
        "run, session.run (us/call)": lambda: wall_us(plain, 20000),
    }
    got: dict = {k: [] for k in cases}
    for r in range(a.rounds):
        order = list(cases) if r % 2 == 0 else list(reversed(cases))
        for k in order:
            got[k].append(cases[k]())
        print(f"round {r + 1}: " + ", ".join(f"{k.split(' (')[0]} {got[k][-1]:.1f}" for k in cases),
              flush=True)
    loop.run_until_complete(rt.stop())
    load = os.getloadavg()
    print(f"\n{a.rounds} rounds, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
          "median [min-max]")
    for k, v in got.items():
        print(f"  {k:32s} {statistics.median(v):8.2f} [{min(v):.2f}-{max(v):.2f}]")
    ratio = [b / p for b, p in zip(got["run, IO binding (us/call)"],
                                   got["run, session.run (us/call)"], strict=True)]
    print(f"  IO binding / session.run per round: {statistics.median(ratio):.2f} "
          f"[{min(ratio):.2f}-{max(ratio):.2f}]")
    ex = [b / s for b, s in zip(got["execute beside busy main"],
                                got["execute alone (us CPU/batch)"], strict=True)]
    print(f"  execute beside a busy main thread / alone: {statistics.median(ex):.1f}x "
          f"[{min(ex):.1f}-{max(ex):.1f}]")
    figures = {k.split(" (")[0]: harness.stat(v, "us") for k, v in got.items()}
    figures["IO binding / session.run"] = harness.stat(ratio, "x")
    figures["execute beside busy main / alone"] = harness.stat(ex, "x")
    harness.emit(figures, args=a)


if __name__ == "__main__":
    main()
