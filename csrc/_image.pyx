# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Image normalise, compiled (twin of ``lumen_core.image``): uint8 HWC -> normalised fp32 CHW.

One fused pass with the GIL released: every pixel is read once and its three samples are
gathered from a 3x256 fp32 lookup table into the three channel planes of ``dest``.  Validation
and the table come from the pure twin so both share one definition of behaviour (and produce
bit-identical output); only the loop lives here.
"""
from libc.stdint cimport uint8_t

from lumen_core.image import channel_lut, check_arrays

__all__ = ["normalize_hwc_to_chw"]


cdef inline void _gather_planes(const uint8_t* src, float* dest, const float* lut,
                                Py_ssize_t n) noexcept nogil:
    """dest planes [3, n] from interleaved src [n, 3]: three streaming writes per pixel."""
    cdef float* d0 = dest
    cdef float* d1 = dest + n
    cdef float* d2 = dest + 2 * n
    cdef const float* l0 = lut
    cdef const float* l1 = lut + 256
    cdef const float* l2 = lut + 512
    cdef Py_ssize_t i
    for i in range(n):
        d0[i] = l0[src[0]]
        d1[i] = l1[src[1]]
        d2[i] = l2[src[2]]
        src += 3


def normalize_hwc_to_chw(src, dest, mean, std):
    """Write ``(src / 255 - mean) / std`` transposed to CHW into ``dest`` and return ``dest``.

    ``src``: uint8 [H,W,3] C-contiguous (read-only buffers are fine); ``dest``: fp32 [3,H,W]
    C-contiguous and writable, typically ``batch[i]``.  Shape/dtype errors raise ValueError.
    """
    cdef const float[:, ::1] lut = channel_lut(mean, std)
    h, w = check_arrays(src, dest)
    cdef Py_ssize_t n = <Py_ssize_t>h * <Py_ssize_t>w
    if n == 0:
        return dest
    cdef const uint8_t[:, :, ::1] s = src
    cdef float[:, :, ::1] d = dest
    with nogil:
        _gather_planes(&s[0, 0, 0], &d[0, 0, 0], &lut[0, 0], n)
    return dest
