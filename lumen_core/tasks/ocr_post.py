"""The OCR task's image geometry and decoding: rapidocr 3.10.0's defaults, step by step.

Everything here is a pure function of its inputs (numpy arrays in, numpy arrays out), so the
``ocr`` backend can run each piece where it fits the pipeline (the preprocessing pool, a step's
assembly or postprocess in an engine worker thread) and tests can compare each with rapidocr.
The constants are rapidocr's ``config.yaml`` (``Global``, ``Det``, ``Cls``, ``Rec``) and the
code paths follow its ``main.py``, ``utils/process_img.py``, ``ch_ppocr_det/``,
``ch_ppocr_cls/`` and ``ch_ppocr_rec/``; the field's own libraries (OpenCV, pyclipper) do the
geometry, exactly as there.  Images are BGR uint8 ``[H, W, 3]`` throughout, like rapidocr's.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from ..errors import InternalError

try:  # the [ocr] extra
    import cv2
    import pyclipper
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    cv2 = pyclipper = None  # type: ignore[assignment]
    _IMPORT_ERROR: Optional[ImportError] = _exc
else:
    _IMPORT_ERROR = None

# -- Global (rapidocr config.yaml) ---------------------------------------------------------------
#: lines whose recognition score is below this are dropped
TEXT_SCORE = 0.5
#: global resize: the shorter side is raised to at least this, the longer cut to at most that
MIN_SIDE_LEN = 30
MAX_SIDE_LEN = 2000
#: vertical padding of very flat or very low images before detection
MIN_HEIGHT = 30
WIDTH_HEIGHT_RATIO = 8
#: sizes are rounded to multiples of this (the detector's stride)
SIZE_MULTIPLE = 32

# -- Det ------------------------------------------------------------------------------------------
DET_LIMIT_SIDE_LEN = 736  # limit_type "min": the shorter side is raised to this
DET_MEAN = (0.5, 0.5, 0.5)
DET_STD = (0.5, 0.5, 0.5)
DET_THRESH = 0.3
DET_BOX_THRESH = 0.5
DET_MAX_CANDIDATES = 1000
DET_UNCLIP_RATIO = 1.6
DET_MIN_SIZE = 3
#: boxes whose top-left y differ by less than this are one line (sorted left to right)
BOX_SORT_Y_THRESHOLD = 10
#: a crop this much taller than wide is rotated 90 degrees (vertical text)
VERTICAL_CROP_RATIO = 1.5

# -- Cls ------------------------------------------------------------------------------------------
CLS_SHAPE = (3, 48, 192)
CLS_THRESH = 0.9
CLS_LABELS = ("0", "180")

# -- Rec ------------------------------------------------------------------------------------------
REC_SHAPE = (3, 48, 320)
#: the recogniser's alphabet lives in the rec model's ONNX metadata under this key
REC_CHARACTER_KEY = "character"
#: recognition width buckets: widths up to ``REC_SHAPE[2]`` share the minimum width, wider crops
#: go to the next of ``REC_SHAPE[2] * REC_BUCKET_GROWTH ** k`` (rounded up to a multiple of
#: ``REC_WIDTH_MULTIPLE``), so a crop is never padded to more than 1.25x its own width
REC_BUCKET_GROWTH = 1.25
REC_WIDTH_MULTIPLE = 8
#: a crop is never recognised wider than this (about a 1:170 line); wider ones are squeezed
REC_MAX_WIDTH = 8192


def require_libs() -> None:
    """Raise a clear error when the ``[ocr]`` extra (OpenCV, pyclipper) is missing."""
    if _IMPORT_ERROR is not None:
        raise ModuleNotFoundError(f"the ocr task needs the [ocr] extra (OpenCV, pyclipper): "
                                  f"pip install \"lumen-core[ocr]\" ({_IMPORT_ERROR})",
                                  name=getattr(_IMPORT_ERROR, "name", None))


def _round32(x: float) -> int:
    return int(round(x / SIZE_MULTIPLE) * SIZE_MULTIPLE)


def _scaled(h: int, w: int, ratio: float) -> tuple:
    """(h, w) scaled by ``ratio`` and rounded to multiples of 32 (either may become 0)."""
    return _round32(int(h * ratio)), _round32(int(w * ratio))


def _resize_ratio(img: np.ndarray, ratio: float) -> tuple:
    """(img resized by ``ratio`` to multiples of 32, ratio_h, ratio_w) or (None, 0, 0)."""
    h, w = img.shape[:2]
    rh, rw = _scaled(h, w, ratio)
    if rh <= 0 or rw <= 0:
        return None, 0.0, 0.0
    return cv2.resize(img, (rw, rh)), h / rh, w / rw


def _padding(h: int, w: int, ratio: float = WIDTH_HEIGHT_RATIO,
             min_height: int = MIN_HEIGHT) -> int:
    """Rows of padding above (and below) an ``h`` x ``w`` image (0: none)."""
    if h <= min_height or w / h > ratio:
        return int(abs(max(int(w / ratio), min_height) * 2 - h) / 2)
    return 0


def _det_ratio(h: int, w: int, limit: int = DET_LIMIT_SIDE_LEN) -> float:
    return limit / (h if h < w else w) if min(h, w) < limit else 1.0


def det_input_size(h: int, w: int) -> Optional[tuple]:
    """(height, width) of the detector input that :func:`resize_within_bounds`,
    :func:`vertical_padding` and :func:`det_resize` make of an ``h`` x ``w`` image, computed
    without touching a pixel (None: the image vanishes), so a hostile shape is refused before
    anything is allocated: a 400x2 strip becomes a 6016x1504 detector input."""
    if max(h, w) > MAX_SIDE_LEN:
        h, w = _scaled(h, w, MAX_SIDE_LEN / (h if h > w else w))
        if h <= 0 or w <= 0:
            return None
    if min(h, w) < MIN_SIDE_LEN:
        h, w = _scaled(h, w, MIN_SIDE_LEN / (h if h < w else w))
        if h <= 0 or w <= 0:
            return None
    h += 2 * _padding(h, w)
    dh, dw = _scaled(h, w, _det_ratio(h, w))
    return (dh, dw) if dh > 0 and dw > 0 else None


def resize_within_bounds(img: np.ndarray, min_side: int = MIN_SIDE_LEN,
                         max_side: int = MAX_SIDE_LEN) -> tuple:
    """rapidocr's global resize: ``(img, ratio_h, ratio_w)``; img None when it vanishes."""
    ratio_h = ratio_w = 1.0
    h, w = img.shape[:2]
    if max(h, w) > max_side:
        img, ratio_h, ratio_w = _resize_ratio(img, max_side / (h if h > w else w))
        if img is None:
            return None, 0.0, 0.0
    h, w = img.shape[:2]
    if min(h, w) < min_side:
        img, ratio_h, ratio_w = _resize_ratio(img, min_side / (h if h < w else w))
    return img, ratio_h, ratio_w


def vertical_padding(img: np.ndarray, ratio: float = WIDTH_HEIGHT_RATIO,
                     min_height: int = MIN_HEIGHT) -> tuple:
    """(img, top): black rows above and below a very low or very flat image."""
    h, w = img.shape[:2]
    if h <= min_height or w / h > ratio:
        pad = _padding(h, w, ratio, min_height)
        return cv2.copyMakeBorder(img, pad, pad, 0, 0, cv2.BORDER_CONSTANT, value=(0, 0, 0)), pad
    return img, 0


def det_resize(img: np.ndarray, limit: int = DET_LIMIT_SIDE_LEN) -> Optional[np.ndarray]:
    """``limit_type: min``: raise the shorter side to ``limit``, both sides to multiples of 32."""
    h, w = img.shape[:2]
    rh, rw = _scaled(h, w, _det_ratio(h, w, limit))
    if rh <= 0 or rw <= 0:
        return None
    return cv2.resize(img, (rw, rh))


# -- DB post-process ------------------------------------------------------------------------------
def _mini_box(contour: np.ndarray) -> tuple:
    rect = cv2.minAreaRect(contour)
    pts = sorted(list(cv2.boxPoints(rect)), key=lambda p: p[0])
    i1, i4 = (0, 1) if pts[1][1] > pts[0][1] else (1, 0)
    i2, i3 = (2, 3) if pts[3][1] > pts[2][1] else (3, 2)
    return np.array([pts[i1], pts[i2], pts[i3], pts[i4]]), min(rect[1])


def _box_score_fast(pred: np.ndarray, box: np.ndarray) -> float:
    h, w = pred.shape[:2]
    box = box.copy()
    xmin = np.clip(np.floor(box[:, 0].min()).astype(np.int32), 0, w - 1)
    xmax = np.clip(np.ceil(box[:, 0].max()).astype(np.int32), 0, w - 1)
    ymin = np.clip(np.floor(box[:, 1].min()).astype(np.int32), 0, h - 1)
    ymax = np.clip(np.ceil(box[:, 1].max()).astype(np.int32), 0, h - 1)
    mask = np.zeros((ymax - ymin + 1, xmax - xmin + 1), dtype=np.uint8)
    box[:, 0] -= xmin
    box[:, 1] -= ymin
    cv2.fillPoly(mask, box.reshape(1, -1, 2).astype(np.int32), 1)  # type: ignore[call-overload]
    return cv2.mean(pred[ymin:ymax + 1, xmin:xmax + 1], mask)[0]


def _unclip(box: np.ndarray, ratio: float) -> np.ndarray:
    """Grow the box by ``area * ratio / perimeter`` (Vatti offset, rounded joins)."""
    pts = box.astype(np.float64)
    x, y = pts[:, 0], pts[:, 1]
    area = 0.5 * abs(float(np.dot(x, np.roll(y, -1)) - np.dot(y, np.roll(x, -1))))
    length = float(np.sum(np.linalg.norm(pts - np.roll(pts, -1, axis=0), axis=1)))
    offset = pyclipper.PyclipperOffset()
    offset.AddPath(box, pyclipper.JT_ROUND, pyclipper.ET_CLOSEDPOLYGON)
    return np.array(offset.Execute(area * ratio / length)).reshape((-1, 1, 2))


def _order_clockwise(pts: np.ndarray) -> np.ndarray:
    xs = pts[np.argsort(pts[:, 0]), :]
    left, right = xs[:2, :], xs[2:, :]
    tl, bl = left[np.argsort(left[:, 1]), :]
    tr, br = right[np.argsort(right[:, 1]), :]
    return np.array([tl, tr, br, bl], dtype="float32")


def db_boxes(prob: np.ndarray, src_h: int, src_w: int, thresh: float = DET_THRESH,
             box_thresh: float = DET_BOX_THRESH, unclip_ratio: float = DET_UNCLIP_RATIO,
             max_candidates: int = DET_MAX_CANDIDATES) -> tuple:
    """DB post-process of one probability map ``[H, W]``: (boxes float32 ``[n, 4, 2]`` in
    ``src`` pixels, clockwise from top-left, sorted in reading order; scores)."""
    height, width = prob.shape
    mask = cv2.dilate((prob > thresh).astype(np.uint8), np.array([[1, 1], [1, 1]]))
    contours = cv2.findContours((mask * 255).astype(np.uint8), cv2.RETR_LIST,
                                cv2.CHAIN_APPROX_SIMPLE)[-2]
    boxes, scores = [], []
    for contour in contours[:max_candidates]:
        points, sside = _mini_box(contour)
        if sside < DET_MIN_SIZE:
            continue
        score = _box_score_fast(prob, points.reshape(-1, 2))
        if box_thresh > score:
            continue
        box, sside = _mini_box(_unclip(points, unclip_ratio))
        if sside < DET_MIN_SIZE + 2:
            continue
        box[:, 0] = np.clip(np.round(box[:, 0] / width * src_w), 0, src_w)
        box[:, 1] = np.clip(np.round(box[:, 1] / height * src_h), 0, src_h)
        box = _order_clockwise(box.astype(np.int32))
        box[:, 0] = np.clip(box[:, 0], 0, src_w - 1).astype(np.int32)
        box[:, 1] = np.clip(box[:, 1], 0, src_h - 1).astype(np.int32)
        if int(np.linalg.norm(box[0] - box[1])) <= 3 or int(np.linalg.norm(box[0] - box[3])) <= 3:
            continue
        boxes.append(box)
        scores.append(score)
    if not boxes:
        return np.zeros((0, 4, 2), dtype=np.float32), []
    arr = np.array(boxes)
    order = reading_order(arr)
    return arr[order], [scores[i] for i in order]


def reading_order(boxes: np.ndarray) -> np.ndarray:
    """Indices sorting boxes top to bottom, left to right within a line (y within 10 px)."""
    y = boxes[:, 0, 1]
    by_y = np.argsort(y, kind="stable")
    ys = y[by_y]
    line = np.concatenate([[0], np.cumsum((np.diff(ys) >= BOX_SORT_Y_THRESHOLD).astype(np.int32))])
    return by_y[np.lexsort((boxes[by_y][:, 0, 0], line))]


def crop(img: np.ndarray, box: np.ndarray) -> np.ndarray:
    """Perspective-warp one box out of ``img`` (rotated 90 degrees when much taller than wide)."""
    pts = box.astype(np.float32)
    w = int(max(np.linalg.norm(pts[0] - pts[1]), np.linalg.norm(pts[2] - pts[3])))
    h = int(max(np.linalg.norm(pts[0] - pts[3]), np.linalg.norm(pts[1] - pts[2])))
    std = np.array([[0, 0], [w, 0], [w, h], [0, h]], dtype=np.float32)
    m = cv2.getPerspectiveTransform(pts, std)
    out = cv2.warpPerspective(img, m, (w, h), borderMode=cv2.BORDER_REPLICATE,
                              flags=cv2.INTER_CUBIC)
    if out.shape[0] / out.shape[1] >= VERTICAL_CROP_RATIO:
        out = np.rot90(out)
    return out


def map_boxes(boxes: np.ndarray, top: int, ratio_h: float, ratio_w: float, ori_h: int,
              ori_w: int) -> np.ndarray:
    """Boxes from the padded, resized image back to input-image pixels (clamped)."""
    b = boxes.astype(np.float32).copy()
    b[:, :, 1] -= top
    b[:, :, 0] *= ratio_w
    b[:, :, 1] *= ratio_h
    b = np.where(b < 0, 0, b)
    b[..., 0] = np.minimum(b[..., 0], ori_w)
    b[..., 1] = np.minimum(b[..., 1], ori_h)
    return b


# -- cls / rec inputs -----------------------------------------------------------------------------
def resized_width(h: int, w: int, height: int, max_width: int) -> int:
    """Width of a crop resized to ``height`` (aspect kept), at most ``max_width``."""
    return min(max_width, int(math.ceil(height * (w / float(h)))))


def rec_batch_width(h: int, w: int) -> int:
    """The width a crop is recognised at: rapidocr's own (``int(48 * max(320/48, w/h))``)
    rounded up to its width bucket, so batches group crops that pad by at most 1.25x."""
    _c, height, base = REC_SHAPE
    own = int(height * max(base / height, w / float(h)))
    if own <= base:
        return base
    width = float(base)
    while width < own:
        width *= REC_BUCKET_GROWTH
    bucket = int(math.ceil(width / REC_WIDTH_MULTIPLE) * REC_WIDTH_MULTIPLE)
    return min(REC_MAX_WIDTH, max(own, bucket))


def normalise_crop(img: np.ndarray, dest: np.ndarray) -> None:
    """Resize ``img`` to ``dest``'s height (aspect kept, at most its width), write
    ``(x/255 - 0.5)/0.5`` CHW into the left part of ``dest`` ``[3, H, W]`` and zeros right."""
    _c, height, width = dest.shape
    h, w = img.shape[:2]
    rw = max(1, resized_width(h, w, height, width))
    resized = cv2.resize(img, (rw, height))
    chw = resized.transpose(2, 0, 1)
    np.multiply(chw, np.float32(2.0 / 255.0), out=dest[:, :, :rw], casting="unsafe")
    dest[:, :, :rw] -= np.float32(1.0)
    dest[:, :, rw:] = 0.0


def rotate_180(img: np.ndarray) -> np.ndarray:
    return cv2.rotate(img, cv2.ROTATE_180)


def ctc_decode(probs: np.ndarray, characters: Sequence[str]) -> tuple:
    """Greedy CTC of one ``[T, C]`` softmax: (text, mean char probability rounded to 5)."""
    idx = probs.argmax(axis=1)
    prob = probs.max(axis=1)
    keep = np.ones(len(idx), dtype=bool)
    keep[1:] = idx[1:] != idx[:-1]
    keep &= idx != 0
    conf = [round(c, 5) for c in prob[keep].tolist()] or [0]
    text = "".join(characters[i] for i in idx[keep])
    return text, float(np.mean(conf).round(5))


def characters_from_metadata(meta: dict) -> list:
    """The CTC alphabet: ``blank``, the model's characters, then a space."""
    chars = meta.get(REC_CHARACTER_KEY)
    if not chars:
        raise InternalError(f"the recognition model has no {REC_CHARACTER_KEY!r} metadata")
    return ["blank", *chars.splitlines(), " "]
