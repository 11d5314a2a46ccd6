"""MTCNN's geometry (``tasks/mtcnn_post.py``) piece by piece: P-Net's output size and why
levels batch by exact size, the pyramid bound, NMS against a plain greedy loop, crops at and
past the image's edges."""
from __future__ import annotations

import numpy as np
import pytest

from lumen_core import models
from lumen_core.engine.session import cpu_session
from lumen_core.tasks import mtcnn_post as P


@pytest.fixture(scope="module")
def pnet(prepared_home):
    return cpu_session(models.model_dir(models.FACES, prepared_home) / "pnet.onnx",
                       intra_op_threads=1)


def _run(sess, x: np.ndarray) -> np.ndarray:
    return sess.run(["softmax"], {sess.get_inputs()[0].name: x})[0]


def test_pnet_output_size(pnet):
    for w, h in [(12, 12), (13, 12), (14, 17), (31, 40), (45, 44)]:
        out = _run(pnet, np.zeros((1, w, h, 3), np.float32))
        assert out.shape[1:3] == (P.pnet_output_size(w), P.pnet_output_size(h))


def test_padding_a_level_keeps_even_sides_exact_and_changes_odd_ones(pnet):
    """Why P-Net levels batch by their exact size: padded to a larger size, a level with even
    sides keeps every valid output cell, but P-Net's "same" 2x2 pooling makes the last cell of
    an odd side read the padding (here: the answers would change)."""
    rng = np.random.default_rng(0)
    for w, h, exact in [(40, 30, True), (41, 30, False), (40, 31, False)]:
        x = rng.uniform(-1, 1, (1, w, h, 3)).astype(np.float32)
        alone = _run(pnet, x)
        big = rng.uniform(-1, 1, (1, 48, 40, 3)).astype(np.float32)
        big[:, :w, :h] = x
        padded = _run(pnet, big)[:, :alone.shape[1], :alone.shape[2]]
        assert np.allclose(alone, padded, atol=1e-5) == exact, (w, h)


def test_pyramid_pixels_and_scales():
    scales = P.pyramid_scales(512, 512)
    assert len(scales) == 10 and scales[0] == pytest.approx(0.6)
    assert P.pyramid_pixels(512, 512) == sum(a * b for a, b in
                                             (P.level_size(512, 512, s) for s in scales))
    assert P.pyramid_scales(19, 500) == []  # shorter than a face: nothing to search
    # smaller faces cost more: a 4-pixel face makes the first level 3x the image's sides
    assert P.pyramid_pixels(100, 100, 4) > 9 * 100 * 100


def _greedy(boxes: np.ndarray, threshold: float, method: str) -> list:
    order = sorted(range(len(boxes)), key=lambda i: -boxes[i, 4])
    keep: list = []
    for i in order:
        ok = True
        for j in keep:
            a, b = boxes[i], boxes[j]
            w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]) + 1)
            h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]) + 1)
            ai = (a[2] - a[0] + 1) * (a[3] - a[1] + 1)
            aj = (b[2] - b[0] + 1) * (b[3] - b[1] + 1)
            o = w * h / (min(ai, aj) if method == "Min" else ai + aj - w * h)
            if o > threshold:
                ok = False
                break
        if ok:
            keep.append(i)
    return keep


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("method", ["Union", "Min"])
def test_nms_equals_a_plain_greedy_loop(seed, method):
    rng = np.random.default_rng(seed)
    n = 60
    xy = rng.uniform(0, 100, (n, 2))
    wh = rng.uniform(5, 40, (n, 2))
    boxes = np.hstack([xy, xy + wh, rng.permutation(n)[:, None] / n])  # distinct scores
    assert P.nms(boxes, 0.5, method).tolist() == _greedy(boxes, 0.5, method)
    assert P.nms(np.empty((0, 5)), 0.5, method).shape == (0,)


def test_crops_at_and_past_the_edges():
    img = np.arange(20 * 30 * 3, dtype=np.uint8).reshape(20, 30, 3)
    inside = np.array([[1, 10, 1, 10, 1, 10, 1, 10, 10, 10]])  # rows/cols 0..9
    dest = np.empty((24, 24, 3), np.float32)
    # boxes are 1-based there: the box 1..10 is the image's pixels 0..9
    P.crop_into(img, P.pad(np.array([[1, 1, 10, 10, 1.0]]), 30, 20)[0], dest)
    ref = np.empty_like(dest)
    P.crop_into(img, inside[0], ref)
    assert np.array_equal(dest, ref)
    # a box reaching past the top-left corner: padded with zeros there (1-based windows)
    win = P.pad(np.array([[-5, -5, 4, 4, 1.0]]), 30, 20)
    assert win[0].tolist() == [7, 10, 7, 10, 1, 4, 1, 4, 10, 10]  # 4 rows, 4 cols of image
    P.crop_into(img, win[0], dest)
    assert np.isfinite(dest).all()
    # wholly outside the image (the package raises): an all-padding crop
    out = P.pad(np.array([[50, 50, 59, 59, 1.0]]), 30, 20)
    P.crop_into(img, out[0], dest)
    assert np.allclose(dest, -P.MEAN * P.SCALE)


def test_windows_usable():
    ok = np.array([[1, 5, 1, 5, 1, 5, 1, 5, 5, 5]])
    assert P.windows_usable(ok)
    assert not P.windows_usable(np.vstack([ok, [1, 5, 1, 0, 1, 5, 1, 0, 0, 5]]))
    assert not P.windows_usable(np.vstack([ok, [1, 5, 1, -2, 1, 5, 1, 0, -2, 5]]))


def test_finish_keeps_the_best_faces_with_their_landmarks():
    total = np.array([[10, 10, 59, 59, 0.0], [12, 12, 61, 61, 0.0], [200, 200, 239, 239, 0.0]])
    score = np.array([0.9, 0.95, 0.8], np.float32)
    reg = np.zeros((3, 4), np.float32)
    points = np.tile(np.array([0.3, 0.7, 0.5, 0.35, 0.65, 0.4, 0.4, 0.6, 0.8, 0.8],
                              np.float32), (3, 1))
    boxes, marks = P.finish(total, score, reg, points, 0.85)
    assert boxes[:, 4].tolist() == pytest.approx([0.95, 0.9][:len(boxes)])
    assert len(boxes) == 1  # the two overlapping boxes: "Min" NMS keeps the better
    assert marks.shape == (1, 5, 2)
    assert marks[0, 0].tolist() == pytest.approx([12 + 0.3 * 50 - 1, 12 + 0.4 * 50 - 1])
