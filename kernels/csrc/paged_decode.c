/* Paged attention for a few new tokens of one sequence on the CPU (decode and small lookahead
 * verification), reading K/V straight from the pages.
 *
 * Why C: decode attention is a stream over the whole KV of a sequence, a handful of query rows
 * against every cached token. BLAS has no good shape for it (an M = 3..9 GEMM or a GEMV per
 * head reads KV at a fraction of the memory bandwidth on the machines we measured), and a
 * torch formulation either wastes flops (a block-diagonal query operand) or materialises
 * [S, rows, D] products. This kernel reads each K/V row once per KV head, keeps the query
 * rows and their accumulators in L1 and uses an online softmax (flash-decoding): the context
 * is cut into splits, each (KV head, split) is one work item, and the splits are merged by
 * log-sum-exp at the end.
 *
 * Layout and conventions are those of kernels/reference.py:
 *   q      [L, H, D] float32, contiguous (the caller converts)
 *   caches [num_blocks, block_size, Hkv, D], float32 or bfloat16, contiguous
 *   blocks the sequence's block ids (int32); token t lives in block blocks[t / block_size]
 *   the new tokens are the last L of ctx_len; query i sees every earlier token, and among the
 *   new tokens token j iff bit j of tail_words[i] (NULL: sees all of them)
 *   out    [L, H, D] float32, lse [L, H] float32 (natural log, of the scaled scores)
 * Query head hq reads KV head hq / (H / Hkv).
 *
 * Built at first use by kernels/cpu_decode.py with the machine's compiler
 * (-O3 -march=native -fopenmp); it links the OpenMP runtime torch already loaded, so torch's
 * thread count applies.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "split_merge.h"

#define TILE 32       /* tokens scored together */
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

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1

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

/* Ask for whole rows (all KV heads) of one cache ahead of their use. */
static inline void prefetch_rows(const void *cache, const int64_t *slots, int n, int row_bytes) {
#ifdef HAVE_AVX2
    for (int j = 0; j < n; j++) {
        const char *row = (const char *)cache + slots[j] * row_bytes;
        for (int b = 0; b < row_bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
    }
#else
    (void)cache; (void)slots; (void)n; (void)row_bytes;
#endif
}

/* One work item: tokens [t0, t1) for every KV head, read in token order (whole rows, so the
 * stream is sequential within a page). qs holds the scaled query rows, [Hkv][rows][D], row
 * r = i * group + g being query token i, head kvh * group + g. Writes the partial states of
 * the Hkv * rows rows: max m, sum l, unnormalised acc [Hkv * rows, D]. */
static void attend_split(const float *qs, const void *k_cache, const void *v_cache, int dtype,
                         const int32_t *blocks, int block_size, int ctx_len, int q_len,
                         int num_heads, int num_kv, int d, const uint64_t *tail_words,
                         int t0, int t1, float *m, float *l, float *acc_out) {
    const int group = num_heads / num_kv;
    const int rows = q_len * group;
    const int first_new = ctx_len - q_len;
    const int elem = dtype == 0 ? 4 : 2;
    const int row_bytes = num_kv * d * elem;
    float scores[MAX_ROWS][TILE];
    float kbuf[TILE * MAX_D], vbuf[TILE * MAX_D];
    const float *krows[TILE], *vrows[TILE];
    for (int r = 0; r < num_kv * rows; r++) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
    }
    memset(acc_out, 0, sizeof(float) * num_kv * rows * d);
    int64_t slots[TILE], next_slots[TILE];
    tile_slots(blocks, block_size, t0, (t1 - t0 < TILE) ? t1 - t0 : TILE, next_slots);
    for (int base = t0; base < t1; base += TILE) {
        const int n = (t1 - base < TILE) ? t1 - base : TILE;
        memcpy(slots, next_slots, sizeof(int64_t) * n);
        if (base + n < t1) { /* the next tile's rows are on their way while this one computes */
            const int next = (t1 - base - n < TILE) ? t1 - base - n : TILE;
            tile_slots(blocks, block_size, base + n, next, next_slots);
            prefetch_rows(k_cache, next_slots, next, row_bytes);
            prefetch_rows(v_cache, next_slots, next, row_bytes);
        }
        for (int kvh = 0; kvh < num_kv; kvh++) {
            const float *qh = qs + (int64_t)kvh * rows * d;
            float *mh = m + kvh * rows, *lh = l + kvh * rows;
            float *acc_h = acc_out + (int64_t)kvh * rows * d;
            tile_rows(k_cache, dtype, slots, n, num_kv, kvh, d, kbuf, krows);
            for (int r = 0; r < rows; r++) row_scores(qh + r * d, krows, n, d, scores[r]);
            if (tail_words && base + n > first_new) {
                for (int j = first_new > base ? first_new - base : 0; j < n; j++) {
                    const int bit = base + j - first_new;
                    for (int r = 0; r < rows; r++)
                        if (!((tail_words[r / group] >> bit) & 1u)) scores[r][j] = -INFINITY;
                }
            }
            for (int r = 0; r < rows; r++) {
                float peak = mh[r];
                for (int j = 0; j < n; j++) peak = scores[r][j] > peak ? scores[r][j] : peak;
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
            tile_rows(v_cache, dtype, slots, n, num_kv, kvh, d, vbuf, vrows);
            for (int r = 0; r < rows; r++) row_accumulate(scores[r], vrows, n, d, acc_h + r * d);
        }
    }
}

/* Returns 0, or a negative code for arguments this kernel does not take (the caller checks
 * them first; this is a second line). work holds
 * num_heads * q_len * d + num_splits * num_heads * q_len * (d + 2) floats. */
int longctx_paged_decode(const float *q, const void *k_cache, const void *v_cache, int dtype,
                         const int32_t *blocks, int block_size, int ctx_len, int q_len,
                         int num_heads, int num_kv, int d, float scale,
                         const uint64_t *tail_words, int split_tokens, float *work,
                         float *out, float *lse) {
    if (dtype != 0 && dtype != 1) return -1;
    if (num_kv <= 0 || num_heads % num_kv != 0 || d > MAX_D || q_len < 1 || q_len > 63) return -2;
    const int group = num_heads / num_kv;
    const int rows = q_len * group;
    if (rows > MAX_ROWS || ctx_len < q_len || split_tokens < 1) return -3;
    const int num_splits = (ctx_len + split_tokens - 1) / split_tokens;
    const int all_rows = num_kv * rows;
    const int64_t item_floats = (int64_t)all_rows * (d + 2);
    float *qs = work, *states = work + (int64_t)all_rows * d;
    for (int kvh = 0; kvh < num_kv; kvh++)
        for (int r = 0; r < rows; r++) {
            const float *src = q + ((int64_t)(r / group) * num_heads + kvh * group + r % group) * d;
            float *dst = qs + ((int64_t)kvh * rows + r) * d;
            for (int x = 0; x < d; x++) dst[x] = src[x] * scale;
        }

#pragma omp parallel for schedule(static)
    for (int split = 0; split < num_splits; split++) {
        const int t0 = split * split_tokens;
        const int t1 = (t0 + split_tokens < ctx_len) ? t0 + split_tokens : ctx_len;
        float *state = states + split * item_floats;
        attend_split(qs, k_cache, v_cache, dtype, blocks, block_size, ctx_len, q_len, num_heads,
                     num_kv, d, tail_words, t0, t1, state, state + all_rows, state + 2 * all_rows);
    }
    merge_splits(states, num_splits, item_floats, all_rows, rows, group, num_heads, d, 0, out, lse);
    return 0;
}
