/* y = x @ W^T (+ bias) for a few rows of x on the CPU: the weight products of decode, batched
 * decode and lookahead verification.
 *
 * Why C: with one to a few dozen rows these products are a stream over the weights, and the
 * bytes read decide the time. BLAS either re-packs the weights on every call (several times
 * the cost of reading them once at 2-32 rows) or, given oneDNN's pre-packed copy, reads them
 * at ~15 GB/s here against ~25 GB/s for a plain reduction over the same bytes. This kernel
 * reads W in the layout the checkpoint has ([out, in], row-major, HF's layout), each weight
 * once per block of rows, with the x rows in L1, so a model keeps one plain copy of its weights
 * that BLAS also takes for long prefill chunks.
 *
 *   x    [M, K] float32, row stride ldx (elements); [M, 2K] for the SwiGLU prologue
 *   w    [N, K] float32, contiguous
 *   bias [N] float32 or NULL
 *   y    [M, N] float32, row stride ldy
 *
 * Optional pieces of the decoder layer around the product, so a decode step makes one call
 * where torch would make several small ones:
 *   prologue 1 (RMSNorm): the product takes g * x / sqrt(mean(x^2) + eps) for each row of x;
 *   prologue 2 (SwiGLU):  the product takes silu(x[:, :K]) * x[:, K:];
 *   residual [M, N] (row stride ldr) or NULL: added to y.
 *
 * Work: output rows of W are cut into slices of SLICE rows over torch's OpenMP threads. Within a
 * slice, rows of x are taken eight at a time against one weight row, so a step of up to eight
 * rows reads each weight once, while it streams in; the remaining rows go against several
 * weight rows at once (eight for a single x row, four for two, three for three) or one (four
 * to seven). The weights of a slice come from memory for the first block of x rows and
 * from cache for the next. Each (x row, weight row) pair has its own vector accumulator, summed
 * across lanes at the end of the row (bench_linear.py has the figures per row count). AVX2 +
 * FMA with intrinsics where the compiler targets them (-march=native), plain C otherwise.
 *
 * Built at first use by kernels/cpu_linear.py with the machine's compiler.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#else
#define HAVE_AVX2 0
#endif

#define SLICE 32 /* output rows per work item: 32 rows x K=1536 floats = 192 KB, fits in L2 */

#if HAVE_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y[m][n] for m < MB, n < NB of a tile: NB weight rows against MB x rows over the whole K. MB and
 * NB are constants at every call site, so the loops unroll and acc stays in registers. */
static inline __attribute__((always_inline)) void tile(int NB, int MB, const float *w, int K,
                                                       const float *x, int64_t ldx, float *out) {
    __m256 acc[8][8];
    for (int n = 0; n < NB; n++)
        for (int m = 0; m < MB; m++) acc[n][m] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 xv[8];
        for (int m = 0; m < MB; m++) xv[m] = _mm256_loadu_ps(x + m * ldx + k);
        for (int n = 0; n < NB; n++) {
            const __m256 wv = _mm256_loadu_ps(w + (int64_t)n * K + k);
            for (int m = 0; m < MB; m++) acc[n][m] = _mm256_fmadd_ps(wv, xv[m], acc[n][m]);
        }
    }
    for (int n = 0; n < NB; n++)
        for (int m = 0; m < MB; m++) {
            float s = hsum(acc[n][m]);
            for (int kk = k; kk < K; kk++) s += w[(int64_t)n * K + kk] * x[m * ldx + kk];
            out[m * 8 + n] = s;
        }
}
#else
static inline void tile(int NB, int MB, const float *w, int K, const float *x, int64_t ldx, float *out) {
    for (int n = 0; n < NB; n++)
        for (int m = 0; m < MB; m++) {
            const float *wr = w + (int64_t)n * K, *xr = x + m * ldx;
            float s = 0.0f;
#pragma omp simd reduction(+ : s)
            for (int k = 0; k < K; k++) s += wr[k] * xr[k];
            out[m * 8 + n] = s;
        }
}
#endif

/* One tile: MB (1..8) x rows against NB (1..8) weight rows, stored into y with the bias. */
typedef struct {
    const float *bias, *res; /* either may be NULL */
    int64_t ldr;
} Epilogue;

static inline __attribute__((always_inline)) void run_tile(int NB, int MB, const float *w, int K,
                                                           const float *x, int64_t ldx,
                                                           Epilogue ep, int n0, float *y,
                                                           int64_t ldy) {
    float out[64];
    tile(NB, MB, w + (int64_t)n0 * K, K, x, ldx, out);
    for (int m = 0; m < MB; m++)
        for (int n = 0; n < NB; n++) {
            float v = out[m * 8 + n];
            if (ep.bias) v += ep.bias[n0 + n];
            if (ep.res) v += ep.res[m * ep.ldr + n0 + n];
            y[m * ldy + n0 + n] = v;
        }
}

/* The epilogue for the x rows from m on. */
static inline Epilogue tile_ep(Epilogue ep, int m) {
    if (ep.res) ep.res += m * ep.ldr;
    return ep;
}

static void slice(const float *x, int64_t ldx, int M, const float *w, int K, Epilogue ep,
                  int n_begin, int n_end, float *y, int64_t ldy) {
    int m = 0;
    for (; m + 8 <= M; m += 8) /* eight rows against one weight row: each weight read once */
        for (int n = n_begin; n < n_end; n++) run_tile(1, 8, w, K, x + m * ldx, ldx, tile_ep(ep, m), n, y + m * ldy, ldy);
    const int rest = M - m;
    if (rest == 0) return;
    const float *xr = x + m * ldx;
    float *yr = y + m * ldy;
    const Epilogue er = tile_ep(ep, m);
    int n = n_begin;
    switch (rest) {
    case 1:
        for (; n + 8 <= n_end; n += 8) run_tile(8, 1, w, K, xr, ldx, er, n, yr, ldy);
        for (; n < n_end; n++) run_tile(1, 1, w, K, xr, ldx, er, n, yr, ldy);
        break;
    case 2:
        for (; n + 4 <= n_end; n += 4) run_tile(4, 2, w, K, xr, ldx, er, n, yr, ldy);
        for (; n < n_end; n++) run_tile(1, 2, w, K, xr, ldx, er, n, yr, ldy);
        break;
    case 3:
        for (; n + 3 <= n_end; n += 3) run_tile(3, 3, w, K, xr, ldx, er, n, yr, ldy);
        for (; n < n_end; n++) run_tile(1, 3, w, K, xr, ldx, er, n, yr, ldy);
        break;
    case 4:
        for (; n < n_end; n++) run_tile(1, 4, w, K, xr, ldx, er, n, yr, ldy);
        break;
    case 5:
        for (; n < n_end; n++) run_tile(1, 5, w, K, xr, ldx, er, n, yr, ldy);
        break;
    case 6:
        for (; n < n_end; n++) run_tile(1, 6, w, K, xr, ldx, er, n, yr, ldy);
        break;
    default:
        for (; n < n_end; n++) run_tile(1, 7, w, K, xr, ldx, er, n, yr, ldy);
        break;
    }
}

/* silu(g) * u, with silu(g) = g / (1 + exp(-g)) as torch computes it. */
static inline float swiglu(float g, float u) { return g / (1.0f + expf(-g)) * u; }

/* Returns 0, or a negative code for arguments it does not take (-2: out of memory). */
int longctx_linear_rows(const float *x, int64_t ldx, int M, const float *w, int N, int K,
                        const float *bias, float *y, int64_t ldy, int prologue,
                        const float *norm_w, float eps, const float *res, int64_t ldr) {
    if (M < 1 || N < 1 || K < 1 || ldy < N || prologue < 0 || prologue > 2) return -1;
    if (ldx < (prologue == 2 ? 2 * (int64_t)K : K) || (prologue == 1 && !norm_w) || (res && ldr < N))
        return -1;
    float *tmp = NULL;
    if (prologue != 0) { /* the rows the product takes, computed once: M x K floats */
        tmp = malloc(sizeof(float) * (size_t)M * (size_t)K);
        if (!tmp) return -2;
        for (int m = 0; m < M; m++) {
            const float *xr = x + m * ldx;
            float *t = tmp + (int64_t)m * K;
            if (prologue == 1) {
                float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
                for (int k = 0; k < K; k++) ss += xr[k] * xr[k];
                const float inv = 1.0f / sqrtf(ss / (float)K + eps);
#pragma omp simd
                for (int k = 0; k < K; k++) t[k] = norm_w[k] * (xr[k] * inv);
            } else {
                for (int k = 0; k < K; k++) t[k] = swiglu(xr[k], xr[K + k]);
            }
        }
        x = tmp;
        ldx = K;
    }
    const Epilogue ep = {bias, res, ldr};
    const int num_slices = (N + SLICE - 1) / SLICE;
#pragma omp parallel for schedule(static)
    for (int s = 0; s < num_slices; s++) {
        const int n0 = s * SLICE, n1 = (n0 + SLICE < N) ? n0 + SLICE : N;
        slice(x, ldx, M, w, K, ep, n0, n1, y, ldy);
    }
    free(tmp);
    return 0;
}

/* Rotate-half RoPE in place on the first `heads` heads of each of T rows (q and k of a fused
 * qkv row): for each head, (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin) with cos/sin [T, D/2]
 * contiguous. The same products and sums as the torch form (no contraction into FMAs: the
 * library is built as ISO C, where GCC does not contract), so the results are bit-identical. */
int longctx_rope_inplace(float *x, int T, int64_t ldx, int heads, int d, const float *cos_t,
                         const float *sin_t) {
    if (T < 1 || heads < 1 || d < 2 || d % 2 != 0 || ldx < (int64_t)heads * d) return -1;
    const int half = d / 2;
    for (int t = 0; t < T; t++) {
        const float *c = cos_t + (int64_t)t * half, *s = sin_t + (int64_t)t * half;
        for (int h = 0; h < heads; h++) {
            float *x1 = x + t * ldx + (int64_t)h * d, *x2 = x1 + half;
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
