"""Cost of always fetching the prepared MiniLM graphs' second output ``pooled`` (what
``normalize=false`` returns) next to ``embedding``, through the CPU engine as the
``text_embedding`` backend binds it (both outputs preallocated, IO binding).

Each round runs the same feeds with a ModelSpec fetching ``embedding`` only and one fetching
both, back to back (order alternating), and prints the CPU-time ratio both / one per round for
a single short text (batch 1, the case where a fixed per-output cost shows most) and a sorted
batch of 32 corpus texts.  1 intra-op thread, no spinning.

Run: ``python bench/bench_pooled_output.py [--home DIR] [--rounds 5]``.
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness  # noqa: E402  (bench/: quick mode, rounds, the result format)
from corpus import make_corpus  # noqa: E402

from lumen_core import models  # noqa: E402
from lumen_core.engine.ort import CpuEngineInstance  # noqa: E402
from lumen_core.engine.plan import ModelSpec, OutputSpec  # noqa: E402
from lumen_core.models import minilm  # noqa: E402


def engine(path: str, outputs: tuple) -> CpuEngineInstance:
    spec = ModelSpec(path, [], [OutputSpec(o, np.float32, (minilm.EMBEDDING_DIM,)) for o in outputs])
    return CpuEngineInstance(spec, "bench", 1, False)


def cpu_seconds(eng: CpuEngineInstance, feeds: dict, n: int, reps: int) -> float:
    t = time.process_time()
    for _ in range(reps):
        eng.run(feeds, n)
    return time.process_time() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--home", default=None)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--scale", type=float, default=1.0,
                    help="scale the calls per measurement (300 one-text, 8 32-text calls)")
    harness.add_quick(ap, rounds=3, scale=0.25)
    args = harness.parse(ap)
    texts = sorted(make_corpus()[:32], key=len)
    figures = {}
    for name in (models.MINILM, models.MINILM_INT8):
        directory = harness.require_model(name, args.home)
        path = str(directory / models.MODEL_FILE)
        tok = minilm.load_tokenizer(directory / minilm.TOKENIZER_FILE)
        one, both = engine(path, (minilm.OUTPUT,)), engine(path, (minilm.OUTPUT, minilm.POOLED))
        cases = {"1 short text": (["a dynamic batcher"], 300), "32 corpus texts": (texts, 8)}
        for label, (batch, reps) in cases.items():
            ids, mask = minilm.pad_batch([e.ids for e in tok.encode_batch(batch)])
            feeds = {minilm.INPUT_IDS: ids, minilm.ATTENTION_MASK: mask}
            ratios = []
            reps = max(2, int(reps * args.scale))
            for r in range(args.rounds):
                order = (one, both) if r % 2 == 0 else (both, one)
                t = {id(e): cpu_seconds(e, feeds, len(batch), reps) for e in order}
                ratios.append(t[id(both)] / t[id(one)])
            print(f"{name:24s} {label:16s} both/one per round "
                  f"{' '.join(f'{x:.3f}' for x in ratios)}  median {statistics.median(ratios):.3f}")
            figures[f"{name} {label}: both outputs / one (CPU)"] = harness.stat(ratios, "x")
    harness.emit(figures, args=args)


if __name__ == "__main__":
    main()
