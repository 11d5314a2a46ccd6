"""text_embed_int8 vs text_embed (fp32) in one run: in-process texts/s and HTTP c=64 req/s.

Both tasks are the default runtime's (``lumen models prepare`` builds both models; 2 engine
instances each, threads = cores // instances), served by one runtime, one LumenServer on a
background event-loop thread, loaded by ``lumen_core.loadgen`` (the closed loop of
``lumen bench``) with the seeded length-mixed corpus.  Each round measures fp32 and int8
back to back (the order alternates between rounds), in process (64 concurrent
``Runtime.infer`` callers) and over HTTP (64 keep-alive connections to ``/v1/embeddings``, one
text per request); the table prints every round's ratio int8 / fp32 and their spread, with
the load average before and after (the box is shared: neighbours' load moves absolute
figures, the in-round ratio much less; texts per CPU-second of the process, server and
client together, moves least).

Run: ``python bench/bench_int8.py [--rounds 3] [--count 384]`` (``--home`` or ``$LUMEN_HOME``
picks the models dir).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import statistics
import sys
import threading
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from corpus import make_corpus  # noqa: E402

from lumen_core import loadgen  # noqa: E402
from lumen_core.runtime import Runtime  # noqa: E402
from lumen_core.serve.server import LumenServer  # noqa: E402
from lumen_core.tasks.text_embedding import INT8_TASK_NAME, TASK_NAME  # noqa: E402

CONCURRENCY = 64
TARGET = 1.5


class Served:
    """The default runtime behind a LumenServer on its own loop thread."""

    def __init__(self) -> None:
        self.runtime = Runtime.default()
        if INT8_TASK_NAME not in [t.name for t in self.runtime.config.tasks]:
            sys.exit(f"{INT8_TASK_NAME} is not prepared: run `lumen models prepare`")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.server = LumenServer(self.runtime, host="127.0.0.1", http_port=0, grpc_port=None)
        self.call(self.server.start())
        self.url = f"http://127.0.0.1:{self.server.http_port}"

    def call(self, coro, timeout: float = 600.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        async def shutdown() -> None:
            await self.server.shutdown()

        self.call(shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--count", type=int, default=384, help="texts / requests per measurement")
    ap.add_argument("--home", default=None)
    args = ap.parse_args()
    if args.home:
        os.environ["LUMEN_HOME"] = args.home
    texts = make_corpus()
    print(f"load average before: {os.getloadavg()}")
    srv = Served()
    rows = {"in-process texts/s": [], "in-process texts/CPU-s": [], "HTTP c=64 req/s": []}
    try:
        for r in range(args.rounds):
            order = (TASK_NAME, INT8_TASK_NAME) if r % 2 == 0 else (INT8_TASK_NAME, TASK_NAME)
            got: dict = {}
            for task in order:
                cpu0 = time.process_time()
                res = srv.call(loadgen.bench_runtime(srv.runtime, texts, CONCURRENCY, args.count,
                                                     task=task, warmup=CONCURRENCY))
                got[("in-process texts/s", task)] = res.rps
                # warm-up included on both sides: texts per CPU-second of the whole process
                got[("in-process texts/CPU-s", task)] = \
                    (args.count + CONCURRENCY) / (time.process_time() - cpu0)
            for task in order:
                res = asyncio.run(loadgen.bench_http(srv.url, texts, CONCURRENCY, args.count,
                                                     model=task, warmup=CONCURRENCY))
                if res.errors:
                    sys.exit(f"{task}: {res.errors} errors over HTTP: {res.first_error}")
                got[("HTTP c=64 req/s", task)] = res.rps
            for what in rows:
                fp32, int8 = got[(what, TASK_NAME)], got[(what, INT8_TASK_NAME)]
                rows[what].append((fp32, int8, int8 / fp32))
                print(f"round {r + 1} {what:<20} fp32 {fp32:8.1f}  int8 {int8:8.1f}  "
                      f"ratio {int8 / fp32:.2f}", flush=True)
    finally:
        srv.stop()
    print(f"load average after: {os.getloadavg()}")
    print(f"\n{'measure':<20} {'fp32 median':>12} {'int8 median':>12} {'ratio median':>13} "
          f"{'ratio min-max':>14}  target {TARGET}x")
    for what, rs in rows.items():
        ratios = [x[2] for x in rs]
        print(f"{what:<20} {statistics.median(x[0] for x in rs):12.1f} "
              f"{statistics.median(x[1] for x in rs):12.1f} {statistics.median(ratios):13.2f} "
              f"{min(ratios):6.2f}-{max(ratios):.2f}")


if __name__ == "__main__":
    main()
