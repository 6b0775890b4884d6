/* y = x @ W^T (+ bias) on the CPU for float32 or bfloat16 weights held as the checkpoint has
 * them ([out, in], row-major, HF's layout): the weight products of decode, batched decode, lookahead
 * verification and prefill chunks.
 *
 * Why C: with one to a few dozen rows these products are a stream over the weights, and the
 * bytes read decide the time. BLAS either re-packs the weights on every call (several times
 * the cost of reading them once at 2-32 rows) or, given oneDNN's pre-packed copy, reads them
 * at ~15 GB/s here against ~25 GB/s for a plain reduction over the same bytes. With more rows
 * the products are compute-bound, and the panel path below measured faster than torch's BLAS
 * on the same [out, in] matrix from 17 rows to 2,048 (bench_linear.py), so a model keeps one
 * plain copy of its weights and one code path for every step.
 *
 *   x    [M, K] float32, row stride ldx (elements); [M, 2K] for the SwiGLU prologue
 *   w    [N, K] float32 or bfloat16 (wt), contiguous; bfloat16 weights are widened to float32 in
 *        registers (a shift), so activations, products and sums stay float32 and a bf16 model
 *        reads half the bytes per step
 *   bias [N] float32 or NULL
 *   y    [M, N] float32, row stride ldy
 *
 * Optional pieces of the decoder layer around the product, so a step makes one call where
 * torch would make several:
 *   prologue 1 (RMSNorm): the product takes g * x / sqrt(mean(x^2) + eps) for each row of x;
 *   prologue 2 (SwiGLU):  the product takes silu(x[:, :K]) * x[:, K:];
 *   residual [M, N] (row stride ldr) or NULL: added to y.
 *
 * Work: output rows of W are cut into slices of SLICE rows over the OpenMP threads the caller
 * asks for (torch's count).
 * Below PANEL_MIN_ROWS rows (dot products): within a slice, rows of x are taken eight at a time
 * against one weight row, so a step of up to eight rows reads each weight once, while it
 * streams in; the remaining rows (one to seven) likewise go against one weight row after
 * another, so each thread reads its weights in address order (row_dot has the figures against
 * reading several weight rows side by side). Each (x row, weight row) pair has its own vector
 * accumulators, summed across lanes at the end of the row. From
 * PANEL_MIN_ROWS rows on (panels): a slice's weights are transposed once into two panels of
 * 16 output columns ([k][16], 8x8 register transposes), and x rows are taken six at a time
 * against a panel: per k two panel loads and six broadcasts feed twelve FMAs, where the dot
 * products spend a load per FMA (at AVX-512 both panels at once, PANEL_ROWS_Z rows a pass: ten
 * on Intel, see panel_rows_z). K goes in blocks of up to PANEL_K and rows in blocks of
 * PANEL_M so the panels and the x rows stay in cache for any model width and step.
 * (bench_linear.py has the figures per row count.) AVX2 + FMA with intrinsics where the
 * compiler targets them (kernels/cpu_build.py picks the instruction set); the dot products run
 * 16 lanes wide where AVX-512 is there; plain C dot products otherwise.
 *
 * Built at first use by kernels/cpu_linear.py with the machine's compiler.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif

#ifndef ROW_PREFETCH /* bytes ahead of a pass of row_dot that it asks into L2; 0: none (see row_dot) */
#define ROW_PREFETCH 0
#endif
#define SLICE 32 /* output rows per work item: 32 rows x K=1536 floats = 192 KB, fits in L2 */
#ifndef PANEL_MIN_ROWS
#define PANEL_MIN_ROWS 17 /* at 16 rows two dot-product passes measured as fast; from 17 the panels win */
#endif
#ifndef PANEL_M
#define PANEL_M 1024 /* rows of x per pass over the weights */
#endif
#ifndef PANEL_K
#define PANEL_K 2048 /* most of K per panel block (a multiple of 8): 2048 x 32 floats = 256 KB, in L2 */
#endif
#ifndef PANEL_ROWS_Z
/* rows of x per pass over a K block of both panels at AVX-512 (1..15): each row's broadcast feeds two FMAs,
 * the two panel loads feed 2 x PANEL_ROWS_Z (see panel_rows_z) */
#define PANEL_ROWS_Z 6
#endif
#if PANEL_ROWS_Z < 1 || PANEL_ROWS_Z > 15
#error "PANEL_ROWS_Z must be 1..15 (the pass's switch and the 32 vector registers)"
#endif
#define ROW_PAD 16 /* floats after each row of the prologue's copy of x (see longctx_linear_rows) */

/* Weights are float32 (WT_F32) or bfloat16 (WT_BF16: the top half of a float32, read back by a
 * 16-bit shift, so every product and sum stays float32 and only the stored weight is rounded).
 * The element index i counts weights, whatever their width. */
enum { WT_F32 = 0, WT_BF16 = 1 };

static inline float wscalar(const void *w, int64_t i, int wt) {
    if (wt == WT_BF16) {
        const uint32_t bits = (uint32_t)((const uint16_t *)w)[i] << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    return ((const float *)w)[i];
}

/* What follows a product: the bias and the residual, either may be NULL. */
typedef struct {
    const float *bias, *res;
    int64_t ldr;
} Epilogue;

#if HAVE_AVX2
static inline __m256 wload8(const void *w, int64_t i, int wt) {
    if (wt == WT_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)w + i))), 16));
    return _mm256_loadu_ps((const float *)w + i);
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define HAVE_AVX512 1
static inline __m512 wload16(const void *w, int64_t i, int wt) {
    if (wt == WT_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)w + i))), 16));
    return _mm512_loadu_ps((const float *)w + i);
}
#else
#define HAVE_AVX512 0
#endif

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* out[m] for m < MB: one weight row (r0) against MB (4..8) x rows over the whole K. MB is a
 * constant at every call site, so the loops unroll and acc stays in registers. */
static inline __attribute__((always_inline)) void tile(int WT, int MB, const void *w, int64_t r0, int K,
                                                       const float *x, int64_t ldx, float *out) {
    __m256 acc[8];
    for (int m = 0; m < MB; m++) acc[m] = _mm256_setzero_ps();
    int k = 0;
#if HAVE_AVX512
    /* 16 lanes: half the loads, widenings and FMAs per weight (the bf16 stream needs them to
     * keep up with memory); the two halves are folded into the 8-lane sums. For float32 tiles
     * with fewer than 8 sums (one weight row against 4-7 x rows) it measured slower than 8
     * lanes (AMD EPYC, 4 rows: 28 vs 24.5 ms over the model's matrices), so those keep 8. */
    if (K >= 16 && (WT == WT_BF16 || MB >= 8)) {
        __m512 acc16[8];
        for (int m = 0; m < MB; m++) acc16[m] = _mm512_setzero_ps();
        for (; k + 16 <= K; k += 16) {
            const __m512 wv = wload16(w, r0 * K + k, WT);
            for (int m = 0; m < MB; m++) acc16[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * ldx + k), acc16[m]);
        }
        for (int m = 0; m < MB; m++)
            acc[m] = _mm256_add_ps(_mm512_castps512_ps256(acc16[m]), _mm512_extractf32x8_ps(acc16[m], 1));
    }
#endif
    for (; k + 8 <= K; k += 8) {
        const __m256 wv = wload8(w, r0 * K + k, WT);
        for (int m = 0; m < MB; m++) acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * ldx + k), acc[m]);
    }
    for (int m = 0; m < MB; m++) {
        float s = hsum(acc[m]);
        for (int kk = k; kk < K; kk++) s += wscalar(w, r0 * K + kk, WT) * x[m * ldx + kk];
        out[m] = s;
    }
}
#else
static inline void tile(int WT, int MB, const void *w, int64_t r0, int K, const float *x, int64_t ldx,
                        float *out) {
    for (int m = 0; m < MB; m++) {
        const float *xr = x + m * ldx;
        const int64_t base = r0 * K;
        float s = 0.0f;
#pragma omp simd reduction(+ : s)
        for (int k = 0; k < K; k++) s += wscalar(w, base + k, WT) * xr[k];
        out[m] = s;
    }
}
#endif

/* out[m] for MR (1..3) x rows against one weight row (elements base .. base + K), reading the
 * row in address order with four independent sums (two per x row for two and three rows), for
 * the FMA latency. One to three x rows (decode, small batches) go through this rather than a
 * tile of several weight rows read side by side: eight short interleaved streams
 * per thread kept fewer lines in flight than one stream in order. AMD EPYC with AVX-512 BF16,
 * 2 threads, the SmolLM2 model's 121 matrices out of cache, medians of 9, builds alternating
 * (ad-hoc ctypes script): bfloat16 15.7-16.5 -> 9.3-10.3 ms, float32 21.5 -> 17.9-18.4 ms.
 * 8 lanes: 16-lane sums measured slower here (bf16 11.0, fp32 18.6 ms), and so did software
 * prefetch 512 B to 4 KB ahead (the hardware prefetcher follows one stream in order).
 * On an Intel Xeon (family 6 model 207) the same stream reached only 13-17 GB/s of the ~22 a
 * plain sum reads, and asking for the line ROW_PREFETCH bytes ahead into L2 at each pass took
 * the 1B model's 64 matrices at one row from 15.8-17.3 to 20.5-21.3 GB/s (float32) and from
 * 13.3-15.9 to 21.0-26.2 (bfloat16), three rows 13.2 -> 20.8 and 10.1 -> 14.5 (ad-hoc ctypes
 * A/B, builds alternating, medians of 7-9). cpu_linear.py builds it with 8 KB on Intel CPUs
 * and without it elsewhere (0: none). */
static inline __attribute__((always_inline)) void row_dot(int WT, int MR, const void *w, int64_t base, int K,
                                                          const float *x, int64_t ldx, float *out) {
    int k = 0;
    float s[3] = {0.0f, 0.0f, 0.0f};
#if HAVE_AVX2
    enum { U = 4 }; /* vectors of a weight row per pass: one x row keeps U sums, more rows two each */
    const int nu = MR == 1 ? U : 2;
    __m256 b[3][U];
    for (int m = 0; m < MR; m++)
        for (int u = 0; u < nu; u++) b[m][u] = _mm256_setzero_ps();
    for (; k + 8 * nu <= K; k += 8 * nu) {
#if ROW_PREFETCH > 0
        {
            const int eb = WT == WT_BF16 ? 2 : 4;
            const char *pw = (const char *)w + (base + k) * eb + ROW_PREFETCH;
            for (int off = 0; off < 8 * nu * eb; off += 64) _mm_prefetch(pw + off, _MM_HINT_T1);
        }
#endif
        for (int u = 0; u < nu; u++) {
            const __m256 wv = wload8(w, base + k + 8 * u, WT);
            for (int m = 0; m < MR; m++) b[m][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * ldx + k + 8 * u), b[m][u]);
        }
    }
    for (; k + 8 <= K; k += 8) {
        const __m256 wv = wload8(w, base + k, WT);
        for (int m = 0; m < MR; m++) b[m][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * ldx + k), b[m][0]);
    }
    for (int m = 0; m < MR; m++) {
        __m256 t = b[m][0];
        for (int u = 1; u < nu; u++) t = _mm256_add_ps(t, b[m][u]);
        s[m] = hsum(t);
    }
#endif
    for (int m = 0; m < MR; m++) {
        float t = s[m];
        const float *xr = x + m * ldx;
#pragma omp simd reduction(+ : t)
        for (int kk = k; kk < K; kk++) t += wscalar(w, base + kk, WT) * xr[kk];
        out[m] = t;
    }
}

/* y[m][n] for MB (1..8) x rows against weight row n, with the epilogue: one to three rows by
 * row_dot (the row read in address order), more by tile. MB is a constant at every call site. */
static inline __attribute__((always_inline)) void weight_row(int WT, int MB, const void *w, int K, const float *x,
                                                             int64_t ldx, Epilogue ep, int n, float *y,
                                                             int64_t ldy) {
    float out[8];
    if (MB <= 3)
        row_dot(WT, MB, w, (int64_t)n * K, K, x, ldx, out);
    else
        tile(WT, MB, w, n, K, x, ldx, out);
    for (int m = 0; m < MB; m++) {
        float v = out[m];
        if (ep.bias) v += ep.bias[n];
        if (ep.res) v += ep.res[m * ep.ldr + n];
        y[m * ldy + n] = v;
    }
}

/* The epilogue for the x rows from m on. */
static inline Epilogue tile_ep(Epilogue ep, int m) {
    if (ep.res) ep.res += m * ep.ldr;
    return ep;
}

/* Inlined once per weight type (WT a constant at both call sites). */
static inline __attribute__((always_inline)) void slice(int WT, const float *x, int64_t ldx, int M, const void *w,
                                                        int K, Epilogue ep, int n_begin, int n_end, float *y,
                                                        int64_t ldy) {
    int m = 0;
    for (; m + 8 <= M; m += 8) /* eight rows against one weight row: each weight read once */
        for (int n = n_begin; n < n_end; n++) weight_row(WT, 8, w, K, x + m * ldx, ldx, tile_ep(ep, m), n, y + m * ldy, ldy);
    const float *xr = x + m * ldx;
    float *yr = y + m * ldy;
    const Epilogue er = tile_ep(ep, m);
#define REST_ROWS(MB) for (int n = n_begin; n < n_end; n++) weight_row(WT, MB, w, K, xr, ldx, er, n, yr, ldy)
    switch (M - m) { /* the remaining rows, a constant count for each copy */
    case 0: break;
    case 1: REST_ROWS(1); break;
    case 2: REST_ROWS(2); break;
    case 3: REST_ROWS(3); break;
    case 4: REST_ROWS(4); break;
    case 5: REST_ROWS(5); break;
    case 6: REST_ROWS(6); break;
    default: REST_ROWS(7); break;
    }
#undef REST_ROWS
}

#if HAVE_AVX2
/* The panel path (see the top): steps of PANEL_MIN_ROWS rows or more. */
static inline void transpose8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(u0, u4, 0x20); r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
    r[2] = _mm256_permute2f128_ps(u2, u6, 0x20); r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
    r[4] = _mm256_permute2f128_ps(u0, u4, 0x31); r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
    r[6] = _mm256_permute2f128_ps(u2, u6, 0x31); r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

/* wp[s][k][j] = w[n0 + 16 s + j][k0 + k] for k < kb and the slice's ns rows, 0 for j past them
 * (s < 2). */
static void pack_panels(const void *w, int wt, int K, int k0, int kb, int n0, int ns, float *wp) {
    for (int jb = 0; jb < 32; jb += 8) {
        float *dst = wp + (int64_t)(jb / 16) * kb * 16 + jb % 16;
        int64_t src[8]; /* element index of each weight row's k0, -1 past the slice */
        for (int i = 0; i < 8; i++) src[i] = jb + i < ns ? (int64_t)(n0 + jb + i) * K + k0 : -1;
        int k = 0;
        for (; k + 8 <= kb; k += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++) r[i] = src[i] >= 0 ? wload8(w, src[i] + k, wt) : _mm256_setzero_ps();
            transpose8(r);
            for (int c = 0; c < 8; c++) _mm256_store_ps(dst + (int64_t)(k + c) * 16, r[c]);
        }
        for (; k < kb; k++)
            for (int i = 0; i < 8; i++) dst[(int64_t)k * 16 + i] = src[i] >= 0 ? wscalar(w, src[i] + k, wt) : 0.0f;
    }
}

/* acc[m] = sum over k < kb of x[m][k] * ws[k][0..15] for MR (1..6) rows; ws: one panel [kb][16]. */
static inline __attribute__((always_inline)) void panel_rows(int MR, const float *ws, int kb, const float *x,
                                                             int64_t ldx, __m256 acc[6][2]) {
    __m256 a[6][2]; /* local, so that it lives in registers (acc's address escapes) */
    for (int m = 0; m < MR; m++) a[m][0] = a[m][1] = _mm256_setzero_ps();
    for (int k = 0; k < kb; k++) {
        const __m256 w0 = _mm256_load_ps(ws + (int64_t)k * 16), w1 = _mm256_load_ps(ws + (int64_t)k * 16 + 8);
        for (int m = 0; m < MR; m++) {
            const __m256 xb = _mm256_broadcast_ss(x + m * ldx + k);
            a[m][0] = _mm256_fmadd_ps(xb, w0, a[m][0]);
            a[m][1] = _mm256_fmadd_ps(xb, w1, a[m][1]);
        }
    }
    for (int m = 0; m < MR; m++) {
        acc[m][0] = a[m][0];
        acc[m][1] = a[m][1];
    }
}

/* y[m][n0 .. n0 + cols) for MR rows: acc, plus what y holds unless this is the first block of
 * K, plus the bias and the residual after the last. */
static inline void panel_store(int MR, __m256 acc[6][2], Epilogue ep, int n0, int cols, float *y, int64_t ldy,
                               int first, int last) {
    for (int m = 0; m < MR; m++) {
        float *yr = y + m * ldy + n0;
        const float *rr = ep.res ? ep.res + m * ep.ldr + n0 : NULL;
        if (cols == 16) {
            for (int h = 0; h < 2; h++) {
                __m256 v = acc[m][h];
                if (!first) v = _mm256_add_ps(_mm256_loadu_ps(yr + 8 * h), v);
                if (last && ep.bias) v = _mm256_add_ps(v, _mm256_loadu_ps(ep.bias + n0 + 8 * h));
                if (last && rr) v = _mm256_add_ps(v, _mm256_loadu_ps(rr + 8 * h));
                _mm256_storeu_ps(yr + 8 * h, v);
            }
        } else {
            float tmp[16];
            _mm256_storeu_ps(tmp, acc[m][0]);
            _mm256_storeu_ps(tmp + 8, acc[m][1]);
            for (int j = 0; j < cols; j++) {
                float v = tmp[j];
                if (!first) v = yr[j] + v;
                if (last && ep.bias) v += ep.bias[n0 + j];
                if (last && rr) v += rr[j];
                yr[j] = v;
            }
        }
    }
}

/* The K block of the panels: K in equal blocks of at most PANEL_K (rounded up to 8). */
static int panel_block(int K) {
    const int blocks = (K + PANEL_K - 1) / PANEL_K;
    return ((K + blocks - 1) / blocks + 7) / 8 * 8;
}

#if HAVE_AVX512
/* AVX-512: both panels of a slice at once, 16 columns each in one register: acc[m][s] = sum
 * over k < kb of x[m][k] * panel s [k][0..15], MR (1..PANEL_ROWS_Z) rows. Per k two panel loads
 * and MR broadcasts feed 2 MR FMAs. On the AMD EPYC (Zen 4, its 512-bit FMAs taken in two halves)
 * 8 or 12 rows measured the same as 6. On the Intel Xeon (two 512-bit FMA ports, where the loads
 * bind first) with the prologue's rows padded (ROW_PAD), one layer's four products of the 1B-shaped
 * model at 512 rows took 209 ms with 10 rows against 226 with 6 (medians of 7, alternating; 9 rows
 * 213, 11 rows 208; 12 rows 217 against 225 in another run; 14 no faster than 6 unpadded): Intel
 * builds take 10 (cpu_linear.VENDOR_FLAGS). */
static inline __attribute__((always_inline)) void panel_rows_z(int MR, const float *wp, int kb, const float *x,
                                                               int64_t ldx, __m512 acc[PANEL_ROWS_Z][2]) {
    __m512 a[PANEL_ROWS_Z][2];
    for (int m = 0; m < MR; m++) a[m][0] = a[m][1] = _mm512_setzero_ps();
    const float *w0 = wp, *w1 = wp + (int64_t)kb * 16;
    for (int k = 0; k < kb; k++) {
        const __m512 p0 = _mm512_load_ps(w0 + (int64_t)k * 16), p1 = _mm512_load_ps(w1 + (int64_t)k * 16);
        for (int m = 0; m < MR; m++) {
            const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
            a[m][0] = _mm512_fmadd_ps(xb, p0, a[m][0]);
            a[m][1] = _mm512_fmadd_ps(xb, p1, a[m][1]);
        }
    }
    for (int m = 0; m < MR; m++) {
        acc[m][0] = a[m][0];
        acc[m][1] = a[m][1];
    }
}

/* panel_store for each of the slice's panels (its ns columns), from the 16-float sums, six rows
 * at a time. */
static inline __attribute__((always_inline)) void panel_store_z(int MR, __m512 z[PANEL_ROWS_Z][2], Epilogue ep,
                                                                int n_begin, int ns, float *y, int64_t ldy, int first,
                                                                int last) {
    for (int s = 0; s * 16 < ns; s++)
        for (int m0 = 0; m0 < MR; m0 += 6) {
            const int mr = MR - m0 < 6 ? MR - m0 : 6;
            __m256 acc[6][2];
            for (int m = 0; m < mr; m++) {
                acc[m][0] = _mm512_castps512_ps256(z[m0 + m][s]);
                acc[m][1] = _mm512_extractf32x8_ps(z[m0 + m][s], 1);
            }
            panel_store(mr, acc, tile_ep(ep, m0), n_begin + 16 * s, ns - 16 * s < 16 ? ns - 16 * s : 16,
                        y + m0 * ldy, ldy, first, last);
        }
}
#endif

/* CALL(R) for R = rows (1..6) as a constant, so that each inlined copy keeps its sums in
 * registers. */
#define BY_ROWS(rows, CALL)             \
    switch (rows) {                     \
    case 1: CALL(1); break;             \
    case 2: CALL(2); break;             \
    case 3: CALL(3); break;             \
    case 4: CALL(4); break;             \
    case 5: CALL(5); break;             \
    default: CALL(6); break;            \
    }

/* One slice (output rows n_begin..n_end of w, at most 32) for all M rows of x. K goes in
 * blocks (panel_block) so that a block's panels stay in L2 whatever the model's width (one
 * block up to 2,048: measured faster here than smaller blocks in L1, which add passes over
 * y); each block's sums are added into y. */
static void slice_panels(const float *x, int64_t ldx, int M, const void *w, int wt, int K, Epilogue ep,
                         int n_begin, int n_end, float *y, int64_t ldy, float *wp) {
    const int ns = n_end - n_begin, block = panel_block(K);
    for (int k0 = 0; k0 < K; k0 += block) {
        const int kb = K - k0 < block ? K - k0 : block;
        const int first = k0 == 0, last = k0 + kb == K;
        pack_panels(w, wt, K, k0, kb, n_begin, ns, wp);
#if HAVE_AVX512
        for (int m = 0; m < M; m += PANEL_ROWS_Z) {
            __m512 z[PANEL_ROWS_Z][2];
            const float *xr = x + m * ldx + k0;
            const Epilogue er = tile_ep(ep, m);
            float *yr = y + m * ldy;
#define Z_ROWS(R) panel_rows_z(R, wp, kb, xr, ldx, z); panel_store_z(R, z, er, n_begin, ns, yr, ldy, first, last)
            switch (M - m < PANEL_ROWS_Z ? M - m : PANEL_ROWS_Z) { /* the rows as a constant: sums in registers */
#if PANEL_ROWS_Z > 1
            case 1: Z_ROWS(1); break;
#endif
#if PANEL_ROWS_Z > 2
            case 2: Z_ROWS(2); break;
#endif
#if PANEL_ROWS_Z > 3
            case 3: Z_ROWS(3); break;
#endif
#if PANEL_ROWS_Z > 4
            case 4: Z_ROWS(4); break;
#endif
#if PANEL_ROWS_Z > 5
            case 5: Z_ROWS(5); break;
#endif
#if PANEL_ROWS_Z > 6
            case 6: Z_ROWS(6); break;
#endif
#if PANEL_ROWS_Z > 7
            case 7: Z_ROWS(7); break;
#endif
#if PANEL_ROWS_Z > 8
            case 8: Z_ROWS(8); break;
#endif
#if PANEL_ROWS_Z > 9
            case 9: Z_ROWS(9); break;
#endif
#if PANEL_ROWS_Z > 10
            case 10: Z_ROWS(10); break;
#endif
#if PANEL_ROWS_Z > 11
            case 11: Z_ROWS(11); break;
#endif
#if PANEL_ROWS_Z > 12
            case 12: Z_ROWS(12); break;
#endif
#if PANEL_ROWS_Z > 13
            case 13: Z_ROWS(13); break;
#endif
#if PANEL_ROWS_Z > 14
            case 14: Z_ROWS(14); break;
#endif
            default: Z_ROWS(PANEL_ROWS_Z); break;
            }
#undef Z_ROWS
        }
#else
        for (int m = 0; m < M; m += 6) /* a block of x rows meets both panels while in L1 */
            for (int s = 0; s * 16 < ns; s++) {
                const float *ws = wp + (int64_t)s * kb * 16;
                const int n0 = n_begin + 16 * s, cols = ns - 16 * s < 16 ? ns - 16 * s : 16;
                __m256 acc[6][2];
                const float *xr = x + m * ldx + k0;
                const Epilogue er = tile_ep(ep, m);
                float *yr = y + m * ldy;
#define Y_ROWS(R) panel_rows(R, ws, kb, xr, ldx, acc); panel_store(R, acc, er, n0, cols, yr, ldy, first, last)
                BY_ROWS(M - m < 6 ? M - m : 6, Y_ROWS);
#undef Y_ROWS
            }
#endif
    }
}
#endif

#if HAVE_AVX2 && HAVE_AVX512 && defined(__AVX512BF16__)
#define HAVE_BF16_PANELS 1
/* bfloat16 weights from PANEL_MIN_ROWS rows on, where the CPU has AVX-512 BF16: the rows of x
 * are rounded to bfloat16 once per call (round to nearest even, as torch's .bfloat16() except
 * for subnormals, which vcvtneps2bf16 and vdpbf16ps take as zero) and the
 * products run by vdpbf16ps, which multiplies pairs of bfloat16 exactly and adds both products
 * to a float32 lane: 32 multiply-adds per instruction, twice the float32 FMA's. Sums stay
 * float32, as do the prologues (RMSNorm, SwiGLU: computed in float32, then rounded) and the
 * epilogue. This is what a bf16 model's prefill does in HF and vLLM (bf16 inputs, fp32
 * accumulation). Calls of up to 16 rows (the dot products: decode of up to 16 sequences)
 * keep float32 rows; any call from 17 rows on rounds them (prefill chunks, verification, a
 * decode batch of 17 or more), so a bf16 model's numbers depend on the size of the step it is in.
 * Layout: pairs along K. xb[m][p] = (x[m][2p], x[m][2p + 1]) as one 32-bit word (0 past K);
 * panel s: wb[s][p][j] = (w[n0 + 16 s + j][k0 + 2p], w[..][k0 + 2p + 1]), 0 past the block
 * or the slice. */

/* x [M, K] float32 (row stride ldx) -> xb [M, (K + 1) / 2] pairs. */
static void round_rows_bf16(const float *x, int64_t ldx, int M, int K, uint32_t *xb, int threads) {
    const int pairs = (K + 1) / 2;
#pragma omp parallel for schedule(static) if (M >= 8) num_threads(threads)
    for (int m = 0; m < M; m++) {
        const float *xr = x + m * ldx;
        uint16_t *dst = (uint16_t *)(xb + (int64_t)m * pairs);
        for (int k = 0; k < K; k += 16) {
            const int n = K - k < 16 ? K - k : 16;
            const __mmask16 live = (__mmask16)((1u << n) - 1u);
            const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(live, xr + k));
            _mm256_mask_storeu_epi16(dst + k, live, (__m256i)h);
        }
        if (K & 1) dst[K] = 0;
    }
}

/* Both panels of a slice for K block [k0, k0 + kb) (k0 even). */
static void pack_panels_bf16(const uint16_t *w, int K, int k0, int kb, int n0, int ns, uint32_t *wp) {
    const int pairs = (kb + 1) / 2;
    for (int j = 0; j < 32; j++) {
        uint32_t *dst = wp + (int64_t)(j / 16) * pairs * 16 + j % 16;
        if (j >= ns) {
            for (int p = 0; p < pairs; p++) dst[(int64_t)p * 16] = 0;
            continue;
        }
        const uint16_t *src = w + (int64_t)(n0 + j) * K + k0;
        int p = 0;
        for (; 2 * p + 1 < kb; p++) {
            uint32_t pair;
            memcpy(&pair, src + 2 * p, sizeof pair);
            dst[(int64_t)p * 16] = pair;
        }
        if (kb & 1) dst[(int64_t)p * 16] = src[2 * p];
    }
}

static inline __attribute__((always_inline)) void panel_rows_bf16(int MR, const uint32_t *wp, int pairs,
                                                                  const uint32_t *xb, int64_t ldxb,
                                                                  __m512 acc[6][2]) {
    __m512 a[6][2];
    for (int m = 0; m < MR; m++) a[m][0] = a[m][1] = _mm512_setzero_ps();
    const uint32_t *w0 = wp, *w1 = wp + (int64_t)pairs * 16;
    for (int p = 0; p < pairs; p++) {
        const __m512i p0 = _mm512_load_si512(w0 + (int64_t)p * 16), p1 = _mm512_load_si512(w1 + (int64_t)p * 16);
        for (int m = 0; m < MR; m++) {
            const __m512i xv = _mm512_set1_epi32((int)xb[m * ldxb + p]);
            a[m][0] = _mm512_dpbf16_ps(a[m][0], (__m512bh)xv, (__m512bh)p0);
            a[m][1] = _mm512_dpbf16_ps(a[m][1], (__m512bh)xv, (__m512bh)p1);
        }
    }
    for (int m = 0; m < MR; m++) {
        acc[m][0] = a[m][0];
        acc[m][1] = a[m][1];
    }
}

/* slice_panels over the pairs: xb [M, (K + 1) / 2], wp room for two panels of (block + 1) / 2 pairs. */
static void slice_panels_bf16(const uint32_t *xb, int M, const uint16_t *w, int K, Epilogue ep, int n_begin,
                              int n_end, float *y, int64_t ldy, uint32_t *wp) {
    const int ns = n_end - n_begin, block = panel_block(K); /* a multiple of 8: every k0 is even */
    const int64_t ldxb = (K + 1) / 2;
    for (int k0 = 0; k0 < K; k0 += block) {
        const int kb = K - k0 < block ? K - k0 : block, pairs = (kb + 1) / 2;
        const int first = k0 == 0, last = k0 + kb == K;
        pack_panels_bf16(w, K, k0, kb, n_begin, ns, wp);
        for (int m = 0; m < M; m += 6) {
            __m512 z[PANEL_ROWS_Z][2]; /* (at most 6 rows used: panel_store_z's array) */
            const uint32_t *xr = xb + m * ldxb + k0 / 2;
            const Epilogue er = tile_ep(ep, m);
            float *yr = y + m * ldy;
#define B_ROWS(R) panel_rows_bf16(R, wp, pairs, xr, ldxb, z); panel_store_z(R, z, er, n_begin, ns, yr, ldy, first, last)
            BY_ROWS(M - m < 6 ? M - m : 6, B_ROWS);
#undef B_ROWS
        }
    }
}
#else
#define HAVE_BF16_PANELS 0
#endif

#include "prologue.h"

/* Whether bfloat16 weights take the vdpbf16ps panels (x rounded to bfloat16) from PANEL_MIN_ROWS
 * rows on, where the build has them, or are widened to float32 in the float32 panels (x stays
 * float32, as below PANEL_MIN_ROWS and in builds without AVX-512 BF16). Set for the process by
 * longctx_linear_set_bf16_dot (kernels/cpu_tune.py measures which is faster at first use): on an
 * Intel Xeon (family 6 model 207) whose VM passes no AMX, the vdpbf16ps panels ran 130-150
 * GFLOP/s against 180-270 widened, on the default and a 1B model's shapes. */
static int bf16_dot = 1;

/* Returns whether this build has the vdpbf16ps panels (the setting then applies). */
int longctx_linear_set_bf16_dot(int on) {
    bf16_dot = on != 0;
    return HAVE_BF16_PANELS;
}

/* Returns 0, or a negative code for arguments it does not take (-2: out of memory). threads:
 * the OpenMP threads to use (the caller passes torch's count: OpenMP's own setting is per
 * calling thread, and a server's worker thread would otherwise get every core). */
int longctx_linear_rows(const float *x, int64_t ldx, int M, const void *w, int wt, int N, int K,
                        const float *bias, float *y, int64_t ldy, int prologue,
                        const float *norm_w, float eps, const float *res, int64_t ldr, int threads) {
    if (M < 1 || N < 1 || K < 1 || ldy < N || prologue < 0 || prologue > 2 || threads < 1) return -1;
    if (wt != WT_F32 && wt != WT_BF16) return -1;
    if (ldx < (prologue == 2 ? 2 * (int64_t)K : K) || (prologue == 1 && !norm_w) || (res && ldr < N))
        return -1;
    float *tmp = NULL;
    if (prologue != 0) { /* the rows the product takes, computed once: M rows of ldt floats */
        /* Each row ROW_PAD floats (a cache line) past the last: the panels read several rows of x side
         * by side, and at a width of 1,024 floats or a multiple of it those rows' lines would share one
         * L1 set (the set repeats every 4 KB). */
        const int64_t ldt = K + (M >= PANEL_MIN_ROWS ? ROW_PAD : 0);
        tmp = malloc(sizeof(float) * (size_t)M * (size_t)ldt);
        if (!tmp) return -2;
#pragma omp parallel for schedule(static) if (M >= 8) num_threads(threads)
        for (int m = 0; m < M; m++) {
            const float *xr = x + m * ldx;
            float *t = tmp + (int64_t)m * ldt;
            if (prologue == 1) {
                rms_row(xr, norm_w, eps, K, t);
            } else {
                swiglu_row(xr, xr + K, K, t);
            }
        }
        x = tmp;
        ldx = ldt;
    }
    const Epilogue ep = {bias, res, ldr};
    const int num_slices = (N + SLICE - 1) / SLICE;
#if HAVE_AVX2
    if (M >= PANEL_MIN_ROWS) { /* every thread's panels in one allocation, before the parallel region */
        /* bf16 weights at AVX-512 BF16: x's rows rounded to bf16 pairs once, [M, (K + 1) / 2] */
        const int bf16 = HAVE_BF16_PANELS && bf16_dot && wt == WT_BF16;
        const int64_t pairs = (K + 1) / 2;
        const size_t per_thread = (size_t)panel_block(K) * 32; /* floats, or more than the pairs need */
        float *pool = aligned_alloc(64, sizeof(float) * per_thread * (size_t)threads);
        uint32_t *xb = bf16 ? malloc(sizeof(uint32_t) * (size_t)M * (size_t)pairs) : NULL;
        if (!pool || (bf16 && !xb)) {
            free(pool);
            free(xb);
            free(tmp);
            return -2;
        }
#if HAVE_BF16_PANELS
        if (bf16) round_rows_bf16(x, ldx, M, K, xb, threads);
#endif
#pragma omp parallel num_threads(threads)
        {
#ifdef _OPENMP
            float *wp = pool + per_thread * (size_t)omp_get_thread_num();
#else
            float *wp = pool;
#endif
            /* rows in blocks of PANEL_M, so that a block's x rows stay in cache across slices */
            for (int m0 = 0; m0 < M; m0 += PANEL_M) {
                const int mb = M - m0 < PANEL_M ? M - m0 : PANEL_M;
#pragma omp for schedule(static)
                for (int s = 0; s < num_slices; s++) {
                    const int n0 = s * SLICE, n1 = (n0 + SLICE < N) ? n0 + SLICE : N;
#if HAVE_BF16_PANELS
                    if (bf16) {
                        slice_panels_bf16(xb + m0 * pairs, mb, (const uint16_t *)w, K, tile_ep(ep, m0), n0, n1,
                                          y + m0 * ldy, ldy, (uint32_t *)wp);
                        continue;
                    }
#endif
                    slice_panels(x + m0 * ldx, ldx, mb, w, wt, K, tile_ep(ep, m0), n0, n1, y + m0 * ldy, ldy, wp);
                }
            }
        }
        free(pool);
        free(xb);
        free(tmp);
        return 0;
    }
#endif
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int s = 0; s < num_slices; s++) {
        const int n0 = s * SLICE, n1 = (n0 + SLICE < N) ? n0 + SLICE : N;
        if (wt == WT_BF16)
            slice(WT_BF16, x, ldx, M, w, K, ep, n0, n1, y, ldy);
        else
            slice(WT_F32, x, ldx, M, w, K, ep, n0, n1, y, ldy);
    }
    free(tmp);
    return 0;
}

/* Rotate-half RoPE in place on the first `heads` heads of each of T rows (q and k of a fused
 * qkv row): for each head, (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) with cos/sin [T, D/2]
 * contiguous. The same products and sums as the torch form (no contraction into FMAs: the
 * library is built as ISO C, where GCC does not contract), so the results are bit-identical.
 * With `pairs`, each head's x1[i], x2[i] are read from its elements 2i and 2i + 1 (llama.cpp's
 * order of a Llama's q/k rows in a GGUF file) and written back as halves: the outputs put in
 * order and rotated in one pass, the same numbers as reordering first. Rows split over
 * `threads` (each element is its own: any split gives the same bits). */
#define ROPE_PAIRS_MAX_HALF 256
int longctx_rope_inplace(float *x, int T, int64_t ldx, int heads, int d, const float *cos_t,
                         const float *sin_t, int pairs, int threads) {
    if (T < 1 || heads < 1 || d < 2 || d % 2 != 0 || ldx < (int64_t)heads * d || threads < 1
        || (pairs && d / 2 > ROPE_PAIRS_MAX_HALF))
        return -1;
    const int half = d / 2;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && T >= 64)
    for (int t = 0; t < T; t++) {
        const float *c = cos_t + (int64_t)t * half, *s = sin_t + (int64_t)t * half;
        for (int h = 0; h < heads; h++) {
            float *x1 = x + t * ldx + (int64_t)h * d, *x2 = x1 + half;
            if (pairs) {
                float a[ROPE_PAIRS_MAX_HALF], b[ROPE_PAIRS_MAX_HALF];
                for (int i = 0; i < half; i++) {
                    a[i] = x1[2 * i];
                    b[i] = x1[2 * i + 1];
                }
#pragma omp simd
                for (int i = 0; i < half; i++) {
                    x1[i] = a[i] * c[i] - b[i] * s[i];
                    x2[i] = b[i] * c[i] + a[i] * s[i];
                }
                continue;
            }
#pragma omp simd
            for (int i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
    return 0;
}

/* out[m][k] = silu(gate[m][k]) * up[m][k] for M rows of F (gate and up: one row stride ld; out:
 * ldo): SwiGLU's product in one pass (swiglu_row, the prologue's numbers: its exponential, not
 * torch's), rows split over threads. Returns 0, or -1 for shapes it does not take. */
int longctx_swiglu_rows(const float *gate, const float *up, int64_t ld, int M, int F, float *out, int64_t ldo,
                        int threads) {
    if (M < 0 || F < 1 || threads < 1 || (M > 1 && (ld < F || ldo < F))) return -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M >= 16)
    for (int m = 0; m < M; m++) swiglu_row(gate + (int64_t)m * ld, up + (int64_t)m * ld, F, out + (int64_t)m * ldo);
    return 0;
}

/* out[m] = w * (x[m] * (1 / sqrt(mean(x[m]^2) + eps))) for M rows of K (row strides ldx, ldo): an
 * RMSNorm in one pass (rms_row, the prologue's numbers: float32 sums in its order), rows split
 * over threads. Returns 0, or -1 for shapes it does not take. */
int longctx_rms_rows(const float *x, int64_t ldx, int M, int K, const float *w, float eps, float *out, int64_t ldo,
                     int threads) {
    if (M < 0 || K < 1 || threads < 1 || !(eps >= 0.0f) || (M > 1 && (ldx < K || ldo < K))) return -1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1 && M >= 16)
    for (int m = 0; m < M; m++) rms_row(x + (int64_t)m * ldx, w, eps, K, out + (int64_t)m * ldo);
    return 0;
}

/* 1 when this build has the panel path for many rows (AVX2 + FMA), else 0: the caller then
 * keeps BLAS for long steps. */
int longctx_linear_has_panels(void) { return HAVE_AVX2; }

/* Whether bfloat16 weights from PANEL_MIN_ROWS rows on take x rounded to bfloat16 (vdpbf16ps). */
int longctx_linear_bf16_panels(void) { return HAVE_BF16_PANELS && bf16_dot; }
