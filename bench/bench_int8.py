"""text_embed_int8 vs text_embed (fp32): accuracy over the whole corpus, CPU time per text in
process, and served throughput (in process and HTTP c=64), in one script.

Three parts, each on the prepared models (``lumen models prepare``; ``--home`` or
``$LUMEN_HOME`` picks the models dir), over the seeded length-mixed corpus of ``lumen bench``
(2,000 texts of 5-200 words):

``--accuracy``
    every corpus text through both prepared graphs (ORT sessions, one thread), **batched**
    (corpus order, 32 per batch: mixed lengths, padded) and **alone**; the cosine of each
    int8 vector to its fp32 one: min, p1, mean, how many are below 0.99, the worst texts,
    and the largest difference between a text's int8 vector alone and batched.  About a
    minute per model.

``--offline``
    CPU time per text (``time.process_time``, one intra-op thread, so the process's CPU time
    is the session's work) of fp32 and int8 on the same ``--count`` corpus texts in sorted
    batches of 32; ``--rounds`` interleaved rounds in one process (the order alternates), the
    ratio int8 / fp32 texts per CPU-second per round, its median and spread.  CPU time within
    one process is what a shared box disturbs least.

``--served`` (the default when no part is named)
    both tasks in the default runtime (2 engine instances each) behind one LumenServer on a
    background event-loop thread, loaded by ``lumen_core.loadgen`` (the closed loop of
    ``lumen bench``); each round measures fp32 and int8 back to back (the order alternates),
    in process (64 concurrent ``Runtime.infer`` callers; texts/s and texts per CPU-second of
    the process) and over HTTP (64 keep-alive connections to ``/v1/embeddings``, one text per
    request).  The load average before and after is printed: wall-clock figures move with
    neighbours, the in-round ratios much less.

Run: ``python bench/bench_int8.py --accuracy --offline --served [--rounds 3] [--count 384]``.
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

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness  # noqa: E402  (bench/: quick mode, rounds, the result format)
from corpus import make_corpus  # noqa: E402

from lumen_core import loadgen, models  # noqa: E402
from lumen_core.engine.session import cpu_session  # noqa: E402
from lumen_core.models import minilm  # noqa: E402
from lumen_core.runtime import Runtime  # noqa: E402
from lumen_core.serve.server import LumenServer  # noqa: E402
from lumen_core.tasks.text_embedding import INT8_TASK_NAME, TASK_NAME  # noqa: E402

CONCURRENCY = 64
#: the issue's aims: int8 per CPU-second vs fp32, and every text this close to fp32
TARGET = 1.5
MIN_COSINE = 0.99
#: texts per batch in the accuracy and offline parts
BATCH = 32
#: worst texts listed by the accuracy part
WORST = 5


# ---------------------------------------------------------------------------------------------
# offline: accuracy and CPU time


class Prepared:
    """Both prepared graphs as single-thread ORT sessions, and the tokenizer."""

    def __init__(self) -> None:
        self.sessions = {}
        for name in (models.MINILM, models.MINILM_INT8):
            directory = models.require_model(name)
            self.sessions[name] = cpu_session(directory / models.MODEL_FILE, intra_op_threads=1)
        self.tokenizer = minilm.load_tokenizer(directory / minilm.TOKENIZER_FILE)
        self.manifest = models.read_manifest(models.require_model(models.MINILM_INT8)) or {}

    def ids(self, texts: list) -> list:
        return [enc.ids for enc in self.tokenizer.encode_batch(texts)]

    def run(self, name: str, ids: list) -> np.ndarray:
        """The L2-normalised embeddings of one padded batch of token ids."""
        input_ids, mask = minilm.pad_batch(ids)
        return self.sessions[name].run([minilm.OUTPUT], {minilm.INPUT_IDS: input_ids,
                                                         minilm.ATTENTION_MASK: mask})[0]


def accuracy(prep: Prepared, texts: list) -> None:
    ids = prep.ids(texts)
    print(f"int8 model: revision {prep.manifest.get('revision')}, graph "
          f"{prep.manifest.get('graph')}; {len(texts)} texts, {BATCH} per batch")
    got = {}
    for name in (models.MINILM, models.MINILM_INT8):
        t0 = time.perf_counter()
        got[(name, "batched")] = np.concatenate(
            [prep.run(name, ids[i:i + BATCH]) for i in range(0, len(ids), BATCH)])
        got[(name, "alone")] = np.concatenate([prep.run(name, [x]) for x in ids])
        print(f"  {name}: {time.perf_counter() - t0:.1f} s", flush=True)
    words = np.array([len(t.split()) for t in texts])
    print(f"\n{'int8 vs fp32':<14} {'min':>8} {'p1':>8} {'mean':>8} {'< ' + str(MIN_COSINE):>7}"
          f"  worst (cosine, words)")
    for how in ("batched", "alone"):
        cos = (got[(models.MINILM, how)] * got[(models.MINILM_INT8, how)]).sum(axis=1)
        worst = np.argsort(cos)[:WORST]
        print(f"{how:<14} {cos.min():8.5f} {np.percentile(cos, 1):8.5f} {cos.mean():8.5f} "
              f"{int((cos < MIN_COSINE).sum()):7d}  "
              + ", ".join(f"{cos[i]:.4f} ({words[i]})" for i in worst))
        long = words >= 150
        print(f"{'  150+ words':<14} {cos[long].min():8.5f} {np.percentile(cos[long], 1):8.5f} "
              f"{cos[long].mean():8.5f} {int((cos[long] < MIN_COSINE).sum()):7d}  "
              f"({int(long.sum())} texts)")
    gap = float(np.abs(got[(models.MINILM_INT8, "alone")]
                       - got[(models.MINILM_INT8, "batched")]).max())
    print(f"int8 alone vs batched: max |difference| {gap:.2e}")


def offline_speed(prep: Prepared, texts: list, count: int, rounds: int) -> dict:
    rng = np.random.default_rng(0)
    chosen = [texts[i] for i in sorted(rng.choice(len(texts), count, replace=False))]
    ids = sorted(prep.ids(chosen), key=len)
    batches = [ids[i:i + BATCH] for i in range(0, len(ids), BATCH)]
    names = [models.MINILM, models.MINILM_INT8]
    for name in names:  # warm-up: first-run allocations outside the rounds
        prep.run(name, batches[0])
    per: dict = {name: [] for name in names}
    print(f"load average before: {os.getloadavg()}")
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            cpu0 = time.process_time()
            for batch in batches:
                prep.run(name, batch)
            per[name].append(count / (time.process_time() - cpu0))
        ratio = per[models.MINILM_INT8][-1] / per[models.MINILM][-1]
        print(f"round {r + 1}: fp32 {per[models.MINILM][-1]:6.1f}  int8 "
              f"{per[models.MINILM_INT8][-1]:6.1f} texts/CPU-s  ratio {ratio:.2f}", flush=True)
    print(f"load average after: {os.getloadavg()}")
    ratios = [i / f for f, i in zip(per[models.MINILM], per[models.MINILM_INT8], strict=True)]
    print(f"\noffline, 1 thread, {count} texts in sorted batches of {BATCH}: fp32 median "
          f"{statistics.median(per[models.MINILM]):.1f}, int8 median "
          f"{statistics.median(per[models.MINILM_INT8]):.1f} texts/CPU-s; ratio median "
          f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}) over "
          f"{rounds} rounds, target {TARGET}x")
    return {"offline fp32": harness.stat(per[models.MINILM], "texts/CPU-s"),
            "offline int8": harness.stat(per[models.MINILM_INT8], "texts/CPU-s"),
            "offline int8 / fp32": harness.stat(ratios, "x")}


# ---------------------------------------------------------------------------------------------
# served


class Served:
    """The default runtime behind a LumenServer on its own loop thread."""

    def __init__(self) -> None:
        self.runtime = Runtime.default()
        if INT8_TASK_NAME not in [t.name for t in self.runtime.config.tasks]:
            harness.skip(f"{INT8_TASK_NAME} is not prepared: run `lumen models prepare` "
                         "(or set LUMEN_HOME)")
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


def served(texts: list, count: int, rounds: int) -> dict:
    print(f"load average before: {os.getloadavg()}")
    srv = Served()
    rows = {"in-process texts/s": [], "in-process texts/CPU-s": [], "HTTP c=64 req/s": []}
    try:
        for r in range(rounds):
            order = (TASK_NAME, INT8_TASK_NAME) if r % 2 == 0 else (INT8_TASK_NAME, TASK_NAME)
            got: dict = {}
            for task in order:
                cpu0 = time.process_time()
                res = srv.call(loadgen.bench_runtime(srv.runtime, texts, CONCURRENCY, count,
                                                     task=task, warmup=CONCURRENCY))
                got[("in-process texts/s", task)] = res.rps
                # warm-up included on both sides: texts per CPU-second of the whole process
                got[("in-process texts/CPU-s", task)] = \
                    (count + CONCURRENCY) / (time.process_time() - cpu0)
            for task in order:
                res = asyncio.run(loadgen.bench_http(srv.url, texts, CONCURRENCY, count,
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
    figures = {}
    for what, rs in rows.items():
        figures[f"{what} fp32"] = harness.stat([x[0] for x in rs], what.split()[-1])
        figures[f"{what} int8"] = harness.stat([x[1] for x in rs], what.split()[-1])
        figures[f"{what} int8 / fp32"] = harness.stat([x[2] for x in rs], "x")
    return figures


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--accuracy", action="store_true", help="cosines over the whole corpus")
    ap.add_argument("--offline", action="store_true", help="CPU time per text, one thread")
    ap.add_argument("--served", action="store_true",
                    help="in process and HTTP c=64 (the default when no part is named)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--count", type=int, default=384, help="texts / requests per measurement")
    ap.add_argument("--home", default=None)
    harness.add_quick(ap, count=128)
    args = harness.parse(ap)
    if args.home:
        os.environ["LUMEN_HOME"] = args.home
    texts = make_corpus()
    figures: dict = {}
    if args.accuracy or args.offline:
        prep = Prepared()
        if args.accuracy:
            accuracy(prep, texts)
        if args.offline:
            figures.update(offline_speed(prep, texts, args.count, args.rounds))
    if args.served or not (args.accuracy or args.offline):
        figures.update(served(texts, args.count, args.rounds))
    if figures:
        harness.emit(figures, args=args)


if __name__ == "__main__":
    main()
