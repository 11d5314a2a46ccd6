"""Images the image-task tests send: PNG bytes of a Pillow image, and a PNG "bomb" whose
header declares more pixels than any limit while its body is a few bytes."""
from __future__ import annotations

import io
import struct
import zlib

from PIL import Image


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def png_bomb(width: int = 60000, height: int = 60000) -> bytes:
    """A valid PNG header declaring ``width`` x ``height`` RGB pixels: a decoder that checks
    the declared size refuses it before decoding anything."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body)))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr)
            + chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + chunk(b"IEND", b""))
