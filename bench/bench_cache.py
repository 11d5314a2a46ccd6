"""Response cache on vs off in one run: the seeded corpus with 50% repeats, in process.

One runtime serves ``text_embed`` twice: ``embed_nocache`` (the default task's table) and
``embed_cache`` (the same plus ``[tasks.cache] max_bytes = 64 MiB``).  The request stream is
N distinct texts of the seeded length-mixed corpus, each sent twice, shuffled with a fixed
seed, so half the requests repeat an earlier one (a repeat may arrive while its first copy
still runs: then it coalesces).  Each round runs both tasks back to back (order alternating)
with 64 concurrent ``Runtime.infer`` callers; the cache task starts each round empty (its
entries are cleared).  Prints texts/s per task, the ratio, and the cache's hit / coalesced /
miss counts, with the load average (the box is shared with other work).

Run: ``python bench/bench_cache.py [--rounds 3] [--distinct 256]``.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import random
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness  # noqa: E402
from corpus import make_corpus  # noqa: E402

from lumen_core import loadgen  # noqa: E402
from lumen_core.runtime import Runtime  # noqa: E402
from lumen_core.tasks.text_embedding import default_task_table  # noqa: E402

CONCURRENCY = 64
CACHE_BYTES = 64 << 20
SEED = 16


def stream(distinct: int) -> list:
    texts = make_corpus()[:distinct]
    reqs = texts + texts
    random.Random(SEED).shuffle(reqs)
    return reqs


async def run(args) -> None:
    base = default_task_table()
    if base is None:
        harness.skip("text_embed is not prepared: run `lumen models prepare` (or set LUMEN_HOME)")
    tasks = [{**base, "name": "embed_nocache"},
             {**base, "name": "embed_cache", "cache": {"max_bytes": CACHE_BYTES}}]
    texts = stream(args.distinct)
    rt = Runtime.from_dict({"tasks": tasks})
    ratios = []
    async with rt:
        for r in range(args.rounds):
            order = ("embed_nocache", "embed_cache") if r % 2 == 0 else ("embed_cache", "embed_nocache")
            got = {}
            for task in order:
                if task == "embed_cache":
                    rt._caches[task].clear()
                    before = dict(rt.cache_stats()[task])
                # one pass over the stream: count = len(texts), each text in order
                res = await loadgen.bench_runtime(rt, texts, CONCURRENCY, len(texts), task=task)
                got[task] = res.rps
                if task == "embed_cache":
                    st = rt.cache_stats()[task]
                    counts = {k: st[k] - before[k] for k in ("hits", "coalesced", "misses")}
            ratio = got["embed_cache"] / got["embed_nocache"]
            ratios.append((got["embed_nocache"], got["embed_cache"], ratio))
            print(f"round {r + 1}: off {got['embed_nocache']:8.1f} texts/s  on "
                  f"{got['embed_cache']:8.1f} texts/s  ratio {ratio:.2f}  {counts}", flush=True)
    print(f"load average after: {os.getloadavg()}")
    rs = [x[2] for x in ratios]
    print(f"{len(texts)} requests ({args.distinct} distinct, 50% repeats), {CONCURRENCY} callers: "
          f"off median {statistics.median(x[0] for x in ratios):.1f} texts/s, on median "
          f"{statistics.median(x[1] for x in ratios):.1f}, ratio median {statistics.median(rs):.2f} "
          f"(min {min(rs):.2f}, max {max(rs):.2f})")
    harness.emit({"cache off": harness.stat([x[0] for x in ratios], "texts/s"),
                  "cache on": harness.stat([x[1] for x in ratios], "texts/s"),
                  "on / off": harness.stat(rs, "x")}, args=args)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--distinct", type=int, default=256)
    ap.add_argument("--home", default=None)
    harness.add_quick(ap, distinct=96)
    args = harness.parse(ap)
    if args.home:
        os.environ["LUMEN_HOME"] = args.home
    print(f"load average before: {os.getloadavg()}")
    asyncio.run(run(args))


if __name__ == "__main__":
    main()
