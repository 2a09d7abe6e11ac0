"""The C source of :mod:`posenc.native.offset_table`'s kernels (the offset-table attention, forward and backward),
appended to :data:`posenc.native.source.SOURCE`: one translation unit with the other kernels, compiled by
:mod:`posenc.native.builds`. Written once for a scalar type and generated for float and double. Imports nothing.
"""

from __future__ import annotations

# The offset-table attention of posenc.native.offset_table (forward and backward), written once for a scalar type
# and generated for float and double below (@S: the C name, @T: the type; ot_v_@S / ot_u_@S: an aligned / unaligned
# vector of OT_W_@S lanes in GNU C's vector extensions, 32 bytes, or 64 in a build with AVX-512, lowered to whatever
# vector unit the build's flags allow; fused multiply-adds where the build has them).
_OFFSET_TEMPLATE = r"""
#ifndef OT_BYTES
#if defined(__AVX512F__)
#define OT_BYTES 64 /* the vector width of the offset-table kernels: 512 bits where the build has them */
#else
#define OT_BYTES 32
#endif
#endif
typedef @T ot_v_@S __attribute__((vector_size(OT_BYTES)));
typedef @T ot_u_@S __attribute__((vector_size(OT_BYTES), aligned(sizeof(@T))));
#define OT_W_@S ((int)(OT_BYTES / sizeof(@T)))
/* the lanes of a vector: the head dimension must be a multiple of twice this (posenc.native.offset_table) */
int posenc_offset_lanes_@S(void) { return OT_W_@S; }

/* y + a * x: one fused multiply-add where the build has them (avx2, avx512), a multiply and an add elsewhere */
static inline ot_v_@S ot_fma_@S(ot_v_@S y, ot_v_@S a, ot_v_@S x) {
#if defined(__AVX512F__)
    return (ot_v_@S)@FMA512(a, x, y);
#elif defined(__FMA__)
    return (ot_v_@S)@FMA(a, x, y);
#else
    return y + a * x;
#endif
}
static inline ot_v_@S ot_bc_@S(@T s) { /* a broadcast (generic: 0 + s, which costs an add: 0 + -0 is +0) */
#if defined(__AVX512F__)
    return (ot_v_@S)@ONE512(s);
#elif defined(__AVX__)
    return (ot_v_@S)@ONE256(s);
#else
    ot_v_@S z = {0};
    return z + s;
#endif
}
typedef @I ot_i_@S __attribute__((vector_size(OT_BYTES)));
static inline ot_v_@S ot_max_@S(ot_v_@S a, ot_v_@S b) {
    const ot_i_@S g = a > b;
    return (ot_v_@S)(((ot_i_@S)a & g) | ((ot_i_@S)b & ~g));
}

static inline ot_v_@S ot_ld_@S(const @T *p) { return *(const ot_u_@S *)p; }
static inline void ot_st_@S(@T *p, ot_v_@S x) { *(ot_u_@S *)p = x; }
static inline @T ot_hsum_@S(ot_v_@S v) {
    @T s = 0;
    for (int l = 0; l < OT_W_@S; l++) s += v[l];
    return s;
}
static inline @T ot_dot_@S(const @T *x, const @T *y, int64_t d) {
    ot_v_@S acc = {0};
    for (int64_t e = 0; e < d; e += OT_W_@S) acc = ot_fma_@S(acc, ot_ld_@S(x + e), ot_ld_@S(y + e));
    return ot_hsum_@S(acc);
}
/* y[e] += g * x[e] */
static inline void ot_axpy_@S(@T *y, @T g, const @T *x, int64_t d) {
    if (g == 0) return;
    for (int64_t e = 0; e < d; e += OT_W_@S) ot_st_@S(y + e, ot_ld_@S(y + e) + g * ot_ld_@S(x + e));
}

@VEXP
/* row r of a block: its ke logits (-inf where masked) -> probabilities, in place; returns the logsumexp (-inf for a
   row that sees no key: its probabilities are then 0). The row is readable and writable up to ke rounded up to W. */
static @T ot_softmax_@S(@T *sr, int64_t ke) {
    const int64_t kv = (ke + OT_W_@S - 1) / OT_W_@S * OT_W_@S;
    for (int64_t j = ke; j < kv; j++) sr[j] = -INFINITY;
    ot_v_@S mv = ot_bc_@S(-INFINITY);
    for (int64_t j = 0; j < kv; j += OT_W_@S) mv = ot_max_@S(mv, ot_ld_@S(sr + j));
    @T m = -INFINITY;
    for (int l = 0; l < OT_W_@S; l++) m = mv[l] > m ? mv[l] : m;
    if (m == -INFINITY) {
        for (int64_t j = 0; j < kv; j++) sr[j] = 0;
        return -INFINITY;
    }
    ot_v_@S sv = {0};
    const ot_v_@S mb = ot_bc_@S(m);
    for (int64_t j = 0; j < kv; j += OT_W_@S) {
        const ot_v_@S p = ot_vexp_@S(ot_ld_@S(sr + j) - mb);
        ot_st_@S(sr + j, p);
        sv += p;
    }
    const @T sum = ot_hsum_@S(sv), inv = 1 / sum;
    for (int64_t j = 0; j < kv; j++) sr[j] *= inv;
    return m + @LOG(sum);
}
/* the probabilities again from the logsumexp l (0 where masked, and for a row with l = -inf) */
static void ot_probs_@S(@T *sr, int64_t ke, @T l) {
    const int64_t kv = (ke + OT_W_@S - 1) / OT_W_@S * OT_W_@S;
    if (l == -INFINITY) {
        for (int64_t j = 0; j < kv; j++) sr[j] = 0;
        return;
    }
    for (int64_t j = ke; j < kv; j++) sr[j] = -INFINITY;
    const ot_v_@S lb = ot_bc_@S(l);
    for (int64_t j = 0; j < kv; j += OT_W_@S) ot_st_@S(sr + j, ot_vexp_@S(ot_ld_@S(sr + j) - lb));
}

/* out[r * ldo + c] = sum_e x[r][e] yt[e * ldy + c], r < 4, c < n rounded up to 2W (yt readable that far) */
static void ot_mm_@S(@T *out, int64_t ldo, const @T *const *x, const @T *yt, int64_t ldy, int64_t n, int64_t d) {
    const @T *x0 = x[0], *x1 = x[1], *x2 = x[2], *x3 = x[3];
    for (int64_t c = 0; c < n; c += 2 * OT_W_@S) {
        ot_v_@S a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0}, a30 = {0}, a31 = {0};
        const @T *y = yt + c;
        for (int64_t e = 0; e < d; e++, y += ldy) {
            const ot_v_@S y0 = ot_ld_@S(y), y1 = ot_ld_@S(y + OT_W_@S);
            const ot_v_@S s0 = ot_bc_@S(x0[e]), s1 = ot_bc_@S(x1[e]), s2 = ot_bc_@S(x2[e]), s3 = ot_bc_@S(x3[e]);
            a00 = ot_fma_@S(a00, s0, y0); a01 = ot_fma_@S(a01, s0, y1);
            a10 = ot_fma_@S(a10, s1, y0); a11 = ot_fma_@S(a11, s1, y1);
            a20 = ot_fma_@S(a20, s2, y0); a21 = ot_fma_@S(a21, s2, y1);
            a30 = ot_fma_@S(a30, s3, y0); a31 = ot_fma_@S(a31, s3, y1);
        }
        ot_st_@S(out + c, a00); ot_st_@S(out + c + OT_W_@S, a01);
        ot_st_@S(out + ldo + c, a10); ot_st_@S(out + ldo + c + OT_W_@S, a11);
        ot_st_@S(out + 2 * ldo + c, a20); ot_st_@S(out + 2 * ldo + c + OT_W_@S, a21);
        ot_st_@S(out + 3 * ldo + c, a30); ot_st_@S(out + 3 * ldo + c + OT_W_@S, a31);
    }
}

/* out[r][e] += sum_{c < n} p[r * ldp + c] y[c * ldy + e], r < 4 (d a multiple of 2W) */
static void ot_pv_@S(@T *const *out, const @T *p, int64_t ldp, const @T *y, int64_t ldy, int64_t n, int64_t d) {
    const @T *p0 = p, *p1 = p + ldp, *p2 = p + 2 * ldp, *p3 = p + 3 * ldp;
    for (int64_t e = 0; e < d; e += 2 * OT_W_@S) {
        ot_v_@S a00 = ot_ld_@S(out[0] + e), a01 = ot_ld_@S(out[0] + e + OT_W_@S);
        ot_v_@S a10 = ot_ld_@S(out[1] + e), a11 = ot_ld_@S(out[1] + e + OT_W_@S);
        ot_v_@S a20 = ot_ld_@S(out[2] + e), a21 = ot_ld_@S(out[2] + e + OT_W_@S);
        ot_v_@S a30 = ot_ld_@S(out[3] + e), a31 = ot_ld_@S(out[3] + e + OT_W_@S);
        const @T *yr = y + e;
        for (int64_t c = 0; c < n; c++, yr += ldy) {
            const ot_v_@S y0 = ot_ld_@S(yr), y1 = ot_ld_@S(yr + OT_W_@S);
            const ot_v_@S s0 = ot_bc_@S(p0[c]), s1 = ot_bc_@S(p1[c]), s2 = ot_bc_@S(p2[c]), s3 = ot_bc_@S(p3[c]);
            a00 = ot_fma_@S(a00, s0, y0); a01 = ot_fma_@S(a01, s0, y1);
            a10 = ot_fma_@S(a10, s1, y0); a11 = ot_fma_@S(a11, s1, y1);
            a20 = ot_fma_@S(a20, s2, y0); a21 = ot_fma_@S(a21, s2, y1);
            a30 = ot_fma_@S(a30, s3, y0); a31 = ot_fma_@S(a31, s3, y1);
        }
        ot_st_@S(out[0] + e, a00); ot_st_@S(out[0] + e + OT_W_@S, a01);
        ot_st_@S(out[1] + e, a10); ot_st_@S(out[1] + e + OT_W_@S, a11);
        ot_st_@S(out[2] + e, a20); ot_st_@S(out[2] + e + OT_W_@S, a21);
        ot_st_@S(out[3] + e, a30); ot_st_@S(out[3] + e + OT_W_@S, a31);
    }
}

/* y[c * ldy + e] += sum_{r < 4} p[r * ldp + c] x[r][e], c < n */
static void ot_rank_@S(@T *y, int64_t ldy, const @T *p, int64_t ldp, const @T *const *x, int64_t n, int64_t d) {
    const @T *p0 = p, *p1 = p + ldp, *p2 = p + 2 * ldp, *p3 = p + 3 * ldp;
    for (int64_t e = 0; e < d; e += 2 * OT_W_@S) {
        const ot_v_@S x00 = ot_ld_@S(x[0] + e), x01 = ot_ld_@S(x[0] + e + OT_W_@S);
        const ot_v_@S x10 = ot_ld_@S(x[1] + e), x11 = ot_ld_@S(x[1] + e + OT_W_@S);
        const ot_v_@S x20 = ot_ld_@S(x[2] + e), x21 = ot_ld_@S(x[2] + e + OT_W_@S);
        const ot_v_@S x30 = ot_ld_@S(x[3] + e), x31 = ot_ld_@S(x[3] + e + OT_W_@S);
        @T *yr = y + e;
        for (int64_t c = 0; c < n; c++, yr += ldy) {
            const @T s0 = p0[c], s1 = p1[c], s2 = p2[c], s3 = p3[c];
            if (s0 == 0 && s1 == 0 && s2 == 0 && s3 == 0) continue;
            ot_v_@S y0 = ot_ld_@S(yr), y1 = ot_ld_@S(yr + OT_W_@S);
            const ot_v_@S b0 = ot_bc_@S(s0), b1 = ot_bc_@S(s1), b2 = ot_bc_@S(s2), b3 = ot_bc_@S(s3);
            y0 = ot_fma_@S(ot_fma_@S(ot_fma_@S(ot_fma_@S(y0, b0, x00), b1, x10), b2, x20), b3, x30);
            y1 = ot_fma_@S(ot_fma_@S(ot_fma_@S(ot_fma_@S(y1, b0, x01), b1, x11), b2, x21), b3, x31);
            ot_st_@S(yr, y0); ot_st_@S(yr + OT_W_@S, y1);
        }
    }
}

/* out[r * ldo + j] = sum_e ct[e * ldc + j] ut[e * ldu + 3 - r + j] for r < 4, j < n rounded up to 2W: the key term
   c_j . U[t] of four query rows, the keys and the table both transposed (row r reads the table one offset further
   left than row r - 1) */
static void ot_kband_@S(@T *out, int64_t ldo, const @T *ct, int64_t ldc, const @T *ut, int64_t ldu, int64_t n,
                        int64_t d) {
    for (int64_t j = 0; j < n; j += 2 * OT_W_@S) {
        ot_v_@S a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0}, a30 = {0}, a31 = {0};
        for (int64_t e = 0; e < d; e++) {
            const @T *cr = ct + e * ldc + j, *ur = ut + e * ldu + j;
            const ot_v_@S c0 = ot_ld_@S(cr), c1 = ot_ld_@S(cr + OT_W_@S);
            a00 = ot_fma_@S(a00, c0, ot_ld_@S(ur + 3)); a01 = ot_fma_@S(a01, c1, ot_ld_@S(ur + 3 + OT_W_@S));
            a10 = ot_fma_@S(a10, c0, ot_ld_@S(ur + 2)); a11 = ot_fma_@S(a11, c1, ot_ld_@S(ur + 2 + OT_W_@S));
            a20 = ot_fma_@S(a20, c0, ot_ld_@S(ur + 1)); a21 = ot_fma_@S(a21, c1, ot_ld_@S(ur + 1 + OT_W_@S));
            a30 = ot_fma_@S(a30, c0, ot_ld_@S(ur)); a31 = ot_fma_@S(a31, c1, ot_ld_@S(ur + OT_W_@S));
        }
        ot_st_@S(out + j, a00); ot_st_@S(out + j + OT_W_@S, a01);
        ot_st_@S(out + ldo + j, a10); ot_st_@S(out + ldo + j + OT_W_@S, a11);
        ot_st_@S(out + 2 * ldo + j, a20); ot_st_@S(out + 2 * ldo + j + OT_W_@S, a21);
        ot_st_@S(out + 3 * ldo + j, a30); ot_st_@S(out + 3 * ldo + j + OT_W_@S, a31);
    }
}

/* the backward of ot_kband in the rows' own layout (stride d, whole aligned vectors): for g_r[j] = g[r * ldg + j],
   j < n, dc_j += sum_r g_r[j] u_{j + 3 - r} and du_w += sum_r g_r[w - 3 + r] c_{w - 3 + r} (u, du: rows [0, n + 3)).
   Each row of du is written once per call (the four query rows' terms summed first) */
static void ot_kband_grad_@S(const @T *g, int64_t ldg, const @T *c, const @T *u, @T *dc, @T *du, int64_t n,
                             int64_t d) {
    for (int64_t j = 0; j < n; j++) {
        const @T g0 = g[j], g1 = g[ldg + j], g2 = g[2 * ldg + j], g3 = g[3 * ldg + j];
        if (g0 == 0 && g1 == 0 && g2 == 0 && g3 == 0) continue;
        const ot_v_@S b0 = ot_bc_@S(g0), b1 = ot_bc_@S(g1), b2 = ot_bc_@S(g2), b3 = ot_bc_@S(g3);
        const @T *u3 = u + j * d;
        @T *dcj = dc + j * d;
        for (int64_t e = 0; e < d; e += OT_W_@S) {
            ot_v_@S acc = ot_ld_@S(dcj + e);
            acc = ot_fma_@S(acc, b0, ot_ld_@S(u3 + 3 * d + e));
            acc = ot_fma_@S(acc, b1, ot_ld_@S(u3 + 2 * d + e));
            acc = ot_fma_@S(acc, b2, ot_ld_@S(u3 + d + e));
            acc = ot_fma_@S(acc, b3, ot_ld_@S(u3 + e));
            ot_st_@S(dcj + e, acc);
        }
    }
    for (int64_t w = 0; w < n + 3; w++) {
        ot_v_@S bs[4];
        const @T *cs[4];
        int m = 0;
        for (int r = 0; r < 4; r++) {
            const int64_t j = w - 3 + r;
            if (j < 0 || j >= n || g[r * ldg + j] == 0) continue;
            bs[m] = ot_bc_@S(g[r * ldg + j]);
            cs[m++] = c + j * d;
        }
        if (!m) continue;
        @T *dw = du + w * d;
        for (int64_t e = 0; e < d; e += OT_W_@S) {
            ot_v_@S acc = ot_ld_@S(dw + e);
            for (int t = 0; t < m; t++) acc = ot_fma_@S(acc, bs[t], ot_ld_@S(cs[t] + e));
            ot_st_@S(dw + e, acc);
        }
    }
}

/* dst[e * ld + j] = src[j * d + e] for j < n */
static void ot_transpose_@S(@T *dst, int64_t ld, const @T *src, int64_t n, int64_t d) {
    for (int64_t j0 = 0; j0 < n; j0 += 16) {
        const int64_t j1 = j0 + 16 < n ? j0 + 16 : n;
        for (int64_t e = 0; e < d; e++)
            for (int64_t j = j0; j < j1; j++) dst[e * ld + j] = src[j * d + e];
    }
}

/* the geometry of a tile of 4 query rows i0 .. i0 + 3: row r at key j has offset t = lo + 3 - r + j, and the keys
   [0, jl) are at offsets in a table's leading run (t < run_l) for all four rows, [jr, ke) in its trailing run */
static inline void ot_cols_@S(int64_t lo, int64_t ke, int64_t run_l, int64_t run_r, int64_t *jl, int64_t *jr) {
    int64_t a = run_l - lo - 3, z = run_r - lo;
    a = a < 0 ? 0 : a > ke ? ke : a;
    z = z < a ? a : z > ke ? ke : z;
    *jl = a;
    *jr = z;
}

/* The per-(sequence, head) state of a call; the forward's and the backward's shared arguments (see the Python
   wrapper posenc.native.offset_table for their meaning). */
typedef struct {
    const @T *q, *k, *v, *a, *T, *c, *U, *V;
    const unsigned char *mask;
    int64_t H, lq, lk, d, causal, th, uh, vh, tl, tr, ul, ur, vl, vr, ms0, ms1, ms2, ld, ldt;
    @T scale;
} ot_args_@S;

static void ot_unpack_@S(ot_args_@S *A, void **P, const int64_t *I, double scale) {
    A->q = P[0]; A->k = P[1]; A->v = P[2]; A->a = P[3]; A->T = P[4]; A->c = P[5]; A->U = P[6]; A->V = P[7];
    A->mask = P[8];
    A->H = I[2]; A->lq = I[3]; A->lk = I[4]; A->d = I[5]; A->causal = I[6]; A->th = I[7]; A->uh = I[8];
    A->vh = I[9]; A->tl = I[10]; A->tr = I[11]; A->ul = I[12]; A->ur = I[13]; A->vl = I[14]; A->vr = I[15];
    A->ms0 = I[16]; A->ms1 = I[17]; A->ms2 = I[18]; A->ld = I[19]; A->ldt = I[20];
    A->scale = (@T)scale;
}

/* the keys [j0, j1) of a row tile's logits split by a table's runs (ot_cols over [0, j1)): [j0, ml) in its leading
   run, [ml, mr) between, [mr, j1) in its trailing run */
static inline void ot_split_@S(int64_t lo, int64_t j0, int64_t j1, int64_t run_l, int64_t run_r, int64_t *ml,
                               int64_t *mr) {
    int64_t jl, jr;
    ot_cols_@S(lo, j1, run_l, run_r, &jl, &jr);
    *ml = jl < j0 ? j0 : jl;
    *mr = jr < j0 ? j0 : jr;
}

/* the four row pointers of the tile i0 .. i0 + 3 of x [lq, d] (rows past lq read row lq - 1: their results are
   dropped) */
static inline void ot_rows_@S(const @T *x, int64_t i0, int64_t lq, int64_t d, const @T **out) {
    for (int r = 0; r < 4; r++) out[r] = x ? x + (i0 + r < lq ? i0 + r : lq - 1) * d : 0;
}

/* the scaled, masked logits of rows i0 .. i0 + 3 against keys [j0, j1) into s[4][ld] (-inf where masked; rows past
   lq are left as computed: the caller zeroes their probabilities). kT: the keys transposed, TT the query table
   transposed, cT, UT the key term's operand and table transposed; kre[2 j]: c_j . U[offset 0], kre[2 j + 1]:
   c_j . U[offset P - 1]; raw, kc: scratch */
static void ot_scores_@S(const ot_args_@S *A, int64_t b, int64_t h, const @T *q, const @T *a, const @T *c,
                         const @T *T, const @T *kT, const @T *TT, const @T *cT, const @T *UT, const @T *kre,
                         int64_t i0, int64_t j0, int64_t j1, @T *s, @T *raw, @T *kc) {
    const int64_t lq = A->lq, lk = A->lk, d = A->d, ld = A->ld, P = lq + lk - 1, lo = lq - 1 - (i0 + 3);
    const @T *xr[4], *ar[4];
    ot_rows_@S(q, i0, lq, d, xr);
    ot_rows_@S(a, i0, lq, d, ar);
    ot_mm_@S(s + j0, ld, xr, kT + j0, ld, j1 - j0, d);
    if (a) {
        int64_t ml, mr;
        ot_split_@S(lo, j0, j1, A->tl, A->tr, &ml, &mr);
        if (ml > j0 || mr < j1)
            for (int r = 0; r < 4; r++) {
                const @T sl = ot_dot_@S(ar[r], T + 4 * d, d), st = ot_dot_@S(ar[r], T + (4 + P - 1) * d, d);
                @T *sr = s + r * ld;
                for (int64_t j = j0; j < ml; j++) sr[j] += sl;
                for (int64_t j = mr; j < j1; j++) sr[j] += st;
            }
        if (mr > ml) {
            ot_mm_@S(raw, ld, ar, TT + 4 + lo + ml, A->ldt, mr - ml + 3, d);
            for (int r = 0; r < 4; r++) {
                @T *sr = s + r * ld;
                const @T *w = raw + r * ld + 3 - r - ml;
                for (int64_t j = ml; j < mr; j++) sr[j] += w[j];
            }
        }
    }
    if (c) {
        int64_t ml, mr;
        ot_split_@S(lo, j0, j1, A->ul, A->ur, &ml, &mr);
        for (int r = 0; r < 4; r++) {
            @T *sr = s + r * ld;
            for (int64_t j = j0; j < ml; j++) sr[j] += kre[2 * j];
            for (int64_t j = mr; j < j1; j++) sr[j] += kre[2 * j + 1];
        }
        if (mr > ml) {
            ot_kband_@S(kc, ld, cT + ml, ld, UT + 4 + lo + ml, A->ldt, mr - ml, d);
            for (int r = 0; r < 4; r++) {
                @T *sr = s + r * ld;
                const @T *w = kc + r * ld - ml;
                for (int64_t j = ml; j < mr; j++) sr[j] += w[j];
            }
        }
    }
    for (int r = 0; r < 4 && i0 + r < lq; r++) {
        const int64_t i = i0 + r;
        const unsigned char *mk = A->mask ? A->mask + b * A->ms0 + h * A->ms1 + i * A->ms2 : 0;
        int64_t lim = A->causal ? i + lk - lq + 1 : lk;
        lim = lim < j1 ? lim : j1;
        lim = lim < j0 ? j0 : lim;
        @T *sr = s + r * ld;
        const @T sc = A->scale;
        for (int64_t j = j0; j < lim; j++) sr[j] *= sc;
        if (mk)
            for (int64_t j = j0; j < lim; j++)
                if (!mk[j]) sr[j] = -INFINITY;
        for (int64_t j = lim; j < j1; j++) sr[j] = -INFINITY;
    }
}

/* skewed copy: pb[r][j - jl + 3 - r] = x[r][j] for j in [jl, jr), zero elsewhere in [0, jr - jl + 3) */
static void ot_skew_@S(@T *pb, const @T *x, int64_t ld, int64_t jl, int64_t jr) {
    const int64_t w = jr - jl + 3;
    for (int r = 0; r < 4; r++) {
        @T *o = pb + r * ld;
        const @T *xr = x + r * ld;
        for (int64_t u = 0; u < w; u++) o[u] = 0;
        for (int64_t j = jl; j < jr; j++) o[j - jl + 3 - r] = xr[j];
    }
}

/* A block of OT_ROWS query rows (tiles of 4) is taken against the keys in chunks of OT_KEYS: a chunk's keys,
   values and table rows stay in the L2 cache while every tile of the block uses them */
#ifndef OT_ROWS
#define OT_ROWS 32
#define OT_KEYS 256
#endif

/* the keys tile i0 may see: [0, ke) */
static inline int64_t ot_kend_@S(const ot_args_@S *A, int64_t i0) {
    const int64_t nr = A->lq - i0 < 4 ? A->lq - i0 : 4, ke = i0 + nr + A->lk - A->lq;
    return A->causal && ke < A->lk ? ke : A->lk;
}

/* the block's logits, tile by tile and chunk by chunk: s + t * 4 * ld holds tile t's rows */
static void ot_block_scores_@S(const ot_args_@S *A, int64_t b, int64_t h, const @T *q, const @T *a, const @T *c,
                               const @T *T, const @T *kT, const @T *TT, const @T *cT, const @T *UT,
                               const @T *kre, int64_t I0, int64_t nt, @T *s, @T *raw, @T *kc) {
    const int64_t kmax = ot_kend_@S(A, I0 + 4 * (nt - 1));
    for (int64_t k0 = 0; k0 < kmax; k0 += OT_KEYS)
        for (int64_t t = 0; t < nt; t++) {
            const int64_t i0 = I0 + 4 * t, ke = ot_kend_@S(A, i0), k1 = k0 + OT_KEYS < ke ? k0 + OT_KEYS : ke;
            if (k1 > k0) ot_scores_@S(A, b, h, q, a, c, T, kT, TT, cT, UT, kre, i0, k0, k1, s + t * 4 * A->ld, raw, kc);
        }
}

/* Forward for the rows n = b * H + h in [I[0], I[1]): out [lq, d] and lse [lq] per row. */
void posenc_offset_forward_@S(void **P, const int64_t *I, double scale) {
    ot_args_@S A;
    ot_unpack_@S(&A, P, I, scale);
    @T *out0 = P[9], *lse0 = P[10], *ws = P[11];
    const int64_t lq = A.lq, lk = A.lk, d = A.d, ld = A.ld, ldt = A.ldt, PP = lq + lk - 1;
    @T *kT = ws, *cT = kT + d * ld, *TT = cT + d * ld, *UT = TT + d * ldt, *s = UT + d * ldt;
    @T *raw = s + OT_ROWS * ld, *pb = raw + 4 * ld, *kc = pb + 4 * ld, *kre = kc + 4 * ld, *orow = kre + 2 * ld;
    for (int64_t n = I[0]; n < I[1]; n++) {
        const int64_t b = n / A.H, h = n % A.H;
        const @T *q = A.q + n * lq * d, *k = A.k + n * lk * d, *v = A.v + n * lk * d;
        const @T *a = A.a ? A.a + n * lq * d : 0, *c = A.c ? A.c + n * lk * d : 0;
        const @T *T = A.T ? A.T + h * A.th : 0, *U = A.U ? A.U + h * A.uh : 0, *V = A.V ? A.V + h * A.vh : 0;
        @T *out = out0 + n * lq * d, *lse = lse0 + n * lq;
        ot_transpose_@S(kT, ld, k, lk, d);
        if (T) ot_transpose_@S(TT, ldt, T, PP + 8, d);
        if (c) {
            ot_transpose_@S(cT, ld, c, lk, d);
            ot_transpose_@S(UT, ldt, U, PP + 8, d);
        }
        if (c && (A.ul > 0 || A.ur < PP))
            for (int64_t j = 0; j < lk; j++) {
                kre[2 * j] = ot_dot_@S(c + j * d, U + 4 * d, d);
                kre[2 * j + 1] = ot_dot_@S(c + j * d, U + (4 + PP - 1) * d, d);
            }
        for (int64_t I0 = 0; I0 < lq; I0 += OT_ROWS) {
            const int64_t nt = ((lq - I0 < OT_ROWS ? lq - I0 : OT_ROWS) + 3) / 4;
            ot_block_scores_@S(&A, b, h, q, a, c, T, kT, TT, cT, UT, kre, I0, nt, s, raw, kc);
            for (int64_t t = 0; t < nt; t++) {
                const int64_t i0 = I0 + 4 * t, nr = lq - i0 < 4 ? lq - i0 : 4, ke = ot_kend_@S(&A, i0);
                for (int r = 0; r < 4; r++) {
                    @T *sr = s + (4 * t + r) * ld;
                    for (int64_t e = 0; e < d; e++) orow[(4 * t + r) * d + e] = 0;
                    if (r >= nr) {
                        for (int64_t j = 0; j < ke; j++) sr[j] = 0;
                        continue;
                    }
                    lse[i0 + r] = ot_softmax_@S(sr, ke); /* -inf: a query that sees no key (no output, no gradient) */
                }
            }
            const int64_t kmax = ot_kend_@S(&A, I0 + 4 * (nt - 1));
            for (int64_t k0 = 0; k0 < kmax; k0 += OT_KEYS)
                for (int64_t t = 0; t < nt; t++) {
                    const int64_t i0 = I0 + 4 * t, ke = ot_kend_@S(&A, i0), k1 = k0 + OT_KEYS < ke ? k0 + OT_KEYS : ke;
                    if (k1 <= k0) continue;
                    const @T *st = s + 4 * t * ld;
                    @T *orows[4];
                    for (int r = 0; r < 4; r++) orows[r] = orow + (4 * t + r) * d;
                    ot_pv_@S(orows, st + k0, ld, v + k0 * d, d, k1 - k0, d);
                    if (V) {
                        int64_t ml, mr;
                        const int64_t lo = lq - 1 - (i0 + 3);
                        ot_split_@S(lo, k0, k1, A.vl, A.vr, &ml, &mr);
                        if (mr > ml) {
                            ot_skew_@S(pb, st, ld, ml, mr);
                            ot_pv_@S(orows, pb, ld, V + (4 + lo + ml) * d, d, mr - ml + 3, d);
                        }
                    }
                }
            for (int64_t t = 0; t < nt; t++) {
                const int64_t i0 = I0 + 4 * t, nr = lq - i0 < 4 ? lq - i0 : 4, ke = ot_kend_@S(&A, i0);
                if (V) { /* the value table's runs: one row each, weighed by the run's probabilities */
                    int64_t jl, jr;
                    ot_cols_@S(lq - 1 - (i0 + 3), ke, A.vl, A.vr, &jl, &jr);
                    if (jl > 0 || jr < ke)
                        for (int r = 0; r < nr; r++) {
                            const @T *sr = s + (4 * t + r) * ld;
                            @T pl = 0, pt = 0;
                            for (int64_t j = 0; j < jl; j++) pl += sr[j];
                            for (int64_t j = jr; j < ke; j++) pt += sr[j];
                            ot_axpy_@S(orow + (4 * t + r) * d, pl, V + 4 * d, d);
                            ot_axpy_@S(orow + (4 * t + r) * d, pt, V + (4 + PP - 1) * d, d);
                        }
                }
                for (int r = 0; r < nr; r++)
                    for (int64_t e = 0; e < d; e++) out[(i0 + r) * d + e] = orow[(4 * t + r) * d + e];
            }
        }
    }
}

/* Backward for the rows n in [I[0], I[1]): dq, da written; dk, dv, dc accumulated (zeroed by the caller); the
   tables' gradients dT, dU, dV accumulated into this part's own (zeroed) buffers, laid out as the tables. */
void posenc_offset_backward_@S(void **P, const int64_t *I, double scale) {
    ot_args_@S A;
    ot_unpack_@S(&A, P, I, scale);
    const @T *dout0 = P[9], *lse0 = P[10], *delta0 = P[11];
    @T *dq0 = P[12], *dk0 = P[13], *dv0 = P[14], *da0 = P[15], *dT0 = P[16], *dc0 = P[17], *dU0 = P[18];
    @T *dV0 = P[19], *ws = P[20];
    const int64_t lq = A.lq, lk = A.lk, d = A.d, ld = A.ld, ldt = A.ldt, PP = lq + lk - 1;
    @T *kT = ws, *vT = kT + d * ld, *cT = vT + d * ld, *TT = cT + d * ld, *VT = TT + d * ldt, *UT = VT + d * ldt;
    @T *s = UT + d * ldt, *dp = s + OT_ROWS * ld, *raw = dp + OT_ROWS * ld, *pb = raw + 4 * ld, *kc = pb + 4 * ld;
    @T *kre = kc + 4 * ld, *krg = kre + 2 * ld, *orow = krg + 2 * ld, *arow = orow + OT_ROWS * d;
    for (int64_t n = I[0]; n < I[1]; n++) {
        const int64_t b = n / A.H, h = n % A.H;
        const @T *q = A.q + n * lq * d, *k = A.k + n * lk * d, *v = A.v + n * lk * d;
        const @T *a = A.a ? A.a + n * lq * d : 0, *c = A.c ? A.c + n * lk * d : 0;
        const @T *T = A.T ? A.T + h * A.th : 0, *U = A.U ? A.U + h * A.uh : 0, *V = A.V ? A.V + h * A.vh : 0;
        @T *dT = dT0 ? dT0 + h * A.th : 0, *dU = dU0 ? dU0 + h * A.uh : 0, *dV = dV0 ? dV0 + h * A.vh : 0;
        const @T *dout = dout0 + n * lq * d, *lse = lse0 + n * lq, *delta = delta0 + n * lq;
        @T *dq = dq0 + n * lq * d, *dk = dk0 + n * lk * d, *dv = dv0 + n * lk * d;
        @T *da = a ? da0 + n * lq * d : 0, *dc = c ? dc0 + n * lk * d : 0;
        const int key_runs = c && (A.ul > 0 || A.ur < PP);
        ot_transpose_@S(kT, ld, k, lk, d);
        ot_transpose_@S(vT, ld, v, lk, d);
        if (T) ot_transpose_@S(TT, ldt, T, PP + 8, d);
        if (V) ot_transpose_@S(VT, ldt, V, PP + 8, d);
        if (c) {
            ot_transpose_@S(cT, ld, c, lk, d);
            ot_transpose_@S(UT, ldt, U, PP + 8, d);
        }
        if (key_runs)
            for (int64_t j = 0; j < lk; j++) {
                kre[2 * j] = ot_dot_@S(c + j * d, U + 4 * d, d);
                kre[2 * j + 1] = ot_dot_@S(c + j * d, U + (4 + PP - 1) * d, d);
                krg[2 * j] = krg[2 * j + 1] = 0;
            }
        for (int64_t I0 = 0; I0 < lq; I0 += OT_ROWS) {
            const int64_t nt = ((lq - I0 < OT_ROWS ? lq - I0 : OT_ROWS) + 3) / 4;
            const int64_t kmax = ot_kend_@S(&A, I0 + 4 * (nt - 1));
            ot_block_scores_@S(&A, b, h, q, a, c, T, kT, TT, cT, UT, kre, I0, nt, s, raw, kc);
            for (int64_t t = 0; t < nt; t++) { /* the probabilities again, from the forward's logsumexp */
                const int64_t i0 = I0 + 4 * t, nr = lq - i0 < 4 ? lq - i0 : 4, ke = ot_kend_@S(&A, i0);
                for (int r = 0; r < 4; r++) {
                    ot_probs_@S(s + (4 * t + r) * ld, ke, r < nr ? lse[i0 + r] : -INFINITY);
                    for (int64_t e = 0; e < d; e++) orow[(4 * t + r) * d + e] = arow[(4 * t + r) * d + e] = 0;
                }
            }
            /* dp = do . (v_j + V[t]), chunk by chunk */
            for (int64_t k0 = 0; k0 < kmax; k0 += OT_KEYS)
                for (int64_t t = 0; t < nt; t++) {
                    const int64_t i0 = I0 + 4 * t, ke = ot_kend_@S(&A, i0), k1 = k0 + OT_KEYS < ke ? k0 + OT_KEYS : ke;
                    if (k1 <= k0) continue;
                    const int64_t lo = lq - 1 - (i0 + 3);
                    const @T *dor[4];
                    ot_rows_@S(dout, i0, lq, d, dor);
                    @T *dpt = dp + 4 * t * ld;
                    ot_mm_@S(dpt + k0, ld, dor, vT + k0, ld, k1 - k0, d);
                    if (V) {
                        int64_t ml, mr;
                        ot_split_@S(lo, k0, k1, A.vl, A.vr, &ml, &mr);
                        if (ml > k0 || mr < k1)
                            for (int r = 0; r < 4; r++) {
                                const @T dl = ot_dot_@S(dor[r], V + 4 * d, d);
                                const @T dt = ot_dot_@S(dor[r], V + (4 + PP - 1) * d, d);
                                @T *dr = dpt + r * ld;
                                for (int64_t j = k0; j < ml; j++) dr[j] += dl;
                                for (int64_t j = mr; j < k1; j++) dr[j] += dt;
                            }
                        if (mr > ml) {
                            ot_mm_@S(raw, ld, dor, VT + 4 + lo + ml, ldt, mr - ml + 3, d);
                            for (int r = 0; r < 4; r++) {
                                @T *dr = dpt + r * ld;
                                const @T *w = raw + r * ld + 3 - r - ml;
                                for (int64_t j = ml; j < mr; j++) dr[j] += w[j];
                            }
                        }
                    }
                }
            /* dz = scale * p (dp - delta) in place of dp: the gradient of the unscaled logits (0 where p is) */
            for (int64_t t = 0; t < nt; t++) {
                const int64_t i0 = I0 + 4 * t, nr = lq - i0 < 4 ? lq - i0 : 4, ke = ot_kend_@S(&A, i0);
                for (int r = 0; r < 4; r++) {
                    @T *dr = dp + (4 * t + r) * ld;
                    const @T *sr = s + (4 * t + r) * ld;
                    const @T dl = r < nr ? delta[i0 + r] : 0;
                    for (int64_t j = 0; j < ke; j++) dr[j] = sr[j] == 0 ? 0 : sr[j] * (dr[j] - dl) * A.scale;
                }
            }
            /* the products, chunk by chunk: dv, dV, dq, dk, da, dT, dc, dU */
            for (int64_t k0 = 0; k0 < kmax; k0 += OT_KEYS)
                for (int64_t t = 0; t < nt; t++) {
                    const int64_t i0 = I0 + 4 * t, ke = ot_kend_@S(&A, i0), k1 = k0 + OT_KEYS < ke ? k0 + OT_KEYS : ke;
                    if (k1 <= k0) continue;
                    const int64_t lo = lq - 1 - (i0 + 3), n = k1 - k0;
                    const @T *xr[4], *dor[4], *ar[4];
                    ot_rows_@S(q, i0, lq, d, xr);
                    ot_rows_@S(dout, i0, lq, d, dor);
                    ot_rows_@S(a, i0, lq, d, ar);
                    @T *orows[4], *arows[4];
                    for (int r = 0; r < 4; r++) {
                        orows[r] = orow + (4 * t + r) * d;
                        arows[r] = arow + (4 * t + r) * d;
                    }
                    const @T *st = s + 4 * t * ld, *zt = dp + 4 * t * ld;
                    int64_t ml, mr;
                    ot_rank_@S(dv + k0 * d, d, st + k0, ld, dor, n, d);
                    if (V) {
                        ot_split_@S(lo, k0, k1, A.vl, A.vr, &ml, &mr);
                        if (mr > ml) {
                            ot_skew_@S(pb, st, ld, ml, mr);
                            ot_rank_@S(dV + (4 + lo + ml) * d, d, pb, ld, dor, mr - ml + 3, d);
                        }
                    }
                    ot_pv_@S(orows, zt + k0, ld, k + k0 * d, d, n, d);
                    ot_rank_@S(dk + k0 * d, d, zt + k0, ld, xr, n, d);
                    if (a) {
                        ot_split_@S(lo, k0, k1, A.tl, A.tr, &ml, &mr);
                        if (mr > ml) {
                            ot_skew_@S(pb, zt, ld, ml, mr);
                            ot_pv_@S(arows, pb, ld, T + (4 + lo + ml) * d, d, mr - ml + 3, d);
                            ot_rank_@S(dT + (4 + lo + ml) * d, d, pb, ld, ar, mr - ml + 3, d);
                        }
                    }
                    if (c) {
                        ot_split_@S(lo, k0, k1, A.ul, A.ur, &ml, &mr);
                        if (mr > ml)
                            ot_kband_grad_@S(zt + ml, ld, c + ml * d, U + (4 + lo + ml) * d, dc + ml * d,
                                             dU + (4 + lo + ml) * d, mr - ml, d);
                    }
                }
            /* the tables' runs (one row each, over whole rows) and the rows' gradients */
            for (int64_t t = 0; t < nt; t++) {
                const int64_t i0 = I0 + 4 * t, nr = lq - i0 < 4 ? lq - i0 : 4, ke = ot_kend_@S(&A, i0);
                const int64_t lo = lq - 1 - (i0 + 3);
                const @T *dor[4], *ar[4];
                ot_rows_@S(dout, i0, lq, d, dor);
                ot_rows_@S(a, i0, lq, d, ar);
                int64_t jl, jr;
                if (V) {
                    ot_cols_@S(lo, ke, A.vl, A.vr, &jl, &jr);
                    if (jl > 0 || jr < ke)
                        for (int r = 0; r < nr; r++) {
                            const @T *sr = s + (4 * t + r) * ld;
                            @T pl = 0, pt = 0;
                            for (int64_t j = 0; j < jl; j++) pl += sr[j];
                            for (int64_t j = jr; j < ke; j++) pt += sr[j];
                            ot_axpy_@S(dV + 4 * d, pl, dor[r], d);
                            ot_axpy_@S(dV + (4 + PP - 1) * d, pt, dor[r], d);
                        }
                }
                if (a) {
                    ot_cols_@S(lo, ke, A.tl, A.tr, &jl, &jr);
                    if (jl > 0 || jr < ke)
                        for (int r = 0; r < nr; r++) {
                            const @T *dr = dp + (4 * t + r) * ld;
                            @T zl = 0, zt = 0;
                            for (int64_t j = 0; j < jl; j++) zl += dr[j];
                            for (int64_t j = jr; j < ke; j++) zt += dr[j];
                            ot_axpy_@S(arow + (4 * t + r) * d, zl, T + 4 * d, d);
                            ot_axpy_@S(arow + (4 * t + r) * d, zt, T + (4 + PP - 1) * d, d);
                            ot_axpy_@S(dT + 4 * d, zl, ar[r], d);
                            ot_axpy_@S(dT + (4 + PP - 1) * d, zt, ar[r], d);
                        }
                }
                if (c) {
                    ot_cols_@S(lo, ke, A.ul, A.ur, &jl, &jr);
                    for (int r = 0; r < 4; r++) {
                        const @T *dr = dp + (4 * t + r) * ld;
                        for (int64_t j = 0; j < jl; j++) krg[2 * j] += dr[j];
                        for (int64_t j = jr; j < ke; j++) krg[2 * j + 1] += dr[j];
                    }
                }
                for (int r = 0; r < nr; r++)
                    for (int64_t e = 0; e < d; e++) {
                        dq[(i0 + r) * d + e] = orow[(4 * t + r) * d + e];
                        if (a) da[(i0 + r) * d + e] = arow[(4 * t + r) * d + e];
                    }
            }
        }
        if (key_runs)
            for (int64_t j = 0; j < lk; j++) {
                ot_axpy_@S(dc + j * d, krg[2 * j], U + 4 * d, d);
                ot_axpy_@S(dc + j * d, krg[2 * j + 1], U + (4 + PP - 1) * d, d);
                ot_axpy_@S(dU + 4 * d, krg[2 * j], c + j * d, d);
                ot_axpy_@S(dU + (4 + PP - 1) * d, krg[2 * j + 1], c + j * d, d);
            }
    }
}
"""


_VEXP_FLOAT = r"""
/* exp of a vector of floats: x = n ln 2 + r (|r| <= ln 2 / 2), exp(r) by the polynomial of Cephes'
   expf (relative error about 1e-7), times 2^n built in the exponent bits; 0 below -87.33 (-inf included).
   Its arguments here are never above 0 (a logit minus its row's maximum or logsumexp). */
static inline ot_v_float ot_vexp_float(ot_v_float x) {
    const ot_i_float under = x < ot_bc_float(-87.33654f);
    x = (ot_v_float)((ot_i_float)x & ~under);
    const ot_v_float magic = ot_bc_float(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    const ot_v_float t = x * ot_bc_float(1.44269504088896341f) + magic;
    const ot_v_float n = t - magic;
    const ot_i_float ni = (ot_i_float)t - (ot_i_float)magic;
    ot_v_float r = x - n * ot_bc_float(0.693359375f);
    r = r - n * ot_bc_float(-2.12194440e-4f);
    ot_v_float p = ot_bc_float(1.9875691500E-4f);
    p = p * r + ot_bc_float(1.3981999507E-3f);
    p = p * r + ot_bc_float(8.3334519073E-3f);
    p = p * r + ot_bc_float(4.1665795894E-2f);
    p = p * r + ot_bc_float(1.6666665459E-1f);
    p = p * r + ot_bc_float(5.0000001201E-1f);
    p = p * (r * r) + r + ot_bc_float(1.0f);
    const ot_v_float scale = (ot_v_float)((ni + 127) << 23);
    return (ot_v_float)((ot_i_float)(p * scale) & ~under);
}"""
_VEXP_DOUBLE = r"""
/* exp of a vector of doubles: libm's exp per lane (float64 is the reference precision, not the fast path) */
static inline ot_v_double ot_vexp_double(ot_v_double x) {
    ot_v_double r;
    for (int l = 0; l < OT_W_double; l++) r[l] = exp(x[l]);
    return r;
}"""


def _offset_source(c_type: str, log: str) -> str:
    """The offset-table kernels for one scalar type (the template's placeholders filled in)."""
    out = _OFFSET_TEMPLATE
    fma = "_mm256_fmadd_ps" if c_type == "float" else "_mm256_fmadd_pd"
    vexp = _VEXP_FLOAT if c_type == "float" else _VEXP_DOUBLE
    out = out.replace("@VEXP", vexp)
    fma512 = "_mm512_fmadd_ps" if c_type == "float" else "_mm512_fmadd_pd"
    sfx = "ps" if c_type == "float" else "pd"
    pairs = (("@ONE512", f"_mm512_set1_{sfx}"), ("@ONE256", f"_mm256_set1_{sfx}"))
    pairs += (("@S", c_type), ("@T", c_type), ("@LOG", log), ("@FMA512", fma512), ("@FMA", fma))
    pairs += (("@I", "int32_t" if c_type == "float" else "int64_t"),)
    for key, val in pairs:
        out = out.replace(key, val)
    return out


OFFSET_SOURCE = _offset_source("float", "logf") + _offset_source("double", "log")
