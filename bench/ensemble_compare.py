"""The interleaved comparison bench_ocr.py and bench_faces.py share: a package's own
sequential loop against one or more Lumen setups of the same task, run after run in one
process, each run's ratios printed, then per setup the median and spread (wall and per
CPU-second) and where its steps spent their time."""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Awaitable, Callable

import harness

MIME = {"png": "image/png", "jpg": "image/jpeg", "webp": "image/webp"}


def common_args(doc: str, rounds: int) -> argparse.ArgumentParser:
    """The options both benches take (``--setups`` is each one's own)."""
    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=rounds, help="passes over the images per run")
    ap.add_argument("--callers", type=int, default=8)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads per instance")
    return ap


async def lumen_run(rt, images: list, rounds: int, callers: int, task: str) -> tuple:
    """(images/s, CPU seconds of this process per image) of ``callers`` concurrent asyncio
    callers of ``rt.infer``, each taking the next of ``rounds`` passes over ``images``
    (``(file name, encoded bytes)``)."""
    import lumen_core as lc

    work = [(name, data) for _ in range(rounds) for name, data in images]
    it = iter(work)

    async def caller() -> None:
        for name, data in it:
            req = lc.new_infer_request(task).for_raw_input(data, MIME[name.rsplit(".", 1)[1]])
            await rt.infer(req.build())

    t0, c0 = time.perf_counter(), time.process_time()
    await asyncio.gather(*[caller() for _ in range(callers)])
    return len(work) / (time.perf_counter() - t0), (time.process_time() - c0) / len(work)


async def compare(rt, setups: dict, reference: Callable[[], tuple],
                  lumen: Callable[[str], Awaitable[tuple]], runs: int, ref_name: str) -> dict:
    """``setups``: name -> task table (its ``name`` is the task to call); ``reference()`` and
    ``await lumen(task)`` each return (images/s, CPU seconds per image).  Returns the per-run
    ratios as harness figures."""
    ratios: dict = {n: [] for n in setups}
    cpu_ratios: dict = {n: [] for n in setups}
    for run in range(runs):
        ref, ref_cpu = reference()
        line = [f"run {run + 1}: {ref_name} {ref:.2f} img/s ({ref_cpu:.3f} CPU-s/img)"]
        for n, t in setups.items():
            ours, our_cpu = await lumen(t["name"])
            ratios[n].append(ours / ref)
            cpu_ratios[n].append(ref_cpu / our_cpu)
            line.append(f"{n}: {ours:.2f} img/s ({our_cpu:.3f} CPU-s/img) "
                        f"{ours / ref:.2f}x wall, {ref_cpu / our_cpu:.2f}x per CPU-s")
        print("; ".join(line) + f" (load {os.getloadavg()[0]:.2f})", flush=True)
    figures = {}
    for n, t in setups.items():
        for what, rs in (("wall", ratios[n]), ("per CPU-second", cpu_ratios[n])):
            print(f"{n}: ratio ({what}) median {statistics.median(rs):.2f}x, "
                  f"min {min(rs):.2f}x, max {max(rs):.2f}x over {runs} runs")
            figures[f"{n} / {ref_name} ({what})"] = harness.stat(rs, "x")
        for step, st in rt.load()[t["name"]]["steps"].items():
            print(f"  step {step}: {st['items']} items in {st['batches']} batches "
                  f"(mean {st['mean_batch_size']:.1f}, max {st['max_batch_size']}), "
                  f"compute {st['compute_us'] / 1e6:.1f} s, queue {st['queue_us'] / 1e6:.1f} s")
    return figures
