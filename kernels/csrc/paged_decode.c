/* Paged attention for a few new tokens of each sequence of a step on the CPU (decode and small
 * lookahead verification), reading K/V straight from the pages, the whole varlen batch per call.
 *
 * Why C: decode attention is a stream over the whole KV of a sequence, a handful of query rows
 * against every cached token. BLAS has no good shape for it (an M = 3..9 GEMM or a GEMV per
 * head reads KV at a fraction of the memory bandwidth on the machines we measured), and a
 * torch formulation either wastes flops (a block-diagonal query operand) or materialises
 * [S, rows, D] products. This kernel reads each K/V row once per KV head, keeps the query
 * rows and their accumulators in L1 and uses an online softmax (flash-decoding): the context
 * is cut into splits, each (sequence, split) is one work item over all KV heads, and the splits
 * are merged by log-sum-exp at the end.
 *
 * Layout and conventions are those of kernels/reference.py, per sequence (the batch entry at
 * the end says how a step's sequences are found):
 *   q      [L, H, D] float32, contiguous (the caller converts)
 *   caches [num_blocks, block_size, Hkv, D], float32, bfloat16 or int8, contiguous
 *   int8 caches (kernels/kv_quant.py): k_scale / v_scale [num_blocks, Hkv] float32, a row's
 *   value being int8 * scale[block, head]; NULL for float caches
 *   blocks the sequence's block ids (int32); token t lives in block blocks[t / block_size]
 *   the new tokens are the last L of ctx_len; query i sees every earlier token, and among the
 *   new tokens token j iff bit j of tail_words[i] (NULL: sees all of them)
 *   window > 0 (a sliding window): query i, at position first_new + popcount(tail_words[i]) - 1
 *   (first_new with no words), also sees only keys at positions > its position - window; a
 *   key's position is its index (exact for cached keys and causal new ones; for a draft tree
 *   the caller keeps window >= 64, so every new key a word allows is inside the window)
 *   softcap > 0: every scaled score s becomes softcap * tanh(s / softcap) (Gemma 2)
 *   out    [L, H, D] float32, lse [L, H] float32 (natural log, of the scaled scores)
 * Query head hq reads KV head hq / (H / Hkv).
 *
 * int8 pages stream a quarter of float32's bytes. Their scale folds out of the inner loops: a
 * token's score is k_scale[page, head] * (q . k_int8) and its probability is multiplied by
 * v_scale[page, head] before it weighs v_int8. The products convert int8 to float32 in
 * registers (AVX-512 or AVX2), each key's bytes once for several query rows, so a tile costs
 * about what its FMAs do; without AVX2 (or for a head dim that is no multiple of the vector
 * width) the rows are converted into float32 copies for the float loops. See "int8 pages" below.
 *
 * Built at first use by kernels/cpu_decode.py with the machine's compiler
 * (-fopenmp, the instruction set kernels/cpu_build.py picks); it links the OpenMP runtime torch
 * already loaded, and the caller passes torch's thread count.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

#include "split_merge.h"

#define TILE 32       /* tokens scored together (at most; see tile_tokens) */
#define MAX_ROWS 128  /* query rows per KV head (L * group), the caller checks */
#define MAX_D 256

/* exp(x) for x <= 0, written so the compiler vectorizes it: x = n ln2 + r, |r| <= ln2 / 2,
 * exp(r) by a degree-6 Taylor polynomial (relative error < 2e-7 on that range), 2^n built in
 * the exponent bits. Below -87 the result is 0. */
static inline float exp_nonpos(float x) {
    const float y = x < -87.0f ? -87.0f : x;
    const float n = floorf(y * 1.44269504088896341f + 0.5f);
    const float r = y - n * 0.693145751953125f - n * 1.42860682030941723212e-6f;
    const float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
    union { float f; int32_t i; } s;
    s.i = ((int32_t)n + 127) << 23;
    return x < -87.0f ? 0.0f : p * s.f; /* a select, not a branch, so loops over it vectorize */
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#if defined(__AVX512F__)
#define HAVE_AVX512 1
#endif
#endif

/* dst[0..d) = src[0..d) as float32 (an int8 page row, unscaled). */
static inline void int8_row(const int8_t *src, int d, float *dst) {
    int x = 0;
#ifdef HAVE_AVX512
    for (; x + 16 <= d; x += 16) {
        const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + x)));
        _mm512_storeu_ps(dst + x, _mm512_cvtepi32_ps(w));
    }
#endif
#ifdef HAVE_AVX2
    for (; x + 8 <= d; x += 8) {
        const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src + x)));
        _mm256_storeu_ps(dst + x, _mm256_cvtepi32_ps(w));
    }
#endif
    for (; x < d; x++) dst[x] = (float)src[x];
}

/* Pointers to the K or V rows (head kvh, float32) of the tile's n tokens, whose cache slots are
 * slots[0..n): into the pages for float32, else converted into buf (n * d floats). */
static inline void tile_rows(const void *cache, int dtype, const int64_t *slots, int n, int num_kv,
                             int kvh, int d, float *buf, const float **rows) {
    for (int j = 0; j < n; j++) {
        const int64_t offset = (slots[j] * num_kv + kvh) * (int64_t)d;
        if (dtype == 0) {
            rows[j] = (const float *)cache + offset;
        } else { /* bfloat16: the high half of a float32 */
            const uint16_t *src = (const uint16_t *)cache + offset;
            uint32_t *dst = (uint32_t *)(buf + (int64_t)j * d);
            for (int x = 0; x < d; x++) dst[x] = (uint32_t)src[x] << 16;
            rows[j] = buf + (int64_t)j * d;
        }
    }
}

/* bfloat16 pages: the tile's n whole K and V cache rows (every KV head; slots[0..n)) widened to
 * float32 into kdst / vdst [n][row_elems], in token order: one pass over whole rows instead of
 * one per KV head over its part of each row (see Ahead for the figures). Used where the products cannot
 * run in registers (no AVX2, or a head dim that is no multiple of the vector width). */
static inline void widen_tile(const uint16_t *k_cache, const uint16_t *v_cache, const int64_t *slots, int n,
                              int row_elems, float *kdst, float *vdst) {
    for (int j = 0; j < n; j++) {
        const uint16_t *ks = k_cache + slots[j] * row_elems, *vs = v_cache + slots[j] * row_elems;
        uint32_t *ko = (uint32_t *)(kdst + (int64_t)j * row_elems), *vo = (uint32_t *)(vdst + (int64_t)j * row_elems);
        for (int x = 0; x < row_elems; x++) ko[x] = (uint32_t)ks[x] << 16;
        for (int x = 0; x < row_elems; x++) vo[x] = (uint32_t)vs[x] << 16;
    }
}

#ifdef HAVE_AVX2
/* The eight horizontal sums of a0..a7, as one vector. */
static inline __m256 sum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5,
                            __m256 a6, __m256 a7) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#endif

/* p[j] = exp(s[j] - peak) in place (s[j] = -inf gives 0); returns the sum of the p[j]. */
static inline float exp_row(float *s, int n, float peak) {
    int j = 0;
    float sum = 0.0f;
#ifdef HAVE_AVX2
    const __m256 lo = _mm256_set1_ps(-87.0f), pk = _mm256_set1_ps(peak);
    __m256 total = _mm256_setzero_ps();
    for (; j + 8 <= n; j += 8) {
        const __m256 x = _mm256_sub_ps(_mm256_loadu_ps(s + j), pk);
        const __m256 dead = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
        const __m256 y = _mm256_max_ps(x, lo);
        const __m256 nf = _mm256_floor_ps(_mm256_fmadd_ps(y, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
        __m256 r = _mm256_fnmadd_ps(nf, _mm256_set1_ps(0.693145751953125f), y);
        r = _mm256_fnmadd_ps(nf, _mm256_set1_ps(1.42860682030941723212e-6f), r);
        __m256 p = _mm256_set1_ps(1.0f / 720);
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
        p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
        const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(nf), _mm256_set1_epi32(127)), 23);
        const __m256 v = _mm256_andnot_ps(dead, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
        _mm256_storeu_ps(s + j, v);
        total = _mm256_add_ps(total, v);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, total);
    for (int u = 0; u < 8; u++) sum += lanes[u];
#endif
    for (; j < n; j++) {
        s[j] = exp_nonpos(s[j] - peak);
        sum += s[j];
    }
    return sum;
}

/* scores[j] = q . k_j for the tile's n tokens (one query row). */
static inline void row_scores(const float *q, const float **k, int n, int d, float *scores) {
    int j = 0;
#ifdef HAVE_AVX2
    if (d % 8 == 0) {
        for (; j + 8 <= n; j += 8) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
            for (int x = 0; x < d; x += 8) {
                const __m256 qv = _mm256_loadu_ps(q + x);
                a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j] + x), a0);
                a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j + 1] + x), a1);
                a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j + 2] + x), a2);
                a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j + 3] + x), a3);
                a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j + 4] + x), a4);
                a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j + 5] + x), a5);
                a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j + 6] + x), a6);
                a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j + 7] + x), a7);
            }
            _mm256_storeu_ps(scores + j, sum8x8(a0, a1, a2, a3, a4, a5, a6, a7));
        }
    }
#endif
    for (; j < n; j++) {
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int x = 0; x < d; x++) s += q[x] * k[j][x];
        scores[j] = s;
    }
}

/* acc += sum_j p[j] v_j over the tile's n tokens (one query row). */
static inline void row_accumulate(const float *p, const float **v, int n, int d, float *acc) {
    int x = 0;
#ifdef HAVE_AVX2
    if (d % 8 == 0) {
        for (; x + 64 <= d; x += 64) { /* eight independent chains hide the FMA latency */
            __m256 c[8];
            for (int u = 0; u < 8; u++) c[u] = _mm256_loadu_ps(acc + x + 8 * u);
            for (int j = 0; j < n; j++) {
                const __m256 pj = _mm256_set1_ps(p[j]);
                const float *vj = v[j] + x;
                for (int u = 0; u < 8; u++) c[u] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * u), c[u]);
            }
            for (int u = 0; u < 8; u++) _mm256_storeu_ps(acc + x + 8 * u, c[u]);
        }
        for (; x < d; x += 8) {
            __m256 c0 = _mm256_loadu_ps(acc + x);
            for (int j = 0; j < n; j++) c0 = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(v[j] + x), c0);
            _mm256_storeu_ps(acc + x, c0);
        }
    }
#endif
    for (int j = 0; j < n && x < d; j++) {
        const float pj = p[j];
        const float *vj = v[j];
#pragma omp simd
        for (int y = x; y < d; y++) acc[y] += pj * vj[y];
    }
}

/* Products in registers. A tile's rows of head kvh are read where they lie in the pages
 * (tile_ptrs), whatever their dtype, and each vector of a key or value is converted to float32 in
 * a register (int8: sign-extend and convert; bfloat16: the high half of a float32; float32: a
 * load) once for several query rows (QK_ROWS, PV_ROWS). That needs AVX2 (or AVX-512) and a head
 * dim that is a multiple of the vector width (IN_REGS); else a tile's rows are converted into
 * float32 copies for the float loops above. Scores of 4 keys are summed together (tile_sums), so
 * a tile's tail reads a zero row for the missing keys; scores[r] has room for them (TILE is a
 * multiple of 4). int8 pages (dtype 2) keep their scales out of the products: the scale of each
 * token's page (tscale) multiplies its scores (K) and probabilities (V).
 *
 * Measured on the 2-core AMD EPYC with AVX-512 (9 / 3 heads, D 64, 30 layers' caches at 8K,
 * libraries alternating): int8 pages reach ~90% of the machine's FMA rate with the cache in L2;
 * see docs/kernels.md for bfloat16 and float32 against the copies they used before. */

/* The rows (head kvh) of the tile's n tokens in the pages; int8: their pages' scales too. */
static inline void tile_ptrs(const void *cache, int dtype, const float *scale, const int64_t *slots,
                             const int64_t *pages, int n, int num_kv, int kvh, int d,
                             const void **rows, float *tscale) {
    const int elem = dtype == 0 ? 4 : dtype == 1 ? 2 : 1;
    for (int j = 0; j < n; j++) {
        rows[j] = (const char *)cache + (slots[j] * num_kv + kvh) * (int64_t)d * elem;
        if (dtype == 2) tscale[j] = scale[pages[j] * num_kv + kvh];
    }
}

#ifdef HAVE_AVX2
#define INLINE static inline __attribute__((always_inline))
#ifdef HAVE_AVX512
typedef __m512 vec;
#define VW 16      /* floats per vector */
#define QK_ROWS 4  /* query rows scored together: 4 x 4 sums, 4 keys and a query in registers */
#define PV_ROWS 4  /* rows accumulated together ... */
#define PV_VECS 4  /* ... over this many vectors of D: 16 sums, 4 values, a probability */
#define vzero _mm512_setzero_ps
#define vset1 _mm512_set1_ps
#define vload _mm512_loadu_ps
#define vstore _mm512_storeu_ps
#define vfma _mm512_fmadd_ps
/* VW values of a row of the given dtype (a constant where this is inlined) as float32. */
INLINE vec kv_vec(const void *row, int dtype, int x) {
    if (dtype == 0) return _mm512_loadu_ps((const float *)row + x);
    if (dtype == 1)
        return _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + x))), 16));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)((const int8_t *)row + x))));
}
#else
typedef __m256 vec;
#define VW 8
#define QK_ROWS 2 /* 16 registers: 2 x 4 sums, 4 keys and a query */
#define PV_ROWS 4
#define PV_VECS 2
#define vzero _mm256_setzero_ps
#define vset1 _mm256_set1_ps
#define vload _mm256_loadu_ps
#define vstore _mm256_storeu_ps
#define vfma _mm256_fmadd_ps
INLINE vec kv_vec(const void *row, int dtype, int x) {
    if (dtype == 0) return _mm256_loadu_ps((const float *)row + x);
    if (dtype == 1)
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + x))), 16));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)row + x))));
}
#endif
#define IN_REGS(d) ((d) % VW == 0)
/* Float pages take the products in registers at both levels. At AVX2 (4 keys x 2 query rows)
 * the float32 / widened-copy loops measured faster while the next tile's rows were asked for in
 * bursts; since they are asked for a few lines per step (Ahead), the products in registers win
 * there too (docs/kernels.md). */
#define FLOAT_IN_REGS(d) IN_REGS(d)

/* Horizontal sums of a[0 .. 4 QK_ROWS): sum r * 4 + t lands in floats 4r .. 4r + 3 of the
 * result, so each 128-bit lane holds one row's scores of 4 keys. */
INLINE vec tile_sums(const vec *a) {
#ifdef HAVE_AVX512
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++) /* 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                             _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* 128-bit lane L: the lane-L sums of a[4i .. 4i + 3] */
        const __m512d x = _mm512_castps_pd(t[2 * i]), y = _mm512_castps_pd(t[2 * i + 1]);
        u[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
    const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                    _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w0, w1, _MM_SHUFFLE(3, 1, 3, 1)));
#else
    return sum8x8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]);
#endif
}

/* scores[r][j0 .. j0 + 4) = q_r . k_t for the nr (<= QK_ROWS) rows at q (stride d) and 4 rows
 * k of the given dtype (d a multiple of VW). */
INLINE void qk_regs(const float *q, int nr, const void *const *k, int dtype, int d, float (*scores)[TILE], int j0) {
    vec a[4 * QK_ROWS];
    for (int i = 0; i < 4 * QK_ROWS; i++) a[i] = vzero();
    for (int x = 0; x < d; x += VW) {
        const vec w0 = kv_vec(k[0], dtype, x), w1 = kv_vec(k[1], dtype, x), w2 = kv_vec(k[2], dtype, x),
                  w3 = kv_vec(k[3], dtype, x);
        for (int r = 0; r < nr; r++) {
            const vec qv = vload(q + (int64_t)r * d + x);
            a[4 * r] = vfma(qv, w0, a[4 * r]);
            a[4 * r + 1] = vfma(qv, w1, a[4 * r + 1]);
            a[4 * r + 2] = vfma(qv, w2, a[4 * r + 2]);
            a[4 * r + 3] = vfma(qv, w3, a[4 * r + 3]);
        }
    }
    float sums[VW]; /* 4 * QK_ROWS */
    vstore(sums, tile_sums(a));
    for (int r = 0; r < nr; r++) memcpy(scores[r] + j0, sums + 4 * r, 4 * sizeof(float));
}

/* acc rows 0 .. nr (<= PV_ROWS, stride d), columns x0 .. x0 + VW nv (nv <= PV_VECS):
 * += sum over the n tokens of p[r][j] * v_j (rows of the given dtype). */
INLINE void pv_regs(float (*p)[TILE], int nr, const void *const *v, int dtype, int n, int x0, int nv,
                    float *acc, int d) {
    vec c[PV_ROWS][PV_VECS];
    for (int r = 0; r < nr; r++)
        for (int u = 0; u < nv; u++) c[r][u] = vload(acc + (int64_t)r * d + x0 + VW * u);
    for (int j = 0; j < n; j++) {
        vec w[PV_VECS];
        for (int u = 0; u < nv; u++) w[u] = kv_vec(v[j], dtype, x0 + VW * u);
        for (int r = 0; r < nr; r++) {
            const vec pj = vset1(p[r][j]);
            for (int u = 0; u < nv; u++) c[r][u] = vfma(pj, w[u], c[r][u]);
        }
    }
    for (int r = 0; r < nr; r++)
        for (int u = 0; u < nv; u++) vstore(acc + (int64_t)r * d + x0 + VW * u, c[r][u]);
}

#define CAP(x, most) ((x) < (most) ? (x) : (most)) /* keeps unreachable cases in bounds */
/* BODY(DT) with the page dtype a constant DT. */
#define BY_DTYPE(BODY)                                                                       \
    switch (dtype) {                                                                         \
    case 0: BODY(0) break;                                                                   \
    case 1: BODY(1) break;                                                                   \
    default: BODY(2) break;                                                                  \
    }

/* qk_regs with nr (<= QK_ROWS) and the dtype made constants. */
#define QK_ROWS_OF(DT)                                                                       \
    switch (nr) {                                                                            \
    case 1: qk_regs(q, 1, k, DT, d, scores, j0); break;                                      \
    case 2: qk_regs(q, CAP(2, QK_ROWS), k, DT, d, scores, j0); break;                        \
    case 3: qk_regs(q, CAP(3, QK_ROWS), k, DT, d, scores, j0); break;                        \
    default: qk_regs(q, QK_ROWS, k, DT, d, scores, j0); break;                               \
    }
static void qk_any(const float *q, int nr, const void *const *k, int dtype, int d, float (*scores)[TILE], int j0) {
    BY_DTYPE(QK_ROWS_OF)
}
#undef QK_ROWS_OF

/* pv_regs with nr (<= PV_ROWS), nv (<= PV_VECS) and the dtype made constants, so each copy keeps
 * its sums in registers. */
#define PV_WIDTHS(NR, DT)                                                            \
    switch (nv) {                                                                    \
    case 1: pv_regs(p, NR, v, DT, n, x0, 1, acc, d); break;                          \
    case 2: pv_regs(p, NR, v, DT, n, x0, CAP(2, PV_VECS), acc, d); break;            \
    case 3: pv_regs(p, NR, v, DT, n, x0, CAP(3, PV_VECS), acc, d); break;            \
    default: pv_regs(p, NR, v, DT, n, x0, PV_VECS, acc, d); break;                   \
    }
#define PV_ROWS_OF(DT)                                                               \
    switch (nr) {                                                                    \
    case 1: PV_WIDTHS(1, DT) break;                                                  \
    case 2: PV_WIDTHS(CAP(2, PV_ROWS), DT) break;                                    \
    case 3: PV_WIDTHS(CAP(3, PV_ROWS), DT) break;                                    \
    default: PV_WIDTHS(PV_ROWS, DT) break;                                           \
    }
static void pv_any(float (*p)[TILE], int nr, const void *const *v, int dtype, int n, int x0, int nv,
                   float *acc, int d) {
    BY_DTYPE(PV_ROWS_OF)
}
#undef PV_ROWS_OF
#undef PV_WIDTHS
#undef BY_DTYPE
#else
#define IN_REGS(d) 0
#define FLOAT_IN_REGS(d) 0
#endif

/* Whether a tile of this dtype and head dim takes the products in registers. */
static inline int regs_for(int dtype, int d) { return dtype == 2 ? IN_REGS(d) : FLOAT_IN_REGS(d); }

/* dst[0..d) = a page row of the given dtype as float32 (int8 unscaled). */
static inline void row_as_float(const void *row, int dtype, int d, float *dst) {
    if (dtype == 2) {
        int8_row((const int8_t *)row, d, dst);
    } else if (dtype == 1) {
        const uint16_t *src = (const uint16_t *)row;
        uint32_t *out = (uint32_t *)dst;
        for (int x = 0; x < d; x++) out[x] = (uint32_t)src[x] << 16;
    } else {
        memcpy(dst, row, sizeof(float) * (size_t)d);
    }
}

/* The next tile's whole K and V rows (every KV head), asked for into L2 a few lines at a time
 * while this tile computes: `step` lines at each of the tile's steps (a group of 4 keys in
 * tile_scores, a vector group of D in tile_accumulate, a query row in the copy loops), so the
 * requests spread over the tile's work. Asking for them in one burst per KV head (before)
 * left the reads and the products in sequence: on the 2-core AMD EPYC (Zen 3, AVX2 only) the
 * kernel took about the sum of its compute (one layer's cache reused from L2) and a plain read
 * of the bytes. Measured there (2026-12-05; ad-hoc script over caches larger than L3, 16 or 30
 * layers, 2 threads, one query token; docs/kernels.md has all rows and rounds): 32 / 8 heads,
 * D 128, 16K tokens, float32 pages 17.2 -> 12.7 ms for 2 layers, bfloat16 17.2 -> 8.9, int8
 * 9.8 -> 7.7; 9 / 3 heads, D 64, 8K, 30 layers: float32 23.3 -> 19.5-20.7, bfloat16 20.1 ->
 * 14.5-16.5 (with the products in registers at AVX2, FLOAT_IN_REGS). Whole rows, in token order:
 * the pages' own order, so each line is asked for once. Into L1 (T0) measured slower. AVX2
 * builds, and AVX-512 builds on Intel CPUs (cpu_decode.py passes -DSPREAD_AHEAD=1 there): on an
 * Intel Xeon (family 6 model 207, 2026-12-06, the same kind of script, builds alternating,
 * medians of 9, the same bits) 9 / 3 heads, D 64, 4K, 30 layers float32 18.3 -> 15.8 ms,
 * bfloat16 15.9 -> 13.8; 32 / 8 heads, D 64, 4K, 16 layers 22.9 -> 19.6 and 18.7 -> 15.6; 16K,
 * 4 layers 23.6 -> 20.0 and 15.8 -> 13.6. Other AVX-512 builds keep prefetch_rows' part per KV
 * head, the form measured on the AMD EPYC (Zen 4). */
#ifndef SPREAD_AHEAD
#ifdef HAVE_AVX512
#define SPREAD_AHEAD 0 /* prefetch_rows' part per KV head instead */
#else
#define SPREAD_AHEAD 1
#endif
#endif
typedef struct {
    const char *cache[2]; /* K, V */
    const int64_t *slots; /* the next tile's cache slots */
    int n, row_bytes;     /* its tokens; bytes of a whole row */
    int which, j, b;      /* where the asking is: cache, row, byte */
    int step;             /* lines per call */
} Ahead;

static inline void ahead_some(Ahead *a) {
#ifdef HAVE_AVX2
    if (!a) return;
    for (int c = 0; c < a->step && a->which < 2; c++) {
        _mm_prefetch(a->cache[a->which] + a->slots[a->j] * a->row_bytes + a->b, _MM_HINT_T1);
        if ((a->b += 64) >= a->row_bytes) {
            a->b = 0;
            if (++a->j == a->n) {
                a->j = 0;
                a->which++;
            }
        }
    }
#else
    (void)a;
#endif
}

/* scores[r][j] = q_r . k_j (int8: times k_scale_j) for the rows rows of q (stride d) and the
 * tile's n rows k (any dtype; attend_split sends float pages here only where FLOAT_IN_REGS).
 * buf: n * d floats for float copies where the products cannot run in registers. */
static void tile_scores(const float *q, int rows, const void *const *k, int dtype, const float *tscale, int n,
                        int d, float *buf, float (*scores)[TILE], Ahead *ahead) {
#ifdef HAVE_AVX2
    static const float zero[MAX_D] = {0}; /* room for a row of any dtype */
    if (regs_for(dtype, d)) {
        for (int j0 = 0; j0 < n; j0 += 4) { /* a key past n reads zeros (scores[r] has room) */
            const void *k4[4];
            for (int t = 0; t < 4; t++) k4[t] = j0 + t < n ? k[j0 + t] : (const void *)zero;
            ahead_some(ahead);
            for (int r0 = 0; r0 < rows; r0 += QK_ROWS)
                qk_any(q + (int64_t)r0 * d, rows - r0 < QK_ROWS ? rows - r0 : QK_ROWS, k4, dtype, d, scores + r0, j0);
        }
    } else
#endif
    {
        const float *kf[TILE];
        for (int j = 0; j < n; j++) {
            row_as_float(k[j], dtype, d, buf + (int64_t)j * d);
            kf[j] = buf + (int64_t)j * d;
        }
        for (int r = 0; r < rows; r++) {
            ahead_some(ahead);
            row_scores(q + (int64_t)r * d, kf, n, d, scores[r]);
        }
    }
    if (dtype == 2)
        for (int r = 0; r < rows; r++) {
            float *sr = scores[r];
#pragma omp simd
            for (int j = 0; j < n; j++) sr[j] *= tscale[j];
        }
}

/* acc[r] += sum_j p[r][j] v_j (int8: p[r][j] scaled by v_scale_j in place, the caller has its
 * sums already) over the tile's n rows v, for the rows rows of acc (stride d). Float dtypes and
 * buf as for tile_scores. */
static void tile_accumulate(float (*p)[TILE], int rows, const void *const *v, int dtype, const float *tscale,
                            int n, int d, float *buf, float *acc, Ahead *ahead) {
    if (dtype == 2)
        for (int r = 0; r < rows; r++) {
            float *pr = p[r];
#pragma omp simd
            for (int j = 0; j < n; j++) pr[j] *= tscale[j];
        }
#ifdef HAVE_AVX2
    if (regs_for(dtype, d)) {
        for (int r0 = 0; r0 < rows; r0 += PV_ROWS) {
            const int nr = rows - r0 < PV_ROWS ? rows - r0 : PV_ROWS;
            for (int x0 = 0; x0 < d; x0 += VW * PV_VECS) {
                const int nv = (d - x0) / VW < PV_VECS ? (d - x0) / VW : PV_VECS;
                ahead_some(ahead);
                pv_any(p + r0, nr, v, dtype, n, x0, nv, acc + (int64_t)r0 * d, d);
            }
        }
        return;
    }
#endif
    const float *vf[TILE];
    for (int j = 0; j < n; j++) {
        row_as_float(v[j], dtype, d, buf + (int64_t)j * d);
        vf[j] = buf + (int64_t)j * d;
    }
    for (int r = 0; r < rows; r++) {
        ahead_some(ahead);
        row_accumulate(p[r], vf, n, d, acc + (int64_t)r * d);
    }
}

/* Calls of ahead_some per KV head and tile: tile_scores' and tile_accumulate's steps. */
static inline int ahead_calls(int regs, int rows, int n, int d) {
#ifdef HAVE_AVX2
    if (regs) return (n + 3) / 4 + (rows + PV_ROWS - 1) / PV_ROWS * ((d + VW * PV_VECS - 1) / (VW * PV_VECS));
#else
    (void)regs; (void)n; (void)d;
#endif
    return 2 * rows;
}

/* Cache slots of tokens [base, base + n). */
static inline void tile_slots(const int32_t *blocks, int block_size, int base, int n, int64_t *slots) {
    int block = base / block_size, offset = base % block_size;
    for (int j = 0; j < n; j++) {
        slots[j] = (int64_t)blocks[block] * block_size + offset;
        if (++offset == block_size) {
            offset = 0;
            block++;
        }
    }
}

/* Block ids (pages) of tokens [base, base + n), for the scales of int8 pages. */
static inline void tile_pages(const int32_t *blocks, int block_size, int base, int n, int64_t *pages) {
    int block = base / block_size, offset = base % block_size;
    for (int j = 0; j < n; j++) {
        pages[j] = blocks[block];
        if (++offset == block_size) {
            offset = 0;
            block++;
        }
    }
}

/* Ask for whole rows (all KV heads) of one cache ahead of their use, into L2: a tile's K and V
 * rows (48 KB for 32 float32 tokens of 3 heads of 64) overflow L1, and the tile's compute is
 * short next to its misses. Measured on the 2-core AMD EPYC, 30 layers' caches at 8K tokens
 * (9 / 3 heads, D 64), medians of 15, alternating builds (ad-hoc script): float32 27.8-28.0 ms
 * into L1 vs 23.8-26.3 into L2, bfloat16 24.9-25.0 vs 18.7-22.5; int8 pages ~25% faster (32K).
 * The next tile's rows are asked for in num_kv parts, one before each KV head's work on this
 * tile, not in one burst at its start (2026-11-25, same geometry, C harness, medians of 21,
 * builds alternating: bfloat16 11.8-12.7 ms against 15.6-16.2 with the burst and per-head
 * widening, int8 6.7-7.2 against 8.3-8.6, float32 unchanged at 20.7-21.6). AVX-512 builds on
 * AMD CPUs keep these parts (SPREAD_AHEAD 0); AVX2 builds and Intel CPUs take the spread form
 * (Ahead), measured on the AVX2-only Zen 3 and an Intel Xeon. */
static inline void prefetch_rows(const void *cache, const int64_t *slots, int n, int row_bytes) {
#ifdef HAVE_AVX2
    for (int j = 0; j < n; j++) {
        const char *row = (const char *)cache + slots[j] * row_bytes;
        for (int b = 0; b < row_bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T1);
    }
#else
    (void)cache; (void)slots; (void)n; (void)row_bytes;
#endif
}

/* Tokens per tile: TILE, or 8 where a few query rows (q_len * group <= 8) meet rows of >= 4 KB
 * (one cache's row, every KV head: float32 pages at 8 KV heads of 128). Such a tile's K and V
 * rows (256 KB at 32 tokens) and the next tile's, asked for ahead, overflow L2 (512 KB on Zen 3).
 * Measured on the 2-core AMD EPYC (Zen 3, AVX2 only), 2 threads, 32 / 8 heads, D 128, float32
 * pages, caches larger than L3, builds alternating in one process (ad-hoc script, medians of
 * 9-15): 4K, one query token, 1.70-2.25 -> 1.43-2.03 ms a layer in four runs (-10 to -16%); 16K
 * 6.6 -> 5.8 and 7.7 -> 7.8; 2 query tokens (8 rows) 2.70 -> 2.46; 8 tokens (32 rows, the
 * products dominate) 6.16 -> 6.53, so those keep TILE. At 2 KB rows (bfloat16 pages of that
 * geometry, float32 at 8 x 64) 8 tokens were 5-10% slower, 16 level with 32. AVX2 builds only
 * (where it was measured, with the spread prefetch): AVX-512 CPUs have 1-2 MB of L2 and were not
 * measured with 8-token tiles; plain C builds ask for nothing ahead. */
static inline int tile_tokens(int rows, int row_bytes) {
#if defined(HAVE_AVX2) && !defined(HAVE_AVX512)
    return rows <= 8 && row_bytes >= 4096 ? 8 : TILE;
#else
    (void)rows; (void)row_bytes;
    return TILE;
#endif
}

/* One work item: tokens [t0, t1) for every KV head, read in token order (whole rows, so the
 * stream is sequential within a page). qs holds the scaled query rows, [Hkv][rows][D], row
 * r = i * group + g being query token i, head kvh * group + g. Writes the partial states of
 * the Hkv * rows rows: max m, sum l, unnormalised acc [Hkv * rows, D]. */
static void attend_split(const float *qs, const void *k_cache, const void *v_cache,
                         const float *k_scale, const float *v_scale, int dtype,
                         const int32_t *blocks, int block_size, int ctx_len, int q_len,
                         int num_heads, int num_kv, int d, const uint64_t *tail_words,
                         int window, float softcap,
                         int t0, int t1, float *m, float *l, float *acc_out, float *wide) {
    const int group = num_heads / num_kv;
    const int rows = q_len * group;
    const int first_new = ctx_len - q_len;
    int lowest[MAX_ROWS]; /* window: each row's first visible key */
    int top_lowest = 0;   /* the largest of them: keys from here on need no window mask */
    if (window > 0)
        for (int r = 0; r < rows; r++) {
            const int i = r / group;
            const int pos = first_new + (tail_words ? __builtin_popcountll(tail_words[i]) - 1 : i);
            lowest[r] = pos - window + 1;
            top_lowest = lowest[r] > top_lowest ? lowest[r] : top_lowest;
        }
    const int elem = dtype == 0 ? 4 : dtype == 1 ? 2 : 1;
    const int row_bytes = num_kv * d * elem;
    const int regs = dtype == 2 || FLOAT_IN_REGS(d); /* products on the page rows (tile_scores) */
    float scores[MAX_ROWS][TILE];
    float kbuf[TILE * MAX_D], vbuf[TILE * MAX_D];
    const float *krows[TILE], *vrows[TILE];
    const void *kv[TILE];      /* in registers: the tile's rows of one head in the pages */
    float tscale[TILE];        /* int8: their pages' scales */
    int64_t pages[TILE];       /* int8: their pages */
    for (int r = 0; r < num_kv * rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(acc_out, 0, sizeof(float) * num_kv * rows * d);
    const int row_elems = num_kv * d;
    float *kwide = wide, *vwide = wide ? wide + (int64_t)TILE * row_elems : NULL; /* bf16: widened tiles */
    int64_t slots[TILE], next_slots[TILE];
    const int tile = tile_tokens(rows, row_bytes);
    tile_slots(blocks, block_size, t0, (t1 - t0 < tile) ? t1 - t0 : tile, next_slots);
    for (int base = t0; base < t1; base += tile) {
        const int n = (t1 - base < tile) ? t1 - base : tile;
        memcpy(slots, next_slots, sizeof(int64_t) * n);
        if (dtype == 2) tile_pages(blocks, block_size, base, n, pages);
        int next = 0; /* the next tile's rows are on their way while this one computes */
        if (base + n < t1) {
            next = (t1 - base - n < tile) ? t1 - base - n : tile;
            tile_slots(blocks, block_size, base + n, next, next_slots);
        }
        const int64_t ahead_lines = 2 * (int64_t)next * ((row_bytes + 63) / 64);
        const int64_t calls = (int64_t)num_kv * ahead_calls(regs_for(dtype, d), rows, n, d);
        Ahead ahead = {{(const char *)k_cache, (const char *)v_cache}, next_slots, next, row_bytes, next ? 0 : 2, 0, 0,
                       (int)((ahead_lines + calls - 1) / calls)};
        Ahead *ask = SPREAD_AHEAD && next ? &ahead : NULL;
        if (wide) {
            widen_tile((const uint16_t *)k_cache, (const uint16_t *)v_cache, slots, n, row_elems, kwide, vwide);
        }
        for (int kvh = 0; kvh < num_kv; kvh++) {
            if (!SPREAD_AHEAD && next) { /* this head's share of the next tile's rows */
                const int a = next * kvh / num_kv, b = next * (kvh + 1) / num_kv;
                prefetch_rows(k_cache, next_slots + a, b - a, row_bytes);
                prefetch_rows(v_cache, next_slots + a, b - a, row_bytes);
            }
            const float *qh = qs + (int64_t)kvh * rows * d;
            float *mh = m + kvh * rows, *lh = l + kvh * rows;
            float *acc_h = acc_out + (int64_t)kvh * rows * d;
            if (regs) {
                tile_ptrs(k_cache, dtype, k_scale, slots, pages, n, num_kv, kvh, d, kv, tscale);
                tile_scores(qh, rows, kv, dtype, tscale, n, d, kbuf, scores, ask);
            } else {
                if (wide)
                    for (int j = 0; j < n; j++) krows[j] = kwide + (int64_t)j * row_elems + kvh * d;
                else
                    tile_rows(k_cache, dtype, slots, n, num_kv, kvh, d, kbuf, krows);
                for (int r = 0; r < rows; r++) {
                    ahead_some(ask);
                    row_scores(qh + r * d, krows, n, d, scores[r]);
                }
            }
            if (softcap > 0.0f) {
                const float inv = 1.0f / softcap;
                for (int r = 0; r < rows; r++)
                    for (int j = 0; j < n; j++) scores[r][j] = softcap * tanhf(scores[r][j] * inv);
            }
            if (window > 0 && base < top_lowest) {
                for (int r = 0; r < rows; r++)
                    for (int j = 0; j < n && base + j < lowest[r]; j++) scores[r][j] = -INFINITY;
            }
            if (tail_words && base + n > first_new) {
                for (int j = first_new > base ? first_new - base : 0; j < n; j++) {
                    const int bit = base + j - first_new;
                    for (int r = 0; r < rows; r++)
                        if (!((tail_words[r / group] >> bit) & 1u)) scores[r][j] = -INFINITY;
                }
            }
            for (int r = 0; r < rows; r++) {
                float peak = mh[r];
                int j0 = 0;
#ifdef HAVE_AVX2
                if (n >= 8) { /* the tile's max in vectors: no chain of n dependent compares */
                    __m256 most = _mm256_loadu_ps(scores[r]);
                    for (j0 = 8; j0 + 8 <= n; j0 += 8) most = _mm256_max_ps(most, _mm256_loadu_ps(scores[r] + j0));
                    __m128 h = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
                    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
                    h = _mm_max_ss(h, _mm_movehdup_ps(h));
                    const float v = _mm_cvtss_f32(h);
                    peak = v > peak ? v : peak;
                }
#endif
                for (int j = j0; j < n; j++) peak = scores[r][j] > peak ? scores[r][j] : peak;
                if (peak == -INFINITY) { /* nothing visible yet in this row */
                    for (int j = 0; j < n; j++) scores[r][j] = 0.0f;
                    continue;
                }
                const float correction = exp_nonpos(mh[r] - peak); /* m = -inf gives 0 */
                const float sum = exp_row(scores[r], n, peak);
                lh[r] = lh[r] * correction + sum;
                mh[r] = peak;
                if (correction != 1.0f) {
                    float *acc = acc_h + r * d;
#pragma omp simd
                    for (int x = 0; x < d; x++) acc[x] *= correction;
                }
            }
            if (regs) {
                tile_ptrs(v_cache, dtype, v_scale, slots, pages, n, num_kv, kvh, d, kv, tscale);
                tile_accumulate(scores, rows, kv, dtype, tscale, n, d, vbuf, acc_h, ask);
            } else {
                if (wide)
                    for (int j = 0; j < n; j++) vrows[j] = vwide + (int64_t)j * row_elems + kvh * d;
                else
                    tile_rows(v_cache, dtype, slots, n, num_kv, kvh, d, vbuf, vrows);
                for (int r = 0; r < rows; r++) {
                    ahead_some(ask);
                    row_accumulate(scores[r], vrows, n, d, acc_h + r * d);
                }
            }
        }
    }
}

/* How many work items a sequence's `len` visible keys are cut into: one per split_tokens, their
 * count rounded up to a multiple of the threads when the items stay at least two tiles long, so
 * that a lone long sequence (the decode of one document) keeps every thread busy to the end.
 * With one split per 512 tokens, 4K + 32 keys made 9 items: 5 for one thread and 4 for the
 * other, 2,560 keys against 1,568. The items cut the keys evenly (split_at). */
static int count_splits(int len, int split_tokens, int threads) {
    int splits = (len + split_tokens - 1) / split_tokens;
    const int even = (splits + threads - 1) / threads * threads;
    if (even != splits && len / even >= 2 * TILE) splits = even;
    return splits > 0 ? splits : 1;
}

/* The first key (from the sequence's first visible one) of item `split` of `splits` over `len`
 * keys: an even cut, on a tile's boundary where the items are at least a tile long (then no item
 * is empty: consecutive cuts differ by at least one tile). */
static inline int split_at(int len, int split, int splits) {
    const int at = (int)((int64_t)len * split / splits);
    return split == splits || len / splits < TILE ? at : at / TILE * TILE;
}

/* A varlen batch in one call: the sequences seqs[0..num_seqs) of a step whose query rows are
 * q[cu_q[s] .. cu_q[s + 1]) and whose pages are block_table[s * table_stride ..] (ctx_lens[s]
 * tokens). Every (sequence, split) is one work item, shared out over `threads` OpenMP threads
 * (the caller passes torch's count), then each row's splits are merged. words: per query row of
 * the whole step (indexed like q's rows), bit j lets the row see new token j of its sequence;
 * NULL: causal among each sequence's new tokens. out [T, H, D] / lse [T, H] rows of the chosen
 * sequences are written, others are left alone.
 *
 * Returns 0, or a negative code for arguments this kernel does not take (the caller checks them
 * first; this is a second line; -4: out of memory; -5: a sequence outside the table, q or the
 * cache, see batch_seq_ok). dtype: 0 float32, 1 bfloat16, 2 int8 (k_scale and v_scale then
 * required, else ignored). */
int longctx_paged_decode_batch(const float *q, const void *k_cache, const void *v_cache,
                               const float *k_scale, const float *v_scale, int dtype,
                               const int32_t *block_table, int table_rows, int64_t table_stride,
                               int num_blocks, const int32_t *ctx_lens, const int32_t *cu_q,
                               int total_q, const int32_t *seqs,
                               int num_seqs, int block_size, int num_heads, int num_kv, int d,
                               float scale, const uint64_t *words, int window, float softcap,
                               int split_tokens, int threads, float *out, float *lse) {
    if (dtype != 0 && dtype != 1 && dtype != 2) return -1;
    if (dtype == 2 && (!k_scale || !v_scale)) return -1;
    if (num_kv <= 0 || num_heads % num_kv != 0 || d < 1 || d > MAX_D) return -2;
    if (split_tokens < 1 || threads < 1 || block_size < 1 || num_seqs < 0 || window < 0 || softcap < 0.0f) return -3;
    if (num_seqs == 0) return 0;
    const int group = num_heads / num_kv;
    uint64_t causal[63]; /* new token i sees new tokens 0..i */
    for (int i = 0; i < 63; i++) causal[i] = ((uint64_t)2 << i) - 1;
    /* per sequence: where its scaled queries and split states start, and its first item */
    int64_t *q_at = malloc(sizeof(int64_t) * 2 * (size_t)num_seqs);
    int *first_item = malloc(sizeof(int) * ((size_t)num_seqs + 1));
    if (!q_at || !first_item) {
        free(q_at);
        free(first_item);
        return -4;
    }
    int64_t *state_at = q_at + num_seqs, floats = 0;
    first_item[0] = 0;
    for (int i = 0; i < num_seqs; i++) {
        if (!batch_seq_ok(seqs[i], table_rows, block_table, table_stride, num_blocks, block_size, ctx_lens, cu_q,
                          total_q)) {
            free(q_at);
            free(first_item);
            return -5;
        }
        const int s = seqs[i], q_len = cu_q[s + 1] - cu_q[s], ctx_len = ctx_lens[s];
        const int all_rows = num_kv * q_len * group;
        if (q_len < 1 || q_len > 63 || q_len * group > MAX_ROWS || ctx_len < q_len) {
            free(q_at);
            free(first_item);
            return -3;
        }
        const int splits = count_splits(ctx_len - key_start(ctx_len, q_len, window), split_tokens, threads);
        q_at[i] = floats;
        state_at[i] = floats + (int64_t)all_rows * d;
        floats = state_at[i] + (int64_t)splits * all_rows * (d + 2);
        first_item[i + 1] = first_item[i] + splits;
    }
    float *work = malloc(sizeof(float) * (size_t)floats);
    if (!work) {
        free(q_at);
        free(first_item);
        return -4;
    }
    for (int i = 0; i < num_seqs; i++) { /* the queries per KV head, scaled */
        const int s = seqs[i], rows = (cu_q[s + 1] - cu_q[s]) * group;
        const float *qs = q + (int64_t)cu_q[s] * num_heads * d;
        for (int kvh = 0; kvh < num_kv; kvh++)
            for (int r = 0; r < rows; r++) {
                const float *src = qs + ((int64_t)(r / group) * num_heads + kvh * group + r % group) * d;
                float *dst = work + q_at[i] + ((int64_t)kvh * rows + r) * d;
                for (int x = 0; x < d; x++) dst[x] = src[x] * scale;
            }
    }
    const int items = first_item[num_seqs];
    /* bfloat16: per thread, a tile's K and V rows widened to float32 (2 x TILE x Hkv x D floats) */
    const size_t wide_floats = dtype == 1 && !FLOAT_IN_REGS(d) ? (size_t)2 * TILE * num_kv * d : 0;
    float *wide_pool = wide_floats ? aligned_alloc(64, (wide_floats * sizeof(float) * (size_t)threads + 63) / 64 * 64)
                                   : NULL;
    if (wide_floats && !wide_pool) {
        free(work);
        free(q_at);
        free(first_item);
        return -4;
    }
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int item = 0; item < items; item++) {
#ifdef _OPENMP
        float *wide = wide_pool ? wide_pool + wide_floats * (size_t)omp_get_thread_num() : NULL;
#else
        float *wide = wide_pool;
#endif
        int i = 0, hi = num_seqs - 1; /* the sequence: the last one whose first item <= item */
        while (i < hi) {
            const int mid = (i + hi + 1) / 2;
            if (first_item[mid] <= item) i = mid; else hi = mid - 1;
        }
        const int s = seqs[i], q_len = cu_q[s + 1] - cu_q[s], ctx_len = ctx_lens[s];
        const int all_rows = num_kv * q_len * group, split = item - first_item[i];
        const int lo = key_start(ctx_len, q_len, window), splits = first_item[i + 1] - first_item[i];
        const int t0 = lo + split_at(ctx_len - lo, split, splits), t1 = lo + split_at(ctx_len - lo, split + 1, splits);
        const uint64_t *tail = words ? words + cu_q[s] : q_len > 1 ? causal : NULL;
        float *state = work + state_at[i] + (int64_t)split * all_rows * (d + 2);
        attend_split(work + q_at[i], k_cache, v_cache, k_scale, v_scale, dtype,
                     block_table + (int64_t)s * table_stride, block_size, ctx_len, q_len, num_heads,
                     num_kv, d, tail, window, softcap, t0, t1, state, state + all_rows, state + 2 * all_rows,
                     wide);
    }
    free(wide_pool);
    /* merge: one flat loop over every sequence's rows */
    int64_t total_rows = 0;
    for (int i = 0; i < num_seqs; i++) total_rows += (int64_t)num_kv * (cu_q[seqs[i] + 1] - cu_q[seqs[i]]) * group;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t flat = 0; flat < total_rows; flat++) {
        int i = 0;
        int64_t at = flat;
        for (;; i++) { /* few sequences per step: a walk is enough */
            const int64_t n = (int64_t)num_kv * (cu_q[seqs[i] + 1] - cu_q[seqs[i]]) * group;
            if (at < n) break;
            at -= n;
        }
        const int s = seqs[i], q_len = cu_q[s + 1] - cu_q[s], rows = q_len * group;
        const int splits = first_item[i + 1] - first_item[i];
        merge_row(work + state_at[i], splits, (int64_t)num_kv * rows * (d + 2), num_kv * rows, (int)at, rows,
                  group, num_heads, d, 0, out + (int64_t)cu_q[s] * num_heads * d, lse + (int64_t)cu_q[s] * num_heads);
    }
    free(work);
    free(q_at);
    free(first_item);
    return 0;
}

/* ---------------------------------------------------------------------------------------
 * int8 page write (kernels/kv_quant.py's write_int8, for K and V in one call): the same
 * steps in the same float32 arithmetic, so the bytes equal the torch path's.
 *   1. the scales of the pages the ``starts`` rows enter, before anything changes;
 *   2. a page whose offset 0 is written forgets its scale; every page's scale becomes the
 *      max of itself and its new rows' |x| / 127 (per KV head);
 *   3. a page entered by a ``starts`` row that held values under a smaller scale is
 *      requantised (round(q * old / new)), once per page;
 *   4. the rows are quantised with their page's scale: round(x / scale), clamped to +-127.
 * x: float32 [T, H, D] rows; slots [T] (>= 0); starts [R] row indices; old: [R * H] work.
 * --------------------------------------------------------------------------------------- */
static void int8_write_one(int8_t *cache, float *scale, const float *x, const int64_t *slots, int64_t n,
                           const int64_t *starts, int64_t r_count, int bs, int h, int d, float *old) {
    const int64_t page = (int64_t)bs * h * d;
    for (int64_t r = 0; r < r_count; r++) {
        const int64_t b = slots[starts[r]] / bs;
        for (int j = 0; j < h; j++) old[r * h + j] = scale[b * h + j];
    }
    for (int64_t t = 0; t < n; t++)
        if (slots[t] % bs == 0)
            for (int j = 0; j < h; j++) scale[(slots[t] / bs) * h + j] *= 0.0f;
    for (int64_t t = 0; t < n; t++) {
        const int64_t b = slots[t] / bs;
        for (int j = 0; j < h; j++) {
            const float *row = x + (t * h + j) * d;
            float m = 0.0f;
            for (int e = 0; e < d; e++) m = fmaxf(m, fabsf(row[e]));
            m = m / 127.0f;
            if (m > scale[b * h + j]) scale[b * h + j] = m;
        }
    }
    for (int64_t r = 0; r < r_count; r++) {
        const int64_t slot = slots[starts[r]], b = slot / bs;
        int seen = 0;
        for (int64_t p = 0; p < r; p++) seen |= slots[starts[p]] / bs == b;
        if (seen || slot % bs == 0) continue;  /* done already / started here: ratio 1 */
        for (int j = 0; j < h; j++) {
            const float now = scale[b * h + j];
            float ratio = now <= 0.0f ? 1.0f : old[r * h + j] / fmaxf(now, 1e-30f);
            if (ratio >= 1.0f) continue;
            for (int o = 0; o < bs; o++) {
                int8_t *q = cache + b * page + ((int64_t)o * h + j) * d;
                for (int e = 0; e < d; e++) q[e] = (int8_t)nearbyintf((float)q[e] * ratio);
            }
        }
    }
    for (int64_t t = 0; t < n; t++) {
        const int64_t b = slots[t] / bs, off = slots[t] % bs;
        for (int j = 0; j < h; j++) {
            const float step = fmaxf(scale[b * h + j], 1e-30f);
            const float *row = x + (t * h + j) * d;
            int8_t *q = cache + b * page + (off * h + j) * d;
            for (int e = 0; e < d; e++) {
                float v = nearbyintf(row[e] / step);
                q[e] = (int8_t)(v > 127.0f ? 127.0f : (v < -127.0f ? -127.0f : v));
            }
        }
    }
}

int longctx_int8_write_kv(int8_t *k_cache, int8_t *v_cache, float *k_scale, float *v_scale,
                          const float *k, const float *v, const int64_t *slots, int64_t n,
                          const int64_t *starts, int64_t r_count, int64_t num_blocks, int bs, int h, int d,
                          float *old) {
    if (bs < 1 || h < 1 || d < 1 || n < 0 || r_count < 0) return -1;
    for (int64_t t = 0; t < n; t++) /* slots inside the cache, starts inside the rows */
        if (slots[t] < 0 || slots[t] >= num_blocks * bs) return -2;
    for (int64_t r = 0; r < r_count; r++)
        if (starts[r] < 0 || starts[r] >= n) return -2;
    int8_write_one(k_cache, k_scale, k, slots, n, starts, r_count, bs, h, d, old);
    int8_write_one(v_cache, v_scale, v, slots, n, starts, r_count, bs, h, d, old);
    return 0;
}

/* float32 to bfloat16 as torch converts (round to nearest even; a NaN to 0x7FC0, torch's scalar form). */
static inline uint16_t bf16_nearest_even(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* The page writes of a float cache in one pass: float32 k / v rows [n, h * d] (row strides ldk,
 * ldv; each row's heads contiguous: q, k and v of one fused qkv row) into float32 (dtype 0) or
 * bfloat16 (dtype 1) caches [num_blocks, bs, h, d] at slots[t] (block * bs + offset; < 0:
 * skipped), where torch converts each row (k.to(cache dtype)) and then copies it into its slot
 * (index_copy_). Rows split over threads. Returns 0, -1 (shapes), -2 (a slot outside the cache:
 * nothing written). */
int longctx_write_kv(void *k_cache, void *v_cache, int dtype, const float *k, int64_t ldk, const float *v,
                     int64_t ldv, const int64_t *slots, int64_t n, int64_t num_blocks, int bs, int h, int d,
                     int threads) {
    const int64_t row = (int64_t)h * d;
    if ((dtype != 0 && dtype != 1) || bs < 1 || h < 1 || d < 1 || n < 0 || threads < 1
        || (n > 1 && (ldk < row || ldv < row)))
        return -1;
    for (int64_t t = 0; t < n; t++)
        if (slots[t] >= num_blocks * bs) return -2;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && n >= 64)
    for (int64_t t = 0; t < n; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        for (int which = 0; which < 2; which++) {
            const float *src = which ? v + t * ldv : k + t * ldk;
            void *cache = which ? v_cache : k_cache;
            if (dtype == 0) {
                memcpy((float *)cache + slot * row, src, sizeof(float) * (size_t)row);
                continue;
            }
            uint16_t *dst = (uint16_t *)cache + slot * row;
#pragma omp simd
            for (int64_t e = 0; e < row; e++) dst[e] = bf16_nearest_even(src[e]);
        }
    }
    return 0;
}

/* The exact tail of int8 pages (longctx/kv/exact_tail.py, kv_quant.exchange_keys): for each
 * result row p (query q_rows[src[p]], output row dst[p]) and head, swap the int8 rows of its
 * group's visible keys for their exact rows in out / lse, then write the step's exact rows
 * into the store (after every read: a chunk's last pages may reuse its first page's half).
 * Key j of group g (k = g * kw + j): its int8 row at pool slot pool_slots[k]; its exact row in
 * the store (store_rows[k]) where cached[k], else the step's row new_rows[k]; with old_k / old_v
 * (float32 [G * kw, Hkv, D], both or neither) the int8 rows are those instead. visible: [G, qw,
 * kw] bytes. q, out [T, H, D], lse [T, H], step k / v [T, Hkv, D] and the store [R, Hkv, D]:
 * contiguous float32; src ascending (result rows in group order). Work goes by (group, KV
 * head): the group's keys are converted once into float32 blocks, K transposed, so each
 * query's scores and output are products over contiguous rows (vectorised across keys / D).
 * Returns 0, or -1 (a shape out of range), -2 (an index outside its tensor), -4 (out of memory). */
/* A per-thread buffer of at least n floats, kept between calls (OpenMP's threads persist):
 * a decode step calls once per layer, and a fresh allocation of this size is an mmap. */
/* *a = x . y, *b = x . z over d floats (the exact tail's direct scores). */
static inline void dot2(const float *restrict x, const float *restrict y, const float *restrict z, int d,
                        float *a, float *b) {
    int e = 0;
    float sa = 0.f, sb = 0.f;
#ifdef HAVE_AVX512
    __m512 va = _mm512_setzero_ps(), vb = _mm512_setzero_ps();
    for (; e + 16 <= d; e += 16) {
        const __m512 xv = _mm512_loadu_ps(x + e);
        va = _mm512_fmadd_ps(xv, _mm512_loadu_ps(y + e), va);
        vb = _mm512_fmadd_ps(xv, _mm512_loadu_ps(z + e), vb);
    }
    sa = _mm512_reduce_add_ps(va);
    sb = _mm512_reduce_add_ps(vb);
#elif defined(HAVE_AVX2)
    __m256 va = _mm256_setzero_ps(), vb = _mm256_setzero_ps();
    for (; e + 8 <= d; e += 8) {
        const __m256 xv = _mm256_loadu_ps(x + e);
        va = _mm256_fmadd_ps(xv, _mm256_loadu_ps(y + e), va);
        vb = _mm256_fmadd_ps(xv, _mm256_loadu_ps(z + e), vb);
    }
    __m128 ha = _mm_add_ps(_mm256_castps256_ps128(va), _mm256_extractf128_ps(va, 1));
    __m128 hb = _mm_add_ps(_mm256_castps256_ps128(vb), _mm256_extractf128_ps(vb, 1));
    ha = _mm_hadd_ps(ha, hb); /* a01 a23 b01 b23 */
    ha = _mm_hadd_ps(ha, ha);  /* a b a b */
    sa = _mm_cvtss_f32(ha);
    sb = _mm_cvtss_f32(_mm_shuffle_ps(ha, ha, 1));
#endif
    for (; e < d; e++) {
        sa += x[e] * y[e];
        sb += x[e] * z[e];
    }
    *a = sa;
    *b = sb;
}

/* Key k's stored row of head hk as the kernels read it, float32: old's row where the caller
 * gave them (*scale 1), else its int8 row converted into row (unscaled; *scale its page's). */
static inline const float *tail_old_row(const float *old, const int8_t *cache, const float *scales,
                                        const int64_t *pool_slots, int64_t k, int64_t hd, int hk, int d, int bs,
                                        int num_kv, float *row, float *scale) {
    if (old) {
        *scale = 1.f;
        return old + k * hd + (int64_t)hk * d;
    }
    const int64_t slot = pool_slots[k];
    *scale = scales[(slot / bs) * num_kv + hk];
    int8_row(cache + slot * hd + (int64_t)hk * d, d, row);
    return row;
}

#define TAIL_DIRECT_ROWS 16 /* a job of at most this many rows dots each key row in place */
static float *tail_workspace(size_t n) {
    static __thread float *buf = NULL;
    static __thread size_t cap = 0;
    if (n > cap) {
        float *grown = realloc(buf, sizeof(float) * n);
        if (!grown) return NULL;
        buf = grown;
        cap = n;
    }
    return buf;
}

int longctx_tail_exchange(const float *q, int64_t total_q, float *out, float *lse,
                          const int8_t *k_cache, const int8_t *v_cache, const float *k_scale,
                          const float *v_scale, const float *old_k, const float *old_v, int64_t num_blocks,
                          int bs, int num_heads, int num_kv, int d,
                          float *store_k, float *store_v, int64_t store_len, const float *k_step,
                          const float *v_step, const int64_t *pool_slots, const int64_t *store_rows,
                          const int64_t *new_rows, const uint8_t *cached, const int64_t *q_rows,
                          const uint8_t *visible, const int64_t *src, const int64_t *dst, int64_t n_out,
                          int64_t out_rows, int groups, int qw, int kw, const int64_t *write_rows,
                          float scale, int threads) {
    if (bs < 1 || num_kv < 1 || d < 1 || d > 256 || num_heads % num_kv || groups < 0 || qw < 0 || kw < 0
        || n_out < 0 || total_q < 0)
        return -1;
    const int64_t nkeys = (int64_t)groups * kw, hd = (int64_t)num_kv * d;
    for (int64_t k = 0; k < nkeys; k++) {
        if ((!old_k && (pool_slots[k] < 0 || pool_slots[k] >= num_blocks * bs)) || store_rows[k] < 0
            || store_rows[k] >= store_len
            || (!cached[k] && (new_rows[k] < 0 || new_rows[k] >= total_q)))
            return -2;
    }
    for (int64_t p = 0; p < n_out; p++)
        if (src[p] < 0 || src[p] >= (int64_t)groups * qw || (p && src[p] <= src[p - 1]) || dst[p] < 0
            || dst[p] >= out_rows || q_rows[src[p]] < 0 || q_rows[src[p]] >= total_q)
            return -2;
    for (int64_t t = 0; t < total_q; t++)
        if (write_rows[t] < 0 || write_rows[t] >= store_len) return -2;
    int64_t *first = malloc(sizeof(int64_t) * (size_t)(groups + 1)); /* group g's result rows: first[g] .. first[g + 1] */
    if (!first) return -4;
    for (int g = 0, p = 0; g <= groups; g++) {
        while (p < n_out && src[p] / qw < g) p++;
        first[g] = p;
    }
    const int group = num_heads / num_kv;
    int ok = 1;
    const int rows_most = qw * group; /* a job's result rows: its group's queries x heads */
#pragma omp parallel num_threads(threads) if (n_out * num_heads >= 64)
    {
        const size_t block = (size_t)kw * d, rk = (size_t)rows_most * kw;
        float *w = tail_workspace(2 * block + 2 * rk + (size_t)rows_most * (d + 3) + (size_t)d);
        if (!w) {
#pragma omp atomic write
            ok = 0;
        }
#pragma omp for schedule(dynamic)
        for (int64_t job = 0; job < (int64_t)groups * num_kv; job++) {
            const int64_t g = job / num_kv;
            const int hk = (int)(job % num_kv);
            if (!w || first[g] == first[g + 1]) continue;
            /* row r: result first[g] + r / group, head hk * group + r % group */
            const int rows = (int)(first[g + 1] - first[g]) * group;
            float *restrict kto = w, *restrict ktn = w + block, *restrict so_all = w + 2 * block,
                  *restrict sn_all = so_all + rk, *restrict acc = sn_all + rk, *restrict top = acc + (size_t)rows_most * d,
                  *restrict base = top + rows_most, *restrict den = base + rows_most, *restrict row = den + rows_most;
            const float *qv[TAIL_DIRECT_ROWS];
            int n = 0; /* keys past the last one any of the job's queries sees are skipped (a causal page's) */
            for (int64_t p = first[g]; p < first[g + 1]; p++) {
                const uint8_t *vis = visible + src[p] * kw;
                int m = kw;
                while (m > n && !vis[m - 1]) m--;
                n = m > n ? m : n;
            }
            if (rows <= TAIL_DIRECT_ROWS) {
                /* few rows (a decode, a drafting sequence's verify): each key row is read once and
                 * dotted with every row's query where it lies, no transposed copy */
                for (int r = 0; r < rows; r++)
                    qv[r] = q + (q_rows[src[first[g] + r / group]] * num_heads + hk * group + r % group) * d;
                for (int j = 0; j < n; j++) {
                    const int64_t k = g * kw + j;
                    const float *kx = (cached[k] ? store_k + store_rows[k] * hd : k_step + new_rows[k] * hd) + (int64_t)hk * d;
                    float ks;
                    const float *ko = tail_old_row(old_k, k_cache, k_scale, pool_slots, k, hd, hk, d, bs, num_kv, row, &ks);
                    for (int r = 0; r < rows; r++) {
                        float a, b;
                        dot2(qv[r], ko, kx, d, &a, &b);
                        so_all[(size_t)r * kw + j] = a * ks * scale;
                        sn_all[(size_t)r * kw + j] = b * scale;
                    }
                }
            } else {
                for (int j = 0; j < n; j++) { /* the group's keys, K transposed [d][kw] (V is read in place) */
                    const int64_t k = g * kw + j;
                    const float *kx = (cached[k] ? store_k + store_rows[k] * hd : k_step + new_rows[k] * hd) + (int64_t)hk * d;
                    if (old_k) { /* the old rows given (float32 [G * kw, Hkv, D]: a rank's gathered rows) */
                        const float *ko = old_k + k * hd + (int64_t)hk * d;
                        for (int e = 0; e < d; e++) {
                            kto[(int64_t)e * kw + j] = ko[e];
                            ktn[(int64_t)e * kw + j] = kx[e];
                        }
                        continue;
                    }
                    const int64_t slot = pool_slots[k];
                    const float ks = k_scale[(slot / bs) * num_kv + hk];
                    const int8_t *ko = k_cache + slot * hd + (int64_t)hk * d;
                    for (int e = 0; e < d; e++) {
                        kto[(int64_t)e * kw + j] = (float)ko[e] * ks;
                        ktn[(int64_t)e * kw + j] = kx[e];
                    }
                }
                for (int r = 0; r < rows; r++) {
                    const float *qr = q + (q_rows[src[first[g] + r / group]] * num_heads + hk * group + r % group) * d;
                    float *restrict so = so_all + (size_t)r * kw, *restrict sn = sn_all + (size_t)r * kw;
                    for (int j = 0; j < n; j++) so[j] = sn[j] = 0.f;
                    for (int e = 0; e < d; e++) { /* scores, across keys */
                        const float x = qr[e] * scale;
                        const float *a = kto + (int64_t)e * kw, *b = ktn + (int64_t)e * kw;
                        for (int j = 0; j < n; j++) {
                            so[j] += x * a[j];
                            sn[j] += x * b[j];
                        }
                    }
                }
            }
            for (int r = 0; r < rows; r++) { /* each row's weights: its own page's and first page's keys swapped */
                const int64_t p = first[g] + r / group;
                const uint8_t *vis = visible + src[p] * kw;
                float *restrict so = so_all + (size_t)r * kw, *restrict sn = sn_all + (size_t)r * kw;
                const float l0 = lse[dst[p] * num_heads + hk * group + r % group];
                float t = l0;
                for (int j = 0; j < n; j++) {
                    if (!vis[j]) so[j] = sn[j] = -INFINITY;
                    t = so[j] > t ? so[j] : t;
                    t = sn[j] > t ? sn[j] : t;
                }
                top[r] = t;
                if (isinf(t)) { /* nothing seen at all */
                    for (int j = 0; j < n; j++) so[j] = sn[j] = 0.f;
                    continue;
                }
                base[r] = exp_nonpos(l0 - t); /* l0 = -inf gives 0 */
                den[r] = base[r] - exp_row(so, n, t) + exp_row(sn, n, t); /* the scores are weights now */
                const float *ov = out + (dst[p] * num_heads + hk * group + r % group) * d;
                for (int e = 0; e < d; e++) acc[(size_t)r * d + e] = base[r] * ov[e];
            }
            for (int j = 0; j < n; j++) { /* V: each key's rows read once for all rows */
                const int64_t k = g * kw + j;
                const float *restrict b = (cached[k] ? store_v + store_rows[k] * hd : v_step + new_rows[k] * hd) + (int64_t)hk * d;
                int any = 0;
                for (int r = 0; r < rows && !any; r++) any = so_all[(size_t)r * kw + j] != 0.f || sn_all[(size_t)r * kw + j] != 0.f;
                if (!any) continue;
                float vs;
                const float *restrict a = tail_old_row(old_v, v_cache, v_scale, pool_slots, k, hd, hk, d, bs, num_kv, row, &vs);
                for (int r = 0; r < rows; r++) {
                    const float pn = sn_all[(size_t)r * kw + j], po = so_all[(size_t)r * kw + j] * vs;
                    if (pn == 0.f && po == 0.f) continue;
                    float *restrict ar = acc + (size_t)r * d;
#pragma omp simd
                    for (int e = 0; e < d; e++) ar[e] += pn * b[e] - po * a[e];
                }
            }
            for (int r = 0; r < rows; r++) {
                const int64_t o = dst[first[g] + r / group];
                const int h = hk * group + r % group;
                float *ov = out + (o * num_heads + h) * d;
                if (!isinf(top[r]) && den[r] > 0.f) {
                    const float inv = 1.f / den[r];
                    for (int e = 0; e < d; e++) ov[e] = acc[(size_t)r * d + e] * inv;
                    lse[o * num_heads + h] = top[r] + logf(den[r]);
                } else {
                    for (int e = 0; e < d; e++) ov[e] = 0.f;
                    lse[o * num_heads + h] = -INFINITY;
                }
            }
        }
    }
    free(first);
    if (!ok) return -4;
    for (int64_t t = 0; t < total_q; t++) { /* this step's exact rows, after every read */
        memcpy(store_k + write_rows[t] * hd, k_step + t * hd, sizeof(float) * (size_t)hd);
        memcpy(store_v + write_rows[t] * hd, v_step + t * hd, sizeof(float) * (size_t)hd);
    }
    return 0;
}
