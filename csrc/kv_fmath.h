/*
 * kv_fmath: float math that rounds the same way everywhere.
 *
 * Plain IEEE float arithmetic with no libm call and no data-dependent branch, so every
 * compiler and CPU gives the same bits, vectorised or not (C99 mode: no fused
 * multiply-add contraction). Used where a value must be reproducible bit for bit: a
 * table's initial rows (kv_init.c) and the synthetic data set (synth/kv_synth.c).
 */
#ifndef KV_FMATH_H
#define KV_FMATH_H

#include <stdint.h>
#include <string.h>

static inline float as_f32(uint32_t b) {
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

static inline uint32_t as_u32(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

#define LN2F_HI 6.9313812256e-01f /* 0x3f317180 */
#define LN2F_LO 9.0580006145e-06f /* 0x3717f7d1 */
#define LGF1 0.66666662693f       /* 0xaaaaaa.0p-24 */
#define LGF2 0.40000972152f       /* 0xccce13.0p-25 */
#define LGF3 0.28498786688f       /* 0x91e9ee.0p-25 */
#define LGF4 0.24279078841f       /* 0xf89e26.0p-26 */

/* logf(x) for normal x > 0 (FreeBSD e_logf.c as in musl; error < 1 ulp). */
static inline float kv_logf(float x) {
    uint32_t ix = as_u32(x) + (0x3f800000 - 0x3f3504f3);
    float k = as_f32(0x4b000000 | (ix >> 23)) - (0x1p23f + 127.0f);
    float f = as_f32((ix & 0x007fffff) + 0x3f3504f3) - 1.0f;
    float s = f / (2.0f + f);
    float z = s * s;
    float w = z * z;
    float t1 = w * (LGF2 + w * LGF4);
    float t2 = z * (LGF1 + w * LGF3);
    float r = t2 + t1;
    float hfsq = 0.5f * f * f;
    return s * (hfsq + r) + k * LN2F_LO - hfsq + f + k * LN2F_HI;
}


/* sin and cos of u turns (2 pi u radians) for u in [0, 1): Cephes' sinf/cosf
 * polynomials on [-pi/4, pi/4] after an exact reduction to the nearest quarter turn. */
static inline void kv_sincos_turn(float u, float *s, float *c) {
    float q = u * 4.0f;                       /* quarter turns, in [0, 4) */
    int32_t k = (int32_t)(q + 0.5f);          /* nearest quarter: 0 .. 4 */
    float x = (q - (float)k) * 1.57079632679f; /* in [-pi/4, pi/4] */
    float z = x * x;
    float sn = ((-1.9515295891e-4f * z + 8.3321608736e-3f) * z - 1.6666654611e-1f) * z * x + x;
    float cs = ((2.443315711809948e-5f * z - 1.388731625493765e-3f) * z +
                4.166664568298827e-2f) * z * z - 0.5f * z + 1.0f;
    /* rotate by k quarter turns with bit operations (no branch, no rounding):
     * odd k swaps sin and cos; sin flips sign for k & 2, cos for (k + 1) & 2 */
    uint32_t bs = as_u32(sn), bc = as_u32(cs), swap = 0u - ((uint32_t)k & 1u);
    *s = as_f32(((bc & swap) | (bs & ~swap)) ^ (((uint32_t)k & 2u) << 30));
    *c = as_f32(((bs & swap) | (bc & ~swap)) ^ ((((uint32_t)k + 1u) & 2u) << 30));
}

/* Whether no element of v[0..n) is Inf or NaN (an exponent of all ones). */
static inline int kv_all_finite(const float *v, size_t n) {
    uint32_t bad = 0;
    for (size_t i = 0; i < n; i++) bad |= (uint32_t)((as_u32(v[i]) & 0x7f800000u) == 0x7f800000u);
    return !bad;
}

#endif
