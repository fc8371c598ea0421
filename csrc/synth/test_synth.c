/*
 * test_synth.c - the SyntheticCTR kernel (kv_synth.c) against a plain scalar reference
 * written from the definitions in kv_synth.h: libm's pow/exp for the ranks, the
 * permutation round by round, numpy's pairwise sums for the logit, libm's tanh for the
 * labels and libm's float functions for the numbers. Also: any split of a range of
 * samples into calls, and every ISA copy this CPU runs, give the same bits;
 * kv_synth_logit agrees with the logits of kv_synth_samples; the libm fallback of the
 * ranks (x == 1 exactly); argument checks; failing allocations.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kv_synth.h"
#include "../tests/test_util.h"

#define R KV_SYNTH_PERM_ROUNDS
#define MAXF 160
#define MAXD 16
#define MAXN 700

typedef struct {
    int32_t nf, nd;
    double a;
    uint64_t vocab[MAXF], mask[MAXF], shift[MAXF];
    uint64_t add[R * MAXF], mul[R * MAXF], inv[R * MAXF], rot[R * MAXF];
    double zc[MAXF];
    int64_t off[MAXF];
    uint64_t pk[MAXF];
    float wm[MAXF], ws[MAXF], vm[MAXF], vs[MAXF];
    float mu[MAXD], sg[MAXD], ce[MAXD], be[MAXD];
    uint64_t keys[MAXF + MAXD + 1];
    kv_synth_t m;
} model_t;

static uint64_t inv64(uint64_t a) {
    uint64_t x = a; /* Newton: each step doubles the correct low bits */
    for (int i = 0; i < 6; i++) x *= 2 - a * x;
    return x;
}

static double unit(uint64_t h) { return (double)(h >> 11) * 0x1p-53; }

/* A model like kvcoll.data.SyntheticCTR's (importance 1 everywhere). */
static void make_model(model_t *t, int32_t nf, int32_t nd, const uint64_t *vocab, double a,
                       uint64_t seed) {
    memset(t, 0, sizeof *t);
    t->nf = nf;
    t->nd = nd;
    t->a = a;
    uint64_t rng = seed;
    int64_t off = 0;
    double w_scale = 1.8 / sqrt(nf), v_scale = sqrt(1.0 / sqrt((nf * (nf - 1) / 2 + 1) * 4.0));
    for (int32_t f = 0; f < nf; f++) {
        uint64_t v = vocab[f];
        int bits = 0;
        while ((v >> (bits + 1)) != 0) bits++;
        t->vocab[f] = v;
        t->mask[f] = ((uint64_t)1 << bits) - 1;
        t->shift[f] = (uint64_t)(bits + 1) / 2 > 1 ? (uint64_t)(bits + 1) / 2 : 1;
        for (int r = 0; r < R; r++) {
            t->add[r * nf + f] = test_rand(&rng) & t->mask[f];
            t->mul[r * nf + f] = test_rand(&rng) | 1;
            t->inv[r * nf + f] = inv64(t->mul[r * nf + f]);
        }
        for (int r = 0; r + 1 < R; r++) t->rot[r * nf + f] = test_rand(&rng) % v;
        t->off[f] = off;
        off += (int64_t)v;
        t->pk[f] = test_rand(&rng);
        double lv1 = log((double)v + 1.0);
        t->zc[f] = a == 1.0 ? lv1 : expm1((1.0 - a) * lv1);
        t->wm[f] = (float)(w_scale * 2.0 * sqrt(3.0) / 65536.0);
        t->ws[f] = (float)(w_scale * sqrt(3.0));
        t->vm[f] = (float)(v_scale * 2.0 * sqrt(3.0) / 4096.0);
        t->vs[f] = (float)(v_scale * sqrt(3.0));
    }
    for (int32_t j = 0; j < nd; j++) {
        t->mu[j] = (float)(3.0 * unit(test_rand(&rng)));
        t->sg[j] = (float)(0.5 + unit(test_rand(&rng)));
        t->ce[j] = log1pf(expf(t->mu[j]));
        t->be[j] = (float)((2.0 * unit(test_rand(&rng)) - 1.0) * 0.3);
    }
    for (int32_t c = 0; c < nf + nd + 1; c++) t->keys[c] = test_rand(&rng);
    kv_synth_perm_t p = {nf, t->vocab, t->mask, t->shift, t->add, t->mul, t->inv, t->rot};
    kv_synth_t m = {p, nd, a == 1.0, KV_SYNTH_ISA_BEST, a == 1.0 ? 1.0 : 1.0 / (1.0 - a), t->zc,
                    t->off, t->pk, t->wm, t->ws, t->vm, t->vs, t->mu, t->sg, t->ce, t->be, -1.2};
    t->m = m;
}

/* ---- the reference ----------------------------------------------------------------- */

static uint64_t ref_mix(uint64_t x) {
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
    return x ^ (x >> 31);
}

static uint64_t ref_hash(const model_t *t, uint64_t g, int32_t c) {
    return ref_mix(g * 0x9E3779B97F4A7C15ULL + t->keys[c]);
}

static uint64_t ref_rank(const model_t *t, int32_t f, uint64_t h) {
    double u = unit(h), c = t->zc[f];
    double x = t->a == 1.0 ? exp(u * c) : pow(1.0 + u * c, 1.0 / (1.0 - t->a));
    uint64_t r = (x >= 1.0 && x < 0x1p62) ? (uint64_t)x - 1 : UINT64_MAX;
    return r < t->vocab[f] - 1 ? r : t->vocab[f] - 1;
}

static uint64_t ref_low_mix(const model_t *t, int32_t f, int r, uint64_t x) {
    uint64_t mask = t->mask[f], s = t->shift[f];
    if (x > mask) return x;
    uint64_t y = (x + t->add[r * t->nf + f]) & mask;
    y ^= y >> s;
    y = (y * t->mul[r * t->nf + f]) & mask;
    return y ^ (y >> s);
}

static uint64_t ref_perm(const model_t *t, int32_t f, uint64_t x) {
    x = ref_low_mix(t, f, 0, x);
    for (int r = 1; r < R; r++) {
        x = (x + t->rot[(r - 1) * t->nf + f]) % t->vocab[f];
        x = ref_low_mix(t, f, r, x);
    }
    return x;
}

/* numpy's pairwise_sum of a float32 row. */
static float ref_pairwise(const float *a, int64_t n) {
    if (n < 8) {
        float res = 0.0f;
        for (int64_t i = 0; i < n; i++) res += a[i];
        return res;
    }
    if (n <= 128) {
        float r[8];
        int64_t i;
        for (int j = 0; j < 8; j++) r[j] = a[j];
        for (i = 8; i < n - n % 8; i += 8)
            for (int j = 0; j < 8; j++) r[j] += a[i + j];
        float res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; i++) res += a[i];
        return res;
    }
    int64_t n2 = n / 2;
    n2 -= n2 % 8;
    return ref_pairwise(a, n2) + ref_pairwise(a + n2, n - n2);
}

/* The numpy reference of the planted logit, one sample. */
static double ref_logit(const model_t *t, const uint64_t *rank, const float *num) {
    int32_t nf = t->nf;
    float g[MAXF], part[4][MAXF], sq[MAXF], lin[MAXD];
    for (int32_t f = 0; f < nf; f++) {
        float d = (float)rank[f];
        d *= (float)(1.0 / 200.0);
        d += 1.0f;
        d = 1.0f / sqrtf(d);
        uint64_t h = ref_mix(rank[f] * 0x9E3779B97F4A7C15ULL + t->pk[f]);
        g[f] = ((float)(h & 0xFFFF) * t->wm[f] - t->ws[f]) * d;
        float a = d * t->vm[f], b = d * t->vs[f];
        for (int q = 0; q < 4; q++) part[q][f] = (float)((h >> (16 + 12 * q)) & 0xFFF) * a - b;
    }
    float logit = ref_pairwise(g, nf), pair = 0.0f;
    for (int q = 0; q < 4; q++) {
        float s = ref_pairwise(part[q], nf);
        pair += s * s;
        for (int32_t f = 0; f < nf; f++) sq[f] = part[q][f] * part[q][f];
        pair -= ref_pairwise(sq, nf);
    }
    logit += 0.5f * pair;
    for (int32_t j = 0; j < t->nd; j++) lin[j] = (num[j] - t->ce[j]) * t->be[j];
    logit += ref_pairwise(lin, t->nd);
    return (double)logit + t->m.bias;
}

static float ref_number(const model_t *t, int32_t j, uint64_t h) {
    float u1 = ((float)(h >> 40) + 0.5f) * 0x1p-24f;
    float u2 = (float)(h & 0xFFFFFF) * (float)(2.0 * 3.141592653589793 / 16777216.0);
    float z = sqrtf(logf(u1) * -2.0f) * cosf(u2) * t->sg[j] + t->mu[j];
    return log1pf(expf(z));
}

/* ---- helpers ----------------------------------------------------------------------- */

typedef struct {
    int64_t cat[MAXN * MAXF];
    float num[MAXN * MAXD];
    float label[MAXN];
    double logit[MAXN];
} out_t;

static int run(const kv_synth_t *m, const uint64_t *keys, uint64_t first, int64_t n, out_t *o) {
    return kv_synth_samples(m, keys, first, n, o->cat, o->num, o->label, o->logit);
}

static int same(const out_t *a, const out_t *b, int64_t n, int32_t nf, int32_t nd) {
    return !memcmp(a->cat, b->cat, (size_t)(n * nf) * 8) &&
           !memcmp(a->num, b->num, (size_t)(n * nd) * 4) &&
           !memcmp(a->label, b->label, (size_t)n * 4) && !memcmp(a->logit, b->logit, (size_t)n * 8);
}

static out_t g_a, g_b;
static uint64_t g_rank[MAXN * MAXF];

/* ---- tests ------------------------------------------------------------------------- */

/* Everything against the reference, n samples from `first`. */
static void check_reference(model_t *t, uint64_t first, int64_t n) {
    int32_t nf = t->nf, nd = t->nd;
    CHECK_EQ_INT(run(&t->m, t->keys, first, n, &g_a), KV_OK);
    int ids = 1, nums = 1, logits = 1, labels = 1, ranges = 1;
    for (int64_t i = 0; i < n; i++) {
        uint64_t g = first + (uint64_t)i;
        for (int32_t f = 0; f < nf; f++) {
            uint64_t r = ref_rank(t, f, ref_hash(t, g, f));
            g_rank[i * nf + f] = r;
            int64_t id = g_a.cat[i * nf + f];
            ids &= id == t->off[f] + (int64_t)ref_perm(t, f, r);
            ranges &= id >= t->off[f] && id < t->off[f] + (int64_t)t->vocab[f];
        }
        for (int32_t j = 0; j < nd; j++) {
            float want = ref_number(t, j, ref_hash(t, g, nf + j)), got = g_a.num[i * nd + j];
            nums &= fabsf(got - want) <= 4e-6f * fabsf(want) + 1e-7f;
        }
        double lg = ref_logit(t, g_rank + i * nf, g_a.num + i * nd);
        logits &= lg == g_a.logit[i];
        float label = unit(ref_hash(t, g, nf + nd)) < 0.5 * (1.0 + tanh(0.5 * lg)) ? 1.0f : 0.0f;
        labels &= label == g_a.label[i];
    }
    CHECK(ids);
    CHECK(ranges);
    CHECK(nums);
    CHECK(logits);
    CHECK(labels);
    /* kv_synth_logit from the ranks: the same bits */
    double lg[MAXN];
    CHECK_EQ_INT(kv_synth_logit(&t->m, g_rank, g_a.num, n, lg), KV_OK);
    CHECK(!memcmp(lg, g_a.logit, (size_t)n * 8));
    /* the inverse permutation gives the ranks back */
    uint64_t *local = malloc((size_t)(n * nf + 1) * 8);
    for (int64_t i = 0; i < n * nf; i++) local[i] = (uint64_t)(g_a.cat[i] - t->off[i % nf]);
    CHECK_EQ_INT(kv_synth_permute(&t->m.perm, local, n, 1, local), KV_OK);
    CHECK(!memcmp(local, g_rank, (size_t)(n * nf) * 8));
    free(local);
}

/* Any split into calls, and every ISA copy, give the same bits. */
static void check_invariance(model_t *t, uint64_t first) {
    int32_t nf = t->nf, nd = t->nd;
    const int64_t n = 300;
    CHECK_EQ_INT(run(&t->m, t->keys, first, n, &g_a), KV_OK);
    static const int64_t pieces[] = {1, 5, 31, 32, 33, 64, 97};
    for (size_t k = 0; k < sizeof pieces / sizeof *pieces; k++) {
        for (int64_t lo = 0; lo < n; lo += pieces[k]) {
            int64_t len = n - lo < pieces[k] ? n - lo : pieces[k];
            out_t *o = &g_b;
            CHECK_EQ_INT(kv_synth_samples(&t->m, t->keys, first + (uint64_t)lo, len,
                                          o->cat + lo * nf, o->num + lo * nd, o->label + lo,
                                          o->logit + lo),
                         KV_OK);
        }
        CHECK(same(&g_a, &g_b, n, nf, nd));
    }
    for (int32_t isa = KV_SYNTH_ISA_BASE; isa <= kv_synth_best_isa(); isa++) {
        kv_synth_t m = t->m;
        m.isa = isa;
        memset(&g_b, 0, sizeof g_b);
        CHECK_EQ_INT(run(&m, t->keys, first, n, &g_b), KV_OK);
        CHECK(same(&g_a, &g_b, n, nf, nd));
        double lg[300];
        for (int64_t i = 0; i < n; i++)
            for (int32_t f = 0; f < nf; f++) g_rank[i * nf + f] = ref_rank(t, f, ref_hash(t, first + (uint64_t)i, f));
        CHECK_EQ_INT(kv_synth_logit(&m, g_rank, g_a.num, n, lg), KV_OK);
        CHECK(!memcmp(lg, g_a.logit, sizeof lg));
    }
    /* without labels or logits, the same ids and numbers */
    memset(&g_b, 0, sizeof g_b);
    CHECK_EQ_INT(kv_synth_samples(&t->m, t->keys, first, n, g_b.cat, g_b.num, NULL, NULL), KV_OK);
    CHECK(!memcmp(g_a.cat, g_b.cat, (size_t)(n * nf) * 8));
    CHECK(!memcmp(g_a.num, g_b.num, (size_t)(n * nd) * 4));
}

static model_t g_t;

static void test_models(void) {
    static const struct {
        int32_t nf, nd;
        double a;
        uint64_t first;
    } cfg[] = {{6, 4, 1.1, 0}, {4, 0, 0.5, 12345}, {150, 3, 1.0, 1ULL << 40}, {1, 7, 3.0, 99},
               {26, 13, 1.1, UINT64_MAX - 100}};
    for (size_t c = 0; c < sizeof cfg / sizeof *cfg; c++) {
        uint64_t vocab[MAXF];
        if (c == 0) {
            const uint64_t v[6] = {1, 2, 3, 1000, (1u << 20) + 1, 10000000};
            memcpy(vocab, v, sizeof v);
        } else if (c == 1) { /* ranks beyond 2^52: the libm path, float(int64) */
            const uint64_t v[4] = {5, (1ULL << 40) + 3, (1ULL << 53) + 7, (1ULL << 61) + 5};
            memcpy(vocab, v, sizeof v);
        } else {
            for (int32_t f = 0; f < cfg[c].nf; f++) vocab[f] = c == 2 ? 100 + (uint64_t)f : 10000000;
        }
        make_model(&g_t, cfg[c].nf, cfg[c].nd, vocab, cfg[c].a, 7 + c);
        CHECK_EQ_INT(kv_synth_check(&g_t.m), KV_OK);
        check_reference(&g_t, cfg[c].first, c == 2 ? 100 : MAXN);
        check_invariance(&g_t, cfg[c].first);
    }
}

/* Sample 0 with key 0 has hash 0, u = 0 and x = 1 exactly: the inline bound straddles
 * 1, so libm decides (rank 0). */
static void test_exact_fallback(void) {
    const uint64_t vocab[2] = {1000, 10000000};
    make_model(&g_t, 2, 1, vocab, 1.1, 3);
    g_t.keys[0] = 0;
    g_t.keys[1] = 0;
    check_reference(&g_t, 0, 40);
    CHECK(g_rank[0] == 0 && g_rank[1] == 0);
}

/* The inverse of ref_mix: the hash key that gives hash h to sample 0. */
static uint64_t ref_unmix(uint64_t h) {
    static const int shifts[3] = {31, 27, 30};
    static const uint64_t muls[2] = {0x94D049BB133111EBULL, 0xBF58476D1CE4E5B9ULL};
    for (int k = 0; k < 3; k++) {
        uint64_t y = h; /* undo h ^= h >> s: y ^ (y >> s) ^ (y >> 2s) ... */
        for (int sh = shifts[k]; sh < 64; sh += shifts[k]) y ^= h >> sh;
        h = y;
        if (k < 2) h *= inv64(muls[k]);
    }
    return h;
}

/* The label's uniform exactly at p = 0.5 (logit 0): the inline tanh cannot decide
 * there, libm's formula does (0.5 < 0.5 is false; one ulp below, true). */
static void test_label_fallback(void) {
    const uint64_t vocab[2] = {1000, 10000000};
    make_model(&g_t, 2, 0, vocab, 1.1, 11);
    CHECK(ref_mix(ref_unmix(0x123456789ULL)) == 0x123456789ULL);
    g_t.m.bias = 0.0;
    CHECK_EQ_INT(run(&g_t.m, g_t.keys, 0, 1, &g_a), KV_OK);
    g_t.m.bias = -g_a.logit[0]; /* the float32 logit, exactly: the logit becomes 0 */
    g_t.keys[2] = ref_unmix(1ULL << 63); /* u = 2^52 * 2^-53 = 0.5 */
    CHECK_EQ_INT(run(&g_t.m, g_t.keys, 0, 1, &g_a), KV_OK);
    CHECK(g_a.logit[0] == 0.0 && g_a.label[0] == 0.0f);
    g_t.keys[2] = ref_unmix((1ULL << 63) - 2048); /* u = 0.5 - 2^-53 */
    CHECK_EQ_INT(run(&g_t.m, g_t.keys, 0, 1, &g_a), KV_OK);
    CHECK(g_a.logit[0] == 0.0 && g_a.label[0] == 1.0f);
}

static void test_permute(void) {
    static const uint64_t sizes[] = {1, 2, 3, 7, 1000, 1024, 1025, 65537};
    for (size_t k = 0; k < sizeof sizes / sizeof *sizes; k++) {
        uint64_t v = sizes[k];
        make_model(&g_t, 1, 0, &v, 1.1, 100 + k);
        uint64_t *x = malloc(v * 8), *y = malloc(v * 8);
        unsigned char *seen = calloc(v, 1);
        for (uint64_t i = 0; i < v; i++) x[i] = i;
        CHECK_EQ_INT(kv_synth_permute(&g_t.m.perm, x, (int64_t)v, 0, y), KV_OK);
        int ok = 1;
        for (uint64_t i = 0; i < v; i++) {
            ok &= y[i] < v && !seen[y[i]] && y[i] == ref_perm(&g_t, 0, i);
            if (y[i] < v) seen[y[i]] = 1;
        }
        CHECK(ok);
        CHECK_EQ_INT(kv_synth_permute(&g_t.m.perm, y, (int64_t)v, 1, y), KV_OK); /* in place */
        CHECK(!memcmp(x, y, v * 8));
        free(x);
        free(y);
        free(seen);
    }
    /* big fields: random values round-trip */
    const uint64_t big[3] = {(1ULL << 40) + 3, (1ULL << 61) + 5, 3};
    make_model(&g_t, 3, 0, big, 1.1, 5);
    uint64_t x[300], y[300], z[300], rng = 1;
    for (int i = 0; i < 300; i++) x[i] = test_rand(&rng) % big[i % 3];
    CHECK_EQ_INT(kv_synth_permute(&g_t.m.perm, x, 100, 0, y), KV_OK);
    int ok = 1;
    for (int i = 0; i < 300; i++) ok &= y[i] == ref_perm(&g_t, i % 3, x[i]);
    CHECK(ok);
    CHECK_EQ_INT(kv_synth_permute(&g_t.m.perm, y, 100, 1, z), KV_OK);
    CHECK(!memcmp(x, z, sizeof x));
    /* out of range: KV_EINVAL, out untouched */
    memset(z, 0xAB, sizeof z);
    x[299] = big[2];
    CHECK_EQ_INT(kv_synth_permute(&g_t.m.perm, x, 100, 0, z), KV_EINVAL);
    CHECK(z[0] == 0xABABABABABABABABULL && z[299] == 0xABABABABABABABABULL);
    CHECK_EQ_INT(kv_synth_permute(&g_t.m.perm, x, -1, 0, z), KV_EINVAL);
    CHECK_EQ_INT(kv_synth_permute(&g_t.m.perm, NULL, 1, 0, z), KV_EINVAL);
    CHECK_EQ_INT(kv_synth_permute(&g_t.m.perm, NULL, 0, 0, NULL), KV_OK);
}

static void test_checks(void) {
    const uint64_t vocab[3] = {10, 1000, 5};
    make_model(&g_t, 3, 2, vocab, 1.1, 9);
    CHECK_EQ_INT(kv_synth_check(&g_t.m), KV_OK);
    CHECK_EQ_INT(kv_synth_check(NULL), KV_EINVAL);
    CHECK_EQ_INT(kv_synth_perm_check(NULL), KV_EINVAL);
#define BAD(stmt)                                        \
    do {                                                 \
        model_t *t_ = &g_t;                              \
        make_model(t_, 3, 2, vocab, 1.1, 9);             \
        stmt;                                            \
        CHECK_EQ_INT(kv_synth_check(&t_->m), KV_EINVAL); \
    } while (0)
    BAD(t_->mask[1] = 1023);             /* M > vocab */
    BAD(t_->mask[1] = 255);              /* not the largest power of two */
    BAD(t_->mask[1] = 500);              /* not a power of two minus one */
    BAD(t_->shift[1] = 0);
    BAD(t_->shift[1] = 4);               /* 2 * 4 < 9 bits */
    BAD(t_->mul[2 * 3 + 1] &= ~1ULL);    /* even */
    BAD(t_->inv[0] += 2);
    BAD(t_->add[3] = t_->mask[0] + 1);
    BAD(t_->rot[1] = 1000);
    BAD(t_->vocab[0] = 0);
    BAD(t_->m.perm.num_fields = 0);
    BAD(t_->m.perm.mul = NULL);
    BAD(t_->m.num_numeric = -1);
    BAD(t_->m.log_uniform = 2);
    BAD(t_->m.isa = 4);
    BAD(t_->m.isa = -1);
    BAD(t_->m.zipf_exponent = 0.0);
    BAD(t_->m.zipf_exponent = INFINITY);
    BAD(t_->zc[0] = -1.5);
    BAD(t_->zc[0] = NAN);
    BAD(t_->off[2] = (int64_t)(1ULL << 62) - 4);
    BAD(t_->off[2] = -1);
    BAD(t_->wm[0] = NAN);
    BAD(t_->vs[2] = INFINITY);
    BAD(t_->mu[1] = 17.0f);
    BAD(t_->sg[0] = -0.5f);
    BAD(t_->be[1] = NAN);
    BAD(t_->m.bias = NAN);
    BAD(t_->m.center = NULL);
#undef BAD
    /* a vocab of 2^62 - 1 (mask 2^61 - 1) is fine on its own */
    const uint64_t huge = (1ULL << 62) - 1;
    make_model(&g_t, 1, 0, &huge, 1.1, 2);
    CHECK_EQ_INT(kv_synth_check(&g_t.m), KV_OK);
}

static void test_arguments(void) {
    const uint64_t vocab[2] = {10, 1000};
    make_model(&g_t, 2, 2, vocab, 1.1, 4);
    kv_synth_t *m = &g_t.m;
    int64_t cat[4];
    float num[4] = {0}, lab[2];
    double lg[2];
    uint64_t ranks[4] = {1, 2, 3, 4};
    CHECK_EQ_INT(kv_synth_samples(m, NULL, 0, 2, cat, num, lab, lg), KV_EINVAL);
    CHECK_EQ_INT(kv_synth_samples(m, g_t.keys, 0, -1, cat, num, lab, lg), KV_EINVAL);
    CHECK_EQ_INT(kv_synth_samples(m, g_t.keys, 0, 2, NULL, num, lab, lg), KV_EINVAL);
    CHECK_EQ_INT(kv_synth_samples(m, g_t.keys, 0, 2, cat, NULL, lab, lg), KV_EINVAL);
    CHECK_EQ_INT(kv_synth_samples(m, g_t.keys, 0, 0, NULL, NULL, NULL, NULL), KV_OK);
    CHECK_EQ_INT(kv_synth_samples(m, g_t.keys, 0, INT64_MAX, cat, num, lab, lg), KV_EINVAL);
    CHECK_EQ_INT(kv_synth_logit(m, ranks, num, 2, lg), KV_OK);
    CHECK_EQ_INT(kv_synth_logit(m, ranks, NULL, 2, lg), KV_EINVAL);
    CHECK_EQ_INT(kv_synth_logit(m, NULL, num, 2, lg), KV_EINVAL);
    CHECK_EQ_INT(kv_synth_logit(m, ranks, num, -1, lg), KV_EINVAL);
    ranks[0] = 10; /* field 0 has ranks 0..9 */
    CHECK_EQ_INT(kv_synth_logit(m, ranks, num, 2, lg), KV_EINVAL);
    /* no numbers: numeric may be NULL */
    make_model(&g_t, 2, 0, vocab, 1.1, 4);
    ranks[0] = 1;
    CHECK_EQ_INT(kv_synth_samples(m, g_t.keys, 0, 2, cat, NULL, lab, lg), KV_OK);
    CHECK_EQ_INT(kv_synth_logit(m, ranks, NULL, 2, lg), KV_OK);
}

static void test_oom(void) {
    const uint64_t vocab[2] = {10, 1000};
    make_model(&g_t, 2, 2, vocab, 1.1, 4);
    int64_t cat[4];
    float num[4], lab[2];
    double lg[2];
    uint64_t ranks[4] = {1, 2, 3, 4};
    fail_alloc_install();
    fail_alloc_arm(1);
    CHECK_EQ_INT(kv_synth_samples(&g_t.m, g_t.keys, 0, 2, cat, num, lab, lg), KV_ENOMEM);
    fail_alloc_arm(1);
    CHECK_EQ_INT(kv_synth_logit(&g_t.m, ranks, num, 2, lg), KV_ENOMEM);
    fail_alloc_arm(0);
    CHECK_EQ_INT(kv_synth_samples(&g_t.m, g_t.keys, 0, 2, cat, num, lab, lg), KV_OK);
    kv_set_allocator(NULL, NULL, NULL);
}

int main(void) {
    test_checks();
    test_permute();
    test_models();
    test_exact_fallback();
    test_label_fallback();
    test_arguments();
    test_oom();
    printf("kv_synth_best_isa: %d\n", kv_synth_best_isa());
    return test_summary();
}
