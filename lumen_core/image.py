"""Image normalise, pure-Python twin of ``csrc/_image.pyx``: uint8 HWC -> normalised fp32 CHW.

Both implementations compute ``dest[c, y, x] = lut[c][src[y, x, c]]`` where the 3x256 fp32
lookup table holds ``i * scale[c] + bias[c]`` with ``scale = 1 / (255 * std)`` and
``bias = -mean / std``.  A uint8 pixel has only 256 possible values per channel, so building
the table once (cached per mean/std pair) turns normalisation into pure gathers, and because
the twins share the table their outputs are bit-identical, not merely close.  The table
entries are within ~1e-6 of ``(i / 255 - mean) / std`` evaluated in float64.

This module holds no image constants (those live in :mod:`lumen_core.tasks.imaging`, the
decode/resize recipe that calls ``native.image``); it must not import Pillow, so the compiled
twin can import its validation helpers (``channel_lut``, ``check_arrays``) cheaply.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import numpy as np

#: channels of an RGB image; the only layout this kernel handles
CHANNELS = 3
#: distinct values of a uint8 sample, i.e. the length of each lookup table row
LUT_SIZE = 256

#: the twin API (``lumen_core._image`` exports the same); ``channel_lut`` and ``check_arrays``
#: are the shared definition both twins call
__all__ = ["normalize_hwc_to_chw"]


def _three_floats(values: Sequence[float], name: str) -> tuple[float, float, float]:
    try:
        out = tuple(float(v) for v in values)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be {CHANNELS} numbers, got {values!r}") from exc
    if len(out) != CHANNELS or not all(math.isfinite(v) for v in out):
        raise ValueError(f"{name} must be {CHANNELS} finite numbers, got {values!r}")
    return out  # type: ignore[return-value]


@functools.lru_cache(maxsize=16)
def _lut_cached(mean: tuple[float, float, float], std: tuple[float, float, float]) -> np.ndarray:
    if any(s == 0.0 for s in std):
        raise ValueError(f"std must not contain zero, got {std!r}")
    scale = (1.0 / (255.0 * np.asarray(std, dtype=np.float64))).astype(np.float32)
    bias = (-np.asarray(mean, dtype=np.float64) / np.asarray(std, dtype=np.float64)).astype(
        np.float32
    )
    levels = np.arange(LUT_SIZE, dtype=np.float32)
    lut = levels[None, :] * scale[:, None] + bias[:, None]  # fp32 throughout
    lut = np.ascontiguousarray(lut, dtype=np.float32)
    lut.flags.writeable = False  # shared by every caller through the cache
    return lut


def channel_lut(mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """The read-only fp32 ``[3, 256]`` table mapping a uint8 sample to its normalised value.

    Cached because a server uses one (mean, std) pair for its whole life; building it per call
    would cost more than the gather it feeds on small images.
    """
    return _lut_cached(_three_floats(mean, "mean"), _three_floats(std, "std"))


def check_arrays(src: object, dest: object) -> tuple[int, int]:
    """Validate ``src`` (uint8 [H,W,3] C-contiguous) and ``dest`` (fp32 [3,H,W] C-contiguous,
    writable); return (H, W).  Raises ValueError so a wiring bug fails loudly, never by writing
    into the wrong memory.  Wrong types are ValueError too: one exception class for every
    "these are not the arrays I need" case keeps both twins' contracts trivially equal."""
    if not isinstance(src, np.ndarray):
        raise ValueError(f"src must be a numpy.ndarray, got {type(src).__name__}")  # noqa: TRY004
    if not isinstance(dest, np.ndarray):
        raise ValueError(f"dest must be a numpy.ndarray, got {type(dest).__name__}")  # noqa: TRY004
    if src.dtype != np.uint8 or src.ndim != 3 or src.shape[2] != CHANNELS:
        raise ValueError(f"src must be uint8 [H,W,{CHANNELS}], got {src.dtype} {src.shape}")
    if not src.flags.c_contiguous:
        raise ValueError("src must be C-contiguous")
    h, w = int(src.shape[0]), int(src.shape[1])
    if dest.dtype != np.float32 or dest.shape != (CHANNELS, h, w):
        raise ValueError(
            f"dest must be float32 [{CHANNELS},{h},{w}] to match src, got {dest.dtype} {dest.shape}"
        )
    if not dest.flags.c_contiguous:
        raise ValueError("dest must be C-contiguous")
    if not dest.flags.writeable:
        raise ValueError("dest must be writable")
    return h, w


def normalize_hwc_to_chw(
    src: np.ndarray, dest: np.ndarray, mean: Sequence[float], std: Sequence[float]
) -> np.ndarray:
    """Write ``(src / 255 - mean) / std`` transposed to CHW into ``dest`` and return ``dest``.

    ``dest`` is usually one slot of a batch buffer (``batch[i]``), so the result lands where
    the model input lives and no intermediate image-sized array is allocated.
    """
    lut = channel_lut(mean, std)
    check_arrays(src, dest)
    for c in range(CHANNELS):
        np.take(lut[c], src[:, :, c], out=dest[c])
    return dest
