/* Bulk copy used by csrc/assemble.pyx to move one payload into its batch slot.
 *
 * Why not plain memcpy: glibc picks its strategy by the size of ONE call.  A batch is many
 * medium copies (32 x 588 KiB for 224x224 fp32 images); glibc serves those with `rep movsb`,
 * which on some x86 parts (AMD Zen measured here) runs ~1.4x slower than the vector loop glibc
 * itself uses for a single copy of the whole batch -- so the gather lost to the "one memcpy"
 * floor it is measured against.  A plain 64-byte SSE2 loop (SSE2 is baseline on x86-64) runs
 * at memory bandwidth for every slot size and keeps the slot in cache for the model that reads
 * it next (no non-temporal stores).  Small copies, non-x86 targets and overlapping ranges go to
 * memcpy / memmove.
 */
#ifndef LUMEN_ASSEMBLE_COPY_H
#define LUMEN_ASSEMBLE_COPY_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* copies shorter than this go straight to memcpy (its small-size paths are hard to beat) */
#define LUMEN_VECTOR_COPY_MIN 256

static inline void lumen_copy(char *dst, const char *src, size_t n)
{
    uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
    if (d < s + n && s < d + n) {          /* an item that aliases the batch buffer */
        memmove(dst, src, n);
        return;
    }
#if defined(__SSE2__)
    if (n >= LUMEN_VECTOR_COPY_MIN) {
        size_t i = 0;
        for (; i + 64 <= n; i += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(src + i));
            __m128i b = _mm_loadu_si128((const __m128i *)(src + i + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + i + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(src + i + 48));
            _mm_storeu_si128((__m128i *)(dst + i), a);
            _mm_storeu_si128((__m128i *)(dst + i + 16), b);
            _mm_storeu_si128((__m128i *)(dst + i + 32), c);
            _mm_storeu_si128((__m128i *)(dst + i + 48), e);
        }
        memcpy(dst + i, src + i, n - i);
        return;
    }
#endif
    memcpy(dst, src, n);
}

#endif /* LUMEN_ASSEMBLE_COPY_H */
