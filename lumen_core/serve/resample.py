"""Whole WAV files in other formats: integer PCM at any common rate and channel count, made
16 kHz mono float32 for the VAD model (issue 38 row 12).

A file is resampled *whole*, so the resampler sees the whole signal at once (no seams between
pieces, one filter delay, trimmed by the library) and the 512-sample chunks are cut from the
result exactly as from a 16 kHz file.  Live streams (the WebSocket route, a client's own
sequence of chunk requests) stay 16 kHz mono: a chunk's boundary would fall inside the
resampler's filter, so they are refused with the format they must have.

Resampling is ``soxr`` (python-soxr over libsoxr, the SoX resampler; part of the ``cpu`` and
``gpu`` extras, beside Pillow for images), at its ``HQ`` quality; downmixing averages the channels (what ``ffmpeg -ac 1`` and
``librosa.to_mono`` do).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from ..errors import InternalError, UnsupportedMediaType

#: the model's rate: every file becomes this
TARGET_RATE = 16000
#: the sample rates a WAV file may have (a header's rate outside is a 415, not a huge buffer)
MIN_RATE, MAX_RATE = 8000, 384000
#: channels a WAV file may have (averaged into one)
MAX_CHANNELS = 32
#: integer PCM sample widths in bytes: 8-bit is unsigned (offset 128), the others signed
WIDTHS = (1, 2, 3, 4)
#: the resampler's quality (soxr's names: QQ, LQ, MQ, HQ, VHQ)
QUALITY = "HQ"


def check_format(channels: int, width: int, rate: int, accepted: str) -> None:
    """415 for a WAV format this module cannot make 16 kHz mono, naming what it takes."""
    problem = None
    if width not in WIDTHS:
        problem = f"{8 * width}-bit samples (8, 16, 24 or 32-bit integer PCM are taken)"
    elif not 1 <= channels <= MAX_CHANNELS:
        problem = f"{channels} channels (1 to {MAX_CHANNELS} are taken)"
    elif not MIN_RATE <= rate <= MAX_RATE:
        problem = f"a rate of {rate} Hz ({MIN_RATE} to {MAX_RATE} Hz are taken)"
    if problem is not None:
        raise UnsupportedMediaType(f"the WAV file has {problem}; accepted: {accepted}",
                                   "Content-Type")


def out_samples(frames: int, rate: int) -> int:
    """Samples at 16 kHz of ``frames`` frames at ``rate`` (known before any work is done, so
    a file too long once resampled is refused up front)."""
    return -(-frames * TARGET_RATE // rate)


def to_float(data: Any, width: int) -> np.ndarray:
    """Interleaved integer PCM (little-endian) as float32 in [-1, 1)."""
    raw = np.frombuffer(data, np.uint8)
    if width == 1:
        return (raw.astype(np.float32) - 128.0) / 128.0
    if width == 2:
        return raw.view("<i2").astype(np.float32) / 32768.0
    if width == 4:
        return (raw.view("<i4").astype(np.float64) / 2147483648.0).astype(np.float32)
    # 24-bit: three bytes a sample, sign-extended through the top byte of an int32
    b = raw.reshape(-1, 3).astype(np.int32)
    v = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
    v = np.where(v >= 1 << 23, v - (1 << 24), v)
    return v.astype(np.float32) / float(1 << 23)


def to_mono_16k(data: Any, channels: int, width: int, rate: int) -> np.ndarray:
    """A WAV file's interleaved integer samples as 16 kHz mono float32 (C-contiguous)."""
    x = to_float(data, width)
    if channels > 1:
        x = x.reshape(-1, channels).mean(axis=1, dtype=np.float32)
    if rate != TARGET_RATE and x.size:
        try:
            import soxr
        except ImportError:
            raise InternalError(f"a {rate} Hz WAV file needs resampling, and the soxr package "
                                f"is not installed here; install it (pip install "
                                f"\"lumen-core[cpu]\", or pip install soxr) or send 16 kHz "
                                f"audio", "payload") from None
        x = soxr.resample(x, rate, TARGET_RATE, quality=QUALITY)
    return np.ascontiguousarray(x, dtype=np.float32)
