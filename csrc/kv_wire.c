/*
 * kv_wire.c - float32 <-> fp16 / bf16 for the exchange's payloads (see kv_wire.h).
 *
 * Every conversion is branch-free per element (each case is computed and the right one
 * selected), so the compiler vectorises the loops; the baseline, AVX2 and AVX-512 copies
 * are the same C and give the same bits.
 *
 * float32 -> fp16 (F. Giesen's float_to_half_fast3_rtne, as selects). With a = |x|'s bits:
 *   a >= 2^16 (0x47800000)       Inf, or a quiet NaN (0x7e00) when x is NaN;
 *   2^-14 <= a < 2^16            normal: rebias the exponent (-112 << 23) and round the
 *                                13 dropped bits to nearest even by adding 0xfff plus the
 *                                kept lsb before the shift; a carry into the exponent is
 *                                the correct round-up, and [65520, 65536) carries into
 *                                exponent 31, i.e. Inf (the overflow the caller is told of);
 *   a < 2^-14                    subnormal or zero: a + 0.5f in float arithmetic leaves the
 *                                value's multiples of 2^-24 (fp16's subnormal step) in the
 *                                low mantissa bits, rounded to nearest even by the FPU
 *                                (round-to-nearest is every C program's default mode);
 *                                subtracting 0.5f's bits leaves the fp16 bits (up to 0x0400,
 *                                the smallest normal, when it rounds up). Flush-to-zero and
 *                                denormals-are-zero modes cannot change it: 0.5f + a is
 *                                normal, and a float32 subnormal rounds to 0 in fp16 anyway.
 * fp16 -> float32 (exact): the 15 low bits shifted into place and the exponent rebiased;
 *   exponent 31 (Inf/NaN) rebiased once more to 255; exponent 0 (zero/subnormal)
 *   renormalised by a float subtraction of 2^-14, exact (both normal).
 * float32 -> bf16: NaN keeps its sign and top payload bits, made quiet (0x0040); else the
 *   16 dropped bits are rounded to nearest even in integer arithmetic (add 0x7fff plus
 *   the kept lsb), a carry into the exponent being the correct round-up (and
 *   0x7f7f8000 or more, finite, becoming Inf: the overflow). bf16 -> float32: << 16.
 *
 * Overflow (and, unpacking, non-finite) detection ORs a flag over blocks of BLOCK
 * values inside the vector loop and scans a flagged block again for its first index.
 */
#include "kv_wire.h"

#include <string.h>

#include "kv_fmath.h"
#include "kv_isa.h"

#define BLOCK 4096       /* values per flag check */
#define RANGE 262144     /* values per pool task, at least (a pool pays for 1 MB) */

/* ---- one value ------------------------------------------------------------------------ */

/* All ones where c holds: selects as masks, so no branch is left for the vectoriser (a
 * ternary over a float operation stays a branch under -ftrapping-math). */
KV_INLINE uint32_t mask_of(int c) { return 0u - (uint32_t)c; }

KV_INLINE uint32_t pick(uint32_t m, uint32_t yes, uint32_t no) { return (yes & m) | (no & ~m); }

KV_INLINE uint32_t f16_of(uint32_t x) {
    uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    uint32_t sub = as_u32(as_f32(a) + 0.5f) - 0x3f000000u;
    uint32_t nrm = (a + 0xc8000fffu + ((a >> 13) & 1u)) >> 13;
    uint32_t big = 0x7c00u | (mask_of(a > 0x7f800000u) & 0x0200u);
    uint32_t h = pick(mask_of(a < 0x38800000u), sub, nrm);
    return pick(mask_of(a >= 0x47800000u), big, h) | sign;
}

KV_INLINE uint32_t f32_of_f16(uint32_t h) {
    uint32_t o = (h & 0x7fffu) << 13, e = o & 0x0f800000u;
    uint32_t nrm = o + 0x38000000u; /* the exponent rebiased: + (127 - 15) << 23 */
    uint32_t inf = o + 0x70000000u; /* 31 -> 255: twice that */
    uint32_t sub = as_u32(as_f32(o + 0x38800000u) - 0x1p-14f);
    uint32_t v = pick(mask_of(e == 0x0f800000u), inf, pick(mask_of(e == 0), sub, nrm));
    return v | ((h & 0x8000u) << 16);
}

KV_INLINE uint32_t bf16_of(uint32_t x) {
    uint32_t a = x & 0x7fffffffu;
    uint32_t r = (x + 0x7fffu + ((x >> 16) & 1u)) >> 16;
    uint32_t nan = (x >> 16) | 0x0040u;
    return pick(mask_of(a > 0x7f800000u), nan, r);
}

/* ---- the kernels (one body, compiled per ISA) ----------------------------------------- */

/* fp16: of in[i] * scale (a power of two: exact, as is the product back on unpacking);
 * bf16: of in[i] (never scaled). Whether any value overflowed: a finite input whose
 * output is Inf. */
KV_INLINE int pack_f16_block(const float *in, size_t n, float scale, uint16_t *out) {
    uint32_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t x = as_u32(in[i]), h = f16_of(as_u32(in[i] * scale));
        out[i] = (uint16_t)h;
        bad |= (uint32_t)((x & 0x7fffffffu) < 0x7f800000u) & (uint32_t)((h & 0x7fffu) == 0x7c00u);
    }
    return bad != 0;
}

KV_INLINE int pack_bf16_block(const float *in, size_t n, uint16_t *out) {
    uint32_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t x = as_u32(in[i]), h = bf16_of(x);
        out[i] = (uint16_t)h;
        bad |= (uint32_t)((x & 0x7fffffffu) < 0x7f800000u) & (uint32_t)((h & 0x7fffu) == 0x7f80u);
    }
    return bad != 0;
}

/* Whether any output is NaN or Inf. */
KV_INLINE int unpack_f16_block(const uint16_t *in, size_t n, float inv, float *out) {
    uint32_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        float v = as_f32(f32_of_f16(in[i])) * inv;
        out[i] = v;
        bad |= (uint32_t)((as_u32(v) & 0x7f800000u) == 0x7f800000u);
    }
    return bad != 0;
}

KV_INLINE int unpack_bf16_block(const uint16_t *in, size_t n, float *out) {
    uint32_t bad = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t h = in[i];
        out[i] = as_f32(h << 16);
        bad |= (uint32_t)((h & 0x7f80u) == 0x7f80u);
    }
    return bad != 0;
}

/* The largest finite magnitude of in[0 .. n), as float bits (0: none, or all zeros). */
KV_INLINE uint32_t max_finite_bits(const float *in, size_t n) {
    uint32_t m = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t a = as_u32(in[i]) & 0x7fffffffu;
        a &= mask_of(a < 0x7f800000u);
        m = a > m ? a : m;
    }
    return m;
}

/* The first index in a flagged block (scalar: only on the error path). */
static int64_t first_overflow(int32_t fmt, const float *in, size_t n, float scale) {
    for (size_t i = 0; i < n; i++) {
        uint32_t x = as_u32(in[i]);
        uint32_t h = fmt == KV_WIRE_F16 ? f16_of(as_u32(in[i] * scale)) : bf16_of(x);
        uint32_t inf = fmt == KV_WIRE_F16 ? 0x7c00u : 0x7f80u;
        if ((x & 0x7fffffffu) < 0x7f800000u && (h & 0x7fffu) == inf) return (int64_t)i;
    }
    return -1;
}

static int64_t first_nonfinite(const float *out, size_t n) {
    for (size_t i = 0; i < n; i++)
        if ((as_u32(out[i]) & 0x7f800000u) == 0x7f800000u) return (int64_t)i;
    return -1;
}

#define DEFINE_KERNELS(SUFFIX, ATTR)                                                      \
    ATTR static int64_t pack_##SUFFIX(int32_t fmt, const float *in, int64_t n,           \
                                      float scale, uint16_t *out) {                       \
        int64_t found = -1;                                                               \
        for (int64_t b = 0; b < n; b += BLOCK) {                                          \
            size_t m = (size_t)(n - b < BLOCK ? n - b : BLOCK);                           \
            int bad = fmt == KV_WIRE_F16 ? pack_f16_block(in + b, m, scale, out + b)      \
                                         : pack_bf16_block(in + b, m, out + b);           \
            if (bad && found < 0) found = b + first_overflow(fmt, in + b, m, scale);      \
        }                                                                                 \
        return found;                                                                     \
    }                                                                                     \
    ATTR static int64_t unpack_##SUFFIX(int32_t fmt, const uint16_t *in, int64_t n,      \
                                        float inv, float *out) {                          \
        int64_t found = -1;                                                               \
        for (int64_t b = 0; b < n; b += BLOCK) {                                          \
            size_t m = (size_t)(n - b < BLOCK ? n - b : BLOCK);                           \
            int bad = fmt == KV_WIRE_F16 ? unpack_f16_block(in + b, m, inv, out + b)      \
                                         : unpack_bf16_block(in + b, m, out + b);         \
            if (bad && found < 0) found = b + first_nonfinite(out + b, m);                \
        }                                                                                 \
        return found;                                                                     \
    }                                                                                     \
    ATTR static uint32_t maxbits_##SUFFIX(const float *in, int64_t n) {                  \
        uint32_t m = 0;                                                                   \
        for (int64_t b = 0; b < n; b += BLOCK) {                                          \
            uint32_t x = max_finite_bits(in + b, (size_t)(n - b < BLOCK ? n - b : BLOCK)); \
            m = x > m ? x : m;                                                            \
        }                                                                                 \
        return m;                                                                         \
    }

DEFINE_KERNELS(base, )
#if KV_ISA_CLONES
DEFINE_KERNELS(avx2, KV_TARGET_AVX2)
DEFINE_KERNELS(avx512, KV_TARGET_AVX512)
#endif

typedef struct {
    int64_t (*pack)(int32_t, const float *, int64_t, float, uint16_t *);
    int64_t (*unpack)(int32_t, const uint16_t *, int64_t, float, float *);
    uint32_t (*maxbits)(const float *, int64_t);
} kernels_t;

static const kernels_t K_BASE = {pack_base, unpack_base, maxbits_base};
#if KV_ISA_CLONES
static const kernels_t K_AVX2 = {pack_avx2, unpack_avx2, maxbits_avx2};
static const kernels_t K_AVX512 = {pack_avx512, unpack_avx512, maxbits_avx512};
#endif

static int g_best_isa; /* 0 until the first call works it out */

int kv_wire_best_isa(void) {
    int isa = __atomic_load_n(&g_best_isa, __ATOMIC_RELAXED);
    if (!isa) {
        isa = kv_isa_detect();
        __atomic_store_n(&g_best_isa, isa, __ATOMIC_RELAXED);
    }
    return isa;
}

static const kernels_t *kernels_for(int isa) {
    switch (isa) {
#if KV_ISA_CLONES
    case KV_ISA_AVX512: return &K_AVX512;
    case KV_ISA_AVX2: return &K_AVX2;
#endif
    default: return &K_BASE;
    }
}

/* ---- segments: one per destination, fp16 with its own power-of-two scale -------------- */

static int32_t kv_wire_exponent_with(const kernels_t *kern, const float *in, int64_t n) {
    uint32_t m = kern->maxbits(in, n);
    if (!m) return 0;
    int32_t k = 141 - (int32_t)(m >> 23); /* 14 - floor(log2 m) for a normal m */
    return k < -KV_WIRE_MAX_EXP ? -KV_WIRE_MAX_EXP : (k > KV_WIRE_MAX_EXP ? KV_WIRE_MAX_EXP : k);
}

int32_t kv_wire_exponent(const float *in, int64_t n) {
    return in && n > 0 ? kv_wire_exponent_with(kernels_for(kv_wire_best_isa()), in, n) : 0;
}

static float pow2(int32_t k) { return as_f32((uint32_t)(127 + k) << 23); } /* |k| <= 126 */

typedef struct {
    const kernels_t *k;
    int32_t fmt, headers; /* headers: fp16 segments carry their exponent */
    const int64_t *seg, *at, *wat; /* values per segment, where its values / wire values start */
    const float *fin;
    const uint16_t *hin;
    float *fout;
    uint16_t *hout;
    int64_t *found; /* per segment */
} seg_job_t;

static void pack_seg(void *arg, int64_t s) {
    seg_job_t *j = arg;
    int64_t n = j->seg[s], f = -1;
    if (n > 0) {
        const float *in = j->fin + j->at[s];
        uint16_t *out = j->hout + j->wat[s];
        int32_t e = 0;
        if (j->headers) {
            e = kv_wire_exponent_with(j->k, in, n);
            *out++ = (uint16_t)(int16_t)e;
        }
        f = j->k->pack(j->fmt, in, n, pow2(e), out);
    }
    j->found[s] = f < 0 ? -1 : j->at[s] + f;
}

static void unpack_seg(void *arg, int64_t s) {
    seg_job_t *j = arg;
    int64_t n = j->seg[s], f = -1;
    if (n > 0) {
        const uint16_t *in = j->hin + j->wat[s];
        int32_t e = 0;
        if (j->headers) {
            e = (int16_t)*in++;
            if (e < -KV_WIRE_MAX_EXP || e > KV_WIRE_MAX_EXP) e = 0; /* never sent */
        }
        f = j->k->unpack(j->fmt, in, n, pow2(-e), j->fout + j->at[s]);
    }
    j->found[s] = f < 0 ? -1 : j->at[s] + f;
}

/* Run pack_seg or unpack_seg over every segment (on the pool when there is enough work);
 * *first: the smallest index any segment flagged, or -1. */
static int run_segments(kv_pool_t *pool, seg_job_t *j, int64_t nseg, int64_t total,
                        void (*fn)(void *, int64_t), int64_t *first) {
    int64_t *buf = kv_malloc((size_t)(3 * nseg + 1) * sizeof(int64_t));
    if (!buf) return KV_ENOMEM;
    int64_t *at = buf, *wat = buf + nseg, *found = buf + 2 * nseg;
    int64_t a = 0, w = 0;
    for (int64_t s = 0; s < nseg; s++) {
        at[s] = a;
        wat[s] = w;
        a += j->seg[s];
        w += j->seg[s] + (j->headers && j->seg[s] > 0);
    }
    j->at = at;
    j->wat = wat;
    j->found = found;
    kv_pool_t *p = total >= 2 * RANGE && nseg > 1 && kv_pool_threads(pool) > 1 ? pool : NULL;
    kv_pool_run(p, nseg, fn, j);
    *first = -1;
    for (int64_t s = 0; s < nseg; s++)
        if (found[s] >= 0 && (*first < 0 || found[s] < *first)) *first = found[s];
    kv_free(buf);
    return KV_OK;
}

static int bad_segments(int32_t fmt, const void *in, const int64_t *seg, int64_t nseg,
                        const void *out, const int64_t *first, int64_t *total) {
    if ((fmt != KV_WIRE_F16 && fmt != KV_WIRE_BF16) || nseg < 0 || !first ||
        (nseg > 0 && !seg))
        return 1;
    int64_t t = 0;
    for (int64_t s = 0; s < nseg; s++) {
        if (seg[s] < 0 || seg[s] > INT64_MAX / 4 - t) return 1;
        t += seg[s];
    }
    *total = t;
    return t > 0 && (!in || !out);
}

int kv_wire_pack_segments(kv_pool_t *pool, int32_t fmt, const float *in, const int64_t *seg,
                          int64_t nseg, uint16_t *out, int64_t *first) {
    int64_t total = 0;
    if (bad_segments(fmt, in, seg, nseg, out, first, &total)) return KV_EINVAL;
    seg_job_t j = {.k = kernels_for(kv_wire_best_isa()), .fmt = fmt,
                   .headers = fmt == KV_WIRE_F16, .seg = seg, .fin = in, .hout = out};
    return run_segments(pool, &j, nseg, total, pack_seg, first);
}

int kv_wire_unpack_segments(kv_pool_t *pool, int32_t fmt, const uint16_t *in,
                            const int64_t *seg, int64_t nseg, float *out, int64_t *first) {
    int64_t total = 0;
    if (bad_segments(fmt, in, seg, nseg, out, first, &total)) return KV_EINVAL;
    seg_job_t j = {.k = kernels_for(kv_wire_best_isa()), .fmt = fmt,
                   .headers = fmt == KV_WIRE_F16, .seg = seg, .hin = in, .fout = out};
    return run_segments(pool, &j, nseg, total, unpack_seg, first);
}

/* ---- plain payloads (no scale, no header) ---------------------------------------------- */

static int bad_args(int32_t fmt, const void *in, int64_t n, const void *out,
                    const int64_t *first) {
    return (fmt != KV_WIRE_F16 && fmt != KV_WIRE_BF16) || n < 0 || !first ||
           (n > 0 && (!in || !out));
}

typedef struct {
    const kernels_t *k;
    int32_t fmt, packing;
    int64_t n, piece;
    const float *fin;
    const uint16_t *hin;
    float *fout;
    uint16_t *hout;
    int64_t *found; /* per task */
} wire_job_t;

static void wire_task(void *arg, int64_t q) {
    wire_job_t *j = arg;
    int64_t a = q * j->piece, m = a + j->piece < j->n ? j->piece : j->n - a;
    int64_t f = j->packing ? j->k->pack(j->fmt, j->fin + a, m, 1.0f, j->hout + a)
                           : j->k->unpack(j->fmt, j->hin + a, m, 1.0f, j->fout + a);
    j->found[q] = f < 0 ? -1 : a + f;
}

/* Run a conversion over the pool by ranges; the first flagged index, or -1. */
static int run(kv_pool_t *pool, wire_job_t *j, int64_t *first) {
    int32_t threads = kv_pool_threads(pool);
    int64_t tasks = j->n >= 2 * RANGE && threads > 1 ? threads : 1;
    int64_t one = -1;
    j->piece = tasks > 1 ? (j->n + tasks - 1) / tasks : j->n;
    j->found = tasks > 1 ? kv_malloc((size_t)tasks * sizeof(int64_t)) : &one;
    if (!j->found) { /* no memory for the flags: one thread then */
        tasks = 1;
        j->piece = j->n;
        j->found = &one;
    }
    if (tasks > 1)
        kv_pool_run(pool, tasks, wire_task, j);
    else if (j->n > 0)
        wire_task(j, 0);
    *first = -1;
    for (int64_t q = 0; q < tasks; q++)
        if (j->found[q] >= 0) {
            *first = j->found[q];
            break;
        }
    if (j->found != &one) kv_free(j->found);
    return KV_OK;
}

int kv_wire_pack(kv_pool_t *pool, int32_t fmt, const float *in, int64_t n, uint16_t *out,
                 int64_t *first) {
    if (bad_args(fmt, in, n, out, first)) return KV_EINVAL;
    wire_job_t j = {.k = kernels_for(kv_wire_best_isa()), .fmt = fmt, .packing = 1, .n = n,
                    .fin = in, .hout = out};
    return run(pool, &j, first);
}

int kv_wire_unpack(kv_pool_t *pool, int32_t fmt, const uint16_t *in, int64_t n, float *out,
                   int64_t *first) {
    if (bad_args(fmt, in, n, out, first)) return KV_EINVAL;
    wire_job_t j = {.k = kernels_for(kv_wire_best_isa()), .fmt = fmt, .n = n, .hin = in,
                    .fout = out};
    return run(pool, &j, first);
}

int kv_wire_pack_isa(int32_t isa, int32_t fmt, const float *in, int64_t n, uint16_t *out,
                     int64_t *first) {
    if (bad_args(fmt, in, n, out, first) || isa < KV_ISA_BASE || isa > kv_wire_best_isa())
        return KV_EINVAL;
    wire_job_t j = {.k = kernels_for(isa), .fmt = fmt, .packing = 1, .n = n, .fin = in,
                    .hout = out};
    return run(NULL, &j, first);
}

int kv_wire_unpack_isa(int32_t isa, int32_t fmt, const uint16_t *in, int64_t n, float *out,
                       int64_t *first) {
    if (bad_args(fmt, in, n, out, first) || isa < KV_ISA_BASE || isa > kv_wire_best_isa())
        return KV_EINVAL;
    wire_job_t j = {.k = kernels_for(isa), .fmt = fmt, .n = n, .hin = in, .fout = out};
    return run(NULL, &j, first);
}

uint16_t kv_wire_from_float(int32_t fmt, float x) {
    return (uint16_t)(fmt == KV_WIRE_BF16 ? bf16_of(as_u32(x)) : f16_of(as_u32(x)));
}

float kv_wire_to_float(int32_t fmt, uint16_t h) {
    return as_f32(fmt == KV_WIRE_BF16 ? (uint32_t)h << 16 : f32_of_f16(h));
}
