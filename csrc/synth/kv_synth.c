/*
 * kv_synth.c - the per-sample kernel of kvcoll.data.SyntheticCTR (see kv_synth.h).
 *
 * Samples are generated in blocks of BLOCK, and inside a block every array is
 * field-major (the value of field f of sample s at [f * BLOCK + s]): each loop runs
 * over the samples of the block with one field's constants fixed, so the compiler
 * vectorises it across samples. A block goes through these stages (run_block):
 *   1. the channel hashes;
 *   2. the Zipf draw, x = exp(t) with t = e * log(1 + u * c) (or t = u * c), in
 *      branch-free double arithmetic: inline log and exp (FreeBSD/musl's e_log.c and
 *      e_exp.c, errors below 1 ulp);
 *   3. rank = min(floor(x) - 1, vocab - 1). It uses x only when x and its error bound
 *      (far above the real errors of the inline functions and of libm's) fall on the
 *      same side of an integer; otherwise, about once in 10^10 draws, libm's pow or
 *      exp computes x again, so the ranks are exactly those of the formula evaluated
 *      with libm;
 *   4. the scrambling of the ranks into ids;
 *   5. the numbers, in float32 steps as numpy's float32 ufuncs take them, with inline
 *      logf, cosf, expf and log1pf (FreeBSD's algorithms; about an ulp each);
 *   6. the planted logits (block_logit, shared with kv_synth_logit);
 *   7. the labels: an inline tanh, and libm's where the uniform is within 2^-44 of
 *      the probability, so they are exactly the labels of the libm formula.
 * block_logit replays numpy's float32 reference step by step, its row sums included
 * (numpy's pairwise summation, done for all the samples of the block at once by
 * pairwise_cols), so its logit is bit for bit numpy's on the same ranks and numbers.
 *
 * On x86-64 the block functions are compiled twice more, for AVX2 and for AVX-512,
 * and picked at run time from the CPU (__builtin_cpu_supports). All three compute
 * the same bits: no value of a sample depends on another sample, every float
 * operation is an IEEE one on one lane, nothing is reassociated (no -ffast-math)
 * and nothing is contracted into an FMA (ISO C mode, or the pragma; see
 * KV_ISA_CLONES). Loops are written for GCC's vectoriser: selects between
 * values, never a float operation under a condition (which it will not if-convert
 * under the default -ftrapping-math).
 */
#include "kv_synth.h"
#include "kv_fmath.h"
#include "kv_isa.h"

#include <float.h>
#include <math.h>
#include <string.h>

#if KV_SYNTH_ISA_BASE != KV_ISA_BASE || KV_SYNTH_ISA_AVX2 != KV_ISA_AVX2 || \
    KV_SYNTH_ISA_AVX512 != KV_ISA_AVX512
#error "KV_SYNTH_ISA_* must number the copies as kv_isa.h does"
#endif

#define GAMMA 0x9E3779B97F4A7C15ULL /* 2^64 / golden ratio */
#define MIX1 0xBF58476D1CE4E5B9ULL
#define MIX2 0x94D049BB133111EBULL
#define BLOCK 32                    /* samples per block */
#define RANK_SCALE ((float)(1.0 / 200.0))
#define TWO_PI_2_24 ((float)(2.0 * 3.141592653589793 / 16777216.0))
#define TWO_52 0x1p52
#define TWO_62 ((uint64_t)1 << 62)
#define RANK_UNSURE UINT64_MAX      /* stage 3: let libm decide */


/* splitmix64's finaliser (not kv_mix64: the data set is defined with this one). */
static inline uint64_t splitmix(uint64_t x) {
    x ^= x >> 30;
    x *= MIX1;
    x ^= x >> 27;
    x *= MIX2;
    x ^= x >> 31;
    return x;
}

static inline double as_f64(uint64_t b) {
    double d;
    memcpy(&d, &b, sizeof d);
    return d;
}

static inline uint64_t as_u64(double d) {
    uint64_t b;
    memcpy(&b, &d, sizeof b);
    return b;
}

/* Exact conversions between integers below 2^52 and doubles through the 2^52 trick
 * (SSE2 and AVX2 have no 64-bit integer <-> double conversion to vectorise). */
static inline double u52_to_f64(uint64_t v) { return as_f64(as_u64(TWO_52) | v) - TWO_52; }

/* (h >> 11) * 2^-53: the 53-bit integer in two exact halves. */
static inline double unit53(uint64_t h) {
    uint64_t m = h >> 11;
    return u52_to_f64(m >> 1) * 0x1p-52 + u52_to_f64(m & 1) * 0x1p-53;
}

/* floor(y) for 0 <= y <= 2^52, as an integer. Written with selects between constants
 * only: GCC does not if-convert (so not vectorise) a float operation under a condition,
 * as it might trap. */
static inline uint64_t floor52(double y) {
    double b = y + TWO_52;                                   /* 2^52 + y rounded */
    uint64_t up = as_u64(b - TWO_52 > y ? 2.0 : 0.0) >> 62; /* 1 if rounded up */
    return as_u64(b) - as_u64(TWO_52) - up;
}

/* ---- inline double math, branch-free ------------------------------------------------ */

#define LN2_HI 6.93147180369123816490e-01 /* 0x3fe62e42 fee00000 */
#define LN2_LO 1.90821492927058770002e-10 /* 0x3dea39ef 35793c76 */
#define LG1 6.666666666666735130e-01
#define LG2 3.999999999940941908e-01
#define LG3 2.857142874366239149e-01
#define LG4 2.222219843214978396e-01
#define LG5 1.818357216161805012e-01
#define LG6 1.531383769920937332e-01
#define LG7 1.479819860511658591e-01

/* log(x) for normal x > 0 (FreeBSD e_log.c as in musl; error < 1 ulp). */
static inline double fast_log(double x) {
    uint64_t ix = as_u64(x) + ((uint64_t)(0x3ff00000 - 0x3fe6a09e) << 32);
    double k = as_f64(0x4330000000000000ULL | (ix >> 52)) - (0x1p52 + 1023.0);
    double f = as_f64((ix & 0x000fffffffffffffULL) + ((uint64_t)0x3fe6a09e << 32)) - 1.0;
    double hfsq = 0.5 * f * f;
    double s = f / (2.0 + f);
    double z = s * s;
    double w = z * z;
    double t1 = w * (LG2 + w * (LG4 + w * LG6));
    double t2 = z * (LG1 + w * (LG3 + w * (LG5 + w * LG7)));
    double r = t2 + t1;
    return s * (hfsq + r) + k * LN2_LO - hfsq + f + k * LN2_HI;
}

#define INV_LN2 1.44269504088896338700e+00
#define ROUND_SHIFT 0x1.8p52 /* x + ROUND_SHIFT - ROUND_SHIFT rounds x to an integer */
#define P1 1.66666666666666019037e-01
#define P2 -2.77777777770155933842e-03
#define P3 6.61375632143793436117e-05
#define P4 -1.65339022054652515390e-06
#define P5 4.13813679705723846039e-08

/* exp(x) for |x| <= 700 with a normal result (FreeBSD e_exp.c; error < 1 ulp). */
static inline double fast_exp(double x) {
    double kd = x * INV_LN2 + ROUND_SHIFT;
    uint64_t ki = as_u64(kd); /* low bits: k, two's complement */
    kd -= ROUND_SHIFT;
    double hi = x - kd * LN2_HI;
    double lo = kd * LN2_LO;
    double r = hi - lo;
    double rr = r * r;
    double c = r - rr * (P1 + rr * (P2 + rr * (P3 + rr * (P4 + rr * P5))));
    double y = 1.0 + (r * c / (2.0 - c) - lo + hi);
    return as_f64(as_u64(y) + (ki << 52)); /* y * 2^k */
}

/* ---- inline float math, branch-free (the numbers) ---------------------------------- */

/* log1pf(y) for y > 0: logf(1 + y) plus the rounding error of 1 + y to first order
 * (FreeBSD s_log1pf.c's correction). */
static inline float fast_log1pf(float y) {
    float u = 1.0f + y;
    float c = y - (u - 1.0f); /* exact: 1 + y = u + c */
    return kv_logf(u) + c / u;
}

#define INV_LN2F 1.4426950216e+0f
#define LN2F_HI_E 6.9314575195e-1f /* 0x3f317200 */
#define LN2F_LO_E 1.4286067653e-6f /* 0x35bfbe8e */
#define PF1 1.6666625440e-1f
#define PF2 -2.7667332906e-3f

/* expf(x) for |x| <= 64 (FreeBSD e_expf.c as in musl; error < 1 ulp). */
static inline float fast_expf(float x) {
    float kd = x * INV_LN2F + 0x1.8p23f;
    uint32_t ki = as_u32(kd);
    kd -= 0x1.8p23f;
    float hi = x - kd * LN2F_HI_E;
    float lo = kd * LN2F_LO_E;
    float r = hi - lo;
    float rr = r * r;
    float c = r - rr * (PF1 + rr * PF2);
    float y = 1.0f + (r * c / (2.0f - c) - lo + hi);
    return as_f32(as_u32(y) + (ki << 23));
}

#define TWO_OVER_PIF 0.63661977236758134f
#define PIO2F_1 1.5703125f                 /* pi/2 in three parts: 8 bits */
#define PIO2F_2 4.837512969970703125e-4f   /* 12 bits */
#define PIO2F_3 7.54978995489188216e-8f    /* the rest */
#define CF0 -0.499999997251031003120f      /* FreeBSD k_cosf.c, k_sinf.c */
#define CF1 0.0416666233237390631894f
#define CF2 -0.00138867637746099294692f
#define CF3 0.0000243904487962774090654f
#define SF1 -0.166666666416265235595f
#define SF2 0.0083333293858894631756f
#define SF3 -0.000198393348360966317347f
#define SF4 0.0000027183114939898219064f

/* cosf(x) for 0 <= x < 2^12: x - q pi/2 with pi/2 in three parts (the products are
 * exact), then cos or sin of the rest, |r| <= pi/4. */
static inline float fast_cosf(float x) {
    float kd = x * TWO_OVER_PIF + 0x1.8p23f;
    uint32_t q = as_u32(kd);
    kd -= 0x1.8p23f;
    float r = ((x - kd * PIO2F_1) - kd * PIO2F_2) - kd * PIO2F_3;
    float z = r * r;
    float w = z * z;
    float c = ((1.0f + z * CF0) + w * CF1) + (w * z) * (CF2 + z * CF3);
    float v = z * r;
    float s = (r + v * (SF1 + z * SF2)) + v * w * (SF3 + z * SF4);
    /* cos(r + q pi/2) = c, -s, -c, s for q mod 4 = 0, 1, 2, 3 */
    uint32_t odd = 0 - (q & 1);
    uint32_t bits = (as_u32(s) & odd) | (as_u32(c) & ~odd);
    return as_f32(bits ^ (((q + 1) & 2) << 30));
}

/* ---- the id pipeline --------------------------------------------------------------- */

/* numpy's min(uint64(x) - 1, vocab - 1) (x < 1 wraps to the top, like numpy). */
static inline uint64_t zipf_rank(double x, uint64_t vocab) {
    uint64_t r = (x >= 1.0 && x < 0x1p62) ? (uint64_t)(int64_t)x - 1 : UINT64_MAX;
    return r < vocab - 1 ? r : vocab - 1;
}

/* The rank of field f from libm: the definition the inline path must agree with. */
static uint64_t zipf_rank_libm(const kv_synth_t *m, int32_t f, uint64_t h) {
    double u = (double)(h >> 11) * 0x1p-53;
    double x = m->log_uniform ? exp(u * m->zipf_c[f])
                              : pow(1.0 + u * m->zipf_c[f], m->zipf_exponent);
    return zipf_rank(x, m->perm.vocab[f]);
}

/* One field's scrambling constants, gathered so a loop keeps them in registers. */
typedef struct {
    uint64_t vocab, mask, shift;
    uint64_t add[KV_SYNTH_PERM_ROUNDS], mul[KV_SYNTH_PERM_ROUNDS], inv[KV_SYNTH_PERM_ROUNDS];
    uint64_t rot[KV_SYNTH_PERM_ROUNDS - 1];
} field_perm_t;

static inline field_perm_t field_perm(const kv_synth_perm_t *p, int32_t f) {
    field_perm_t fp;
    size_t nf = (size_t)p->num_fields;
    fp.vocab = p->vocab[f];
    fp.mask = p->mask[f];
    fp.shift = p->shift[f];
    for (int r = 0; r < KV_SYNTH_PERM_ROUNDS; r++) {
        fp.add[r] = p->add[(size_t)r * nf + (size_t)f];
        fp.mul[r] = p->mul[(size_t)r * nf + (size_t)f];
        fp.inv[r] = p->inv[(size_t)r * nf + (size_t)f];
    }
    for (int r = 0; r + 1 < KV_SYNTH_PERM_ROUNDS; r++) fp.rot[r] = p->rot[(size_t)r * nf + (size_t)f];
    return fp;
}

/* Round r of A (see kv_synth.h), and its inverse. */
static inline uint64_t low_mix(const field_perm_t *fp, int r, uint64_t x) {
    uint64_t y = (x + fp->add[r]) & fp->mask;
    y ^= y >> fp->shift;
    y = (y * fp->mul[r]) & fp->mask;
    y ^= y >> fp->shift;
    return x <= fp->mask ? y : x;
}

static inline uint64_t low_unmix(const field_perm_t *fp, int r, uint64_t x) {
    uint64_t y = x ^ (x >> fp->shift); /* undoes y ^= y >> s, as 2 s >= log2(M) */
    y = (y * fp->inv[r]) & fp->mask;
    y ^= y >> fp->shift;
    y = (y - fp->add[r]) & fp->mask;
    return x <= fp->mask ? y : x;
}

static inline uint64_t perm_forward(const field_perm_t *fp, uint64_t x) {
    x = low_mix(fp, 0, x);
    for (int r = 1; r < KV_SYNTH_PERM_ROUNDS; r++) {
        x += fp->rot[r - 1];
        x = x >= fp->vocab ? x - fp->vocab : x;
        x = low_mix(fp, r, x);
    }
    return x;
}

static inline uint64_t perm_inverse(const field_perm_t *fp, uint64_t x) {
    for (int r = KV_SYNTH_PERM_ROUNDS - 1; r > 0; r--) {
        uint64_t c = fp->rot[r - 1];
        x = low_unmix(fp, r, x);
        x = x >= c ? x - c : x + (fp->vocab - c);
    }
    return low_unmix(fp, 0, x);
}

/* ---- blocks ------------------------------------------------------------------------ */

/* Floats of scratch pairwise_cols needs: 8 rows at the bottom of the recursion, one
 * more per level above it (n < 2^31: at most 24 levels). */
#define PAIRWISE_TMP (40 * BLOCK)

/* Scratch of one block (field-major), carved from one allocation. */
typedef struct {
    uint64_t *h;    /* [F + D + 1][BLOCK] channel hashes: fields, numbers, label */
    uint64_t *rank; /* [F][BLOCK] */
    int64_t *id;    /* [F][BLOCK] global ids */
    double *t;      /* [F][BLOCK] Zipf exponents */
    double *x;      /* [F][BLOCK] Zipf x */
    double *logit;  /* [BLOCK] */
    float *label;   /* [BLOCK] */
    float *num;     /* [D][BLOCK] */
    float *w;       /* [F][BLOCK] ranks as floats, first-order terms, squares */
    float *part;    /* [PARTS][F][BLOCK] interaction vector components */
    float *lin;     /* [D][BLOCK] numeric terms */
    float *sum;     /* [3][BLOCK] row sums */
    float *tmp;     /* [PAIRWISE_TMP] */
    void *mem;
} block_t;

static int block_alloc(block_t *b, int32_t nf, int32_t nd) {
    size_t f = (size_t)nf * BLOCK, d = (size_t)nd * BLOCK;
    size_t n64 = f + d + BLOCK + 4 * f + BLOCK; /* h, rank id t x, logit */
    size_t n32 = d + (1 + KV_SYNTH_PARTS) * f + d + 3 * BLOCK + PAIRWISE_TMP + BLOCK;
    uint64_t *p = kv_malloc(n64 * 8 + n32 * 4);
    if (!p) return KV_ENOMEM;
    b->mem = p;
    b->h = p;
    b->rank = b->h + f + d + BLOCK;
    b->id = (int64_t *)(b->rank + f);
    b->t = (double *)(b->id + f); /* 64-bit integers and doubles: same size and alignment */
    b->x = b->t + f;
    b->logit = b->x + f;
    b->num = (float *)(b->logit + BLOCK);
    b->w = b->num + d;
    b->part = b->w + f;
    b->lin = b->part + KV_SYNTH_PARTS * f;
    b->sum = b->lin + d;
    b->tmp = b->sum + 3 * BLOCK;
    b->label = b->tmp + PAIRWISE_TMP;
    return KV_OK;
}

/*
 * out[s] = sum over i < n of a[i * BLOCK + s], for every s < BLOCK, each column summed
 * exactly as numpy sums a contiguous float32 row (pairwise_sum in numpy's
 * loops_utils.h: a plain loop below 8 values, eight accumulators up to 128, halves
 * at a multiple of 8 above; pairwise_cols_big).
 */
static void pairwise_cols_big(const float *a, int64_t n, float *out, float *tmp);

KV_INLINE void pairwise_cols(const float *restrict a, int64_t n, float *restrict out,
                             float *restrict tmp) {
    if (n < 8) {
        for (int s = 0; s < BLOCK; s++) out[s] = 0.0f;
        for (int64_t i = 0; i < n; i++)
            for (int s = 0; s < BLOCK; s++) out[s] += a[i * BLOCK + s];
    } else if (n <= 128) {
        float *r = tmp; /* r[j * BLOCK + s]: accumulator j of column s */
        int64_t i;
        for (int k = 0; k < 8 * BLOCK; k++) r[k] = a[k];
        for (i = 8; i < n - (n % 8); i += 8)
            for (int k = 0; k < 8 * BLOCK; k++) r[k] += a[i * BLOCK + k];
        for (int s = 0; s < BLOCK; s++)
            out[s] = ((r[s] + r[BLOCK + s]) + (r[2 * BLOCK + s] + r[3 * BLOCK + s])) +
                     ((r[4 * BLOCK + s] + r[5 * BLOCK + s]) + (r[6 * BLOCK + s] + r[7 * BLOCK + s]));
        for (; i < n; i++)
            for (int s = 0; s < BLOCK; s++) out[s] += a[i * BLOCK + s];
    } else {
        pairwise_cols_big(a, n, out, tmp);
    }
}

static void pairwise_cols_big(const float *a, int64_t n, float *out, float *tmp) {
    int64_t n2 = n / 2;
    n2 -= n2 % 8;
    pairwise_cols(a, n2, out, tmp);
    pairwise_cols(a + n2 * BLOCK, n - n2, tmp, tmp + BLOCK);
    for (int s = 0; s < BLOCK; s++) out[s] += tmp[s];
}

/* Stage 1: hashes of every channel; base[s] = (first + s) * GAMMA. */
KV_INLINE void stage_hash(const uint64_t *restrict keys, int64_t nc,
                          const uint64_t *restrict base, uint64_t *restrict h) {
    for (int64_t c = 0; c < nc; c++) {
        const uint64_t key = keys[c];
        for (int s = 0; s < BLOCK; s++) h[c * BLOCK + s] = splitmix(base[s] + key);
    }
}

/* Stage 2: t and x = exp(t) of every id (u from the field's hash). */
KV_INLINE void stage_zipf(const kv_synth_t *m, const uint64_t *restrict h, double *restrict t,
                          double *restrict x) {
    const double e = m->zipf_exponent;
    for (int32_t f = 0; f < m->perm.num_fields; f++) {
        const double c = m->zipf_c[f];
        const uint64_t *hf = h + f * BLOCK;
        double *tf = t + f * BLOCK, *xf = x + f * BLOCK;
        if (m->log_uniform) {
            for (int s = 0; s < BLOCK; s++) tf[s] = unit53(hf[s]) * c;
        } else {
            for (int s = 0; s < BLOCK; s++) tf[s] = e * fast_log(1.0 + unit53(hf[s]) * c);
        }
        for (int s = 0; s < BLOCK; s++) xf[s] = fast_exp(tf[s]);
    }
}

/* Stage 3: ranks, or RANK_UNSURE where x is too close to an integer (or out of the
 * range of the inline path). Returns whether any is unsure. */
KV_INLINE int stage_rank(const kv_synth_t *m, const double *restrict t, const double *restrict x,
                         uint64_t *restrict rank) {
    uint64_t unsure = 0;
    for (int32_t f = 0; f < m->perm.num_fields; f++) {
        /* min(floor(x) - 1, vocab - 1) = floor(min(x, vocab)) - 1; vocab as a double is
         * inexact only above 2^53, where x < 2^52 is below it all the same */
        const double vocab = (double)m->perm.vocab[f];
        const double *tf = t + f * BLOCK, *xf = x + f * BLOCK;
        uint64_t *rf = rank + f * BLOCK;
        for (int s = 0; s < BLOCK; s++) {
            double at = fabs(tf[s]);
            double err = xf[s] * (at + 2.0) * 0x1p-44;
            double lo = xf[s] - err, hi = xf[s] + err;
            lo = lo < vocab ? lo : vocab;
            hi = hi < vocab ? hi : vocab;
            /* 2.0 (bit 62) for each reason to ask libm: t out of range (or NaN), x - err
             * below 1 (numpy's wrap-around case), x + err at or above 2^52 */
            double out = (at <= 512.0 ? 0.0 : 2.0) + (lo >= 1.0 ? 0.0 : 2.0) +
                         (hi < TWO_52 ? 0.0 : 2.0);
            uint64_t flo = floor52(lo), fhi = floor52(hi), d = flo ^ fhi;
            uint64_t mask = (0 - ((as_u64(out) >> 62) & 1)) | (0 - ((d | (0 - d)) >> 63));
            rf[s] = (flo - 1) | mask;
            unsure |= mask;
        }
    }
    return unsure != 0;
}

/* Stage 4: ids = offsets + perm(rank). */
KV_INLINE void stage_perm(const kv_synth_t *m, const uint64_t *restrict rank,
                          int64_t *restrict id) {
    for (int32_t f = 0; f < m->perm.num_fields; f++) {
        const field_perm_t fp = field_perm(&m->perm, f);
        const int64_t offset = m->offsets[f];
        const uint64_t *rf = rank + f * BLOCK;
        int64_t *idf = id + f * BLOCK;
        for (int s = 0; s < BLOCK; s++) idf[s] = (int64_t)perm_forward(&fp, rf[s]) + offset;
    }
}

/* Stage 5: the numbers: Box-Muller in float32 (|z| < 6), then softplus. */
KV_INLINE void stage_numeric(const kv_synth_t *m, const uint64_t *restrict h,
                             float *restrict num) {
    for (int32_t j = 0; j < m->num_numeric; j++) {
        const float mu = m->mu[j], sigma = m->sigma[j];
        const uint64_t *hj = h + j * BLOCK;
        float *nj = num + j * BLOCK;
        for (int s = 0; s < BLOCK; s++) {
            float u1 = (float)(int32_t)(hj[s] >> 40);
            u1 += 0.5f;
            u1 *= 0x1p-24f;
            float t = kv_logf(u1);
            t *= -2.0f;
            float z = sqrtf(t);
            float u2 = (float)(int32_t)(hj[s] & 0xFFFFFF);
            u2 *= TWO_PI_2_24;
            z *= fast_cosf(u2);
            z *= sigma;
            z += mu;
            nj[s] = fast_log1pf(fast_expf(z));
        }
    }
}

/* One field's terms of the logit, from its ranks (as floats, in w): w[s] becomes the
 * weight and part[q * fb + s] the vector components. */
KV_INLINE void logit_terms(const kv_synth_t *m, int32_t f, const uint64_t *restrict rank,
                           float *restrict w, float *restrict part, size_t fb) {
    const uint64_t key = m->param_keys[f];
    const float w_mul = m->w_mul[f], w_sub = m->w_sub[f];
    const float v_mul = m->v_mul[f], v_sub = m->v_sub[f];
    if (m->perm.vocab[f] <= (uint64_t)1 << 52) {
        for (int s = 0; s < BLOCK; s++) w[s] = (float)u52_to_f64(rank[s]);
    } else { /* the same value, rounded once, from the 64-bit conversion */
        for (int s = 0; s < BLOCK; s++) w[s] = (float)(int64_t)rank[s];
    }
    uint32_t hlo[BLOCK], hhi[BLOCK]; /* the hash's halves: 32-bit lanes vectorise better */
    for (int s = 0; s < BLOCK; s++) {
        const uint64_t h = splitmix(rank[s] * GAMMA + key);
        hlo[s] = (uint32_t)h;
        hhi[s] = (uint32_t)(h >> 32);
    }
    for (int s = 0; s < BLOCK; s++) {
        const uint32_t lo = hlo[s], hi = hhi[s];
        /* bits 0-15: the weight; 16-27, 28-39, 40-51, 52-63: the KV_SYNTH_PARTS (4)
         * vector components */
        const int32_t bits[1 + KV_SYNTH_PARTS] = {
            (int32_t)(lo & 0xFFFF), (int32_t)((lo >> 16) & 0xFFF),
            (int32_t)((lo >> 28) | ((hi & 0xFF) << 4)), (int32_t)((hi >> 8) & 0xFFF),
            (int32_t)((hi >> 20) & 0xFFF)};
        float d = w[s];
        d *= RANK_SCALE;
        d += 1.0f;
        d = 1.0f / sqrtf(d);
        float g = (float)bits[0];
        g *= w_mul;
        g -= w_sub;
        w[s] = g * d;
        const float a = d * v_mul, c = d * v_sub;
        for (int q = 0; q < KV_SYNTH_PARTS; q++) {
            float v = (float)bits[1 + q];
            v *= a;
            part[(size_t)q * fb + (size_t)s] = v - c;
        }
    }
}

KV_INLINE void squares(const float *restrict a, size_t n, float *restrict out) {
    for (size_t k = 0; k < n; k++) out[k] = a[k] * a[k];
}

/*
 * Stage 6: the planted logits of the block's samples (b->rank, b->num) into b->logit,
 * step by step as the numpy reference:
 *   decay = 1 / sqrt(1 + rank * (1/200));  h = splitmix(rank * GAMMA + param_key)
 *   logit = sum_f (lo16(h) * w_mul - w_sub) * decay
 *         + 0.5 * sum_q [(sum_f part_qf)^2 - sum_f part_qf^2],
 *           part_qf = (12-bit part q of h above bit 16) * (decay * v_mul) - decay * v_sub
 *         + sum_j (num_j - center_j) * beta_j
 * all in float32 (sums: numpy's pairwise order), then + bias in double.
 */
KV_INLINE void block_logit(const kv_synth_t *m, const block_t *b) {
    const int32_t nf = m->perm.num_fields, nd = m->num_numeric;
    const size_t fb = (size_t)nf * BLOCK;
    float *restrict w = b->w, *restrict part = b->part, *restrict lin = b->lin;
    float *restrict logit = b->sum, *restrict pair = b->sum + BLOCK;
    float *restrict sum = b->sum + 2 * BLOCK, *restrict tmp = b->tmp;
    for (int32_t f = 0; f < nf; f++)
        logit_terms(m, f, b->rank + (size_t)f * BLOCK, w + (size_t)f * BLOCK,
                    part + (size_t)f * BLOCK, fb);
    pairwise_cols(w, nf, logit, tmp);
    for (int s = 0; s < BLOCK; s++) pair[s] = 0.0f;
    for (int q = 0; q < KV_SYNTH_PARTS; q++) {
        pairwise_cols(part + (size_t)q * fb, nf, sum, tmp);
        for (int s = 0; s < BLOCK; s++) pair[s] += sum[s] * sum[s];
        squares(part + (size_t)q * fb, fb, w);
        pairwise_cols(w, nf, sum, tmp);
        for (int s = 0; s < BLOCK; s++) pair[s] -= sum[s];
    }
    for (int s = 0; s < BLOCK; s++) logit[s] += 0.5f * pair[s];
    for (int32_t j = 0; j < nd; j++) {
        const float center = m->center[j], beta = m->beta[j];
        const float *nj = b->num + (size_t)j * BLOCK;
        for (int s = 0; s < BLOCK; s++) lin[(size_t)j * BLOCK + (size_t)s] = (nj[s] - center) * beta;
    }
    pairwise_cols(lin, nd, sum, tmp);
    double *restrict out = b->logit;
    for (int s = 0; s < BLOCK; s++) out[s] = (double)(logit[s] + sum[s]) + m->bias;
}

/* The label of p = 0.5 * (1 + tanh(logit / 2)) from libm: the definition. */
static float label_libm(double logit, uint64_t h) {
    double p = 0.5 * (1.0 + tanh(0.5 * logit));
    return (double)(h >> 11) * 0x1p-53 < p ? 1.0f : 0.0f;
}

/* Stage 7: labels, with an inline tanh, tanh(a) = (1 - e^-2a) / (1 + e^-2a), within a
 * few 1e-16 of libm's; where the uniform is closer than 2^-44 to p, libm decides.
 * Returns whether it has to. */
KV_INLINE int stage_label(const double *restrict logit, const uint64_t *restrict h,
                          float *restrict label) {
    uint64_t unsure = 0;
    for (int s = 0; s < BLOCK; s++) {
        double half = 0.5 * logit[s];
        /* a = min(|half|, 20) (tanh(20) rounds to 1), on the bits: a float select here
         * would stop GCC vectorising */
        uint64_t abits = as_u64(half) & 0x7fffffffffffffffULL, lim = as_u64(20.0);
        double e = fast_exp(-2.0 * as_f64(abits < lim ? abits : lim));
        double th = (1.0 - e) / (1.0 + e);
        th = as_f64(as_u64(th) | (as_u64(half) & 0x8000000000000000ULL)); /* sign of half */
        double p = 0.5 * (1.0 + th);
        double d = unit53(h[s]) - p;
        unsure |= as_u64(fabs(d) > 0x1p-44 ? 0.0 : 2.0) >> 62;
        label[s] = (float)(d < 0.0 ? 1.0 : 0.0);
    }
    return unsure != 0;
}

/* A whole block of samples first, ..., first + BLOCK - 1 (stages 1 to 6, and 7 if
 * with_labels): ids in b->id, numbers in b->num, logits in b->logit, labels in
 * b->label. */
KV_INLINE void run_block(const kv_synth_t *m, const uint64_t *keys, uint64_t first,
                         int with_logit, int with_labels, const block_t *b) {
    const int32_t nf = m->perm.num_fields, nd = m->num_numeric;
    uint64_t base[BLOCK];
    for (int s = 0; s < BLOCK; s++) base[s] = (first + (uint64_t)s) * GAMMA;
    stage_hash(keys, (int64_t)nf + nd + 1, base, b->h);
    stage_zipf(m, b->h, b->t, b->x);
    if (stage_rank(m, b->t, b->x, b->rank)) {
        for (int32_t f = 0; f < nf; f++)
            for (int s = 0; s < BLOCK; s++)
                if (b->rank[f * BLOCK + s] == RANK_UNSURE)
                    b->rank[f * BLOCK + s] = zipf_rank_libm(m, f, b->h[f * BLOCK + s]);
    }
    stage_perm(m, b->rank, b->id);
    stage_numeric(m, b->h + (size_t)nf * BLOCK, b->num);
    if (!with_logit && !with_labels) return;
    block_logit(m, b);
    if (with_labels) {
        const uint64_t *hl = b->h + ((size_t)nf + (size_t)nd) * BLOCK;
        if (stage_label(b->logit, hl, b->label))
            for (int s = 0; s < BLOCK; s++) b->label[s] = label_libm(b->logit[s], hl[s]);
    }
}

/* ---- dispatch ---------------------------------------------------------------------- */

typedef void (*run_block_fn)(const kv_synth_t *, const uint64_t *, uint64_t, int, int,
                             const block_t *);
typedef void (*block_logit_fn)(const kv_synth_t *, const block_t *);

static void run_block_base(const kv_synth_t *m, const uint64_t *keys, uint64_t first,
                           int with_logit, int with_labels, const block_t *b) {
    run_block(m, keys, first, with_logit, with_labels, b);
}
static void block_logit_base(const kv_synth_t *m, const block_t *b) { block_logit(m, b); }

#if KV_ISA_CLONES
KV_TARGET_AVX2 static void run_block_avx2(const kv_synth_t *m, const uint64_t *keys,
                                       uint64_t first, int with_logit, int with_labels,
                                       const block_t *b) {
    run_block(m, keys, first, with_logit, with_labels, b);
}
KV_TARGET_AVX2 static void block_logit_avx2(const kv_synth_t *m, const block_t *b) {
    block_logit(m, b);
}
KV_TARGET_AVX512 static void run_block_avx512(const kv_synth_t *m, const uint64_t *keys,
                                           uint64_t first, int with_logit, int with_labels,
                                           const block_t *b) {
    run_block(m, keys, first, with_logit, with_labels, b);
}
KV_TARGET_AVX512 static void block_logit_avx512(const kv_synth_t *m, const block_t *b) {
    block_logit(m, b);
}
#endif

int kv_synth_best_isa(void) { return kv_isa_detect(); }

/* The copy m->isa asks for (m checked: the CPU has it). */
static int isa_of(const kv_synth_t *m) {
    return m->isa == KV_SYNTH_ISA_BEST ? kv_synth_best_isa() : m->isa;
}

static run_block_fn pick_run_block(const kv_synth_t *m) {
    switch (isa_of(m)) {
#if KV_ISA_CLONES
    case KV_SYNTH_ISA_AVX512: return run_block_avx512;
    case KV_SYNTH_ISA_AVX2: return run_block_avx2;
#endif
    default: return run_block_base;
    }
}

static block_logit_fn pick_block_logit(const kv_synth_t *m) {
    switch (isa_of(m)) {
#if KV_ISA_CLONES
    case KV_SYNTH_ISA_AVX512: return block_logit_avx512;
    case KV_SYNTH_ISA_AVX2: return block_logit_avx2;
#endif
    default: return block_logit_base;
    }
}

/* ---- argument checks --------------------------------------------------------------- */

static int floats_in(const float *a, int32_t n, float lo, float hi) {
    for (int32_t i = 0; i < n; i++)
        if (!(a[i] >= lo && a[i] <= hi)) return 0; /* also rejects NaN */
    return 1;
}

static int finite_floats(const float *a, int32_t n) { return floats_in(a, n, -FLT_MAX, FLT_MAX); }

int kv_synth_perm_check(const kv_synth_perm_t *p) {
    if (!p || p->num_fields < 1 || !p->vocab || !p->mask || !p->shift || !p->add || !p->mul ||
        !p->inv || !p->rot)
        return KV_EINVAL;
    int32_t nf = p->num_fields;
    for (int32_t f = 0; f < nf; f++) {
        uint64_t v = p->vocab[f], mask = p->mask[f], s = p->shift[f];
        if (v < 1 || v >= TWO_62) return KV_EINVAL;
        if ((mask & (mask + 1)) != 0 || mask >= v || v > 2 * mask + 1) return KV_EINVAL;
        int bits = 0;
        while ((mask >> bits) != 0) bits++;
        if (s < 1 || s > 63 || 2 * (int)s < bits) return KV_EINVAL;
        for (int32_t r = 0; r < KV_SYNTH_PERM_ROUNDS; r++) {
            size_t i = (size_t)r * (size_t)nf + (size_t)f;
            if (p->add[i] > mask || (p->mul[i] & 1) == 0 || p->mul[i] * p->inv[i] != 1)
                return KV_EINVAL;
        }
        for (int32_t r = 0; r + 1 < KV_SYNTH_PERM_ROUNDS; r++)
            if (p->rot[(size_t)r * (size_t)nf + (size_t)f] >= v) return KV_EINVAL;
    }
    return KV_OK;
}

int kv_synth_check(const kv_synth_t *m) {
    if (!m || kv_synth_perm_check(&m->perm) != KV_OK) return KV_EINVAL;
    int32_t nf = m->perm.num_fields, nd = m->num_numeric;
    if (nd < 0 || (m->log_uniform != 0 && m->log_uniform != 1)) return KV_EINVAL;
    if (m->isa != KV_SYNTH_ISA_BEST && (m->isa < KV_SYNTH_ISA_BASE || m->isa > kv_synth_best_isa()))
        return KV_EINVAL;
    if (!m->zipf_c || !m->offsets || !m->param_keys || !m->w_mul || !m->w_sub || !m->v_mul ||
        !m->v_sub)
        return KV_EINVAL;
    if (nd > 0 && (!m->mu || !m->sigma || !m->center || !m->beta)) return KV_EINVAL;
    if (!m->log_uniform && !(isfinite(m->zipf_exponent) && m->zipf_exponent != 0.0))
        return KV_EINVAL;
    if (!isfinite(m->bias)) return KV_EINVAL;
    for (int32_t f = 0; f < nf; f++) {
        double c = m->zipf_c[f];
        if (m->log_uniform ? !(c >= 0.0 && c <= 64.0) : !(c >= -1.0 && isfinite(c)))
            return KV_EINVAL;
        if (m->offsets[f] < 0 || (uint64_t)m->offsets[f] > TWO_62 - m->perm.vocab[f])
            return KV_EINVAL;
    }
    if (!finite_floats(m->w_mul, nf) || !finite_floats(m->w_sub, nf) ||
        !finite_floats(m->v_mul, nf) || !finite_floats(m->v_sub, nf))
        return KV_EINVAL;
    if (nd > 0 && (!floats_in(m->mu, nd, -16.0f, 16.0f) || !floats_in(m->sigma, nd, 0.0f, 8.0f) ||
                   !finite_floats(m->center, nd) || !finite_floats(m->beta, nd)))
        return KV_EINVAL;
    return KV_OK;
}

/* Every value of rows[n][F] below its field's vocab? */
static int ranks_in_range(const kv_synth_perm_t *p, const uint64_t *rows, int64_t n) {
    int32_t nf = p->num_fields;
    for (int64_t i = 0; i < n; i++)
        for (int32_t f = 0; f < nf; f++)
            if (rows[i * nf + f] >= p->vocab[f]) return 0;
    return 1;
}

/* ---- public kernels ---------------------------------------------------------------- */

int kv_synth_permute(const kv_synth_perm_t *p, const uint64_t *in, int64_t n, int32_t inverse,
                     uint64_t *out) {
    if (kv_synth_perm_check(p) != KV_OK || n < 0 || (n > 0 && (!in || !out))) return KV_EINVAL;
    int32_t nf = p->num_fields;
    if (n > INT64_MAX / nf || !ranks_in_range(p, in, n)) return KV_EINVAL;
    for (int32_t f = 0; f < nf; f++) {
        const field_perm_t fp = field_perm(p, f);
        for (int64_t i = 0; i < n; i++) {
            uint64_t x = in[i * nf + f];
            out[i * nf + f] = inverse ? perm_inverse(&fp, x) : perm_forward(&fp, x);
        }
    }
    return KV_OK;
}

int kv_synth_logit(const kv_synth_t *m, const uint64_t *ranks, const float *numeric, int64_t n,
                   double *logit) {
    if (kv_synth_check(m) != KV_OK || n < 0) return KV_EINVAL;
    if (n > 0 && (!ranks || !logit || (m->num_numeric > 0 && !numeric))) return KV_EINVAL;
    const int32_t nf = m->perm.num_fields, nd = m->num_numeric;
    if (n > INT64_MAX / nf || !ranks_in_range(&m->perm, ranks, n)) return KV_EINVAL;
    if (n == 0) return KV_OK;
    block_t b;
    if (block_alloc(&b, nf, nd) != KV_OK) return KV_ENOMEM;
    const block_logit_fn run = pick_block_logit(m);
    for (int64_t lo = 0; lo < n; lo += BLOCK) {
        const int ns = n - lo < BLOCK ? (int)(n - lo) : BLOCK;
        for (int s = 0; s < BLOCK; s++) { /* a short block repeats its last sample */
            const int64_t i = lo + (s < ns ? s : ns - 1);
            for (int32_t f = 0; f < nf; f++) b.rank[f * BLOCK + s] = ranks[i * nf + f];
            for (int32_t j = 0; j < nd; j++) b.num[j * BLOCK + s] = numeric[i * nd + j];
        }
        run(m, &b);
        memcpy(logit + lo, b.logit, (size_t)ns * sizeof(double));
    }
    kv_free(b.mem);
    return KV_OK;
}

int kv_synth_samples(const kv_synth_t *m, const uint64_t *keys, uint64_t first, int64_t n,
                     int64_t *categorical, float *numeric, float *label, double *logit) {
    if (kv_synth_check(m) != KV_OK || !keys || n < 0) return KV_EINVAL;
    const int32_t nf = m->perm.num_fields, nd = m->num_numeric;
    if (n > 0 && (!categorical || (nd > 0 && !numeric))) return KV_EINVAL;
    if (n > INT64_MAX / ((int64_t)nf + nd + 1)) return KV_EINVAL;
    if (n == 0) return KV_OK;
    block_t b;
    if (block_alloc(&b, nf, nd) != KV_OK) return KV_ENOMEM;
    const run_block_fn run = pick_run_block(m);
    for (int64_t lo = 0; lo < n; lo += BLOCK) {
        /* A short last block computes the next samples of the stream too, unstored. */
        const int ns = n - lo < BLOCK ? (int)(n - lo) : BLOCK;
        run(m, keys, first + (uint64_t)lo, logit != NULL, label != NULL, &b);
        for (int s = 0; s < ns; s++) {
            int64_t *cat = categorical + (lo + s) * nf;
            for (int32_t f = 0; f < nf; f++) cat[f] = b.id[f * BLOCK + s];
            for (int32_t j = 0; j < nd; j++) numeric[(lo + s) * nd + j] = b.num[j * BLOCK + s];
        }
        if (logit) memcpy(logit + lo, b.logit, (size_t)ns * sizeof(double));
        if (label) memcpy(label + lo, b.label, (size_t)ns * sizeof(float));
    }
    kv_free(b.mem);
    return KV_OK;
}
