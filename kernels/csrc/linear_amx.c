/* bfloat16 weight products on AMX tiles: y[M, N] = x[M, K] @ w[N, K]^T for float32 x and y and a
 * bfloat16 w in the checkpoint's [out, in] layout (the row kernel's), for the long steps
 * (prefill chunks) of a bfloat16 model on CPUs with AMX-BF16 (Intel Sapphire Rapids and later).
 *
 * Numerics: the row kernel's bf16 panel path's (linear_rows.c, from 17 rows): x's rows rounded
 * to bfloat16 once per call, or once for several products over that x (longctx_amx_round_scaled, with
 * an RMSNorm's two products folded in) (vcvtneps2bf16: round to
 * nearest even, subnormals to zero), pairs of bfloat16 multiplied exactly and summed in float32
 * (tdpbf16ps), y float32. Only the order of the float32 sums differs. Two prologues are made in
 * the rounding pass with the kernel's own arithmetic (not torch's bits): an RMSNorm's statistics
 * (longctx_amx_round_rms) and SwiGLU / GELU's gated product (longctx_amx_round_gated).
 *
 * Tiles (8 of 16 rows x 64 bytes): 0-3 the float32 sums of a 32 x 32 block of y (C[mi][ni] =
 * tile 2 mi + ni), 4-5 two 16-row blocks of x (A: 16 rows of 32 bfloat16 k, each tile 1 KB
 * contiguous in the rounded copy of x: round_rows), 6-7 two 16-column blocks of w in pairs along K (B: row r holds
 * (w[n][k0 + 2r], w[n][k0 + 2r + 1]) for the 16 columns n, one 32-bit word each). Each thread
 * takes a slice of up to 256 columns, packs it for all of K once (at most ~1 MB: in L2) and runs
 * every block of 32 rows of x over each 32 columns of it, so w is read once per call and x once
 * per slice (a slice of 32 columns re-read x from L3 8 times as often).
 * Needs K % 32 == 0 and N % 16 == 0 (the caller checks; every model dimension here is a
 * multiple of 64); M is any (x is padded to 16 rows inside).
 *
 * Linux grants a process the AMX tile state only on request: longctx_amx_enable() asks once
 * (amx_tiles.h). */

#define _GNU_SOURCE
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx_tiles.h"
#define HAVE_AVX2 1
#include "prologue.h"

/* 0 when this process may use the AMX tiles, else -1. */
int longctx_amx_enable(void) { return amx_request_tiles(); }

/* x [M, K] float32 (row stride ldx; times row_scale[m], then col_scale[k] times that, where not
 * NULL) -> xb, bfloat16 in A tiles: xb[Mp / 16][K / 32][16 r][32 k]
 * (each tile 1 KB, contiguous), rows M..Mp-1 zero. Rows K * 2 bytes apart, as x's own rows
 * are, put a tile's 16 rows in one L1 set whenever K * 2 is a multiple of 4 KB (K = 2,048,
 * 8,192: the 1B model's): 16 lines in a 12-way set, missed at every load. */
static void round_rows(const float *x, int64_t ldx, int M, int Mp, int K, const float *row_scale,
                       const float *col_scale, float rms_eps, uint16_t *xb, int threads) {
    const int kblocks = K / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int m = 0; m < Mp; m++) {
        uint16_t *dst = xb + ((int64_t)(m / 16) * kblocks * 16 + (m % 16)) * 32;  /* row m of its kb = 0 tile */
        if (m >= M) {
            for (int kb = 0; kb < kblocks; kb++) memset(dst + (int64_t)kb * 512, 0, 64);
            continue;
        }
        const float *xr = x + (int64_t)m * ldx;
        float scale = row_scale ? row_scale[m] : 1.0f;
        if (rms_eps >= 0.0f) { /* RMSNorm's 1 / sqrt(mean(x^2) + eps), the row read twice (from L1) */
            __m512 ss0 = _mm512_setzero_ps(), ss1 = _mm512_setzero_ps();
            for (int kb = 0; kb < kblocks; kb++) {
                const __m512 a = _mm512_loadu_ps(xr + 32 * kb), b = _mm512_loadu_ps(xr + 32 * kb + 16);
                ss0 = _mm512_fmadd_ps(a, a, ss0);
                ss1 = _mm512_fmadd_ps(b, b, ss1);
            }
            scale = 1.0f / sqrtf(_mm512_reduce_add_ps(_mm512_add_ps(ss0, ss1)) / (float)K + rms_eps);
        }
        const int scaled = row_scale != NULL || rms_eps >= 0.0f;
        const __m512 r = _mm512_set1_ps(scale);
        for (int kb = 0; kb < kblocks; kb++) {
            __m512 lo = _mm512_loadu_ps(xr + 32 * kb), hi = _mm512_loadu_ps(xr + 32 * kb + 16);
            if (scaled) { /* x * r, then w * (x * r): RMSNorm's two products, each rounded as torch rounds it */
                lo = _mm512_mul_ps(lo, r);
                hi = _mm512_mul_ps(hi, r);
            }
            if (col_scale) {
                lo = _mm512_mul_ps(_mm512_loadu_ps(col_scale + 32 * kb), lo);
                hi = _mm512_mul_ps(_mm512_loadu_ps(col_scale + 32 * kb + 16), hi);
            }
            _mm512_storeu_si512((__m512i *)(dst + (int64_t)kb * 512), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

/* xb's columns [c0, c0 + w) (xb as round_rows writes it, [Mp, K]; c0 and w multiples of 32) <-
 * act(gate) * up (gated_vec16) for x's M rows, gate and up [M, w] float32 with row stride ld;
 * rows M..Mp-1 zero there. The MLP's SwiGLU (or GELU) product made in the pass that rounds it
 * for the down projection's tiles: gate and up are read once, and no [M, w] float32 result is
 * written and read back. */
static void round_gated_rows(const float *gate, const float *up, int64_t ld, int M, int Mp, int K, int c0, int w,
                             int act, uint16_t *xb, int threads) {
    const int kblocks = K / 32, kb0 = c0 / 32, kb1 = (c0 + w) / 32;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int m = 0; m < Mp; m++) {
        uint16_t *dst = xb + ((int64_t)(m / 16) * kblocks * 16 + (m % 16)) * 32;
        if (m >= M) {
            for (int kb = kb0; kb < kb1; kb++) memset(dst + (int64_t)kb * 512, 0, 64);
            continue;
        }
        const float *g = gate + (int64_t)m * ld - c0, *u = up + (int64_t)m * ld - c0;  /* indexed by column */
        for (int kb = kb0; kb < kb1; kb++) {
            const __m512 lo = gated_vec16(_mm512_loadu_ps(g + 32 * kb), _mm512_loadu_ps(u + 32 * kb), act);
            const __m512 hi = gated_vec16(_mm512_loadu_ps(g + 32 * kb + 16), _mm512_loadu_ps(u + 32 * kb + 16), act);
            _mm512_storeu_si512((__m512i *)(dst + (int64_t)kb * 512), (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
    }
}

/* w rows [n0, n0 + 16) for all of K -> block b of wp[K / 32][nb][16 r][16 n] pairs (one B tile
 * per 32 k and 16 columns, 1 KB each): each 16 x 16 block of pairs transposed. */
static void pack_block(const uint16_t *w, int K, int n0, int b, int nb, uint32_t *wp) {
    const int kblocks = K / 32;
    const uint32_t *rows = (const uint32_t *)(w + (int64_t)n0 * K);  /* K / 2 pairs a row */
    for (int kb = 0; kb < kblocks; kb++) {
        __m512i r[16];
        for (int n = 0; n < 16; n++) r[n] = _mm512_loadu_si512(rows + (int64_t)n * (K / 2) + 16 * kb);
        amx_transpose16(r);
        uint32_t *tile = wp + ((int64_t)kb * nb + b) * 256;
        for (int i = 0; i < 16; i++) _mm512_store_si512(tile + 16 * i, r[i]);
    }
}

/* w rows [n0, n0 + 16 * nb) -> wp[K / 32][nb][16 r][16 n]. */
static void pack_slice(const uint16_t *w, int K, int n0, int nb, uint32_t *wp) {
    for (int b = 0; b < nb; b++) pack_block(w, K, n0 + 16 * b, b, nb, wp);
}

/* One k step (k block kb of kblocks) of a block of up to 2 x 2 tiles: C tiles 0-3 (C[mi][ni] =
 * tile 2 mi + ni) += rows [m0, m0 + 16 mb) of xb's k block times the nb packed 16-column blocks
 * of w's (mb, nb in {1, 2}). */
static inline __attribute__((always_inline)) void tile_k_step(const uint16_t *xb, int kblocks, int m0, int mb,
                                                              const uint32_t *wp, int nb, int kb) {
    const uint16_t *a = xb + ((int64_t)(m0 / 16) * kblocks + kb) * 512;
    const uint32_t *b = wp + (int64_t)kb * nb * 256;
    _tile_loadd(4, a, 64);
    _tile_loadd(6, b, 64);
    _tile_dpbf16ps(0, 4, 6);
    if (nb == 2) {
        _tile_loadd(7, b + 256, 64);
        _tile_dpbf16ps(1, 4, 7);
    }
    if (mb == 2) {
        _tile_loadd(5, a + (int64_t)kblocks * 512, 64);
        _tile_dpbf16ps(2, 5, 6);
        if (nb == 2) _tile_dpbf16ps(3, 5, 7);
    }
}

/* The block's C tiles to c[0 .. 16 mb, 0 .. 16 nb) (row stride ldc floats). */
static inline __attribute__((always_inline)) void tile_store_c(float *c, int64_t ldc, int mb, int nb) {
    const int64_t cstride = ldc * 4;
    _tile_stored(0, c, cstride);
    if (nb == 2) _tile_stored(1, c + 16, cstride);
    if (mb == 2) {
        _tile_stored(2, c + 16 * ldc, cstride);
        if (nb == 2) _tile_stored(3, c + 16 * ldc + 16, cstride);
    }
}

static inline __attribute__((always_inline)) void tile_zero_c(void) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
}

/* c[0 .. 16 mb, 0 .. 16 nb) (row stride ldc) = rows [m0, m0 + 16 mb) of x times the nb packed
 * 16-column blocks of w, over all of K (mb, nb in {1, 2}). */
static void tile_block(const uint16_t *xb, int K, int m0, int mb, const uint32_t *wp, int nb, float *c,
                       int64_t ldc) {
    const int kblocks = K / 32;
    tile_zero_c();
    for (int kb = 0; kb < kblocks; kb++) tile_k_step(xb, kblocks, m0, mb, wp, nb, kb);
    tile_store_c(c, ldc, mb, nb);
}

/* A thread's slice of w, in groups of 32 rows (of `groups`): up to 8, as many as keep the packed
 * slice near 1 MB (in L2 with the 32 rows of x it meets) and give each thread two slices or more. */
static int slice_groups(int K, int groups, int threads) {
    int n = (int)((1 << 20) / ((int64_t)K * 64));
    const int even = groups / (2 * threads);
    n = n < 1 ? 1 : n > 8 ? 8 : n;
    return even >= 1 && n > even ? even : n;
}

/* y [Mp, N] float32 (row stride ldy) = xb (x rounded: round_rows, Mp rows) @ w [N, K] bfloat16 ^T.
 * Returns 0, or -1 for a failed allocation (nothing written). */
static int tiles_product(const uint16_t *xb, int Mp, int K, const uint16_t *w, int N, float *y, int64_t ldy,
                         int threads) {
    const int pairs = slice_groups(K, (N + 31) / 32, threads);  /* pairs of 16-column blocks a slice */
    const int width = 32 * pairs, slices = (N + width - 1) / width;
    const size_t per_thread = (size_t)width * (size_t)K / 2;  /* the slice's columns x K / 2 pairs */
    uint32_t *packed = aligned_alloc(64, sizeof(uint32_t) * per_thread * (size_t)threads);
    if (!packed) return -1;
#pragma omp parallel num_threads(threads)
    {
        uint32_t *wp = packed + per_thread * (size_t)omp_get_thread_num();
        amx_load_config();
#pragma omp for schedule(dynamic, 1)
        for (int s = 0; s < slices; s++) {
            const int s0 = width * s, s1 = s0 + width < N ? s0 + width : N;
            for (int n0 = s0; n0 < s1; n0 += 32)  /* each pair of blocks packed apart: 32 x K / 2 pairs */
                pack_slice(w, K, n0, s1 - n0 >= 32 ? 2 : 1, wp + (int64_t)(n0 - s0) * (K / 2));
            for (int m0 = 0; m0 < Mp; m0 += 32)  /* 32 rows of x (in L1/L2) against every pair */
                for (int n0 = s0; n0 < s1; n0 += 32)
                    tile_block(xb, K, m0, Mp - m0 >= 32 ? 2 : 1, wp + (int64_t)(n0 - s0) * (K / 2),
                               s1 - n0 >= 32 ? 2 : 1, y + (int64_t)m0 * ldy + n0, ldy);
        }
        _tile_release();
    }
    free(packed);
    return 0;
}

/* Rows [r0, r1) of a 2 x 2 block's sums b (row i: gate's 16, then up's; rows m0 + i of x,
 * result columns [c, c + 16)) through the activation and rounded into xo (round_rows' order, F /
 * 32 = okb tiles along K); rows past M zero. */
static inline void gated_out(const float *b, int m0, int c, int r0, int r1, int M, int okb, int act, uint16_t *xo) {
    for (int i = r0; i < r1; i++) {
        const int m = m0 + i;
        uint16_t *dst = xo + ((int64_t)(m / 16) * okb + c / 32) * 512 + (m % 16) * 32 + c % 32;
        if (m >= M) {
            memset(dst, 0, 32);
            continue;
        }
        const __m512 v = gated_vec16(_mm512_load_ps(b + 32 * i), _mm512_load_ps(b + 32 * i + 16), act);
        _mm256_storeu_si256((__m256i *)dst, (__m256i)_mm512_cvtneps_pbh(v));
    }
}

/* A finished block whose activation is still to run (gated_out's arguments; rows 0: none). */
typedef struct {
    const float *buf;
    int m0, c, rows;
} Pending;

/* tile_block for a gate/up pair (nb 2) into c (row stride 32), with the previous block's
 * activation (prev) run a few rows at a time between the k steps: the vector work goes on while
 * the tile unit multiplies, where one after the other left the tiles idle through it. */
static void tile_block_gated(const uint16_t *xb, int K, int m0, int mb, const uint32_t *wp, float *c,
                             const Pending *prev, int M, int okb, int act, uint16_t *xo) {
    const int kblocks = K / 32;
    const int step = (prev->rows + kblocks - 1) / kblocks;  /* rows of prev's activation a k step */
    int done = 0;
    tile_zero_c();
    for (int kb = 0; kb < kblocks; kb++) {
        tile_k_step(xb, kblocks, m0, mb, wp, 2, kb);
        if (done < prev->rows) {
            const int end = done + step < prev->rows ? done + step : prev->rows;
            gated_out(prev->buf, prev->m0, prev->c, done, end, M, okb, act, xo);
            done = end;
        }
    }
    if (done < prev->rows) gated_out(prev->buf, prev->m0, prev->c, done, prev->rows, M, okb, act, xo);
    tile_store_c(c, 32, mb, 2);
}

/* xo [Mp, F] bfloat16, in round_rows' tile order (the down projection's rounded x) = act(x @
 * w[0, F)^T) * (x @ w[F, 2F)^T) rounded (gated_vec16, then vcvtneps2bf16), for xb (x rounded,
 * Mp rows, M of them x's) and an MLP's gate/up matrix w [2F, K] (gate's rows first); rows
 * M..Mp-1 of xo zero. Each block of 16 gate columns is multiplied beside its 16 up columns (a
 * 2 x 2 tile block: gate and up for 32 rows), the sums go to a 4 KB buffer in L1 and out as
 * bfloat16 through the activation, instead of a [Mp, 2F] float32 product written to memory
 * and read back by round_gated_rows: the same sums (each element's over K in the same order)
 * and the same activation and rounding, so the same bits as the two passes. Two such buffers:
 * a block's activation runs a few rows at a time between the k steps of the next block's
 * products (tile_block_gated), where one after the other left the tile unit idle through the
 * exponentials. Intel Xeon (family 6 model 167), 2 threads, 2026-12-07, 3 matrices a call,
 * alternating in one process, medians of 12 (4 at 1B): 2,048 rows of SmolLM2's MLP (K 576, F
 * 1,536) 3.25 -> 2.50 ms, of a 1B's (K 2,048, F 8,192) 75.9 -> 65.3 ms; 512 rows 0.85 -> 0.70
 * ms; the same bits. The 135M bfloat16 model's 2K prefill 494 -> 474 ms. The float32 products'
 * stores (tiles_product) taken through such a buffer the same way measured no faster. Returns
 * 0, or -1 for a failed allocation (nothing written). */
static int tiles_gated(const uint16_t *xb, int M, int Mp, int K, const uint16_t *w, int F, int act, uint16_t *xo,
                       int threads) {
    const int fblocks = F / 16, okb = F / 32;  /* 16-column blocks of the result; its tiles along K */
    int per = slice_groups(K, fblocks, threads);  /* gate/up block pairs (32 rows of w each) a slice */
    per = per < 2 ? 2 : per / 2 * 2;  /* whole 32-column groups: one thread writes a tile row's 64 bytes */
    const int slices = (fblocks + per - 1) / per;
    const size_t pair_words = (size_t)16 * (size_t)K;  /* 32 rows of w, K / 2 pairs each */
    uint32_t *packed = aligned_alloc(64, sizeof(uint32_t) * pair_words * (size_t)per * (size_t)threads);
    if (!packed) return -1;
#pragma omp parallel num_threads(threads)
    {
        uint32_t *wp = packed + pair_words * (size_t)per * (size_t)omp_get_thread_num();
        float bufs[2][32 * 32] __attribute__((aligned(64)));  /* row i: gate's 16 sums, then up's */
        amx_load_config();
#pragma omp for schedule(dynamic, 1)
        for (int s = 0; s < slices; s++) {
            const int j0 = per * s, j1 = j0 + per < fblocks ? j0 + per : fblocks;
            for (int j = j0; j < j1; j++) {
                pack_block(w, K, 16 * j, 0, 2, wp + (int64_t)(j - j0) * pair_words);
                pack_block(w, K, F + 16 * j, 1, 2, wp + (int64_t)(j - j0) * pair_words);
            }
            /* each block's activation runs while the tiles multiply the next block (two buffers) */
            Pending prev = {bufs[1], 0, 0, 0};
            int cur = 0;
            for (int m0 = 0; m0 < Mp; m0 += 32) {
                const int mb = Mp - m0 >= 32 ? 2 : 1;
                for (int j = j0; j < j1; j++) {
                    tile_block_gated(xb, K, m0, mb, wp + (int64_t)(j - j0) * pair_words, bufs[cur], &prev, M, okb,
                                     act, xo);
                    prev.buf = bufs[cur];
                    prev.m0 = m0;
                    prev.c = 16 * j;
                    prev.rows = 16 * mb;
                    cur ^= 1;
                }
            }
            gated_out(prev.buf, prev.m0, prev.c, 0, prev.rows, M, okb, act, xo);
        }
        _tile_release();
    }
    free(packed);
    return 0;
}

/* y [Mp, N] float32 (row stride ldy, Mp = M rounded up to 16: the caller's buffer holds the
 * padding rows) = x [M, K] float32 (row stride ldx) @ w [N, K] bfloat16 ^T. Returns 0, or -1 for
 * shapes it does not take (K % 32, N % 16) or a failed allocation (nothing written).
 * ``threads`` >= 1. */
int longctx_amx_linear(const float *x, int64_t ldx, int M, int K, const uint16_t *w, int N, float *y, int64_t ldy,
                       int threads) {
    if (M <= 0 || K <= 0 || N <= 0 || threads < 1 || K % 32 || N % 16) return -1;
    const int Mp = (M + 15) / 16 * 16;
    uint16_t *xb = aligned_alloc(64, sizeof(uint16_t) * (size_t)Mp * (size_t)K);
    if (!xb) return -1;
    round_rows(x, ldx, M, Mp, K, NULL, NULL, -1.0f, xb, threads);
    const int rc = tiles_product(xb, Mp, K, w, N, y, ldy, threads);
    free(xb);
    return rc;
}

/* The two halves of longctx_amx_linear, for several products over one x (the slices of a
 * matrix that is never whole in bfloat16: GGUF blocks dequantized a slice at a time): x rounded
 * once into xb [Mp * K] (the A-tile order, not rows; the rounding functions below), then each
 * slice's product from it (longctx_amx_linear_rounded). The same numbers as
 * longctx_amx_linear's. They return 0, or -1 for shapes they do not take or (the products) a
 * failed allocation: nothing written.
 *
 * x rounded, times row_scale[m] and then col_scale[k] (either NULL: not applied; both NULL: the
 * plain rounding): an RMSNorm's two products (torch's x * rsqrt(mean) then weight * that, the
 * same roundings) made in the pass that rounds them, instead of two passes over [M, K] floats
 * and a third to round. */
int longctx_amx_round_scaled(const float *x, int64_t ldx, int M, int K, const float *row_scale,
                             const float *col_scale, uint16_t *xb, int threads) {
    if (M <= 0 || K <= 0 || threads < 1 || K % 32) return -1;
    round_rows(x, ldx, M, (M + 15) / 16 * 16, K, row_scale, col_scale, -1.0f, xb, threads);
    return 0;
}

/* round_gated_rows: act (0 silu, 1 GELU tanh) of gate times up, [M, w] each (row stride ld), into
 * columns [c0, c0 + w) of xb [Mp, K] (K, c0, w multiples of 32, c0 + w <= K). Returns 0, or -1
 * for shapes it does not take (nothing written). */
int longctx_amx_round_gated(const float *gate, const float *up, int64_t ld, int M, int K, int c0, int w, int act,
                            uint16_t *xb, int threads) {
    if (M <= 0 || K <= 0 || w <= 0 || c0 < 0 || threads < 1 || K % 32 || c0 % 32 || w % 32 || c0 + w > K
        || (act != 0 && act != 1))
        return -1;
    round_gated_rows(gate, up, ld, M, (M + 15) / 16 * 16, K, c0, w, act, xb, threads);
    return 0;
}

/* longctx_amx_round_scaled with row_scale[m] = 1 / sqrt(mean_k(x[m][k]^2) + eps) made in the same
 * pass (an RMSNorm whole: its statistics in float32, 32 running sums a row, then its two
 * products), for eps >= 0. The sums' order is not torch's: the scale may differ from torch's
 * rsqrt(x.pow(2).mean() + eps) in its last bit. */
int longctx_amx_round_rms(const float *x, int64_t ldx, int M, int K, float eps, const float *col_scale,
                          uint16_t *xb, int threads) {
    if (M <= 0 || K <= 0 || threads < 1 || K % 32 || !(eps >= 0.0f)) return -1;
    round_rows(x, ldx, M, (M + 15) / 16 * 16, K, NULL, col_scale, eps, xb, threads);
    return 0;
}

int longctx_amx_linear_rounded(const uint16_t *xb, int M, int K, const uint16_t *w, int N, float *y, int64_t ldy,
                               int threads) {
    if (M <= 0 || K <= 0 || N <= 0 || threads < 1 || K % 32 || N % 16) return -1;
    return tiles_product(xb, (M + 15) / 16 * 16, K, w, N, y, ldy, threads);
}

/* tiles_gated: an MLP's act(gate) * up (act 0 silu, 1 GELU tanh) for xb's M rows (as
 * longctx_amx_linear_rounded takes them) and its gate/up matrix w [2F, K], straight into xo
 * [Mp, F] bfloat16 in the rounded order (longctx_amx_round_gated's result for the two halves of
 * longctx_amx_linear_rounded's [M, 2F] product, bit for bit). Returns 0, or -1 for shapes it
 * does not take (K % 32, F % 32) or a failed allocation (nothing written). */
int longctx_amx_gated_rounded(const uint16_t *xb, int M, int K, const uint16_t *w, int F, int act, uint16_t *xo,
                              int threads) {
    if (M <= 0 || K <= 0 || F <= 0 || threads < 1 || K % 32 || F % 32 || (act != 0 && act != 1)) return -1;
    return tiles_gated(xb, M, (M + 15) / 16 * 16, K, w, F, act, xo, threads);
}
