"""CLIP image preprocessing: the fused normalise kernel (both twins, ``image`` fixture) and the
decode/resize recipe (``lumen_core.tasks.imaging``).

Every end-to-end check compares against an independent, plain Pillow + numpy rendering of the
recipe (float64 maths, no lookup table), so a shared mistake in our helpers cannot hide.
"""
from __future__ import annotations

import io
import struct
import warnings
import zlib

import numpy as np
import pytest
from PIL import ExifTags, Image, ImageOps

from lumen_core import native
from lumen_core.errors import InvalidArgument, UnsupportedMediaType
from lumen_core.tasks import imaging
from lumen_core.tasks.imaging import CLIP_MEAN, CLIP_SIZE, CLIP_STD

TOL = 1e-5
#: generous limit for tests that are not about the pixel limit
BIG_LIMIT = 50_000_000
MEAN64 = np.asarray(CLIP_MEAN, dtype=np.float64)
STD64 = np.asarray(CLIP_STD, dtype=np.float64)


def numpy_reference(hwc: np.ndarray, mean=MEAN64, std=STD64) -> np.ndarray:
    """The formula as written: ((x / 255) - mean) / std, then HWC -> CHW."""
    return (((hwc / 255.0) - mean) / std).transpose(2, 0, 1)


def pillow_reference(data: bytes) -> np.ndarray:
    """Plain recipe: open, EXIF-upright, RGB, torchvision Resize(224, BICUBIC) + CenterCrop(224)."""
    im = ImageOps.exif_transpose(Image.open(io.BytesIO(data)))
    im = im.convert("RGB")
    w, h = im.size
    if w <= h:
        new_w, new_h = CLIP_SIZE, int(CLIP_SIZE * h / w)
    else:
        new_w, new_h = int(CLIP_SIZE * w / h), CLIP_SIZE
    im = im.resize((new_w, new_h), Image.BICUBIC)
    top = int(round((new_h - CLIP_SIZE) / 2.0))
    left = int(round((new_w - CLIP_SIZE) / 2.0))
    hwc = np.asarray(im, dtype=np.float64)[top:top + CLIP_SIZE, left:left + CLIP_SIZE]
    return numpy_reference(hwc)


def pattern(w: int, h: int, seed: int) -> np.ndarray:
    """A smooth gradient plus noise: structure for the resampler, detail for the crop."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([xx * 255.0 / max(w - 1, 1), yy * 255.0 / max(h - 1, 1),
                     (xx + yy) * 127.0 / max(w + h - 2, 1)], axis=-1)
    noisy = base + rng.normal(0, 25, size=base.shape)
    return np.clip(noisy, 0, 255).astype(np.uint8)


def encode(img: Image.Image, fmt: str, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


def make_image(mode: str, w: int, h: int, seed: int = 0) -> Image.Image:
    rgb = Image.fromarray(pattern(w, h, seed), "RGB")
    if mode == "RGB":
        return rgb
    if mode == "RGBA":
        alpha = Image.fromarray(pattern(w, h, seed + 1)[:, :, 0], "L")
        out = rgb.copy()
        out.putalpha(alpha)
        return out
    if mode == "P":
        return rgb.quantize(colors=64)
    if mode == "P_transparent":
        pal = rgb.quantize(colors=64)
        pal.info["transparency"] = 3
        return pal
    return rgb.convert(mode)  # L, LA, CMYK


# ----------------------------------------------------------------------------- the kernel


@pytest.mark.parametrize("h,w", [(1, 1), (7, 13), (224, 224), (97, 300)])
def test_kernel_matches_numpy_reference(image, h, w):
    src = np.random.default_rng(h * 1000 + w).integers(0, 256, (h, w, 3), dtype=np.uint8)
    dest = np.empty((3, h, w), dtype=np.float32)
    out = image.normalize_hwc_to_chw(src, dest, CLIP_MEAN, CLIP_STD)
    assert out is dest
    np.testing.assert_allclose(dest, numpy_reference(src), rtol=0, atol=TOL)


def test_kernel_twins_bit_identical(image):
    src = np.random.default_rng(7).integers(0, 256, (61, 45, 3), dtype=np.uint8)
    ours = image.normalize_hwc_to_chw(src, np.empty((3, 61, 45), np.float32),
                                      CLIP_MEAN, CLIP_STD)
    pure = native.pure("image").normalize_hwc_to_chw(src, np.empty((3, 61, 45), np.float32),
                                                     CLIP_MEAN, CLIP_STD)
    assert np.array_equal(ours, pure)


def test_kernel_covers_every_level(image):
    # all 256 values in every channel: the whole lookup table is exercised
    levels = np.arange(256, dtype=np.uint8)
    src = np.ascontiguousarray(np.stack([levels, levels[::-1], levels * np.uint8(7)], -1)[None])
    dest = np.empty((3, 1, 256), np.float32)
    image.normalize_hwc_to_chw(src, dest, CLIP_MEAN, CLIP_STD)
    np.testing.assert_allclose(dest, numpy_reference(src), rtol=0, atol=TOL)


def test_kernel_writes_only_its_batch_slot_from_readonly_src(image):
    src = np.random.default_rng(1).integers(0, 256, (20, 30, 3), dtype=np.uint8)
    src.flags.writeable = False
    batch = np.full((4, 3, 20, 30), np.nan, dtype=np.float32)
    image.normalize_hwc_to_chw(src, batch[2], CLIP_MEAN, CLIP_STD)
    np.testing.assert_allclose(batch[2], numpy_reference(src), rtol=0, atol=TOL)
    assert np.isnan(batch[[0, 1, 3]]).all()


def test_kernel_other_mean_std(image):
    src = np.random.default_rng(2).integers(0, 256, (5, 6, 3), dtype=np.uint8)
    dest = np.empty((3, 5, 6), np.float32)
    image.normalize_hwc_to_chw(src, dest, [0.0, 0.0, 0.0], (1.0, 1.0, 1.0))
    np.testing.assert_allclose(dest, src.transpose(2, 0, 1) / 255.0, rtol=0, atol=TOL)


def test_kernel_empty_image(image):
    src = np.zeros((0, 5, 3), np.uint8)
    dest = np.empty((3, 0, 5), np.float32)
    assert image.normalize_hwc_to_chw(src, dest, CLIP_MEAN, CLIP_STD) is dest


_GOOD_SRC = np.zeros((4, 6, 3), np.uint8)
_GOOD_DEST = np.zeros((3, 4, 6), np.float32)
_READONLY_DEST = np.zeros((3, 4, 6), np.float32)
_READONLY_DEST.flags.writeable = False


@pytest.mark.parametrize(
    "src,dest,mean,std",
    [
        (_GOOD_SRC.astype(np.float32), _GOOD_DEST, CLIP_MEAN, CLIP_STD),
        (np.zeros((4, 6, 4), np.uint8), _GOOD_DEST, CLIP_MEAN, CLIP_STD),
        (np.zeros((4, 6), np.uint8), _GOOD_DEST, CLIP_MEAN, CLIP_STD),
        (np.zeros((4, 12, 3), np.uint8)[:, ::2], _GOOD_DEST, CLIP_MEAN, CLIP_STD),
        (_GOOD_SRC.tolist(), _GOOD_DEST, CLIP_MEAN, CLIP_STD),
        (_GOOD_SRC, np.zeros((3, 6, 4), np.float32), CLIP_MEAN, CLIP_STD),
        (_GOOD_SRC, np.zeros((4, 6, 3), np.float32), CLIP_MEAN, CLIP_STD),
        (_GOOD_SRC, np.zeros((3, 4, 6), np.float64), CLIP_MEAN, CLIP_STD),
        (_GOOD_SRC, np.zeros((3, 4, 12), np.float32)[:, :, ::2], CLIP_MEAN, CLIP_STD),
        (_GOOD_SRC, _READONLY_DEST, CLIP_MEAN, CLIP_STD),
        (_GOOD_SRC, b"\0" * 288, CLIP_MEAN, CLIP_STD),
        (_GOOD_SRC, _GOOD_DEST, CLIP_MEAN[:2], CLIP_STD),
        (_GOOD_SRC, _GOOD_DEST, CLIP_MEAN, (0.2, 0.0, 0.3)),
        (_GOOD_SRC, _GOOD_DEST, CLIP_MEAN, ("a", "b", "c")),
        (_GOOD_SRC, _GOOD_DEST, (float("nan"), 0.0, 0.0), CLIP_STD),
    ],
    ids=["src-float", "src-4ch", "src-2d", "src-strided", "src-list", "dest-shape",
         "dest-hwc", "dest-f64", "dest-strided", "dest-readonly", "dest-bytes", "mean-len",
         "std-zero", "std-text", "mean-nan"],
)
def test_kernel_rejects_bad_arguments(image, src, dest, mean, std):
    with pytest.raises(ValueError):
        image.normalize_hwc_to_chw(src, dest, mean, std)


# ----------------------------------------------------------------------------- geometry


@pytest.mark.parametrize(
    "size,expected",
    [((640, 427), (335, 224)), ((427, 640), (224, 335)), ((1, 1), (224, 224)),
     ((224, 500), (224, 500)), ((1000, 3), (74666, 224))],
)
def test_resize_output_size_truncates_like_torchvision(size, expected):
    assert imaging.resize_output_size(*size) == expected


@pytest.mark.parametrize(
    "size,expected",
    [((335, 224), (56, 0)), ((225, 224), (0, 0)), ((224, 227), (0, 2)), ((224, 224), (0, 0))],
)
def test_center_crop_offsets_round_half_even_like_torchvision(size, expected):
    assert imaging.center_crop_offsets(*size) == expected


# ----------------------------------------------------------------------------- end to end

_CASES = [
    ("RGB", 640, 427, "JPEG"),
    ("RGB", 300, 500, "PNG"),
    ("RGB", 1, 1, "PNG"),
    ("RGB", 1, 40, "PNG"),
    ("RGB", 1600, 1200, "JPEG"),
    ("RGB", 333, 222, "WEBP"),
    ("RGB", 224, 224, "PNG"),
    ("L", 50, 80, "PNG"),
    ("L", 120, 90, "JPEG"),
    ("P", 120, 90, "PNG"),
    ("P_transparent", 90, 120, "PNG"),
    ("RGBA", 200, 100, "PNG"),
    ("RGBA", 150, 150, "WEBP"),
    ("LA", 64, 70, "PNG"),
    ("CMYK", 100, 150, "JPEG"),
]
_MIME = {"JPEG": "image/jpeg", "PNG": "image/png", "WEBP": "image/webp"}


@pytest.mark.parametrize("mode,w,h,fmt", _CASES, ids=[f"{m}-{w}x{h}-{f}" for m, w, h, f in _CASES])
def test_preprocess_clip_matches_pillow_numpy_recipe(mode, w, h, fmt):
    data = encode(make_image(mode, w, h, seed=w + h), fmt)
    batch = np.full((3, 3, CLIP_SIZE, CLIP_SIZE), np.nan, dtype=np.float32)
    out = imaging.preprocess_clip(data, _MIME[fmt], BIG_LIMIT, dest=batch[1])
    assert out.dtype == np.float32 and out.shape == (3, CLIP_SIZE, CLIP_SIZE)
    np.testing.assert_allclose(batch[1], pillow_reference(data), rtol=0, atol=TOL)
    assert np.isnan(batch[[0, 2]]).all()


def _jpeg_with_orientation(orientation: int, w: int = 300, h: int = 200) -> bytes:
    exif = Image.Exif()
    exif[ExifTags.Base.Orientation] = orientation
    return encode(make_image("RGB", w, h, seed=orientation), "JPEG", exif=exif.tobytes())


@pytest.mark.parametrize("orientation", [6, 8])
def test_exif_orientation_applied(orientation):
    data = _jpeg_with_orientation(orientation)
    assert imaging.decode_image(data, "image/jpeg", BIG_LIMIT).size == (200, 300)  # rotated
    out = imaging.preprocess_clip(data, "image/jpeg", BIG_LIMIT)
    np.testing.assert_allclose(out, pillow_reference(data), rtol=0, atol=TOL)
    upright_only = Image.open(io.BytesIO(data)).convert("RGB")  # orientation ignored
    ignored = numpy_reference(imaging.resize_center_crop(upright_only).astype(np.float64))
    assert np.abs(out - ignored).max() > 0.1  # the rotation really changed the pixels


def test_sixteen_bit_grey_png_is_scaled_not_clipped():
    grey = (np.arange(40 * 30, dtype=np.uint32).reshape(30, 40) * 54).astype(np.uint16)
    data = encode(Image.fromarray(grey), "PNG")
    assert Image.open(io.BytesIO(data)).mode == "I;16"
    rgb = np.asarray(imaging.decode_image(data, "image/png", BIG_LIMIT))
    expected = (grey >> 8).astype(np.uint8)
    for c in range(3):
        assert np.array_equal(rgb[:, :, c], expected)


def test_uint8_route_is_the_crop_before_normalisation():
    data = encode(make_image("RGB", 400, 260, seed=3), "PNG")
    hwc = imaging.preprocess_clip_uint8(data, "image/png", BIG_LIMIT)
    assert hwc.dtype == np.uint8 and hwc.shape == (CLIP_SIZE, CLIP_SIZE, 3)
    np.testing.assert_allclose(numpy_reference(hwc.astype(np.float64)), pillow_reference(data),
                               rtol=0, atol=TOL)
    slot = np.zeros((2, CLIP_SIZE, CLIP_SIZE, 3), np.uint8)
    assert imaging.preprocess_clip_uint8(data, "image/png", BIG_LIMIT, dest=slot[1]) is not None
    assert np.array_equal(slot[1], hwc) and not slot[0].any()


@pytest.mark.parametrize("mime", ["image/png; charset=binary", "IMAGE/PNG", " image/png "])
def test_mime_parameters_and_case_ignored(mime):
    data = encode(make_image("RGB", 30, 20), "PNG")
    assert imaging.decode_image(data, mime, BIG_LIMIT).size == (30, 20)


def test_accepts_any_contiguous_buffer():
    data = encode(make_image("RGB", 30, 20), "PNG")
    for payload in (bytearray(data), memoryview(data), np.frombuffer(data, np.uint8)):
        assert imaging.decode_image(payload, "image/png", BIG_LIMIT).size == (30, 20)


# ----------------------------------------------------------------------------- rejections


@pytest.mark.parametrize("mime", ["image/gif", "text/plain", "image/jpg", "", None])
def test_unsupported_mime(mime):
    data = encode(make_image("RGB", 8, 8), "PNG")
    with pytest.raises(UnsupportedMediaType) as err:
        imaging.decode_image(data, mime, BIG_LIMIT)
    assert err.value.field == "payload_mime"


def _assert_invalid_payload(data, mime: str, limit: int = BIG_LIMIT) -> InvalidArgument:
    with pytest.raises(InvalidArgument) as err:
        imaging.preprocess_clip(data, mime, limit)
    assert err.value.field == "payload"
    return err.value


def test_text_labelled_png():
    _assert_invalid_payload(b"this is not an image at all", "image/png")


def test_empty_payload():
    _assert_invalid_payload(b"", "image/jpeg")


@pytest.mark.parametrize("actual,claimed", [("PNG", "image/jpeg"), ("JPEG", "image/png"),
                                            ("WEBP", "image/png"), ("JPEG", "image/webp")])
def test_mime_bytes_mismatch(actual, claimed):
    data = encode(make_image("RGB", 16, 16), actual)
    err = _assert_invalid_payload(data, claimed)
    assert actual in err.message


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
def test_truncated(fmt):
    data = encode(make_image("RGB", 120, 80, seed=9), fmt)
    _assert_invalid_payload(data[: len(data) // 2], _MIME[fmt])


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def test_png_header_bomb_refused_before_decoding():
    # ~60 bytes claiming 50000x50000 RGB: only the header is read, nothing is allocated
    ihdr = struct.pack(">IIBBBBB", 50_000, 50_000, 8, 2, 0, 0, 0)
    data = (b"\x89PNG\r\n\x1a\n" + _png_chunk(b"IHDR", ihdr)
            + _png_chunk(b"IDAT", zlib.compress(b"\0" * 16)) + _png_chunk(b"IEND", b""))
    limit_before = Image.MAX_IMAGE_PIXELS
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no DecompressionBombWarning, no other noise
        err = _assert_invalid_payload(data, "image/png", limit=BIG_LIMIT)
    assert "options.max_image_pixels" in err.message and str(BIG_LIMIT) in err.message
    assert Image.MAX_IMAGE_PIXELS == limit_before


def test_pixel_limit_is_inclusive():
    data = encode(make_image("RGB", 100, 50), "JPEG")
    assert imaging.decode_image(data, "image/jpeg", 5000).size == (100, 50)
    with pytest.raises(InvalidArgument, match="options.max_image_pixels"):
        imaging.decode_image(data, "image/jpeg", 4999)


def test_resized_size_counts_against_the_limit():
    # 112x224 holds 25088 pixels but its resize to short side 224 holds 224x448 = 100352
    data = encode(make_image("RGB", 112, 224), "PNG")
    assert imaging.decode_image(data, "image/png", 100_352, short_side=CLIP_SIZE).size == (112, 224)
    with pytest.raises(InvalidArgument, match="aspect ratio"):
        imaging.decode_image(data, "image/png", 100_351, short_side=CLIP_SIZE)
    assert imaging.decode_image(data, "image/png", 100_351).size == (112, 224)


def test_thin_strip_refused_before_resizing():
    # a 1x50000 strip is small, but resizing it for CLIP would need 224 x 11.2M pixels
    data = encode(Image.new("RGB", (1, 50_000), (10, 20, 30)), "PNG")
    err = _assert_invalid_payload(data, "image/png", limit=BIG_LIMIT)
    assert "aspect ratio" in err.message and "options.max_image_pixels" in err.message


def test_corrupt_pixel_data():
    data = bytearray(encode(make_image("RGB", 64, 64, seed=4), "PNG"))
    idat = data.index(b"IDAT")
    data[idat + 8: idat + 40] = b"\xff" * 32  # garbage inside the compressed stream
    _assert_invalid_payload(bytes(data), "image/png")
