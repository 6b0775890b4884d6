/* What the AMX kernels share (linear_amx.c; paged_flash.c built with LONGCTX_AMX): asking Linux
 * for the tile state, the one tile shape they use, and a 16 x 16 transpose of 32-bit words (the
 * bfloat16 pairs an operand B tile holds). Include only in builds with -mamx-tile -mamx-bf16
 * and AVX-512 (_GNU_SOURCE defined first, for syscall).
 *
 * Linux grants a process the AMX tile state only on request (arch_prctl ARCH_REQ_XCOMP_PERM):
 * without it the first tile instruction faults. */
#ifndef LONGCTX_AMX_TILES_H
#define LONGCTX_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

/* 0 when this process may use the AMX tiles, else -1 (an old kernel, or a VM that hides them). */
static inline int amx_request_tiles(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 0 : -1;
}

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} AmxTileConfig;

/* All 8 tiles as 16 rows of 64 bytes (16 float32 sums, or 32 bfloat16 as 16 pairs), for the
 * calling thread (each thread loads its own). */
static inline void amx_load_config(void) {
    /* a constant, not a stack struct filled in place: GCC 12 at -O3 dropped that struct's stores
     * ahead of ldtilecfg in one caller (tiles_product's OpenMP body, 2026-12-07), which then
     * faulted on the all-zero shape */
    static const AmxTileConfig cfg = {
        .palette_id = 1,
        .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
        .rows = {16, 16, 16, 16, 16, 16, 16, 16},
    };
    _tile_loadconfig(&cfg);
}

/* r[i] <- column i of the 16 x 16 words r (row i: r[i]). Two rounds of unpacks give, in lane L
 * of r[4 g + j], words 4 L + j of rows 4 g .. 4 g + 3; two rounds of 128-bit lane shuffles
 * gather the four groups' lane L into row 4 L + j. */
static inline void amx_transpose16(__m512i r[16]) {
    __m512i t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int g = 0; g < 4; g++) {
        r[4 * g] = _mm512_unpacklo_epi64(t[4 * g], t[4 * g + 2]);
        r[4 * g + 1] = _mm512_unpackhi_epi64(t[4 * g], t[4 * g + 2]);
        r[4 * g + 2] = _mm512_unpacklo_epi64(t[4 * g + 1], t[4 * g + 3]);
        r[4 * g + 3] = _mm512_unpackhi_epi64(t[4 * g + 1], t[4 * g + 3]);
    }
    for (int j = 0; j < 4; j++) {
        const __m512i u0 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44), u1 = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
        const __m512i u2 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
        const __m512i u3 = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
        t[j] = _mm512_shuffle_i32x4(u0, u2, 0x88);
        t[4 + j] = _mm512_shuffle_i32x4(u0, u2, 0xDD);
        t[8 + j] = _mm512_shuffle_i32x4(u1, u3, 0x88);
        t[12 + j] = _mm512_shuffle_i32x4(u1, u3, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

#endif
