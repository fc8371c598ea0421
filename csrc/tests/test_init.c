/*
 * test_init.c - initial values (kv_init.c) against a plain per-element reference, with
 * every ISA copy of the kernel this CPU runs.
 *
 * The reference computes element e of key k on its own, straight from the documented
 * definition (the draw's counter, pair_uniforms, Box-Muller with kv_fmath's log and
 * sincos, the truncated redraws, the uniform's rounding rule), in scalar code. Every
 * KV_INIT_ISA_* copy must give exactly its bits, for every kind and for dims that
 * make rows straddle the kernel's blocks (odd dims, more than one block per row).
 * (test_table.c checks the values against libm and the order and split invariance.)
 */
#include <math.h>
#include <string.h>

#include "../kv_fmath.h"
#include "../kv_init.h"
#include "../kv_route.h"
#include "test_util.h"

#define GOLDEN 0x9e3779b97f4a7c15ULL

static uint64_t ref_draw(uint64_t base, uint64_t counter) {
    return kv_mix64(base + GOLDEN * (counter + 1));
}

/* the z of counter c: element 0 (cos) or 1 (sin) of its Box-Muller pair */
static float ref_z(uint64_t base, uint64_t c, int sin_half) {
    uint64_t h = ref_draw(base, c);
    float u1 = (float)((h >> 40) + 1) * 0x1p-24f, u2 = (float)((h >> 16) & 0xffffff) * 0x1p-24f;
    float r = sqrtf(-2.0f * kv_logf(u1)), sn, cs;
    kv_sincos_turn(u2, &sn, &cs);
    return sin_half ? r * sn : r * cs;
}

static float ref_value(const kv_table_config_t *c, int64_t key, int32_t e) {
    float a = c->init_a, b = c->init_b;
    uint64_t base = kv_mix64(kv_mix64(kv_mix64(c->seed) ^ c->table_id) ^ (uint64_t)key);
    switch (c->init_kind) {
    case KV_INIT_ZEROS: return 0.0f;
    case KV_INIT_CONSTANT: return a;
    case KV_INIT_UNIFORM: {
        double u = (double)(ref_draw(base, (uint64_t)e << 24) >> 40) * 0x1p-24;
        float v = (float)((double)a + ((double)b - (double)a) * u);
        return v >= b && a < b ? nextafterf(b, a) : v;
    }
    default: {
        float z = ref_z(base, (uint64_t)(e & ~1) << 24, e & 1);
        if (c->init_kind == KV_INIT_TRUNCATED_NORMAL)
            for (uint64_t attempt = 1; fabsf(z) > 2.0f; attempt++)
                z = attempt < (1u << 20) ? ref_z(base, ((uint64_t)e << 24) + 2 * attempt, 0) : 0.0f;
        return a + b * z;
    }
    }
}

static long g_redrawn; /* truncated-normal elements whose first redraw was out too */

static void count_second_redraws(const kv_table_config_t *c, int64_t key, int32_t dim) {
    uint64_t base = kv_mix64(kv_mix64(kv_mix64(c->seed) ^ c->table_id) ^ (uint64_t)key);
    for (int32_t e = 0; e < dim; e++)
        if (fabsf(ref_z(base, (uint64_t)(e & ~1) << 24, e & 1)) > 2.0f &&
            fabsf(ref_z(base, ((uint64_t)e << 24) + 2, 0)) > 2.0f)
            g_redrawn++;
}

/* Every ISA copy gives the reference's bits, for every kind and many dims. */
static void test_isa_copies(void) {
    static const int32_t dims[] = {1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 33, 64, 255, 256, 257, 300, 513};
    static const float ab[][2] = {{0.0f, 1.0f}, {-0.5f, 0.25f}, {1.0f, 0.05f}, {3.0f, 0.0f}, {0.1f, 0.1f}};
    enum { N = 700 };
    int64_t *keys = malloc(N * sizeof(int64_t));
    float *ref = malloc((size_t)N * 513 * sizeof(float)), *got = malloc((size_t)N * 513 * sizeof(float));
    uint64_t rng = 99;
    for (int i = 0; i < N; i++) keys[i] = (int64_t)test_rand(&rng);
    keys[0] = 0;
    keys[1] = -1;
    keys[2] = INT64_MIN;
    keys[3] = INT64_MAX;
    int best = kv_init_best_isa();
    CHECK(best >= KV_INIT_ISA_BASE && best <= KV_INIT_ISA_AVX512);
    long compared = 0;
    for (size_t di = 0; di < sizeof dims / sizeof *dims; di++) {
        int32_t dim = dims[di];
        int n = dim > 100 ? 97 : N - (int)di; /* wide rows: fewer keys */
        for (int32_t kind = KV_INIT_ZEROS; kind <= KV_INIT_TRUNCATED_NORMAL; kind++)
            for (size_t pi = 0; pi < sizeof ab / sizeof *ab; pi++) {
                kv_table_config_t c;
                memset(&c, 0, sizeof c);
                c.dim = dim;
                c.init_kind = kind;
                c.init_a = ab[pi][0];
                c.init_b = ab[pi][1];
                c.seed = 1234 + pi;
                c.table_id = 77 + (uint64_t)di;
                if (kind == KV_INIT_UNIFORM && c.init_a > c.init_b) {
                    float t = c.init_a;
                    c.init_a = c.init_b;
                    c.init_b = t;
                }
                CHECK_EQ_INT(kv_init_check(&c), KV_OK);
                for (int i = 0; i < n; i++)
                    for (int32_t e = 0; e < dim; e++) ref[(size_t)i * dim + e] = ref_value(&c, keys[i], e);
                if (kind == KV_INIT_TRUNCATED_NORMAL && pi == 0)
                    for (int i = 0; i < n; i++) count_second_redraws(&c, keys[i], dim);
                size_t bytes = (size_t)n * dim * sizeof(float);
                for (int32_t isa = KV_INIT_ISA_BEST; isa <= best; isa++) {
                    memset(got, 0xff, bytes);
                    CHECK_EQ_INT(kv_initial_values_isa(&c, keys, n, got, isa), KV_OK);
                    int same = !memcmp(got, ref, bytes);
                    if (!same)
                        fprintf(stderr, "isa %d dim %d kind %d a %g b %g: not the reference's bits\n",
                                isa, dim, kind, c.init_a, c.init_b);
                    CHECK(same);
                    compared++;
                }
                /* the public entry, one key at a time and the whole batch */
                CHECK_EQ_INT(kv_initial_values(&c, keys, n, got), KV_OK);
                CHECK(!memcmp(got, ref, bytes));
                for (int i = 0; i < n; i += 13) {
                    CHECK_EQ_INT(kv_initial_values(&c, keys + i, 1, got), KV_OK);
                    CHECK(!memcmp(got, ref + (size_t)i * dim, (size_t)dim * sizeof(float)));
                }
            }
    }
    CHECK(compared > 0);
    CHECK(g_redrawn > 20); /* the second-redraw path was exercised */
    free(keys);
    free(ref);
    free(got);
}

/* Rows given as separate pointers (as kv_table does), batches of any size. */
static void test_rows_api(void) {
    enum { N = 150, DIM = 9 };
    kv_table_config_t c;
    memset(&c, 0, sizeof c);
    c.dim = DIM;
    c.init_kind = KV_INIT_TRUNCATED_NORMAL;
    c.init_b = 1.0f;
    c.seed = 5;
    int64_t keys[N];
    static float rows[N][DIM + 3];
    float *out[N];
    for (int i = 0; i < N; i++) {
        keys[i] = (int64_t)i * 1000003 - 77;
        out[N - 1 - i] = rows[N - 1 - i] + 1; /* reversed, unaligned */
    }
    memset(rows, 0, sizeof rows);
    kv_init_rows(&c, keys, N, out);
    int ok = 1;
    for (int i = 0; i < N; i++) {
        ok &= rows[i][0] == 0.0f && rows[i][DIM + 1] == 0.0f && rows[i][DIM + 2] == 0.0f;
        for (int32_t e = 0; e < DIM; e++) ok &= out[i][e] == ref_value(&c, keys[i], e);
    }
    CHECK(ok);
    kv_init_rows(&c, keys, 0, out); /* nothing */
    CHECK(ok);
}

static void test_arguments(void) {
    kv_table_config_t c;
    memset(&c, 0, sizeof c);
    c.dim = 4;
    c.init_kind = KV_INIT_NORMAL;
    c.init_b = 1.0f;
    int64_t key = 1;
    float out[4];
    CHECK_EQ_INT(kv_initial_values_isa(&c, &key, 1, out, -1), KV_EINVAL);
    CHECK_EQ_INT(kv_initial_values_isa(&c, &key, 1, out, kv_init_best_isa() + 1), KV_EINVAL);
    CHECK_EQ_INT(kv_initial_values_isa(&c, &key, 1, out, KV_INIT_ISA_AVX512 + 1), KV_EINVAL);
    CHECK_EQ_INT(kv_initial_values_isa(&c, &key, 1, out, KV_INIT_ISA_BASE), KV_OK);
    CHECK_EQ_INT(kv_initial_values_isa(&c, &key, 0, NULL, KV_INIT_ISA_BEST), KV_OK);
    CHECK_EQ_INT(kv_initial_values_isa(NULL, &key, 1, out, KV_INIT_ISA_BEST), KV_EINVAL);
    c.init_b = -1.0f;
    CHECK_EQ_INT(kv_init_check(&c), KV_EINIT);
    CHECK_EQ_INT(kv_initial_values_isa(&c, &key, 1, out, KV_INIT_ISA_BASE), KV_EINIT);
    c.init_b = 1.0f;
    c.dim = 0;
    CHECK_EQ_INT(kv_initial_values_isa(&c, &key, 1, out, KV_INIT_ISA_BASE), KV_EINVAL);
}

int main(void) {
    test_isa_copies();
    test_rows_api();
    test_arguments();
    printf("kv_init_best_isa: %d, second redraws: %ld\n", kv_init_best_isa(), g_redrawn);
    return test_summary();
}
