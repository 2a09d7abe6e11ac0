"""The C source of the kernels of :mod:`posenc.native`: one translation unit, compiled as a whole by
:mod:`posenc.native.builds` (its text is part of the cache key of a build, so any edit here rebuilds).

Holds the RoPE rotation (``posenc_rope_f32/f64``), the page populate helper (``posenc_populate``), FIRE's
piecewise-linear bias and its backward (``posenc_fire_forward/backward_*``), one query's key term against a looked-up
table (``posenc_rows_dot_*``) and the one-pass decoding step (``posenc_decode_*``); their ctypes signatures are
declared in :mod:`posenc.native.loader`; the offset-table attention's is :mod:`posenc.native.offset_source`'s, appended.
Imports that module only.
"""

from __future__ import annotations

from .offset_source import OFFSET_SOURCE

SOURCE = r"""
#define _DEFAULT_SOURCE
#include <math.h>
#include <stdint.h>
#include <sys/mman.h>
#if defined(__AVX512F__) || defined(__AVX__)
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
   g = #{knots < x[p]} (as torch.searchsorted), and out[h * n + p] = A[g * H + h] * x[p] + B[g * H + h], a run of
   values in one piece at a time (the distances of a row are monotone: few runs, each a vectorised loop). */
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
        int32_t g[FIRE_CHUNK], run[FIRE_CHUNK + 1];                                                          \
        for (int64_t c0 = p0; c0 < p1; c0 += FIRE_CHUNK) {                                                   \
            const int64_t c1 = c0 + FIRE_CHUNK < p1 ? c0 + FIRE_CHUNK : p1;                                  \
            int64_t gp = -1, runs = 0;                                                                       \
            for (int64_t p = c0; p < c1; p++) { /* the previous value's piece if it holds, else a search */  \
                const T v = x[p];                                                                            \
                const int64_t last = gp;                                                                     \
                if (!(gp >= 0 && (gp == 0 || knots[gp - 1] < v) && (gp == m || !(knots[gp] < v))))          \
                    gp = piece_##T(knots, m, v);                                                             \
                g[p - c0] = (int32_t)gp;                                                                     \
                if (gp != last) run[runs++] = (int32_t)(p - c0); /* a run of one piece starts here */        \
            }                                                                                                \
            run[runs] = (int32_t)(c1 - c0);                                                                  \
            for (int64_t h = 0; h < H; h++) {                                                                \
                T *restrict o = out + h * n + c0;                                                            \
                const T *restrict xc = x + c0;                                                               \
                if (8 * runs > c1 - c0) { /* short runs (values in no order): per value */                   \
                    for (int64_t p = 0; p < c1 - c0; p++) o[p] = A[g[p] * H + h] * xc[p] + B[g[p] * H + h];  \
                    continue;                                                                                \
                }                                                                                            \
                for (int64_t r = 0; r < runs; r++) {                                                         \
                    const int64_t k = g[run[r]] * H + h;                                                     \
                    const T a = A[k], b = B[k];                                                              \
                    for (int64_t p = run[r]; p < run[r + 1]; p++) o[p] = a * xc[p] + b;                      \
                }                                                                                            \
            }                                                                                                \
        }                                                                                                    \
    }
FIRE_FORWARD(float)
FIRE_FORWARD(double)

/* the backward of FIRE_FORWARD for gout[h * gs + p]: dx[p] = sum_h gout * A[g, h] (written), and the sums
   dA[g, h] += gout * x[p], dB[g, h] += gout over the pairs of piece g. The pieces' runs are found once per chunk
   (as the forward does); each run is summed in 8 lanes of T, flushed to double at the run's end (a fixed order:
   every build adds the same numbers in the same order) */
#define FIRE_BACKWARD(T)                                                                                     \
    void posenc_fire_backward_##T(const T *x, const T *knots, int64_t m, const T *A, const T *gout,          \
                                   int64_t gs, T *dx, double *dA, double *dB, int64_t H, int64_t p0,         \
                                   int64_t p1) {                                                             \
        int32_t g[FIRE_CHUNK], run[FIRE_CHUNK + 1];                                                          \
        for (int64_t c0 = p0; c0 < p1; c0 += FIRE_CHUNK) {                                                   \
            const int64_t c1 = c0 + FIRE_CHUNK < p1 ? c0 + FIRE_CHUNK : p1;                                  \
            int64_t gp = -1, runs = 0;                                                                       \
            for (int64_t p = c0; p < c1; p++) {                                                              \
                const T v = x[p];                                                                            \
                const int64_t last = gp;                                                                     \
                if (!(gp >= 0 && (gp == 0 || knots[gp - 1] < v) && (gp == m || !(knots[gp] < v))))          \
                    gp = piece_##T(knots, m, v);                                                             \
                g[p - c0] = (int32_t)gp;                                                                     \
                if (gp != last) run[runs++] = (int32_t)(p - c0);                                             \
                dx[p] = 0;                                                                                   \
            }                                                                                                \
            run[runs] = (int32_t)(c1 - c0);                                                                  \
            const T *restrict xc = x + c0;                                                                   \
            T *restrict dxc = dx + c0;                                                                       \
            for (int64_t h = 0; h < H; h++) {                                                                \
                const T *restrict gr = gout + h * gs + c0;                                                   \
                for (int64_t r = 0; r < runs; r++) {                                                         \
                    const int64_t k = g[run[r]] * H + h;                                                     \
                    const T a = A[k];                                                                        \
                    T sa[8] = {0}, sb[8] = {0};                                                              \
                    int64_t p = run[r];                                                                      \
                    const int64_t e = run[r + 1];                                                            \
                    for (; p + 8 <= e; p += 8)                                                               \
                        for (int u = 0; u < 8; u++) {                                                        \
                            const T gv = gr[p + u];                                                          \
                            sa[u] += gv * xc[p + u];                                                         \
                            sb[u] += gv;                                                                     \
                            dxc[p + u] += gv * a;                                                            \
                        }                                                                                    \
                    double ta = 0, tb = 0;                                                                   \
                    for (; p < e; p++) {                                                                     \
                        const T gv = gr[p];                                                                  \
                        ta += (double)(gv * xc[p]);                                                          \
                        tb += (double)gv;                                                                    \
                        dxc[p] += gv * a;                                                                    \
                    }                                                                                        \
                    for (int u = 0; u < 8; u++) { ta += (double)sa[u]; tb += (double)sb[u]; }                \
                    dA[k] += ta;                                                                             \
                    dB[k] += tb;                                                                             \
                }                                                                                            \
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
     s_j = scale * (q . k_j + a . T[ti_j] + k_j . U[ui_j]) + add_j,    out = sum_j p_j (v_j + W[wi_j]),
     p = softmax(s)
   q, a: rows with strides (qs0, qs1), (as0, as1); k, v: strides (ks0, ks1, ks2), (vs0, vs1, vs2); every last dim
   contiguous. T (NULL: no query term): row stride tr, head stride th (0: shared by the heads), ti the row of each
   key (NULL: row j); tp > 0 (with ti): a . T[r] is taken once for the tp rows r < tp (the table is smaller than
   the keys: a clipped or bucketed one), then looked up per key. U, ui likewise for the key term (no lookup: k_j
   differs per key). W (NULL: no value table, Shaw's a^V): row stride wr, head stride wh, wi the row of each key
   (NULL: row j, added to the key's value); with wi, the probabilities are summed per row (wn rows) and the rows
   multiplied once at the end: sum_j p_j W[wi_j] = sum_r (sum_{wi_j = r} p_j) W[r]. ws: tp + wn scratch values per
   row n (at ws + n * (tp + wn)). add (NULL: none): strides (ds0, ds1), a -inf entry masks its key. out: [n, d]
   contiguous. d <= 256. Grouped-query keys: query head h reads key/value head h / G (G = 1: one key head each). */
#define DECODE(T, EXP)                                                                                       \
    void posenc_decode_##T(const T *q, int64_t qs0, int64_t qs1, const T *k, int64_t ks0, int64_t ks1,       \
                           int64_t ks2, const T *v, int64_t vs0, int64_t vs1, int64_t vs2, const T *a,       \
                           int64_t as0, int64_t as1, const T *tt, int64_t tr, int64_t th, const int64_t *ti, \
                           int64_t tp, const T *uu, int64_t ur, int64_t uh, const int64_t *ui, const T *ww,  \
                           int64_t wr, int64_t wh, const int64_t *wi, int64_t wn, T *ws, const T *add,       \
                           int64_t ds0, int64_t ds1, T *out, T scale, int64_t H, int64_t lk, int64_t d,      \
                           int64_t G, int64_t n0, int64_t n1) {                                              \
        T acc[256], accw[256];                                                                               \
        for (int64_t n = n0; n < n1; n++) {                                                                  \
            const int64_t b = n / H, h = n % H, hk = h / G;                                                  \
            const T *qr = q + b * qs0 + h * qs1, *kr = k + b * ks0 + hk * ks1, *vr = v + b * vs0 + hk * vs1; \
            const T *ar = a ? a + b * as0 + h * as1 : 0, *tb = tt ? tt + h * th : 0;                         \
            const T *ub = uu ? uu + h * uh : 0, *dr = add ? add + b * ds0 + h * ds1 : 0;                     \
            const T *wb = ww ? ww + h * wh : 0;                                                              \
            T *qt = ws ? ws + n * (tp + wn) : 0, *pr = ws ? ws + n * (tp + wn) + tp : 0;                     \
            const int look = tb && ti && tp > 0, rows = wb && wi;                                            \
            if (look)                                                                                        \
                for (int64_t r = 0; r < tp; r++) qt[r] = dot_##T(ar, tb + r * tr, d);                        \
            if (rows)                                                                                        \
                for (int64_t r = 0; r < wn; r++) pr[r] = 0;                                                  \
            T m = -INFINITY, l = 0;                                                                          \
            for (int64_t e = 0; e < d; e++) acc[e] = accw[e] = 0;                                            \
            for (int64_t j = 0; j < lk; j++) {                                                               \
                if (dr && dr[j] == -INFINITY) continue;                                                      \
                const T *x = kr + j * ks2;                                                                   \
                T s = dot_##T(qr, x, d);                                                                     \
                if (look)                                                                                    \
                    s += qt[ti[j]];                                                                          \
                else if (tb)                                                                                 \
                    s += dot_##T(ar, tb + (ti ? ti[j] : j) * tr, d);                                         \
                if (ub) s += dot_##T(x, ub + (ui ? ui[j] : j) * ur, d);                                      \
                s *= scale;                                                                                  \
                if (dr) s += dr[j];                                                                          \
                if (s > m) {                                                                                 \
                    const T c = EXP(m - s);                                                                  \
                    l *= c;                                                                                  \
                    for (int64_t e = 0; e < d; e++) acc[e] *= c;                                             \
                    if (wb && !wi)                                                                           \
                        for (int64_t e = 0; e < d; e++) accw[e] *= c;                                        \
                    if (rows)                                                                                \
                        for (int64_t r = 0; r < wn; r++) pr[r] *= c;                                         \
                    m = s;                                                                                   \
                }                                                                                            \
                const T p = EXP(s - m);                                                                      \
                const T *restrict y = vr + j * vs2;                                                          \
                l += p;                                                                                      \
                for (int64_t e = 0; e < d; e++) acc[e] += p * y[e];                                          \
                if (rows) {                                                                                  \
                    pr[wi[j]] += p;                                                                          \
                } else if (wb) {                                                                             \
                    const T *restrict w = wb + j * wr;                                                       \
                    for (int64_t e = 0; e < d; e++) accw[e] += p * w[e];                                     \
                }                                                                                            \
            }                                                                                                \
            if (rows)                                                                                        \
                for (int64_t r = 0; r < wn; r++) {                                                           \
                    const T pw = pr[r], *restrict w = wb + r * wr;                                           \
                    if (pw != 0)                                                                             \
                        for (int64_t e = 0; e < d; e++) accw[e] += pw * w[e];                                \
                }                                                                                            \
            T *o = out + n * d;                                                                              \
            for (int64_t e = 0; e < d; e++) o[e] = l > 0 ? (acc[e] + accw[e]) / l : 0;                      \
        }                                                                                                    \
    }
DECODE(float, expf)
DECODE(double, exp)
"""

SOURCE += OFFSET_SOURCE  # the offset-table attention (posenc.native.offset_source)
