"""In-process Silero VAD (issue 5): 256 concurrent streams vs the ideal offline loop.

Ideal: one ORT session, one call of all streams per step (``[256, 576]`` window + the
``[2, 256, 128]`` state carried by hand), the loop every VAD path must equal.  Ours: 256
asyncio callers, each streaming its chunks one request at a time (awaiting each answer, as a
live audio client does) through ``Runtime.infer`` with the sequence batcher.  Both run in this
one process, one after the other, with the same ORT thread count, so the ratio ours / ideal
is the runtime's efficiency under the same machine conditions.  The ideal's thread count is
chosen by measuring 1 and 2 threads and keeping the faster (``--threads`` overrides).

    LUMEN_HOME=... python bench/bench_vad.py [--streams 256] [--chunks 200] [--threads 0]
        [--rounds 3] [--route pcm|l16|tensor] [--instances 1] [--strategy direct|oldest] [--delay-us 0] [--util 0.5]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time

import harness  # noqa: E402  (bench/: quick mode, rounds, the result format)
import numpy as np

import lumen_core as lc
from lumen_core import native
from lumen_core.engine.session import session_options
from lumen_core.models import MODEL_FILE, SILERO_VAD, silero
from lumen_core.tasks import vad as vad_task

CHUNK = silero.CHUNK_SAMPLES
CONTEXT = silero.CONTEXT_SAMPLES
THREAD_CHOICES = (1, 2)
IDEAL_WARMUP_STEPS = 5
MIMES = {"pcm": "audio/pcm;format=f32le;rate=16000", "l16": "audio/L16;rate=16000"}


def make_audio(streams: int, chunks: int, seed: int = 0) -> np.ndarray:
    """Noise with tone bursts, so probabilities vary (values are irrelevant to speed)."""
    rng = np.random.default_rng(seed)
    t = np.arange(chunks * CHUNK) / silero.SAMPLE_RATE
    audio = (rng.standard_normal((streams, chunks * CHUNK)) * 0.02).astype(np.float32)
    gate = (np.sin(2 * np.pi * 0.5 * t) > 0).astype(np.float32)
    audio += (0.3 * np.sin(2 * np.pi * 220 * t) * gate).astype(np.float32)
    return audio


def ideal(path: str, audio: np.ndarray, threads: int) -> tuple:
    """chunks/s of the offline loop, and its probabilities [streams, chunks]."""
    import onnxruntime as ort

    sess = ort.InferenceSession(path, session_options(threads, False),
                                providers=["CPUExecutionProvider"])
    warm = silero.run_streams(sess, audio[:, :IDEAL_WARMUP_STEPS * CHUNK])
    assert np.isfinite(warm).all()
    t0 = time.perf_counter()
    probs = silero.run_streams(sess, audio)
    dt = time.perf_counter() - t0
    return audio.size // CHUNK / dt, probs


async def ours(audio: np.ndarray, threads: int, args) -> tuple:
    streams, total = audio.shape
    chunks = total // CHUNK
    per_lane = -(-streams // args.instances)
    cfg = {"tasks": [{"name": "vad", "backend": "vad", "intra_op_threads": threads,
                      "instances": args.instances,
                      "batching": {"max_batch_size": args.max_batch or per_lane,
                                   "max_queue_size": streams * 4},
                      "sequence": {"strategy": args.strategy,
                                   "max_candidate_sequences": per_lane,
                                   "max_queue_delay_us": args.delay_us,
                                   "minimum_slot_utilization": args.util}}]}
    if args.route == "tensor":
        def request(k: int, c: int, meta: dict) -> lc.InferRequest:
            x = audio[k, c * CHUNK:(c + 1) * CHUNK].reshape(1, CHUNK)
            b = lc.new_infer_request("vad").for_tensor_array(x, "NL", "silero_vad_16k_v5")
            for key, v in meta.items():
                b.with_meta(key, v)
            return b.build()
    else:
        mime = MIMES[args.route]
        pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2") if args.route == "l16" else audio

        def request(k: int, c: int, meta: dict) -> lc.InferRequest:
            return lc.InferRequest(task="vad", payload=pcm[k, c * CHUNK:(c + 1) * CHUNK],
                                   payload_mime=mime, meta=meta)

    reqs = []
    for k in range(streams):
        row = []
        for c in range(chunks):
            meta = {"lumen.sequence.id": f"stream-{k}"}
            if c == 0:
                meta["lumen.sequence.start"] = "true"
            if c == chunks - 1:
                meta["lumen.sequence.end"] = "true"
            row.append(request(k, c, meta))
        reqs.append(row)
    probs = np.zeros((streams, chunks), dtype=np.float32)
    sizes = np.zeros((streams, chunks), dtype=np.int32)
    async with lc.Runtime.from_dict(cfg) as rt:
        async def stream(k: int) -> None:
            for c, r in enumerate(reqs[k]):
                resp = await rt.infer(r)
                probs[k, c] = resp.outputs["speech_prob"][0]
                sizes[k, c] = int(resp.meta["lumen.batch.size"])

        t0 = time.perf_counter()
        await asyncio.gather(*[stream(k) for k in range(streams)])
        dt = time.perf_counter() - t0
    if os.environ.get("BENCH_VAD_SIZES"):
        vals, counts = np.unique(sizes, return_counts=True)
        print("batch sizes (size: requests):", dict(zip(vals.tolist(), counts.tolist(), strict=True)))
    return streams * chunks / dt, probs, float(sizes.mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=200)
    ap.add_argument("--threads", type=int, default=0, help="ORT intra-op threads (0: best of 1, 2)")
    ap.add_argument("--route", choices=("pcm", "l16", "tensor"), default="pcm")
    ap.add_argument("--instances", type=int, default=1)
    ap.add_argument("--strategy", choices=("direct", "oldest"), default="direct")
    ap.add_argument("--delay-us", type=int, default=vad_task.DEFAULT_QUEUE_DELAY_US,
                    help="max_queue_delay_us (default: the built-in vad task's)")
    ap.add_argument("--util", type=float, default=vad_task.DEFAULT_SLOT_UTILIZATION,
                    help="minimum_slot_utilization (default: the built-in vad task's)")
    ap.add_argument("--max-batch", type=int, default=0,
                    help="batching.max_batch_size (0: streams per instance)")
    ap.add_argument("--uvloop", action="store_true")
    ap.add_argument("--rounds", type=int, default=1, help="repeat ours (and the ideal after it)")
    harness.add_quick(ap, streams=64, chunks=50, rounds=3, threads=1)
    args = harness.parse(ap)
    path = str(harness.require_model(SILERO_VAD) / MODEL_FILE)
    audio = make_audio(args.streams, args.chunks)
    if args.threads:
        threads = args.threads
        ideal_cps, ref = ideal(path, audio, threads)
        print(f"ideal, {threads} thread(s): {ideal_cps:,.0f} chunks/s")
    else:
        best = None
        for t in THREAD_CHOICES:
            cps, ref = ideal(path, audio, t)
            print(f"ideal, {t} thread(s): {cps:,.0f} chunks/s")
            if best is None or cps > best[0]:
                best = (cps, ref, t)
        ideal_cps, ref, threads = best
    if args.uvloop:
        import uvloop

        uvloop.install()
    ratios, rates = [], []
    for rnd in range(1, args.rounds + 1):
        cps, probs, mean_batch = asyncio.run(ours(audio, threads, args))
        err = float(np.abs(probs - ref).max())
        # the ideal again after ours (the best of before and after): a box that sped up
        # during the round cannot flatter the ratio
        again, _ = ideal(path, audio, threads)
        ideal_cps = max(ideal_cps, again)
        ratios.append(cps / ideal_cps)
        rates.append(cps)
        print(f"round {rnd}: ours ({args.route}, {args.strategy}, {args.instances} instance(s) x "
              f"{threads} thread(s), max batch {args.max_batch or 'all'}, delay {args.delay_us} us, "
              f"util {args.util}, extensions {all(native.using_extensions().values())}): "
              f"{cps:,.0f} chunks/s, mean batch {mean_batch:.1f}, max |p - ideal| {err:.1e}")
        print(f"ratio ours / ideal: {cps / ideal_cps:.3f}  (ideal {ideal_cps:,.0f} chunks/s; "
              f"load average {os.getloadavg()[0]:.2f})")
    if len(ratios) > 1:
        print(f"over {len(ratios)} rounds: median {statistics.median(ratios):.3f} "
              f"(min {min(ratios):.3f}, max {max(ratios):.3f})")
    harness.emit({"ours": harness.stat(rates, "chunks/s"),
                  "ours / ideal": harness.stat(ratios, "x")}, args=args)


if __name__ == "__main__":
    main()
