/* y = x @ W^T (+ bias) (+ residual) for weights kept in GGUF's block formats, as the file stores
 * them (memory-mapped, never expanded in memory): the products of decode, batched decode and
 * lookahead verification, where the weight bytes read decide the time. A Q4_1 matrix is ~5 bits
 * a weight against float32's 32, so a step streams ~6x fewer bytes.
 *
 * Numerics ("exact"): each weight row is dequantized into float32 exactly as ggml's reference
 * (and the gguf package, and transformers' GGUF loader) computes it - every block format's
 * value is d * q (+ m, or - dmin * m), whose product is exact in float32 (at most 24 significant
 * bits: an fp16 scale times a small integer), so the dequantized row is bit-identical whatever
 * the instruction set - and multiplied in float32. The result is float32's product on the
 * dequantized weights, summed in another order: what the row kernel (linear_rows.c) gives on a
 * float32 copy of them. One exception, AVX2 builds with one row of x: the kernels there take
 * the scales and offsets out of the sums (d * sum(x * q) - m * sum(x), q4k_row_sums and below),
 * the same value in exact arithmetic, rounded differently (~5e-7 of the sum of |x * w| apart).
 *
 *   x    [M, K] float32, row stride ldx
 *   w    [N, row_bytes] bytes: N rows of K / block_elems blocks each, in format fmt (GGML's type
 *        ids: F32 0, F16 1, Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14,
 *        BF16 30)
 *   bias [N] float32 or NULL; res [M, N] float32 (row stride ldr) or NULL
 *   y    [M, N] float32, row stride ldy (so a product can fill a column slice of a wider output:
 *        the parts of a fused q/k/v matrix whose parts have different formats)
 *   prologue (the parts entry) 1: the product takes RMSNorm(x) with weight norm_w and eps;
 *        2: x is [M, 2K] and the product takes silu(x[:, :K]) * x[:, K:] (prologue.h)
 *
 * Work: output rows are cut into chunks of CHUNK over the OpenMP threads asked for. A thread
 * takes a weight row against the x rows four at a time (at AVX2 and up dequantized in registers,
 * the register kernels below; else into a float32 buffer of K floats), so each weight byte is
 * read from memory once per call.
 * longctx_blocks_dequant writes chosen rows (the embedding's lookups) or a range of rows (a
 * prefill step's slice, which then goes to linear_rows.c's panel product) as float32;
 * longctx_blocks_dequant_bf16 a range of rows rounded to bfloat16 (a bfloat16 model's prefill
 * slice, for linear_amx.c's tiles).
 *
 * Built at first use by kernels/cpu_blocks.py with the machine's compiler (cpu_build.py picks
 * the instruction set; AVX-512 and AVX2 dot products by intrinsics, plain C otherwise).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#if defined(__AVX2__) && defined(__FMA__)
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif
#if HAVE_AVX2 && defined(__AVX512F__)
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif

#include "prologue.h"

#define CHUNK 8 /* output rows per work item */
#define C128_MAX_ROWS 8 /* x rows up to which the fast Q8_0 form gets x's c128 (QuantX) */

/* Weight bytes asked into L2 ahead of their use: each block loop below asks for the lines
 * PREFETCH_BYTES past the block it is at (spread over the loop, one or a few lines a step). A
 * thread's rows are contiguous, and with one or a few rows of x (decode) a product is a stream
 * of the weights, which the hardware prefetcher alone kept at ~13.5 GB/s of the ~25 the Intel
 * Xeon's memory gives (Q8_0 [8192, 2048] fast, 2 threads, medians of 7; 2026-12-05): 17.7 with
 * 2 KB ahead into L1, 19.2 with 4 KB into L2. Asking for a whole row at once (34 lines) gave
 * 15.7: bursts fill the L2's miss queue. The 1B int8-fast decode at 4K: with float32 pages
 * 103 ms a token without it, 79-81 with 4 KB ahead; with int8 pages 70-72 at 8 KB against 72-77
 * at 4 KB, 74-76 at 16 KB and 83-85 into L1 (docs/kernels.md). On an AMD EPYC (Zen 3, AVX2
 * only), 2 threads, fast: Q8_0 [8192, 2048] 16.4 GB/s without, 19.6 / 19.9 / 19.9 at 2 / 4 / 8 KB;
 * Q6_K [2048, 8192] 17.1 -> 20.1; exact (bound by the dequantizing, ~5-11 GB/s) alike within the
 * noise either way (medians of 12, one process, builds interleaved; 2026-12-05). */
#ifndef PREFETCH_BYTES
#define PREFETCH_BYTES 8192
#endif
#if HAVE_AVX2 && PREFETCH_BYTES > 0 /* -DPREFETCH_BYTES=0 builds without it (A/B) */
#define PREFETCH_W(ptr, lines)                                                                 \
    do {                                                                                       \
        for (int pf_ = 0; pf_ < (lines); pf_++)                                                \
            _mm_prefetch((const char *)(ptr) + PREFETCH_BYTES + 64 * pf_, _MM_HINT_T1);        \
    } while (0)
#else
#define PREFETCH_W(ptr, lines) ((void)(ptr))
#endif
/* up to this many x rows a register-dequantizing format dequantizes each weight group once per
 * four rows; from there the row is dequantized once into the buffer, which the dot products read */
#define REGISTER_MAX_ROWS 8

enum { F_F32 = 0, F_F16 = 1, F_Q4_0 = 2, F_Q4_1 = 3, F_Q5_0 = 6, F_Q5_1 = 7, F_Q8_0 = 8,
       F_Q4_K = 12, F_Q5_K = 13, F_Q6_K = 14, F_BF16 = 30 };

/* elements and bytes per block, 0 for a format this file does not read */
static int block_elems(int fmt) {
    switch (fmt) {
    case F_F32: case F_F16: case F_BF16: return 1;
    case F_Q4_0: case F_Q4_1: case F_Q5_0: case F_Q5_1: case F_Q8_0: return 32;
    case F_Q4_K: case F_Q5_K: case F_Q6_K: return 256;
    default: return 0;
    }
}

static int block_bytes(int fmt) {
    switch (fmt) {
    case F_F32: return 4;
    case F_F16: case F_BF16: return 2;
    case F_Q4_0: return 18;
    case F_Q4_1: return 20;
    case F_Q5_0: return 22;
    case F_Q5_1: return 24;
    case F_Q8_0: return 34;
    case F_Q4_K: return 144;
    case F_Q5_K: return 176;
    case F_Q6_K: return 210;
    default: return 0;
    }
}

/* IEEE half -> float, exact (normal, subnormal, inf and NaN alike). */
static inline float h2f(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#endif
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, mant = h & 1023;
    uint32_t bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else { /* subnormal: mant * 2^-24, exact in float */
            float f = (float)mant * 5.9604644775390625e-8f;
            return sign ? -f : f;
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Q4_K / Q5_K: the j-th (0..7) sub-block's 6-bit scale and min from the 12 packed bytes. */
static inline void scale_min_k4(int j, const uint8_t *q, int *sc, int *m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

/* One row of K elements in format fmt -> out[K] float32 (bit-identical to ggml's reference). */
static void dequant_row_vector(const uint8_t *row, int fmt, int64_t k, float *restrict out);

static void dequant_row(const uint8_t *row, int fmt, int64_t k, float *restrict out) {
#if defined(__AVX2__) && defined(__FMA__)
    if (fmt == F_Q8_0 || fmt == F_Q4_0 || fmt == F_Q4_1 || fmt == F_Q4_K || fmt == F_Q6_K) {
        dequant_row_vector(row, fmt, k, out);
        return;
    }
#endif
    switch (fmt) {
    case F_F32:
        memcpy(out, row, (size_t)k * 4);
        return;
    case F_F16:
        for (int64_t i = 0; i < k; i++)
            out[i] = h2f(row + 2 * i);
        return;
    case F_BF16:
        for (int64_t i = 0; i < k; i++) {
            uint16_t b;
            memcpy(&b, row + 2 * i, 2);
            const uint32_t bits = (uint32_t)b << 16;
            memcpy(out + i, &bits, 4);
        }
        return;
    }
    const int64_t nb = k / block_elems(fmt);
    const int bb = block_bytes(fmt);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bb;
        PREFETCH_W(blk, 1);
        switch (fmt) {
        case F_Q8_0: {
            float *restrict o = out + b * 32;
            const float d = h2f(blk);
            const int8_t *q = (const int8_t *)(blk + 2);
            for (int j = 0; j < 32; j++)
                o[j] = d * (float)q[j];
            break;
        }
        case F_Q4_0: {
            float *restrict o = out + b * 32;
            const float d = h2f(blk);
            const uint8_t *q = blk + 2;
            for (int j = 0; j < 16; j++) {
                o[j] = d * (float)((int)(q[j] & 15) - 8);
                o[j + 16] = d * (float)((int)(q[j] >> 4) - 8);
            }
            break;
        }
        case F_Q4_1: {
            float *restrict o = out + b * 32;
            const float d = h2f(blk), m = h2f(blk + 2);
            const uint8_t *q = blk + 4;
            for (int j = 0; j < 16; j++) {
                o[j] = d * (float)(q[j] & 15) + m;
                o[j + 16] = d * (float)(q[j] >> 4) + m;
            }
            break;
        }
        case F_Q5_0: case F_Q5_1: {
            float *restrict o = out + b * 32;
            const int one = fmt == F_Q5_1;
            const float d = h2f(blk), m = one ? h2f(blk + 2) : 0.0f;
            uint32_t qh;
            memcpy(&qh, blk + 2 + 2 * one, 4);
            const uint8_t *q = blk + 6 + 2 * one;
            for (int j = 0; j < 16; j++) {
                const int lo = (q[j] & 15) | (((qh >> j) & 1) << 4);
                const int hi = (q[j] >> 4) | (((qh >> (j + 16)) & 1) << 4);
                if (one) {
                    o[j] = d * (float)lo + m;
                    o[j + 16] = d * (float)hi + m;
                } else {
                    o[j] = d * (float)(lo - 16);
                    o[j + 16] = d * (float)(hi - 16);
                }
            }
            break;
        }
        case F_Q4_K: case F_Q5_K: {
            float *restrict o = out + b * 256;
            const int five = fmt == F_Q5_K;
            const float d = h2f(blk), dmin = h2f(blk + 2);
            const uint8_t *scales = blk + 4;
            const uint8_t *qh = blk + 16;                 /* Q5_K: 32 bytes of high bits */
            const uint8_t *qs = blk + 16 + 32 * five;     /* 128 bytes of nibbles */
            for (int c = 0; c < 4; c++) {                 /* 64 elements: two sub-blocks */
                for (int s = 0; s < 2; s++) {
                    int sc, mn;
                    scale_min_k4(2 * c + s, scales, &sc, &mn);
                    const float ds = d * (float)sc, dm = dmin * (float)mn;
                    const int e0 = c * 64 + s * 32;
                    for (int j = 0; j < 32; j++) {
                        int q = (qs[c * 32 + j] >> (4 * s)) & 15;
                        if (five)
                            q |= ((qh[j] >> (e0 / 32)) & 1) << 4;
                        o[e0 + j] = ds * (float)q - dm;
                    }
                }
            }
            break;
        }
        case F_Q6_K: {
            float *restrict o = out + b * 256;
            const uint8_t *ql = blk, *qh = blk + 128;
            const int8_t *sc = (const int8_t *)(blk + 192);
            const float d = h2f(blk + 208);
            for (int h = 0; h < 2; h++) {                 /* halves of 128 elements */
                for (int r = 0; r < 128; r++) {
                    const int e = h * 128 + r;
                    const int lo = (ql[h * 64 + (r & 63)] >> (4 * (r >> 6))) & 15;
                    const int hi = (qh[h * 32 + (r & 31)] >> (2 * (r >> 5))) & 3;
                    o[e] = (d * (float)sc[e / 16]) * (float)((lo | (hi << 4)) - 32);
                }
            }
            break;
        }
        }
    }
}

/* ----------------------------------------------------------------- dot products over a row */

#if HAVE_AVX512
static inline float hsum16(__m512 v) { return _mm512_reduce_add_ps(v); }
#endif
#if HAVE_AVX2
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* x's rows a dot_rows call takes at most: AVX-512 keeps eight sums in registers (eight chains of
 * FMAs in flight, nine loads for eight FMAs), AVX2 four rows of two chains, the C loop four */
#if HAVE_AVX512
#define DOT_ROWS_MAX 8
#else
#define DOT_ROWS_MAX 4
#endif
/* widest k whose DOT_ROWS_MAX rows of x (float32) stay within a 32 KB L1 beside the weight row;
 * wider rows take passes of four */
#define DOT_ROWS_WIDE_K 1024

/* out[i] = x_i . w for R (1..DOT_ROWS_MAX) rows x_i = x + i * ldx, over k elements. Each row's
 * sum takes the same steps in the same order whatever R is and wherever the row sits, so a row
 * gets the same bits alone or with others. */
static inline __attribute__((always_inline)) void dot_rows_n(const float *x, int64_t ldx, const int R,
                                                             const float *w, int64_t k, float *out) {
    int64_t i = 0;
    float acc[DOT_ROWS_MAX] = {0};
#if HAVE_AVX512
    {
        __m512 a[DOT_ROWS_MAX];
        for (int r = 0; r < R; r++)
            a[r] = _mm512_setzero_ps();
        for (; i + 16 <= k; i += 16) {
            const __m512 wv = _mm512_loadu_ps(w + i);
            for (int r = 0; r < R; r++)
                a[r] = _mm512_fmadd_ps(_mm512_loadu_ps(x + r * ldx + i), wv, a[r]);
        }
        for (int r = 0; r < R; r++)
            acc[r] = hsum16(a[r]);
    }
#elif HAVE_AVX2
    {
        __m256 a[DOT_ROWS_MAX], b[DOT_ROWS_MAX]; /* two chains per row: FMA latency */
        for (int r = 0; r < R; r++)
            a[r] = b[r] = _mm256_setzero_ps();
        for (; i + 16 <= k; i += 16) {
            const __m256 w0 = _mm256_loadu_ps(w + i), w1 = _mm256_loadu_ps(w + i + 8);
            for (int r = 0; r < R; r++) {
                a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + i), w0, a[r]);
                b[r] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + i + 8), w1, b[r]);
            }
        }
        for (int r = 0; r < R; r++)
            acc[r] = hsum8(_mm256_add_ps(a[r], b[r]));
    }
#else
    {
        float s[DOT_ROWS_MAX][4] = {{0}};
        for (; i + 4 <= k; i += 4)
            for (int r = 0; r < R; r++)
                for (int l = 0; l < 4; l++)
                    s[r][l] += x[r * ldx + i + l] * w[i + l];
        for (int r = 0; r < R; r++)
            acc[r] = (s[r][0] + s[r][1]) + (s[r][2] + s[r][3]);
    }
#endif
    for (; i < k; i++)
        for (int r = 0; r < R; r++)
            acc[r] += x[r * ldx + i] * w[i];
    for (int r = 0; r < R; r++)
        out[r] = acc[r];
}

/* dot_rows_n with R a compile-time constant in each case (the sums stay in registers) */
static void dot_rows(const float *x, int64_t ldx, int R, const float *w, int64_t k, float *out) {
    switch (R) {
    case 1: dot_rows_n(x, ldx, 1, w, k, out); break;
    case 2: dot_rows_n(x, ldx, 2, w, k, out); break;
    case 3: dot_rows_n(x, ldx, 3, w, k, out); break;
#if DOT_ROWS_MAX > 4
    case 4: dot_rows_n(x, ldx, 4, w, k, out); break;
    case 5: dot_rows_n(x, ldx, 5, w, k, out); break;
    case 6: dot_rows_n(x, ldx, 6, w, k, out); break;
    case 7: dot_rows_n(x, ldx, 7, w, k, out); break;
    default: dot_rows_n(x, ldx, 8, w, k, out); break;
#else
    default: dot_rows_n(x, ldx, 4, w, k, out); break;
#endif
    }
}

/* ------------------------------------------- AVX2: dequantized in registers, 32 weights a time */

#if HAVE_AVX2
/* 32 weights of group g (32 consecutive elements of the row) as four float vectors, the same
 * values as dequant_row's (each product d * q is exact in float32, so an FMA rounds as the
 * reference's multiply-then-add does). */
static inline __m256 cvt8(__m128i bytes8, int is_signed) { /* the low 8 bytes -> 8 floats */
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes8) : _mm256_cvtepu8_epi32(bytes8));
}

static inline void deq_q8_0(const uint8_t *row, int64_t g, __m256 w[4]) {
    const uint8_t *blk = row + g * 34;
    const __m256 d = _mm256_set1_ps(h2f(blk));
    for (int v = 0; v < 4; v++) /* vpmovsxbd from memory: no shuffles to bring the bytes down */
        w[v] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * v)))));
}

/* the 16 bytes' low nibbles (elements 0..15) and high nibbles (16..31) */
static inline void nibbles(const uint8_t *q, __m128i *lo, __m128i *hi) {
    const __m128i b = _mm_loadu_si128((const __m128i *)q), mask = _mm_set1_epi8(15);
    *lo = _mm_and_si128(b, mask);
    *hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
}

static inline void deq_q4_0(const uint8_t *row, int64_t g, __m256 w[4]) {
    const uint8_t *blk = row + g * 18;
    const __m256 d = _mm256_set1_ps(h2f(blk));
    __m128i lo, hi;
    nibbles(blk + 2, &lo, &hi);
    const __m128i eight = _mm_set1_epi8(8);
    lo = _mm_sub_epi8(lo, eight), hi = _mm_sub_epi8(hi, eight);
    w[0] = _mm256_mul_ps(d, cvt8(lo, 1));
    w[1] = _mm256_mul_ps(d, cvt8(_mm_srli_si128(lo, 8), 1));
    w[2] = _mm256_mul_ps(d, cvt8(hi, 1));
    w[3] = _mm256_mul_ps(d, cvt8(_mm_srli_si128(hi, 8), 1));
}

static inline void deq_q4_1(const uint8_t *row, int64_t g, __m256 w[4]) {
    const uint8_t *blk = row + g * 20;
    const __m256 d = _mm256_set1_ps(h2f(blk)), m = _mm256_set1_ps(h2f(blk + 2));
    __m128i lo, hi;
    nibbles(blk + 4, &lo, &hi);
    w[0] = _mm256_fmadd_ps(d, cvt8(lo, 0), m);
    w[1] = _mm256_fmadd_ps(d, cvt8(_mm_srli_si128(lo, 8), 0), m);
    w[2] = _mm256_fmadd_ps(d, cvt8(hi, 0), m);
    w[3] = _mm256_fmadd_ps(d, cvt8(_mm_srli_si128(hi, 8), 0), m);
}

static inline void deq_q4_k(const uint8_t *row, int64_t g, __m256 w[4]) {
    const uint8_t *blk = row + (g >> 3) * 144;
    const int j = (int)(g & 7), c = j >> 1, s = j & 1;
    int sc, mn;
    scale_min_k4(j, blk + 4, &sc, &mn);
    const __m256 ds = _mm256_set1_ps(h2f(blk) * (float)sc), dm = _mm256_set1_ps(h2f(blk + 2) * (float)mn);
    const __m256i b = _mm256_loadu_si256((const __m256i *)(blk + 16 + c * 32));
    const __m256i q = _mm256_and_si256(s ? _mm256_srli_epi16(b, 4) : b, _mm256_set1_epi8(15));
    const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
    w[0] = _mm256_fmsub_ps(ds, cvt8(q0, 0), dm);
    w[1] = _mm256_fmsub_ps(ds, cvt8(_mm_srli_si128(q0, 8), 0), dm);
    w[2] = _mm256_fmsub_ps(ds, cvt8(q1, 0), dm);
    w[3] = _mm256_fmsub_ps(ds, cvt8(_mm_srli_si128(q1, 8), 0), dm);
}

static inline void deq_q6_k(const uint8_t *row, int64_t g, __m256 w[4]) {
    const uint8_t *blk = row + (g >> 3) * 210;
    const int gg = (int)(g & 7), h = gg >> 2, quarter = gg & 3;
    const int8_t *sc = (const int8_t *)(blk + 192);
    const float d = h2f(blk + 208);
    const __m256i l = _mm256_loadu_si256((const __m256i *)(blk + h * 64 + (quarter & 1) * 32));
    const __m256i lo = _mm256_and_si256(quarter >> 1 ? _mm256_srli_epi16(l, 4) : l, _mm256_set1_epi8(15));
    const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + h * 32));
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(hb, _mm_cvtsi32_si128(2 * quarter)), _mm256_set1_epi8(3));
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
    const __m256 d0 = _mm256_set1_ps(d * (float)sc[2 * gg]), d1 = _mm256_set1_ps(d * (float)sc[2 * gg + 1]);
    const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
    w[0] = _mm256_mul_ps(d0, cvt8(q0, 1));
    w[1] = _mm256_mul_ps(d0, cvt8(_mm_srli_si128(q0, 8), 1));
    w[2] = _mm256_mul_ps(d1, cvt8(q1, 1));
    w[3] = _mm256_mul_ps(d1, cvt8(_mm_srli_si128(q1, 8), 1));
}

/* out[i] = x_i . row for R (1..4) rows of x, the row dequantized 32 weights at a time */
#define DEFINE_ROW_DOT(NAME, DEQ)                                                                      \
    static void NAME(const uint8_t *row, int64_t k, const float *x, int64_t ldx, int R, float *out) { \
        const int64_t groups = k / 32;                                                                 \
        if (R == 1) {                                                                                  \
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                                \
            for (int64_t g = 0; g < groups; g++) {                                                     \
                __m256 w[4];                                                                           \
                DEQ(row, g, w);                                                                        \
                const float *xp = x + g * 32;                                                          \
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(xp), w[0], a0);                                   \
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(xp + 8), w[1], a1);                               \
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(xp + 16), w[2], a2);                              \
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(xp + 24), w[3], a3);                              \
            }                                                                                          \
            out[0] = hsum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));               \
            return;                                                                                    \
        }                                                                                              \
        __m256 a[4][2];                                                                                \
        for (int r = 0; r < 4; r++)                                                                    \
            a[r][0] = a[r][1] = _mm256_setzero_ps();                                                   \
        for (int64_t g = 0; g < groups; g++) {                                                         \
            __m256 w[4];                                                                               \
            DEQ(row, g, w);                                                                            \
            for (int r = 0; r < 4; r++) {                                                              \
                if (r < R) {                                                                           \
                    const float *xp = x + r * ldx + g * 32;                                            \
                    a[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xp), w[0], a[r][0]);                     \
                    a[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + 8), w[1], a[r][1]);                 \
                    a[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + 16), w[2], a[r][0]);                \
                    a[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(xp + 24), w[3], a[r][1]);                \
                }                                                                                      \
            }                                                                                          \
        }                                                                                              \
        for (int r = 0; r < R; r++)                                                                    \
            out[r] = hsum8(_mm256_add_ps(a[r][0], a[r][1]));                                           \
    }

/* Q4_K super-block scales: d * sc and dmin * m of its 8 sub-blocks, from the 12 packed bytes
 * (sc, m of sub-block j < 4: the low 6 bits of bytes j and j + 4; of j >= 4: the nibbles of byte
 * j + 4 below the top 2 bits of bytes j - 4 and j), four sub-blocks per 32-bit word. */
static inline void q4k_scales8(const uint8_t *blk, float ds[8], float dm[8]) {
    uint32_t w[3];
    memcpy(w, blk + 4, 12);
    const uint32_t low6 = 0x3f3f3f3fu, low4 = 0x0f0f0f0fu, low2 = 0x03030303u;
    const uint32_t sc_lo = w[0] & low6, m_lo = w[1] & low6;
    const uint32_t sc_hi = (w[2] & low4) | (((w[0] >> 6) & low2) << 4);
    const uint32_t m_hi = ((w[2] >> 4) & low4) | (((w[1] >> 6) & low2) << 4);
    const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32((int)sc_lo, (int)sc_hi, 0, 0)));
    const __m256 mn = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_setr_epi32((int)m_lo, (int)m_hi, 0, 0)));
    _mm256_storeu_ps(ds, _mm256_mul_ps(_mm256_set1_ps(h2f(blk)), sc));
    _mm256_storeu_ps(dm, _mm256_mul_ps(_mm256_set1_ps(h2f(blk + 2)), mn));
}

/* Q6_K: half h (0, 1) of a super-block's quants as four quarters of 32 bytes, 0..63 each (the
 * low 4 bits from ql, the high 2 from qh; subtract 32 for the signed quant) */
static inline void q6k_join(const uint8_t *blk, int h, __m256i q[4]) {
    const __m256i m15 = _mm256_set1_epi8(15), m3 = _mm256_set1_epi8(3);
    const __m256i l0 = _mm256_loadu_si256((const __m256i *)(blk + h * 64));
    const __m256i l1 = _mm256_loadu_si256((const __m256i *)(blk + h * 64 + 32));
    const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + h * 32));
    q[0] = _mm256_or_si256(_mm256_and_si256(l0, m15), _mm256_slli_epi16(_mm256_and_si256(hb, m3), 4));
    q[1] = _mm256_or_si256(_mm256_and_si256(l1, m15),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m3), 4));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m15),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m3), 4));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m15),
                           _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m3), 4));
}

/* 8 bytes from memory, each zero-extended to a 32-bit lane (one vpmovzxbd with a memory
 * operand: no register shuffles to bring the bytes down) */
static inline __m256i bytes8_u32(const uint8_t *p) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
}

/* The 4-bit formats at AVX2, for NR (a compile-time 1..4) rows of x, 16 weights a step: 8 bytes
 * zero-extended straight from memory to 32-bit lanes; their low nibbles (and 15) and high
 * nibbles (shift by 4) converted to float and scaled, d * q - m as dequant_row computes it (the
 * product is exact, so the fused multiply-add rounds as its multiply-then-add). Per 16 weights:
 * one zero-extend, an and, a shift, two converts, two multiply-adds for the weights and two per
 * row of x. The 128-bit extracts and byte shifts of the register form (deq_q4_k) it replaces took
 * the shuffle ports the zero-extends need. Rows of 1 and 2 keep four accumulators a row, so the
 * adds of one chain do not wait on each other (a multiply-add's latency is 4-5 cycles).
 * Q4_K: the nibbles of chunk c's byte j are elements c * 64 + j (sub-block 2c) and
 * c * 64 + 32 + j (sub-block 2c + 1); Q4_0 / Q4_1: byte j holds elements j and j + 16. */
/* Decode rows (Q4_K: two rows of x, one where x's block sums are not made: q4k_row_sums; Q6_K:
 * one): the scales (Q6_K: and the joined quants)
 * of up to SCALES_AHEAD super-blocks are worked out and stored first, then read back as
 * broadcast loads, so no load waits on the store just before it and the scale arithmetic runs
 * apart from the products. Per super-block, each store followed by its loads (before), one row
 * took ~15% longer: 8B-shaped Q4_K [14336, 4096] 2.96-3.11 -> 2.53-2.57 ms, Q6_K [4096, 14336]
 * 3.22-3.29 -> 2.66-2.74; Q4_K at 2 rows 3.40-3.50 -> 3.13-3.17 (2 threads, medians of 101,
 * builds alternating over 3 rounds, AMD EPYC Zen 3 AVX2, 2026-12-05; tile of the ad-hoc
 * script). With more rows the products dominate; the batched form measured 3-8% slower there
 * (Q6_K from 2 rows), so they keep the per-super-block order. */
#ifndef SCALES_AHEAD
#define SCALES_AHEAD 8
#endif
#if SCALES_AHEAD < 1
#error "SCALES_AHEAD must be at least 1"
#endif
#define Q4_ACC(NR) ((NR) <= 2 ? 4 : 2)

/* x[0..8) * q0 + x[8..16) * q1: 16 products x * q of one (sub-)block, before its scale */
static inline __m256 xq16(const float *x, __m256 q0, __m256 q1) {
    return _mm256_fmadd_ps(_mm256_loadu_ps(x + 8), q1, _mm256_mul_ps(_mm256_loadu_ps(x), q0));
}

/* Q4_K: the scales (d * sc, dmin * m) of super-blocks sb0 .. sb1 - 1 into ds, dm, 8 each, read
 * back after as loads (the barrier keeps the compiler from forwarding them in registers) */
static inline void q4k_scales_ahead(const uint8_t *row, int64_t sb0, int64_t sb1, float *ds, float *dm) {
    for (int64_t sb = sb0; sb < sb1; sb++) q4k_scales8(row + sb * 144, ds + 8 * (sb - sb0), dm + 8 * (sb - sb0));
    __asm__ volatile("" ::: "memory");
}
static inline __attribute__((always_inline)) void q4_step256(const uint8_t *q8, __m256 dlo, __m256 mlo, __m256 dhi,
                                                             __m256 mhi, const float *x, int64_t ldx, int64_t elo,
                                                             int64_t ehi, const int NR, __m256 a[4][4], int slot) {
    const __m256i b = bytes8_u32(q8);
    const __m256 wl = _mm256_fmsub_ps(dlo, _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15))), mlo);
    const __m256 wh = _mm256_fmsub_ps(dhi, _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4)), mhi);
    const int s0 = Q4_ACC(NR) == 4 ? 2 * slot : 0, s1 = s0 + 1;
    for (int r = 0; r < NR; r++) {
        a[r][s0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + elo), wl, a[r][s0]);
        a[r][s1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + ehi), wh, a[r][s1]);
    }
}

static inline void q4_finish256(__m256 a[4][4], const int NR, float *out) {
    for (int r = 0; r < NR; r++) {
        __m256 s = _mm256_add_ps(a[r][0], a[r][1]);
        if (Q4_ACC(NR) == 4)
            s = _mm256_add_ps(s, _mm256_add_ps(a[r][2], a[r][3]));
        out[r] = hsum8(s);
    }
}

static inline __attribute__((always_inline)) void q4k_rows256(const uint8_t *row, int64_t k, const float *x,
                                                              int64_t ldx, const int NR, float *out) {
    __m256 a[4][4];
    for (int r = 0; r < NR; r++)
        a[r][0] = a[r][1] = a[r][2] = a[r][3] = _mm256_setzero_ps();
    float ds[8 * SCALES_AHEAD], dm[8 * SCALES_AHEAD];
    const int64_t nsb = k / 256;
    const int ahead = NR <= 2 ? SCALES_AHEAD : 1;
    for (int64_t sb0 = 0; sb0 < nsb; sb0 += ahead) {
        const int64_t sb1 = sb0 + ahead < nsb ? sb0 + ahead : nsb;
        q4k_scales_ahead(row, sb0, sb1, ds, dm);
        for (int64_t sb = sb0; sb < sb1; sb++) {
            const uint8_t *blk = row + sb * 144;
            const float *dsb = ds + 8 * (sb - sb0), *dmb = dm + 8 * (sb - sb0);
            PREFETCH_W(blk, 3);
            for (int c = 0; c < 4; c++) {
                const __m256 dlo = _mm256_set1_ps(dsb[2 * c]), mlo = _mm256_set1_ps(dmb[2 * c]);
                const __m256 dhi = _mm256_set1_ps(dsb[2 * c + 1]), mhi = _mm256_set1_ps(dmb[2 * c + 1]);
                const uint8_t *q = blk + 16 + c * 32;
                const int64_t e = sb * 256 + c * 64;
                for (int j = 0; j < 32; j += 8)
                    q4_step256(q + j, dlo, mlo, dhi, mhi, x, ldx, e + j, e + 32 + j, NR, a, (j >> 3) & 1);
            }
        }
    }
    q4_finish256(a, NR, out);
}

/* Q4_0 (ONE 0: d * (q - 8), as d * q - 8d: both exact) and Q4_1 (d * q + m) */
static inline __attribute__((always_inline)) void q4b_rows256(const uint8_t *row, int64_t k, const float *x,
                                                              int64_t ldx, const int NR, const int one,
                                                              float *out) {
    __m256 a[4][4];
    for (int r = 0; r < NR; r++)
        a[r][0] = a[r][1] = a[r][2] = a[r][3] = _mm256_setzero_ps();
    const int bb = one ? 20 : 18, qo = one ? 4 : 2;
    for (int64_t g = 0; g < k / 32; g++) {
        const uint8_t *blk = row + g * bb;
        PREFETCH_W(blk, 1);
        const float d = h2f(blk), m = one ? -h2f(blk + 2) : 8.0f * d;
        const __m256 dv = _mm256_set1_ps(d), mv = _mm256_set1_ps(m);
        const int64_t e = g * 32;
        q4_step256(blk + qo, dv, mv, dv, mv, x, ldx, e, e + 16, NR, a, 0);
        q4_step256(blk + qo + 8, dv, mv, dv, mv, x, ldx, e + 8, e + 24, NR, a, 1);
    }
    q4_finish256(a, NR, out);
}

/* One row of x, the 4-bit formats' scales and offsets taken out of the sums: a block's (Q4_K:
 * a sub-block's) sum over x * (d * q - m) is computed as d * sum(x * q) - m * sum(x), with sum(x)
 * over each 32 of x made once a call (xs, k / 32 a row of x: ``x_block_sums``). Per 16 weights:
 * a zero-extend, an and, a shift, two converts and two multiply-adds (the per-weight multiply-add
 * that dequantized is gone); per 32 one scale multiply-add. The same value in exact arithmetic,
 * rounded differently: ~5e-7 of the sum of |x * w| apart from the dequantize-then-multiply form
 * (the two sums can cancel; tests/kernels/test_blocks.py holds both to the float64 reference's
 * bound). One row of an 8B-shaped Q4_K [14336, 4096]: 2.47-2.48 -> 2.01 ms at 2 threads (AMD
 * EPYC Zen 3 AVX2, 2026-12-05, the two builds alternating in one process, medians of 101). With 2
 * rows of x the dequantized weight is shared and this form measured no faster, so calls with
 * m > 1 keep q4k_rows256 / q4b_rows256 (their one-row tails too: xs is made for m == 1 only).
 * Q4_K: all four chunks of a super-block step together (8 independent sums in registers), the
 * scales worked out SCALES_AHEAD super-blocks ahead as in q4k_rows256. */
#if !HAVE_AVX512 /* (AVX-512 builds take their 512-bit kernels: sums_row_dot) */
static void q4k_row_sums(const uint8_t *row, int64_t k, const float *x, const float *xs, float *out) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, am = a0;
    float ds[8 * SCALES_AHEAD], dm[8 * SCALES_AHEAD];
    const int64_t nsb = k / 256;
    for (int64_t sb0 = 0; sb0 < nsb; sb0 += SCALES_AHEAD) {
        const int64_t sb1 = sb0 + SCALES_AHEAD < nsb ? sb0 + SCALES_AHEAD : nsb;
        q4k_scales_ahead(row, sb0, sb1, ds, dm);
        for (int64_t sb = sb0; sb < sb1; sb++) {
            const uint8_t *blk = row + sb * 144;
            const float *dsb = ds + 8 * (sb - sb0);
            PREFETCH_W(blk, 3);
            am = _mm256_fmadd_ps(_mm256_loadu_ps(dm + 8 * (sb - sb0)), _mm256_loadu_ps(xs + sb * 8), am);
            __m256 lo[4], hi[4]; /* sums of x * q of sub-blocks 2c and 2c + 1 */
            for (int j = 0; j < 32; j += 8)
                for (int c = 0; c < 4; c++) {
                    const __m256i b = bytes8_u32(blk + 16 + c * 32 + j);
                    const __m256 ql = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
                    const __m256 qh = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
                    const float *xp = x + sb * 256 + c * 64 + j;
                    lo[c] = j == 0 ? _mm256_mul_ps(_mm256_loadu_ps(xp), ql)
                                   : _mm256_fmadd_ps(_mm256_loadu_ps(xp), ql, lo[c]);
                    hi[c] = j == 0 ? _mm256_mul_ps(_mm256_loadu_ps(xp + 32), qh)
                                   : _mm256_fmadd_ps(_mm256_loadu_ps(xp + 32), qh, hi[c]);
                }
            for (int c = 0; c < 4; c++) {
                a0 = _mm256_fmadd_ps(_mm256_set1_ps(dsb[2 * c]), lo[c], a0);
                a1 = _mm256_fmadd_ps(_mm256_set1_ps(dsb[2 * c + 1]), hi[c], a1);
            }
        }
    }
    *out = hsum8(_mm256_add_ps(a0, a1)) - hsum8(am);
}

/* Q4_0 (ONE 0: d * q - 8d) and Q4_1 (d * q + m), one row of x over its block sums xs */
static inline __attribute__((always_inline)) void q4b_row_sums(const uint8_t *row, int64_t k, const float *x,
                                                               const float *xs, const int one, float *out) {
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    float off = 0.0f; /* the offsets' part: sum over blocks of m * sum(x) */
    const int bb = one ? 20 : 18, qo = one ? 4 : 2;
    for (int64_t g = 0; g < k / 32; g++) {
        const uint8_t *blk = row + g * bb;
        PREFETCH_W(blk, 1);
        const float d = h2f(blk), m = one ? h2f(blk + 2) : -8.0f * d;
        const __m256i b0 = bytes8_u32(blk + qo), b1 = bytes8_u32(blk + qo + 8);
        const float *xp = x + g * 32;
        const __m256i m15 = _mm256_set1_epi32(15);
        const __m256 lo = xq16(xp, _mm256_cvtepi32_ps(_mm256_and_si256(b0, m15)),
                               _mm256_cvtepi32_ps(_mm256_and_si256(b1, m15)));
        const __m256 hi = xq16(xp + 16, _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)),
                               _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)));
        a[g & 3] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_add_ps(lo, hi), a[g & 3]);
        off = fmaf(m, xs[g], off);
    }
    *out = hsum8(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3]))) + off;
}
static void q4_0_row_sums(const uint8_t *row, int64_t k, const float *x, const float *xs, float *out) {
    q4b_row_sums(row, k, x, xs, 0, out);
}
static void q4_1_row_sums(const uint8_t *row, int64_t k, const float *x, const float *xs, float *out) {
    q4b_row_sums(row, k, x, xs, 1, out);
}
#endif

/* Q6_K half h of a super-block: its 128 signed quants (q - 32) stored at qb (32-byte aligned),
 * and (h 0 only) the super-block's 16 scales times d at scale. */
static inline __attribute__((always_inline)) void q6k_half(const uint8_t *blk, int h, float *scale, int8_t *qb) {
    if (h == 0) {
        const __m256 d = _mm256_set1_ps(h2f(blk + 208));
        const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 192));
        _mm256_storeu_ps(scale, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
        _mm256_storeu_ps(scale + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
    }
    const __m256i b32 = _mm256_set1_epi8(32);
    __m256i q[4];
    q6k_join(blk, h, q);
    for (int t = 0; t < 4; t++) _mm256_store_si256((__m256i *)(qb + 32 * t), _mm256_sub_epi8(q[t], b32));
}

/* The products of a half super-block's 128 weights (q6k_half's quants and 8 scales) with NR
 * rows of x from element e. */
static inline __attribute__((always_inline)) void q6k_half_dot(const int8_t *qb, const float *scale, const float *x,
                                                               int64_t ldx, int64_t e0, const int NR, __m256 a[4][4]) {
    if (NR == 1) { /* a sub-block's 16 products summed, then times its scale: 3 float ops per 16 weights, not 4 */
        for (int j = 0; j < 128; j += 16) {
            const __m256 q0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qb + j))));
            const __m256 q1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qb + j + 8))));
            a[0][(j >> 4) & 3] = _mm256_fmadd_ps(_mm256_set1_ps(scale[j / 16]), xq16(x + e0 + j, q0, q1), a[0][(j >> 4) & 3]);
        }
        return;
    }
    for (int j = 0; j < 128; j += 16) {
        const __m256 s = _mm256_set1_ps(scale[j / 16]);
        const __m256 w0 = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qb + j)))));
        const __m256 w1 = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qb + j + 8)))));
        const int64_t e = e0 + j;
        const int s0 = Q4_ACC(NR) == 4 ? ((j >> 3) & 2) : 0, s1 = s0 + 1;
        for (int r = 0; r < NR; r++) {
            a[r][s0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + e), w0, a[r][s0]);
            a[r][s1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * ldx + e + 8), w1, a[r][s1]);
        }
    }
}

/* Q6_K at AVX2, for NR (a compile-time 1..4) rows of x: a half super-block's low and high bits
 * joined into its 128 signed quants (q - 32) in registers and stored to a small buffer, from
 * which 8 at a time are sign-extended as they are loaded (as deq_q8_0), so no register
 * shuffles bring bytes down; the 16 scales times d converted once a super-block and read back
 * as broadcast loads. Per 8 weights: a load-extend, a convert, a multiply and one
 * multiply-add a row (the product d * sc * q is exact: dequant_row's value); for one row of x,
 * each sub-block's 16 products x * q are summed and then taken times d * sc (q6k_half_dot: 3
 * float ops per 16 weights instead of 4; Q6_K [4096, 14336] 2.66-2.68 -> 2.56 ms, 2 threads,
 * same A/B as q4k_row_sums). */
static inline __attribute__((always_inline)) void q6k_rows256(const uint8_t *row, int64_t k, const float *x,
                                                              int64_t ldx, const int NR, float *out) {
    __m256 a[4][4];
    for (int r = 0; r < NR; r++)
        a[r][0] = a[r][1] = a[r][2] = a[r][3] = _mm256_setzero_ps();
    float scale[16 * SCALES_AHEAD];
    int8_t qb[256 * SCALES_AHEAD] __attribute__((aligned(32)));
    const int64_t nsb = k / 256;
    if (NR == 1) { /* every half of up to SCALES_AHEAD super-blocks joined first */
        for (int64_t sb0 = 0; sb0 < nsb; sb0 += SCALES_AHEAD) {
            const int64_t sb1 = sb0 + SCALES_AHEAD < nsb ? sb0 + SCALES_AHEAD : nsb;
            for (int64_t sb = sb0; sb < sb1; sb++)
                for (int h = 0; h < 2; h++)
                    q6k_half(row + sb * 210, h, scale + 16 * (sb - sb0), qb + 256 * (sb - sb0) + 128 * h);
            __asm__ volatile("" ::: "memory"); /* the quants and scales are read back as loads */
            for (int64_t sb = sb0; sb < sb1; sb++) {
                PREFETCH_W(row + sb * 210, 4);
                for (int h = 0; h < 2; h++)
                    q6k_half_dot(qb + 256 * (sb - sb0) + 128 * h, scale + 16 * (sb - sb0) + 8 * h, x, ldx,
                                 sb * 256 + h * 128, NR, a);
            }
        }
    } else { /* a half at a time: measured faster for 2-4 rows */
        for (int64_t sb = 0; sb < nsb; sb++) {
            PREFETCH_W(row + sb * 210, 4);
            for (int h = 0; h < 2; h++) {
                q6k_half(row + sb * 210, h, scale, qb);
                __asm__ volatile("" ::: "memory");
                q6k_half_dot(qb, scale + 8 * h, x, ldx, sb * 256 + h * 128, NR, a);
            }
        }
    }
    q4_finish256(a, NR, out);
}

#define DEFINE_ROWS256(NAME, CALL)                                                                     \
    static void NAME(const uint8_t *row, int64_t k, const float *x, int64_t ldx, int R, float *out) { \
        switch (R) {                                                                                   \
        case 1: CALL(1); return;                                                                       \
        case 2: CALL(2); return;                                                                       \
        case 3: CALL(3); return;                                                                       \
        default: CALL(4); return;                                                                      \
        }                                                                                              \
    }
#define Q4K_CALL(NR) q4k_rows256(row, k, x, ldx, NR, out)
#define Q40_CALL(NR) q4b_rows256(row, k, x, ldx, NR, 0, out)
#define Q41_CALL(NR) q4b_rows256(row, k, x, ldx, NR, 1, out)
#define Q6K_CALL(NR) q6k_rows256(row, k, x, ldx, NR, out)
DEFINE_ROWS256(row_dot_q4_k, Q4K_CALL)
DEFINE_ROWS256(row_dot_q4_0, Q40_CALL)
DEFINE_ROWS256(row_dot_q4_1, Q41_CALL)
DEFINE_ROWS256(row_dot_q6_k, Q6K_CALL)

DEFINE_ROW_DOT(row_dot_q8_0_deq, deq_q8_0)

/* Q8_0 for one row of x: a block's 32 products x * q summed, then taken times d (10 float ops per
 * 32 weights instead of 12; one row, 2 threads, AMD EPYC Zen 3 AVX2: the 1B file's [49152, 2048]
 * embedding 4.58-4.68 -> 3.96-4.07 ms, its [8192, 2048] matrices, read at ~27 GB/s, within the
 * noise); 2-4 rows dequantize once for them all. */
static void row_dot_q8_0(const uint8_t *row, int64_t k, const float *x, int64_t ldx, int R, float *out) {
    if (R > 1) {
        row_dot_q8_0_deq(row, k, x, ldx, R, out);
        return;
    }
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t g = 0; g < k / 32; g++) {
        const uint8_t *blk = row + g * 34;
        PREFETCH_W(blk, 1);
        __m256 q[4];
        for (int v = 0; v < 4; v++)
            q[v] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(blk + 2 + 8 * v))));
        const float *xp = x + g * 32;
        a[g & 3] = _mm256_fmadd_ps(_mm256_set1_ps(h2f(blk)), _mm256_add_ps(xq16(xp, q[0], q[1]), xq16(xp + 16, q[2], q[3])),
                                   a[g & 3]);
    }
    out[0] = hsum8(_mm256_add_ps(_mm256_add_ps(a[0], a[1]), _mm256_add_ps(a[2], a[3])));
}

#define DEFINE_ROW_DEQ(NAME, DEQ)                                                    \
    static void NAME(const uint8_t *row, int64_t k, float *out) {                   \
        for (int64_t g = 0; g < k / 32; g++) {                                       \
            __m256 w[4];                                                             \
            DEQ(row, g, w);                                                          \
            for (int v = 0; v < 4; v++)                                              \
                _mm256_storeu_ps(out + g * 32 + 8 * v, w[v]);                        \
        }                                                                            \
    }

DEFINE_ROW_DEQ(row_deq_q8_0, deq_q8_0)
DEFINE_ROW_DEQ(row_deq_q4_0, deq_q4_0)
DEFINE_ROW_DEQ(row_deq_q4_1, deq_q4_1)
DEFINE_ROW_DEQ(row_deq_q4_k, deq_q4_k)
DEFINE_ROW_DEQ(row_deq_q6_k, deq_q6_k)

typedef void (*RowDot)(const uint8_t *, int64_t, const float *, int64_t, int, float *);
/* one row of x with its block sums (the 4-bit kernels over sums of x, AVX2 builds) */
typedef void (*RowDotSums)(const uint8_t *, int64_t, const float *, const float *, float *);

#if HAVE_AVX512
/* The same 32 weights as two 16-lane vectors: half the conversions and multiply-adds of the
 * AVX2 forms per weight (AVX-512 builds take these). */
static inline __m512 cvt16(__m128i bytes16, int is_signed) {
    return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(bytes16) : _mm512_cvtepu8_epi32(bytes16));
}

static inline void deq512_q8_0(const uint8_t *row, int64_t g, __m512 w[2]) {
    const uint8_t *blk = row + g * 34;
    PREFETCH_W(blk, 1);
    const __m512 d = _mm512_set1_ps(h2f(blk));
    w[0] = _mm512_mul_ps(d, cvt16(_mm_loadu_si128((const __m128i *)(blk + 2)), 1));
    w[1] = _mm512_mul_ps(d, cvt16(_mm_loadu_si128((const __m128i *)(blk + 18)), 1));
}

/* A compile-time row count NR (1..4) keeps the accumulators in registers. */
static inline __attribute__((always_inline)) void q8_0_rows512(const uint8_t *row, int64_t k, const float *x,
                                                               int64_t ldx, const int NR, float *out) {
    __m512 a[4][2];
    for (int r = 0; r < NR; r++)
        a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (int64_t g = 0; g < k / 32; g++) {
        __m512 w[2];
        deq512_q8_0(row, g, w);
        for (int r = 0; r < NR; r++) {
            const float *xp = x + r * ldx + g * 32;
            a[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xp), w[0], a[r][0]);
            a[r][1] = _mm512_fmadd_ps(_mm512_loadu_ps(xp + 16), w[1], a[r][1]);
        }
    }
    for (int r = 0; r < NR; r++)
        out[r] = hsum16(_mm512_add_ps(a[r][0], a[r][1]));
}

static void row_dot512_q8_0(const uint8_t *row, int64_t k, const float *x, int64_t ldx, int R, float *out) {
    switch (R) {
    case 1: q8_0_rows512(row, k, x, ldx, 1, out); return;
    case 2: q8_0_rows512(row, k, x, ldx, 2, out); return;
    case 3: q8_0_rows512(row, k, x, ldx, 3, out); return;
    default: q8_0_rows512(row, k, x, ldx, 4, out); return;
    }
}

/* Q4_0 / Q4_1 in 512-bit registers, for NR (a compile-time 1..4) rows of x in ``q4b_order``:
 * as q4k_rows512, each nibble picks its weight from a register of the block's 16 values
 * (d * (q - 8), or d * q + m), the block's 16 bytes broadcast to the four 128-bit lanes and
 * shifted per lane. */
static inline __attribute__((always_inline)) void q4b_rows512(const uint8_t *row, int64_t k, const float *x,
                                                              int64_t ldx, const int NR, const int one,
                                                              float *out) {
    __m512 a[4][2];
    for (int r = 0; r < NR; r++)
        a[r][0] = a[r][1] = _mm512_setzero_ps();
    const int bb = one ? 20 : 18, qo = one ? 4 : 2;
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 iota8 = _mm512_sub_ps(iota, _mm512_set1_ps(8.0f));
    const __m512i sh_lo = _mm512_setr_epi32(0, 0, 0, 0, 8, 8, 8, 8, 16, 16, 16, 16, 24, 24, 24, 24);
    const __m512i sh_hi = _mm512_add_epi32(sh_lo, _mm512_set1_epi32(4));
    for (int64_t g = 0; g < k / 32; g++) {
        const uint8_t *blk = row + g * bb;
        PREFETCH_W(blk, 1);
        const __m512 d = _mm512_set1_ps(h2f(blk));
        const __m512 table = one ? _mm512_fmadd_ps(d, iota, _mm512_set1_ps(h2f(blk + 2))) : _mm512_mul_ps(d, iota8);
        const __m512i v = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(blk + qo)));
        const __m512 w0 = _mm512_permutexvar_ps(_mm512_srlv_epi32(v, sh_lo), table);
        const __m512 w1 = _mm512_permutexvar_ps(_mm512_srlv_epi32(v, sh_hi), table);
        for (int r = 0; r < NR; r++) {
            const float *xp = x + r * ldx + g * 32;
            a[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xp), w0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(_mm512_loadu_ps(xp + 16), w1, a[r][1]);
        }
    }
    for (int r = 0; r < NR; r++)
        out[r] = hsum16(_mm512_add_ps(a[r][0], a[r][1]));
}

/* x's elements in the order q4b_rows512 meets them: in every 16 (the low nibbles, then the
 * high ones), position 4t + j holds element 4j + t. */
static void q4b_order(const float *x, int64_t ldx, int m, int64_t k, float *out) {
    for (int i = 0; i < m; i++)
        for (int64_t g = 0; g < k; g += 16)
            for (int p = 0; p < 16; p++)
                out[(int64_t)i * k + g + p] = x[(int64_t)i * ldx + g + 4 * (p & 3) + (p >> 2)];
}

#define DEFINE_Q4B_ROW_DOT(NAME, ONE)                                                                  \
    static void NAME(const uint8_t *row, int64_t k, const float *x, int64_t ldx, int R, float *out) { \
        switch (R) {                                                                                   \
        case 1: q4b_rows512(row, k, x, ldx, 1, ONE, out); return;                                     \
        case 2: q4b_rows512(row, k, x, ldx, 2, ONE, out); return;                                     \
        case 3: q4b_rows512(row, k, x, ldx, 3, ONE, out); return;                                     \
        default: q4b_rows512(row, k, x, ldx, 4, ONE, out); return;                                    \
        }                                                                                              \
    }
DEFINE_Q4B_ROW_DOT(row_dot512_q4_0, 0)
DEFINE_Q4B_ROW_DOT(row_dot512_q4_1, 1)

/* Q6_K in 512-bit registers, for NR (a compile-time 1..4) rows of x: a half super-block's
 * low and high bits loaded once and joined into its four quarters of 32 signed bytes; the
 * 16 scales times d converted once a super-block and read back as broadcast loads (a scalar
 * convert and a register broadcast for every 16 weights kept port 5 busy). */
static inline __attribute__((always_inline)) void q6k_rows512(const uint8_t *row, int64_t k, const float *x,
                                                              int64_t ldx, const int NR, float *out) {
    __m512 a[4][2];
    for (int r = 0; r < NR; r++)
        a[r][0] = a[r][1] = _mm512_setzero_ps();
    const __m256i b32 = _mm256_set1_epi8(32);
    float scale[16];
    for (int64_t sb = 0; sb < k / 256; sb++) {
        const uint8_t *blk = row + sb * 210;
        PREFETCH_W(blk, 4);
        const __m512 d = _mm512_set1_ps(h2f(blk + 208));
        _mm512_storeu_ps(scale, _mm512_mul_ps(d, _mm512_cvtepi32_ps(
                                                     _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192))))));
        __asm__ volatile("" ::: "memory"); /* read the scales back as broadcast loads */
        for (int h = 0; h < 2; h++) {
            __m256i q[4];
            q6k_join(blk, h, q);
            for (int t = 0; t < 4; t++) {
                const __m256i qs = _mm256_sub_epi8(q[t], b32);
                const int si = h * 8 + 2 * t;
                const __m512 w0 = _mm512_mul_ps(_mm512_set1_ps(scale[si]), cvt16(_mm256_castsi256_si128(qs), 1));
                const __m512 w1 = _mm512_mul_ps(_mm512_set1_ps(scale[si + 1]),
                                                cvt16(_mm256_extracti128_si256(qs, 1), 1));
                const int64_t e = sb * 256 + h * 128 + t * 32;
                for (int r = 0; r < NR; r++) {
                    const float *xp = x + r * ldx + e;
                    a[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xp), w0, a[r][0]);
                    a[r][1] = _mm512_fmadd_ps(_mm512_loadu_ps(xp + 16), w1, a[r][1]);
                }
            }
        }
    }
    for (int r = 0; r < NR; r++)
        out[r] = hsum16(_mm512_add_ps(a[r][0], a[r][1]));
}

static void row_dot512_q6_k(const uint8_t *row, int64_t k, const float *x, int64_t ldx, int R, float *out) {
    switch (R) {
    case 1: q6k_rows512(row, k, x, ldx, 1, out); return;
    case 2: q6k_rows512(row, k, x, ldx, 2, out); return;
    case 3: q6k_rows512(row, k, x, ldx, 3, out); return;
    default: q6k_rows512(row, k, x, ldx, 4, out); return;
    }
}

/* Q4_K in 512-bit registers, for NR (a compile-time 1..4) rows of x, which must come in
 * ``q4k_order`` (see there). A sub-block's 16 possible weights (d * sc * q - dmin * m, q = 0..15)
 * are one register and each nibble picks its weight from it (vpermps reads only an index's low
 * 4 bits): the same values as dequantizing each weight. A chunk's 32 bytes are broadcast to both
 * halves of a register as 8 dwords, and a per-lane shift brings byte 4i + t (lanes 0-7) and
 * 4i + t + 1 (lanes 8-15) down to the low bits, 4 more for the high nibbles. Per 16 weights:
 * a shift, a permute and a multiply-add (the zero-extend, convert and multiply-add it replaces
 * left port 5 the bottleneck: ~10 cycles a sub-block measured, for ~4). The scales go through
 * memory so that their broadcasts are loads, not port-5 shuffles. */
static inline __attribute__((always_inline)) void q4k_rows512(const uint8_t *row, int64_t k, const float *x,
                                                              int64_t ldx, const int NR, float *out) {
    __m512 a[4][2];
    for (int r = 0; r < NR; r++)
        a[r][0] = a[r][1] = _mm512_setzero_ps();
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i half = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 8, 8, 8, 8, 8, 8, 8, 8);
    __m512i shift[4]; /* t = 0, 2 for the low nibbles; the same + 4 for the high ones */
    shift[0] = half;
    shift[1] = _mm512_add_epi32(half, _mm512_set1_epi32(16));
    shift[2] = _mm512_add_epi32(half, _mm512_set1_epi32(4));
    shift[3] = _mm512_add_epi32(half, _mm512_set1_epi32(20));
    float ds[8], dm[8];
    for (int64_t sb = 0; sb < k / 256; sb++) {
        const uint8_t *blk = row + sb * 144;
        PREFETCH_W(blk, 3);
        q4k_scales8(blk, ds, dm);
        __asm__ volatile("" ::: "memory"); /* read ds, dm back as broadcast loads */
        for (int c = 0; c < 4; c++) {
            const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16 + c * 32)));
            for (int s = 0; s < 2; s++) {
                const int j = 2 * c + s;
                const __m512 table = _mm512_fmsub_ps(_mm512_set1_ps(ds[j]), iota, _mm512_set1_ps(dm[j]));
                const __m512 w0 = _mm512_permutexvar_ps(_mm512_srlv_epi32(v, shift[2 * s]), table);
                const __m512 w1 = _mm512_permutexvar_ps(_mm512_srlv_epi32(v, shift[2 * s + 1]), table);
                const int64_t e = sb * 256 + c * 64 + s * 32;
                for (int r = 0; r < NR; r++) {
                    const float *xp = x + r * ldx + e;
                    a[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(xp), w0, a[r][0]);
                    a[r][1] = _mm512_fmadd_ps(_mm512_loadu_ps(xp + 16), w1, a[r][1]);
                }
            }
        }
    }
    for (int r = 0; r < NR; r++)
        out[r] = hsum16(_mm512_add_ps(a[r][0], a[r][1]));
}

/* x's elements in the order q4k_rows512 meets them: in every 32, positions 0-15 hold elements
 * 0, 4, .., 28, 1, 5, .., 29 and positions 16-31 hold 2, 6, .., 30, 3, 7, .., 31. */
static void q4k_order(const float *x, int64_t ldx, int m, int64_t k, float *out) {
    for (int i = 0; i < m; i++)
        for (int64_t g = 0; g < k; g += 32)
            for (int p = 0; p < 32; p++) {
                const int t = (p >> 4) * 2 + ((p >> 3) & 1), lane = p & 7;
                out[(int64_t)i * k + g + p] = x[(int64_t)i * ldx + g + 4 * lane + t];
            }
}

static void row_dot512_q4_k(const uint8_t *row, int64_t k, const float *x, int64_t ldx, int R, float *out) {
    switch (R) {
    case 1: q4k_rows512(row, k, x, ldx, 1, out); return;
    case 2: q4k_rows512(row, k, x, ldx, 2, out); return;
    case 3: q4k_rows512(row, k, x, ldx, 3, out); return;
    default: q4k_rows512(row, k, x, ldx, 4, out); return;
    }
}
#define Q4K_ORDERED 1
#endif

/* Which reordered x a format's register kernel reads: 0 Q4_K's, 1 Q4_0's and Q4_1's, -1 x as is. */
static inline int x_order(int fmt) {
#ifdef Q4K_ORDERED
    return fmt == F_Q4_K ? 0 : fmt == F_Q4_0 || fmt == F_Q4_1 ? 1 : -1;
#else
    (void)fmt;
    return -1;
#endif
}

static void dequant_row_vector(const uint8_t *row, int fmt, int64_t k, float *restrict out) {
    switch (fmt) {
    case F_Q8_0: row_deq_q8_0(row, k, out); return;
    case F_Q4_0: row_deq_q4_0(row, k, out); return;
    case F_Q4_1: row_deq_q4_1(row, k, out); return;
    case F_Q4_K: row_deq_q4_k(row, k, out); return;
    case F_Q6_K: row_deq_q6_k(row, k, out); return;
    }
}

static RowDot register_row_dot(int fmt) {
#if HAVE_AVX512
    switch (fmt) {
    case F_Q8_0: return row_dot512_q8_0;
    case F_Q4_0: return row_dot512_q4_0;
    case F_Q4_1: return row_dot512_q4_1;
    case F_Q4_K: return row_dot512_q4_k;
    case F_Q6_K: return row_dot512_q6_k;
    default: return NULL;
    }
#endif
    switch (fmt) {
    case F_Q8_0: return row_dot_q8_0;
    case F_Q4_0: return row_dot_q4_0;
    case F_Q4_1: return row_dot_q4_1;
    case F_Q4_K: return row_dot_q4_k;
    case F_Q6_K: return row_dot_q6_k;
    default: return NULL;
    }
}

/* The kernel for one row of x over its block sums, where the build has one (AVX2 without
 * AVX-512: the 512-bit kernels pick weights from a register of their values, with no convert
 * to save) */
static RowDotSums sums_row_dot(int fmt) {
#if HAVE_AVX512
    (void)fmt;
    return NULL;
#else
    return fmt == F_Q4_K ? q4k_row_sums : fmt == F_Q4_0 ? q4_0_row_sums : fmt == F_Q4_1 ? q4_1_row_sums : NULL;
#endif
}

/* xs[b]: the sum of the row x over elements 32b .. 32b + 31 */
static void x_block_sums(const float *x, int64_t k, float *xs) {
    for (int64_t b = 0; b < k / 32; b++) {
        const float *xp = x + b * 32;
        xs[b] = hsum8(_mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(xp), _mm256_loadu_ps(xp + 8)),
                                    _mm256_add_ps(_mm256_loadu_ps(xp + 16), _mm256_loadu_ps(xp + 24))));
    }
}
#endif

/* ------------------------------------------------------------------------------ entry points */

int longctx_blocks_row_bytes(int fmt, int64_t k, int64_t *row_bytes) {
    const int be = block_elems(fmt);
    if (be == 0 || k < 1 || k % be != 0)
        return 1;
    *row_bytes = k / be * block_bytes(fmt);
    return 0;
}

int longctx_blocks_fast_supported(int fmt);
#if HAVE_AVX2
typedef struct QuantX QuantX; /* x rounded to int8 in blocks of 32 (the "fast" numerics, below) */
static QuantX *new_quant_x(const float *x, int64_t ldx, int m, int64_t k, int terms, int want_c128);
static void free_quant_x(QuantX *qx);
static void fast_dot_terms(const uint8_t *row, int fmt, int64_t k, const QuantX *qx, int terms, int i0, int R,
                           float *out);
#endif

/* One product over a matrix stored as parts stacked along the output rows (a fused q/k/v whose
 * parts have different formats): part p has rows[p] rows of row_bytes[p] bytes in format
 * fmts[p] at ws[p]; its outputs are the columns after the previous parts'. One parallel region
 * for them all (the parts' calls one by one cost a region each: ~30 us a call, 200 a step). */
int longctx_blocks_linear_parts(const float *x, int64_t ldx, int m, int nparts, const uint8_t *const *ws,
                                const int64_t *row_bytes, const int *fmts, const int64_t *rows, int64_t k,
                                const float *bias, float *y, int64_t ldy, const float *res, int64_t ldr,
                                int nthreads, int prologue, const float *norm_w, float eps, int fast) {
    /* fast: 0 exact; 1 or 2 x's int8 terms for the formats with integer products (quantize_x) */
    enum { MAX_PARTS = 8 };
    if (nparts < 1 || nparts > MAX_PARTS)
        return 2;
    int64_t first_chunk[MAX_PARTS + 1], first_col[MAX_PARTS + 1];
    first_chunk[0] = first_col[0] = 0;
    for (int p = 0; p < nparts; p++) {
        int64_t expect;
        if (longctx_blocks_row_bytes(fmts[p], k, &expect) != 0 || expect != row_bytes[p] || rows[p] < 1)
            return 1;
        first_chunk[p + 1] = first_chunk[p] + (rows[p] + CHUNK - 1) / CHUNK;
        first_col[p + 1] = first_col[p] + rows[p];
    }
    const int64_t n = first_col[nparts];
    if (m < 1 || ldx < (prologue == 2 ? 2 * k : k) || ldy < n || (res != NULL && ldr < n) || nthreads < 1 ||
        prologue < 0 || prologue > 2 || (prologue == 1 && norm_w == NULL) || fast < 0 || fast > 2)
        return 2;
    float *pro = NULL; /* the rows the product takes after the prologue (RMSNorm, SwiGLU), once */
    if (prologue != 0) {
        if ((pro = (float *)malloc((size_t)m * (size_t)k * sizeof(float))) == NULL)
            return 3;
        for (int i = 0; i < m; i++) {
            const float *xr = x + (int64_t)i * ldx;
            if (prologue == 1)
                rms_row(xr, norm_w, eps, (int)k, pro + (int64_t)i * k);
            else
                swiglu_row(xr, xr + k, (int)k, pro + (int64_t)i * k);
        }
        x = pro;
        ldx = k;
    }
    int failed = 0;
#if HAVE_AVX2
    /* fast: x rounded to int8 once a call, for the parts whose format has integer products */
    QuantX *qx = NULL;
    int q8_0 = 0; /* a Q8_0 part: x's c128 serves its few-row form */
    for (int p = 0; p < nparts; p++)
        q8_0 |= fmts[p] == F_Q8_0;
    for (int p = 0; p < nparts && fast && qx == NULL; p++) {
        if (!longctx_blocks_fast_supported(fmts[p]))
            continue;
        if ((qx = new_quant_x(x, ldx, m, k, fast, q8_0)) == NULL) {
            free(pro);
            return 3;
        }
    }
#define FAST_PART(fmt) (qx != NULL && longctx_blocks_fast_supported(fmt))
#else
    (void)fast;
#define FAST_PART(fmt) 0
#endif
    /* x in the order the 4-bit register kernels meet it (Q4_K's; Q4_0's and Q4_1's), made once
     * a call for the parts that take the register path */
    float *xo[2] = {NULL, NULL};
#ifdef Q4K_ORDERED
    for (int p = 0; p < nparts && m <= REGISTER_MAX_ROWS; p++) {
        const int o = x_order(fmts[p]);
        if (o < 0 || xo[o] != NULL || FAST_PART(fmts[p]))
            continue;
        if ((xo[o] = (float *)malloc((size_t)m * (size_t)k * sizeof(float))) == NULL) {
            free(xo[0]), free(xo[1]), free(pro);
            free_quant_x(qx);
            return 3;
        }
        (o == 0 ? q4k_order : q4b_order)(x, ldx, m, k, xo[o]);
    }
#endif
    /* one row of x: its block sums, made once a call for the 4-bit parts that take them */
    float *xs = NULL;
#if HAVE_AVX2
    for (int p = 0; p < nparts && m == 1 && xs == NULL; p++) {
        if (sums_row_dot(fmts[p]) == NULL || FAST_PART(fmts[p]))
            continue;
        if ((xs = (float *)malloc((size_t)(k / 32) * sizeof(float))) == NULL) {
            free(xo[0]), free(xo[1]), free(pro);
            free_quant_x(qx);
            return 3;
        }
        x_block_sums(x, k, xs);
    }
#endif
#pragma omp parallel num_threads(nthreads) reduction(| : failed)
    {
        float *buf = NULL;
#pragma omp for schedule(static)
        for (int64_t c = 0; c < first_chunk[nparts]; c++) {
            int p = 0;
            while (c >= first_chunk[p + 1])
                p++;
            const int fmt = fmts[p];
            const int use_fast = FAST_PART(fmt);
#if HAVE_AVX2
            const RowDot in_registers = !use_fast && m <= REGISTER_MAX_ROWS ? register_row_dot(fmt) : NULL;
            const RowDotSums over_sums = xs != NULL && !use_fast ? sums_row_dot(fmt) : NULL;
#else
            const void *in_registers = NULL;
#endif
            if (!use_fast && !in_registers && buf == NULL && (buf = (float *)malloc((size_t)k * sizeof(float))) == NULL) {
                failed = 1;
                continue;
            }
            const int64_t r0 = (c - first_chunk[p]) * CHUNK, r1 = r0 + CHUNK < rows[p] ? r0 + CHUNK : rows[p];
            for (int64_t r = r0; r < r1; r++) {
                const uint8_t *wr = ws[p] + r * row_bytes[p];
                const int64_t col = first_col[p] + r;
                if (!use_fast && !in_registers)
                    dequant_row(wr, fmt, k, buf);
                const float b = bias ? bias[col] : 0.0f;
                /* x's rows a call (fast, 2 terms: 2 rows, 4 of qx's); over the dequantized row,
                 * passes of at most DOT_ROWS_MAX rows, as even as they go (9: 5 + 4) */
                const int most = k <= DOT_ROWS_WIDE_K ? DOT_ROWS_MAX : 4, passes = (m + most - 1) / most;
                const int step = use_fast ? 4 / fast : in_registers ? 4 : (m + passes - 1) / passes;
                for (int i = 0; i < m; i += step) {
                    const int nr = m - i < step ? m - i : step;
                    float out[DOT_ROWS_MAX > 4 ? DOT_ROWS_MAX : 4];
#if HAVE_AVX2
                    if (use_fast)
                        fast_dot_terms(wr, fmt, k, qx, fast, i, nr, out);
                    else if (over_sums)
                        over_sums(wr, k, x, xs, out);
                    else if (in_registers && x_order(fmt) >= 0)
                        in_registers(wr, k, xo[x_order(fmt)] + (int64_t)i * k, k, nr, out);
                    else if (in_registers)
                        in_registers(wr, k, x + (int64_t)i * ldx, ldx, nr, out);
                    else
#endif
                        dot_rows(x + (int64_t)i * ldx, ldx, nr, buf, k, out);
                    for (int j = 0; j < nr; j++) {
                        float v = out[j] + b;
                        if (res)
                            v += res[(int64_t)(i + j) * ldr + col];
                        y[(int64_t)(i + j) * ldy + col] = v;
                    }
                }
            }
        }
        free(buf);
    }
    free(xo[0]), free(xo[1]), free(xs), free(pro);
#if HAVE_AVX2
    free_quant_x(qx);
#endif
#undef FAST_PART
    return failed ? 3 : 0;
}

/* One matrix in one format: the parts' product with one part. */
int longctx_blocks_linear(const float *x, int64_t ldx, int m, const uint8_t *w, int64_t row_bytes, int fmt,
                          int n, int64_t k, const float *bias, float *y, int64_t ldy, const float *res,
                          int64_t ldr, int nthreads) {
    const uint8_t *ws[1] = {w};
    const int64_t bytes[1] = {row_bytes}, rows[1] = {n};
    const int fmts[1] = {fmt};
    return longctx_blocks_linear_parts(x, ldx, m, 1, ws, bytes, fmts, rows, k, bias, y, ldy, res, ldr, nthreads, 0,
                                       NULL, 0.0f, 0);
}

/* rows == NULL: rows first_row .. first_row + nrows - 1; else the nrows row indices given (each
 * checked against n). out [nrows, k] float32 with row stride ldo. */
int longctx_blocks_dequant(const uint8_t *w, int64_t row_bytes, int fmt, int64_t n, int64_t k,
                           const int64_t *rows, int64_t first_row, int64_t nrows, float *out, int64_t ldo,
                           int nthreads) {
    int64_t expect;
    if (longctx_blocks_row_bytes(fmt, k, &expect) != 0 || expect != row_bytes)
        return 1;
    if (nrows < 0 || ldo < k || nthreads < 1 || (rows == NULL && (first_row < 0 || first_row + nrows > n)))
        return 2;
    if (rows != NULL)
        for (int64_t i = 0; i < nrows; i++)
            if (rows[i] < 0 || rows[i] >= n)
                return 4;
#pragma omp parallel for schedule(static) num_threads(nthreads) if (nrows * k >= 65536)
    for (int64_t i = 0; i < nrows; i++) {
        const int64_t r = rows ? rows[i] : first_row + i;
        dequant_row(w + r * row_bytes, fmt, k, out + i * ldo);
    }
    return 0;
}

/* float32 -> bfloat16, round to nearest even (a NaN stays a quiet NaN): torch's conversion, bit for
 * bit, for normal values (the vector path below flushes subnormal inputs to zero, as the AMX
 * tiles would read them anyway). */
static inline uint16_t f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* As longctx_blocks_dequant over a range of rows, each row rounded to bfloat16 (out [nrows, k]
 * uint16 bits, row stride ldo): a bfloat16 model's prefill slice for the AMX tiles (cpu_amx),
 * without a float32 slice in memory between. Each thread dequantizes a row into its own float32
 * row (in L1/L2) and rounds it from there. Returns as longctx_blocks_dequant does (5: no memory). */
int longctx_blocks_dequant_bf16(const uint8_t *w, int64_t row_bytes, int fmt, int64_t n, int64_t k,
                                int64_t first_row, int64_t nrows, uint16_t *out, int64_t ldo, int nthreads) {
    int64_t expect;
    if (longctx_blocks_row_bytes(fmt, k, &expect) != 0 || expect != row_bytes)
        return 1;
    if (nrows < 0 || ldo < k || nthreads < 1 || first_row < 0 || first_row + nrows > n)
        return 2;
    int failed = 0;
#pragma omp parallel num_threads(nthreads) if (nrows * k >= 65536)
    {
        float *row = aligned_alloc(64, (size_t)((k + 15) / 16 * 16) * sizeof(float));
        if (!row) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < nrows; i++) {
            if (!row)
                continue;
            dequant_row(w + (first_row + i) * row_bytes, fmt, k, row);
            uint16_t *dst = out + i * ldo;
            int64_t c = 0;
#if defined(__AVX512BF16__)
            for (; c + 16 <= k; c += 16)
                _mm256_storeu_si256((__m256i *)(dst + c), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(row + c)));
#endif
            for (; c < k; c++)
                dst[c] = f2bf(row[c]);
        }
        free(row);
    }
    return failed ? 5 : 0;
}

/* ------------------------------------------------ "fast": int8 activations, integer products
 *
 * llama.cpp's numerics: each x row is rounded to int8 in blocks of 32 (scale amax / 127 per
 * block, round to nearest), and each weight block's integer quants are multiplied with them in
 * integers (maddubs: unsigned weight bytes times signed x bytes, pairs summed in int16; then
 * madd with ones: four bytes' sums in int32), the sums turned to float and scaled by the two
 * blocks' scales. Offsets (Q4_1's m, Q4_K's dmin * m, Q4_0's -8 and Q6_K's -32) go through the
 * x block's own sum. Several times fewer instructions per weight than dequantizing to float,
 * at the cost of x's rounding (an error of up to half an int8 step of each block's largest
 * element). Formats: Q8_0, Q4_0, Q4_1, Q4_K, Q6_K (others: the exact path). AVX2 only.
 */
#if HAVE_AVX2
struct QuantX {
    int8_t *q;     /* [m, k] */
    float *d;      /* [m, k / 32]: the block scales */
    float *s16;    /* [m, k / 16]: d * the sum of q over each half block */
    float *d8;     /* [m, k / 32 * 8]: each block's scale 8 times (the lanes of its sums) */
    float *s32;    /* [m, k / 32]: d * the sum of q over each block */
    int32_t *c128; /* [m, k / 4]: -128 * the sum of each 4 of q (a Q8_0 part, terms == 1, m <= C128_MAX_ROWS; else NULL) */
};

static void free_quant_x(QuantX *qx) { /* a calloc'ed QuantX and what quantize_x gave it; NULL: nothing */
    if (qx == NULL)
        return;
    free(qx->q), free(qx->d), free(qx->s16), free(qx->d8), free(qx->s32), free(qx->c128);
    free(qx);
}

/* One block of 32 floats to int8 at qx's row i, block b, round to nearest: scale amax / 127,
 * or (d2 > 0) the given scale, the values clamped to +-127. rest (or NULL): what the rounding
 * left, xb - d * q. Returns the scale. */
static float quantize_block(const float *xb, QuantX *qx, int64_t i, int64_t b, int64_t k, float d2, float *rest) {
    float amax = 0.0f;
    for (int j = 0; j < 32; j++)
        amax = fmaxf(amax, fabsf(xb[j]));
    const float d = d2 > 0.0f ? d2 : amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
    int8_t *qb = qx->q + i * k + b * 32;
    int sum0 = 0, sum1 = 0;
    for (int j = 0; j < 32; j++) {
        int v = (int)nearbyintf(xb[j] * id);
        v = v > 127 ? 127 : v < -127 ? -127 : v;
        qb[j] = (int8_t)v;
        if (j < 16) sum0 += v; else sum1 += v;
        if (rest)
            rest[j] = xb[j] - d * (float)v;
    }
    qx->d[i * (k / 32) + b] = d;
    for (int j = 0; j < 8; j++)
        qx->d8[(i * (k / 32) + b) * 8 + j] = d;
    qx->s16[i * (k / 16) + 2 * b] = d * (float)sum0;
    qx->s16[i * (k / 16) + 2 * b + 1] = d * (float)sum1;
    qx->s32[i * (k / 32) + b] = d * (float)(sum0 + sum1);
    return d;
}

/* terms 1: row i of x is qx's row i. terms 2: x's row i is qx's rows 2i (x rounded, scale d)
 * and 2i + 1 (what that rounding left, at most d / 2, rounded on the scale d / 256): x to
 * within d / 512 (~1/65000 of each block's largest element) instead of d / 2 (1/254), a 16-bit
 * value 256 q1 + q2 on the scale d / 256, whose integer sums the AVX-512 forms take as
 * 256 * (w . q1) + w . q2 in one int32 lane (|w . q1| over 4 elements <= 4 * 255 * 127). */
static int quantize_x(const float *x, int64_t ldx, int m, int64_t k, int terms, int want_c128, QuantX *qx) {
    const size_t rows = (size_t)m * (size_t)terms;
    qx->q = (int8_t *)malloc(rows * k);
    qx->d = (float *)malloc(rows * (k / 32) * sizeof(float));
    qx->s16 = (float *)malloc(rows * (k / 16) * sizeof(float));
    qx->d8 = (float *)malloc(rows * (k / 32) * 8 * sizeof(float));
    qx->s32 = (float *)malloc(rows * (k / 32) * sizeof(float));
    if (!qx->q || !qx->d || !qx->s16 || !qx->d8 || !qx->s32)
        return 1;
    for (int i = 0; i < m; i++)
        for (int64_t b = 0; b < k / 32; b++) {
            const float *xb = x + (int64_t)i * ldx + b * 32;
            if (terms == 1) {
                quantize_block(xb, qx, i, b, k, 0.0f, NULL);
            } else {
                float rest[32];
                const float d = quantize_block(xb, qx, 2 * (int64_t)i, b, k, 0.0f, rest);
                quantize_block(rest, qx, 2 * (int64_t)i + 1, b, k, d / 256.0f, NULL); /* d = 0: all zeros */
            }
        }
#if defined(__AVX512VNNI__)
    /* decode-sized calls: x's 4-byte sums times -128, where Q8_0's AVX-512 form starts its sums
     * (fast512_q32) */
    if (want_c128 && terms == 1 && m <= C128_MAX_ROWS) {
        if ((qx->c128 = (int32_t *)malloc((size_t)m * (size_t)(k / 4) * sizeof(int32_t))) == NULL)
            return 1;
        for (int64_t j = 0; j < (int64_t)m * (k / 4); j++) {
            const int8_t *q4 = qx->q + 4 * j;
            qx->c128[j] = -128 * (q4[0] + q4[1] + q4[2] + q4[3]);
        }
    }
#endif
    return 0;
}

/* x [m, k] rounded to int8 in 1 or 2 terms (quantize_x), or NULL when out of memory */
static QuantX *new_quant_x(const float *x, int64_t ldx, int m, int64_t k, int terms, int want_c128) {
    QuantX *qx = (QuantX *)calloc(1, sizeof *qx);
    if (qx == NULL || quantize_x(x, ldx, m, k, terms, want_c128, qx) != 0) {
        free_quant_x(qx);
        return NULL;
    }
    return qx;
}

static inline __m256i wbytes_nibbles(const uint8_t *q16) { /* [lo nibbles | hi nibbles]: elements 0..31 */
    const __m128i b = _mm_loadu_si128((const __m128i *)q16), mask = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), mask), _mm_and_si128(b, mask));
}

#endif

#if HAVE_AVX2
/* The same integer products at AVX2, one function per format with a compile-time row count NR
 * (1..4), none of fast_row's per-block format switch, scalar scale unpacking and serial offset
 * sums (which held it to ~1 weight a cycle, below the exact path). Per 32 weights and row of
 * x: maddubs, madd, a convert and a multiply-add by the block's two scales (weight's times
 * x's, made a super-block at a time where the format allows). Offsets (the unsigned quants'
 * zero points) go through x's block sums as vectors: 8 blocks a multiply-add for Q4_K, 16
 * half blocks in two for Q6_K; Q4_0 and Q8_0 take signed weights (the sign moved onto x), so
 * they have none. */
static inline __m256i umul_sum(__m256i w_unsigned, __m256i xs) { /* 8 int32 lanes, 4 elements each */
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w_unsigned, xs), _mm256_set1_epi16(1));
}

static inline __attribute__((always_inline)) void fast_q4k_rows(const uint8_t *row, int64_t k, const QuantX *qx,
                                                                int i0, const int NR, float *out) {
    __m256 acc[4][2], off[4];
    for (int r = 0; r < NR; r++)
        acc[r][0] = acc[r][1] = off[r] = _mm256_setzero_ps();
    const int64_t nb = k / 32;
    const __m256i m15 = _mm256_set1_epi8(15);
    float ds[8], dm[8], sx[4][8];
    for (int64_t sb = 0; sb < k / 256; sb++) {
        const uint8_t *blk = row + sb * 144;
        PREFETCH_W(blk, 3);
        q4k_scales8(blk, ds, dm);
        const __m256 dsv = _mm256_loadu_ps(ds), dmv = _mm256_loadu_ps(dm);
        for (int r = 0; r < NR; r++) {
            const int64_t i = i0 + r;
            _mm256_storeu_ps(sx[r], _mm256_mul_ps(dsv, _mm256_loadu_ps(qx->d + i * nb + sb * 8)));
            off[r] = _mm256_fmadd_ps(dmv, _mm256_loadu_ps(qx->s32 + i * nb + sb * 8), off[r]);
        }
        __asm__ volatile("" ::: "memory"); /* the scale products are read back as broadcast loads */
        for (int c = 0; c < 4; c++) {
            const __m256i b = _mm256_loadu_si256((const __m256i *)(blk + 16 + c * 32));
            const __m256i lo = _mm256_and_si256(b, m15), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), m15);
            for (int r = 0; r < NR; r++) {
                const int8_t *xq = qx->q + (int64_t)(i0 + r) * k + sb * 256 + c * 64;
                const __m256i s0 = umul_sum(lo, _mm256_loadu_si256((const __m256i *)xq));
                const __m256i s1 = umul_sum(hi, _mm256_loadu_si256((const __m256i *)(xq + 32)));
                acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_set1_ps(sx[r][2 * c]), acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_set1_ps(sx[r][2 * c + 1]), acc[r][1]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        out[r] = hsum8(_mm256_add_ps(acc[r][0], acc[r][1])) - hsum8(off[r]);
}

static inline __attribute__((always_inline)) void fast_q6k_rows(const uint8_t *row, int64_t k, const QuantX *qx,
                                                                int i0, const int NR, float *out) {
    __m256 acc[4][2], off[4];
    for (int r = 0; r < NR; r++)
        acc[r][0] = acc[r][1] = off[r] = _mm256_setzero_ps();
    const int64_t nb = k / 32;
    const __m256i pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    for (int64_t sb = 0; sb < k / 256; sb++) {
        const uint8_t *blk = row + sb * 210;
        PREFETCH_W(blk, 4);
        const __m256 d = _mm256_set1_ps(h2f(blk + 208));
        const __m128i sc = _mm_loadu_si128((const __m128i *)(blk + 192));
        const __m256 scf[2] = {_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))),
                               _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))))};
        for (int r = 0; r < NR; r++) { /* the -32 of every quant: d * sc * 32 * x's half-block sums */
            const float *s16 = qx->s16 + (int64_t)(i0 + r) * (k / 16) + sb * 16;
            off[r] = _mm256_fmadd_ps(scf[0], _mm256_loadu_ps(s16), off[r]);
            off[r] = _mm256_fmadd_ps(scf[1], _mm256_loadu_ps(s16 + 8), off[r]);
        }
        for (int h = 0; h < 2; h++) {
            __m256i q[4]; /* 0..63 */
            q6k_join(blk, h, q);
            for (int t = 0; t < 4; t++) {
                const int g = h * 4 + t; /* the 32-block of the super-block: scales 2g and 2g + 1 */
                const __m256 lanes = _mm256_permutevar8x32_ps(scf[g >> 2], _mm256_add_epi32(pair, _mm256_set1_epi32(2 * (g & 3))));
                for (int r = 0; r < NR; r++) {
                    const int64_t i = i0 + r;
                    const int8_t *xq = qx->q + i * k + sb * 256 + g * 32;
                    const __m256i s = umul_sum(q[t], _mm256_loadu_si256((const __m256i *)xq));
                    const __m256 sc2 = _mm256_mul_ps(lanes, _mm256_set1_ps(qx->d[i * nb + sb * 8 + g]));
                    acc[r][t & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), sc2, acc[r][t & 1]);
                }
            }
        }
    }
    for (int r = 0; r < NR; r++)
        out[r] = hsum8(_mm256_add_ps(acc[r][0], acc[r][1])) - 32.0f * hsum8(off[r]);
}

/* Q8_0 (ONE -1), Q4_0 (0: nibbles - 8) and Q4_1 (1: nibbles, and m through x's block sum) */
static inline __attribute__((always_inline)) void fast_q32_rows(const uint8_t *row, int64_t k, const QuantX *qx,
                                                                int i0, const int NR, const int kind, float *out) {
    __m256 acc[4][2];
    float off[4][2] = {{0}};
    for (int r = 0; r < NR; r++)
        acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const int64_t nb = k / 32;
    const int bb = kind < 0 ? 34 : kind ? 20 : 18, qo = kind == 1 ? 4 : 2;
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = row + b * bb;
        PREFETCH_W(blk, 1);
        const float dw = h2f(blk);
        __m256i w;
        if (kind < 0) {
            w = _mm256_loadu_si256((const __m256i *)(blk + 2));
        } else {
            w = wbytes_nibbles(blk + qo);
            if (kind == 0)
                w = _mm256_sub_epi8(w, _mm256_set1_epi8(8));
        }
        const __m256i wabs = kind == 1 ? w : _mm256_sign_epi8(w, w);
        const float mw = kind == 1 ? h2f(blk + 2) : 0.0f;
        for (int r = 0; r < NR; r++) {
            const int64_t i = i0 + r;
            __m256i xs = _mm256_loadu_si256((const __m256i *)(qx->q + i * k + b * 32));
            if (kind != 1)
                xs = _mm256_sign_epi8(xs, w);
            const __m256 f = _mm256_cvtepi32_ps(umul_sum(wabs, xs));
            acc[r][b & 1] = _mm256_fmadd_ps(f, _mm256_set1_ps(dw * qx->d[i * nb + b]), acc[r][b & 1]);
            if (kind == 1)
                off[r][b & 1] += mw * qx->s32[i * nb + b];
        }
    }
    for (int r = 0; r < NR; r++)
        out[r] = hsum8(_mm256_add_ps(acc[r][0], acc[r][1])) + (off[r][0] + off[r][1]);
}

#define FAST_SWITCH(CALL)              \
    switch (R) {                       \
    case 1: CALL(1); return;           \
    case 2: CALL(2); return;           \
    case 3: CALL(3); return;           \
    default: CALL(4); return;          \
    }
#define FAST_Q4K(NR) fast_q4k_rows(row, k, qx, i0, NR, out)
#define FAST_Q6K(NR) fast_q6k_rows(row, k, qx, i0, NR, out)
#define FAST_Q80(NR) fast_q32_rows(row, k, qx, i0, NR, -1, out)
#define FAST_Q40(NR) fast_q32_rows(row, k, qx, i0, NR, 0, out)
#define FAST_Q41(NR) fast_q32_rows(row, k, qx, i0, NR, 1, out)

static void fast_row256(const uint8_t *row, int fmt, int64_t k, const QuantX *qx, int i0, int R, float *out) {
    switch (fmt) {
    case F_Q4_K: FAST_SWITCH(FAST_Q4K)
    case F_Q6_K: FAST_SWITCH(FAST_Q6K)
    case F_Q8_0: FAST_SWITCH(FAST_Q80)
    case F_Q4_0: FAST_SWITCH(FAST_Q40)
    default: FAST_SWITCH(FAST_Q41)
    }
}
#endif

#if HAVE_AVX512 && defined(__AVX512BW__)
/* The integer products in 512-bit registers, one function per format with a compile-time row
 * count NR (1..4), as the AVX2 forms above: 64 weights (two blocks of x) a step, the weights'
 * bytes unsigned, x's int8 bytes contiguous, 16 int32 lanes of 4-element sums (lanes 0-7 the
 * first block of 32, 8-15 the second), converted and scaled per lane by the weight's scale
 * (hoisted out of the rows) times x's block scale (Q4_K, Q6_K: x's 8 block scales of a
 * super-block in one register, each step's pair spread over the lanes by one permute; Q8_0,
 * Q4_0, Q4_1: qx->d8, each block's 8 times, one load).
 * With AVX-512 VNNI the 4-element sums are one vpdpbusd; without, maddubs + madd (the same
 * sums: no pair of products here reaches int16's limit, 2 * 128 * 127 at most). Offsets (the
 * unsigned quants' zero points) go through x's block sums: Q4_K 8 blocks a multiply-add, Q6_K
 * 16 half blocks in one; Q4_0 / Q4_1 per block. Needs k / 32 even (fast_dot checks). The
 * per-step format switch, scalar scale unpacking and runtime row count of the form this
 * replaces made it slower than the exact path on Zen 4 (1B Q4_K_M decode 149 vs 100 ms). */
static inline __m512i sums4_512(__m512i w_unsigned, __m512i xs) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(_mm512_setzero_si512(), w_unsigned, xs);
#else
    return _mm512_madd_epi16(_mm512_maddubs_epi16(w_unsigned, xs), _mm512_set1_epi16(1));
#endif
}

/* acc + the same sums (terms 2: the second term's, onto 256 times the first's) */
static inline __m512i sums4_acc_512(__m512i acc, __m512i w_unsigned, __m512i xs) {
#if defined(__AVX512VNNI__)
    return _mm512_dpbusd_epi32(acc, w_unsigned, xs);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w_unsigned, xs), _mm512_set1_epi16(1)));
#endif
}

/* x's integer sums against w at qx's row q1 (T = 1), or 256 times those plus the next row's
 * (T = 2: the 16-bit value of quantize_x's two terms); flip: x's bytes negated where neg is
 * set first (Q8_0's weight signs) */
static inline __attribute__((always_inline)) __m512i xsums_512(__m512i w, const int8_t *q1, int64_t k, const int T,
                                                               const int flip, __mmask64 neg) {
    __m512i x1 = _mm512_loadu_si512((const void *)q1);
    if (flip)
        x1 = _mm512_mask_sub_epi8(x1, neg, _mm512_setzero_si512(), x1);
    const __m512i s1 = sums4_512(w, x1);
    if (T == 1)
        return s1;
    __m512i x2 = _mm512_loadu_si512((const void *)(q1 + k));
    if (flip)
        x2 = _mm512_mask_sub_epi8(x2, neg, _mm512_setzero_si512(), x2);
    return sums4_acc_512(_mm512_slli_epi32(s1, 8), w, x2);
}

static inline __m512i join256(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

static inline float hsum_tail(__m512 a0, __m512 a1) { return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)); }

/* lanes 0-7 of the result: lane 2t of v; lanes 8-15: lane 2t + 1 (a 64-weight step's two blocks) */
static inline __m512i pick_pair(int t) {
    return _mm512_add_epi32(_mm512_set1_epi32(2 * t), _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
}

static inline __attribute__((always_inline)) void fast512_q4k(const uint8_t *row, int64_t k, const QuantX *qx,
                                                              int i0, const int NR, const int T, float *out) {
    __m512 acc[4][2], sx[4];
    __m256 off[4];
    for (int r = 0; r < NR; r++)
        acc[r][0] = acc[r][1] = _mm512_setzero_ps(), off[r] = _mm256_setzero_ps();
    const int64_t nb = k / 32;
    const __m512i m15 = _mm512_set1_epi8(15);
    const __m512i pick[4] = {pick_pair(0), pick_pair(1), pick_pair(2), pick_pair(3)};
    float ds[8], dm[8];
    for (int64_t sb = 0; sb < k / 256; sb++) {
        const uint8_t *blk = row + sb * 144;
        PREFETCH_W(blk, 3);
        q4k_scales8(blk, ds, dm);
        const __m256 dsv = _mm256_loadu_ps(ds), dmv = _mm256_loadu_ps(dm);
        for (int r = 0; r < NR; r++) { /* the 8 blocks' weight scale times x's, once a super-block */
            const int64_t at = (int64_t)T * (i0 + r) * nb + sb * 8, last = at + (T - 1) * nb; /* T = 2: d / 256 */
            sx[r] = _mm512_castps256_ps512(_mm256_mul_ps(dsv, _mm256_loadu_ps(qx->d + last)));
            __m256 xs = _mm256_loadu_ps(qx->s32 + at);
            if (T == 2)
                xs = _mm256_add_ps(xs, _mm256_loadu_ps(qx->s32 + last));
            off[r] = _mm256_fmadd_ps(dmv, xs, off[r]);
        }
        for (int c = 0; c < 4; c++) {
            const __m256i b = _mm256_loadu_si256((const __m256i *)(blk + 16 + c * 32));
            const __m512i w = _mm512_and_si512(join256(b, _mm256_srli_epi16(b, 4)), m15); /* blocks 2c, 2c + 1 */
            for (int r = 0; r < NR; r++) {
                const __m512 f = _mm512_cvtepi32_ps(xsums_512(w, qx->q + (int64_t)T * (i0 + r) * k + sb * 256 + c * 64, k, T, 0, 0));
                acc[r][c & 1] = _mm512_fmadd_ps(f, _mm512_permutexvar_ps(pick[c], sx[r]), acc[r][c & 1]);
            }
        }
    }
    for (int r = 0; r < NR; r++)
        out[r] = hsum_tail(acc[r][0], acc[r][1]) - hsum8(off[r]);
}

static inline __attribute__((always_inline)) void fast512_q6k(const uint8_t *row, int64_t k, const QuantX *qx,
                                                              int i0, const int NR, const int T, float *out) {
    __m512 acc[4][2], off[4], xd[4];
    for (int r = 0; r < NR; r++)
        acc[r][0] = acc[r][1] = off[r] = _mm512_setzero_ps();
    const int64_t nb = k / 32;
    const __m512i m15 = _mm512_set1_epi8(15), m3 = _mm512_set1_epi8(3);
    const __m512i pick[4] = {pick_pair(0), pick_pair(1), pick_pair(2), pick_pair(3)};
    for (int64_t sb = 0; sb < k / 256; sb++) {
        const uint8_t *blk = row + sb * 210;
        PREFETCH_W(blk, 4);
        /* d * the 16 scales: scf's lane g is the scale of elements 16g .. 16g + 15 */
        const __m512 scf = _mm512_mul_ps(_mm512_set1_ps(h2f(blk + 208)),
                                         _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192)))));
        for (int r = 0; r < NR; r++) { /* the -32 of every quant: d * sc * 32 * x's half-block sums */
            const int64_t qi = (int64_t)T * (i0 + r), last = qi + T - 1;
            __m512 xs = _mm512_loadu_ps(qx->s16 + qi * (k / 16) + sb * 16);
            if (T == 2)
                xs = _mm512_add_ps(xs, _mm512_loadu_ps(qx->s16 + last * (k / 16) + sb * 16));
            off[r] = _mm512_fmadd_ps(scf, xs, off[r]);
            xd[r] = _mm512_castps256_ps512(_mm256_loadu_ps(qx->d + last * nb + sb * 8)); /* x's 8 block scales */
        }
        for (int h = 0; h < 2; h++) {
            const __m512i l = _mm512_loadu_si512((const void *)(blk + h * 64));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)(blk + 128 + h * 32));
            const __m512i hb01 = join256(hb, _mm256_srli_epi16(hb, 2)), hb23 = _mm512_srli_epi16(hb01, 4);
            __m512i w[2]; /* 0..63: elements h * 128 + 0..63 and + 64..127 */
            w[0] = _mm512_or_si512(_mm512_and_si512(l, m15), _mm512_slli_epi16(_mm512_and_si512(hb01, m3), 4));
            w[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m15),
                                   _mm512_slli_epi16(_mm512_and_si512(hb23, m3), 4));
            for (int t = 0; t < 2; t++) {
                const int g = h * 2 + t; /* 64 elements 64g ..: scales 4g .. 4g + 3, blocks 2g, 2g + 1 */
                const __m512 wsc = _mm512_permutexvar_ps(
                    _mm512_add_epi32(_mm512_set1_epi32(4 * g),
                                     _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3)), scf);
                for (int r = 0; r < NR; r++) {
                    const __m512 f = _mm512_cvtepi32_ps(xsums_512(w[t], qx->q + (int64_t)T * (i0 + r) * k + sb * 256 + g * 64, k, T, 0, 0));
                    const __m512 sc = _mm512_mul_ps(wsc, _mm512_permutexvar_ps(pick[g], xd[r]));
                    acc[r][t] = _mm512_fmadd_ps(f, sc, acc[r][t]);
                }
            }
        }
    }
    for (int r = 0; r < NR; r++)
        out[r] = hsum_tail(acc[r][0], acc[r][1]) - 32.0f * _mm512_reduce_add_ps(off[r]);
}

/* One 64-weight step p (two blocks) of fast512_q32 into acc[r] (the sums of the steps of p's
 * parity) and off. Q8_0 (kind -1) takes one of two forms of the same int32 sums: with x's
 * c128 (AVX-512 VNNI, one term, few rows), the weights' bytes made unsigned by flipping their
 * top bit (w + 128) and vpdpbusd started from -128 times x's 4-byte sums, so
 * sum (w + 128) x - 128 sum x = sum w x; else their magnitudes, with their signs moved onto x.
 * The first takes one flip a step and, per row of x, a load of the sums' start with the
 * product; the second a sign mask and the magnitudes a step, then per row x's masked negation
 * and a zeroed sum besides the product. */
static inline __attribute__((always_inline)) void q32_step512(const uint8_t *row, int64_t k, const QuantX *qx,
                                                              int i0, const int NR, const int kind, const int T,
                                                              const int unsigned_w, int64_t p, __m512 *acc,
                                                              float (*off)[2]) {
    const int64_t nb = k / 32;
    const int bb = kind < 0 ? 34 : kind ? 20 : 18, qo = kind == 1 ? 4 : 2;
    const uint8_t *b0 = row + 2 * p * bb, *b1 = b0 + bb;
    PREFETCH_W(b0, 2);
    const float d0 = h2f(b0), d1 = h2f(b1);
    __m512i w;
    __mmask64 neg = 0;
    if (kind < 0) {
        const __m512i sw = join256(_mm256_loadu_si256((const __m256i *)(b0 + 2)),
                                   _mm256_loadu_si256((const __m256i *)(b1 + 2)));
        if (unsigned_w) {
            w = _mm512_xor_si512(sw, _mm512_set1_epi8((char)0x80));
        } else {
            neg = _mm512_movepi8_mask(sw);
            w = _mm512_abs_epi8(sw);
        }
    } else { /* byte j of a block: elements j (low nibble) and j + 16 (high) */
        const __m256i m15 = _mm256_set1_epi8(15);
        const __m128i q0 = _mm_loadu_si128((const __m128i *)(b0 + qo)), q1 = _mm_loadu_si128((const __m128i *)(b1 + qo));
        const __m256i lo = _mm256_and_si256(_mm256_set_m128i(q1, q0), m15);                        /* lo0 lo1 */
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(_mm256_set_m128i(q1, q0), 4), m15); /* hi0 hi1 */
        const __m512i lh = join256(lo, hi);
        w = _mm512_shuffle_i64x2(lh, lh, _MM_SHUFFLE(3, 1, 2, 0)); /* lo0 hi0 lo1 hi1 */
    }
    const __m512 wsc = _mm512_insertf32x8(_mm512_set1_ps(d0), _mm256_set1_ps(d1), 1);
    const float m0 = kind == 1 ? h2f(b0 + 2) : -8.0f * d0, m1 = kind == 1 ? h2f(b1 + 2) : -8.0f * d1;
    for (int r = 0; r < NR; r++) {
        const int64_t i = (int64_t)T * (i0 + r), last = i + T - 1; /* T = 2: the scale d / 256 is last's */
        __m512i sums;
#if defined(__AVX512VNNI__)
        if (unsigned_w)
            sums = _mm512_dpbusd_epi32(_mm512_loadu_si512((const void *)(qx->c128 + i * (k / 4) + p * 16)), w,
                                       _mm512_loadu_si512((const void *)(qx->q + i * k + p * 64)));
        else
#endif
            /* kind < 0: the weights' signs onto x, each term */
            sums = xsums_512(w, qx->q + i * k + p * 64, k, T, kind < 0, neg);
        const __m512 f = _mm512_cvtepi32_ps(sums);
        const __m512 sc = _mm512_mul_ps(wsc, _mm512_loadu_ps(qx->d8 + (last * nb + 2 * p) * 8));
        acc[r] = _mm512_fmadd_ps(f, sc, acc[r]);
        if (kind >= 0) {
            off[r][0] += m0 * (qx->s32[i * nb + 2 * p] + (T == 2 ? qx->s32[last * nb + 2 * p] : 0.0f));
            off[r][1] += m1 * (qx->s32[i * nb + 2 * p + 1] + (T == 2 ? qx->s32[last * nb + 2 * p + 1] : 0.0f));
        }
    }
}

/* Q8_0 (kind -1: see q32_step512), Q4_0 (0: nibbles, offset -8 d) and Q4_1 (1: nibbles, offset
 * m), two blocks a step, the even and odd steps into two sets of sums (taken two steps an
 * iteration, so both stay in registers: indexed by p & 1 they lived on the stack, a load and a
 * store a step) */
static inline __attribute__((always_inline)) void fast512_q32(const uint8_t *row, int64_t k, const QuantX *qx,
                                                              int i0, const int NR, const int kind, const int T,
                                                              float *out) {
    __m512 even[4], odd[4];
    float off[4][2] = {{0}};
    for (int r = 0; r < NR; r++)
        even[r] = odd[r] = _mm512_setzero_ps();
    const int64_t steps = k / 64;
#define Q32_STEPS(U)                                                                                  \
    do {                                                                                              \
        int64_t p = 0;                                                                                \
        for (; p + 2 <= steps; p += 2) {                                                              \
            q32_step512(row, k, qx, i0, NR, kind, T, U, p, even, off);                                \
            q32_step512(row, k, qx, i0, NR, kind, T, U, p + 1, odd, off);                             \
        }                                                                                             \
        if (p < steps)                                                                                \
            q32_step512(row, k, qx, i0, NR, kind, T, U, p, even, off);                                \
    } while (0)
#if defined(__AVX512VNNI__)
    if (kind < 0 && T == 1 && qx->c128 != NULL)
        Q32_STEPS(1);
    else
#endif
        Q32_STEPS(0);
#undef Q32_STEPS
    for (int r = 0; r < NR; r++)
        out[r] = hsum_tail(even[r], odd[r]) + (off[r][0] + off[r][1]);
}

#define FAST512_Q4K(NR) fast512_q4k(row, k, qx, i0, NR, T, out)
#define FAST512_Q6K(NR) fast512_q6k(row, k, qx, i0, NR, T, out)
#define FAST512_Q80(NR) fast512_q32(row, k, qx, i0, NR, -1, T, out)
#define FAST512_Q40(NR) fast512_q32(row, k, qx, i0, NR, 0, T, out)
#define FAST512_Q41(NR) fast512_q32(row, k, qx, i0, NR, 1, T, out)

static inline __attribute__((always_inline)) void fast_row512_terms(const uint8_t *row, int fmt, int64_t k,
                                                                    const QuantX *qx, int i0, int R, const int T,
                                                                    float *out) {
    switch (fmt) {
    case F_Q4_K: FAST_SWITCH(FAST512_Q4K)
    case F_Q6_K: FAST_SWITCH(FAST512_Q6K)
    case F_Q8_0: FAST_SWITCH(FAST512_Q80)
    case F_Q4_0: FAST_SWITCH(FAST512_Q40)
    default: FAST_SWITCH(FAST512_Q41)
    }
}

/* x's rows i0 .. i0 + R - 1 (R <= 4) against one weight row: qx's rows i0 .. (T = 1), or its
 * pairs 2i, 2i + 1 (T = 2, quantize_x's two terms); T a compile-time constant in each form */
static void fast_row512(const uint8_t *row, int fmt, int64_t k, const QuantX *qx, int i0, int R, int T, float *out) {
    if (T == 2)
        fast_row512_terms(row, fmt, k, qx, i0, R, 2, out);
    else
        fast_row512_terms(row, fmt, k, qx, i0, R, 1, out);
}
#define HAVE_FAST512 1
#else
#define HAVE_FAST512 0
#endif

#if HAVE_AVX2
/* out[i] = row . x_i for R (1..4) quantized rows of qx (from i0), in the widest form here */
/* x's rows i0 .. i0 + R - 1 (R <= 4 / terms) against one weight row, from qx in `terms` terms,
 * in the widest form here (the AVX2 forms take the two terms as two rows of qx and add them) */
static void fast_dot_terms(const uint8_t *row, int fmt, int64_t k, const QuantX *qx, int terms, int i0, int R,
                           float *out) {
#if HAVE_FAST512
    if ((k / 32) % 2 == 0) {
        fast_row512(row, fmt, k, qx, i0, R, terms, out);
        return;
    }
#endif
    if (terms == 1) {
        fast_row256(row, fmt, k, qx, i0, R, out);
        return;
    }
    float both[4];
    fast_row256(row, fmt, k, qx, 2 * i0, 2 * R, both);
    for (int j = 0; j < R; j++)
        out[j] = both[2 * j] + both[2 * j + 1];
}
#endif

int longctx_blocks_fast_supported(int fmt) {
#if HAVE_AVX2
    return fmt == F_Q8_0 || fmt == F_Q4_0 || fmt == F_Q4_1 || fmt == F_Q4_K || fmt == F_Q6_K;
#else
    (void)fmt;
    return 0;
#endif
}

int longctx_blocks_linear_fast(const float *x, int64_t ldx, int m, const uint8_t *w, int64_t row_bytes, int fmt,
                               int n, int64_t k, const float *bias, float *y, int64_t ldy, const float *res,
                               int64_t ldr, int nthreads, int terms) {
    if (!longctx_blocks_fast_supported(fmt))
        return 5;
    if (terms < 1 || terms > 2)
        return 2;
    const uint8_t *ws[1] = {w};
    const int64_t bytes[1] = {row_bytes}, rows[1] = {n};
    const int fmts[1] = {fmt};
    return longctx_blocks_linear_parts(x, ldx, m, 1, ws, bytes, fmts, rows, k, bias, y, ldy, res, ldr, nthreads, 0,
                                       NULL, 0.0f, terms);
}
