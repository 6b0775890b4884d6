/* Paged flash attention on the CPU for many query rows per KV head: prefill chunks and
 * lookahead verification, reading K/V straight from the pages, a step's varlen batch per call.
 *
 * Why another kernel: paged_decode.c scores one query row at a time (dot products along the
 * head dim), which is right when a step has a few rows and the cost is the KV stream, and
 * compute-bound past that. Here the rows are the wide side. Per KV head, a block of query rows
 * (the new tokens times the GQA group) is held transposed, Q^T [D][rows], and a tile of keys is
 * scored against it as a small GEMM whose vectors run along the rows:
 *     S^T[key][rows] += K[key][x] * Q^T[x][rows]     (K[key][x] broadcast from the page)
 *     O^T[x][rows]   += V[key][x] * P^T[key][rows]   (V[key][x] broadcast from the page)
 * so K and V are used in place (no packing, no transposes), and the online softmax over the
 * keys of a tile is a column pass over S^T: max, exp and sum are plain vector ops with no
 * horizontal reductions. Scores are kept in log2 units (Q is pre-scaled by scale * log2 e) so
 * the exponentials are exp2. Fully masked key tiles (beyond the causal diagonal of a row block)
 * are never computed.
 *
 * Work items are (sequence, KV head, row block, KV split); a step with few row blocks (verification)
 * splits the keys too and merges the splits by log-sum-exp at the end, as flash-decoding does.
 *
 * Layout and conventions are those of kernels/reference.py, per sequence (the batch entry at
 * the end says how a step's sequences are found):
 *   q      [L, H, D] float32, contiguous (the caller converts)
 *   caches [num_blocks, block_size, Hkv, D], float32, bfloat16 or int8, contiguous
 *   int8 caches (kernels/kv_quant.py): k_scale / v_scale [num_blocks, Hkv] float32, a row's
 *   value being int8 * scale[block, head]; NULL for float caches
 *   blocks the sequence's block ids (int32); token t lives in block blocks[t / block_size]
 *   the new tokens are the last L of ctx_len; query i sees every earlier token, and among the
 *   new tokens: tokens 0..i (tail_words NULL: causal), or token j iff bit j of tail_words[i]
 *   window > 0 (a sliding window): query i, at position first_new + i (with tail_words:
 *   first_new + popcount(tail_words[i]) - 1), also sees only keys at positions > its position
 *   - window; a key's position is its index (the caller keeps window >= 64 for draft trees,
 *   so every new key a word allows is inside the window). Key tiles below every row's window
 *   are never computed.
 *   softcap > 0: every scaled score s becomes softcap * tanh(s / softcap) (Gemma 2)
 *   out    [L, H, D] float32, lse [L, H] float32 (natural log, of the scaled scores)
 * Query head hq reads KV head hq / (H / Hkv).
 *
 * int8 pages are converted to float32 times their page's scale as a tile's rows are fetched
 * (SIMD: AVX-512, AVX2 or plain C), into the buffers the bfloat16 path uses: that is O(keys * D)
 * per tile against O(keys * D * rows) for the products, which stay the float ones, and gives
 * exactly the values reference.py dequantises to.
 *
 * Built at first use by kernels/cpu_flash.py (through cpu_build.py) with -O3 -fopenmp and the
 * instruction set cpu_build.py picks; without AVX2/FMA the same loops run in plain C.
 */
#ifdef LONGCTX_AMX
#define _GNU_SOURCE /* amx_tiles.h's syscall */
#endif
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "split_merge.h"

#ifndef RB
#ifdef LONGCTX_AMX
/* The AMX build gathers K where its pages are not read in place (amx_k_groups) once per work item
 * and key tile, and V's pairs once per call for long sequences (prepack_v; else per work item):
 * twice the rows share that work, while amx_tile keeps each strip group's S^T in L1 whatever the
 * block's rows (see amx_tile for the figures). */
#define RB 192
#else
#define RB 96 /* query rows per work item (a multiple of 16) */
#endif
#endif
#ifndef KT
#ifdef LONGCTX_AMX
/* The AMX build's P.V loads and stores O^T's sums (RB x d floats: 48 KB at d 64, in L2) once per
 * key tile and column group: twice the keys a tile halve those round trips and the rescales.
 * Intel Xeon (family 6 model 167), 2 threads, the default model's bf16 8K prefill in 2,048-token
 * chunks (longctx-bf16 of bench_e2e, builds alternating, 3 runs each, twice): KT 96 4.33-4.73 s,
 * 192 4.08-4.28 s; 288 level with 192; RB 96 instead of 192 5.0-5.2 s. (With QK_EXACT_EDGES, an
 * A/B switch off by default, the first tile's float32 q then covers 192 keys here, 96 in the
 * vector builds.) */
#define KT 192
#else
#define KT 96 /* keys per tile (a multiple of 6) */
#endif
#endif
/* With QK_EXACT_EDGES (off by default): rows whose first token decides which key tiles are a
 * block's edge (scored with exact q): the vector build's RB. The AMX build (RB 192) decides per EXACT_ROWS of its
 * blocks, so both builds round q on the same keys: deciding per 192 rows parted the default
 * model's bf16 greedy tokens from float32's on bench_e2e's 8K prompt (token 3, a 0.15-nat margin
 * turned by 0.17) and moved the real-model test's logits from 0.9% to 1.4% off float32's. */
_Static_assert(KT % 6 == 0, "key tiles in whole groups of 6 keys (the vector scores' step)");
/* The AVX-512 float32 products' register blocks (see qk_keys16): keys a pass of the scores takes
 * and head-dim columns a pass of P.V takes, against a 32-row strip. 6 and 6 by default; Intel
 * builds take 12 and 12 (kernels/cpu_flash.py's VENDOR_FLAGS). */
#ifndef QK_KEYS
#define QK_KEYS 6
#endif
#ifndef PV_COLS
#define PV_COLS 6
#endif
#if QK_KEYS < 6 || QK_KEYS > 12 || KT % QK_KEYS != 0
#error "QK_KEYS must be 6..12 and divide KT (the sums of a pass stay in 2 x QK_KEYS registers)"
#endif
#if PV_COLS < 6 || PV_COLS > 12
#error "PV_COLS must be 6..12 (the sums of a pass stay in 2 x PV_COLS registers)"
#endif
#define EXACT_ROWS 96
#define MAX_D 256
#define KT32 ((KT + 31) / 32 * 32)
#define VT_STRIDE (KT32 / 2) /* words in a row of V^T's pairs (the AMX build's operand A) */
/* bfloat16 pages at avx512bf16: scores by vdpbf16ps (QK_BF16); with QK_EXACT_EDGES the sink and
 * diagonal tiles keep float32 q (off since 2026-12-06: see the note above dot_bf16); build-time
 * switches for A/B runs (see HAVE_BF16_DOT). */
#ifndef QK_BF16
#define QK_BF16 1
#endif
#ifndef QK_EXACT_EDGES
#define QK_EXACT_EDGES 0
#endif

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#if defined(__AVX512F__)
#define HAVE_AVX512 1
#endif
#endif

#define INLINE static inline __attribute__((always_inline))

/* 2^x for one float: 0 below -126 (and for -inf). Used off the hot loops. */
static inline float exp2_scalar(float x) { return x < -126.0f ? 0.0f : exp2f(x); }

#ifdef HAVE_AVX2
/* The vector code, written once for each register width W (floats per register: 8 with AVX2,
 * 16 with AVX-512) from the intrinsics' prefix P (_mm256 / _mm512):
 *
 * exp2_W(x): 2^x for x <= 0 (or -inf). x = n + f, |f| <= 1/2; 2^f by a degree-6 polynomial fitted
 *   to 2^f on that range (relative error 2e-9 in exact arithmetic, about 1e-7 with float32
 *   rounding); 2^n in the exponent bits. x is first raised to -127, where 2^n's exponent bits
 *   are 0, so the result is exactly 0 from -126.5 down (and for -inf) with no compare and mask.
 * qk_W: S^T rows k0..k0+5 (6 keys), columns i0..i0+2W-1: sum over x of K[key][x] * Q^T[x][i].
 * pv_W: O^T rows x0..x0+nd-1 (nd <= 12, a constant after inlining), columns i0..i0+2W-1:
 *   alpha[i] * O^T + sum over the tile's n keys of V[key][x] * P^T[key][i]; alpha NULL: 1 (the
 *   online softmax's rescale of the old sums, done as they are loaded).
 * pv_strips_W: pv_W over the 2W-row strips of rows [i_begin, i_end) and every column of O^T, COLS
 *   columns a pass (6; PV_COLS at AVX-512), the rest in one last pass.
 * softmax_W: the online-softmax step (tile_softmax) for rows i..i+W-1.
 *
 * With AVX-512 a 32-row strip is two 16-float registers: half the loads and instructions per
 * product of two 8-float ones (the FMA rate is the same on cores that split 512-bit FMAs). */
#define FLASH_SIMD(W, VT, VI, P, ROUND, CAST, COLS)                                                   \
    INLINE VT exp2_##W(VT x) {                                                                        \
        const VT y = P##_max_ps(x, P##_set1_ps(-127.0f));                                             \
        const VT n = ROUND(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                         \
        const VT f = P##_sub_ps(y, n);                                                                \
        VT p = P##_set1_ps(1.5337577497120947e-04f);                                                  \
        p = P##_fmadd_ps(p, f, P##_set1_ps(1.3399859890341759e-03f));                                 \
        p = P##_fmadd_ps(p, f, P##_set1_ps(9.618519805371761e-03f));                                  \
        p = P##_fmadd_ps(p, f, P##_set1_ps(5.550329014658928e-02f));                                  \
        p = P##_fmadd_ps(p, f, P##_set1_ps(2.4022646248340607e-01f));                                 \
        p = P##_fmadd_ps(p, f, P##_set1_ps(6.931471824645996e-01f));                                  \
        p = P##_fmadd_ps(p, f, P##_set1_ps(1.0f));                                                    \
        const VI e = P##_slli_epi32(P##_add_epi32(P##_cvtps_epi32(n), P##_set1_epi32(127)), 23);      \
        return P##_mul_ps(p, CAST(e));                                                                \
    }                                                                                                 \
    INLINE void qk_##W(const float *qt, int rbp, const float *const *krow, int d, float *st, int sstride, \
                       int i0) {                                                                      \
        VT a0 = P##_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;                        \
        VT b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0;                                      \
        const float *k0 = krow[0], *k1 = krow[1], *k2 = krow[2], *k3 = krow[3], *k4 = krow[4],        \
                    *k5 = krow[5];                                                                    \
        const float *qp = qt + i0;                                                                    \
        for (int x = 0; x < d; x++, qp += rbp) {                                                      \
            const VT q0 = P##_loadu_ps(qp), q1 = P##_loadu_ps(qp + W);                                \
            VT k = P##_set1_ps(k0[x]);                                                                \
            a0 = P##_fmadd_ps(k, q0, a0); b0 = P##_fmadd_ps(k, q1, b0);                               \
            k = P##_set1_ps(k1[x]);                                                                   \
            a1 = P##_fmadd_ps(k, q0, a1); b1 = P##_fmadd_ps(k, q1, b1);                               \
            k = P##_set1_ps(k2[x]);                                                                   \
            a2 = P##_fmadd_ps(k, q0, a2); b2 = P##_fmadd_ps(k, q1, b2);                               \
            k = P##_set1_ps(k3[x]);                                                                   \
            a3 = P##_fmadd_ps(k, q0, a3); b3 = P##_fmadd_ps(k, q1, b3);                               \
            k = P##_set1_ps(k4[x]);                                                                   \
            a4 = P##_fmadd_ps(k, q0, a4); b4 = P##_fmadd_ps(k, q1, b4);                               \
            k = P##_set1_ps(k5[x]);                                                                   \
            a5 = P##_fmadd_ps(k, q0, a5); b5 = P##_fmadd_ps(k, q1, b5);                               \
        }                                                                                             \
        float *s = st + i0;                                                                           \
        P##_storeu_ps(s, a0); P##_storeu_ps(s + W, b0); s += sstride;                                 \
        P##_storeu_ps(s, a1); P##_storeu_ps(s + W, b1); s += sstride;                                 \
        P##_storeu_ps(s, a2); P##_storeu_ps(s + W, b2); s += sstride;                                 \
        P##_storeu_ps(s, a3); P##_storeu_ps(s + W, b3); s += sstride;                                 \
        P##_storeu_ps(s, a4); P##_storeu_ps(s + W, b4); s += sstride;                                 \
        P##_storeu_ps(s, a5); P##_storeu_ps(s + W, b5);                                               \
    }                                                                                                 \
    INLINE void pv_##W(const float *pt, int rbp, const float *const *vrow, int n, int x0, int nd,      \
                       float *ot, int i0, const float *alpha) {                                       \
        VT a[12], b[12];                                                                              \
        for (int u = 0; u < nd; u++) {                                                                \
            a[u] = P##_loadu_ps(ot + (int64_t)(x0 + u) * rbp + i0);                                   \
            b[u] = P##_loadu_ps(ot + (int64_t)(x0 + u) * rbp + i0 + W);                               \
        }                                                                                             \
        if (alpha) {                                                                                  \
            const VT s0 = P##_loadu_ps(alpha + i0), s1 = P##_loadu_ps(alpha + i0 + W);                \
            for (int u = 0; u < nd; u++) {                                                            \
                a[u] = P##_mul_ps(a[u], s0);                                                          \
                b[u] = P##_mul_ps(b[u], s1);                                                          \
            }                                                                                         \
        }                                                                                             \
        const float *pp = pt + i0;                                                                    \
        for (int j = 0; j < n; j++, pp += rbp) {                                                      \
            const VT p0 = P##_loadu_ps(pp), p1 = P##_loadu_ps(pp + W);                                \
            const float *v = vrow[j] + x0;                                                            \
            for (int u = 0; u < nd; u++) {                                                            \
                const VT w = P##_set1_ps(v[u]);                                                       \
                a[u] = P##_fmadd_ps(w, p0, a[u]);                                                     \
                b[u] = P##_fmadd_ps(w, p1, b[u]);                                                     \
            }                                                                                         \
        }                                                                                             \
        for (int u = 0; u < nd; u++) {                                                                \
            P##_storeu_ps(ot + (int64_t)(x0 + u) * rbp + i0, a[u]);                                   \
            P##_storeu_ps(ot + (int64_t)(x0 + u) * rbp + i0 + W, b[u]);                               \
        }                                                                                             \
    }                                                                                                 \
    INLINE void pv_strips_##W(const float *pt, int rbp, const float *const *vrow, int n, int d,        \
                              float *ot, int i_begin, int i_end, const float *alpha) {                \
        int x0 = 0;                                                                                   \
        for (; x0 + COLS <= d; x0 += COLS)                                                            \
            for (int i0 = i_begin; i0 < i_end; i0 += 2 * W) pv_##W(pt, rbp, vrow, n, x0, COLS, ot, i0, alpha); \
        const int rest = d - x0;                                                                      \
        for (int i0 = i_begin; i0 < i_end && rest > 0; i0 += 2 * W) {                                 \
            switch (rest) { /* constant widths, so each inlined copy keeps its sums in registers */    \
            case 1: pv_##W(pt, rbp, vrow, n, x0, 1, ot, i0, alpha); break;                            \
            case 2: pv_##W(pt, rbp, vrow, n, x0, 2, ot, i0, alpha); break;                            \
            case 3: pv_##W(pt, rbp, vrow, n, x0, 3, ot, i0, alpha); break;                            \
            case 4: pv_##W(pt, rbp, vrow, n, x0, 4, ot, i0, alpha); break;                            \
            case 5: pv_##W(pt, rbp, vrow, n, x0, 5, ot, i0, alpha); break;                            \
            case 6: pv_##W(pt, rbp, vrow, n, x0, 6, ot, i0, alpha); break;                            \
            case 7: pv_##W(pt, rbp, vrow, n, x0, 7, ot, i0, alpha); break;                            \
            case 8: pv_##W(pt, rbp, vrow, n, x0, 8, ot, i0, alpha); break;                            \
            case 9: pv_##W(pt, rbp, vrow, n, x0, 9, ot, i0, alpha); break;                            \
            case 10: pv_##W(pt, rbp, vrow, n, x0, 10, ot, i0, alpha); break;                          \
            default: pv_##W(pt, rbp, vrow, n, x0, 11, ot, i0, alpha); break;                          \
            }                                                                                         \
        }                                                                                             \
    }                                                                                                 \
    INLINE void softmax_##W(float *st, int rbp, int n, int i, float *m, float *l, float *alpha) {     \
        /* four max chains: one would wait on the max's latency for every key */                   \
        VT peak = P##_loadu_ps(m + i), pk1 = peak, pk2 = peak, pk3 = peak;                            \
        int j = 0;                                                                                    \
        for (; j + 4 <= n; j += 4) {                                                                  \
            const float *s = st + (int64_t)j * rbp + i;                                               \
            peak = P##_max_ps(peak, P##_loadu_ps(s));                                                 \
            pk1 = P##_max_ps(pk1, P##_loadu_ps(s + rbp));                                             \
            pk2 = P##_max_ps(pk2, P##_loadu_ps(s + 2 * (int64_t)rbp));                                \
            pk3 = P##_max_ps(pk3, P##_loadu_ps(s + 3 * (int64_t)rbp));                                \
        }                                                                                             \
        for (; j < n; j++) peak = P##_max_ps(peak, P##_loadu_ps(st + (int64_t)j * rbp + i));         \
        peak = P##_max_ps(P##_max_ps(peak, pk1), P##_max_ps(pk2, pk3));                               \
        /* a row that has seen nothing keeps m = -inf; its reference is then -FLT_MAX, which gives   \
           it P = 0 and alpha = 0 */                                                                  \
        const VT ref = P##_max_ps(peak, P##_set1_ps(-FLT_MAX));                                       \
        const VT a = exp2_##W(P##_sub_ps(P##_loadu_ps(m + i), ref));                                  \
        VT sum = P##_setzero_ps();                                                                    \
        for (j = 0; j < n; j++) {                                                                     \
            float *s = st + (int64_t)j * rbp + i;                                                     \
            const VT p = exp2_##W(P##_sub_ps(P##_loadu_ps(s), ref));                                  \
            P##_storeu_ps(s, p);                                                                      \
            sum = P##_add_ps(sum, p);                                                                 \
        }                                                                                             \
        P##_storeu_ps(l + i, P##_fmadd_ps(P##_loadu_ps(l + i), a, sum));                              \
        P##_storeu_ps(m + i, peak);                                                                   \
        P##_storeu_ps(alpha + i, a);                                                                  \
    }

FLASH_SIMD(8, __m256, __m256i, _mm256, _mm256_round_ps, _mm256_castsi256_ps, 6)
#ifdef HAVE_AVX512
FLASH_SIMD(16, __m512, __m512i, _mm512, _mm512_roundscale_ps, _mm512_castsi512_ps, PV_COLS)
#endif

#if defined(HAVE_AVX512) && QK_KEYS != 6
/* qk_16 over QK_KEYS keys a pass (pv_16 takes PV_COLS columns a pass: FLASH_SIMD's COLS), up to
 * 12 each: per step, two loads of the strip and one broadcast a key (column) feed two FMAs a key (column), so 12 keys
 * take 14 loads for 24 FMAs where 6 take 8 for 12. On an Intel core with two 512-bit FMA ports
 * the loads bind first (as in linear_rows.c's panels). Each sum is the same sum in the same
 * order: the same bits. Intel Xeon (family 6 model 167), 2 threads, 2026-12-07, float32 pages of
 * SmolLM2's geometry (9 / 3 heads of 64), 8,000 keys in 4,096-row chunks, 6 layers, builds
 * alternating in one process, medians of 9: 1,551 ms with 6 and 6, 1,503 with 12 and 12 (8 and 8
 * 1,588 against 1,632 in a noisier run). */
INLINE void qk_keys16(const float *qt, int rbp, const float *const *krow, int d, float *st, int sstride, int i0) {
    __m512 a[QK_KEYS], b[QK_KEYS];
    const float *kr[QK_KEYS];
    for (int u = 0; u < QK_KEYS; u++) {
        a[u] = b[u] = _mm512_setzero_ps();
        kr[u] = krow[u];
    }
    const float *qp = qt + i0;
    for (int x = 0; x < d; x++, qp += rbp) {
        const __m512 q0 = _mm512_loadu_ps(qp), q1 = _mm512_loadu_ps(qp + 16);
        for (int u = 0; u < QK_KEYS; u++) {
            const __m512 k = _mm512_set1_ps(kr[u][x]);
            a[u] = _mm512_fmadd_ps(k, q0, a[u]);
            b[u] = _mm512_fmadd_ps(k, q1, b[u]);
        }
    }
    float *s = st + i0;
    for (int u = 0; u < QK_KEYS; u++, s += sstride) {
        _mm512_storeu_ps(s, a[u]);
        _mm512_storeu_ps(s + 16, b[u]);
    }
}
#endif

/* The same two products for a last strip of 8 rows (a block whose rows are 8 mod 16). */
INLINE void qk_6x8(const float *qt, int rbp, const float *const *krow, int d, float *st, int i0) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
    const float *qp = qt + i0;
    for (int x = 0; x < d; x++, qp += rbp) {
        const __m256 q0 = _mm256_load_ps(qp);
        a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(krow[0] + x), q0, a0);
        a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(krow[1] + x), q0, a1);
        a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(krow[2] + x), q0, a2);
        a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(krow[3] + x), q0, a3);
        a4 = _mm256_fmadd_ps(_mm256_broadcast_ss(krow[4] + x), q0, a4);
        a5 = _mm256_fmadd_ps(_mm256_broadcast_ss(krow[5] + x), q0, a5);
    }
    float *s = st + i0;
    _mm256_store_ps(s, a0); s += rbp;
    _mm256_store_ps(s, a1); s += rbp;
    _mm256_store_ps(s, a2); s += rbp;
    _mm256_store_ps(s, a3); s += rbp;
    _mm256_store_ps(s, a4); s += rbp;
    _mm256_store_ps(s, a5);
}

INLINE void pv_strip8(const float *pt, int rbp, const float *const *vrow, int n, int d, float *ot, int i0,
                      const float *alpha) {
    const __m256 s0 = alpha ? _mm256_loadu_ps(alpha + i0) : _mm256_set1_ps(1.0f);
    int x0 = 0;
    for (; x0 + 6 <= d; x0 += 6) {
        __m256 a[6];
        for (int u = 0; u < 6; u++) a[u] = _mm256_mul_ps(_mm256_load_ps(ot + (int64_t)(x0 + u) * rbp + i0), s0);
        const float *pp = pt + i0;
        for (int j = 0; j < n; j++, pp += rbp) {
            const __m256 p0 = _mm256_load_ps(pp);
            const float *v = vrow[j] + x0;
            for (int u = 0; u < 6; u++) a[u] = _mm256_fmadd_ps(_mm256_broadcast_ss(v + u), p0, a[u]);
        }
        for (int u = 0; u < 6; u++) _mm256_store_ps(ot + (int64_t)(x0 + u) * rbp + i0, a[u]);
    }
    for (; x0 < d; x0++) {
        __m256 a = _mm256_mul_ps(_mm256_load_ps(ot + (int64_t)x0 * rbp + i0), s0);
        const float *pp = pt + i0;
        for (int j = 0; j < n; j++, pp += rbp) a = _mm256_fmadd_ps(_mm256_broadcast_ss(vrow[j] + x0), _mm256_load_ps(pp), a);
        _mm256_store_ps(ot + (int64_t)x0 * rbp + i0, a);
    }
}
#endif

/* S^T[k][i] for the tile's keys (krow, n of them, rounded up to 6 and to QK_KEYS with zero rows) and the
 * block's rbp rows. */
static void tile_scores(const float *qt, int rbp, const float *const *krow, int n, int d, float *st) {
#if defined(HAVE_AVX512) && QK_KEYS != 6 /* the 32-row strips QK_KEYS keys a pass, the rest below */
    const int wide = rbp / 32 * 32;
    for (int k0 = 0; k0 < n; k0 += QK_KEYS)
        for (int i0 = 0; i0 < wide; i0 += 32) qk_keys16(qt, rbp, krow + k0, d, st + (int64_t)k0 * rbp, rbp, i0);
#endif
    for (int k0 = 0; k0 < n; k0 += 6) {
#ifdef HAVE_AVX2
        int i0 = 0;
#if defined(HAVE_AVX512) && QK_KEYS != 6
        i0 = wide;
#elif defined(HAVE_AVX512)
        for (; i0 + 32 <= rbp; i0 += 32) qk_16(qt, rbp, krow + k0, d, st + (int64_t)k0 * rbp, rbp, i0);
#endif
        for (; i0 + 16 <= rbp; i0 += 16) qk_8(qt, rbp, krow + k0, d, st + (int64_t)k0 * rbp, rbp, i0);
        if (i0 < rbp) qk_6x8(qt, rbp, krow + k0, d, st + (int64_t)k0 * rbp, i0);
#else
        for (int k = k0; k < k0 + 6; k++) {
            float *s = st + (int64_t)k * rbp;
            for (int i = 0; i < rbp; i++) s[i] = 0.0f;
            for (int x = 0; x < d; x++) {
                const float kx = krow[k][x];
                const float *qx = qt + (int64_t)x * rbp;
                for (int i = 0; i < rbp; i++) s[i] += kx * qx[i];
            }
        }
#endif
    }
}

/* O^T = alpha * O^T + V^T P^T over the tile's n keys (alpha per row; NULL: 1). */
static void tile_accumulate(const float *pt, int rbp, const float *const *vrow, int n, int d, float *ot,
                            const float *alpha) {
#ifdef HAVE_AVX2
    int wide = 0; /* rows in 32-row strips (AVX-512), then 16-row strips; an 8-row strip may follow */
#ifdef HAVE_AVX512
    wide = rbp / 32 * 32;
    pv_strips_16(pt, rbp, vrow, n, d, ot, 0, wide, alpha);
#endif
    const int full = wide + (rbp - wide) / 16 * 16;
    pv_strips_8(pt, rbp, vrow, n, d, ot, wide, full, alpha);
    if (full < rbp) pv_strip8(pt, rbp, vrow, n, d, ot, full, alpha);
#else
    if (alpha)
        for (int x = 0; x < d; x++)
            for (int i = 0; i < rbp; i++) ot[(int64_t)x * rbp + i] *= alpha[i];
    for (int j = 0; j < n; j++) {
        const float *p = pt + (int64_t)j * rbp;
        for (int x = 0; x < d; x++) {
            const float vx = vrow[j][x];
            float *o = ot + (int64_t)x * rbp;
            for (int i = 0; i < rbp; i++) o[i] += vx * p[i];
        }
    }
#endif
}

#if defined(HAVE_AVX512) && defined(__AVX512BF16__)
#define HAVE_BF16_DOT 1
/* bfloat16 pages on CPUs with AVX-512 BF16: O^T += V^T P^T by vdpbf16ps, which multiplies
 * pairs of bfloat16 exactly and adds both products to a float32 lane, so a 16-float register
 * does 32 multiply-adds per instruction (twice the float32 FMA's). The pairs run along the
 * keys: after the softmax P^T becomes pp[j/2][row] = (P[row][j], P[row][j+1]) rounded to
 * bfloat16 (0.4% relative per weight, as GPU flash kernels round p), against V's pairs packed
 * per tile, vp[j/2][x] = (V[j][x], V[j+1][x]) (exact: V is bfloat16).
 * Scores too, by pairs along the head dim: Q^T as qp[x/2][row] = (q[x], q[x+1]) rounded to
 * bfloat16 once per work item, K's pair read from the page as one 32-bit word (d even) -- in
 * every key tile. QK_EXACT_EDGES (a build-time switch, off) keeps float32 q in the first tile
 * (the attention sink) and the tiles the rows' causal edge crosses: it was on while the real
 * model's bf16 test asked for float32's 64 greedy tokens, which rounding q everywhere parted at
 * token 3, a three-way tie within 0.06 nats. That equality sat on the tie (with lookahead off
 * the same build parted there too), and the test now scores each bf16 token by HF float32's
 * log-probs on bf16's own prefix (tests/test_real_model.py). Off, the engine's bf16 prefill
 * measured 0.74 -> 0.71 s at 2K and 5.43 -> 5.27 s at 8K (Intel Xeon, AMX build).
 * Rows run in 32-row strips (two registers) and a last strip of 16 or 8 rows (masked). */
INLINE __m512 dot_bf16(__m512 acc, __m512i a, __m512i b) {
    return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

/* O^T rows x0..x0+nd-1, columns i0..: alpha * O^T + sum over key pairs of V pair x P pair. */
INLINE void pv_bf16(const uint32_t *pp, int rbp, const uint32_t *vp, int half_n, int d, int x0, int nd,
                    float *ot, int i0, const float *alpha, int two, __mmask16 live) {
    __m512 a[6], b[6];
    for (int u = 0; u < nd; u++) {
        a[u] = _mm512_maskz_loadu_ps(live, ot + (int64_t)(x0 + u) * rbp + i0);
        b[u] = two ? _mm512_loadu_ps(ot + (int64_t)(x0 + u) * rbp + i0 + 16) : a[u];
    }
    if (alpha) {
        const __m512 s0 = _mm512_maskz_loadu_ps(live, alpha + i0);
        const __m512 s1 = two ? _mm512_loadu_ps(alpha + i0 + 16) : s0;
        for (int u = 0; u < nd; u++) {
            a[u] = _mm512_mul_ps(a[u], s0);
            if (two) b[u] = _mm512_mul_ps(b[u], s1);
        }
    }
    const uint32_t *p = pp + i0;
    for (int jp = 0; jp < half_n; jp++, p += rbp) {
        const __m512i p0 = _mm512_maskz_loadu_epi32(live, p);
        const __m512i p1 = two ? _mm512_loadu_si512(p + 16) : p0;
        const uint32_t *v = vp + (int64_t)jp * d + x0;
        for (int u = 0; u < nd; u++) {
            const __m512i w = _mm512_set1_epi32((int)v[u]);
            a[u] = dot_bf16(a[u], p0, w);
            if (two) b[u] = dot_bf16(b[u], p1, w);
        }
    }
    for (int u = 0; u < nd; u++) {
        _mm512_mask_storeu_ps(ot + (int64_t)(x0 + u) * rbp + i0, live, a[u]);
        if (two) _mm512_storeu_ps(ot + (int64_t)(x0 + u) * rbp + i0 + 16, b[u]);
    }
}

INLINE void pv_bf16_columns(const uint32_t *pp, int rbp, const uint32_t *vp, int half_n, int d, float *ot,
                            int i0, const float *alpha, int two, __mmask16 live) {
    int x0 = 0;
    for (; x0 + 6 <= d; x0 += 6) pv_bf16(pp, rbp, vp, half_n, d, x0, 6, ot, i0, alpha, two, live);
    switch (d - x0) { /* constant widths, so each inlined copy keeps its sums in registers */
    case 1: pv_bf16(pp, rbp, vp, half_n, d, x0, 1, ot, i0, alpha, two, live); break;
    case 2: pv_bf16(pp, rbp, vp, half_n, d, x0, 2, ot, i0, alpha, two, live); break;
    case 3: pv_bf16(pp, rbp, vp, half_n, d, x0, 3, ot, i0, alpha, two, live); break;
    case 4: pv_bf16(pp, rbp, vp, half_n, d, x0, 4, ot, i0, alpha, two, live); break;
    case 5: pv_bf16(pp, rbp, vp, half_n, d, x0, 5, ot, i0, alpha, two, live); break;
    default: break;
    }
}

/* n rows of float32 (row stride rbp) as (n + 1) / 2 rows of bfloat16 pairs, dst[p][i] =
 * (src[2p][i], src[2p + 1][i]) (0 for a missing last row): Q^T before a work item's scores (P^T's
 * pairs come out of the softmax itself: tile_softmax_pairs, the same layout). */
static void pair_rows_bf16(const float *src, int rbp, int n, uint32_t *dst_rows) {
    for (int jp = 0; jp < (n + 1) / 2; jp++) {
        const float *lo = src + (int64_t)(2 * jp) * rbp, *hi = lo + rbp;
        const int has_hi = 2 * jp + 1 < n;
        uint32_t *dst = dst_rows + (int64_t)jp * rbp;
        for (int i = 0; i < rbp; i += 16) {
            const __mmask16 live = rbp - i >= 16 ? 0xFFFF : 0x00FF;
            const __m512 x = _mm512_maskz_loadu_ps(live, lo + i);
            const __m512 y = has_hi ? _mm512_maskz_loadu_ps(live, hi + i) : _mm512_setzero_ps();
            const __m512i xl = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x));
            const __m512i yh = _mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(y)), 16);
            _mm512_mask_storeu_epi32(dst + i, live, _mm512_or_si512(xl, yh));
        }
    }
}

/* tile_softmax for bfloat16 pages, with P written straight as pair_rows_bf16's pairs over S^T
 * (pair row j / 2 over float row j / 2, read by then): the same sums in the same order and the
 * same roundings as tile_softmax then pair_rows_bf16, without storing P as float32 and reading it
 * back. vcvtne2ps2bf16 rounds two keys' P at once (key j in the low 16 halves, j + 1 in the
 * high ones) and a word permute interleaves them into pairs. The max runs as four chains (one
 * would wait on vmaxps' latency for every key; the maximum is the same whatever the order). */
INLINE void softmax_pairs_16(float *st, int stride, int n, int i, float *m, float *l, float *alpha,
                             __m512i interleave, __mmask16 live) {
    __m512 peak = _mm512_maskz_loadu_ps(live, m + i), pk1 = peak, pk2 = peak, pk3 = peak;
    int j = 0;
    for (; j + 4 <= n; j += 4) {
        const float *s = st + (int64_t)j * stride + i;
        peak = _mm512_max_ps(peak, _mm512_maskz_loadu_ps(live, s));
        pk1 = _mm512_max_ps(pk1, _mm512_maskz_loadu_ps(live, s + stride));
        pk2 = _mm512_max_ps(pk2, _mm512_maskz_loadu_ps(live, s + 2 * (int64_t)stride));
        pk3 = _mm512_max_ps(pk3, _mm512_maskz_loadu_ps(live, s + 3 * (int64_t)stride));
    }
    for (; j < n; j++) peak = _mm512_max_ps(peak, _mm512_maskz_loadu_ps(live, st + (int64_t)j * stride + i));
    peak = _mm512_max_ps(_mm512_max_ps(peak, pk1), _mm512_max_ps(pk2, pk3));
    const __m512 ref = _mm512_max_ps(peak, _mm512_set1_ps(-FLT_MAX));
    const __m512 a = exp2_16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, m + i), ref));
    __m512 sum = _mm512_setzero_ps();
    uint32_t *pp = (uint32_t *)st + i;
    for (j = 0; j < n; j += 2, pp += stride) {
        const __m512 p0 = exp2_16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, st + (int64_t)j * stride + i), ref));
        sum = _mm512_add_ps(sum, p0);
        __m512 p1 = _mm512_setzero_ps();
        if (j + 1 < n) {
            p1 = exp2_16(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, st + (int64_t)(j + 1) * stride + i), ref));
            sum = _mm512_add_ps(sum, p1);
        }
        _mm512_mask_storeu_epi32(pp, live, _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(p1, p0)));
    }
    _mm512_mask_storeu_ps(l + i, live, _mm512_fmadd_ps(_mm512_maskz_loadu_ps(live, l + i), a, sum));
    _mm512_mask_storeu_ps(m + i, live, peak);
    _mm512_mask_storeu_ps(alpha + i, live, a);
}

/* tile_softmax then pair_rows_bf16 over S^T's n keys and `rows` columns (a multiple of 8), in
 * one pass (softmax_pairs_16). Returns whether any alpha is not 1. */
static int tile_softmax_pairs(float *st, int rows, int n, float *m, float *l, float *alpha) {
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __mmask16 moved = 0;
    for (int i = 0; i < rows; i += 16) {
        const __mmask16 live = rows - i >= 16 ? 0xFFFF : 0x00FF;
        softmax_pairs_16(st, rows, n, i, m, l, alpha, interleave, live);
        moved |= _mm512_mask_cmpneq_ps_mask(live, _mm512_maskz_loadu_ps(live, alpha + i), _mm512_set1_ps(1.0f));
    }
    return moved != 0;
}

/* V's rows of a tile's n keys (bfloat16 rows vrow[j]) as (n + 1) / 2 rows of pairs. */
static void pair_v_bf16(const uint16_t *const *vrow, int n, int d, const uint16_t *zero, uint32_t *vp) {
    for (int jp = 0; jp < (n + 1) / 2; jp++) {
        const uint16_t *v0 = vrow[2 * jp], *v1 = 2 * jp + 1 < n ? vrow[2 * jp + 1] : zero;
        uint32_t *dst = vp + (int64_t)jp * d;
        int x = 0;
        for (; x + 16 <= d; x += 16) {
            const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v0 + x)));
            const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v1 + x)));
            _mm512_storeu_si512(dst + x, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
        }
        for (; x < d; x++) dst[x] = (uint32_t)v0[x] | (uint32_t)v1[x] << 16;
    }
}

/* S^T rows (6 keys, bfloat16 rows krow[u]) for columns i0.. of a strip: sum over x pairs of
 * (K[key][2p], K[key][2p + 1]) . Q^T pair p, the pair read from the page as one 32-bit word. */
INLINE void qk_bf16(const uint32_t *qp, int rbp, const uint16_t *const *krow, int half_d, float *st, int i0,
                    int two, __mmask16 live) {
    __m512 a[6], b[6];
    for (int u = 0; u < 6; u++) a[u] = b[u] = _mm512_setzero_ps();
    const uint32_t *q = qp + i0;
    for (int p = 0; p < half_d; p++, q += rbp) {
        const __m512i q0 = _mm512_maskz_loadu_epi32(live, q);
        const __m512i q1 = two ? _mm512_loadu_si512(q + 16) : q0;
        for (int u = 0; u < 6; u++) {
            uint32_t word;
            memcpy(&word, krow[u] + 2 * p, sizeof word);
            const __m512i k = _mm512_set1_epi32((int)word);
            a[u] = dot_bf16(a[u], q0, k);
            if (two) b[u] = dot_bf16(b[u], q1, k);
        }
    }
    for (int u = 0; u < 6; u++) {
        _mm512_mask_storeu_ps(st + (int64_t)u * rbp + i0, live, a[u]);
        if (two) _mm512_storeu_ps(st + (int64_t)u * rbp + i0 + 16, b[u]);
    }
}

/* tile_scores over bfloat16 pages with Q^T as bfloat16 pairs qp[p][row] (d even). */
static void tile_scores_bf16(const uint32_t *qp, int rbp, const uint16_t *const *krow, int n, int d, float *st) {
    for (int k0 = 0; k0 < n; k0 += 6) {
        float *s = st + (int64_t)k0 * rbp;
        int i0 = 0;
        for (; i0 + 32 <= rbp; i0 += 32) qk_bf16(qp, rbp, krow + k0, d / 2, s, i0, 1, 0xFFFF);
        for (; i0 + 16 <= rbp; i0 += 16) qk_bf16(qp, rbp, krow + k0, d / 2, s, i0, 0, 0xFFFF);
        if (i0 < rbp) qk_bf16(qp, rbp, krow + k0, d / 2, s, i0, 0, 0x00FF);
    }
}

static void tile_accumulate_bf16(const uint32_t *pp, int rbp, const uint32_t *vp, int n, int d, float *ot,
                                 const float *alpha) {
    const int half_n = (n + 1) / 2;
    int i0 = 0;
    for (; i0 + 32 <= rbp; i0 += 32) pv_bf16_columns(pp, rbp, vp, half_n, d, ot, i0, alpha, 1, 0xFFFF);
    for (; i0 + 16 <= rbp; i0 += 16) pv_bf16_columns(pp, rbp, vp, half_n, d, ot, i0, alpha, 0, 0xFFFF);
    if (i0 < rbp) pv_bf16_columns(pp, rbp, vp, half_n, d, ot, i0, alpha, 0, 0x00FF);
}
#endif

typedef struct Args {
    const float *q;   /* the sequence's first token's row */
    int64_t q_stride; /* floats from one token's row of q to the next's (>= num_heads * d) */
    const void *k_cache, *v_cache;
    const float *k_scale, *v_scale; /* int8 caches only */
    int dtype;
    const int32_t *blocks;
    int block_size, ctx_len, q_len, num_heads, num_kv, d;
    float scale;
    const uint64_t *tail_words;
    int window;    /* 0: none */
    float softcap; /* 0: none */
    int key_lo;    /* the first key any row may see (key_start) */
    const uint32_t *vt_pre; /* the AMX build: V^T's pairs of every KT-key tile, made once (prepack_v), or NULL */
} Args;

static void mask_columns(const Args *a, int row0, int rows, int base, int n, int meets_window,
                         int meets_mask, float *st, int stride, int c0, int w);

/* The KT-key tiles [t KT, t KT + KT) that cover a sequence's context (prepack_v's per KV head). */
static inline int key_tiles(const Args *a) { return (a->ctx_len + KT - 1) / KT; }

#if defined(LONGCTX_AMX) && defined(HAVE_BF16_DOT)
#define HAVE_AMX 1
#include "amx_tiles.h"
/* bfloat16 pages on the AMX tiles (this file built with -DLONGCTX_AMX -mamx-tile -mamx-bf16,
 * where the CPU has AMX-BF16, kernels/cpu_flash.py): the two products of the vdpbf16ps forms
 * above with the same operands -- Q^T pairs (qp) against K's bfloat16 rows, P rounded to
 * bfloat16 (pp) against V's -- as 16 x 16 x 32 tile products, so only the order of the float32
 * sums differs (with QK_EXACT_EDGES, off by default, the first tile's and the diagonal tiles'
 * scores keep float32 q and the vector products, as in the vector build). Needs d % 32 == 0 and rbp % 16 == 0 (ROW_ALIGN). Tiles: C 0-3
 * the sums of up to four 16-row strips (S^T: 16 keys x 16 rows; O^T: 16 of d x 16 rows), A 4 (16
 * keys x 32 of d from K's rows, in the pages or gathered: amx_k_groups; 16 of d x 32 keys from
 * V^T), B 5-7 (16 pairs x 16 rows of qp or pp); in the 2 x 2 blocks of two 16-row strips (AMX_2X2), A 4-5 and B 6-7. Tile numbers
 * are immediates, hence the unrolled strips. */
/* B operands (16 pairs x 16 rows each, of Q^T's or P^T's pairs at b, rows bstride bytes apart)
 * against A in tile 4, into the C tiles of up to four 16-row strips */
#define AMX_STRIPS(bstride)                                                                       \
    do {                                                                                          \
        _tile_loadd(5, b, bstride); _tile_dpbf16ps(0, 4, 5);                                      \
        if (ns > 1) { _tile_loadd(6, b + 16, bstride); _tile_dpbf16ps(1, 4, 6); }                 \
        if (ns > 2) { _tile_loadd(7, b + 32, bstride); _tile_dpbf16ps(2, 4, 7); }                 \
        if (ns > 3) { _tile_loadd(5, b + 48, bstride); _tile_dpbf16ps(3, 4, 5); }                 \
    } while (0)
#define AMX_C(OP, base, stride)                                                                   \
    do {                                                                                          \
        OP(0, (base), (stride));                                                                  \
        if (ns > 1) OP(1, (base) + 16, (stride));                                                 \
        if (ns > 2) OP(2, (base) + 32, (stride));                                                 \
        if (ns > 3) OP(3, (base) + 48, (stride));                                                 \
    } while (0)
/* A 2 x 2 block of C tiles 0-3 += A rows (tiles 4, 5: at a0 and a1, astride bytes between rows)
 * times B (tiles 6, 7: two 16-row strips at b and b + 16, bstride bytes): four chains of sums
 * in flight, where one A against up to four strips (AMX_STRIPS) left one or two */
#define AMX_2X2(a0, a1, astride, b, bstride)                                                      \
    do {                                                                                          \
        _tile_loadd(4, a0, astride); _tile_loadd(5, a1, astride);                                  \
        _tile_loadd(6, b, bstride); _tile_loadd(7, (b) + 16, bstride);                             \
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);                                          \
        _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);                                          \
    } while (0)
/* C tiles 0-3 to or from rows c0 (tiles 0, 1: columns 0 and 16) and c1 (tiles 2, 3) */
#define AMX_2X2_C(OP, c0, c1, stride)                                                             \
    do {                                                                                          \
        OP(0, c0, stride); OP(1, (c0) + 16, stride); OP(2, c1, stride); OP(3, (c1) + 16, stride);  \
    } while (0)
#define TILE_LOAD(t, p, stride) _tile_loadd(t, p, stride)
#define TILE_STORE(t, p, stride) _tile_stored(t, p, stride)
#define TILE_ZERO(t, p, stride) _tile_zero(t)

int longctx_flash_amx_enable(void) { return amx_request_tiles(); }

/* Where the scores' A tiles (16 keys' K rows, bfloat16) of the tile's n keys are read, per group
 * of 16 keys (i = g / 16): kg[i] and kgs[i] (bytes between rows). A whole group whose rows lie one
 * cache row apart (row elements: every group inside one page, or pages that follow each other)
 * is read where it lies; another (the last group past n, or one over scattered pages) is
 * gathered into kb [n16][d] first, rows n..n16 zero. Reading the pages in place instead of
 * copying every key row: Intel Xeon (family 6 model 167), 2 threads, 2026-12-07, SmolLM2's
 * geometry over bfloat16 pages, builds alternating in one process, medians of 7: 8,000 keys in
 * 4,096-row chunks, 8 layers, 681 -> 652 ms; 2,048 keys, 30 layers, 181 -> 174 ms; the same
 * bits (a build that skipped the gather altogether, wrong numbers, bounded it: 676 -> 618). */
static void amx_k_groups(const uint16_t *k_cache, const int64_t *at, int n, int n16, int d, int64_t row,
                         uint16_t *kb, const uint16_t **kg, int *kgs) {
    for (int g = 0; g < n16; g += 16) {
        int direct = g + 16 <= n;
        for (int i = 1; i < 16 && direct; i++) direct = at[g + i] - at[g] == i * row;
        if (direct) {
            kg[g / 16] = k_cache + at[g];
            kgs[g / 16] = (int)(row * 2);
            continue;
        }
        uint16_t *dst = kb + (int64_t)g * d;
        const int have = n - g < 16 ? n - g : 16;
        for (int j = 0; j < have; j++) memcpy(dst + (int64_t)j * d, k_cache + at[g + j], sizeof(uint16_t) * (size_t)d);
        if (have < 16) memset(dst + (int64_t)have * d, 0, sizeof(uint16_t) * (size_t)(16 - have) * d);
        kg[g / 16] = dst;
        kgs[g / 16] = d * 2;
    }
}

/* V^T's pairs, operand A of P.V: vt[x][p] = (V[2p][x], V[2p + 1][x]) for the tile's n keys' V
 * rows (vrow), zero past them up to n32 keys, d a multiple of 16: each 16 pairs x 16 columns
 * made in registers (two rows widened and interleaved a pair) and turned by a 16 x 16 word
 * transpose. It had been two passes, pair_v_bf16 into a [n32 / 2][d] buffer and a transpose of
 * that: the same words. Intel Xeon (family 6 model 167), 2 threads, 2026-12-07, SmolLM2's
 * geometry over bfloat16 pages, builds alternating in one process, medians of 7: 8,000 keys in
 * 4,096-row chunks, 8 layers, 662 -> 626 ms; 2,048 keys, 30 layers, 174 -> 171 ms. */
static void amx_v_pairs_transposed(const uint16_t *const *vrow, int n, int n32, int d, const uint16_t *zero,
                                   uint32_t *vt) {
    for (int jb = 0; jb < n32 / 2; jb += 16)
        for (int xb = 0; xb < d; xb += 16) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) {
                const int j = 2 * (jb + i);
                const uint16_t *v0 = j < n ? vrow[j] : zero, *v1 = j + 1 < n ? vrow[j + 1] : zero;
                const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v0 + xb)));
                const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(v1 + xb)));
                r[i] = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
            }
            amx_transpose16(r);
            for (int i = 0; i < 16; i++) _mm512_storeu_si512(vt + (int64_t)(xb + i) * VT_STRIDE + jb, r[i]);
        }
}

#ifndef AMX_SW
#define AMX_SW 32 /* rows per strip group of amx_tile (a multiple of 16 dividing EXACT_ROWS, at most 64) */
#endif
_Static_assert(EXACT_ROWS % AMX_SW == 0 && AMX_SW % 16 == 0 && AMX_SW <= 64, "strip groups within EXACT_ROWS");

/* One key tile on the tiles, a strip group of AMX_SW rows at a time: its scores (K's 16-key
 * groups where amx_k_groups says, zero rows up to n16; for the groups in the EXACT_ROWS parts whose bit is set in exact_bits,
 * float32 q^T (qt) against K's rows as float32 (kf, n rounded up to 6 with zero rows) by the
 * vector products, as tile_scores computes them), the cap where cap > 0, the
 * window's and the causal or tree mask where the tile meets them (mask_columns), the
 * online-softmax step, P^T's bfloat16 pairs (zero past the keys, up to n32) and its part of O^T
 * (V^T's pairs in vt), each row through the same steps in the same order as tile_softmax and
 * pair_rows_bf16 take it over the whole block. Why strip groups (measured with KT 96, the key
 * tile before 2026-12-07; 192 keys now, a group's S^T 24 KB): the whole block's S^T (96
 * keys x 96 rows, 36 KB) left L1 between the passes over it (scores, max, exp, pairs, P.V), a
 * group's (96 x 32, 12 KB) stays, and a work item can then take more rows per K and V packing
 * (RB 192 in this build). Intel Xeon (family 6 model 207), 2 threads, one layer of SmolLM2's
 * geometry over bfloat16 pages, 8K keys in 2,048-token chunks (ad-hoc script, builds alternating
 * in one process, medians of 7-11; the machine's speed moved up to 1.3x between runs): the
 * whole-block form 187 / 197 / 219 ms, strip groups 178 / 192 / 208 ms, with RB 192 as well
 * 168 / 178 / 191 ms; against git 45b7b7c's build, 195 vs 222 ms with the same bits out.
 * Groups of 64 rows measured level with 32, of 16 rows 24% slower; RB 144
 * level with 96, 240 within 2% of 192; the exponentials written straight as pairs, level then (kept
 * since, with two keys rounded at once: tile_softmax_pairs). Not
 * kept: the edge tiles' scores on the tiles too, as two products (q's bfloat16 rounding and what
 * it left, q to within 2^-16): 220 -> 209 ms, but at bf16's level any change of the numbers
 * moved a bf16 model's tokens where they sat on a tie, and the real model's bf16 test, which
 * then asked for float32's tokens, parted from them at token 3 (its three-way tie, noted
 * above). Since QK_EXACT_EDGES went off (2026-12-06) every tile rounds q. */
static void amx_tile(const Args *a, int row0, int rows, int base, int meets_window, int meets_mask,
                     const uint32_t *qp, const float *qt, const float *const *kf, int exact_bits, int rbp,
                     const uint16_t *const *kg, const int *kgs, int n_tile, int n16_tile,
                     int n32_tile, int d, const uint32_t *vt, float *ot, float *m, float *l, float *alpha, float *sbuf,
                     float cap, float inv_cap) {
    const int group = a->num_heads / a->num_kv, first_new = a->ctx_len - a->q_len;
    for (int r0 = 0; r0 < rbp; r0 += AMX_SW) {
        const int w = rbp - r0 < AMX_SW ? rbp - r0 : AMX_SW, ns = w / 16;
        /* causal: the group's last row sees keys up to first_new + its token; the tile's keys after
         * that are masked for every row of the group, so the group's steps stop there (a group that
         * sees none of the tile skips it): keys all masked change no row's m, l or O^T, the same bits */
        int n = n_tile, n16 = n16_tile, n32 = n32_tile;
        if (meets_mask && !a->tail_words) {
            const int seen = first_new + (row0 + (r0 + w < rows ? r0 + w : rows) - 1) / group + 1 - base;
            if (seen <= 0) continue;
            if (seen < n) {
                n = seen;
                n16 = (n + 15) / 16 * 16;
                n32 = (n + 31) / 32 * 32;
            }
        }
        if ((exact_bits >> (r0 / EXACT_ROWS)) & 1) { /* float32 q and K (kf), the vector products */
            for (int k0 = 0; k0 < n; k0 += 6) {
                float *st = sbuf + (int64_t)k0 * w - r0;
                if (w == 32) qk_16(qt, rbp, kf + k0, d, st, w, r0);
                else qk_8(qt, rbp, kf + k0, d, st, w, r0);
            }
        } else {
            int g = 0;
            if (ns == 2) /* two key groups against the two strips: four chains of sums in flight */
                for (; g + 32 <= n16 && kgs[g / 16] == kgs[g / 16 + 1]; g += 32) {
                    AMX_2X2_C(TILE_ZERO, 0, 0, 0);
                    for (int c = 0; c < d / 32; c++)
                        AMX_2X2(kg[g / 16] + 32 * c, kg[g / 16 + 1] + 32 * c, kgs[g / 16],
                                qp + (int64_t)16 * c * rbp + r0, rbp * 4);
                    AMX_2X2_C(TILE_STORE, sbuf + (int64_t)g * w, sbuf + (int64_t)(g + 16) * w, w * 4);
                }
            for (; g < n16; g += 16) {
                AMX_C(TILE_ZERO, 0, 0);
                for (int c = 0; c < d / 32; c++) {
                    const uint32_t *b = qp + (int64_t)16 * c * rbp + r0;
                    _tile_loadd(4, kg[g / 16] + 32 * c, kgs[g / 16]);
                    AMX_STRIPS(rbp * 4);
                }
                AMX_C(TILE_STORE, sbuf + (int64_t)g * w, w * 4);
            }
        }
        if (cap > 0.0f)
            for (int j = 0; j < n; j++)
                for (int r = 0; r < w; r++) sbuf[(int64_t)j * w + r] = cap * tanhf(sbuf[(int64_t)j * w + r] * inv_cap);
        if (meets_window || meets_mask)
            mask_columns(a, row0, rows, base, n, meets_window, meets_mask, sbuf, w, r0, w);
        const int rescale = tile_softmax_pairs(sbuf, w, n, m + r0, l + r0, alpha + r0);
        for (int jp = (n + 1) / 2; jp < n32 / 2; jp++) memset((uint32_t *)sbuf + (int64_t)jp * w, 0, sizeof(uint32_t) * (size_t)w);
        if (rescale)
            for (int x = 0; x < d; x++)
                for (int i = 0; i < w; i += 16) {
                    float *o = ot + (int64_t)x * rbp + r0 + i;
                    _mm512_storeu_ps(o, _mm512_mul_ps(_mm512_loadu_ps(o), _mm512_loadu_ps(alpha + r0 + i)));
                }
        const uint32_t *pp = (const uint32_t *)sbuf;
        if (ns == 2) /* two column groups of O^T (d % 32 == 0) against the two strips */
            for (int xg = 0; xg < d; xg += 32) {
                float *c0 = ot + (int64_t)xg * rbp + r0, *c1 = c0 + (int64_t)16 * rbp;
                AMX_2X2_C(TILE_LOAD, c0, c1, rbp * 4);
                for (int kc = 0; kc < n32 / 32; kc++)
                    AMX_2X2(vt + (int64_t)xg * VT_STRIDE + 16 * kc, vt + (int64_t)(xg + 16) * VT_STRIDE + 16 * kc,
                            VT_STRIDE * 4, pp + (int64_t)16 * kc * w, w * 4);
                AMX_2X2_C(TILE_STORE, c0, c1, rbp * 4);
            }
        else
            for (int xg = 0; xg < d; xg += 16) {
                float *c0 = ot + (int64_t)xg * rbp + r0;
                AMX_C(TILE_LOAD, c0, rbp * 4);
                for (int kc = 0; kc < n32 / 32; kc++) {
                    const uint32_t *b = pp + (int64_t)16 * kc * w;
                    _tile_loadd(4, vt + (int64_t)xg * VT_STRIDE + 16 * kc, VT_STRIDE * 4);
                    AMX_STRIPS(w * 4);
                }
                AMX_C(TILE_STORE, c0, rbp * 4);
            }
    }
}
#endif
#if defined(LONGCTX_AMX) && !defined(HAVE_AMX)
/* an AMX build whose flags took the AVX-512 BF16 paths away (the tests' -mno-avx2): not used */
int longctx_flash_amx_enable(void) { return -2; }
#endif
#ifdef HAVE_AMX
#define ROW_ALIGN 16 /* a block's rows padded to whole 16-row strips (the tiles' columns) */
#else
#define ROW_ALIGN 8
#endif
/* A row block's rows as the scratch holds them: padded to whole ROW_ALIGN strips. */
static inline int padded_rows(int rows) { return (rows + ROW_ALIGN - 1) / ROW_ALIGN * ROW_ALIGN; }

/* The online-softmax step for one tile: S^T (n keys) becomes P^T = 2^(S - m_new) in place,
 * l and m are updated, and alpha[i] = 2^(m_old - m_new) is the factor O^T's row i is to be
 * rescaled by (tile_accumulate does it). Returns whether any alpha is not 1. Columns whose row
 * has seen nothing yet keep m = -inf and get P = 0. */
static int tile_softmax(float *st, int rbp, int n, float *m, float *l, float *alpha) {
#ifdef HAVE_AVX2
    int i = 0;
#ifdef HAVE_AVX512
    for (; i + 16 <= rbp; i += 16) softmax_16(st, rbp, n, i, m, l, alpha);
#endif
    for (; i < rbp; i += 8) softmax_8(st, rbp, n, i, m, l, alpha); /* rbp: a multiple of 8 */
#else
    for (int i = 0; i < rbp; i++) {
        float peak = m[i];
        for (int j = 0; j < n; j++) peak = st[(int64_t)j * rbp + i] > peak ? st[(int64_t)j * rbp + i] : peak;
        const float ref = peak == -INFINITY ? 0.0f : peak;
        alpha[i] = exp2_scalar(m[i] - ref);
        float sum = 0.0f;
        for (int j = 0; j < n; j++) {
            float *s = st + (int64_t)j * rbp + i;
            *s = exp2_scalar(*s - ref);
            sum += *s;
        }
        l[i] = l[i] * alpha[i] + sum;
        m[i] = peak;
    }
#endif
    int rescale = 0;
    for (int i = 0; i < rbp; i++) rescale |= alpha[i] != 1.0f;
    return rescale;
}

/* dst[0..d) = src[0..d) * scale (an int8 page row as float32). */
static inline void int8_row(const int8_t *src, int d, float scale, float *dst) {
    int x = 0;
#ifdef HAVE_AVX512
    const __m512 s16 = _mm512_set1_ps(scale);
    for (; x + 16 <= d; x += 16) {
        const __m512i w = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + x)));
        _mm512_storeu_ps(dst + x, _mm512_mul_ps(_mm512_cvtepi32_ps(w), s16));
    }
#endif
#ifdef HAVE_AVX2
    const __m256 s8 = _mm256_set1_ps(scale);
    for (; x + 8 <= d; x += 8) {
        const __m256i w = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(src + x)));
        _mm256_storeu_ps(dst + x, _mm256_mul_ps(_mm256_cvtepi32_ps(w), s8));
    }
#endif
    for (; x < d; x++) dst[x] = (float)src[x] * scale;
}

/* Element offsets in a cache [blocks][block_size][num_kv][d] of head kvh's rows of keys
 * [base, base + n). */
static void tile_offsets(const int32_t *blocks, int block_size, int base, int n, int num_kv, int kvh, int d,
                         int64_t *at) {
    int block = base / block_size, offset = base % block_size;
    for (int j = 0; j < n; j++) {
        at[j] = (((int64_t)blocks[block] * block_size + offset) * num_kv + kvh) * (int64_t)d;
        if (++offset == block_size) {
            offset = 0;
            block++;
        }
    }
}

/* Pointers to the K or V rows (head kvh) of keys [base, base + n): into the pages for float32,
 * else converted into buf (n * d floats); int8 (dtype 2) times scale[block, kvh]. */
static void tile_rows(const void *cache, int dtype, const float *scale, const int32_t *blocks,
                      int block_size, int base, int n, int num_kv, int kvh, int d, float *buf,
                      const float **rows) {
    int64_t at[KT];
    tile_offsets(blocks, block_size, base, n, num_kv, kvh, d, at);
    for (int j = 0; j < n; j++) {
        if (dtype == 0) {
            rows[j] = (const float *)cache + at[j];
        } else if (dtype == 2) {
            const int64_t block = blocks[(base + j) / block_size];
            int8_row((const int8_t *)cache + at[j], d, scale[block * num_kv + kvh], buf + (int64_t)j * d);
            rows[j] = buf + (int64_t)j * d;
        } else { /* bfloat16: the high half of a float32 */
            const uint16_t *src = (const uint16_t *)cache + at[j];
            uint32_t *dst = (uint32_t *)(buf + (int64_t)j * d);
            for (int x = 0; x < d; x++) dst[x] = (uint32_t)src[x] << 16;
            rows[j] = buf + (int64_t)j * d;
        }
    }
}

/* Ask for head kvh's K or V rows of keys [base, base + n) ahead of their use (into L2: a
 * tile's rows are read over the whole tile's compute). */
static void prefetch_tile(const void *cache, int elem, const int32_t *blocks, int block_size, int base,
                          int n, int num_kv, int kvh, int d) {
#ifdef HAVE_AVX2
    int block = base / block_size, offset = base % block_size;
    const int row_bytes = d * elem;
    for (int j = 0; j < n; j++) {
        const int64_t slot = (int64_t)blocks[block] * block_size + offset;
        const char *row = (const char *)cache + (slot * num_kv + kvh) * (int64_t)row_bytes;
        for (int b = 0; b < row_bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T1);
        if (++offset == block_size) {
            offset = 0;
            block++;
        }
    }
#else
    (void)cache; (void)elem; (void)blocks; (void)block_size; (void)base; (void)n; (void)num_kv;
    (void)kvh; (void)d;
#endif
}

/* Per-thread buffers, 64-byte aligned (a 16-row strip of Q^T, S^T or O^T is one cache line). */
typedef struct {
    float *qt, *st, *ot, *kbuf, *vbuf, *zero;
    uint32_t *qp; /* Q^T as bfloat16 pairs (bfloat16 pages' scores by vdpbf16ps) */
    float *kf; /* the AMX build's edge tiles: K's rows as float32 */
    uint32_t *vt; /* V^T as bfloat16 pairs, [d][VT_STRIDE] (the AMX build's P.V) */
    float m[RB], l[RB], alpha[RB];
    const float *krow[KT + 6], *vrow[KT];
    const uint16_t *vrow16[KT]; /* bfloat16 V rows for the vdpbf16ps P.V */
} Scratch;

/* The first key new token t may see under the window (a->window > 0). */
static inline int window_low(const Args *a, int t) {
    const int first_new = a->ctx_len - a->q_len;
    return first_new + (a->tail_words ? __builtin_popcountll(a->tail_words[t]) - 1 : t) - a->window + 1;
}

/* Whether key tile [base, base + n) holds keys some rows see not (mask_columns' meets_mask):
 * a key after the first row's token (first_token; with tree words any new key), or below the
 * highest window start of the rows (low, window > 0). */
static inline int tile_meets_mask(const Args *a, int base, int n, int first_token, int low) {
    return base + n > a->ctx_len - a->q_len + (a->tail_words ? 0 : first_token + 1) || (a->window > 0 && base < low);
}

/* -inf into S^T (row stride `stride`, column c = block row c0 + c, w columns) where a key of the
 * tile [base, base + n) is outside a row's window (meets_window) or its mask (meets_mask: causal
 * or tree words); the block's rows start at query row row0, and its rows past `rows` (padding)
 * are left alone. */
static void mask_columns(const Args *a, int row0, int rows, int base, int n, int meets_window, int meets_mask,
                         float *st, int stride, int c0, int w) {
    const int group = a->num_heads / a->num_kv, first_new = a->ctx_len - a->q_len;
    const int end = c0 + w < rows ? c0 + w : rows;
    int tok[RB]; /* the rows' tokens, found once (a division each) */
    for (int r = c0; r < end; r++) tok[r - c0] = (row0 + r) / group;
    if (meets_window)
        for (int r = c0; r < end; r++) {
            const int low = window_low(a, tok[r - c0]);
            for (int j = 0; j < n && base + j < low; j++) st[(int64_t)j * stride + r - c0] = -INFINITY;
        }
    if (meets_mask)
        for (int j = 0; j < n; j++) {
            const int key = base + j, rel = key - first_new;
            if (rel < 0) continue;
            float *col = st + (int64_t)j * stride;
            if (a->tail_words) {
                for (int r = 0; r < end - c0; r++)
                    if (!((a->tail_words[tok[r]] >> rel) & 1u)) col[r] = -INFINITY;
            } else
                for (int r = 0; r < end - c0; r++)
                    if (rel > tok[r]) col[r] = -INFINITY;
        }
}

/* Whether bfloat16 pages take the vdpbf16ps products (q and p rounded to bfloat16; where the
 * build has them) or are widened to float32 as a tile's rows are fetched, for the float32
 * products (the int8 pages' way; q and p stay float32). Set for the process by
 * longctx_flash_set_bf16_dot (kernels/cpu_tune.py measures which is faster at first use): on an
 * Intel Xeon (family 6 model 207) whose VM passes no AMX, vdpbf16ps ran one layer's attention of
 * the default model's second 4K chunk of an 8K prompt in 378 ms, widened 275 ms (best of 11,
 * 2 threads; docs/kernels.md). */
static int bf16_dot = 1;

/* Returns whether this build has the vdpbf16ps products (the setting then applies). */
int longctx_flash_set_bf16_dot(int on) {
    bf16_dot = on != 0;
#ifdef HAVE_BF16_DOT
    return 1;
#else
    return 0;
#endif
}

/* 1 where bfloat16 pages run by vdpbf16ps now (the build has it and the setting is on), else 0. */
int longctx_flash_bf16_dot(void) {
#ifdef HAVE_BF16_DOT
    return bf16_dot;
#else
    return 0;
#endif
}

/* One work item: rows [r0, r1) of KV head kvh against keys [k0, k1). Leaves the block's
 * running max (log2 units), sum and unnormalised O^T in s. */
static void attend_item(const Args *a, int kvh, int r0, int r1, int k0, int k1, Scratch *s) {
    const int group = a->num_heads / a->num_kv;
    const int rows = r1 - r0, rbp = padded_rows(rows);
    const int d = a->d, first_new = a->ctx_len - a->q_len;
    const float qscale = a->scale * 1.44269504088896341f;
#ifdef HAVE_BF16_DOT
    const int pairs = a->dtype == 1 && bf16_dot; /* bfloat16 pages: P.V by vdpbf16ps */
#else
    const int pairs = 0;
#endif
    /* Q^T, row by row: row r0 + r is token (r0 + r) / group's query head kvh * group + (r0 + r) % group */
    for (int r = 0; r < rbp; r++) {
        float *dst = s->qt + r;
        if (r < rows) {
            const int row = r0 + r;
            const float *src = a->q + (int64_t)(row / group) * a->q_stride + (int64_t)(kvh * group + row % group) * d;
            for (int x = 0; x < d; x++) dst[(int64_t)x * rbp] = src[x] * qscale;
        } else
            for (int x = 0; x < d; x++) dst[(int64_t)x * rbp] = 0.0f;
    }
#ifdef HAVE_BF16_DOT
    const int qpairs = pairs && d % 2 == 0 && QK_BF16; /* scores by vdpbf16ps: Q^T pairs in qp */
    if (qpairs) pair_rows_bf16(s->qt, rbp, d, s->qp);
#else
    const int qpairs = 0;
#endif
#ifdef HAVE_AMX
    const int amx = qpairs && d % 32 == 0; /* both products on the tiles */
#endif
    memset(s->ot, 0, sizeof(float) * (size_t)d * rbp);
    for (int r = 0; r < rbp; r++) {
        s->m[r] = -INFINITY;
        s->l[r] = 0.0f;
    }
    /* causal: the block's last row sees up to key first_new + its token */
    const int t_first = r0 / group, t_last = (r1 - 1) / group;
    int end = k1;
    if (!a->tail_words && first_new + t_last + 1 < end) end = first_new + t_last + 1;
    /* window: the rows' first visible keys; tiles before the lowest are skipped, tiles before
     * the highest are masked */
    int begin = k0, low_min = 0, low_max = 0;
    if (a->window > 0) {
        low_min = INT32_MAX;
        for (int t = t_first; t <= t_last; t++) {
            const int low = window_low(a, t);
            low_min = low < low_min ? low : low_min;
            low_max = low > low_max ? low : low_max;
        }
        if (low_min > begin) begin = low_min;
    }
    const float cap = a->softcap * 1.44269504088896341f, inv_cap = a->softcap > 0.0f ? 1.0f / cap : 0.0f;
#ifdef HAVE_AMX
    /* the block's EXACT_ROWS parts: their first tokens and highest window starts (the edges) */
    int part_first[RB / EXACT_ROWS + 1], part_low[RB / EXACT_ROWS + 1];
    const int parts = (rows + EXACT_ROWS - 1) / EXACT_ROWS;
    for (int h = 0; h < parts; h++) {
        const int first = r0 + h * EXACT_ROWS, last = (first + EXACT_ROWS < r1 ? first + EXACT_ROWS : r1) - 1;
        part_first[h] = first / group;
        part_low[h] = 0;
        if (a->window > 0)
            for (int t = first / group; t <= last / group; t++) {
                const int low = window_low(a, t);
                part_low[h] = low > part_low[h] ? low : part_low[h];
            }
    }
#endif
    for (int base = begin; base < end; base += KT) {
        const int n = end - base < KT ? end - base : KT;
        if (base + n < end) {
            const int next = end - base - n < KT ? end - base - n : KT;
            const int elem = a->dtype == 0 ? 4 : a->dtype == 1 ? 2 : 1;
            prefetch_tile(a->k_cache, elem, a->blocks, a->block_size, base + n, next, a->num_kv, kvh, d);
            prefetch_tile(a->v_cache, elem, a->blocks, a->block_size, base + n, next, a->num_kv, kvh, d);
        }
        const int meets_window = a->window > 0 && base < low_max;
        const int meets_mask = tile_meets_mask(a, base, n, t_first, low_max);
        int64_t at[KT]; /* bf16 pages: the tile's row offsets, for its K and V rows alike */
        if (pairs) tile_offsets(a->blocks, a->block_size, base, n, a->num_kv, kvh, d, at);
        /* QK_EXACT_EDGES only: fp32 q in the first tile and the tiles with keys the block's rows may not all see */
        const int exact_edge = QK_EXACT_EDGES && (base < KT || meets_mask);
#ifdef HAVE_AMX
        if (amx) { /* the whole tile, a strip group at a time */
            const int n16 = (n + 15) / 16 * 16, n32 = (n + 31) / 32 * 32;
            const uint16_t *kg[KT / 16 + 1];
            int kgs[KT / 16 + 1];
            amx_k_groups((const uint16_t *)a->k_cache, at, n, n16, d, (int64_t)a->num_kv * d, (uint16_t *)s->kbuf,
                         kg, kgs);
            const uint32_t *vt = s->vt;
            if (a->vt_pre && base % KT == 0) /* made once for the step (prepack_v) */
                vt = a->vt_pre + ((int64_t)kvh * key_tiles(a) + base / KT) * d * VT_STRIDE;
            else {
                for (int j = 0; j < n; j++) s->vrow16[j] = (const uint16_t *)a->v_cache + at[j];
                amx_v_pairs_transposed(s->vrow16, n, n32, d, (const uint16_t *)s->zero, s->vt);
            }
            int exact_bits = 0; /* exact_edge, per EXACT_ROWS part of the block */
            for (int h = 0; h < parts && QK_EXACT_EDGES; h++)
                if (base < KT || tile_meets_mask(a, base, n, part_first[h], part_low[h])) exact_bits |= 1 << h;
            if (exact_bits) {
                tile_rows(a->k_cache, a->dtype, a->k_scale, a->blocks, a->block_size, base, n, a->num_kv, kvh, d,
                          s->kf, s->krow);
                for (int j = n; j < (n + 5) / 6 * 6; j++) s->krow[j] = s->zero;
            }
            amx_tile(a, r0, rows, base, meets_window, meets_mask, s->qp, s->qt, s->krow, exact_bits,
                     rbp, kg, kgs, n, n16, n32, d, vt, s->ot, s->m, s->l, s->alpha, s->st,
                     a->softcap > 0.0f ? cap : 0.0f, inv_cap);
            continue;
        }
#endif
        if (qpairs && !exact_edge) {
#ifdef HAVE_BF16_DOT
            const uint16_t *krow16[KT + 6];
            for (int j = 0; j < n; j++) krow16[j] = (const uint16_t *)a->k_cache + at[j];
            for (int j = n; j < (n + 5) / 6 * 6; j++) krow16[j] = (const uint16_t *)s->zero;
            tile_scores_bf16(s->qp, rbp, krow16, n, d, s->st);
#endif
        } else {
            tile_rows(a->k_cache, a->dtype, a->k_scale, a->blocks, a->block_size, base, n, a->num_kv, kvh, d,
                      s->kbuf, s->krow);
            for (int j = n; j < (n + 5) / 6 * 6 || j < (n + QK_KEYS - 1) / QK_KEYS * QK_KEYS; j++) s->krow[j] = s->zero;
            tile_scores(s->qt, rbp, s->krow, n, d, s->st);
        }
        if (a->softcap > 0.0f) /* in log2 units: cap = softcap * log2 e */
            for (int j = 0; j < n; j++) {
                float *col = s->st + (int64_t)j * rbp;
                for (int r = 0; r < rbp; r++) col[r] = cap * tanhf(col[r] * inv_cap);
            }
        if (meets_window || meets_mask)
            mask_columns(a, r0, rows, base, n, meets_window, meets_mask, s->st, rbp, 0, rbp);
#ifdef HAVE_BF16_DOT
        const int rescale = pairs ? tile_softmax_pairs(s->st, rbp, n, s->m, s->l, s->alpha)
                                  : tile_softmax(s->st, rbp, n, s->m, s->l, s->alpha);
#else
        const int rescale = tile_softmax(s->st, rbp, n, s->m, s->l, s->alpha);
#endif
        if (pairs) {
#ifdef HAVE_BF16_DOT
            for (int j = 0; j < n; j++) s->vrow16[j] = (const uint16_t *)a->v_cache + at[j];
            pair_v_bf16(s->vrow16, n, d, (const uint16_t *)s->zero, (uint32_t *)s->vbuf);
            tile_accumulate_bf16((const uint32_t *)s->st, rbp, (const uint32_t *)s->vbuf, n, d, s->ot,
                                 rescale ? s->alpha : NULL);
#endif
        } else {
            tile_rows(a->v_cache, a->dtype, a->v_scale, a->blocks, a->block_size, base, n, a->num_kv, kvh, d,
                      s->vbuf, s->vrow);
            tile_accumulate(s->st, rbp, s->vrow, n, d, s->ot, rescale ? s->alpha : NULL);
        }
    }
}

/* Floats of one thread's scratch, a multiple of 16 so that every thread's part stays aligned. */
static size_t scratch_floats(int d) {
    const size_t floats = (size_t)d * RB * 2 + (size_t)KT * RB + (size_t)KT * d * 2 + (size_t)d
                          + (size_t)(d + 1) / 2 * RB + (size_t)d * VT_STRIDE + (size_t)KT * d;
    return (floats + 15) / 16 * 16;
}

/* Lay one thread's scratch out in base (scratch_floats(d) floats, 64-byte aligned). */
static void scratch_init(Scratch *s, float *base, int d) {
    s->qt = base;
    s->ot = s->qt + (size_t)d * RB;
    s->st = s->ot + (size_t)d * RB;
    s->kbuf = s->st + (size_t)KT * RB;
    s->vbuf = s->kbuf + (size_t)KT * d;
    s->zero = s->vbuf + (size_t)KT * d;
    memset(s->zero, 0, sizeof(float) * (size_t)d);
    s->qp = (uint32_t *)(s->zero + d);
    s->vt = s->qp + (size_t)(d + 1) / 2 * RB;
    s->kf = (float *)(s->vt + (size_t)d * VT_STRIDE);
}

#ifdef HAVE_AMX
/* V^T's pairs (amx_v_pairs_transposed's operand) of every KT-key tile [t KT, t KT + KT) of the
 * sequences whose work items all start their keys at 0 and take P.V on the tiles (bfloat16 pages,
 * d % 32 == 0, no KV splits, no window) and span two row blocks or more, made once for the call
 * into one buffer ([num_kv][tiles][d][VT_STRIDE] words a sequence, args[i].vt_pre), where each
 * work item had made its tiles' own (the row blocks of a 2K chunk repacked every key ~16 times
 * between them). A tile's words for keys past the context are zero; a work item whose causal
 * end cuts a tile reads its first keys' words only, and past its own keys (up to the next 32) it
 * multiplies V's real rows by P's zero pairs: the same sums (a key it cannot see whose V holds
 * Inf or NaN would now reach it as 0 * Inf). Returns the buffer to free (NULL: none made, or
 * more than PREPACK_MAX_BYTES; every work item then packs its own). */
#ifndef PREPACK_MAX_BYTES
#define PREPACK_MAX_BYTES ((int64_t)64 << 20)
#endif
/* Whether prepack_v packs sequence a's tiles (its KV splits: `splits`). */
static inline int prepacks(const Args *a, int splits, int group) {
    return a->dtype == 1 && a->d % 32 == 0 && QK_BF16 && splits == 1 && a->window == 0 && a->key_lo == 0
           && (a->q_len * group + RB - 1) / RB >= 2;
}

static uint32_t *prepack_v(Args *args, const int32_t *splits, int num_seqs, int group, int threads) {
    static const uint16_t zero[MAX_D];
    int64_t words = 0;
    for (int i = 0; i < num_seqs; i++)
        if (prepacks(&args[i], splits[i], group))
            words += (int64_t)args[i].num_kv * key_tiles(&args[i]) * args[i].d * VT_STRIDE;
    /* a call's packed V is one layer's V of its long sequences again (bfloat16 pairs): above
     * PREPACK_MAX_BYTES (a very long context's chunk) every work item packs its own instead */
    if (words > PREPACK_MAX_BYTES / (int64_t)sizeof(uint32_t)) return NULL;
    uint32_t *pool = words > 0 ? aligned_alloc(64, sizeof(uint32_t) * (size_t)((words + 15) / 16 * 16)) : NULL;
    if (!pool) return NULL;
    int64_t at = 0;
    int jobs = 0;
    for (int i = 0; i < num_seqs; i++) {
        Args *a = &args[i];
        if (!prepacks(a, splits[i], group)) continue;
        a->vt_pre = pool + at;
        at += (int64_t)a->num_kv * key_tiles(a) * a->d * VT_STRIDE;
        jobs += a->num_kv * key_tiles(a);
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int job = 0; job < jobs; job++) {
        int i = 0, first = 0; /* the job's sequence, KV head and tile */
        for (;; i++) {
            const Args *a = &args[i];
            if (!a->vt_pre) continue;
            const int here = a->num_kv * key_tiles(a);
            if (job < first + here) break;
            first += here;
        }
        const Args *a = &args[i];
        const int tiles = key_tiles(a), kvh = (job - first) / tiles, t = (job - first) % tiles;
        const int base = t * KT, n = a->ctx_len - base < KT ? a->ctx_len - base : KT, d = a->d;
        int64_t offsets[KT];
        const uint16_t *vrow[KT];
        tile_offsets(a->blocks, a->block_size, base, n, a->num_kv, kvh, d, offsets);
        for (int j = 0; j < n; j++) vrow[j] = (const uint16_t *)a->v_cache + offsets[j];
        uint32_t *vt = a->vt_pre + ((int64_t)kvh * tiles + t) * d * VT_STRIDE;
        amx_v_pairs_transposed(vrow, n, KT32, d, zero, vt);
    }
    return pool;
}
#endif

/* Query rows per work item in this build (kernels/cpu_flash.py counts work items with it). */
int longctx_flash_row_block(void) { return RB; }

/* out_rounded (longctx_paged_flash_batch's optional output): each row of the result, o = O^T's
 * column times 1 / l in float32 as `out` gets it, rounded to bfloat16 (vcvtneps2bf16: to nearest
 * even, subnormals to zero) into the A-tile order of the AMX products' rounded x (linear_amx.c's
 * round_rows: [Mp / 16][K / 32][16 rows][32 k], K = num_heads * d, the padding rows past the
 * step's tokens zero): the o projection's input as it would round `out`, the same bits, without
 * `out` written in float32 and read back. Needs AVX-512 BF16 and d a multiple of 16. */
static inline int rounds_out(int num_heads, int d) {
#if defined(HAVE_AVX512) && defined(__AVX512BF16__)
    return d % 16 == 0 && (num_heads * d) % 32 == 0;
#else
    (void)num_heads;
    (void)d;
    return 0;
#endif
}

/* Row m of out_rounded, columns [k0, k0 + d): ot[x * rbp] * inv for x < d (kblocks = K / 32). */
static void round_out_row(const float *ot, int rbp, int d, float inv, int m, int k0, int kblocks, uint16_t *xb) {
#if defined(HAVE_AVX512) && defined(__AVX512BF16__)
    float row[16] __attribute__((aligned(64)));
    for (int x0 = 0; x0 < d; x0 += 16) {
        for (int x = 0; x < 16; x++) row[x] = ot[(int64_t)(x0 + x) * rbp] * inv;
        const int k = k0 + x0;
        uint16_t *dst = xb + ((int64_t)(m / 16) * kblocks + k / 32) * 512 + (m % 16) * 32 + k % 32;
        _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(row)));
    }
#else
    (void)ot, (void)rbp, (void)d, (void)inv, (void)m, (void)k0, (void)kblocks, (void)xb;
#endif
}

/* 1 where this build writes out_rounded (rounds_out's build condition), else 0. */
int longctx_flash_rounds_out(void) { return rounds_out(1, 32); }

/* A varlen batch in one call: the sequences seqs[0..num_seqs) of a step whose query rows are
 * q[cu_q[s] .. cu_q[s + 1]), whose pages are block_table[s * table_stride ..] (ctx_lens[s]
 * tokens) and whose keys are cut into splits[i] KV splits. Every (sequence, KV head, row block,
 * split) is one work item, shared out over `threads` OpenMP threads (the caller passes torch's
 * count); split sequences are merged at the end. words: per query row of the whole step
 * (indexed like q's rows), bit j lets the row see new token j of its sequence; NULL: causal
 * among each sequence's new tokens. q's token rows are q_stride floats apart (>= H * D; a view
 * of a wider [T, (H + 2 Hkv) D] projection needs no copy), each row's heads D apart. out [T, H, D]
 * / lse [T, H] rows of the chosen sequences are written, others are left alone; with out_rounded
 * (not NULL: every sequence of the step here, none split) the rows go there instead of to out
 * (round_out_row; [T rounded up to 16, H * D] bfloat16).
 *
 * Returns 0, or a negative code for arguments this kernel does not take (the caller checks them
 * first; this is a second line; -4: out of memory; -5: a sequence outside the table, q or the
 * cache, see batch_seq_ok; -6: out_rounded where this build or head layout cannot write it, a
 * split sequence, or sequences that leave some of q's rows out). dtype: 0 float32, 1 bfloat16, 2 int8 (k_scale and v_scale then
 * required, else ignored). */
int longctx_paged_flash_batch(const float *q, const void *k_cache, const void *v_cache,
                              const float *k_scale, const float *v_scale, int dtype,
                              const int32_t *block_table, int table_rows, int64_t table_stride,
                              int num_blocks, const int32_t *ctx_lens, const int32_t *cu_q,
                              int total_q, const int32_t *seqs,
                              const int32_t *splits, int64_t q_stride, int num_seqs, int block_size, int num_heads,
                              int num_kv, int d, float scale, const uint64_t *words, int window, float softcap,
                              int threads, float *out, float *lse, uint16_t *out_rounded) {
    if (dtype != 0 && dtype != 1 && dtype != 2) return -1;
    if (out_rounded && !rounds_out(num_heads, d)) return -6;
    if (dtype == 2 && (!k_scale || !v_scale)) return -1;
    if (num_kv <= 0 || num_heads % num_kv != 0 || d < 1 || d > MAX_D) return -2;
    if (block_size < 1 || threads < 1 || num_seqs < 0 || window < 0 || softcap < 0.0f) return -3;
    if (q_stride < (int64_t)num_heads * d) return -2;
    if (num_seqs == 0) return 0;
    const int group = num_heads / num_kv;
    /* per sequence: its arguments, where its split states start, and its first item */
    Args *args = malloc(sizeof(Args) * (size_t)num_seqs);
    int64_t *state_at = malloc(sizeof(int64_t) * (size_t)num_seqs);
    int *first_item = malloc(sizeof(int) * ((size_t)num_seqs + 1));
    const size_t per_thread = scratch_floats(d);
    float *pool = aligned_alloc(64, per_thread * (size_t)threads * sizeof(float));
    float *work = NULL;
    int rc = (!args || !state_at || !first_item || !pool) ? -4 : 0;
    int64_t floats = 0;
    if (rc == 0) first_item[0] = 0;
    for (int i = 0; rc == 0 && i < num_seqs; i++) {
        if (!batch_seq_ok(seqs[i], table_rows, block_table, table_stride, num_blocks, block_size, ctx_lens, cu_q,
                          total_q)) {
            rc = -5;
            break;
        }
        const int s = seqs[i], q_len = cu_q[s + 1] - cu_q[s], ctx_len = ctx_lens[s];
        if (q_len < 1 || ctx_len < q_len || splits[i] < 1 || (words && q_len > 63)) {
            rc = -3;
            break;
        }
        if (out_rounded && splits[i] != 1) { /* (a split row's result comes from the merge, in float32) */
            rc = -6;
            break;
        }
        const Args one = {q + (int64_t)cu_q[s] * q_stride, q_stride, k_cache, v_cache, k_scale, v_scale, dtype,
                          block_table + (int64_t)s * table_stride, block_size, ctx_len, q_len, num_heads,
                          num_kv, d, scale, words ? words + cu_q[s] : NULL, window, softcap,
                          key_start(ctx_len, q_len, window), NULL};
        args[i] = one;
        const int num_rb = (q_len * group + RB - 1) / RB;
        state_at[i] = floats;
        if (splits[i] > 1) floats += (int64_t)splits[i] * num_kv * q_len * group * (d + 2);
        first_item[i + 1] = first_item[i] + num_kv * num_rb * splits[i];
    }
    if (rc == 0 && out_rounded) { /* every row of q here: out_rounded's rows are all written */
        int64_t covered = 0;
        for (int i = 0; i < num_seqs; i++) covered += cu_q[seqs[i] + 1] - cu_q[seqs[i]];
        if (covered != total_q) rc = -6;
    }
    if (rc == 0 && floats > 0 && !(work = malloc(sizeof(float) * (size_t)floats))) rc = -4;
    if (rc != 0) {
        free(args);
        free(state_at);
        free(first_item);
        free(pool);
        return rc;
    }
    const int items = first_item[num_seqs];
    const float ln2 = 0.693147180559945309f;
#ifdef HAVE_AMX
    uint32_t *vt_pool = prepack_v(args, splits, num_seqs, group, threads);
#endif

#pragma omp parallel num_threads(threads)
    {
        Scratch sc;
#ifdef _OPENMP
        scratch_init(&sc, pool + per_thread * (size_t)omp_get_thread_num(), d);
#else
        scratch_init(&sc, pool, d);
#endif
#ifdef HAVE_AMX
        if (dtype == 1) amx_load_config();
#endif
        /* row blocks last to first: under the causal mask the last ones have the most keys */
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; item++) {
            int i = 0, hi = num_seqs - 1; /* the sequence: the last one whose first item <= item */
            while (i < hi) {
                const int mid = (i + hi + 1) / 2;
                if (first_item[mid] <= item) i = mid; else hi = mid - 1;
            }
            const Args *a = &args[i];
            const int num_splits = splits[i], rows = a->q_len * group, ctx_len = a->ctx_len;
            const int num_rb = (rows + RB - 1) / RB, local = item - first_item[i];
            const int split = local % num_splits;
            const int rb = num_rb - 1 - (local / num_splits) % num_rb;
            const int kvh = local / (num_splits * num_rb);
            const int split_len = (ctx_len - a->key_lo + num_splits - 1) / num_splits;
            const int r0 = rb * RB, r1 = r0 + RB < rows ? r0 + RB : rows;
            const int k0 = a->key_lo + split * split_len;
            const int k1 = k0 + split_len < ctx_len ? k0 + split_len : ctx_len;
            attend_item(a, kvh, r0, r1, k0, k1, &sc);
            const int rbp = padded_rows(r1 - r0), all_rows = num_kv * rows;
            float *o_seq = out + (int64_t)cu_q[seqs[i]] * num_heads * d;
            float *lse_seq = lse + (int64_t)cu_q[seqs[i]] * num_heads;
            for (int r = 0; r < r1 - r0; r++) {
                const int row = r0 + r, t = row / group, hq = kvh * group + row % group;
                if (num_splits == 1) {
                    const float total = sc.l[r];
                    const float inv = total > 0.0f ? 1.0f / total : 0.0f;
                    if (out_rounded) /* the row as the o projection's tiles take it */
                        round_out_row(sc.ot + r, rbp, d, inv, cu_q[seqs[i]] + t, hq * d, num_heads * d / 32,
                                      out_rounded);
                    else {
                        float *o = o_seq + ((int64_t)t * num_heads + hq) * d;
                        for (int x = 0; x < d; x++) o[x] = sc.ot[(int64_t)x * rbp + r] * inv;
                    }
                    lse_seq[t * num_heads + hq] = total > 0.0f ? (sc.m[r] + log2f(total)) * ln2 : -INFINITY;
                } else { /* partial state: m, l, unnormalised row */
                    float *state = work + state_at[i] + (int64_t)split * all_rows * (d + 2);
                    const int at = kvh * rows + row;
                    state[at] = sc.m[r];
                    state[all_rows + at] = sc.l[r];
                    float *acc = state + 2 * all_rows + (int64_t)at * d;
                    for (int x = 0; x < d; x++) acc[x] = sc.ot[(int64_t)x * rbp + r];
                }
            }
        }
#ifdef HAVE_AMX
        if (dtype == 1) _tile_release();
#endif
    }
    if (out_rounded) /* the padding rows of the last 16-row tile: zero, as the products' rounding leaves them */
        for (int m = total_q; m < (total_q + 15) / 16 * 16; m++)
            for (int kb = 0; kb < num_heads * d / 32; kb++)
                memset(out_rounded + ((int64_t)(m / 16) * (num_heads * d / 32) + kb) * 512 + (m % 16) * 32, 0, 64);
    for (int i = 0; i < num_seqs; i++) {
        if (splits[i] == 1) continue;
        const int s = seqs[i], rows = (cu_q[s + 1] - cu_q[s]) * group;
        merge_splits(work + state_at[i], splits[i], (int64_t)num_kv * rows * (d + 2), num_kv * rows, rows, group,
                     num_heads, d, 1, out + (int64_t)cu_q[s] * num_heads * d, lse + (int64_t)cu_q[s] * num_heads,
                     threads);
    }
    free(work);
#ifdef HAVE_AMX
    free(vt_pool);
#endif
    free(args);
    free(state_at);
    free(first_item);
    free(pool);
    return 0;
}
