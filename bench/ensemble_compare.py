"""The interleaved comparison bench_ocr.py and bench_faces.py share: a package's own
sequential loop against one or more Lumen setups of the same task, run after run in one
process, each run's ratios printed, then per setup the median and spread (wall and per
CPU-second) and where its steps spent their time."""
from __future__ import annotations

import os
import statistics
from typing import Awaitable, Callable


async def compare(rt, setups: dict, reference: Callable[[], tuple],
                  lumen: Callable[[str], Awaitable[tuple]], runs: int, ref_name: str) -> None:
    """``setups``: name -> task table (its ``name`` is the task to call); ``reference()`` and
    ``await lumen(task)`` each return (images/s, CPU seconds per image)."""
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
    for n, t in setups.items():
        for what, rs in (("wall", ratios[n]), ("per CPU-second", cpu_ratios[n])):
            print(f"{n}: ratio ({what}) median {statistics.median(rs):.2f}x, "
                  f"min {min(rs):.2f}x, max {max(rs):.2f}x over {runs} runs")
        for step, st in rt.load()[t["name"]]["steps"].items():
            print(f"  step {step}: {st['items']} items in {st['batches']} batches "
                  f"(mean {st['mean_batch_size']:.1f}, max {st['max_batch_size']}), "
                  f"compute {st['compute_us'] / 1e6:.1f} s, queue {st['queue_us'] / 1e6:.1f} s")
