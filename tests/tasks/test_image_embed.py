"""image_embed (backend ``image_embedding``) end to end on a small generated vision encoder.

The reference for every embedding is the encoder run directly with ONNX Runtime on the
``clip_image_openai_v1`` recipe's output (``imaging.preprocess_clip``; the recipe itself is
checked against an independent Pillow + numpy rendering in test_image_preprocess.py), then
L2-normalised in float64.  The three routes (raw bytes, fp32 NCHW tensor, uint8 NHWC tensor)
must all land on it, alone, mixed and under concurrency.
"""
from __future__ import annotations

import asyncio
import io
import random
import struct
import zlib

import numpy as np
import onnx_models as M
import onnxruntime as ort
import pytest
from PIL import Image

import lumen_core as lc
from lumen_core.engine.buffers import BufferArena
from lumen_core.engine.plan import ImageInput, PreparedModelRequest
from lumen_core.errors import ConfigError
from lumen_core.tasks import imaging
from lumen_core.tasks.image_embedding import ImageEmbeddingBackend
from lumen_core.tasks.imaging import (
    CLIP_MEAN,
    CLIP_PREPROCESS_ID,
    CLIP_STD,
    CLIP_UINT8_PREPROCESS_ID,
)

TASK = "image_embed"
TOL = 1e-5
D_OUT = 64
LIMIT = 50_000_000
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
#: queue delay of the batch-composition tests: batches there form by filling up, long before
#: this; it only has to outlast decoding a few small pictures on a loaded box (the lone
#: warm-up request waits for it once per runtime)
BATCH_WAIT_US = 2_000_000


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("image_models")
    return {
        "enc": M.image_encoder(d / "enc.onnx", d_out=D_OUT),
        "two": M.image_encoder(d / "two.onnx", d_out=D_OUT, extra_output=True),
        "nan": M.image_encoder(d / "nan.onnx", d_out=D_OUT, nan_marker=True),
        "mlp": M.mlp(d / "mlp.onnx"),
    }


def task(model: str, **over) -> dict:
    t = {"name": TASK, "backend": "image_embedding", "model": model,
         "batching": {"max_batch_size": 16, "max_queue_delay_us": 2000}}
    t.update(over)
    return {"tasks": [t]}


def picture(w: int, h: int, seed: int, mode: str = "RGB") -> Image.Image:
    """Gradient + noise (structure for the resampler, detail for the crop) in ``mode``."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255.0 / max(w - 1, 1), yy * 255.0 / max(h - 1, 1),
                     (xx * yy) % 256], axis=-1) + rng.normal(0, 20, (h, w, 3))
    img = Image.fromarray(np.clip(base, 0, 255).astype(np.uint8), "RGB")
    if mode == "RGBA":
        img.putalpha(Image.fromarray(rng.integers(0, 256, (h, w), dtype=np.uint8), "L"))
        return img
    return img if mode == "RGB" else img.convert(mode)


def encode(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


#: (w, h, mode): landscape, portrait, exact size, upscaled, extreme-ish ratio, non-RGB modes
PICTURES = [(400, 300, "RGB"), (300, 500, "RGB"), (224, 224, "RGB"), (97, 150, "RGB"),
            (640, 200, "RGB"), (320, 240, "L"), (256, 256, "RGBA"), (300, 300, "P")]
MIME = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp"}


@pytest.fixture(scope="module")
def samples():
    """(label, encoded bytes, mime) for every picture as PNG, and as JPEG where the mode allows."""
    out = []
    for i, (w, h, mode) in enumerate(PICTURES):
        img = picture(w, h, i, mode)
        out.append((f"png-{w}x{h}-{mode}", encode(img, "PNG"), MIME["PNG"]))
        if mode in ("RGB", "L"):
            out.append((f"jpeg-{w}x{h}-{mode}", encode(img, "JPEG"), MIME["JPEG"]))
    out.append(("webp-lossless", _webp(picture(350, 260, 99)), MIME["WEBP"]))
    return out


def _webp(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "WEBP", lossless=True)
    return buf.getvalue()


def l2(x: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    return (x64 / np.linalg.norm(x64, axis=-1, keepdims=True)).astype(np.float32)


@pytest.fixture(scope="module")
def reference(models):
    sess = ort.InferenceSession(models["enc"], providers=["CPUExecutionProvider"])

    def ref(data: bytes, mime: str, normalize: bool = True) -> np.ndarray:
        x = imaging.preprocess_clip(data, mime, LIMIT)[None]
        y = sess.run(["image_embeds"], {"x": x})[0][0]
        return l2(y) if normalize else y

    return ref


def raw_req(data: bytes, mime: str, **meta):
    return lc.new_infer_request(TASK).for_raw_input(data, mime).with_metas(meta).build()


def fp32_req(data: bytes, mime: str, **meta):
    x = imaging.preprocess_clip(data, mime, LIMIT)[None]
    return (lc.new_infer_request(TASK).for_tensor_array(x, "NCHW", CLIP_PREPROCESS_ID)
            .with_metas(meta).build())


def uint8_req(data: bytes, mime: str, **meta):
    u = imaging.preprocess_clip_uint8(data, mime, LIMIT)[None]
    return (lc.new_infer_request(TASK).for_tensor_array(u, "NHWC", CLIP_UINT8_PREPROCESS_ID)
            .with_metas(meta).build())


ROUTES = {"raw": raw_req, "fp32": fp32_req, "uint8": uint8_req}


@pytest.fixture(scope="module")
def rt(models):
    """One background runtime shared by the single-request tests (start-up is the slow part)."""
    runtime = lc.Runtime.from_dict(task(models["enc"], batching={"max_queue_delay_us": 0}))
    with runtime:
        yield runtime


# --------------------------------------------------------------------------- the plan
def test_image_input_plan_normalises_uint8_items_into_their_slots_and_copies_fp32_runs():
    rng = np.random.default_rng(0)
    plan = ImageInput("x", CLIP_MEAN, CLIP_STD, 224, 224)
    hwcs = [rng.integers(0, 256, (224, 224, 3), dtype=np.uint8) for _ in range(3)]
    chws = [rng.standard_normal((1, 3, 224, 224)).astype(np.float32) for _ in range(3)]
    # u, f, f, u, f, u: runs of fp32 items of length 2 and 1 between uint8 items
    kinds = ["u", "f", "f", "u", "f", "u"]
    items, expected = [], []
    for k in kinds:
        if k == "u":
            h = hwcs.pop()
            h.flags.writeable = False  # decoded images are read-only views of Pillow's bytes
            items.append(PreparedModelRequest("sig", (h,), (3, 224, 224)))
            expected.append(((h / 255.0 - np.asarray(CLIP_MEAN)) / np.asarray(CLIP_STD)).transpose(2, 0, 1))
        else:
            c = chws.pop()
            items.append(PreparedModelRequest("sig", (memoryview(c),), (3, 224, 224)))
            expected.append(c[0])
    arena = BufferArena()
    arena.get("x", (8, 3, 224, 224), np.float32).fill(np.nan)  # stale contents must be overwritten
    stats: dict = {}
    out = plan.assemble(items, arena, stats)["x"]
    assert out.shape == (6, 3, 224, 224) and out.dtype == np.float32
    for i, e in enumerate(expected):
        np.testing.assert_allclose(out[i], e, atol=TOL, err_msg=f"slot {i} ({kinds[i]})")
    assert stats == {"normalised_images": 3, "copied_images": 3}


# --------------------------------------------------------------------------- routes agree
def test_three_routes_give_the_reference_embedding_for_every_picture(rt, samples, reference):
    for label, data, mime in samples:
        want = reference(data, mime)
        got = {name: rt.infer_sync(make(data, mime)).outputs["embedding"]
               for name, make in ROUTES.items()}
        for name, emb in got.items():
            assert emb.shape == (D_OUT,) and emb.dtype == np.float32, (label, name)
            np.testing.assert_allclose(emb, want, atol=TOL, err_msg=f"{label} via {name}")
            assert abs(float(np.linalg.norm(emb)) - 1.0) < 1e-5
        # identical model inputs: the routes agree with each other far below the tolerance
        np.testing.assert_allclose(got["raw"], got["uint8"], atol=1e-6, err_msg=label)
        np.testing.assert_allclose(got["raw"], got["fp32"], atol=1e-6, err_msg=label)


def test_raw_route_applies_exif_orientation(rt, reference):
    img = picture(300, 200, 7)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW to display
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=95, exif=exif)
    tagged = buf.getvalue()
    got = rt.infer_sync(raw_req(tagged, "image/jpeg")).outputs["embedding"]
    np.testing.assert_allclose(got, reference(tagged, "image/jpeg"), atol=TOL)
    # the upright picture is portrait: same pixels as the untagged JPEG rotated
    plain = rt.infer_sync(raw_req(encode(img, "JPEG"), "image/jpeg")).outputs["embedding"]
    assert not np.allclose(got, plain, atol=1e-3)


def test_normalize_false_returns_the_raw_model_output(models, samples, reference):
    label, data, mime = samples[0]
    cfg = task(models["enc"], options={"normalize": False})
    with lc.Runtime.from_dict(cfg) as runtime:
        got = runtime.infer_sync(raw_req(data, mime)).outputs["embedding"]
    np.testing.assert_allclose(got, reference(data, mime, normalize=False), rtol=1e-5, atol=1e-5)
    assert abs(float(np.linalg.norm(got)) - 1.0) > 1e-3  # really not normalised


def test_output_option_picks_the_returned_output(models, samples):
    label, data, mime = samples[0]
    cfg = task(models["two"], options={"output": "patch_tokens"})
    with lc.Runtime.from_dict(cfg) as runtime:
        emb = runtime.infer_sync(raw_req(data, mime)).outputs["embedding"]
        assert runtime.describe()[TASK]["model_output"] == "patch_tokens"
    assert emb.shape == (16 * 14 * 14,)


# --------------------------------------------------------------------------- concurrency
def test_mixed_concurrent_raw_and_tensor_callers_each_get_their_own_result(models, samples,
                                                                             reference):
    jobs = [(label, data, mime, route) for label, data, mime in samples for route in ROUTES]
    random.Random(5).shuffle(jobs)
    assert len(jobs) >= 36  # dozens of callers
    want = {label: reference(data, mime) for label, data, mime in samples}
    reqs = [ROUTES[route](data, mime) for _, data, mime, route in jobs]  # client-side work first

    async def main():
        async with lc.Runtime.from_dict(task(models["enc"])) as runtime:
            return await asyncio.gather(*[runtime.infer(r) for r in reqs])

    res = asyncio.run(main())
    for (label, _, _, route), r in zip(jobs, res, strict=True):
        np.testing.assert_allclose(r.outputs["embedding"], want[label], atol=TOL,
                                   err_msg=f"{label} via {route}")
    assert max(int(r.meta["lumen.batch.size"]) for r in res) > 1


def test_raw_and_fp32_share_batches_and_uint8_never_joins_them(models, samples, monkeypatch):
    """8 raw + 8 fp32 requests fill one batch of 16 (neither route could alone); 16 uint8
    requests of the same pictures fill their own.  A spy on postprocess sees every batch."""
    seen: list = []
    original = ImageEmbeddingBackend.postprocess

    def spy(self, outputs, items):
        # a raw item carries its decoded uint8 HWC pixels, an fp32 tensor item its buffer
        seen.append([(it.signature[-1], "raw" if isinstance(it.tensors[0], np.ndarray)
                      and it.tensors[0].dtype == np.uint8 else "tensor") for it in items])
        return original(self, outputs, items)

    monkeypatch.setattr(ImageEmbeddingBackend, "postprocess", spy)
    pics = [(d, m) for _, d, m in samples[:8]]
    reqs = ([raw_req(d, m) for d, m in pics] + [fp32_req(d, m) for d, m in pics]
            + [uint8_req(d, m) for d, m in pics * 2])
    random.Random(1).shuffle(reqs)
    # a long delay: a batch forms only when 16 requests of one signature are queued
    cfg = task(models["enc"], batching={"max_batch_size": 16, "max_queue_delay_us": BATCH_WAIT_US})

    async def main():
        async with lc.Runtime.from_dict(cfg) as runtime:
            seen.clear()  # drop the warm-up batches
            return await asyncio.gather(*[runtime.infer(r) for r in reqs])

    res = asyncio.run(main())
    assert [int(r.meta["lumen.batch.size"]) for r in res] == [16] * 32
    assert len(seen) == 2
    for batch in seen:
        ids = {pp for pp, _ in batch}
        assert len(ids) == 1, f"preprocess ids mixed in one batch: {ids}"
    v1 = next(b for b in seen if b[0][0] == CLIP_PREPROCESS_ID)
    assert sorted(ctx for _, ctx in v1) == ["raw"] * 8 + ["tensor"] * 8


def test_non_finite_output_is_refused_for_that_request_only(models, samples):
    _, data, mime = samples[0]
    x = imaging.preprocess_clip(data, mime, LIMIT)[None]
    poisoned = x.copy()
    poisoned[0, 0, 0, 0] = -2 * M.NAN_MARKER_OFFSET  # sqrt(negative) inside the model
    sess = ort.InferenceSession(models["nan"], providers=["CPUExecutionProvider"])
    want = l2(sess.run(["image_embeds"], {"x": x})[0][0])
    reqs = [lc.new_infer_request(TASK).for_tensor_array(poisoned if i == 3 else x, "NCHW",
                                                        CLIP_PREPROCESS_ID).build()
            for i in range(7)] + [raw_req(data, mime)]
    cfg = task(models["nan"], batching={"max_batch_size": 8, "max_queue_delay_us": BATCH_WAIT_US})

    async def main():
        async with lc.Runtime.from_dict(cfg) as runtime:
            return await asyncio.gather(*[runtime.infer(r) for r in reqs], return_exceptions=True)

    res = asyncio.run(main())
    assert isinstance(res[3], lc.InternalError) and "non-finite" in res[3].message
    for i, r in enumerate(res):
        if i != 3:
            np.testing.assert_allclose(r.outputs["embedding"], want, atol=TOL)
            assert r.meta["lumen.batch.size"] == "8"  # it shared the poisoned request's batch


# --------------------------------------------------------------------------- rejections
def png_declaring(width: int, height: int) -> bytes:
    """A PNG whose (CRC-valid) header declares ``width`` x ``height``: a decompression bomb is
    refused from the header alone, before any pixel data is read."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    idat = zlib.compress(b"\x00" * 64)
    body = (struct.pack(">I", len(ihdr)) + chunk + struct.pack(">I", zlib.crc32(chunk))
            + struct.pack(">I", len(idat)) + b"IDAT" + idat
            + struct.pack(">I", zlib.crc32(b"IDAT" + idat)))
    return PNG_SIGNATURE + body + struct.pack(">I", 0) + b"IEND" + struct.pack(">I", zlib.crc32(b"IEND"))


def _tensor(dtype, shape, layout, pp, **meta):
    arr = np.zeros(shape, dtype=dtype)
    return lc.new_infer_request(TASK).for_tensor_array(arr, layout, pp).with_metas(meta).build()


def _bad_length():
    req = _tensor(np.float32, (1, 3, 224, 224), "NCHW", CLIP_PREPROCESS_ID)
    req.payload = bytes(memoryview(req.payload).cast("B"))[:-4]
    return req


def _png(w=64, h=48):
    return encode(picture(w, h, 3), "PNG")


REJECTIONS = {
    "text mime": (lambda: raw_req(b"a cat", "text/plain"), lc.UnsupportedMediaType, "payload_mime"),
    "gif mime": (lambda: raw_req(b"GIF89a" + b"\0" * 32, "image/gif"), lc.UnsupportedMediaType,
                 "payload_mime"),
    "lying mime": (lambda: raw_req(encode(picture(64, 48, 1), "JPEG"), "image/png"),
                   lc.InvalidArgument, "payload"),
    "garbage bytes": (lambda: raw_req(b"\x00\x01garbage" * 50, "image/jpeg"), lc.InvalidArgument,
                      "payload"),
    "corrupt png body": (lambda: raw_req(PNG_SIGNATURE + b"\x00" * 200, "image/png"),
                         lc.InvalidArgument, "payload"),
    "truncated png": (lambda: raw_req(_png()[:-60], "image/png"), lc.InvalidArgument, "payload"),
    "truncated jpeg": (lambda: raw_req(encode(picture(200, 150, 2), "JPEG")[:600], "image/jpeg"),
                       lc.InvalidArgument, "payload"),
    "empty payload": (lambda: raw_req(b"", "image/png"), lc.InvalidArgument, "payload"),
    "bomb header": (lambda: raw_req(png_declaring(30000, 30000), "image/png"), lc.InvalidArgument,
                    "payload"),
    "thin strip bomb": (lambda: raw_req(png_declaring(1, 60000), "image/png"), lc.InvalidArgument,
                        "payload"),
    "raw with uint8 id": (lambda: raw_req(_png(), "image/png",
                                          **{"lumen.preprocess.id": CLIP_UINT8_PREPROCESS_ID}),
                          lc.InvalidArgument, "lumen.preprocess.id"),
    "unknown preprocess id": (lambda: _tensor(np.float32, (1, 3, 224, 224), "NCHW", "siglip_v1"),
                              lc.InvalidArgument, "lumen.preprocess.id"),
    "fp32 with uint8 id": (lambda: _tensor(np.float32, (1, 3, 224, 224), "NCHW",
                                           CLIP_UINT8_PREPROCESS_ID),
                           lc.InvalidArgument, "lumen.preprocess.id"),
    "uint8 with fp32 id": (lambda: _tensor(np.uint8, (1, 224, 224, 3), "NHWC", CLIP_PREPROCESS_ID),
                           lc.InvalidArgument, "lumen.preprocess.id"),
    "wrong size": (lambda: _tensor(np.float32, (1, 3, 256, 256), "NCHW", CLIP_PREPROCESS_ID),
                   lc.InvalidArgument, "lumen.tensor.shape"),
    "payload batch": (lambda: _tensor(np.float32, (2, 3, 224, 224), "NCHW", CLIP_PREPROCESS_ID),
                      lc.InvalidArgument, "lumen.tensor.shape"),
    "uint8 in CHW order": (lambda: _tensor(np.uint8, (1, 3, 224, 224), "NHWC",
                                           CLIP_UINT8_PREPROCESS_ID),
                           lc.InvalidArgument, "lumen.tensor.shape"),
    "rank 3 layout": (lambda: _tensor(np.float32, (3, 224, 224), "CHW", CLIP_PREPROCESS_ID),
                      lc.InvalidArgument, "lumen.tensor.layout"),
    "fp16": (lambda: _tensor(np.float16, (1, 3, 224, 224), "NCHW", CLIP_PREPROCESS_ID),
             lc.InvalidArgument, "lumen.tensor.dtype"),
    "int64": (lambda: _tensor(np.int64, (1, 3, 224, 224), "NCHW", CLIP_PREPROCESS_ID),
              lc.InvalidArgument, "lumen.tensor.dtype"),
    "payload length": (_bad_length, lc.InvalidArgument, "payload"),
    "model id": (lambda: _tensor(np.float32, (1, 3, 224, 224), "NCHW", CLIP_PREPROCESS_ID,
                                 **{"lumen.model.id": "siglip"}),
                 lc.InvalidArgument, "lumen.model.id"),
}


@pytest.mark.parametrize("case", list(REJECTIONS))
def test_rejection(rt, case):
    make, cls, field = REJECTIONS[case]
    with pytest.raises(cls) as info:
        rt.infer_sync(make())
    assert type(info.value) is cls
    assert info.value.field == field, info.value
    assert info.value.message


def test_bombs_name_the_config_key_and_the_limit_is_per_task(models):
    data = _png(400, 300)  # 120k pixels
    with lc.Runtime.from_dict(task(models["enc"], options={"max_image_pixels": 100_000})) as small:
        with pytest.raises(lc.InvalidArgument) as info:
            small.infer_sync(raw_req(data, "image/png"))
        assert "options.max_image_pixels" in info.value.message
        # 300x200 is below the limit, and so is its 336x224 resize
        assert small.infer_sync(raw_req(_png(300, 200), "image/png")).outputs["embedding"].shape == (D_OUT,)


def test_a_rejected_request_does_not_disturb_concurrent_ones(models, samples, reference):
    good = [(d, m) for _, d, m in samples[:6]]
    bad = [raw_req(png_declaring(30000, 30000), "image/png"),
           raw_req(_png()[:-60], "image/png"), raw_req(b"junk", "image/webp")]
    reqs = [raw_req(d, m) for d, m in good] + bad + [uint8_req(d, m) for d, m in good]

    async def main():
        async with lc.Runtime.from_dict(task(models["enc"])) as runtime:
            return await asyncio.gather(*[runtime.infer(r) for r in reqs], return_exceptions=True)

    res = asyncio.run(main())
    want = [reference(d, m) for d, m in good] * 2
    got = res[:6] + res[9:]
    for r, w in zip(got, want, strict=True):
        np.testing.assert_allclose(r.outputs["embedding"], w, atol=TOL)
    assert all(isinstance(r, lc.InvalidArgument) and r.field == "payload" for r in res[6:9])


# --------------------------------------------------------------------------- configuration
CONFIG_ERRORS = {
    "unknown option": ({"options": {"mean": [0.5, 0.5, 0.5]}}, "enc", "options.mean"),
    "unknown recipe": ({"options": {"preprocess_id": "siglip_v1"}}, "enc", "options.preprocess_id"),
    "bad normalize": ({"options": {"normalize": "yes"}}, "enc", "options.normalize"),
    "bad pixel limit": ({"options": {"max_image_pixels": 0}}, "enc", "options.max_image_pixels"),
    "ambiguous output": ({}, "two", "options.output"),
    "missing output": ({"options": {"output": "pooled"}}, "two", "options.output"),
    "not an image encoder": ({}, "mlp", "model"),
    "no model": ({}, None, "model"),
}


@pytest.mark.parametrize("case", list(CONFIG_ERRORS))
def test_config_errors_name_the_key(models, case):
    over, model, key = CONFIG_ERRORS[case]
    cfg = task(models[model] if model else "", **over)

    async def main():
        async with lc.Runtime.from_dict(cfg):
            pass

    with pytest.raises(ConfigError) as info:
        asyncio.run(main())
    assert info.value.key == f"tasks[0].{key}", info.value


def test_describe_lists_both_tensor_signatures_and_the_raw_recipe(rt):
    d = rt.describe()[TASK]
    assert d["raw_mimes"] == ["image/jpeg", "image/png", "image/webp"]
    assert d["raw_preprocess_ids"] == [CLIP_PREPROCESS_ID]
    sigs = {(s["dtype"], s["layout"], tuple(s["preprocess_ids"])): s["shape"]
            for s in d["tensor_signatures"]}
    assert sigs == {("fp32", "NCHW", (CLIP_PREPROCESS_ID,)): [1, 3, 224, 224],
                    ("uint8", "NHWC", (CLIP_UINT8_PREPROCESS_ID,)): [1, 224, 224, 3]}
