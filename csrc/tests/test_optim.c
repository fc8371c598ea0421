/*
 * test_optim.c - smoke tests of the row optimizers (kv_optim.c), no table involved.
 *
 * Hyperparameter checks, slot counts and initial slots, one hand-computed step of
 * every rule (Adagrad with epsilon outside and inside the sqrt, FTRL with Keras'
 * beta, which follows a changed learning rate), the group-lasso zeroing (exact +0.0f bits, threshold l21 * sqrt(dim)),
 * Group Adam without regularization reducing to Adam, multi-row strides, and the
 * per-row step counter; row-wise Adagrad (FBGEMM's rule: the mean of g^2 into one
 * accumulator per row, its three weight-decay modes, dim 1 equal to Adagrad). The precise comparison with TensorFlow and TFPlus's rules
 * lives in tests/unit/test_optimizers.py. Buffers are malloc'ed at their exact size
 * so AddressSanitizer sees any write past a row's slots.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../kv_optim.h"
#include "test_util.h"

#define CLOSE(a, b, rel) (fabs((double)(a) - (double)(b)) <= (rel) * (fabs((double)(b)) + 1e-30))

static kv_optim_t base(int32_t kind, float lr)
{
    kv_optim_t o;
    memset(&o, 0, sizeof o);
    o.kind = kind;
    o.lr = lr;
    return o;
}

static float *fvec(size_t n, float x)
{
    float *p = malloc(n * sizeof *p);
    for (size_t i = 0; i < n; i++)
        p[i] = x;
    return p;
}

static uint32_t bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static void test_check(void)
{
    kv_optim_t o = base(KV_OPT_ADAM, 0.1f);
    o.beta1 = 0.9f, o.beta2 = 0.999f, o.epsilon = 1e-7f, o.lr_power = -0.5f;
    CHECK_EQ_INT(kv_optim_check(&o), KV_OK);
    CHECK_EQ_INT(kv_optim_check(NULL), KV_EINVAL);

    struct { float *field; float bad; } cases[] = {
        {&o.lr, 0.0f}, {&o.lr, -1.0f}, {&o.lr, NAN}, {&o.lr, INFINITY},
        {&o.beta1, 1.0f}, {&o.beta1, -0.1f}, {&o.beta2, 1.0f}, {&o.beta2, NAN},
        {&o.epsilon, -1e-9f}, {&o.initial_accumulator, -0.1f}, {&o.l1, -1.0f},
        {&o.l2, -1.0f}, {&o.l21, -1.0f}, {&o.l2_shrinkage, -1.0f},
        {&o.lr_power, 0.5f}, {&o.epsilon, INFINITY}, {&o.l21, NAN},
        {&o.beta, -0.1f}, {&o.beta, NAN}, {&o.beta, INFINITY},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        float keep = *cases[i].field;
        *cases[i].field = cases[i].bad;
        CHECK_EQ_INT(kv_optim_check(&o), KV_EOPTIM);
        *cases[i].field = keep;
    }
    CHECK_EQ_INT(kv_optim_check(&o), KV_OK);
    o.per_row_step = 2;
    CHECK_EQ_INT(kv_optim_check(&o), KV_EOPTIM);
    o.per_row_step = 1;
    CHECK_EQ_INT(kv_optim_check(&o), KV_OK);
    o.kind = 7;
    CHECK_EQ_INT(kv_optim_check(&o), KV_EOPTIM);
    o.kind = -1;
    CHECK_EQ_INT(kv_optim_check(&o), KV_EOPTIM);
    for (int32_t k = KV_OPT_SGD; k <= KV_OPT_ROWWISE_ADAGRAD; k++) {
        const int rowwise = k == KV_OPT_ROWWISE_ADAGRAD;
        o.kind = k;
        CHECK_EQ_INT(kv_optim_check(&o), KV_OK);
        /* epsilon inside the sqrt: Adagrad's flag only; unknown bits never */
        o.flags = KV_OPTF_EPS_INSIDE_SQRT;
        CHECK_EQ_INT(kv_optim_check(&o), k == KV_OPT_ADAGRAD ? KV_OK : KV_EOPTIM);
        o.flags = 8;
        CHECK_EQ_INT(kv_optim_check(&o), KV_EOPTIM);
        /* weight decay and its modes: row-wise Adagrad's only, one mode at a time, and a
         * decay without a mode (FBGEMM's NONE ignores it) is refused */
        o.flags = KV_OPTF_WD_L2;
        CHECK_EQ_INT(kv_optim_check(&o), rowwise ? KV_OK : KV_EOPTIM);
        o.flags = KV_OPTF_WD_DECOUPLED;
        o.weight_decay = 0.01f;
        CHECK_EQ_INT(kv_optim_check(&o), rowwise ? KV_OK : KV_EOPTIM);
        o.flags = KV_OPTF_WD_L2 | KV_OPTF_WD_DECOUPLED;
        CHECK_EQ_INT(kv_optim_check(&o), KV_EOPTIM);
        o.flags = 0;
        CHECK_EQ_INT(kv_optim_check(&o), KV_EOPTIM);
        o.flags = KV_OPTF_WD_L2;
        o.weight_decay = -0.01f;
        CHECK_EQ_INT(kv_optim_check(&o), KV_EOPTIM);
        o.weight_decay = NAN;
        CHECK_EQ_INT(kv_optim_check(&o), KV_EOPTIM);
        o.flags = 0, o.weight_decay = 0.0f;
    }
}

static void test_slots(void)
{
    const int32_t d = 5;
    int32_t want[] = {0, d, 2 * d + 1, 2 * d, 3 * d + 1, 2 * d, 1};
    for (int32_t k = KV_OPT_SGD; k <= KV_OPT_ROWWISE_ADAGRAD; k++) {
        kv_optim_t o = base(k, 0.1f);
        o.initial_accumulator = 0.25f;
        CHECK_EQ_INT(kv_optim_slot_floats(&o, d), want[k]);
        if (want[k] == 0)
            continue;
        float *s = fvec((size_t)want[k], 123.0f);
        kv_optim_init_slots(&o, d, s);
        int ok = 1;
        for (int32_t i = 0; i < want[k]; i++) {
            float expect = 0.0f;
            if ((k == KV_OPT_ADAGRAD || k == KV_OPT_FTRL || k == KV_OPT_GROUP_ADAGRAD ||
                 k == KV_OPT_ROWWISE_ADAGRAD) && i < d)
                expect = 0.25f;
            if (k == KV_OPT_GROUP_ADAM && i >= d && i < 2 * d)
                expect = 0.25f; /* Group Adam's v */
            ok &= bits(s[i]) == bits(expect);
        }
        CHECK(ok);
        free(s);
    }
    kv_optim_t o = base(KV_OPT_ADAM, 0.1f);
    CHECK(kv_optim_slot_floats(&o, 0) < 0);
    o.kind = 9;
    CHECK(kv_optim_slot_floats(&o, 4) < 0);
}

static void test_sgd_and_adagrad(void)
{
    kv_optim_t o = base(KV_OPT_SGD, 0.5f);
    float *w = fvec(3, 1.0f), g[3] = {2.0f, -1.0f, 0.0f};
    kv_optim_apply_rows(&o, 3, 1, w, NULL, g, 1); /* SGD: no slots, NULL is fine */
    CHECK(w[0] == 0.0f && w[1] == 1.5f && w[2] == 1.0f);
    free(w);

    o = base(KV_OPT_ADAGRAD, 0.1f);
    o.initial_accumulator = 0.1f, o.epsilon = 1e-7f;
    w = fvec(2, 1.0f);
    float *s = fvec(2, 0.0f), g2[2] = {1.0f, -2.0f};
    kv_optim_init_slots(&o, 2, s);
    kv_optim_apply_rows(&o, 2, 1, w, s, g2, 1);
    CHECK(CLOSE(s[0], 1.1, 1e-6) && CLOSE(s[1], 4.1, 1e-6));
    CHECK(CLOSE(w[0], 1.0 - 0.1 / (sqrt(1.1) + 1e-7), 1e-6));
    CHECK(CLOSE(w[1], 1.0 + 0.2 / (sqrt(4.1) + 1e-7), 1e-6));
    free(w), free(s);
}

/* Adagrad's two epsilon rules: TF's / (sqrt(accum) + eps) and Keras 3's
 * / sqrt(accum + eps). A small accumulator makes them far apart. */
static void test_adagrad_epsilon_inside_sqrt(void)
{
    for (int inside = 0; inside < 2; inside++) {
        kv_optim_t o = base(KV_OPT_ADAGRAD, 0.1f);
        o.initial_accumulator = 0.0f, o.epsilon = 1e-4f;
        o.flags = inside ? KV_OPTF_EPS_INSIDE_SQRT : 0;
        CHECK_EQ_INT(kv_optim_check(&o), KV_OK);
        float *w = fvec(2, 1.0f), *s = fvec(2, 5.0f), g[2] = {1e-3f, -2.0f};
        kv_optim_init_slots(&o, 2, s);
        CHECK(s[0] == 0.0f && s[1] == 0.0f);
        kv_optim_apply_rows(&o, 2, 1, w, s, g, 1);
        for (int i = 0; i < 2; i++) {
            double a = (double)g[i] * g[i];
            double den = inside ? sqrt(a + 1e-4) : sqrt(a) + 1e-4;
            CHECK(CLOSE(s[i], a, 1e-6));
            CHECK(CLOSE(w[i], 1.0 - 0.1 * g[i] / den, 1e-6));
        }
        /* g = 1e-3: outside moves by lr * 0.909, inside by lr * 0.0995 */
        CHECK(inside ? w[0] > 0.98f : w[0] < 0.92f);
        free(w), free(s);
    }
}

static void test_adam(void)
{
    kv_optim_t o = base(KV_OPT_ADAM, 0.01f);
    o.beta1 = 0.9f, o.beta2 = 0.999f, o.epsilon = 1e-7f;
    const int32_t d = 4;
    float *w = fvec(d, 0.5f), *s = fvec(2 * d + 1, 9.0f), g[4] = {1, -2, 0.5f, 0};
    kv_optim_init_slots(&o, d, s);
    kv_optim_apply_rows(&o, d, 1, w, s, g, 1);
    /* step 1: m = 0.1 g, v = 0.001 g^2, lr_t = lr sqrt(0.001) / 0.1, so the step is
       lr * g / (|g| + epsilon / sqrt(0.001)) ~ lr * sign(g) */
    for (int i = 0; i < 3; i++) {
        double m = 0.1 * g[i], v = 0.001 * g[i] * g[i];
        double lr_t = 0.01 * sqrt(1 - 0.999) / (1 - 0.9);
        CHECK(CLOSE(w[i], 0.5 - lr_t * m / (sqrt(v) + 1e-7), 1e-5));
    }
    CHECK(w[3] == 0.5f); /* zero gradient, zero moments: no move */
    uint32_t count;
    memcpy(&count, s + 2 * d, sizeof count);
    CHECK_EQ_INT(count, 1);

    /* per_row_step: a row's first update at global step 50 is still "step 1" */
    kv_optim_t p = o;
    p.per_row_step = 1;
    float *w2 = fvec(d, 0.5f), *s2 = fvec(2 * d + 1, 0.0f);
    kv_optim_init_slots(&p, d, s2);
    kv_optim_apply_rows(&p, d, 1, w2, s2, g, 50);
    CHECK(memcmp(w, w2, d * sizeof(float)) == 0);
    /* without it, step 50's bias correction applies */
    float *w3 = fvec(d, 0.5f), *s3 = fvec(2 * d + 1, 0.0f);
    kv_optim_init_slots(&o, d, s3);
    kv_optim_apply_rows(&o, d, 1, w3, s3, g, 50);
    double lr_50 = 0.01 * sqrt(1 - pow(0.999, 50)) / (1 - pow(0.9, 50));
    CHECK(CLOSE(w3[0], 0.5 - lr_50 * 0.1 / (sqrt(0.001) + 1e-7), 1e-5));
    free(w), free(s), free(w2), free(s2), free(w3), free(s3);
}

static void test_step_counter_saturates(void)
{
    kv_optim_t o = base(KV_OPT_ADAM, 0.01f);
    o.beta1 = 0.9f, o.beta2 = 0.999f, o.per_row_step = 1;
    float *w = fvec(1, 0.0f), *s = fvec(3, 0.0f), g = 1.0f;
    uint32_t n = 0x7F7FFFFEu;
    memcpy(s + 2, &n, sizeof n);
    kv_optim_apply_rows(&o, 1, 1, w, s, &g, 1);
    kv_optim_apply_rows(&o, 1, 1, w, s, &g, 1);
    memcpy(&n, s + 2, sizeof n);
    CHECK_EQ_INT(n, 0x7F7FFFFFu);
    CHECK(isfinite(s[2]) && isfinite(w[0]));
    /* a step argument < 1 is treated as 1 rather than dividing by 1 - beta^0 = 0 */
    o.per_row_step = 0;
    kv_optim_apply_rows(&o, 1, 1, w, s, &g, 0);
    CHECK(isfinite(w[0]));
    free(w), free(s);
}

static void test_ftrl(void)
{
    kv_optim_t o = base(KV_OPT_FTRL, 0.1f);
    o.lr_power = -0.5f, o.initial_accumulator = 0.1f, o.l2 = 0.05f;
    float *w = fvec(2, 0.0f), *s = fvec(4, 0.0f), g[2] = {1.0f, -0.5f};
    kv_optim_init_slots(&o, 2, s);
    kv_optim_apply_rows(&o, 2, 1, w, s, g, 1);
    /* from w = 0 with l1 = 0: linear = g, w = -g / (sqrt(accum + g^2) / lr + 2 l2) */
    for (int i = 0; i < 2; i++) {
        CHECK(s[2 + i] == g[i]);
        CHECK(CLOSE(w[i], -g[i] / (sqrt(0.1 + g[i] * g[i]) / 0.1 + 0.1), 1e-6));
    }
    /* |linear| <= l1 -> exactly 0 */
    o.l1 = 2.0f;
    float *w2 = fvec(2, 0.3f), *s2 = fvec(4, 0.0f);
    kv_optim_init_slots(&o, 2, s2);
    kv_optim_apply_rows(&o, 2, 1, w2, s2, (float[]){0.01f, 0.01f}, 1);
    CHECK(w2[0] == 0.0f && w2[1] == 0.0f);
    /* lr_power = 0: constant rate, P(x) = 1 */
    kv_optim_t c = base(KV_OPT_FTRL, 0.1f);
    c.initial_accumulator = 0.1f;
    float *w3 = fvec(1, 0.0f), *s3 = fvec(2, 0.0f), g3 = 2.0f;
    kv_optim_init_slots(&c, 1, s3);
    kv_optim_apply_rows(&c, 1, 1, w3, s3, &g3, 1);
    CHECK(CLOSE(w3[0], -0.2, 1e-6)); /* -linear * lr */
    free(w), free(s), free(w2), free(s2), free(w3), free(s3);
}

/* Keras' beta adds beta / (2 lr) to l2, with the lr of each call: a learning rate
 * changed between steps changes the extra l2 too. beta = 0 is TF's rule bit for bit. */
static void test_ftrl_beta(void)
{
    kv_optim_t o = base(KV_OPT_FTRL, 0.1f);
    o.lr_power = -0.5f, o.initial_accumulator = 0.1f, o.l2 = 0.05f, o.beta = 0.3f;
    float *w = fvec(2, 0.0f), *s = fvec(4, 0.0f), g[2] = {1.0f, -0.5f};
    kv_optim_init_slots(&o, 2, s);
    kv_optim_apply_rows(&o, 2, 1, w, s, g, 1);
    /* from w = 0 with l1 = 0: w = -g / (sqrt(accum') / lr + 2 l2 + beta / lr) */
    for (int i = 0; i < 2; i++)
        CHECK(CLOSE(w[i], -g[i] / (sqrt(0.1 + g[i] * g[i]) / 0.1 + 0.1 + 0.3 / 0.1), 1e-6));
    /* a second step at lr 0.4 (a schedule): linear moves by g - dP / lr * w and the
     * denominator uses beta / 0.4 */
    o.lr = 0.4f;
    float w1[2] = {w[0], w[1]}, lin[2] = {s[2], s[3]}, acc[2] = {s[0], s[1]};
    kv_optim_apply_rows(&o, 2, 1, w, s, g, 2);
    for (int i = 0; i < 2; i++) {
        double a2 = (double)acc[i] + (double)g[i] * g[i];
        double l = lin[i] + g[i] - (sqrt(a2) - sqrt((double)acc[i])) / 0.4 * w1[i];
        CHECK(CLOSE(s[2 + i], l, 1e-5));
        CHECK(CLOSE(w[i], -l / (sqrt(a2) / 0.4 + 0.1 + 0.3 / 0.4), 1e-5));
    }
    /* beta = 0 leaves the rule exactly as it was without it */
    kv_optim_t z = base(KV_OPT_FTRL, 0.1f);
    z.lr_power = -0.5f, z.initial_accumulator = 0.1f, z.l2 = 0.05f, z.l1 = 0.01f;
    float *wa = fvec(3, 0.25f), *sa = fvec(6, 0.0f), ga[3] = {0.3f, -0.7f, 2.0f};
    kv_optim_init_slots(&z, 3, sa);
    kv_optim_apply_rows(&z, 3, 1, wa, sa, ga, 1);
    for (int i = 0; i < 3; i++) {
        const float new_accum = 0.1f + ga[i] * ga[i];
        const float lin0 = (ga[i] - (sqrtf(new_accum) - sqrtf(0.1f)) / 0.1f * 0.25f);
        const float x = (lin0 > 0.01f ? 0.01f : lin0 < -0.01f ? -0.01f : lin0) - lin0;
        CHECK(bits(wa[i]) == bits(x / (sqrtf(new_accum) / 0.1f + 2.0f * 0.05f)));
    }
    free(w), free(s), free(wa), free(sa);
}

/* A Group Adagrad step from w = 0 with l1 = 0 gives linear = g: the row is kept iff
 * ||g|| > l21 * sqrt(dim). */
static void test_group_adagrad_threshold(void)
{
    const int32_t dims[] = {1, 7, 64, 1000};
    for (size_t k = 0; k < sizeof dims / sizeof dims[0]; k++) {
        const int32_t d = dims[k];
        kv_optim_t o = base(KV_OPT_GROUP_ADAGRAD, 0.1f);
        o.lr_power = -0.5f, o.initial_accumulator = 0.1f, o.l21 = 0.5f;
        for (int above = 0; above < 2; above++) {
            float *w = fvec((size_t)d, 0.0f), *s = fvec(2 * (size_t)d, 0.0f);
            float *g = fvec((size_t)d, above ? 0.6f : 0.4f); /* ||g|| = c sqrt(d) */
            kv_optim_init_slots(&o, d, s);
            kv_optim_apply_rows(&o, d, 1, w, s, g, 1);
            int zero = 1, nonzero = 1;
            for (int32_t i = 0; i < d; i++) {
                zero &= bits(w[i]) == 0u; /* +0.0f, not -0.0f */
                nonzero &= w[i] != 0.0f;
            }
            CHECK(above ? nonzero : zero);
            if (above) /* shrink factor 1 - 0.5/0.6 */
                CHECK(CLOSE(w[0], -0.6 * (1 - 0.5 / 0.6) / (sqrt(0.1 + 0.36) / 0.1), 1e-5));
            free(w), free(s), free(g);
        }
    }
}

/* Group Adam with l1 = l2 = l21 = 0 and per-row steps is Adam (Adam's epsilon). */
static void test_group_adam_reduces_to_adam(void)
{
    const int32_t d = 6;
    kv_optim_t a = base(KV_OPT_ADAM, 0.02f), ga;
    a.beta1 = 0.8f, a.beta2 = 0.95f, a.epsilon = 1e-6f, a.per_row_step = 1;
    ga = a;
    ga.kind = KV_OPT_GROUP_ADAM;
    float *wa = fvec(d, 0.0f), *wg = fvec(d, 0.0f);
    float *sa = fvec(2 * d + 1, 0.0f), *sg = fvec(3 * d + 1, 0.0f), *g = fvec(d, 0.0f);
    uint64_t seed = 42;
    for (int32_t i = 0; i < d; i++)
        wa[i] = wg[i] = (float)((double)(test_rand(&seed) >> 11) / 9007199254740992.0 - 0.5);
    kv_optim_init_slots(&a, d, sa);
    kv_optim_init_slots(&ga, d, sg);
    int ok = 1;
    for (int step = 1; step <= 20; step++) {
        for (int32_t i = 0; i < d; i++)
            g[i] = (float)((double)(test_rand(&seed) >> 11) / 9007199254740992.0 - 0.5);
        kv_optim_apply_rows(&a, d, 1, wa, sa, g, 1000 + step);
        kv_optim_apply_rows(&ga, d, 1, wg, sg, g, 1000 + step);
        for (int32_t i = 0; i < d; i++)
            ok &= fabsf(wa[i] - wg[i]) <= 1e-5f * (fabsf(wa[i]) + 1e-3f);
    }
    CHECK(ok);
    uint32_t ca, cg;
    memcpy(&ca, sa + 2 * d, sizeof ca);
    memcpy(&cg, sg + 3 * d, sizeof cg);
    CHECK(ca == 20 && cg == 20);

    /* huge l21 (scaled by lr, then sqrt(dim)) zeroes the row exactly */
    ga.l21 = 1e6f;
    kv_optim_apply_rows(&ga, d, 1, wg, sg, g, 1);
    int zero = 1;
    for (int32_t i = 0; i < d; i++)
        zero &= bits(wg[i]) == 0u;
    CHECK(zero);
    free(wa), free(wg), free(sa), free(sg), free(g);
}

/* nrows > 1 uses strides dim (w, g) and slot_floats (slots): same as row by row. */
static void test_multi_row_strides(void)
{
    const int32_t d = 3;
    for (int32_t k = KV_OPT_SGD; k <= KV_OPT_ROWWISE_ADAGRAD; k++) {
        kv_optim_t o = base(k, 0.05f);
        o.beta1 = 0.9f, o.beta2 = 0.99f, o.epsilon = 1e-7f, o.lr_power = -0.5f;
        o.initial_accumulator = 0.1f, o.l1 = 0.001f, o.l2 = 0.001f, o.l21 = 0.001f;
        const int32_t ns = kv_optim_slot_floats(&o, d);
        const size_t nw = 4 * (size_t)d, nsl = 4 * (size_t)ns;
        float *w1 = fvec(nw, 0.0f), *w2 = fvec(nw, 0.0f), *g = fvec(nw, 0.0f);
        float *s1 = ns ? fvec(nsl, 0.0f) : NULL, *s2 = ns ? fvec(nsl, 0.0f) : NULL;
        uint64_t seed = 7 + (uint64_t)k;
        for (size_t i = 0; i < nw; i++) {
            w1[i] = w2[i] = (float)(test_rand(&seed) % 1000) / 1000.0f - 0.5f;
            g[i] = (float)(test_rand(&seed) % 1000) / 500.0f - 1.0f;
        }
        for (int r = 0; r < 4 && ns; r++) {
            kv_optim_init_slots(&o, d, s1 + r * ns);
            kv_optim_init_slots(&o, d, s2 + r * ns);
        }
        kv_optim_apply_rows(&o, d, 4, w1, s1, g, 3);
        for (int r = 0; r < 4; r++)
            kv_optim_apply_rows(&o, d, 1, w2 + r * d, ns ? s2 + r * ns : NULL, g + r * d, 3);
        CHECK(memcmp(w1, w2, nw * sizeof(float)) == 0);
        CHECK(ns == 0 || memcmp(s1, s2, nsl * sizeof(float)) == 0);
        free(w1), free(w2), free(g), free(s1), free(s2);
    }
}

/* Row-wise Adagrad, FBGEMM's rule by hand (in double; the kernel is float): the
 * accumulator gains the mean of g'^2 over the row, every component moves with one step
 * m = lr / (sqrt(accum) + eps), and the weight-decay modes change g' and the factor c. */
static void test_rowwise_adagrad(void)
{
    const float w0[4] = {0.5f, -1.0f, 2.0f, 0.0f}, g[4] = {1.0f, -2.0f, 0.5f, 0.0f};
    const int32_t modes[3] = {0, KV_OPTF_WD_L2, KV_OPTF_WD_DECOUPLED};
    for (int k = 0; k < 3; k++) {
        kv_optim_t o = base(KV_OPT_ROWWISE_ADAGRAD, 0.1f);
        o.epsilon = 1e-8f, o.initial_accumulator = 0.25f;
        o.flags = modes[k], o.weight_decay = k ? 0.05f : 0.0f;
        CHECK_EQ_INT(kv_optim_check(&o), KV_OK);
        CHECK_EQ_INT(kv_optim_slot_floats(&o, 4), 1);
        float *w = fvec(4, 0.0f), *s = fvec(1, 9.0f);
        memcpy(w, w0, sizeof w0);
        kv_optim_init_slots(&o, 4, s);
        CHECK(s[0] == 0.25f);
        kv_optim_apply_rows(&o, 4, 1, w, s, g, 1);
        double sumsq = 0.0, wd = k ? 0.05 : 0.0;
        for (int i = 0; i < 4; i++) {
            double gi = g[i] + (modes[k] == KV_OPTF_WD_L2 ? wd * w0[i] : 0.0);
            sumsq += gi * gi;
        }
        const double acc = 0.25 + sumsq / 4.0;
        const double m = 0.1 / (sqrt(acc) + 1e-8);
        const double c = modes[k] == KV_OPTF_WD_L2 ? 1.0 - m * wd
                         : modes[k] == KV_OPTF_WD_DECOUPLED ? 1.0 - 0.1 * wd : 1.0;
        CHECK(CLOSE(s[0], acc, 1e-6));
        for (int i = 0; i < 4; i++)
            CHECK(CLOSE(w[i], c * w0[i] - m * g[i], 1e-6) || (w0[i] == 0.0f && g[i] == 0.0f &&
                                                              w[i] == 0.0f));
        /* a second step adds to the same single accumulator */
        kv_optim_apply_rows(&o, 4, 1, w, s, g, 2);
        CHECK(s[0] > (float)acc);
        free(w), free(s);
    }
    /* dim 1: the mean over the row is the element itself, so it is Adagrad with epsilon
     * outside the sqrt (the same accumulator bits; the weight to an ulp, as FBGEMM
     * multiplies g by lr / den where TF divides lr * g by den) */
    kv_optim_t r = base(KV_OPT_ROWWISE_ADAGRAD, 0.05f), a = base(KV_OPT_ADAGRAD, 0.05f);
    r.epsilon = a.epsilon = 1e-7f, r.initial_accumulator = a.initial_accumulator = 0.1f;
    float wr = 0.3f, wa = 0.3f, sr, sa;
    kv_optim_init_slots(&r, 1, &sr), kv_optim_init_slots(&a, 1, &sa);
    for (int step = 1; step <= 5; step++) {
        const float gs = 0.7f - 0.3f * (float)step;
        kv_optim_apply_rows(&r, 1, 1, &wr, &sr, &gs, step);
        kv_optim_apply_rows(&a, 1, 1, &wa, &sa, &gs, step);
    }
    CHECK(bits(sr) == bits(sa) && CLOSE(wr, wa, 1e-6));
}

int main(void)
{
    test_check();
    test_slots();
    test_sgd_and_adagrad();
    test_adagrad_epsilon_inside_sqrt();
    test_adam();
    test_step_counter_saturates();
    test_ftrl();
    test_ftrl_beta();
    test_group_adagrad_threshold();
    test_group_adam_reduces_to_adam();
    test_multi_row_strides();
    test_rowwise_adagrad();
    return test_summary();
}
