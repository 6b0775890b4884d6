/* The prologues of the CPU matrix kernels (linear_rows.c, linear_blocks.c): the rows a product
 * takes when the model's RMSNorm or SwiGLU runs inside the call, in float32.
 * Include after HAVE_AVX2 is defined (1 with AVX2 and FMA intrinsics, else 0). */
#ifndef LONGCTX_PROLOGUE_H
#define LONGCTX_PROLOGUE_H

#include <math.h>

/* silu(g) * u, with silu(g) = g / (1 + exp(-g)) as torch computes it. */
static inline float swiglu(float g, float u) { return g / (1.0f + expf(-g)) * u; }

/* exp_vec's and exp_vec16's constants: clamps, ln 2 in two parts, the polynomial's coefficients
 * (highest first; the last two are 1). */
#define EXP_OVERFLOW 88.72284f
#define EXP_HI 88.3f
#define EXP_LO (-87.3f)
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693115234375f
#define EXP_LN2_LO 3.1946183e-05f
#define EXP_C6 1.3836948e-3f
#define EXP_C5 8.3748084e-3f
#define EXP_C4 4.1668221e-2f
#define EXP_C3 1.6666420e-1f
#define EXP_C2 4.9999991e-1f

#if HAVE_AVX2
/* e^x for 8 floats: x = n ln2 + r with |r| <= ln2 / 2 (ln2 split in two so n ln2 is exact),
 * e^r by a degree-6 polynomial fitted for relative error on that range (8.2e-8 evaluated in
 * float32, under one ulp), 2^n in the exponent bits. x is clamped to [-87.3, 88.3] for that
 * (NaN passes through); past 88.72, where float e^x overflows, the result is +inf. */
static inline __m256 exp_vec(__m256 x) {
    const __m256 over = _mm256_cmp_ps(x, _mm256_set1_ps(EXP_OVERFLOW), _CMP_GT_OQ);
    x = _mm256_min_ps(_mm256_set1_ps(EXP_HI), _mm256_max_ps(_mm256_set1_ps(EXP_LO), x));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_C6);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C5));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_C2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_blendv_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), _mm256_set1_ps(INFINITY), over);
}
#endif

#if HAVE_AVX2 && defined(__AVX512F__)
/* exp_vec for 16 floats: the same reduction, polynomial and clamps (the same results). */
static inline __m512 exp_vec16(__m512 x) {
    const __mmask16 over = _mm512_cmp_ps_mask(x, _mm512_set1_ps(EXP_OVERFLOW), _CMP_GT_OQ);
    x = _mm512_min_ps(_mm512_set1_ps(EXP_HI), _mm512_max_ps(_mm512_set1_ps(EXP_LO), x));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_C6);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C5));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_C2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mask_blend_ps(over, _mm512_mul_ps(p, _mm512_castsi512_ps(e)), _mm512_set1_ps(INFINITY));
}

/* act(g) * u for 16 floats, act 0: silu, g / (1 + e^-g); 1: GELU's tanh form,
 * 0.5 g (1 + tanh(z)) with z = sqrt(2 / pi) (g + 0.044715 g^3), computed as g / (1 + e^(-2 z))
 * (the same function). Within a few ulp of the exact function times u: of torch's silu too; torch's
 * 0.5 g (1 + tanh z) loses bits to cancellation for negative g, this form does not. */
static inline __m512 gated_vec16(__m512 g, __m512 u, int act) {
    __m512 z = g;
    if (act) {
        const __m512 cube = _mm512_mul_ps(_mm512_mul_ps(g, g), _mm512_mul_ps(_mm512_set1_ps(0.044715f), g));
        z = _mm512_mul_ps(_mm512_set1_ps(1.5957691216057308f), _mm512_add_ps(g, cube));  /* 2 sqrt(2 / pi) */
    }
    const __m512 e = exp_vec16(_mm512_sub_ps(_mm512_setzero_ps(), z));
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}
#endif

/* t[k] = silu(g[k]) * u[k] for k < K (vectorized with AVX2: within ~1 ulp of the scalar form,
 * the same at infinities and NaN). */
static void swiglu_row(const float *g, const float *u, int K, float *t) {
    int k = 0;
#if HAVE_AVX2
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; k + 8 <= K; k += 8) {
        const __m256 gv = _mm256_loadu_ps(g + k);
        const __m256 e = exp_vec(_mm256_sub_ps(_mm256_setzero_ps(), gv));
        _mm256_storeu_ps(t + k, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), _mm256_loadu_ps(u + k)));
    }
#endif
    for (; k < K; k++) t[k] = swiglu(g[k], u[k]);
}

/* t[k] = w[k] * (x[k] * (1 / sqrt(mean(x^2) + eps))) for k < K: RMSNorm, statistics in float32. */
static void rms_row(const float *x, const float *w, float eps, int K, float *t) {
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int k = 0; k < K; k++) ss += x[k] * x[k];
    const float inv = 1.0f / sqrtf(ss / (float)K + eps);
#pragma omp simd
    for (int k = 0; k < K; k++) t[k] = w[k] * (x[k] * inv);
}

#endif
