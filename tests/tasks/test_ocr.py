"""The ``ocr`` task against rapidocr 3.10.0's own readings of the fixture images, concurrent
answers equal to answers alone, the tensor route, bad input, and HTTP / gRPC.

One runtime for the module (three models on two cores are slow to load and run); the fixture
images go through once, concurrently, and the other tests reuse those answers.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import FIXTURES
from image_support import png_bomb, png_bytes
from PIL import Image

import lumen_core as lc
from lumen_core import models

OCR_DIR = FIXTURES / "ocr"
REF = json.loads((OCR_DIR / "rapidocr_reference.json").read_text())
MIME = {"png": "image/png", "jpg": "image/jpeg"}


def raw(path_or_bytes, mime: str = "image/png") -> lc.InferRequest:
    data = path_or_bytes if isinstance(path_or_bytes, bytes) else path_or_bytes.read_bytes()
    return lc.new_infer_request("ocr").for_raw_input(data, mime).build()


def fixture_request(name: str) -> lc.InferRequest:
    return raw(OCR_DIR / name, MIME[name.rsplit(".", 1)[1]])


@pytest.fixture(scope="module")
def rt(prepared_home):
    directory = str(models.model_dir(models.OCR, prepared_home))
    cfg = {"tasks": [{"name": "ocr", "backend": "ocr", "intra_op_threads": 1,
                      "model": directory, "batching": {"max_queue_delay_us": 5000}},
                     {"name": "ocr_one_queued", "backend": "ocr", "intra_op_threads": 1,
                      "model": directory, "batching": {"max_queue_size": 1}}],
           "server": {"max_payload_bytes": 4_000_000}}
    runtime = lc.Runtime.from_dict(cfg)
    with runtime:
        yield runtime


@pytest.fixture(scope="module")
def together(rt):
    """Every fixture image at once (one group: det / cls / rec batches span images)."""
    reqs = [fixture_request(im["file"]) for im in REF["images"]]
    out = rt.infer_many_sync(reqs)
    for r in out:
        assert isinstance(r, lc.InferResponse), r
    return {im["file"]: r.outputs["lines"] for im, r in zip(REF["images"], out, strict=True)}


def test_same_answers_as_rapidocr(together):
    same = total = 0
    for im in REF["images"]:
        lines = together[im["file"]]
        assert len(lines) == len(im["texts"]), im["file"]
        for line, text, score, box in zip(lines, im["texts"], im["scores"], im["boxes"],
                                          strict=True):
            total += 1
            # boxes on every line; scores where the text is the same (a line read otherwise
            # has the score of that other reading); texts counted
            assert np.abs(np.array(line["box"]) - np.array(box)).max() <= 3, im["file"]
            if line["text"] == text:
                same += 1
                assert abs(line["score"] - score) <= 0.02, (im["file"], text)
            assert set(line) == {"text", "score", "box"}
    assert total == 45
    assert same >= 0.95 * total, f"{same}/{total} lines read like rapidocr"


def test_alone_equals_together_and_tensor_route(rt, together):
    """An image's answer does not depend on which requests its crops batched with (width
    buckets), and the uint8 RGB tensor route equals the raw route."""
    for name in ("ocr_11_02.png", "ocr_11_06.jpg"):
        alone = rt.infer_sync(fixture_request(name)).outputs["lines"]
        _same_lines(alone, together[name])
    name = "ocr_11_07.png"
    rgb = np.asarray(Image.open(OCR_DIR / name).convert("RGB"))
    req = (lc.new_infer_request("ocr")
           .for_tensor_array(rgb[None], layout="NHWC", preprocess_id="rgb_uint8_v1").build())
    _same_lines(rt.infer_sync(req).outputs["lines"], together[name])


def test_many_concurrent_callers(rt, together):
    """12 threads calling at once (two images, six callers each): crops of different
    requests share cls / rec batches, and every caller gets its own image's answer."""
    from concurrent.futures import ThreadPoolExecutor

    names = ["ocr_11_01.png", "ocr_11_09.png"] * 6
    before = rt.load()["ocr"]["steps"]["rec"]["batches"]
    with ThreadPoolExecutor(len(names)) as pool:
        outs = list(pool.map(lambda n: rt.infer_sync(fixture_request(n)), names))
    for name, resp in zip(names, outs, strict=True):
        _same_lines(resp.outputs["lines"], together[name])
    rec = rt.load()["ocr"]["steps"]["rec"]
    crops = sum(len(together[n]) for n in names)
    assert rec["batches"] - before < crops  # recognition batched crops across requests


def _same_lines(a: list, b: list) -> None:
    assert [x["text"] for x in a] == [x["text"] for x in b]
    for x, y in zip(a, b, strict=True):
        assert x["box"] == y["box"]
        assert abs(x["score"] - y["score"]) <= 1e-3


def test_bad_input_fails_alone(rt, together):
    black = png_bytes(Image.new("RGB", (1, 1), (0, 0, 0)))
    bomb = png_bomb()  # a header declaring 60000 x 60000 pixels: refused before any decode
    reqs = [raw(black), raw(b"not an image at all"), raw(b"%PDF-1.4", "application/pdf"),
            raw(bomb), fixture_request("ocr_11_04.jpg"), raw(b"x" * 4_000_001)]
    out = rt.infer_many_sync(reqs)
    assert out[0].outputs["lines"] == []
    assert isinstance(out[1], lc.InvalidArgument) and out[1].field == "payload"
    assert isinstance(out[2], lc.UnsupportedMediaType)
    assert isinstance(out[3], lc.InvalidArgument) and "pixels" in out[3].message
    _same_lines(out[4].outputs["lines"], together["ocr_11_04.jpg"])
    assert isinstance(out[5], lc.PayloadTooLarge)
    # a tensor of the wrong preprocess id is refused by the contract
    bad = (lc.new_infer_request("ocr").for_tensor_array(
        np.zeros((1, 8, 8, 3), np.uint8), layout="NHWC", preprocess_id="clip_image_openai_v1")
        .build())
    with pytest.raises(lc.InvalidArgument):
        rt.infer_sync(bad)


@pytest.mark.parametrize("h,w", [(2, 400), (1, 2000), (250, 2000), (2000, 250), (1000, 1000),
                                 (29, 2001), (31, 7), (1, 1), (2000, 2000), (5000, 40),
                                 (16384, 1), (3, 900)])
def test_detector_input_size_is_computed_without_pixels(h, w):
    from lumen_core.tasks import ocr_post as P

    img, _rh, _rw = P.resize_within_bounds(np.zeros((h, w, 3), np.uint8))
    det = None
    if img is not None:
        img, _top = P.vertical_padding(img)
        det = P.det_resize(img)
    assert P.det_input_size(h, w) == (None if det is None else det.shape[:2])


def test_an_extreme_aspect_is_refused_before_any_work(rt):
    """A 400x2 PNG (under 100 bytes) would be a 6016x1504 detector input (10 s, 1.6 GB):
    refused from its size, by the raw and the tensor route."""
    import time

    strip = png_bytes(Image.new("RGB", (400, 2), (255, 255, 255)))
    assert len(strip) < 100
    t0 = time.monotonic()
    with pytest.raises(lc.InvalidArgument, match="max_det_pixels") as ei:
        rt.infer_sync(raw(strip))
    assert ei.value.field == "payload" and "6016x1504" in ei.value.message
    tensor = (lc.new_infer_request("ocr").for_tensor_array(
        np.full((1, 2, 600, 3), 255, np.uint8), layout="NHWC", preprocess_id="rgb_uint8_v1")
        .build())
    with pytest.raises(lc.InvalidArgument, match="max_det_pixels") as ei:
        rt.infer_sync(tensor)
    assert ei.value.field == "lumen.tensor.shape"
    assert time.monotonic() - t0 < 2.0  # nothing was resized, padded or detected


def _dense_page(side: int) -> bytes:
    """A page of small dense text: lines of words in PIL's default font, 12 pixels apart."""
    from PIL import ImageDraw

    img = Image.new("RGB", (side, side), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    words = ("lorem", "ipsum", "dolor", "sit", "amet", "text", "small", "page", "42")
    for row, y in enumerate(range(2, side - 10, 12)):
        x = 2
        while x < side - 40:
            word = words[(row * 7 + x) % len(words)]
            draw.text((x, y), word, fill=(0, 0, 0))
            x += 6 * len(word) + 6
    return png_bytes(img)


def test_a_request_fans_out_to_all_its_lines_whatever_the_queue_size(rt):
    """With one request admitted at a time, cls and rec still hold every line of it (80
    words here, over the 64 items per admitted request the steps held before)."""
    from PIL import ImageDraw

    img = Image.new("RGB", (800, 1000), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    for row in range(10):
        for col in range(8):
            draw.text((10 + col * 100, 20 + row * 95), "word", fill=(0, 0, 0))
    req = (lc.new_infer_request("ocr_one_queued").for_raw_input(png_bytes(img), "image/png")
           .build())
    lines = rt.infer_sync(req).outputs["lines"]
    assert rt.load()["ocr_one_queued"]["steps"]["cls"]["items"] > 64
    assert len(lines) > 64


def test_a_dense_page_is_refused_by_the_recognition_budget(rt):
    """A 1000x1000 page of small text (83 lines, 11.8 M pixels to recognise: 26 s of CPU and
    6 GB) is refused once the detector has found its lines, before any is classified or
    read; a page within the budget is read."""
    steps = rt.load()["ocr"]["steps"]
    cls_items, rec_items = steps["cls"]["items"], steps["rec"]["items"]
    with pytest.raises(lc.PayloadTooLarge, match="max_rec_pixels") as ei:
        rt.infer_sync(raw(_dense_page(1000)))
    assert ei.value.field == "payload"
    steps = rt.load()["ocr"]["steps"]
    assert (steps["cls"]["items"], steps["rec"]["items"]) == (cls_items, rec_items)
    assert rt.describe("ocr")["max_rec_pixels"] == 8_000_000


def test_deadline_and_step_stats(rt):
    req = (lc.new_infer_request("ocr").for_raw_input((OCR_DIR / "ocr_11_03.png").read_bytes(),
                                                      "image/png")
           .with_meta("lumen.timeout_ms", "1").build())
    with pytest.raises(lc.DeadlineExceeded):
        rt.infer_sync(req)
    desc = rt.describe("ocr")
    assert desc["steps"] == ["det", "cls", "rec"] and desc["raw_mimes"]
    load = rt.load()["ocr"]
    assert load["pending"] == 0
    # the fixture images' crops batched across requests in the cls and rec steps
    steps = load["steps"]
    assert steps["cls"]["max_batch_size"] > 1 and steps["rec"]["items"] >= 45
    assert steps["det"]["compute_us"] > 0


def test_http_and_grpc(prepared_home, together):
    import grpc
    import httpx
    from serve_support import ServerThread, lumen_home_env

    from lumen_core.serve.proto import lumen_pb2, lumen_pb2_grpc

    with lumen_home_env(prepared_home):
        cfg = {"tasks": [{"name": "ocr", "backend": "ocr", "intra_op_threads": 1}],
               "server": {"max_payload_bytes": 4_000_000}}
        srv = ServerThread(lc.Runtime.from_dict(cfg))
    try:
        name = "ocr_11_08.png"
        data = (OCR_DIR / name).read_bytes()
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            r = c.post("/v1/infer/ocr", content=data, headers={"content-type": "image/png"})
            assert r.status_code == 200, r.text
            _same_lines(r.json()["lines"], together[name])
            r = c.post("/v1/infer/ocr", content=b"garbage", headers={"content-type": "image/png"})
            assert r.status_code == 400 and r.json()["error"]["field"] == "payload"
            r = c.post("/v1/infer/ocr", content=b"garbage", headers={"content-type": "text/plain"})
            assert r.status_code == 415
            # (a body over max_payload_bytes is a 413 before it is read: tests/serve/test_http)
            r = c.post("/v1/infer/ocr", content=png_bytes(Image.new("RGB", (1, 1))),
                       headers={"content-type": "image/png"})
            assert r.status_code == 200 and r.json()["lines"] == []
        with grpc.insecure_channel(srv.grpc_target) as ch:
            stub = lumen_pb2_grpc.InferenceStub(ch)
            resp = stub.Infer(lumen_pb2.InferRequest(task="ocr", payload=data,
                                                     payload_mime="image/png"), timeout=60)
            t = resp.outputs["lines"]
            assert t.dtype == "json"
            _same_lines(json.loads(t.data), together[name])
    finally:
        srv.stop()


def test_default_tables_and_config_errors(prepared_home, tmp_path):
    from serve_support import lumen_home_env

    from lumen_core.tasks import default_task_tables

    with lumen_home_env(prepared_home):
        (table,) = [t for t in default_task_tables() if t["name"] == "ocr"]
    # the detector (70% of the model time) and the recogniser on every core, not one
    n = max(1, min(os.cpu_count() or 1, 4))
    assert table["options"]["det_instances"] == table["options"]["rec_instances"] == n
    with lumen_home_env(tmp_path):  # nothing prepared: no ocr default task, a clear error
        assert "ocr" not in [t["name"] for t in default_task_tables()]
        with pytest.raises(lc.ModelMissingError, match="lumen models prepare"):
            with lc.Runtime.from_dict({"tasks": [{"name": "ocr", "backend": "ocr"}]}):
                pass
    with pytest.raises(lc.ConfigError, match=r"tasks\[0\]\.model"):
        with lc.Runtime.from_dict({"tasks": [{"name": "ocr", "backend": "ocr",
                                              "model": str(tmp_path / "none")}]}):
            pass
