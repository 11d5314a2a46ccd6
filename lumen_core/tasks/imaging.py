"""Image decoding and the CLIP preprocessing recipe (``clip_image_openai_v1``).

The recipe (SPEC section 5): decode, apply EXIF orientation, convert to RGB, resize the shorter
side to 224 with bicubic, centre-crop 224x224, scale to [0, 1], normalise with the CLIP mean/std,
lay out as CHW.  The last three steps are one fused pass in ``native.image`` (compiled, or its
pure twin) writing straight into the caller's batch slot.

Geometry matches torchvision as used by openai/CLIP (``Resize(224, BICUBIC)`` on a PIL image
followed by ``CenterCrop(224)``):

* resize: the short side becomes ``size`` and the long side ``int(size * long / short)`` --
  torchvision *truncates* (``_compute_resized_output_size``), it does not round; a 640x427 image
  becomes 335x224, not 336x224;
* crop offsets are ``int(round((dim - size) / 2.0))`` (Python's round-half-to-even), as in
  torchvision's ``center_crop``.

Colour: modes are converted with Pillow's ``convert("RGB")``, the same call openai/CLIP makes, so
alpha (RGBA, LA, P with transparency) is *dropped*, not composited: a transparent pixel keeps its
stored colour.  One deliberate departure: 16-bit greyscale (``I;16``/``I``) is scaled to 8 bits
(``v >> 8``) because ``convert("RGB")`` clips it, turning almost every 16-bit PNG white.  We
convert *before* resizing (SPEC order); openai/CLIP resizes first, which for palette images means
Pillow silently uses nearest-neighbour, and for RGBA premultiplied-alpha filtering.  For RGB and L
inputs both orders give identical pixels.

Safety: the declared pixel count is checked against ``max_pixels`` from the header alone (Pillow
opens lazily) before any pixel is decoded.  So is the size of the *resized* image when the caller
says it will resize (``short_side``): a 1x50000 strip is only 50k pixels, but resizing its short
side to 224 would materialise 224x11.2M pixels (~7.5 GB) -- torchvision would happily try.  One
limit bounds both, since both are "pixels we agree to hold".  Decoding is then forced with
``load()`` so truncated or corrupt data fails here, as InvalidArgument, rather than deep inside
a batch.  (We never set ``ImageFile.LOAD_TRUNCATED_IMAGES``; a process that sets it globally
makes Pillow grey-fill truncated images instead of raising.)  Pillow's own
decompression-bomb limit (the process-global ``Image.MAX_IMAGE_PIXELS``) is neither read nor
changed: the format's plugin class is instantiated directly, so ``max_pixels`` (config key
``options.max_image_pixels``) is the single, per-task authority and no warning filter is touched.
"""
from __future__ import annotations

import io
import struct
import zlib

import numpy as np
from PIL import ExifTags, Image, ImageOps
from PIL.JpegImagePlugin import JpegImageFile
from PIL.PngImagePlugin import PngImageFile
from PIL.WebPImagePlugin import WebPImageFile

from lumen_core import native
from lumen_core.errors import InvalidArgument, UnsupportedMediaType

#: openai/CLIP normalisation constants (``clip/clip.py``, ``_transform``)
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
#: side of the square model input
CLIP_SIZE = 224
#: preprocess id of the fp32 NCHW tensor route (normalised by the client)
CLIP_PREPROCESS_ID = "clip_image_openai_v1"
#: preprocess id of the uint8 NHWC tensor route (resized/cropped by the client, normalised here)
CLIP_UINT8_PREPROCESS_ID = "clip_image_openai_v1_uint8"

#: config key that sets ``max_pixels``; named in errors so an operator knows what to raise
MAX_PIXELS_CONFIG_KEY = "options.max_image_pixels"

#: accepted ``payload_mime`` (parameters stripped, lower-cased) -> Pillow format name
MIME_FORMATS = {"image/jpeg": "JPEG", "image/png": "PNG", "image/webp": "WEBP"}
_FORMAT_MIME = {fmt: mime for mime, fmt in MIME_FORMATS.items()}
_PLUGINS = {"JPEG": JpegImageFile, "PNG": PngImageFile, "WEBP": WebPImageFile}

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_JPEG_SOI = b"\xff\xd8\xff"
#: bytes needed to recognise any accepted format (RIFF....WEBP)
_SNIFF_BYTES = 12
#: EXIF orientations that need a transpose (1 is "as stored")
_TRANSPOSED_ORIENTATIONS = frozenset(range(2, 9))
#: 16-bit greyscale modes Pillow produces for PNG; scaled to 8 bits instead of clipped
_SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N", "I"})
_UINT16_MAX = 0xFFFF

#: what Pillow raises for malformed input across its plugins and codecs
_DECODE_ERRORS = (
    OSError,  # includes UnidentifiedImageError and "image file is truncated"
    SyntaxError,  # plugins signal "not a <format> file" this way
    ValueError,
    EOFError,
    IndexError,
    TypeError,
    struct.error,
    zlib.error,
    Image.DecompressionBombError,
)

__all__ = [
    "CLIP_MEAN",
    "CLIP_PREPROCESS_ID",
    "CLIP_SIZE",
    "CLIP_STD",
    "CLIP_UINT8_PREPROCESS_ID",
    "MIME_FORMATS",
    "center_crop_offsets",
    "decode_image",
    "preprocess_clip",
    "preprocess_clip_uint8",
    "resize_center_crop",
    "resize_output_size",
]


def _format_for_mime(mime: object) -> str:
    base = mime.split(";", 1)[0].strip().lower() if isinstance(mime, str) else ""
    fmt = MIME_FORMATS.get(base)
    if fmt is None:
        accepted = ", ".join(MIME_FORMATS)
        raise UnsupportedMediaType(
            f"payload_mime {mime!r} is not an accepted image type ({accepted})", "payload_mime"
        )
    return fmt


def _sniff(head: bytes) -> str | None:
    if head.startswith(_JPEG_SOI):
        return "JPEG"
    if head.startswith(_PNG_SIGNATURE):
        return "PNG"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    return None


def _check_pixels(width: int, height: int, max_pixels: int, short_side: int | None) -> None:
    if width < 1 or height < 1:
        raise InvalidArgument(f"payload declares an empty image ({width}x{height})", "payload")
    if width * height > max_pixels:
        raise InvalidArgument(
            f"image is {width}x{height} = {width * height} pixels, above the limit of "
            f"{max_pixels} pixels ({MAX_PIXELS_CONFIG_KEY})",
            "payload",
        )
    if short_side is not None:
        new_w, new_h = resize_output_size(width, height, short_side)
        if new_w * new_h > max_pixels:
            raise InvalidArgument(
                f"image is {width}x{height}: resizing its short side to {short_side} gives "
                f"{new_w}x{new_h} = {new_w * new_h} pixels, above the limit of {max_pixels} "
                f"pixels ({MAX_PIXELS_CONFIG_KEY}); the aspect ratio is too extreme",
                "payload",
            )


def _open_checked(
    payload: object, view: memoryview, fmt: str, max_pixels: int, short_side: int | None
) -> Image.Image:
    """Parse the header only, and refuse the image if it declares too many pixels."""
    sniffed = _sniff(bytes(view[:_SNIFF_BYTES]))
    if sniffed is None:
        raise InvalidArgument(
            f"payload is not a {fmt} image (unrecognised leading bytes)", "payload"
        )
    if sniffed != fmt:
        raise InvalidArgument(
            f"payload_mime says {_FORMAT_MIME[fmt]} but the payload bytes are {sniffed}",
            "payload",
        )
    try:
        # BytesIO shares a bytes object's memory; any other buffer is copied once here
        img = _PLUGINS[fmt](io.BytesIO(payload if isinstance(payload, bytes) else view))  # type: ignore[abstract]
    except _DECODE_ERRORS as exc:
        raise InvalidArgument(f"payload is not a readable {fmt} image: {exc}", "payload") from None
    _check_pixels(img.width, img.height, max_pixels, short_side)
    return img


def _apply_exif_orientation(img: Image.Image) -> Image.Image:
    # exif_transpose copies even when nothing changes; look at the tag first (cheap)
    orientation = img.getexif().get(ExifTags.Base.Orientation, 1)
    if orientation in _TRANSPOSED_ORIENTATIONS:
        return ImageOps.exif_transpose(img)
    return img


def to_rgb(img: Image.Image) -> Image.Image:
    """RGB with alpha dropped, as ``convert("RGB")`` does; 16-bit grey is scaled, not clipped."""
    if img.mode == "RGB":
        return img
    if img.mode in _SIXTEEN_BIT_MODES:
        grey = np.asarray(img).astype(np.int64, copy=False)
        grey8 = (np.clip(grey, 0, _UINT16_MAX) >> 8).astype(np.uint8)
        return Image.fromarray(grey8, mode="L").convert("RGB")
    return img.convert("RGB")


def decode_image(
    payload: object, mime: str, max_pixels: int, short_side: int | None = None
) -> Image.Image:
    """Decode an accepted image payload to an upright RGB Pillow image.

    Raises UnsupportedMediaType (field ``payload_mime``) for a mime outside MIME_FORMATS, and
    InvalidArgument (field ``payload``) for bytes that are not that format, declare more than
    ``max_pixels`` pixels, or are truncated/corrupt.  With ``short_side`` the image is also
    refused when resizing its short side to that length would exceed ``max_pixels``.
    """
    fmt = _format_for_mime(mime)
    if max_pixels < 1:
        raise ValueError(f"max_pixels must be positive, got {max_pixels}")
    try:
        view = memoryview(payload).cast("B")  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgument("payload must be bytes-like", "payload") from None
    if view.nbytes == 0:
        raise InvalidArgument("payload is empty", "payload")
    img = _open_checked(payload, view, fmt, max_pixels, short_side)
    try:
        img.load()  # decode now: truncation and corrupt data surface here, not later
        img = _apply_exif_orientation(img)
        return to_rgb(img)
    except _DECODE_ERRORS as exc:
        raise InvalidArgument(
            f"payload is a truncated or corrupt {fmt} image: {exc}", "payload"
        ) from None


def resize_output_size(width: int, height: int, size: int = CLIP_SIZE) -> tuple[int, int]:
    """(width, height) after torchvision ``Resize(size)``: short side -> size, long side truncated."""
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(size * long / short)
    return (size, new_long) if width <= height else (new_long, size)


def center_crop_offsets(width: int, height: int, size: int = CLIP_SIZE) -> tuple[int, int]:
    """(left, top) of torchvision ``CenterCrop(size)`` on an image at least size x size."""
    return round((width - size) / 2.0), round((height - size) / 2.0)


def resize_center_crop(img: Image.Image, size: int = CLIP_SIZE) -> np.ndarray:
    """Bicubic resize (short side -> ``size``) then centre crop: uint8 ``[size, size, 3]``.

    The array is C-contiguous and may be read-only (it wraps Pillow's bytes without a copy).
    The full resized image is materialised (cropping first changes pixels at the 1-LSB level),
    so untrusted images must come through ``decode_image(..., short_side=size)``.
    """
    img = to_rgb(img)
    new_w, new_h = resize_output_size(img.width, img.height, size)
    if (new_w, new_h) != img.size:
        img = img.resize((new_w, new_h), Image.Resampling.BICUBIC)
    left, top = center_crop_offsets(new_w, new_h, size)
    if (left, top, new_w, new_h) != (0, 0, size, size):
        img = img.crop((left, top, left + size, top + size))
    return np.asarray(img)


def preprocess_clip(
    payload: object, mime: str, max_pixels: int, dest: np.ndarray | None = None
) -> np.ndarray:
    """Raw route of ``clip_image_openai_v1``: payload bytes -> fp32 ``[3, 224, 224]`` in ``dest``.

    ``dest`` is normally the request's slot in the batch buffer (``batch[i]``) so the normalised
    image is written exactly once; without it a fresh array is returned.
    """
    hwc = resize_center_crop(decode_image(payload, mime, max_pixels, CLIP_SIZE), CLIP_SIZE)
    if dest is None:
        dest = np.empty((3, CLIP_SIZE, CLIP_SIZE), dtype=np.float32)
    return native.image.normalize_hwc_to_chw(hwc, dest, CLIP_MEAN, CLIP_STD)


def preprocess_clip_uint8(
    payload: object, mime: str, max_pixels: int, dest: np.ndarray | None = None
) -> np.ndarray:
    """Decode + resize + crop only: uint8 ``[224, 224, 3]`` (the ``_uint8`` route's layout)."""
    hwc = resize_center_crop(decode_image(payload, mime, max_pixels, CLIP_SIZE), CLIP_SIZE)
    if dest is None:
        return np.array(hwc, dtype=np.uint8, copy=True)
    if dest.dtype != np.uint8 or dest.shape != hwc.shape:
        raise ValueError(f"dest must be uint8 {hwc.shape}, got {dest.dtype} {dest.shape}")
    np.copyto(dest, hwc)
    return dest
