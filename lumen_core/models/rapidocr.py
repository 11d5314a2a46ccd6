"""rapidocr's three OCR models, copied from the ``rapidocr`` PyPI package and hash-checked.

``rapidocr==3.10.0`` (Apache-2.0, installed ``--no-deps``) ships under ``rapidocr/models/``:

- ``PP-OCRv6_det_small.onnx``: ``x [N,3,H,W]`` -> ``[N,1,H,W]`` text probability map;
- ``ch_ppocr_mobile_v2.0_cls_mobile.onnx``: ``[N,3,48,192]`` -> ``[N,2]`` (labels 0, 180);
- ``PP-OCRv6_rec_small.onnx``: ``[N,3,48,W]`` -> ``[N,W/8,C]`` softmax; its alphabet is the
  ONNX metadata ``character``.

The SHA-256 of each file is the one the package's ``MODEL_LICENSES.md`` records; ``prepare``
refuses a file that differs.  Nothing is downloaded.
"""
from __future__ import annotations

import pathlib
import shutil
from typing import Any, Optional

import numpy as np

from ..engine.session import cpu_session
from ..errors import ModelMissingError
from ._files import ProgressFn, distribution_version, packaged_path, pip_command, sha256_file

DIST = "rapidocr"
DIST_VERSION = "3.10.0"
MODULE = "rapidocr"
SOURCE_DIR = "models"

MODEL_ID = "rapidocr-pp-ocrv6-small"
MODEL_VERSION = "1"
REVISION = 1

#: prepared file names (one per step) and the packaged files they come from, with the
#: SHA-256 recorded in rapidocr 3.10.0's MODEL_LICENSES.md
DET_FILE, CLS_FILE, REC_FILE = "det.onnx", "cls.onnx", "rec.onnx"
SOURCES = {
    DET_FILE: ("PP-OCRv6_det_small.onnx",
               "090f04abcd9d9a7498bc4ebf677e4cb9bdce1fe4197ddb7e529f1ef44e1ff94f"),
    CLS_FILE: ("ch_ppocr_mobile_v2.0_cls_mobile.onnx",
               "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c"),
    REC_FILE: ("PP-OCRv6_rec_small.onnx",
               "6f327246b50388f3c176ae304bd95767ea6dc0c9ae92153ef8cbe210b3c14884"),
}
#: the recogniser's alphabet key in the rec model's ONNX metadata
CHARACTER_KEY = "character"


def source_dir() -> pathlib.Path:
    """``rapidocr/models`` of the installed package; a clear error naming pip if absent."""
    return packaged_path(MODULE, SOURCE_DIR, tuple(src for src, _h in SOURCES.values()), DIST,
                         DIST_VERSION, "the ocr models")


def source_info() -> dict[str, Any]:
    d = source_dir()
    return {"package": DIST, "version": distribution_version(DIST),
            "files": {src: sha256_file(d / src) for src, _h in SOURCES.values()},
            "revision": REVISION}


def build(out_dir: pathlib.Path, progress: Optional[ProgressFn] = None) -> dict[str, Any]:
    """Copy the three files, check their hashes and that each loads and runs at batch 2."""
    say = progress or (lambda _msg: None)
    src_dir = source_dir()
    for out, (src, want) in SOURCES.items():
        say(f"{MODEL_ID}: copying {MODULE}/{SOURCE_DIR}/{src}")
        shutil.copyfile(src_dir / src, out_dir / out)
        got = sha256_file(out_dir / out)
        if got != want:
            raise ModelMissingError(
                f"{DIST} ships {src} with sha256 {got}, not {want} (MODEL_LICENSES.md of "
                f"{DIST} {DIST_VERSION}); install that version with "
                f"`{pip_command(DIST, DIST_VERSION)}`", command=pip_command(DIST, DIST_VERSION))
    say(f"{MODEL_ID}: checking the models load in ONNX Runtime")
    shapes = {DET_FILE: (2, 3, 64, 64), CLS_FILE: (2, 3, 48, 192), REC_FILE: (2, 3, 48, 320)}
    for out, shape in shapes.items():
        sess = cpu_session(out_dir / out, intra_op_threads=1)
        res = sess.run(None, {sess.get_inputs()[0].name: np.zeros(shape, np.float32)})[0]
        if res.shape[0] != 2 or not np.all(np.isfinite(res)):
            raise RuntimeError(f"{MODEL_ID}: {out} gave {res.shape} on zeros")
        if out == REC_FILE and CHARACTER_KEY not in sess.get_modelmeta().custom_metadata_map:
            raise RuntimeError(f"{MODEL_ID}: {out} has no {CHARACTER_KEY!r} metadata")
    return {"model_id": MODEL_ID, "model_version": MODEL_VERSION, "revision": REVISION,
            "files": {out: src for out, (src, _h) in SOURCES.items()},
            "output_files": list(SOURCES)}
