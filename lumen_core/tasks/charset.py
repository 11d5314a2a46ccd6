"""The text codec a ``text/plain`` payload's ``charset`` parameter names: :func:`codec_for`
(strict: a name that is no text encoding is a 415), remembered per spelling within a bound."""
from __future__ import annotations

import codecs
from typing import Optional

from ..errors import UnsupportedMediaType

DEFAULT_CHARSET = "utf-8"
#: a charset parameter longer than this is refused without a codec lookup
MAX_CHARSET_CHARS = 64
#: distinct charset spellings remembered (bounded: the parameter is caller-controlled)
CHARSET_CACHE_SIZE = 64

_charset_cache: dict = {}


def codec_for(charset: Optional[str]) -> str:
    """Python codec name for a mime ``charset``; UnsupportedMediaType when there is none.

    Only text encodings count: ``charset=base64`` names a codec, but not one that yields text.
    """
    if charset is None:
        return DEFAULT_CHARSET
    name = _charset_cache.get(charset)
    if name is not None:
        return name
    info = None
    if 0 < len(charset) <= MAX_CHARSET_CHARS:
        try:
            info = codecs.lookup(charset)
        except (LookupError, ValueError):  # ValueError: a NUL in the name
            info = None
    if info is not None:
        try:  # a codec that cannot decode at all (``undefined``) is no text encoding either
            info.decode(b"")
        except Exception:  # noqa: BLE001 - whatever it raises, it decodes nothing
            info = None
    if info is None or not getattr(info, "_is_text_encoding", True):
        shown = charset if len(charset) <= MAX_CHARSET_CHARS else charset[:MAX_CHARSET_CHARS] + "..."
        raise UnsupportedMediaType(
            f"unknown text charset {shown!r} in payload_mime; send UTF-8 (the default) or name a "
            f"text encoding such as utf-8, us-ascii, latin-1 or utf-16", "payload_mime")
    if len(_charset_cache) < CHARSET_CACHE_SIZE:
        _charset_cache[charset] = info.name
    return info.name
