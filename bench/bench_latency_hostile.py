"""Issue 38 rows 2 and 3 in process, on ``text_embed`` (the prepared MiniLM) with a target.

    LUMEN_HOME=... PYTHONPATH=$PWD python bench/bench_latency_hostile.py recovery|group

``recovery`` (row 2, ``latency_target_ms = 100``): 16 callers send long texts for
``--contention-s`` while two busy processes take the cores; then, on the idle server, one lone
long text every 0.25 s for 3 s: which were refused (429) and when the first was admitted.

``group`` (row 3, ``latency_target_ms = 200``): after the cost is learnt on short texts, one
``infer_many`` of 40 max-length texts, and six short requests from another caller sent
50-300 ms after it: whether the group was admitted, and the short requests' latencies.

Run it on two checkouts (before and after) to compare; the box is shared: it prints the load.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time

import harness  # noqa: E402  (bench/: quick mode, rounds, the result format)

LONG = " ".join(["word"] * 240)  # about 242 tokens
SHORT = "a short text"


def table(target_ms: int) -> dict:
    from lumen_core.tasks import default_task_table

    t = default_task_table("text_embed")
    t.setdefault("batching", {})["latency_target_ms"] = target_ms
    return {"tasks": [t]}


async def recovery(contention_s: float) -> dict:
    import lumen_core as lc
    from lumen_core.errors import Overloaded

    async with lc.Runtime.from_dict(table(100)) as rt:
        for _ in range(20):  # learn the cost (some may be refused on a busy box)
            await asyncio.gather(*[rt.infer(rt.text_request("text_embed", LONG))
                                   for _ in range(4)], return_exceptions=True)
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
        refused = ok = 0
        stop = time.monotonic() + contention_s

        async def client():
            nonlocal refused, ok
            while time.monotonic() < stop:
                try:
                    await rt.infer(rt.text_request("text_embed", LONG))
                    ok += 1
                except Overloaded:
                    refused += 1
                    await asyncio.sleep(0.01)

        try:
            await asyncio.gather(*[client() for _ in range(16)])
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        cost = rt.load()["text_embed"]["cost"]
        print(f"contention: {ok} answered, {refused} refused; budget "
              f"{cost['latency_budget_ms']:.0f} ms of 100")
        t0 = time.monotonic()
        outcome = []
        while time.monotonic() - t0 < 3.0:
            s = time.monotonic()
            try:
                await rt.infer(rt.text_request("text_embed", LONG))
                outcome.append((s - t0, "ok", (time.monotonic() - s) * 1000))
            except Overloaded:
                outcome.append((s - t0, "429", 0.0))
            await asyncio.sleep(0.25)
        first = next((t for t, o, _ in outcome if o == "ok"), None)
        print("idle: " + ", ".join(f"{t:.2f}s {o}" + (f" {ms:.0f}ms" if o == "ok" else "")
                                   for t, o, ms in outcome))
        print(f"refused {sum(o == '429' for _, o, _ in outcome)} of {len(outcome)}; first "
              f"admitted at {'never' if first is None else f'{first:.2f} s'} after the contention")
    return {"recovery: refused when idle": harness.value(
                sum(o == "429" for _, o, _ in outcome), "requests"),
            "recovery: first admitted after contention": harness.value(
                -1.0 if first is None else first, "s (-1: never)")}


async def group() -> dict:
    import lumen_core as lc
    from lumen_core.errors import Overloaded

    async with lc.Runtime.from_dict(table(200)) as rt:
        for _ in range(40):
            await asyncio.gather(*[rt.infer(rt.text_request("text_embed", SHORT))
                                   for _ in range(8)])
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        big = asyncio.ensure_future(rt.infer_many([rt.text_request("text_embed", LONG)
                                                   for _ in range(40)]))

        async def short(delay):
            await asyncio.sleep(delay)
            s = time.monotonic()
            try:
                await rt.infer(rt.text_request("text_embed", SHORT))
                return f"{(time.monotonic() - s) * 1000:.0f}ms"
            except Overloaded:
                return "429"

        shorts = await asyncio.gather(*[short(d) for d in (0.05, 0.1, 0.15, 0.2, 0.25, 0.3)])
        try:
            res = await big
            verdict = ("admitted" if not any(isinstance(r, Exception) for r in res)
                       else f"items refused: {sum(isinstance(r, Exception) for r in res)}")
        except Overloaded:
            verdict = "refused (429)"
        took_ms = (time.monotonic() - t0) * 1000
        print(f"group of 40 long texts: {verdict}, {took_ms:.0f} ms; "
              f"short requests after it: {', '.join(shorts)}")
    return {"group: admitted": harness.value(float(verdict == "admitted"), "bool"),
            "group: took": harness.value(took_ms, "ms"),
            "group: short requests refused": harness.value(shorts.count("429"), "requests")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("scenario", nargs="?", choices=("recovery", "group"),
                    help="one scenario (default: both)")
    ap.add_argument("--contention-s", type=float, default=4.0)
    harness.add_quick(ap, contention_s=2.0)
    args = harness.parse(ap)
    from lumen_core.tasks import default_task_table

    if default_task_table("text_embed") is None:
        harness.skip("text_embed is not prepared: run `lumen models prepare` (or set LUMEN_HOME)")
    print(f"load average: {os.getloadavg()}")
    figures: dict = {}
    if args.scenario in (None, "recovery"):
        figures.update(asyncio.run(recovery(args.contention_s)))
    if args.scenario in (None, "group"):
        figures.update(asyncio.run(group()))
    harness.emit(figures, args=args)


if __name__ == "__main__":
    main()
