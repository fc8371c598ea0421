/*
 * test_wire.c - the 16-bit wire formats (kv_wire.h) against references of their own.
 *
 * References, independent of kv_wire.c's bit tricks:
 *   - fp16: the table of every non-negative finite fp16 value (decoded from its fields
 *     with ldexp), searched for the nearest value to a float (in double arithmetic, a
 *     tie going to the even bit pattern; at or beyond 65520 the result is Inf); and,
 *     where the compiler has _Float16 (GCC 12+ on x86-64), the compiler's own
 *     conversions, which round to nearest even;
 *   - bf16: the two bf16 neighbours of a float (truncated, and one step up), the nearer
 *     by a double subtraction, a tie to the even pattern.
 * Checked: every fp16 and bf16 value round-trips exactly (NaN stays a NaN of the same
 * sign); ties and near-ties between every two consecutive fp16 values; a strided sweep
 * of all 2^32 float bit patterns against the references; Inf, NaN, overflow at the
 * exact boundaries (65519.996 fits, 65520 does not; bf16 at 0x7f7f8000) and where it
 * is reported; subnormals both ways (fp16's down to 2^-24, float32 ones into bf16),
 * also with the FPU's flush-to-zero and denormals-are-zero modes on; every ISA copy and
 * a pool of threads give the same bits as the one-value functions; bad arguments.
 * Segments (the exchange's format): the exponent each fp16 segment gets; every value is
 * the reference's fp16 of x * 2^k, times 2^-k; tiny and huge segments keep fp16's 11
 * bits relative to their largest value and never overflow; bf16 segments are the plain
 * concatenation; empty segments take no wire value; pools; NaN/Inf; bad arguments.
 */
#include <math.h>
#include <string.h>

#include "../kv_fmath.h"
#include "../kv_wire.h"
#include "test_util.h"

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

#define F16 KV_WIRE_F16
#define BF16 KV_WIRE_BF16

static double g_f16[0x7c00]; /* every non-negative finite fp16 value, by its bits */

static double f16_field_value(uint32_t h) {
    uint32_t e = (h >> 10) & 31, m = h & 1023;
    double v = e ? ldexp(1024.0 + m, (int)e - 25) : ldexp((double)m, -24);
    return (h & 0x8000) ? -v : v;
}

static void build_f16_table(void) {
    for (uint32_t h = 0; h < 0x7c00; h++) g_f16[h] = f16_field_value(h);
}

/* The nearest fp16 to x by the table (ties to the even pattern), Inf beyond range. */
static uint16_t ref_f16(float x) {
    uint32_t b = as_u32(x), sign = (b >> 16) & 0x8000u;
    if (isnan(x)) return (uint16_t)(sign | 0x7e00u);
    double a = fabs((double)x);
    if (a >= 65520.0) return (uint16_t)(sign | 0x7c00u);
    uint32_t lo = 0, hi = 0x7bff; /* largest value <= a */
    while (lo < hi) {
        uint32_t mid = (lo + hi + 1) / 2;
        if (g_f16[mid] <= a) lo = mid; else hi = mid - 1;
    }
    uint32_t r = lo; /* [65504, 65520): 65504 */
    if (lo < 0x7bff) {
        double dl = a - g_f16[lo], dh = g_f16[lo + 1] - a;
        if (dh < dl || (dh == dl && (lo & 1))) r = lo + 1;
    }
    return (uint16_t)(sign | r);
}

static uint16_t ref_bf16(float x) {
    uint32_t b = as_u32(x);
    if (isnan(x)) return (uint16_t)((b >> 16) | 0x40u);
    if (isinf(x)) return (uint16_t)(b >> 16);
    uint32_t lo = b >> 16, hi = lo + 1; /* same sign: hi is one step away from zero */
    double dl = fabs((double)x - (double)as_f32(lo << 16));
    double dh = (hi & 0x7f80u) == 0x7f80u ? ldexp(1.0, 128) - fabs((double)x)
                                          : fabs((double)as_f32(hi << 16) - (double)x);
    return (uint16_t)((dh < dl || (dh == dl && (lo & 1))) ? hi : lo);
}

static int same_float(float a, float b) { return as_u32(a) == as_u32(b); }

static void test_round_trip(void) {
    long bad16 = 0, badbf = 0;
    for (uint32_t h = 0; h < 0x10000; h++) {
        float f = kv_wire_to_float(F16, (uint16_t)h);
        uint16_t back = kv_wire_from_float(F16, f);
        int nan = (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu);
        if (nan) {
            bad16 += !(isnan(f) && (back & 0x7e00u) == 0x7e00u && (back & 0x8000u) == (h & 0x8000u));
        } else {
            bad16 += back != h;
            bad16 += !isnan(f) && (double)f != ((h & 0x7c00u) == 0x7c00u
                ? ((h & 0x8000u) ? -INFINITY : INFINITY) : f16_field_value(h));
        }
        float g = kv_wire_to_float(BF16, (uint16_t)h);
        uint16_t bb = kv_wire_from_float(BF16, g);
        int bnan = (h & 0x7f80u) == 0x7f80u && (h & 0x7fu);
        badbf += bnan ? !(isnan(g) && bb == (h | 0x40u)) : bb != h;
        badbf += as_u32(g) != h << 16;
    }
    CHECK_EQ_INT(bad16, 0);
    CHECK_EQ_INT(badbf, 0);
}

/* Between every two consecutive positive finite fp16 values: the midpoint goes to the
 * even one, one float ulp either side to the nearer; negatives mirror. */
static void test_ties(void) {
    long bad = 0;
    for (uint32_t h = 0; h < 0x7bff; h++) {
        double mid = (g_f16[h] + g_f16[h + 1]) / 2; /* exact in float: 12 bits */
        float m = (float)mid;
        uint16_t even = (h & 1) ? (uint16_t)(h + 1) : (uint16_t)h;
        bad += kv_wire_from_float(F16, m) != even;
        bad += kv_wire_from_float(F16, -m) != (even | 0x8000u);
        bad += kv_wire_from_float(F16, nextafterf(m, 0.0f)) != h;
        bad += kv_wire_from_float(F16, nextafterf(m, INFINITY)) != h + 1;
        bad += kv_wire_from_float(F16, (float)g_f16[h]) != h;
    }
    CHECK_EQ_INT(bad, 0);
    /* bf16: 1 + 2^-8 is a tie between 1 (even) and 1 + 2^-7; 1 + 3 * 2^-8 goes up */
    CHECK_EQ_INT(kv_wire_from_float(BF16, 1.0f + 0x1p-8f), 0x3f80);
    CHECK_EQ_INT(kv_wire_from_float(BF16, 1.0f + 3 * 0x1p-8f), 0x3f82);
    CHECK_EQ_INT(kv_wire_from_float(BF16, nextafterf(1.0f + 0x1p-8f, 2.0f)), 0x3f81);
}

/* A strided walk over every float bit pattern (and its neighbours) against both
 * references. */
static void test_sweep(void) {
    long bad16 = 0, badbf = 0, badc = 0;
    uint64_t seed = 7;
    for (uint64_t b = 0; b < 0x100000000ULL; b += 977 + (test_rand(&seed) & 1023)) {
        for (uint32_t k = 0; k < 3; k++) {
            float x = as_f32((uint32_t)b + k);
            uint16_t h = kv_wire_from_float(F16, x), r = ref_f16(x);
            bad16 += isnan(x) ? (h & 0x7fffu) != 0x7e00u || (h & 0x8000u) != (r & 0x8000u)
                              : h != r;
            badbf += kv_wire_from_float(BF16, x) != ref_bf16(x);
#if defined(__FLT16_MAX__)
            if (!isnan(x)) {
                _Float16 c = (_Float16)x;
                uint16_t cb;
                memcpy(&cb, &c, 2);
                badc += cb != h;
            }
#endif
        }
    }
    CHECK_EQ_INT(bad16, 0);
    CHECK_EQ_INT(badbf, 0);
    CHECK_EQ_INT(badc, 0);
#if defined(__FLT16_MAX__)
    long badu = 0;
    for (uint32_t h = 0; h < 0x10000; h++) {
        _Float16 c;
        uint16_t hb = (uint16_t)h;
        memcpy(&c, &hb, 2);
        float f = (float)c, g = kv_wire_to_float(F16, hb);
        badu += isnan(f) ? !isnan(g) : !same_float(f, g);
    }
    CHECK_EQ_INT(badu, 0);
#else
    printf("(no _Float16 in this compiler: checked against the table reference only)\n");
#endif
}

static void test_specials(void) {
    CHECK_EQ_INT(kv_wire_from_float(F16, INFINITY), 0x7c00);
    CHECK_EQ_INT(kv_wire_from_float(F16, -INFINITY), 0xfc00);
    CHECK_EQ_INT(kv_wire_from_float(F16, NAN) & 0x7fff, 0x7e00);
    CHECK_EQ_INT(kv_wire_from_float(F16, -NAN) & 0x8000, 0x8000);
    CHECK_EQ_INT(kv_wire_from_float(F16, 0.0f), 0);
    CHECK_EQ_INT(kv_wire_from_float(F16, -0.0f), 0x8000);
    CHECK_EQ_INT(kv_wire_from_float(F16, 65504.0f), 0x7bff);
    CHECK_EQ_INT(kv_wire_from_float(F16, nextafterf(65520.0f, 0.0f)), 0x7bff);
    CHECK_EQ_INT(kv_wire_from_float(F16, 65520.0f), 0x7c00);
    CHECK_EQ_INT(kv_wire_from_float(F16, -65520.0f), 0xfc00);
    CHECK_EQ_INT(kv_wire_from_float(F16, 3.4028235e38f), 0x7c00);
    CHECK(kv_wire_to_float(F16, 0x7c00) == INFINITY);
    CHECK(kv_wire_to_float(F16, 0xfc00) == -INFINITY);
    CHECK(isnan(kv_wire_to_float(F16, 0x7e00)));
    CHECK(isnan(kv_wire_to_float(F16, 0x7c01)));
    CHECK(kv_wire_to_float(F16, 0x7bff) == 65504.0f);
    CHECK(same_float(kv_wire_to_float(F16, 0x8000), -0.0f));
    /* bf16 */
    CHECK_EQ_INT(kv_wire_from_float(BF16, INFINITY), 0x7f80);
    CHECK_EQ_INT(kv_wire_from_float(BF16, -INFINITY), 0xff80);
    CHECK_EQ_INT(kv_wire_from_float(BF16, as_f32(0x7f800001u)), 0x7fc0); /* made quiet */
    CHECK_EQ_INT(kv_wire_from_float(BF16, as_f32(0xffa12345u)), 0xffe1); /* sign, payload */
    CHECK_EQ_INT(kv_wire_from_float(BF16, as_f32(0x7f7f7fffu)), 0x7f7f);
    CHECK_EQ_INT(kv_wire_from_float(BF16, as_f32(0x7f7f8000u)), 0x7f80);
    CHECK_EQ_INT(kv_wire_from_float(BF16, 3.4028235e38f), 0x7f80);
    CHECK_EQ_INT(kv_wire_from_float(BF16, -3.4028235e38f), 0xff80);
    CHECK(isnan(kv_wire_to_float(BF16, 0x7fc0)));
    CHECK(kv_wire_to_float(BF16, 0xff80) == -INFINITY);
}

static void check_subnormals(void) {
    /* fp16 subnormals: steps of 2^-24 */
    CHECK_EQ_INT(kv_wire_from_float(F16, 0x1p-24f), 0x0001);
    CHECK_EQ_INT(kv_wire_from_float(F16, 0x1p-25f), 0x0000);           /* tie -> 0 */
    CHECK_EQ_INT(kv_wire_from_float(F16, nextafterf(0x1p-25f, 1.0f)), 0x0001);
    CHECK_EQ_INT(kv_wire_from_float(F16, 3 * 0x1p-25f), 0x0002);       /* tie -> even */
    CHECK_EQ_INT(kv_wire_from_float(F16, 5 * 0x1p-25f), 0x0002);       /* tie -> even */
    CHECK_EQ_INT(kv_wire_from_float(F16, -0x1p-24f), 0x8001);
    CHECK_EQ_INT(kv_wire_from_float(F16, 0x1p-14f - 0x1p-25f), 0x0400); /* up to normal */
    CHECK_EQ_INT(kv_wire_from_float(F16, 0x3ffp-24f), 0x03ff);
    CHECK_EQ_INT(kv_wire_from_float(F16, as_f32(0x00000001u)), 0x0000); /* f32 subnormal */
    CHECK_EQ_INT(kv_wire_from_float(F16, as_f32(0x80400000u)), 0x8000);
    CHECK(kv_wire_to_float(F16, 0x0001) == 0x1p-24f);
    CHECK(kv_wire_to_float(F16, 0x03ff) == 0x3ffp-24f);
    CHECK(kv_wire_to_float(F16, 0x8200) == -0x200p-24f);
    /* bf16 keeps float32's subnormals (rounded) */
    CHECK_EQ_INT(kv_wire_from_float(BF16, as_f32(0x00000001u)), 0x0000);
    CHECK_EQ_INT(kv_wire_from_float(BF16, as_f32(0x00008000u)), 0x0000); /* tie -> even */
    CHECK_EQ_INT(kv_wire_from_float(BF16, as_f32(0x00018000u)), 0x0002); /* tie -> even */
    CHECK_EQ_INT(kv_wire_from_float(BF16, as_f32(0x00010001u)), 0x0001);
    CHECK_EQ_INT(kv_wire_from_float(BF16, as_f32(0x007fffffu)), 0x0080); /* up to normal */
    CHECK_EQ_INT(kv_wire_from_float(BF16, as_f32(0x80048000u)), 0x8004);
    CHECK(as_u32(kv_wire_to_float(BF16, 0x0001)) == 0x00010000u);
}

static void test_subnormals(void) {
    check_subnormals();
#if defined(__SSE__)
    /* flush-to-zero and denormals-are-zero on (what some math libraries set): the same */
    unsigned int csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040u);
    long bad = 0;
    for (uint32_t h = 0; h < 0x400; h++) {
        float f = kv_wire_to_float(F16, (uint16_t)h);
        bad += kv_wire_from_float(F16, f) != h;
        bad += (double)f != ldexp((double)h, -24);
    }
    _mm_setcsr(csr);
    CHECK_EQ_INT(bad, 0);
    _mm_setcsr(csr | 0x8040u);
    CHECK_EQ_INT(kv_wire_from_float(F16, 0x1p-24f), 0x0001);
    CHECK_EQ_INT(kv_wire_from_float(F16, 3 * 0x1p-25f), 0x0002);
    CHECK_EQ_INT(kv_wire_from_float(BF16, as_f32(0x00018000u)), 0x0002);
    _mm_setcsr(csr);
#endif
}

/* The batch kernels: every ISA copy and a pool give the one-value functions' bits, and
 * report the first overflow / non-finite value. */
static void test_batch(void) {
    const int64_t n = 600000; /* > 2 ranges: the pool splits it */
    float *in = malloc((size_t)n * sizeof(float)), *back = malloc((size_t)n * sizeof(float));
    uint16_t *h = malloc((size_t)n * 2), *h2 = malloc((size_t)n * 2);
    uint64_t seed = 11;
    for (int64_t i = 0; i < n; i++) {
        uint64_t r = test_rand(&seed);
        /* mostly ordinary magnitudes, some tiny, some huge bit patterns */
        in[i] = (r & 7) ? (float)((double)(int64_t)(r >> 11) * 0x1p-60) : as_f32((uint32_t)(r >> 20));
        if (!isfinite(in[i]) || fabsf(in[i]) >= 65504.0f) in[i] = 1.5f;
    }
    kv_pool_t *pool = NULL;
    CHECK_EQ_INT(kv_pool_create(3, &pool), KV_OK);
    for (int32_t fmt = F16; fmt <= BF16; fmt++) {
        int64_t first = 5;
        CHECK_EQ_INT(kv_wire_pack(NULL, fmt, in, n, h, &first), KV_OK);
        CHECK_EQ_INT(first, -1);
        long bad = 0;
        for (int64_t i = 0; i < n; i++) bad += h[i] != kv_wire_from_float(fmt, in[i]);
        CHECK_EQ_INT(bad, 0);
        for (int isa = 1; isa <= kv_wire_best_isa(); isa++) {
            memset(h2, 0, (size_t)n * 2);
            CHECK_EQ_INT(kv_wire_pack_isa(isa, fmt, in, n, h2, &first), KV_OK);
            CHECK_EQ_INT(first, -1);
            CHECK(memcmp(h, h2, (size_t)n * 2) == 0);
            CHECK_EQ_INT(kv_wire_unpack_isa(isa, fmt, h, n, back, &first), KV_OK);
            CHECK_EQ_INT(first, -1);
            bad = 0;
            for (int64_t i = 0; i < n; i++)
                bad += !same_float(back[i], kv_wire_to_float(fmt, h[i]));
            CHECK_EQ_INT(bad, 0);
        }
        memset(h2, 0, (size_t)n * 2);
        CHECK_EQ_INT(kv_wire_pack(pool, fmt, in, n, h2, &first), KV_OK);
        CHECK(memcmp(h, h2, (size_t)n * 2) == 0);
        /* overflows at 300001 and 450000 (another range), NaN/Inf inputs before them
         * are not overflows */
        float keep[4] = {in[7], in[9], in[300001], in[450000]};
        in[7] = NAN;
        in[9] = -INFINITY;
        in[300001] = fmt == F16 ? -1e5f : -3.4e38f;
        in[450000] = fmt == F16 ? 70000.0f : 3.4e38f;
        for (int p = 0; p < 2; p++) {
            CHECK_EQ_INT(kv_wire_pack(p ? pool : NULL, fmt, in, n, h2, &first), KV_OK);
            CHECK_EQ_INT(first, 300001);
            CHECK_EQ_INT(kv_wire_unpack(p ? pool : NULL, fmt, h2, n, back, &first), KV_OK);
            CHECK_EQ_INT(first, 7);
            CHECK(isnan(back[7]) && back[9] == -INFINITY && back[300001] == -INFINITY &&
                  back[450000] == INFINITY);
        }
        CHECK_EQ_INT(kv_wire_pack(pool, fmt, in + 300002, n - 300002, h2, &first), KV_OK);
        CHECK_EQ_INT(first, 450000 - 300002);
        CHECK_EQ_INT(kv_wire_unpack(pool, fmt, h2, n - 300002, back, &first), KV_OK);
        CHECK_EQ_INT(first, 450000 - 300002);
        in[7] = keep[0], in[9] = keep[1], in[300001] = keep[2], in[450000] = keep[3];
        /* short and empty payloads */
        CHECK_EQ_INT(kv_wire_pack(pool, fmt, in, 3, h2, &first), KV_OK);
        CHECK(h2[0] == h[0] && h2[2] == h[2]);
        CHECK_EQ_INT(kv_wire_pack(pool, fmt, NULL, 0, NULL, &first), KV_OK);
        CHECK_EQ_INT(first, -1);
        CHECK_EQ_INT(kv_wire_unpack(NULL, fmt, NULL, 0, NULL, &first), KV_OK);
    }
    /* bad arguments */
    int64_t first;
    CHECK_EQ_INT(kv_wire_pack(NULL, KV_WIRE_F32, in, 4, h, &first), KV_EINVAL);
    CHECK_EQ_INT(kv_wire_pack(NULL, 3, in, 4, h, &first), KV_EINVAL);
    CHECK_EQ_INT(kv_wire_pack(NULL, F16, in, -1, h, &first), KV_EINVAL);
    CHECK_EQ_INT(kv_wire_pack(NULL, F16, NULL, 4, h, &first), KV_EINVAL);
    CHECK_EQ_INT(kv_wire_pack(NULL, F16, in, 4, NULL, &first), KV_EINVAL);
    CHECK_EQ_INT(kv_wire_pack(NULL, F16, in, 4, h, NULL), KV_EINVAL);
    CHECK_EQ_INT(kv_wire_unpack(NULL, BF16, h, 4, NULL, &first), KV_EINVAL);
    CHECK_EQ_INT(kv_wire_unpack(NULL, -1, h, 4, back, &first), KV_EINVAL);
    CHECK_EQ_INT(kv_wire_pack_isa(0, F16, in, 4, h, &first), KV_EINVAL);
    CHECK_EQ_INT(kv_wire_pack_isa(kv_wire_best_isa() + 1, F16, in, 4, h, &first), KV_EINVAL);
    CHECK_EQ_INT(kv_wire_unpack_isa(4, F16, h, 4, back, &first), KV_EINVAL);
    kv_pool_destroy(pool);
    free(in);
    free(back);
    free(h);
    free(h2);
}

/* The reference value of x in an fp16 segment of exponent k. */
static float ref_seg_f16(float x, int32_t k) {
    float s = (float)ldexp(1.0, k);
    uint16_t h = ref_f16(x * s);
    float v = kv_wire_to_float(F16, h);
    return isnan(v) ? v : (float)((double)v * ldexp(1.0, -k));
}

static void test_exponents(void) {
    float one[3] = {0.5f, -1.0f, 0.25f};
    CHECK_EQ_INT(kv_wire_exponent(one, 3), 14);            /* 1 * 2^14 = 16384 */
    float f[2] = {0.75f, NAN};
    CHECK_EQ_INT(kv_wire_exponent(f, 2), 15);              /* NaN is not counted */
    float big[2] = {65504.0f, -INFINITY};
    CHECK_EQ_INT(kv_wire_exponent(big, 2), -1);
    float huge[1] = {-3.0e38f};
    CHECK_EQ_INT(kv_wire_exponent(huge, 1), -113);
    float tiny[2] = {as_f32(0x00000005u), 0.0f};           /* a float32 subnormal */
    CHECK_EQ_INT(kv_wire_exponent(tiny, 2), KV_WIRE_MAX_EXP);
    float zeros[2] = {0.0f, -0.0f};
    CHECK_EQ_INT(kv_wire_exponent(zeros, 2), 0);
    CHECK_EQ_INT(kv_wire_exponent(zeros, 0), 0);
    CHECK_EQ_INT(kv_wire_exponent(NULL, 5), 0);
    float grad[2] = {3e-6f, -2e-5f};                        /* 2e-5 ~ 1.31 * 2^-16 */
    CHECK_EQ_INT(kv_wire_exponent(grad, 2), 30);
}

static void test_segments(void) {
    /* segments: gradient-sized, row-sized, empty, huge, with NaN/Inf, one value */
    enum { NSEG = 7 };
    int64_t seg[NSEG] = {5000, 3000, 0, 700, 9, 0, 1};
    int64_t total = 0, wire = 0;
    for (int s = 0; s < NSEG; s++) {
        total += seg[s];
        wire += seg[s] + (seg[s] > 0);
    }
    float *in = malloc((size_t)total * sizeof(float)), *back = malloc((size_t)total * sizeof(float));
    uint16_t *h = malloc((size_t)wire * 2), *h2 = malloc((size_t)wire * 2);
    uint64_t seed = 5;
    int64_t a = 0;
    for (int s = 0; s < NSEG; s++)
        for (int64_t i = 0; i < seg[s]; i++, a++) {
            double u = (double)(test_rand(&seed) >> 11) * 0x1p-53 * 2 - 1;
            double scale = s == 0 ? 2e-5 : s == 1 ? 0.3 : s == 3 ? 1e30 : 1.0;
            in[a] = (float)(u * scale);
        }
    int64_t at4 = 5000 + 3000 + 700;
    in[at4 + 2] = NAN;
    in[at4 + 5] = -INFINITY;
    int64_t first = 7;
    CHECK_EQ_INT(kv_wire_pack_segments(NULL, F16, in, seg, NSEG, h, &first), KV_OK);
    CHECK_EQ_INT(first, -1);                                /* nothing overflows */
    /* layout: [k][values] per non-empty segment; values are the reference's */
    long bad = 0, worse = 0;
    int64_t w = 0;
    a = 0;
    double worst = 0;
    for (int s = 0; s < NSEG; s++) {
        if (!seg[s]) continue;
        int32_t k = kv_wire_exponent(in + a, seg[s]);
        bad += (int16_t)h[w] != k;
        w++;
        float m = 0;
        for (int64_t i = 0; i < seg[s]; i++)
            if (isfinite(in[a + i]) && fabsf(in[a + i]) > m) m = fabsf(in[a + i]);
        for (int64_t i = 0; i < seg[s]; i++, a++, w++) {
            float want = ref_seg_f16(in[a], k), got = kv_wire_to_float(F16, h[w]) * (float)ldexp(1.0, -k);
            bad += isnan(want) ? !isnan(got) : !same_float(want, got);
            /* fp16's 11 bits relative to the segment's largest, whatever its size */
            if (isfinite(in[a]) && fabs((double)in[a]) >= m * 0x1p-10) {
                double rel = fabs((double)got - in[a]) / fabs((double)in[a]);
                worst = rel > worst ? rel : worst;
            }
        }
    }
    CHECK_EQ_INT(bad, 0);
    CHECK_EQ_INT(w, wire);
    CHECK(worst <= 0x1p-11);
    /* plain fp16 (no scale) loses the small gradients that segments keep */
    for (int64_t i = 0; i < 5000; i++) {
        float plain = kv_wire_to_float(F16, kv_wire_from_float(F16, in[i]));
        worse += fabs((double)plain - in[i]) > fabs((double)in[i]) * 0x1p-11;
    }
    CHECK(worse > 1000);
    CHECK_EQ_INT(kv_wire_unpack_segments(NULL, F16, h, seg, NSEG, back, &first), KV_OK);
    CHECK_EQ_INT(first, at4 + 2);
    bad = 0;
    a = 0;
    for (int s = 0; s < NSEG; s++) {
        int32_t k = seg[s] ? kv_wire_exponent(in + a, seg[s]) : 0;
        for (int64_t i = 0; i < seg[s]; i++, a++) {
            float want = ref_seg_f16(in[a], k);
            bad += isnan(want) ? !isnan(back[a]) : !same_float(want, back[a]);
        }
    }
    CHECK_EQ_INT(bad, 0);
    CHECK(back[at4 + 5] == -INFINITY);
    /* a pool gives the same bits (enough values to use it) */
    kv_pool_t *pool = NULL;
    CHECK_EQ_INT(kv_pool_create(3, &pool), KV_OK);
    int64_t bigseg[3] = {400000, 0, 300000};
    float *bin = malloc(700000 * sizeof(float)), *bback = malloc(700000 * sizeof(float)),
          *bback2 = malloc(700000 * sizeof(float));
    uint16_t *bh = malloc(700002 * 2), *bh2 = malloc(700002 * 2);
    for (int64_t i = 0; i < 700000; i++)
        bin[i] = (float)(((double)(test_rand(&seed) >> 11) * 0x1p-53 - 0.5) * (i < 400000 ? 1e-4 : 3.0));
    for (int32_t fmt = F16; fmt <= BF16; fmt++) {
        int64_t n = fmt == F16 ? 700002 : 700000, f1, f2;
        CHECK_EQ_INT(kv_wire_pack_segments(NULL, fmt, bin, bigseg, 3, bh, &f1), KV_OK);
        CHECK_EQ_INT(kv_wire_pack_segments(pool, fmt, bin, bigseg, 3, bh2, &f2), KV_OK);
        CHECK(memcmp(bh, bh2, (size_t)n * 2) == 0 && f1 == -1 && f2 == -1);
        CHECK_EQ_INT(kv_wire_unpack_segments(NULL, fmt, bh, bigseg, 3, bback, &f1), KV_OK);
        CHECK_EQ_INT(kv_wire_unpack_segments(pool, fmt, bh, bigseg, 3, bback2, &f2), KV_OK);
        CHECK(memcmp(bback, bback2, 700000 * sizeof(float)) == 0 && f1 == -1 && f2 == -1);
    }
    /* bf16 segments: the plain concatenation, no header; an overflow is reported */
    CHECK_EQ_INT(kv_wire_pack_segments(NULL, BF16, in, seg, NSEG, h, &first), KV_OK);
    CHECK_EQ_INT(kv_wire_pack(NULL, BF16, in, total, h2, &first), KV_OK);
    CHECK(memcmp(h, h2, (size_t)total * 2) == 0);
    float keep = in[6000];
    in[6000] = 3.4e38f;
    CHECK_EQ_INT(kv_wire_pack_segments(NULL, BF16, in, seg, NSEG, h, &first), KV_OK);
    CHECK_EQ_INT(first, 6000);
    CHECK_EQ_INT(kv_wire_pack_segments(NULL, F16, in, seg, NSEG, h, &first), KV_OK);
    CHECK_EQ_INT(first, -1);                                /* fp16 scales it down */
    in[6000] = keep;
    /* empty payloads and bad arguments */
    int64_t none[2] = {0, 0};
    CHECK_EQ_INT(kv_wire_pack_segments(NULL, F16, NULL, none, 2, NULL, &first), KV_OK);
    CHECK_EQ_INT(first, -1);
    CHECK_EQ_INT(kv_wire_unpack_segments(NULL, F16, NULL, none, 0, NULL, &first), KV_OK);
    int64_t neg[2] = {3, -1};
    CHECK_EQ_INT(kv_wire_pack_segments(NULL, F16, in, neg, 2, h, &first), KV_EINVAL);
    CHECK_EQ_INT(kv_wire_pack_segments(NULL, KV_WIRE_F32, in, seg, NSEG, h, &first), KV_EINVAL);
    CHECK_EQ_INT(kv_wire_pack_segments(NULL, F16, in, NULL, 2, h, &first), KV_EINVAL);
    CHECK_EQ_INT(kv_wire_pack_segments(NULL, F16, NULL, seg, NSEG, h, &first), KV_EINVAL);
    CHECK_EQ_INT(kv_wire_unpack_segments(NULL, F16, h, seg, NSEG, NULL, &first), KV_EINVAL);
    CHECK_EQ_INT(kv_wire_unpack_segments(NULL, F16, h, seg, NSEG, back, NULL), KV_EINVAL);
    kv_pool_destroy(pool);
    free(in);
    free(back);
    free(h);
    free(h2);
    free(bin);
    free(bback);
    free(bback2);
    free(bh);
    free(bh2);
}

int main(void) {
    build_f16_table();
    test_round_trip();
    test_ties();
    test_specials();
    test_subnormals();
    test_sweep();
    test_batch();
    test_exponents();
    test_segments();
    return test_summary();
}
