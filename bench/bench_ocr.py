"""ocr: images/s of the ``ocr`` task with 8 concurrent callers vs rapidocr's own sequential loop.

Both sides read the same fixture images (``tests/fixtures/ocr``), on the same model files
(rapidocr 3.10.0's, prepared by ``lumen models prepare``), in one process run, alternating
``--runs`` times; the ratio of each run is printed, then the median and the spread.

- **rapidocr**: ``RapidOCR()`` with its defaults except ONNX Runtime's threads, set explicitly
  to the box's cores (``EngineConfig.onnxruntime.intra_op_num_threads``), called image after
  image on the encoded bytes (its own decode included, as ours).
- **lumen**: ``Runtime.infer`` from ``--callers`` concurrent asyncio callers, each taking the
  next image; the task's steps run on their own engine instances (``--threads`` per instance).

Also printed: CPU seconds of the process per image on each side (less sensitive to the
neighbours' load than wall time on a shared box), per-step batches, mean batch size and compute time (where the time goes).

``--setups`` compares several engine layouts in the same run, interleaved with rapidocr's
loop: ``DET:REC`` (detector and recogniser instances, one classifier) or ``default`` (the
served default task, ``tasks.ocr.default_task_table``: what ``lumen serve`` runs).

    python bench/bench_ocr.py [--runs 3] [--callers 8] [--rounds 2] [--setups default,1:1]
"""
from __future__ import annotations

import asyncio
import json
import os
import pathlib
import sys
import time

import harness  # noqa: E402  (bench/: quick mode, rounds, the result format)
from ensemble_compare import common_args, compare, lumen_run  # noqa: E402  (bench/)

ROOT = pathlib.Path(__file__).resolve().parents[1]
OCR_DIR = ROOT / "tests" / "fixtures" / "ocr"


def load_images() -> list:
    ref = json.loads((OCR_DIR / "rapidocr_reference.json").read_text())
    return [(im["file"], (OCR_DIR / im["file"]).read_bytes()) for im in ref["images"]]


def rapidocr_loop(engine, images: list, rounds: int) -> tuple:
    """(images/s, CPU seconds of this process per image)."""
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(rounds):
        for _name, data in images:
            engine(data)
    n = rounds * len(images)
    return n / (time.perf_counter() - t0), (time.process_time() - c0) / n


def main() -> None:
    ap = common_args(__doc__, 2)
    ap.add_argument("--det-instances", type=int, default=2)
    ap.add_argument("--rec-instances", type=int, default=2)
    ap.add_argument("--setups", default="",
                    help="comma-separated DET:REC or 'default' (replaces --det/--rec-instances)")
    harness.add_quick(ap, runs=3, rounds=1)
    args = harness.parse(ap)

    sys.path.insert(0, str(ROOT))
    try:
        from rapidocr import RapidOCR
    except ImportError as exc:
        harness.skip(f"the reference package cannot load ({exc}): install the ocr extra")

    import lumen_core as lc
    from lumen_core import models

    cores = os.cpu_count() or 1
    images = load_images()
    model_dir = models.model_dir(models.OCR)
    if harness.quick(args):  # the suite does not build models; it says what is missing
        harness.require_model(models.OCR)
    models.prepare([models.OCR])
    engine = RapidOCR(params={"EngineConfig.onnxruntime.intra_op_num_threads": cores,
                              "EngineConfig.onnxruntime.inter_op_num_threads": 1,
                              "Global.log_level": "error"})
    engine(images[0][1])  # load + warm its models
    from lumen_core.tasks.ocr import default_task_table

    setups = {}
    for name in (args.setups.split(",") if args.setups
                 else [f"{args.det_instances}:{args.rec_instances}"]):
        if name == "default":
            table = default_task_table()
        else:
            det, rec = (int(x) for x in name.split(":"))
            table = {"name": "ocr", "backend": "ocr", "intra_op_threads": args.threads,
                     "options": {"det_instances": det, "cls_instances": 1,
                                 "rec_instances": rec}}
        table = {**table, "name": f"ocr_{len(setups)}", "model": str(model_dir),
                 "batching": {"max_queue_delay_us": 2000}}
        setups[name] = table
    print(f"{len(images)} images x {args.rounds} rounds, {args.callers} callers; lumen setups: "
          + "; ".join(f"{n}: {json.dumps(t.get('options', {}))}, intra_op_threads "
                      f"{t.get('intra_op_threads')}" for n, t in setups.items())
          + f"; rapidocr: {cores} intra-op threads; load {os.getloadavg()[0]:.2f}")

    async def go() -> dict:
        rt = lc.Runtime.from_dict({"tasks": list(setups.values())})
        async with rt:
            return await compare(rt, setups, lambda: rapidocr_loop(engine, images, args.rounds),
                          lambda task: lumen_run(rt, images, args.rounds, args.callers, task),
                          args.runs, "rapidocr")

    harness.emit(asyncio.run(go()), args=args)


if __name__ == "__main__":
    main()
