"""text_embed in process vs offline ONNX Runtime on the seeded length-mixed corpus.

Modes, all on the same prepared all-MiniLM-L6-v2, ORT with 2 intra-op threads and spinning
off, tokenization included everywhere (``Tokenizer.encode`` per text, one thread):

* ``offline per text``: tokenize + ``session.run`` one text at a time;
* ``offline sorted 32``: tokenize all, sort by token count, run batches of 32 (the ideal for
  padding: the batcher cannot see the whole corpus at once);
* ``offline blind 32``: batches of 32 in corpus order (reference: what padding costs);
* ``in process``: ``Runtime.infer`` from 64 concurrent callers (raw ``text/plain`` route), the
  default text_embed batching (max 32, length-aware formation).

The offline best is the better of per text and sorted 32, measured in the same round.  Rounds
alternate the modes so a neighbour's burst of load hits all of them; the table reports the
best round of each mode and the ratio of bests.  Texts per CPU-second (process CPU time of all
threads) is printed too: on a shared box it moves much less with the neighbours' load than
wall time, and it still charges every overhead of the in-process path (event loop, tokenizer,
thread hand-offs), though not idle gaps.

Run: ``python bench/bench_text_embed.py [--texts 2000] [--rounds 2]`` (needs
``lumen models prepare``; ``--home`` or ``$LUMEN_HOME`` picks the models dir).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import sys
import time
from typing import Any, Callable

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import harness  # noqa: E402  (bench/: quick mode, rounds, the result format)
from corpus import DEFAULT_SEED, describe, make_corpus  # noqa: E402

import lumen_core as lc  # noqa: E402
from lumen_core import models  # noqa: E402
from lumen_core.batching import dynamic  # noqa: E402
from lumen_core.engine.session import session_options  # noqa: E402
from lumen_core.models import minilm  # noqa: E402

CONCURRENCY = 64
BATCH = 32
INTRA_OP_THREADS = 2
TARGET_RATIO = 0.95
OUTPUT = "embedding"


def offline_session(path: pathlib.Path) -> Any:
    import onnxruntime as ort

    return ort.InferenceSession(str(path), session_options(INTRA_OP_THREADS, False),
                                providers=["CPUExecutionProvider"])


def _run(sess: Any, rows: list) -> np.ndarray:
    ids, mask = minilm.pad_batch(rows)
    return sess.run([OUTPUT], {minilm.INPUT_IDS: ids, minilm.ATTENTION_MASK: mask})[0]


def per_text(sess: Any, tok: Any, texts: list) -> tuple:
    out = np.empty((len(texts), minilm.EMBEDDING_DIM), np.float32)
    for i, t in enumerate(texts):
        out[i] = _run(sess, [tok.encode(t).ids])[0]
    return out, 0.0


def batched(sess: Any, tok: Any, texts: list, sort: bool) -> tuple:
    ids = [tok.encode(t).ids for t in texts]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i])) if sort else list(range(len(ids)))
    out = np.empty((len(texts), minilm.EMBEDDING_DIM), np.float32)
    real = slots = 0
    for s in range(0, len(order), BATCH):
        chunk = order[s:s + BATCH]
        rows = [ids[i] for i in chunk]
        out[chunk] = _run(sess, rows)
        real += sum(len(r) for r in rows)
        slots += len(rows) * max(len(r) for r in rows)
    return out, (slots - real) / slots


def in_process(rt: lc.Runtime, texts: list) -> tuple:
    payloads = [t.encode("utf-8") for t in texts]
    out = np.empty((len(texts), minilm.EMBEDDING_DIM), np.float32)
    task = rt.tasks["text_embed"]
    def counters() -> list:  # engine counters (batches, items) + the runners' plan counters
        return [{**i.stats, **r.stats} for i, r in zip(task.instances, task.runners, strict=True)]

    before = counters()

    async def caller(next_index: list) -> None:
        while next_index[0] < len(payloads):
            i = next_index[0]
            next_index[0] += 1
            r = await rt.infer(lc.InferRequest(task="text_embed", payload=payloads[i],
                                               payload_mime="text/plain"))
            out[i] = r.outputs[OUTPUT]

    async def main() -> None:
        shared = [0]
        await asyncio.gather(*[caller(shared) for _ in range(CONCURRENCY)])

    asyncio.run_coroutine_threadsafe(main(), rt.loop).result()
    after = counters()

    def delta(key: str) -> int:
        return sum(a.get(key, 0) - b.get(key, 0) for a, b in zip(after, before, strict=True))

    real, slots, batches = delta("real_tokens"), delta("padded_tokens"), delta("batches")
    in_process.mean_batch = len(texts) / max(1, batches)  # type: ignore[attr-defined]
    return out, (slots - real) / slots


def with_tolerance(tol: float, slack: int, fn: Callable[[], tuple]) -> tuple:
    """Run ``fn`` with other padding tolerances of the length-aware formation (read per batch)."""
    saved = dynamic.PAD_TOLERANCE, dynamic.PAD_SLACK_TOKENS
    dynamic.PAD_TOLERANCE, dynamic.PAD_SLACK_TOKENS = tol, slack
    try:
        return fn()
    finally:
        dynamic.PAD_TOLERANCE, dynamic.PAD_SLACK_TOKENS = saved


def timed(fn: Callable[[], tuple]) -> tuple:
    """(wall seconds, process CPU seconds over all threads, outputs, padding ratio)."""
    c0 = time.process_time()
    t0 = time.perf_counter()
    out, pad = fn()
    return time.perf_counter() - t0, time.process_time() - c0, out, pad


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--texts", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--home", default=None, help="LUMEN_HOME with the prepared models")
    ap.add_argument("--no-blind", action="store_true", help="skip the slow length-blind mode")
    ap.add_argument("--policies", default="",
                    help="extra in-process modes with other padding tolerances, e.g. '0.1:8,0:4' "
                         "(PAD_TOLERANCE:PAD_SLACK_TOKENS of batching/dynamic.py)")
    harness.add_quick(ap, texts=256, no_blind=True)
    args = harness.parse(ap)
    if args.home:
        os.environ["LUMEN_HOME"] = args.home
    directory = harness.require_model(models.MINILM)
    path = directory / models.MODEL_FILE
    tok = minilm.load_tokenizer(directory / minilm.TOKENIZER_FILE)
    texts = make_corpus(args.texts, args.seed)
    print(f"corpus: {describe(texts, tok)}")
    print(f"load average at start: {os.getloadavg()[0]:.2f}; {os.cpu_count()} cpus; "
          f"ORT {INTRA_OP_THREADS} intra-op threads, spinning off; {CONCURRENCY} callers")

    sess = offline_session(path)
    _run(sess, [tok.encode(texts[0]).ids])
    rt = lc.Runtime.from_dict({"tasks": [{
        "name": "text_embed", "backend": "text_embedding", "model": str(path),
        "intra_op_threads": INTRA_OP_THREADS, "allow_spinning": False,
        "batching": {"max_batch_size": BATCH, "max_queue_size": 4 * CONCURRENCY}}]})
    rt.start_background()
    modes: dict = {
        "offline per text": lambda: per_text(sess, tok, texts),
        "offline sorted 32": lambda: batched(sess, tok, texts, True),
        "in process (64 callers)": lambda: in_process(rt, texts),
    }
    for spec in filter(None, args.policies.split(",")):
        tol, slack = (float(x) for x in spec.split(":"))
        modes[f"in process tol {tol:g} slack {slack:g}"] = (
            lambda tol=tol, slack=int(slack): with_tolerance(tol, slack, lambda: in_process(rt, texts)))
    if not args.no_blind:
        modes["offline blind 32"] = lambda: batched(sess, tok, texts, False)
    best: dict = {}
    pads: dict = {}
    mean_batch: dict = {}
    best_cpu: dict = {}
    outs: dict = {}
    try:
        for r in range(args.rounds):
            row = []
            for name, fn in modes.items():
                dt, cpu, out, pad = timed(fn)
                rate = len(texts) / dt
                best[name] = max(best.get(name, 0.0), rate)
                best_cpu[name] = max(best_cpu.get(name, 0.0), len(texts) / cpu)
                pads[name] = pad
                if name.startswith("in process"):
                    mean_batch[name] = in_process.mean_batch  # type: ignore[attr-defined]
                outs[name] = out
                row.append(f"{name} {rate:.1f}")
            offline = max(best["offline per text"], best["offline sorted 32"])
            print(f"round {r + 1}: " + ", ".join(row) + f" texts/s; load {os.getloadavg()[0]:.2f}")
        in_pad = rt.tasks["text_embed"].padding_ratio
    finally:
        rt.stop_background()
    diff = float(np.abs(outs["in process (64 callers)"] - outs["offline sorted 32"]).max())
    offline = max(best["offline per text"], best["offline sorted 32"])
    print()
    cpu_offline = max(best_cpu["offline per text"], best_cpu["offline sorted 32"])
    print("| mode | texts/s (best round) | vs offline best | texts per CPU-second | vs offline best | padding |")
    print("|---|---|---|---|---|---|")
    for name in modes:
        extra = ""
        if name.startswith("in process") and name in mean_batch:
            extra = f" (mean batch {mean_batch[name]:.1f})"
        print(f"| {name} | {best[name]:.1f} | {best[name] / offline:.3f} | {best_cpu[name]:.1f} | "
              f"{best_cpu[name] / cpu_offline:.3f} | {pads[name]:.3f}{extra} |")
    ratio = best["in process (64 callers)"] / offline
    print(f"\nin process / offline best = {ratio:.3f} (target >= {TARGET_RATIO}); "
          f"task padding_ratio over the run {in_pad:.3f}; max |in process - offline| = {diff:.1e}; "
          f"load average at end {os.getloadavg()[0]:.2f}")
    figures = {f"{name} (best round)": harness.value(best[name], "texts/s") for name in modes}
    figures["in process / offline best"] = harness.value(ratio, "x")
    figures["max |in process - offline|"] = harness.value(diff, "abs")
    harness.emit(figures, args=args)


if __name__ == "__main__":
    main()
