r"""One-pass CPU kernels in C, compiled on first use with the system's C compiler and loaded with ctypes.

PyTorch has no single elementwise op for a rotary rotation: the rotate-half layout pairs dimension ``i``
with ``i + d/2``, so eager code needs four half-width passes (or temporaries and a ``cat``), each as slow
as a full one. :func:`rope_rotate` does it in one pass: it reads ``x`` once (any strides with a contiguous
last dimension, e.g. the ``[B, L, H, d] -> [B, H, L, d]`` view a projection gives), reads the broadcast
``cos`` / ``sin`` rows, and writes the output once -- with non-temporal stores where the output is larger
than a cache (the store then skips reading the destination first), so it runs at about the speed of a
copy (``benchmarks/README.md``).

The C source below is compiled on first use into ``$POSENC_CACHE_DIR`` (default ``~/.cache/posenc``) with
portable flags, in one of a few builds chosen at run time from the CPU's flags (``/proc/cpuinfo``): ``baseline``
(``-O3``, the compiler's default target), ``avx2`` (``-mavx2 -mfma``) or ``avx512`` (adds ``-mavx512f`` and the
kernels' AVX-512 code). ``POSENC_NATIVE_ISA=baseline|avx2|avx512|native`` forces one (``native``:
``-march=native``, this CPU only); :func:`build` says which is in use, and the benchmark records it with every
run. A file name carrying the hash of the source, the compiler and the flags keeps builds apart, and a build is
written to a temporary name and renamed, so concurrent processes never load half a file. The builds compute the
same sums in the same order (no ``-ffast-math``; ``-std=c99`` keeps the compiler from fusing multiply-adds), so
they agree to the last bit except where the AVX-512 code uses explicit fused multiply-adds (tests/test_native.py
compares them). Where there is no compiler or the build fails, :func:`available` is ``False``, one line on stderr
says so, and every caller keeps its PyTorch path (the same numbers up to rounding; tests/test_native.py compares
both); ``POSENC_NATIVE=0`` turns the kernels off without that line. Large tensors are split over
``torch.get_num_threads()`` threads (ctypes releases the GIL during the call).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import Tensor

_SOURCE = r"""
#define _DEFAULT_SOURCE
#include <math.h>
#include <stdint.h>
#include <sys/mman.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

/* No fused multiply-adds anywhere (the AVX-512 code multiplies and adds apart; C99 keeps the compiler from fusing
   the rest): every build rounds as the scalar code does, so all give the same bits.
   RoPE on the rows [row0, row1) of the flattened (n0, n1, n2) leading dims of x [n0, n1, n2, d] (element strides
   xs0..xs2, last dim contiguous); out is contiguous with the same shape. c, s hold h = r / 2 phases a row, with
   strides cs0..cs2 (0 where they broadcast). half = 1 pairs (i, i + h), half = 0 pairs (2i, 2i + 1); sign = -1
   rotates back (the backward); dims r .. d - 1 are copied. nt: non-temporal stores (out rows 64-byte aligned). */

#define SCALAR_ROW(T)                                                                                        \
    do {                                                                                                     \
        if (half) {                                                                                          \
            for (int64_t i = 0; i < h; i++) {                                                                \
                T x1 = xr[i], x2 = xr[i + h], cc = cr[i], ss = sign * sr[i];                                 \
                o[i] = x1 * cc - x2 * ss;                                                                    \
                o[i + h] = x2 * cc + x1 * ss;                                                                \
            }                                                                                                \
        } else {                                                                                             \
            for (int64_t i = 0; i < h; i++) {                                                                \
                T x1 = xr[2 * i], x2 = xr[2 * i + 1], cc = cr[i], ss = sign * sr[i];                         \
                o[2 * i] = x1 * cc - x2 * ss;                                                                \
                o[2 * i + 1] = x2 * cc + x1 * ss;                                                            \
            }                                                                                                \
        }                                                                                                    \
        for (int64_t j = r; j < d; j++) o[j] = xr[j];                                                        \
    } while (0)

/* walk the rows: (a, b) runs of consecutive l, pointers stepped (no division per row); BODY does one row */
#define FOR_ROWS(T, BODY)                                                                                    \
    int64_t l = row0 % n2, b = (row0 / n2) % n1, a = row0 / n2 / n1, row = row0;                             \
    while (row < row1) {                                                                                     \
        int64_t stop = row + (n2 - l) < row1 ? row + (n2 - l) : row1;                                        \
        const T *xr = x + a * xs0 + b * xs1 + l * xs2;                                                       \
        const T *cr = c + a * cs0 + b * cs1 + l * cs2;                                                       \
        const T *sr = s + a * cs0 + b * cs1 + l * cs2;                                                       \
        T *o = out + row * d;                                                                                \
        for (; row < stop; row++, xr += xs2, cr += cs2, sr += cs2, o += d) {                                 \
            BODY;                                                                                            \
        }                                                                                                    \
        l = 0;                                                                                               \
        if (++b == n1) { b = 0; a++; }                                                                       \
    }

#if defined(__AVX512F__)
#define STORE(p, v) do { if (nt) _mm512_stream_ps((p), (v)); else _mm512_storeu_ps((p), (v)); } while (0)
/* pairs (i, i + h), 16 pairs a step; H: the half width (a constant lets the compiler unroll) */
#define HALF_ROW(H)                                                                                          \
    do {                                                                                                     \
        for (int64_t i = 0; i < (H); i += 16) {                                                              \
            __m512 x1 = _mm512_loadu_ps(xr + i), x2 = _mm512_loadu_ps(xr + i + (H));                         \
            __m512 cc = _mm512_loadu_ps(cr + i), ss = _mm512_mul_ps(sg, _mm512_loadu_ps(sr + i));           \
            STORE(o + i, _mm512_sub_ps(_mm512_mul_ps(x1, cc), _mm512_mul_ps(x2, ss)));                       \
            STORE(o + i + (H), _mm512_add_ps(_mm512_mul_ps(x2, cc), _mm512_mul_ps(x1, ss)));                 \
        }                                                                                                    \
        for (int64_t j = r; j < d; j++) o[j] = xr[j];                                                        \
    } while (0)
/* pairs (2i, 2i + 1), 8 pairs a step: each phase serves two lanes, the partner is the pair's other lane */
#define PAIR_ROW(H)                                                                                          \
    do {                                                                                                     \
        for (int64_t i = 0; i < (H); i += 8) {                                                               \
            __m512 xv = _mm512_loadu_ps(xr + 2 * i);                                                         \
            __m512 cc = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_loadu_ps(cr + i)));         \
            __m512 ss = _mm512_permutexvar_ps(dup, _mm512_castps256_ps512(_mm256_loadu_ps(sr + i)));         \
            __m512 sw = _mm512_mul_ps(_mm512_permute_ps(xv, 0xB1), ss); /* (x_odd s, x_even s) */            \
            __m512 xc = _mm512_mul_ps(xv, cc);                                                               \
            /* even lanes x c -/+ sw, odd lanes x c +/- sw: the sign of the rotation picks which (odd: 0xAAAA) */ \
            STORE(o + 2 * i, back ? _mm512_mask_sub_ps(_mm512_add_ps(xc, sw), 0xAAAA, xc, sw)                  \
                                  : _mm512_mask_add_ps(_mm512_sub_ps(xc, sw), 0xAAAA, xc, sw));                \
        }                                                                                                    \
        for (int64_t j = r; j < d; j++) o[j] = xr[j];                                                        \
    } while (0)
#endif

void posenc_rope_f32(const float *x, float *out, const float *c, const float *s, int64_t n0, int64_t n1,
                     int64_t n2, int64_t d, int64_t r, int64_t xs0, int64_t xs1, int64_t xs2, int64_t cs0,
                     int64_t cs1, int64_t cs2, int64_t row0, int64_t row1, int half, float sign, int nt) {
    const int64_t h = r / 2;
    (void)n0;
#if defined(__AVX512F__)
    /* the vector loops need whole vectors, and aligned rows for streaming stores */
    if ((h % 16 == 0) && (!nt || (((uintptr_t)out & 63) == 0 && d % 16 == 0))) {
        const __m512 sg = _mm512_set1_ps(sign);
        if (half) {
            if (h == 32) { FOR_ROWS(float, HALF_ROW(32)) }
            else if (h == 64) { FOR_ROWS(float, HALF_ROW(64)) }
            else { FOR_ROWS(float, HALF_ROW(h)) }
        } else {
            const __m512i dup = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
            const int back = sign < 0;
            if (h == 32) { FOR_ROWS(float, PAIR_ROW(32)) }
            else { FOR_ROWS(float, PAIR_ROW(h)) }
        }
        if (nt) _mm_sfence();
        return;
    }
#endif
    { FOR_ROWS(float, SCALAR_ROW(float)) }
}

void posenc_rope_f64(const double *x, double *out, const double *c, const double *s, int64_t n0, int64_t n1,
                     int64_t n2, int64_t d, int64_t r, int64_t xs0, int64_t xs1, int64_t xs2, int64_t cs0,
                     int64_t cs1, int64_t cs2, int64_t row0, int64_t row1, int half, double sign, int nt) {
    const int64_t h = r / 2;
    (void)n0; (void)nt;
    FOR_ROWS(double, SCALAR_ROW(double))
}

/* Map the pages of a fresh output in one call (Linux >= 5.14) rather than one page fault per 4 KiB page as the
   kernel first writes them; memory the allocator already used is left as it is. Returns madvise's result. */
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
int posenc_populate(void *p, int64_t bytes) {
#if defined(__linux__)
    const uintptr_t page = 4096, a = (uintptr_t)p;
    const uintptr_t start = (a + page - 1) & ~(page - 1), end = (a + (uintptr_t)bytes) & ~(page - 1);
    if (end <= start) return 0;
    return madvise((void *)start, end - start, MADV_POPULATE_WRITE);
#else
    (void)p; (void)bytes;
    return -1;
#endif
}

/* FIRE's MLP as the piecewise-linear function it is: for each of the n values x[p], its piece
   g = #{knots < x[p]} (as torch.searchsorted), and out[h * n + p] = A[g * H + h] * x[p] + B[g * H + h]. */
#define PIECE(T)                                                                                             \
    static inline int64_t piece_##T(const T *knots, int64_t m, T v) {                                        \
        int64_t lo = 0, hi = m; /* first knot >= v */                                                        \
        while (lo < hi) {                                                                                    \
            int64_t mid = (lo + hi) >> 1;                                                                    \
            if (knots[mid] < v) lo = mid + 1; else hi = mid;                                                 \
        }                                                                                                    \
        return lo;                                                                                           \
    }
PIECE(float)
PIECE(double)

/* pairs are taken in chunks so that a chunk's pieces stay in L1 while each head is written */
#define FIRE_CHUNK 2048

#define FIRE_FORWARD(T)                                                                                      \
    void posenc_fire_forward_##T(const T *x, const T *knots, int64_t m, const T *A, const T *B, T *out,      \
                                 int64_t n, int64_t H, int64_t p0, int64_t p1) {                             \
        int32_t g[FIRE_CHUNK];                                                                               \
        for (int64_t c0 = p0; c0 < p1; c0 += FIRE_CHUNK) {                                                   \
            const int64_t c1 = c0 + FIRE_CHUNK < p1 ? c0 + FIRE_CHUNK : p1;                                  \
            for (int64_t p = c0; p < c1; p++) g[p - c0] = (int32_t)piece_##T(knots, m, x[p]);                \
            for (int64_t h = 0; h < H; h++) {                                                                \
                T *restrict o = out + h * n;                                                                 \
                for (int64_t p = c0; p < c1; p++) {                                                          \
                    const int64_t k = g[p - c0] * H + h;                                                     \
                    o[p] = A[k] * x[p] + B[k];                                                               \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
    }
FIRE_FORWARD(float)
FIRE_FORWARD(double)

/* the backward of FIRE_FORWARD for gout[h * gs + p]: dx[p] = sum_h gout * A[g, h] (written), and the sums
   dA[g, h] += gout * x[p], dB[g, h] += gout over the pairs of piece g (accumulated in double) */
#define FIRE_BACKWARD(T)                                                                                     \
    void posenc_fire_backward_##T(const T *x, const T *knots, int64_t m, const T *A, const T *gout,          \
                                  int64_t gs, T *dx, double *dA, double *dB, int64_t H, int64_t p0,          \
                                  int64_t p1) {                                                              \
        int32_t g[FIRE_CHUNK];                                                                               \
        for (int64_t c0 = p0; c0 < p1; c0 += FIRE_CHUNK) {                                                   \
            const int64_t c1 = c0 + FIRE_CHUNK < p1 ? c0 + FIRE_CHUNK : p1;                                  \
            for (int64_t p = c0; p < c1; p++) {                                                              \
                g[p - c0] = (int32_t)piece_##T(knots, m, x[p]);                                              \
                dx[p] = 0;                                                                                   \
            }                                                                                                \
            for (int64_t h = 0; h < H; h++) {                                                                \
                const T *restrict gr = gout + h * gs;                                                        \
                /* runs of one piece are long (x is monotone along a row): sum a run, then flush it */       \
                int32_t cur = g[0];                                                                          \
                double sa = 0, sb = 0;                                                                       \
                for (int64_t p = c0; p < c1; p++) {                                                          \
                    const int32_t gp = g[p - c0];                                                            \
                    if (gp != cur) {                                                                         \
                        dA[cur * H + h] += sa;                                                               \
                        dB[cur * H + h] += sb;                                                               \
                        sa = sb = 0;                                                                         \
                        cur = gp;                                                                            \
                    }                                                                                        \
                    const T gv = gr[p];                                                                      \
                    sa += (double)(gv * x[p]);                                                               \
                    sb += (double)gv;                                                                        \
                    dx[p] += gv * A[gp * H + h];                                                             \
                }                                                                                            \
                dA[cur * H + h] += sa;                                                                       \
                dB[cur * H + h] += sb;                                                                       \
            }                                                                                                \
        }                                                                                                    \
    }
FIRE_BACKWARD(float)
FIRE_BACKWARD(double)


/* x . y over d elements with 16 partial sums (vectorised; not one dependent chain) */
#define DOT_FN(T)                                                                                            \
    static inline T dot_##T(const T *restrict x, const T *restrict y, int64_t d) {                           \
        T acc[16] = {0};                                                                                     \
        int64_t e = 0;                                                                                       \
        for (; e + 16 <= d; e += 16)                                                                         \
            for (int u = 0; u < 16; u++) acc[u] += x[e + u] * y[e + u];                                      \
        T s = 0;                                                                                             \
        for (int u = 0; u < 16; u++) s += acc[u];                                                            \
        for (; e < d; e++) s += x[e] * y[e];                                                                 \
        return s;                                                                                            \
    }
DOT_FN(float)
DOT_FN(double)

/* out[n * lk + j] = sum_e k[b, h, j, e] * tab[idx[j], h, e] for the rows n = b * H + h in [n0, n1): one query's key
   term against a table looked up per key (a decoding step's k_j . E[i - j]) in one pass, no temporary. k has element
   strides ks0 (batch), ks1 (head), ks2 (key), its last dim contiguous; tab has row stride tr and head stride th
   (0: the heads share it). */
#define ROWS_DOT(T)                                                                                          \
    void posenc_rows_dot_##T(const T *k, int64_t ks0, int64_t ks1, int64_t ks2, const T *tab, int64_t tr,    \
                             int64_t th, const int64_t *idx, T *out, int64_t H, int64_t lk, int64_t d,       \
                             int64_t n0, int64_t n1) {                                                       \
        for (int64_t n = n0; n < n1; n++) {                                                                  \
            const T *kr = k + (n / H) * ks0 + (n % H) * ks1, *tb = tab + (n % H) * th;                       \
            T *o = out + n * lk;                                                                             \
            for (int64_t j = 0; j < lk; j++) o[j] = dot_##T(kr + j * ks2, tb + idx[j] * tr, d);              \
        }                                                                                                    \
    }
ROWS_DOT(float)
ROWS_DOT(double)

/* One query per row n = b * H + h of [n0, n1) attending over lk keys in one pass, with an online softmax: a
   decoding step of a relative encoding, whose terms are read beside the keys instead of in passes of their own.
     s_j = scale * (q . k_j + a . T[ti_j] + k_j . U[ui_j]) + add_j,    out = sum_j softmax(s)_j v_j
   q, a: rows with strides (qs0, qs1), (as0, as1); k, v: strides (ks0, ks1, ks2), (vs0, vs1, vs2); every last dim
   contiguous. T (NULL: no query term): row stride tr, head stride th (0: shared by the heads), ti the row of each
   key (NULL: row j); U, ui likewise for the key term; add (NULL: none): strides (ds0, ds1), a -inf entry masks its
   key. out: [n, d] contiguous. d <= 256. */
#define DECODE(T, EXP)                                                                                       \
    void posenc_decode_##T(const T *q, int64_t qs0, int64_t qs1, const T *k, int64_t ks0, int64_t ks1,       \
                           int64_t ks2, const T *v, int64_t vs0, int64_t vs1, int64_t vs2, const T *a,       \
                           int64_t as0, int64_t as1, const T *tt, int64_t tr, int64_t th, const int64_t *ti, \
                           const T *uu, int64_t ur, int64_t uh, const int64_t *ui, const T *add, int64_t ds0, \
                           int64_t ds1, T *out, T scale, int64_t H, int64_t lk, int64_t d, int64_t n0,       \
                           int64_t n1) {                                                                     \
        T acc[256];                                                                                          \
        for (int64_t n = n0; n < n1; n++) {                                                                  \
            const int64_t b = n / H, h = n % H;                                                              \
            const T *qr = q + b * qs0 + h * qs1, *kr = k + b * ks0 + h * ks1, *vr = v + b * vs0 + h * vs1;   \
            const T *ar = a ? a + b * as0 + h * as1 : 0, *tb = tt ? tt + h * th : 0;                         \
            const T *ub = uu ? uu + h * uh : 0, *dr = add ? add + b * ds0 + h * ds1 : 0;                     \
            T m = -INFINITY, l = 0;                                                                          \
            for (int64_t e = 0; e < d; e++) acc[e] = 0;                                                      \
            for (int64_t j = 0; j < lk; j++) {                                                               \
                const T *x = kr + j * ks2;                                                                   \
                T s = dot_##T(qr, x, d);                                                                     \
                if (tb) s += dot_##T(ar, tb + (ti ? ti[j] : j) * tr, d);                                     \
                if (ub) s += dot_##T(x, ub + (ui ? ui[j] : j) * ur, d);                                      \
                s *= scale;                                                                                  \
                if (dr) {                                                                                    \
                    if (dr[j] == -INFINITY) continue;                                                        \
                    s += dr[j];                                                                              \
                }                                                                                            \
                if (s > m) {                                                                                 \
                    const T c = EXP(m - s);                                                                  \
                    l *= c;                                                                                  \
                    for (int64_t e = 0; e < d; e++) acc[e] *= c;                                             \
                    m = s;                                                                                   \
                }                                                                                            \
                const T p = EXP(s - m);                                                                      \
                const T *restrict y = vr + j * vs2;                                                          \
                l += p;                                                                                      \
                for (int64_t e = 0; e < d; e++) acc[e] += p * y[e];                                          \
            }                                                                                                \
            T *o = out + n * d;                                                                              \
            for (int64_t e = 0; e < d; e++) o[e] = l > 0 ? acc[e] / l : 0;                                   \
        }                                                                                                    \
    }
DECODE(float, expf)
DECODE(double, exp)
"""

# outputs at least this large are written with non-temporal stores (about an L2 cache: smaller ones stay in cache)
NT_BYTES = 1 << 20
# outputs at least this large (glibc's largest mmap threshold) get their pages mapped in one madvise call
POPULATE_BYTES = 32 << 20
# tensors with at least this many elements are split over torch.get_num_threads() threads
PARALLEL_NUMEL = 1 << 18

# the largest head dimension decode_attention takes (its per-row accumulator lives on the C stack)
DECODE_MAX_HEAD_DIM = 256

# set to False to keep every caller on its PyTorch path (tests compare the two)
enabled = True

_lock = threading.Lock()
_state: dict[str, object] = {}


#: the builds of the kernels, by name: the flags added to the common ones (:data:`_COMMON_FLAGS`). One source,
#: compiled for the instruction set that :func:`isa` picks from the CPU's flags (the runtime dispatch); the
#: vector code of each build is only what its flags allow, so a build runs on every CPU that has them.
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "baseline": (),  # the compiler's default target: x86-64 (SSE2) on x86, armv8-a on arm64 ...
    "avx2": ("-mavx2", "-mfma"),  # the vector units of x86-64-v3 (Haswell, Zen and later)
    "avx512": ("-mavx512f", "-mavx2", "-mfma"),  # adds the kernels' AVX-512 code (Skylake-X, Zen 4 ...)
    "native": ("-march=native",),  # this CPU exactly: only when asked for (POSENC_NATIVE_ISA=native)
}
#: the /proc/cpuinfo flags a build needs (every flag its compiler options let the compiler use)
ISA_NEEDS: dict[str, tuple[str, ...]] = {
    "baseline": (),
    "avx2": ("avx2", "fma"),
    "avx512": ("avx512f", "avx2", "fma"),
    "native": (),
}
_COMMON_FLAGS = ("-O3", "-ffp-contract=off", "-fno-tree-slp-vectorize", "-shared", "-fPIC", "-std=c99")
_OFF = ("0", "false", "no", "off")


def _cpu_flags() -> set[str] | None:
    """The CPU's feature flags from ``/proc/cpuinfo`` (Linux; the kernel lists only what the OS enables), or
    ``None`` where there is no such file."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags") and ":" in line:
                    return set(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None


def _is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def supported_isas() -> list[str]:
    """The builds this CPU can run, best first (``native`` left out: it is always "this CPU").

    ``avx2`` and ``avx512`` only on x86 with the flags :data:`ISA_NEEDS` lists (read from ``/proc/cpuinfo``;
    elsewhere only ``baseline``, the one build known to run)."""
    flags = _cpu_flags() if _is_x86() else None
    out = ["baseline"]
    if flags is not None:
        out = [name for name in ("avx512", "avx2") if set(ISA_NEEDS[name]) <= flags] + out
    return out


def isa() -> str:
    """The build to use: ``$POSENC_NATIVE_ISA`` (``baseline``, ``avx2``, ``avx512`` or ``native``) if set, else the
    best one :func:`supported_isas` finds for this CPU.

    Raises:
        ConfigError: ``POSENC_NATIVE_ISA`` names no build, or a build this CPU cannot run (it would die of an
            illegal instruction).
    """
    from .errors import ConfigError

    want = os.environ.get("POSENC_NATIVE_ISA", "").strip().lower()
    if want in ("", "auto"):
        return supported_isas()[0]
    if want not in ISA_FLAGS:
        raise ConfigError(f"POSENC_NATIVE_ISA={want!r} names no build; use one of auto, {', '.join(ISA_FLAGS)}")
    flags = _cpu_flags() if _is_x86() else None
    missing = [f for f in ISA_NEEDS[want] if flags is not None and f not in flags]
    if missing or (ISA_NEEDS[want] and not _is_x86()):
        why = f"lacks {', '.join(missing)}" if missing else f"is not x86 ({platform.machine()})"
        raise ConfigError(
            f"POSENC_NATIVE_ISA={want!r}: this CPU {why}; it runs {', '.join(supported_isas())} (or unset it)"
        )
    return want


def _cpu_tag() -> str:
    """The CPU's model and flags: part of the cache key of a ``native`` build only (the others are portable)."""
    tag = ""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith(("flags", "model name")):
                    tag += line
                if line.startswith("flags"):
                    break
    except OSError:
        pass
    return tag or platform.processor() or platform.machine()


def cache_dir() -> Path:
    """Where compiled kernels live: ``$POSENC_CACHE_DIR`` or ``~/.cache/posenc``."""
    env = os.environ.get("POSENC_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "posenc"


def _compiler() -> str | None:
    for cc in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if cc and shutil.which(cc):
            return cc
    return None


def flags(name: str) -> list[str]:
    """The compiler flags of the build ``name`` (a key of :data:`ISA_FLAGS`)."""
    return [*_COMMON_FLAGS, *ISA_FLAGS[name]]


def _compile(cc: str, name: str) -> tuple[Path | None, str]:
    """Compile the build ``name`` into the cache (once: the file name carries the hash of the source, compiler and
    flags) and return ``(path, "")``, or ``(None, why)``."""
    opts = flags(name)
    parts = [_SOURCE, cc, *opts, platform.machine()] + ([_cpu_tag()] if name == "native" else [])
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()
    file = f"native-{name}-{key[:16]}.so"
    errors = []
    # the cache directory, else a private one under the temporary directory (a read-only home)
    for folder in (cache_dir(), Path(tempfile.gettempdir()) / f"posenc-{os.getuid() if hasattr(os, 'getuid') else 0}"):
        lib_path = folder / file
        if lib_path.exists():
            return lib_path, ""
        try:
            folder.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=folder) as tmp:
                src = Path(tmp) / "posenc_native.c"
                src.write_text(_SOURCE)
                so = Path(tmp) / "posenc_native.so"
                res = subprocess.run([cc, *opts, "-o", str(so), str(src)], capture_output=True, text=True)
                if res.returncode:
                    why = res.stderr.strip()[:500] or "no message"
                    return None, f"{cc} exited with status {res.returncode} building the {name} kernels: {why}"
                os.replace(so, lib_path)  # atomic: a concurrent process loads the old file or the new one
            return lib_path, ""
        except OSError as exc:
            errors.append(f"could not build in {folder}: {exc}")
    return None, "; ".join(errors)


def _build() -> ctypes.CDLL | None:
    if os.environ.get("POSENC_NATIVE", "1").strip().lower() in _OFF:
        _state["error"] = "disabled by POSENC_NATIVE"
        return None
    want = isa()  # raises ConfigError for a POSENC_NATIVE_ISA this CPU cannot run
    cc = _compiler()
    if cc is None:
        return _off("no C compiler (cc, gcc or clang) on PATH")
    # a compiler too old for a vector build's flags: the next build down (only when the build was not asked for)
    forced = os.environ.get("POSENC_NATIVE_ISA", "").strip().lower() not in ("", "auto")
    names = [want] if forced else supported_isas()[supported_isas().index(want) :]
    why = ""
    for chosen in names:
        lib_path, why = _compile(cc, chosen)
        if lib_path is not None:
            break
    else:
        return _off(why)
    lib = _load(lib_path)
    _state["path"], _state["isa"] = str(lib_path), chosen
    return lib


def _load(lib_path: Path) -> ctypes.CDLL:
    """Load a build and declare its functions' argument types."""
    lib = ctypes.CDLL(str(lib_path))
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    for name, real in (("posenc_rope_f32", ctypes.c_float), ("posenc_rope_f64", ctypes.c_double)):
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [ptr] * 4 + [i64] * 13 + [ctypes.c_int, real, ctypes.c_int]
    for t in ("float", "double"):
        fwd = getattr(lib, f"posenc_fire_forward_{t}")
        fwd.restype = None
        fwd.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64]
        bwd = getattr(lib, f"posenc_fire_backward_{t}")
        bwd.restype = None
        bwd.argtypes = [ptr, ptr, i64, ptr, ptr, i64, ptr, ptr, ptr, i64, i64, i64]
    for t in ("float", "double"):
        fn = getattr(lib, f"posenc_rows_dot_{t}")
        fn.restype = None
        fn.argtypes = [ptr, i64, i64, i64, ptr, i64, i64, ptr, ptr, i64, i64, i64, i64, i64]
    for t in ("float", "double"):
        fn = getattr(lib, f"posenc_decode_{t}")
        fn.restype = None
        real = ctypes.c_float if t == "float" else ctypes.c_double
        fn.argtypes = [ptr, i64, i64] + [ptr, i64, i64, i64] * 2 + [ptr, i64, i64] + [ptr, i64, i64, ptr] * 2
        fn.argtypes += [ptr, i64, i64, ptr, real, i64, i64, i64, i64, i64]
    lib.posenc_populate.restype = ctypes.c_int
    lib.posenc_populate.argtypes = [ptr, i64]
    return lib


def _off(why: str) -> None:
    """Record why the kernels are off and say so in one line on stderr (once a process): the PyTorch paths give
    the same results, slower. Not said where POSENC_NATIVE=0 asked for it."""
    _state["error"] = why
    first = why.splitlines()[0] if why else "unknown"
    sys.stderr.write(
        f"posenc: native CPU kernels off ({first}); using the PyTorch paths (POSENC_NATIVE=0 hides this)\n"
    )
    return None


def _lib() -> ctypes.CDLL | None:
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"] = _build()
    return _state["lib"]  # type: ignore[return-value]


def available() -> bool:
    """Whether the compiled kernels can be used on this machine (builds them on first call)."""
    return enabled and _lib() is not None


def build() -> str | None:
    """The name of the build in use (a key of :data:`ISA_FLAGS`: ``baseline``, ``avx2``, ``avx512`` or ``native``),
    or ``None`` where the kernels are off. Builds the kernels on first call, as :func:`available` does."""
    return str(_state["isa"]) if available() else None


def status() -> str:
    """A line saying whether the kernels are in use, and from where or why not (``posenc info`` prints it)."""
    if not enabled:
        return "native CPU kernels: off (posenc.native.enabled is False); PyTorch ops are used instead"
    if available():
        return f"native CPU kernels: {_state['path']} ({build()} build: {' '.join(flags(str(build())))})"
    return f"native CPU kernels: off ({_state.get('error', 'unknown')}); PyTorch ops are used instead"


_pool: ThreadPoolExecutor | None = None
_pool_pid = 0


def _threads() -> ThreadPoolExecutor:
    global _pool, _pool_pid
    n = torch.get_num_threads()
    # a new pool when torch's thread count changed, or in a forked child (its parent's worker threads are gone)
    if _pool is None or _pool._max_workers != n or _pool_pid != os.getpid():  # noqa: SLF001
        _pool, _pool_pid = ThreadPoolExecutor(max_workers=n, thread_name_prefix="posenc-native"), os.getpid()
    return _pool


def _split(n: int, numel: int) -> list[tuple[int, int]]:
    """``[0, n)`` in one range, or one per thread where the work (``numel``) is large."""
    k = torch.get_num_threads() if numel >= PARALLEL_NUMEL else 1
    step = -(-n // max(1, k))
    return [(a, min(n, a + step)) for a in range(0, n, max(1, step))]


def _run(calls: list) -> None:
    """Run ``(fn, *args)`` calls, on the thread pool when there are several (ctypes releases the GIL)."""
    if len(calls) == 1:
        fn, *args = calls[0]
        fn(*args)
        return
    pool = _threads()
    for job in [pool.submit(*c) for c in calls]:
        job.result()


def _rope(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int, half: bool, sign: float) -> Tensor:
    """The kernel on a 4-d ``x`` and phases that broadcast to it (checked by :func:`rope_rotate`)."""
    lib = _lib()
    assert lib is not None
    n0, n1, n2, d = shape = x.shape
    xst, cst, csh = x.stride(), cos.stride(), cos.shape
    # a dim of size 1 is never stepped (stride 0): a broadcast phase, or a single batch / head / position
    xs = (xst[0] if n0 > 1 else 0, xst[1] if n1 > 1 else 0, xst[2] if n2 > 1 else 0)
    cs = (cst[0] if csh[0] > 1 else 0, cst[1] if csh[1] > 1 else 0, cst[2] if csh[2] > 1 else 0)
    out = torch.empty(shape, dtype=x.dtype)
    rows = n0 * n1 * n2
    numel = rows * d
    nbytes = numel * x.element_size()
    nt = int(nbytes >= NT_BYTES)
    if nbytes >= POPULATE_BYTES:  # likely fresh pages from mmap: map them in one call, not a fault per page
        lib.posenc_populate(out.data_ptr(), nbytes)
    fn = lib.posenc_rope_f32 if x.dtype == torch.float32 else lib.posenc_rope_f64
    head = (x.data_ptr(), out.data_ptr(), cos.data_ptr(), sin.data_ptr(), n0, n1, n2, d, rotary_dim, *xs, *cs)
    _run([(fn, *head, r0, r1, int(half), sign, nt) for r0, r1 in _split(rows, numel)])
    return out


class _Rotate(torch.autograd.Function):
    """The rotation as one autograd node; its backward rotates the gradient back (by ``-θ``)."""

    @staticmethod
    def forward(ctx, x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int, half: bool, sign: float):  # type: ignore[override]
        ctx.save_for_backward(cos, sin)
        ctx.args = (rotary_dim, half, sign)
        return _rope(x, cos, sin, rotary_dim, half, sign)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        cos, sin = ctx.saved_tensors
        rotary_dim, half, sign = ctx.args
        g = grad if grad.stride(-1) == 1 else grad.contiguous()
        if torch.is_grad_enabled():  # create_graph=True: the backward itself is differentiated
            dx = _Rotate.apply(g, cos, sin, rotary_dim, half, -sign)
        else:
            dx = _rope(g, cos, sin, rotary_dim, half, -sign)
        return dx, None, None, None, None, None


def rope_rotate(x: Tensor, cos: Tensor, sin: Tensor, rotary_dim: int, interleaved: bool) -> Tensor | None:
    r"""Rotate ``x [B, H, L, d]`` (or ``[B, L, d]``) by the phases ``cos``, ``sin`` ``[B|1, H|1, L, r/2]``.

    .. math::
        \text{half: } (o_i, o_{i+h}) = (x_i c_i - x_{i+h} s_i,\; x_{i+h} c_i + x_i s_i), \qquad
        \text{interleaved: } (o_{2i}, o_{2i+1}) = (x_{2i} c_i - x_{2i+1} s_i,\; x_{2i+1} c_i + x_{2i} s_i)

    for ``i < r/2``; dimensions ``r .. d-1`` pass through. Returns ``None`` (the caller keeps its PyTorch
    path) where the kernel does not apply: no compiled kernel, not CPU, not float32/float64, phases that
    need gradients, ``torch.compile`` tracing, a last dimension that is not contiguous, or shapes that do
    not broadcast.
    """
    if not enabled or cos.requires_grad or sin.requires_grad or torch.compiler.is_compiling():
        return None
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64) or _lib() is None:
        return None
    if x.dim() not in (3, 4) or cos.dim() != x.dim() or x.stride(-1) != 1:
        return None
    if cos.shape != sin.shape or cos.stride() != sin.stride() or cos.stride(-1) != 1:
        return None
    if cos.dtype != x.dtype or sin.dtype != x.dtype or cos.shape[-1] != rotary_dim // 2:
        return None
    if rotary_dim % 2 or not 0 < rotary_dim <= x.shape[-1]:
        return None
    if any(cs not in (1, xs) for xs, cs in zip(x.shape[:-1], cos.shape[:-1])):
        return None
    three = x.dim() == 3  # [B, L, d]: one head
    if three:
        x, cos, sin = x[:, None], cos[:, None], sin[:, None]
    if torch.is_grad_enabled() and x.requires_grad:
        out = _Rotate.apply(x, cos, sin, rotary_dim, not interleaved, 1.0)
    else:  # no graph to record: skip the autograd node's overhead (about 25 µs)
        out = _rope(x, cos, sin, rotary_dim, not interleaved, 1.0)
    return out[:, 0] if three else out


class _FireBias(torch.autograd.Function):
    """``out[h, p] = A[g_p, h] x_p + B[g_p, h]`` with ``g_p`` the piece of ``x_p`` among the sorted knots."""

    @staticmethod
    def forward(ctx, x: Tensor, knots: Tensor, slope: Tensor, intercept: Tensor) -> Tensor:  # type: ignore[override]
        lib = _lib()
        assert lib is not None
        x, knots = x.contiguous(), knots.contiguous()
        a, b = slope.contiguous(), intercept.contiguous()
        n, heads = x.numel(), a.shape[1]
        out = torch.empty((heads, *x.shape), dtype=x.dtype)
        fn = getattr(lib, f"posenc_fire_forward_{_CTYPE[x.dtype]}")
        args = (x.data_ptr(), knots.data_ptr(), knots.numel(), a.data_ptr(), b.data_ptr(), out.data_ptr(), n, heads)
        _run([(fn, *args, p0, p1) for p0, p1 in _split(n, n * heads)])
        ctx.save_for_backward(x, knots, a)
        return out

    @staticmethod
    def backward(ctx, gout: Tensor):  # type: ignore[override]
        x, knots, a = ctx.saved_tensors
        lib = _lib()
        assert lib is not None
        n, heads = x.numel(), a.shape[1]
        g = gout.reshape(heads, n)
        if g.stride(1) != 1:
            g = g.contiguous()
        dx = torch.empty_like(x)
        parts = _split(n, n * heads)
        da = torch.zeros((len(parts), *a.shape), dtype=torch.float64)
        db = torch.zeros((len(parts), *a.shape), dtype=torch.float64)
        fn = getattr(lib, f"posenc_fire_backward_{_CTYPE[x.dtype]}")
        head = (x.data_ptr(), knots.data_ptr(), knots.numel(), a.data_ptr(), g.data_ptr(), g.stride(0), dx.data_ptr())
        _run([(fn, *head, da[i].data_ptr(), db[i].data_ptr(), heads, p0, p1) for i, (p0, p1) in enumerate(parts)])
        return dx, None, da.sum(0).to(a.dtype), db.sum(0).to(a.dtype)


_CTYPE = {torch.float32: "float", torch.float64: "double"}


def fire_bias(x: Tensor, knots: Tensor, slope: Tensor, intercept: Tensor) -> Tensor | None:
    r"""FIRE's bias from its MLP in piecewise-linear form, in one pass: ``[H, *x.shape]``.

    .. math::
        b_h(x) = A_{s(x), h}\, x + B_{s(x), h}, \qquad s(x) = \#\{	ext{knots} < x\}

    (``knots [m]`` sorted, ``slope`` ``A`` and ``intercept`` ``B`` ``[m + 1, H]``; see
    :meth:`posenc.bias.fire.FIRE.piecewise_linear`). The backward gives ``∂x``, ``∂A`` and ``∂B`` in one pass
    over the pairs (sums over a piece's pairs accumulate in float64). Returns ``None`` where the kernel does not
    apply (no compiled kernel, not CPU, mixed or other dtypes, ``torch.compile`` tracing): the caller keeps
    its PyTorch form.
    """
    if not enabled or torch.compiler.is_compiling() or _lib() is None:
        return None
    ts = (x, knots, slope, intercept)
    if any(t.device.type != "cpu" or t.dtype != x.dtype for t in ts) or x.dtype not in _CTYPE:
        return None
    if knots.dim() != 1 or slope.shape != intercept.shape or slope.shape[0] != knots.numel() + 1:
        return None
    return _FireBias.apply(x, knots, slope, intercept)


def rows_dot(k: Tensor, table: Tensor, index: Tensor) -> Tensor | None:
    r"""One query's key term in one pass: ``out[b, h, j] = Σ_e k[b, h, j, e] · table[index[j], (h,) e]``.

    .. math::
        o_{bhj} = k_{bhj} \cdot T_{\mathrm{index}_j}

    ``k [B, H, Lk, d]`` (any strides, last dimension contiguous: a KV cache's view), ``table [R, d]`` (shared by the
    heads) or ``[R, H, d]``, ``index [Lk]`` (long). Reads ``k`` and the rows once and writes ``[B, H, Lk]``: the
    PyTorch form gathers the rows (``[Lk, H, d]``), multiplies (another) and sums. Used where a decoding step takes
    the hooks rather than :func:`decode_attention` (DeBERTa with p2p, which has no offset-table form). Returns
    ``None`` where the kernel does not apply (no compiled kernel, not CPU, not float32/float64, a gradient to record,
    ``torch.compile``): the caller keeps its PyTorch form.
    """
    if not enabled or torch.compiler.is_compiling() or _lib() is None:
        return None
    if k.device.type != "cpu" or k.dtype not in _CTYPE or table.dtype != k.dtype or k.dim() != 4:
        return None
    if torch.is_grad_enabled() and (k.requires_grad or table.requires_grad):
        return None
    b, h, lk, d = k.shape
    if table.dim() not in (2, 3) or table.shape[-1] != d or (table.dim() == 3 and table.shape[1] != h):
        return None
    if index.shape != (lk,) or index.dtype != torch.long or index.device.type != "cpu":
        return None
    if k.stride(-1) != 1 and d > 1:
        return None
    if table.stride(-1) != 1 and d > 1:
        table = table.contiguous()
    index = index.contiguous()
    if lk and (int(index.min()) < 0 or int(index.max()) >= table.shape[0]):
        raise IndexError(f"rows_dot: index out of range for a table of {table.shape[0]} rows")
    lib = _lib()
    assert lib is not None
    out = torch.empty(b, h, lk, dtype=k.dtype)
    th = table.stride(1) if table.dim() == 3 else 0
    fn = getattr(lib, f"posenc_rows_dot_{_CTYPE[k.dtype]}")
    head = (k.data_ptr(), k.stride(0), k.stride(1), k.stride(2), table.data_ptr(), table.stride(0), th)
    tail = (index.data_ptr(), out.data_ptr(), h, lk, d)
    _run([(fn, *head, *tail, n0, n1) for n0, n1 in _split(b * h, b * h * lk * d)])
    return out


def _rows_of(table: Tensor, index: Tensor | None, h: int, d: int, lk: int) -> tuple | None:
    """``(table, row stride, head stride, index)`` of a ``[R, H|1, d]`` table for the decode kernel, or ``None``."""
    if table.dim() != 3 or table.shape[1] not in (1, h) or table.shape[2] != d or table.stride(2) != 1:
        return None
    if index is not None:
        if index.shape != (lk,) or index.dtype != torch.long:
            return None
        index = index.contiguous()
        if lk and (int(index.min()) < 0 or int(index.max()) >= table.shape[0]):
            raise IndexError(f"decode_attention: a row index is out of range for a table of {table.shape[0]} rows")
    elif table.shape[0] < lk:
        return None
    th = table.stride(1) if table.shape[1] > 1 else 0
    return table, table.stride(0), th, index


def decode_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float,
    *,
    query_term: tuple[Tensor, Tensor, Tensor | None] | None = None,
    key_table: tuple[Tensor, Tensor | None] | None = None,
    add: Tensor | None = None,
) -> Tensor | None:
    r"""One query per sequence and head against its keys, in one pass with an online softmax: ``[B, H, d]``.

    .. math::
        s_j = \text{scale}\,(q \cdot k_j + a \cdot T_{t_j} + k_j \cdot U_{u_j}) + \text{add}_j, \qquad
        o = \sum_j \operatorname{softmax}(s)_j\, v_j

    A decoding step of a relative encoding (:class:`~posenc.fused.RelativeForm` with one query): its query and key
    terms are read beside the keys, so the step reads the keys, the values and the looked-up rows once, where the
    SDPA kernel plus the terms as a mask read the keys two or three times.

    Args:
        q: ``[B, H, d]``; k, v: ``[B, H, Lk, d]`` (any strides, last dimension contiguous: a KV cache's views).
        query_term: ``(a [B, H, d], T [R, H|1, d], t [Lk] long or None)``: adds ``a · T[t_j]`` (``T[j]`` without t).
        key_table: ``(U [R, H|1, d], u [Lk] long or None)``: adds ``k_j · U[u_j]``.
        add: ``[B|1, H|1, Lk]`` added after the scale (a mask: ``-inf`` drops the key).
    Returns ``None`` where the kernel does not apply (no compiled kernel, not CPU, not float32/float64, mixed
    dtypes, a gradient to record, ``d > 256``, ``torch.compile``).
    """
    if not enabled or torch.compiler.is_compiling() or _lib() is None:
        return None
    if q.device.type != "cpu" or q.dtype not in _CTYPE or q.dim() != 3 or k.dim() != 4 or v.shape != k.shape:
        return None
    b, h, lk, d = k.shape
    if q.shape != (b, h, d) or d > DECODE_MAX_HEAD_DIM:
        return None
    ts = [q, k, v, add] + ([query_term[0], query_term[1]] if query_term else []) + ([key_table[0]] if key_table else [])
    if any(t is not None and (t.dtype != q.dtype or t.device != q.device) for t in ts):
        return None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts):
        return None
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        return None
    none = (None, 0, 0)
    qa, tt, ti = none, (None, 0, 0), None
    if query_term is not None:
        a, table, index = query_term
        if a.shape != (b, h, d) or a.stride(-1) != 1:
            return None
        got = _rows_of(table, index, h, d, lk)
        if got is None:
            return None
        qa = (a.data_ptr(), a.stride(0), a.stride(1))
        tt, ti = (got[0].data_ptr(), got[1], got[2]), got[3]
    uu, ui = (None, 0, 0), None
    if key_table is not None:
        got = _rows_of(key_table[0], key_table[1], h, d, lk)
        if got is None:
            return None
        uu, ui = (got[0].data_ptr(), got[1], got[2]), got[3]
    dd = none
    if add is not None:
        if add.dim() != 3 or add.shape[0] not in (1, b) or add.shape[1] not in (1, h) or add.shape[2] != lk:
            return None
        if add.stride(-1) != 1:
            add = add.contiguous()
        dd = (add.data_ptr(), add.stride(0) if add.shape[0] > 1 else 0, add.stride(1) if add.shape[1] > 1 else 0)
    lib = _lib()
    assert lib is not None
    out = torch.empty(b, h, d, dtype=q.dtype)
    fn = getattr(lib, f"posenc_decode_{_CTYPE[q.dtype]}")
    head = (q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), *k.stride()[:3], v.data_ptr(), *v.stride()[:3])
    terms = (*qa, *tt, ti.data_ptr() if ti is not None else None, *uu, ui.data_ptr() if ui is not None else None)
    tail = (*dd, out.data_ptr(), float(scale), h, lk, d)
    _run([(fn, *head, *terms, *tail, n0, n1) for n0, n1 in _split(b * h, b * h * lk * d)])
    return out


__all__ = [
    "available",
    "build",
    "cache_dir",
    "decode_attention",
    "fire_bias",
    "rope_rotate",
    "rows_dot",
    "status",
    "supported_isas",
    "isa",
    "flags",
]
