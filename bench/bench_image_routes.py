"""image_embed routes: in-process throughput of raw vs fp32 tensor vs uint8 tensor (issue 7).

One runtime serving the generated CLIP-style encoder (``tests/onnx_models.image_encoder``),
``callers`` concurrent coroutines, each sending its share of ``requests``; the routes take turns
in every round and the best round of each is kept (noise on the shared box only ever adds
time), so the printed ratios come from one run under the same conditions.

* raw: a 640x480 JPEG (q90) per request -- the server decodes, resizes, crops (in threads off
  the event loop) and normalises into the batch slot;
* fp32: the client's ``[1,3,224,224]`` NCHW tensor (602 KB), memcpy'd into its slot;
* uint8: the client's ``[1,224,224,3]`` NHWC crop (150 KB), normalised into its slot by the
  fused pass;
* mixed: a third of each, concurrently (raw and fp32 share batches, uint8 has its own);
* ``fp32 on loop`` / ``uint8 on loop``: the tensor routes with the backend's ``prepare`` run on
  the event loop instead of ``asyncio.to_thread`` (what a per-route ``prepare_off_loop`` in the
  runtime would give the tensor routes, which never decode).

Client-side work (encoding, preprocessing) is done before timing and is not counted.  Also
printed: the encoder alone (ORT, pre-stacked batches of ``max_batch_size``, same threads), as
the ceiling, taking its turn in every round.

    python bench/bench_image_routes.py [--callers 32] [--requests 768] [--rounds 3]
"""
from __future__ import annotations

import argparse
import asyncio
import io
import os
import tempfile
import time

import harness  # noqa: E402  (bench/: quick mode, rounds, the result format)
import numpy as np
from PIL import Image

import lumen_core as lc  # noqa: E402
from lumen_core import native  # noqa: E402
from lumen_core import toy_graphs as M  # noqa: E402
from lumen_core.engine.session import session_options  # noqa: E402
from lumen_core.tasks import imaging  # noqa: E402
from lumen_core.tasks.imaging import CLIP_PREPROCESS_ID, CLIP_UINT8_PREPROCESS_ID  # noqa: E402

TASK = "image_embed"
#: the raw route's source picture (a phone-photo-sized web image)
SOURCE_SIZE = (640, 480)
JPEG_QUALITY = 90
#: distinct pictures cycled through by the callers (decode work is not cached anywhere)
PICTURES = 8
MAX_BATCH = 32
QUEUE_DELAY_US = 2000
#: encoder width (patch-embedding channels) and embedding size
WIDTH, D_OUT = 64, 512
LIMIT = 50_000_000
#: timings of the encoder alone per round (each is short, so one neighbour's burst would skew it)
CEILING_TRIES = 3


def pictures() -> list:
    rng = np.random.default_rng(0)
    w, h = SOURCE_SIZE
    yy, xx = np.mgrid[0:h, 0:w]
    out = []
    for _ in range(PICTURES):
        base = np.stack([xx * 255.0 / w, yy * 255.0 / h, (xx ^ yy) % 256], -1)
        img = Image.fromarray(np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8))
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=JPEG_QUALITY)
        out.append(buf.getvalue())
    return out


def requests_for(route: str, jpegs: list) -> list:
    if route == "raw":
        return [lc.new_infer_request(TASK).for_raw_input(j, "image/jpeg").build() for j in jpegs]
    if route == "fp32":
        return [lc.new_infer_request(TASK).for_tensor_array(
            imaging.preprocess_clip(j, "image/jpeg", LIMIT)[None], "NCHW", CLIP_PREPROCESS_ID).build()
            for j in jpegs]
    return [lc.new_infer_request(TASK).for_tensor_array(
        imaging.preprocess_clip_uint8(j, "image/jpeg", LIMIT)[None], "NHWC",
        CLIP_UINT8_PREPROCESS_ID).build() for j in jpegs]


async def drive(rt, reqs: list, callers: int, total: int) -> tuple:
    """(requests/s, mean batch size, worker us per image) for ``total`` requests from
    ``callers`` coroutines.  The worker time (``lumen.compute_us`` / batch size: assembly +
    model + postprocess) shows what each route's assembly adds to the model's own time."""
    sizes: list = []
    per_image: list = []

    async def caller(k: int) -> None:
        for i in range(k, total, callers):
            res = await rt.infer(reqs[i % len(reqs)])
            n = int(res.meta["lumen.batch.size"])
            sizes.append(n)
            per_image.append(int(res.meta["lumen.compute_us"]) / n)

    t0 = time.perf_counter()
    await asyncio.gather(*[caller(k) for k in range(callers)])
    return total / (time.perf_counter() - t0), float(np.mean(sizes)), float(np.median(per_image))


class Ceiling:
    """The encoder alone: one ORT session with the runtime's settings, pre-stacked batches."""

    def __init__(self, path: str, x: np.ndarray, threads: int):
        import onnxruntime as ort

        self.sess = ort.InferenceSession(path, session_options(threads, False),
                                         providers=["CPUExecutionProvider"])
        self.batch = np.ascontiguousarray(np.repeat(x, MAX_BATCH, axis=0))
        self.sess.run(None, {"x": self.batch})

    def rate(self, total: int) -> float:
        n = max(1, total // MAX_BATCH)
        t0 = time.perf_counter()
        for _ in range(n):
            self.sess.run(None, {"x": self.batch})
        return n * MAX_BATCH / (time.perf_counter() - t0)


async def main(args) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = M.image_encoder(os.path.join(d, "enc.onnx"), width=WIDTH, d_out=D_OUT)
        jpegs = pictures()
        reqs = {r: requests_for(r, jpegs) for r in ("raw", "fp32", "uint8")}
        mixed = [q for trio in zip(reqs["raw"], reqs["fp32"], reqs["uint8"], strict=True) for q in trio]
        cfg = {"tasks": [{"name": TASK, "backend": "image_embedding", "model": path,
                          "intra_op_threads": args.threads,
                          "batching": {"max_batch_size": MAX_BATCH,
                                       "max_queue_delay_us": QUEUE_DELAY_US,
                                       "max_queue_size": 4 * args.callers}}]}
        runs = {"raw": (reqs["raw"], True), "fp32": (reqs["fp32"], True),
                "uint8": (reqs["uint8"], True), "mixed": (mixed, True),
                "fp32 on loop": (reqs["fp32"], False), "uint8 on loop": (reqs["uint8"], False)}
        best = {name: (0.0, 0.0, 0.0) for name in runs}
        x = imaging.preprocess_clip(jpegs[0], "image/jpeg", LIMIT)[None]
        ceiling = Ceiling(path, x, args.threads)
        top = 0.0
        async with lc.Runtime.from_dict(cfg) as rt:
            backend = rt.tasks[TASK].backend
            for rs, _ in runs.values():  # warm every path once
                await drive(rt, rs, args.callers, args.callers)
            for _ in range(args.rounds):
                for _ in range(CEILING_TRIES):  # takes its turn in every round; short, so best-of
                    top = max(top, ceiling.rate(args.requests))
                for name, (rs, off_loop) in runs.items():
                    backend.prepare_off_loop = off_loop
                    got = await drive(rt, rs, args.callers, args.requests)
                    if got[0] > best[name][0]:
                        best[name] = got
            backend.prepare_off_loop = True
    load = os.getloadavg()[0]
    print(f"extensions={native.using_extensions()} callers={args.callers} "
          f"requests/round={args.requests} rounds={args.rounds} threads={args.threads} "
          f"load={load:.2f}")
    print(f"encoder alone (ORT, batches of {MAX_BATCH}): {top:.0f} img/s")
    print(f"{'route':<15} {'img/s':>8} {'mean batch':>10} {'worker us/img':>13} {'vs raw':>7} "
          f"{'vs encoder':>10}")
    raw = best["raw"][0]
    for name, (rate, mean_batch, us) in best.items():
        print(f"{name:<15} {rate:8.0f} {mean_batch:10.1f} {us:13.0f} {rate / raw:6.2f}x "
              f"{rate / top:9.2f}")
    print(f"uint8 / fp32: {best['uint8'][0] / best['fp32'][0]:.2f}x   "
          f"fp32 on loop / off loop: {best['fp32 on loop'][0] / best['fp32'][0]:.2f}x   "
          f"uint8 on loop / off loop: {best['uint8 on loop'][0] / best['uint8'][0]:.2f}x")
    figures = {"encoder alone (best)": harness.value(top, "img/s")}
    for name, (rate, _mean_batch, _us) in best.items():
        figures[f"{name} (best round)"] = harness.value(rate, "img/s")
        figures[f"{name} / encoder alone"] = harness.value(rate / top, "x")
    harness.emit(figures, args=args)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--callers", type=int, default=32)
    p.add_argument("--requests", type=int, default=768)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    harness.add_quick(p, requests=192)
    asyncio.run(main(harness.parse(p)))
