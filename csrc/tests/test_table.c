/*
 * test_table.c - the C table against a plain reference model.
 *
 * The reference is a dense array over a key universe of U keys: key(k) = k * ODD
 * (mod 2^64, so keys spread over the whole int64 range, negatives included) and
 * k = key * ODD^-1. Every test compares the table's answers (find, export, sizes)
 * with it, through many arena and index growths, deletes and free-row reuse.
 * Error cases compare a full arena-order export before and after the failing call.
 * The failing allocator walks every allocation of each batch call.
 *
 * Built twice by the Makefile: normally, and with -DKV_TEST_MAX_ROWS=1000 (then only
 * the KV_EFULL test runs). `test_table threads` runs only the two-thread test (the
 * ThreadSanitizer build uses it).
 */
#include <math.h>
#include <pthread.h>
#include <string.h>

#include "../kv_route.h"
#include "../kv_table.h"
#include "test_util.h"

#define ODD 0x9e3779b97f4a7c15ULL

static uint64_t inv_odd(uint64_t a) { /* Newton: a * x == 1 (mod 2^64) */
    uint64_t x = a;
    for (int i = 0; i < 6; i++) x *= 2 - a * x;
    return x;
}
static int64_t key_of(uint64_t k) { return (int64_t)(k * ODD); }

static kv_optim_t g_optim; /* Adagrad if kv_optim.c is linked, else the SGD stub */

static void pick_optim(void) {
    memset(&g_optim, 0, sizeof g_optim);
    g_optim.kind = KV_OPT_ADAGRAD;
    g_optim.lr = 0.1f;
    g_optim.initial_accumulator = 0.1f;
    g_optim.epsilon = 1e-7f;
    if (kv_optim_check(&g_optim) != KV_OK) {
        memset(&g_optim, 0, sizeof g_optim);
        g_optim.kind = KV_OPT_SGD;
        g_optim.lr = 0.5f;
    }
}

static kv_table_config_t config(int32_t dim, int32_t kind, float a, float b) {
    kv_table_config_t c;
    memset(&c, 0, sizeof c);
    c.dim = dim;
    c.init_kind = kind;
    c.init_a = a;
    c.init_b = b;
    c.seed = 1234;
    c.table_id = 77;
    c.optim = g_optim;
    return c;
}

static int kv_all_finite_test(const float *v, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!isfinite(v[i])) return 0;
    return 1;
}

/* ---- snapshots: the full arena-order export ------------------------------------- */

typedef struct {
    int64_t n, dim, s;
    int64_t *keys;
    float *values, *slots;
    uint32_t *steps, *counts;
    uint8_t *dirty;
    kv_table_stats_t st;
} snap_t;

static snap_t snapshot(kv_table_t *t) {
    snap_t s;
    memset(&s, 0, sizeof s);
    kv_table_stats(t, &s.st);
    s.dim = s.st.dim;
    s.s = s.st.slot_floats;
    int64_t cap = s.st.rows + 1;
    s.keys = malloc((size_t)cap * 8);
    s.values = malloc((size_t)(cap * s.dim) * 4);
    s.slots = malloc((size_t)(cap * (s.s ? s.s : 1)) * 4);
    s.steps = malloc((size_t)cap * 4);
    s.counts = malloc((size_t)cap * 4);
    s.dirty = malloc((size_t)cap);
    int64_t cursor = 0, got = 0;
    /* small pages to exercise the cursor */
    for (;;) {
        int64_t m = cap - s.n < 997 ? cap - s.n : 997;
        int rc = kv_table_export(t, &cursor, m, 0, s.keys + s.n, s.values + s.n * s.dim,
                                 s.slots + s.n * s.s, s.steps + s.n, s.counts + s.n,
                                 s.dirty + s.n, &got);
        CHECK_EQ_INT(rc, KV_OK);
        s.n += got;
        if (got < m || rc != KV_OK) break;
    }
    CHECK_EQ_INT(s.n, s.st.rows);
    return s;
}

static void snap_free(snap_t *s) {
    free(s->keys);
    free(s->values);
    free(s->slots);
    free(s->steps);
    free(s->counts);
    free(s->dirty);
}

/* Equal rows in arena order (keys, values, slots, steps, counts, dirty), capacity
 * aside. */
static int rows_equal(const snap_t *a, const snap_t *b) {
    return a->n == b->n && a->st.rows == b->st.rows &&
           !memcmp(a->keys, b->keys, (size_t)a->n * 8) &&
           !memcmp(a->values, b->values, (size_t)(a->n * a->dim) * 4) &&
           !memcmp(a->slots, b->slots, (size_t)(a->n * a->s) * 4) &&
           !memcmp(a->steps, b->steps, (size_t)a->n * 4) &&
           !memcmp(a->counts, b->counts, (size_t)a->n * 4) &&
           !memcmp(a->dirty, b->dirty, (size_t)a->n);
}

/* Equal rows, and the same capacity and index. */
static int snap_equal(const snap_t *a, const snap_t *b) {
    return rows_equal(a, b) && a->st.row_capacity == b->st.row_capacity &&
           a->st.index_slots == b->st.index_slots;
}

/* Check that every key of the table finds exactly its exported row. */
static int table_consistent(kv_table_t *t) {
    snap_t s = snapshot(t);
    float *out = malloc((size_t)(s.n * s.dim + 1) * 4);
    uint8_t *found = malloc((size_t)s.n + 1);
    int ok = kv_table_find(t, s.keys, s.n, out, found, NULL) == KV_OK;
    for (int64_t i = 0; ok && i < s.n; i++) ok = found[i] == 1;
    ok = ok && !memcmp(out, s.values, (size_t)(s.n * s.dim) * 4);
    free(out);
    free(found);
    snap_free(&s);
    return ok;
}

/* ---- reference model ---------------------------------------------------------- */

typedef struct {
    uint64_t U;
    int32_t dim;
    uint8_t *present;
    float *vals;
    int64_t size;
} ref_t;

static ref_t ref_new(uint64_t U, int32_t dim) {
    ref_t r = {U, dim, calloc(U, 1), calloc(U * (uint64_t)dim, 4), 0};
    return r;
}
static void ref_free(ref_t *r) {
    free(r->present);
    free(r->vals);
}

static int matches_reference(kv_table_t *t, const ref_t *r) {
    int ok = kv_table_size(t) == r->size;
    snap_t s = snapshot(t);
    uint64_t inv = inv_odd(ODD);
    uint8_t *seen = calloc(r->U, 1);
    for (int64_t i = 0; ok && i < s.n; i++) {
        uint64_t k = (uint64_t)s.keys[i] * inv;
        ok = k < r->U && r->present[k] && !seen[k] &&
             !memcmp(s.values + i * s.dim, r->vals + k * (uint64_t)r->dim, (size_t)s.dim * 4);
        if (ok) seen[k] = 1;
    }
    free(seen);
    snap_free(&s);
    return ok && table_consistent(t);
}

static void test_random_ops(void) {
    const int32_t dim = 5;
    const uint64_t U = 60000;
    kv_table_config_t c = config(dim, KV_INIT_UNIFORM, -1.0f, 1.0f);
    kv_table_t *t = NULL;
    CHECK_EQ_INT(kv_table_create(&c, &t), KV_OK);
    ref_t r = ref_new(U, dim);
    uint64_t rng = 42;
    enum { B = 3000 };
    int64_t keys[B];
    float vals[B * dim], out[B * dim];
    uint8_t found[B];
    int ok_vals = 1, ok_found = 1, ok_created = 1;
    int64_t max_seen = 0;
    for (int round = 0; round < 400; round++) {
        int op = (int)(test_rand(&rng) % 10);
        int64_t n = (int64_t)(test_rand(&rng) % B) + 1;
        /* a growing universe then shrinking phases, so the table grows and shrinks */
        uint64_t span = round < 250 ? U * (uint64_t)(round + 1) / 250 : U;
        uint64_t ks[B];
        for (int64_t i = 0; i < n; i++) {
            ks[i] = test_rand(&rng) % span;
            keys[i] = key_of(ks[i]);
        }
        if (round > 300 && op < 6) op = 8; /* delete-heavy tail */
        if (op < 4) { /* find_or_create */
            int64_t created = -1, expect = 0;
            uint8_t *mark = calloc(U, 1);
            for (int64_t i = 0; i < n; i++)
                if (!r.present[ks[i]] && !mark[ks[i]]) {
                    mark[ks[i]] = 1;
                    expect++;
                }
            free(mark);
            CHECK_EQ_INT(kv_table_find_or_create(t, keys, n, out, (uint32_t)round, &created, NULL), KV_OK);
            ok_created &= created == expect;
            float init[dim];
            for (int64_t i = 0; i < n; i++) {
                if (!r.present[ks[i]]) {
                    kv_initial_values(&c, &keys[i], 1, init);
                    memcpy(r.vals + ks[i] * dim, init, sizeof init);
                    r.present[ks[i]] = 1;
                    r.size++;
                }
                ok_vals &= !memcmp(out + i * dim, r.vals + ks[i] * dim, dim * 4);
            }
        } else if (op < 7) { /* update */
            for (int64_t i = 0; i < n * dim; i++) vals[i] = (float)(test_rand(&rng) % 1000) - 500.0f;
            CHECK_EQ_INT(kv_table_update(t, keys, n, vals), KV_OK);
            for (int64_t i = 0; i < n; i++) {
                if (!r.present[ks[i]]) r.size++;
                r.present[ks[i]] = 1;
                memcpy(r.vals + ks[i] * dim, vals + i * dim, dim * 4);
            }
        } else if (op < 9) { /* delete */
            int64_t nd = -1, expect = 0;
            for (int64_t i = 0; i < n; i++)
                if (r.present[ks[i]]) {
                    r.present[ks[i]] = 0;
                    r.size--;
                    expect++;
                }
            CHECK_EQ_INT(kv_table_delete(t, keys, n, &nd), KV_OK);
            ok_created &= nd == expect;
        } else { /* find */
            float dflt[dim];
            for (int j = 0; j < dim; j++) dflt[j] = 7.0f + (float)j;
            CHECK_EQ_INT(kv_table_find(t, keys, n, out, found, dflt), KV_OK);
            for (int64_t i = 0; i < n; i++) {
                ok_found &= found[i] == r.present[ks[i]];
                ok_vals &= !memcmp(out + i * dim, r.present[ks[i]] ? r.vals + ks[i] * dim : dflt,
                                   dim * 4);
            }
        }
        if (r.size > max_seen) max_seen = r.size;
        if (round % 50 == 49) CHECK(matches_reference(t, &r));
    }
    CHECK(ok_vals);
    CHECK(ok_found);
    CHECK(ok_created);
    CHECK(max_seen > 40000); /* many growths happened */
    CHECK(matches_reference(t, &r));
    /* clear keeps memory, empties the table, and the table works afterwards */
    kv_table_stats_t before, after;
    kv_table_stats(t, &before);
    CHECK_EQ_INT(kv_table_clear(t), KV_OK);
    kv_table_stats(t, &after);
    CHECK_EQ_INT(after.rows, 0);
    CHECK_EQ_INT(after.bytes, before.bytes);
    CHECK_EQ_INT(kv_table_size(t), 0);
    memset(r.present, 0, U);
    r.size = 0;
    CHECK(matches_reference(t, &r));
    CHECK_EQ_INT(kv_table_update(t, keys, 10, vals), KV_OK);
    CHECK_EQ_INT(kv_table_size(t) > 0, 1);
    CHECK(table_consistent(t));
    ref_free(&r);
    kv_table_destroy(t);
}

/* ---- sequential and adversarial keys ------------------------------------------ */

static void test_key_patterns(void) {
    kv_table_config_t c = config(2, KV_INIT_ZEROS, 0, 0);
    kv_table_t *t = NULL;
    CHECK_EQ_INT(kv_table_create(&c, &t), KV_OK);
    enum { N = 50000 };
    int64_t *keys = malloc(N * 8);
    float *v = malloc(N * 2 * 4), *out = malloc(N * 2 * 4);
    for (int64_t i = 0; i < N; i++) {
        keys[i] = i < 10 ? (i == 0 ? INT64_MIN : i == 1 ? INT64_MAX : i == 2 ? -1 : i - 3)
                         : (int64_t)((uint64_t)i << 40); /* low bits all zero */
        v[2 * i] = (float)i;
        v[2 * i + 1] = -(float)i;
    }
    CHECK_EQ_INT(kv_table_update(t, keys, N, v), KV_OK);
    CHECK_EQ_INT(kv_table_size(t), N);
    CHECK_EQ_INT(kv_table_find(t, keys, N, out, NULL, NULL), KV_OK);
    CHECK(!memcmp(out, v, N * 2 * 4));
    /* delete every other key; the rest must still be reachable (backward shift) */
    for (int64_t i = 0; i < N; i += 2) {
        int64_t nd = 0;
        kv_table_delete(t, &keys[i], 1, &nd);
        if (nd != 1) CHECK_EQ_INT(nd, 1);
    }
    uint8_t *found = malloc(N);
    CHECK_EQ_INT(kv_table_find(t, keys, N, out, found, NULL), KV_OK);
    int ok = 1;
    for (int64_t i = 0; i < N; i++) {
        ok &= found[i] == (i & 1);
        if (i & 1) ok &= out[2 * i] == (float)i && out[2 * i + 1] == -(float)i;
        else ok &= out[2 * i] == 0.0f;
    }
    CHECK(ok);
    CHECK(table_consistent(t));
    free(found);
    free(keys);
    free(v);
    free(out);
    kv_table_destroy(t);
}

/* ---- free list ------------------------------------------------------------------ */

static void test_free_list(void) {
    kv_table_config_t c = config(3, KV_INIT_CONSTANT, 2.5f, 0);
    kv_table_t *t = NULL;
    CHECK_EQ_INT(kv_table_create(&c, &t), KV_OK);
    enum { N = 20000 };
    int64_t keys[N];
    float out[N * 3];
    for (int i = 0; i < N; i++) keys[i] = key_of((uint64_t)i);
    int64_t created = 0;
    CHECK_EQ_INT(kv_table_find_or_create(t, keys, N, out, 1, &created, NULL), KV_OK);
    CHECK_EQ_INT(created, N);
    CHECK(out[0] == 2.5f && out[3 * N - 1] == 2.5f);
    kv_table_stats_t s0, s1;
    kv_table_stats(t, &s0);
    int64_t nd = 0;
    CHECK_EQ_INT(kv_table_delete(t, keys, N / 2, &nd), KV_OK);
    CHECK_EQ_INT(nd, N / 2);
    CHECK_EQ_INT(kv_table_size(t), N - N / 2);
    /* export skips the free rows */
    snap_t s = snapshot(t);
    CHECK_EQ_INT(s.n, N - N / 2);
    snap_free(&s);
    int64_t fresh[N / 2];
    for (int i = 0; i < N / 2; i++) fresh[i] = key_of((uint64_t)(N + i));
    CHECK_EQ_INT(kv_table_find_or_create(t, fresh, N / 2, out, 2, &created, NULL), KV_OK);
    CHECK_EQ_INT(created, N / 2);
    kv_table_stats(t, &s1);
    CHECK_EQ_INT(s1.row_capacity, s0.row_capacity); /* the freed rows were reused */
    CHECK_EQ_INT(s1.bytes, s0.bytes);
    CHECK_EQ_INT(s1.rows, N);
    /* deleted keys come back as new rows with their initial value, not stale data */
    float upd[3] = {9, 9, 9};
    CHECK_EQ_INT(kv_table_update(t, &keys[N / 2], 1, upd), KV_OK);
    CHECK_EQ_INT(kv_table_delete(t, &keys[N / 2], 1, &nd), KV_OK);
    CHECK_EQ_INT(kv_table_find_or_create(t, &keys[N / 2], 1, out, 3, &created, NULL), KV_OK);
    CHECK(created == 1 && out[0] == 2.5f);
    CHECK(table_consistent(t));
    kv_table_destroy(t);
}

/* ---- arena chunks: many widths, chunk boundaries, holes in the row ids ----------- */

/* Rows live in chunks of a fixed block of row ids, fewer rows than ids (and small
 * first chunks), so ids skip; widths 8/16/32/64 take the constant-size copy paths,
 * 3000 and 20000 give chunks of a few rows. Check find (found, default row),
 * find_or_create, export across the holes, free-row reuse and the byte count. */
static void test_chunks(void) {
    const int32_t dims[] = {1, 8, 16, 32, 64, 3000, 20000};
    for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
        const int32_t dim = dims[di];
        kv_table_config_t c = config(dim, KV_INIT_UNIFORM, -1.0f, 1.0f);
        kv_table_t *t = NULL;
        CHECK_EQ_INT(kv_table_create(&c, &t), KV_OK);
        const int64_t N = dim >= 3000 ? 600 : 40000;
        int64_t *keys = malloc((size_t)N * 8);
        float *vals = malloc((size_t)N * dim * 4), *out = malloc((size_t)N * dim * 4);
        float *dflt = malloc((size_t)dim * 4);
        uint8_t *found = malloc((size_t)N);
        for (int64_t i = 0; i < N; i++) {
            keys[i] = key_of((uint64_t)i);
            for (int32_t e = 0; e < dim; e++) vals[i * dim + e] = (float)i + 0.001f * (float)e;
        }
        for (int32_t e = 0; e < dim; e++) dflt[e] = -3.0f - (float)e;
        /* first half by update in uneven batches, second half absent */
        int64_t half = N / 2;
        for (int64_t b = 0; b < half;) {
            int64_t m = 1 + (b * 7919) % 997;
            if (m > half - b) m = half - b;
            CHECK_EQ_INT(kv_table_update(t, keys + b, m, vals + b * dim), KV_OK);
            b += m;
        }
        CHECK_EQ_INT(kv_table_find(t, keys, N, out, found, dflt), KV_OK);
        int ok = 1;
        for (int64_t i = 0; i < N; i++) {
            ok &= found[i] == (i < half);
            ok &= !memcmp(out + i * dim, i < half ? vals + i * dim : dflt, (size_t)dim * 4);
        }
        CHECK(ok);
        CHECK_EQ_INT(kv_table_find(t, keys + half - 5, 10, out, NULL, NULL), KV_OK);
        ok = !memcmp(out, vals + (half - 5) * dim, (size_t)5 * dim * 4);
        for (int64_t e = 5 * dim; e < 10 * dim; e++) ok &= out[e] == 0.0f;
        CHECK(ok);
        /* delete a third, then find_or_create everything: reuse plus new chunks */
        int64_t nd = 0;
        for (int64_t i = 0; i < half; i += 3) {
            int64_t one = 0;
            kv_table_delete(t, &keys[i], 1, &one);
            nd += one;
        }
        CHECK_EQ_INT(nd, (half + 2) / 3);
        int64_t created = 0;
        CHECK_EQ_INT(kv_table_find_or_create(t, keys, N, out, 5, &created, NULL), KV_OK);
        CHECK_EQ_INT(created, N - half + nd);
        float *init = malloc((size_t)dim * 4);
        ok = 1;
        for (int64_t i = 0; i < N; i++) {
            if (i < half && i % 3) {
                ok &= !memcmp(out + i * dim, vals + i * dim, (size_t)dim * 4);
            } else {
                kv_initial_values(&c, &keys[i], 1, init);
                ok &= !memcmp(out + i * dim, init, (size_t)dim * 4);
            }
        }
        CHECK(ok);
        free(init);
        CHECK_EQ_INT(kv_table_size(t), N);
        CHECK(table_consistent(t)); /* export across every chunk finds each key once */
        kv_table_stats_t st;
        CHECK_EQ_INT(kv_table_stats(t, &st), KV_OK);
        CHECK(st.row_capacity >= N);
        CHECK(st.bytes >= st.row_capacity * st.row_bytes + st.index_slots * 4);
        /* a chunk's rows fit in it: at most a few chunks' worth beyond the rows */
        CHECK(st.bytes < (N * st.row_bytes) * 2 + st.index_slots * 4 + (8 << 20));
        free(keys);
        free(vals);
        free(out);
        free(dflt);
        free(found);
        kv_table_destroy(t);
    }
}

/* ---- deterministic initial values ---------------------------------------------- */

enum { IDIM = 7 };
/* Normal initial values are Box-Muller on the documented draws, with kvcoll's own
 * float ln / sin / cos: check them against double-precision libm. */
static void test_init_normal_accuracy(void) {
    enum { dim = 7, N = 20000 };
    kv_table_config_t c = config(dim, KV_INIT_NORMAL, 0.0f, 1.0f);
    int64_t *keys = malloc(N * 8);
    float *out = malloc(N * dim * 4);
    for (int i = 0; i < N; i++) keys[i] = key_of((uint64_t)i * 13 + 1);
    CHECK_EQ_INT(kv_initial_values(&c, keys, N, out), KV_OK);
    double worst = 0, sum = 0, sum2 = 0;
    for (int i = 0; i < N; i++) {
        uint64_t base = kv_mix64(kv_mix64(kv_mix64(c.seed) ^ c.table_id) ^ (uint64_t)keys[i]);
        for (int e = 0; e < dim; e++) {
            uint64_t h = kv_mix64(base + 0x9e3779b97f4a7c15ULL * ((((uint64_t)(e & ~1)) << 24) + 1));
            double u1 = (double)((h >> 40) + 1) * 0x1p-24, u2 = (double)((h >> 16) & 0xffffff) * 0x1p-24;
            double r = sqrt(-2.0 * log(u1)), th = 6.283185307179586 * u2;
            double z = (e & 1) ? r * sin(th) : r * cos(th);
            double err = fabs(z - (double)out[i * dim + e]);
            if (err > worst) worst = err;
            sum += out[i * dim + e];
            sum2 += (double)out[i * dim + e] * out[i * dim + e];
        }
    }
    CHECK(worst < 4e-6);
    double mean = sum / (N * dim), var = sum2 / (N * dim) - mean * mean;
    CHECK(fabs(mean) < 0.01 && fabs(var - 1.0) < 0.02);
    free(keys);
    free(out);
}

static void test_init_determinism(void) {
    const int32_t dim = IDIM;
    int32_t kinds[] = {KV_INIT_UNIFORM, KV_INIT_NORMAL, KV_INIT_TRUNCATED_NORMAL};
    for (int kk = 0; kk < 3; kk++) {
        kv_table_config_t c = config(dim, kinds[kk], kinds[kk] == KV_INIT_UNIFORM ? -0.5f : 1.0f,
                                     kinds[kk] == KV_INIT_UNIFORM ? 0.25f : 0.5f);
        enum { N = 4000 };
        int64_t keys[N], rev[N];
        for (int i = 0; i < N; i++) {
            keys[i] = key_of((uint64_t)i * 7 + 3);
            rev[N - 1 - i] = keys[i];
        }
        static float a[N * IDIM], b[N * IDIM], ref[N * IDIM];
        kv_table_t *t1 = NULL, *t2 = NULL;
        CHECK_EQ_INT(kv_table_create(&c, &t1), KV_OK);
        c.initial_capacity = 100000; /* a different layout must not matter */
        CHECK_EQ_INT(kv_table_create(&c, &t2), KV_OK);
        c.initial_capacity = 0;
        CHECK_EQ_INT(kv_table_find_or_create(t1, keys, N, a, 0, NULL, NULL), KV_OK);
        for (int i = 0; i < N; i += 37) /* odd batch split, reversed order */
            CHECK_EQ_INT(kv_table_find_or_create(t2, rev + i, N - i < 37 ? N - i : 37,
                                                 b + (size_t)i * dim, 0, NULL, NULL), KV_OK);
        CHECK_EQ_INT(kv_initial_values(&c, keys, N, ref), KV_OK);
        CHECK(!memcmp(a, ref, sizeof a));
        int same = 1;
        for (int i = 0; i < N; i++) same &= !memcmp(b + (size_t)(N - 1 - i) * dim, a + (size_t)i * dim, dim * 4);
        CHECK(same);
        /* distribution sanity */
        double sum = 0, sq = 0, lo = 1e9, hi = -1e9;
        for (int i = 0; i < N * dim; i++) {
            sum += a[i];
            sq += (double)a[i] * a[i];
            lo = a[i] < lo ? a[i] : lo;
            hi = a[i] > hi ? a[i] : hi;
        }
        double mean = sum / (N * dim), sd = sqrt(sq / (N * dim) - mean * mean);
        if (kinds[kk] == KV_INIT_UNIFORM) {
            CHECK(lo >= -0.5 && hi < 0.25 && fabs(mean + 0.125) < 0.01);
        } else if (kinds[kk] == KV_INIT_NORMAL) {
            CHECK(fabs(mean - 1.0) < 0.02 && fabs(sd - 0.5) < 0.02);
            CHECK(lo < 0.0 && hi > 2.0); /* tails beyond 2 sd exist */
        } else {
            CHECK(lo >= 0.0 && hi <= 2.0 && fabs(mean - 1.0) < 0.02);
            CHECK(sd > 0.40 && sd < 0.46); /* truncated at 2 sd: 0.88 * 0.5 */
        }
        /* another table id or seed gives other values */
        c.table_id++;
        CHECK_EQ_INT(kv_initial_values(&c, keys, N, ref), KV_OK);
        CHECK(memcmp(a, ref, sizeof a) != 0);
        kv_table_destroy(t1);
        kv_table_destroy(t2);
    }
}

/* ---- apply_gradients, dirty bits, counts ---------------------------------------- */

static void test_apply_and_dirty(void) {
    enum { dim = 4 };
    kv_table_config_t c = config(dim, KV_INIT_CONSTANT, 1.0f, 0);
    c.optim.kind = KV_OPT_SGD;
    c.optim.lr = 0.5f;
    kv_table_t *t = NULL;
    CHECK_EQ_INT(kv_table_create(&c, &t), KV_OK);
    int64_t keys[3] = {10, 20, 30};
    float out[3 * dim];
    CHECK_EQ_INT(kv_table_find_or_create(t, keys, 2, out, 5, NULL, NULL), KV_OK);
    /* duplicate 10 twice, 30 is missing */
    int64_t gk[4] = {10, 30, 10, 20};
    float g[4 * dim];
    for (int i = 0; i < 4 * dim; i++) g[i] = (float)(i / dim + 1); /* rows 1,2,3,4 */
    int64_t missing = -1;
    CHECK_EQ_INT(kv_table_apply_gradients(t, gk, 4, g, 9, 0, &missing), KV_OK);
    CHECK_EQ_INT(missing, 1);
    CHECK_EQ_INT(kv_table_size(t), 2);
    uint8_t found[3];
    CHECK_EQ_INT(kv_table_find(t, keys, 3, out, found, NULL), KV_OK);
    CHECK(out[0] == 1.0f - 0.5f * 4.0f);     /* 1 + 3 summed */
    CHECK(out[dim] == 1.0f - 0.5f * 4.0f);   /* 20 got 4 */
    CHECK(found[2] == 0);
    CHECK_EQ_INT(kv_table_apply_gradients(t, gk, 4, g, 10, KV_APPLY_CREATE_MISSING, &missing), KV_OK);
    CHECK_EQ_INT(missing, 0);
    CHECK_EQ_INT(kv_table_find(t, keys, 3, out, found, NULL), KV_OK);
    CHECK(found[2] == 1 && out[2 * dim] == 1.0f - 0.5f * 2.0f);
    CHECK(out[0] == 1.0f - 0.5f * 8.0f);
    snap_t s = snapshot(t);
    for (int64_t i = 0; i < s.n; i++) {
        int64_t k = s.keys[i];
        CHECK(s.dirty[i] == 1);
        CHECK_EQ_INT(s.steps[i], 10);
        CHECK_EQ_INT(s.counts[i], k == 30 ? 1 : 2);
    }
    snap_free(&s);
    /* clear dirty; then only touched rows are dirty */
    int64_t cur = 0, n = 0, ek[8];
    float ev[8 * dim];
    CHECK_EQ_INT(kv_table_export(t, &cur, 8, KV_EXPORT_DIRTY_ONLY | KV_EXPORT_CLEAR_DIRTY, ek, ev,
                                 NULL, NULL, NULL, NULL, &n), KV_OK);
    CHECK_EQ_INT(n, 3);
    cur = 0;
    CHECK_EQ_INT(kv_table_export(t, &cur, 8, KV_EXPORT_DIRTY_ONLY, ek, ev, NULL, NULL, NULL, NULL, &n),
                 KV_OK);
    CHECK_EQ_INT(n, 0);
    float v[dim] = {3, 3, 3, 3};
    CHECK_EQ_INT(kv_table_update(t, &keys[1], 1, v), KV_OK);
    cur = 0;
    CHECK_EQ_INT(kv_table_export(t, &cur, 8, KV_EXPORT_DIRTY_ONLY, ek, ev, NULL, NULL, NULL, NULL, &n),
                 KV_OK);
    CHECK(n == 1 && ek[0] == 20 && ev[0] == 3.0f);
    /* find_or_create sets last_step but not dirty */
    CHECK_EQ_INT(kv_table_find_or_create(t, keys, 1, out, 77, NULL, NULL), KV_OK);
    s = snapshot(t);
    for (int64_t i = 0; i < s.n; i++) {
        if (s.keys[i] == 10) CHECK(s.steps[i] == 77 && s.dirty[i] == 0);
    }
    snap_free(&s);
    /* step is truncated to 32 bits */
    CHECK_EQ_INT(kv_table_apply_gradients(t, keys, 1, g, ((int64_t)1 << 32) + 5, 0, NULL), KV_OK);
    s = snapshot(t);
    for (int64_t i = 0; i < s.n; i++)
        if (s.keys[i] == 10) CHECK_EQ_INT(s.steps[i], 5);
    snap_free(&s);
    kv_table_destroy(t);
}

/* ---- kv_table_set_optim: new hyperparameters, same rows --------------------------- */

/* Row `i` of a snapshot, found by key. */
static int64_t snap_find(const snap_t *s, int64_t key) {
    for (int64_t i = 0; i < s->n; i++)
        if (s->keys[i] == key) return i;
    return -1;
}

/* After set_optim, an update equals kv_optim_apply_rows with the new hyperparameters on
 * the rows as they were; the call itself changes no row, slot or header; errors change
 * nothing, not even the hyperparameters. */
static void test_set_optim(void) {
    enum { dim = 4, N = 50 };
    const int32_t kinds[] = {KV_OPT_ADAGRAD, KV_OPT_ADAM, KV_OPT_FTRL};
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        kv_table_config_t c = config(dim, KV_INIT_UNIFORM, -0.5f, 0.5f);
        memset(&c.optim, 0, sizeof c.optim);
        c.optim.kind = kinds[k];
        c.optim.lr = 0.1f, c.optim.epsilon = 1e-7f, c.optim.initial_accumulator = 0.1f;
        c.optim.beta1 = 0.9f, c.optim.beta2 = 0.999f, c.optim.lr_power = -0.5f;
        c.optim.beta = kinds[k] == KV_OPT_FTRL ? 0.2f : 0.0f;
        kv_table_t *t = NULL;
        CHECK_EQ_INT(kv_table_create(&c, &t), KV_OK);
        int64_t keys[N];
        float out[N * dim], g[N * dim];
        uint64_t rng = 17 + k;
        for (int i = 0; i < N; i++) keys[i] = key_of((uint64_t)i);
        for (int i = 0; i < N * dim; i++) g[i] = (float)(test_rand(&rng) % 1000) * 2e-3f - 1.0f;
        CHECK_EQ_INT(kv_table_find_or_create(t, keys, N, out, 1, NULL, NULL), KV_OK);
        CHECK_EQ_INT(kv_table_apply_gradients(t, keys, N, g, 1, 0, NULL), KV_OK);

        /* a new learning rate (and for Adagrad the other epsilon rule) changes no row */
        kv_optim_t o = c.optim;
        o.lr = 0.37f;
        if (o.kind == KV_OPT_ADAGRAD) o.flags = KV_OPTF_EPS_INSIDE_SQRT;
        if (o.kind == KV_OPT_ADAM) o.per_row_step = 1; /* same layout: allowed */
        snap_t s0 = snapshot(t);
        CHECK_EQ_INT(kv_table_set_optim(t, &o), KV_OK);
        snap_t s1 = snapshot(t);
        CHECK(snap_equal(&s0, &s1));
        CHECK_EQ_INT(s1.st.slot_floats, kv_optim_slot_floats(&c.optim, dim));

        /* errors: nothing changes, and the hyperparameters stay those of the last
         * successful call */
        kv_optim_t bad = o;
        bad.flags = 0; /* Adagrad's flag would make the other kinds fail the check */
        bad.kind = kinds[k] == KV_OPT_ADAM ? KV_OPT_GROUP_ADAM : KV_OPT_GROUP_ADAGRAD;
        CHECK_EQ_INT(kv_table_set_optim(t, &bad), KV_EINVAL); /* another kind */
        bad.kind = KV_OPT_SGD;
        CHECK_EQ_INT(kv_table_set_optim(t, &bad), KV_EINVAL); /* fewer slots */
        bad = o;
        bad.lr = 0.0f;
        CHECK_EQ_INT(kv_table_set_optim(t, &bad), KV_EOPTIM);
        bad.lr = NAN;
        CHECK_EQ_INT(kv_table_set_optim(t, &bad), KV_EOPTIM);
        bad = o;
        bad.beta = -1.0f;
        CHECK_EQ_INT(kv_table_set_optim(t, &bad), KV_EOPTIM);
        bad = o;
        bad.flags = kinds[k] == KV_OPT_ADAGRAD ? 4 : KV_OPTF_EPS_INSIDE_SQRT;
        CHECK_EQ_INT(kv_table_set_optim(t, &bad), KV_EOPTIM);
        bad = o;
        bad.kind = 99;
        CHECK_EQ_INT(kv_table_set_optim(t, &bad), KV_EOPTIM);
        CHECK_EQ_INT(kv_table_set_optim(NULL, &o), KV_EINVAL);
        CHECK_EQ_INT(kv_table_set_optim(t, NULL), KV_EINVAL);
        snap_t s2 = snapshot(t);
        CHECK(snap_equal(&s0, &s2));

        /* the next update uses o: compare with kv_optim_apply_rows on the old rows */
        CHECK_EQ_INT(kv_table_apply_gradients(t, keys, N, g, 2, 0, NULL), KV_OK);
        snap_t s3 = snapshot(t);
        int ok = 1;
        for (int i = 0; i < N; i++) {
            int64_t a = snap_find(&s1, keys[i]), b = snap_find(&s3, keys[i]);
            if (a < 0 || b < 0) {
                ok = 0;
                continue;
            }
            float w[dim], sl[3 * dim + 1];
            memcpy(w, s1.values + a * dim, sizeof w);
            memcpy(sl, s1.slots + a * s1.s, (size_t)s1.s * 4);
            kv_optim_apply_rows(&o, dim, 1, w, sl, g + (size_t)i * dim, 2);
            ok &= !memcmp(w, s3.values + b * dim, sizeof w);
            ok &= !memcmp(sl, s3.slots + b * s3.s, (size_t)s3.s * 4);
        }
        CHECK(ok);
        /* and differs from what the old hyperparameters would have given */
        int64_t a0 = snap_find(&s1, keys[0]), b0 = snap_find(&s3, keys[0]);
        float w_old[dim], sl_old[3 * dim + 1];
        memcpy(w_old, s1.values + a0 * dim, sizeof w_old);
        memcpy(sl_old, s1.slots + a0 * s1.s, (size_t)s1.s * 4);
        kv_optim_apply_rows(&c.optim, dim, 1, w_old, sl_old, g, 2);
        CHECK(memcmp(w_old, s3.values + b0 * dim, sizeof w_old) != 0);
        snap_free(&s0), snap_free(&s1), snap_free(&s2), snap_free(&s3);
        kv_table_destroy(t);
    }
}

/* ---- export / import round trip ------------------------------------------------ */

static void test_export_import(void) {
    const int32_t dim = 6;
    kv_table_config_t c = config(dim, KV_INIT_NORMAL, 0, 1);
    kv_table_t *a = NULL, *b = NULL;
    CHECK_EQ_INT(kv_table_create(&c, &a), KV_OK);
    CHECK_EQ_INT(kv_table_create(&c, &b), KV_OK);
    enum { N = 12000 };
    int64_t *keys = malloc(N * 8);
    float *buf = malloc(N * dim * 4), *g = malloc(N * dim * 4);
    for (int i = 0; i < N; i++) keys[i] = key_of((uint64_t)i * 13);
    for (int i = 0; i < N * dim; i++) g[i] = 0.01f * (float)(i % 17);
    CHECK_EQ_INT(kv_table_find_or_create(a, keys, N, buf, 3, NULL, NULL), KV_OK);
    CHECK_EQ_INT(kv_table_apply_gradients(a, keys, N / 2, g, 4, 0, NULL), KV_OK);
    CHECK_EQ_INT(kv_table_apply_gradients(a, keys, N / 3, g, 6, 0, NULL), KV_OK);
    int64_t nd;
    CHECK_EQ_INT(kv_table_delete(a, keys + 100, 50, &nd), KV_OK);
    snap_t sa = snapshot(a);
    CHECK_EQ_INT(kv_table_import(b, sa.keys, sa.n, sa.values, sa.slots, sa.steps, sa.counts), KV_OK);
    snap_t sb = snapshot(b);
    CHECK_EQ_INT(sb.n, sa.n);
    /* b was empty, so arena order equals import order */
    CHECK(!memcmp(sa.keys, sb.keys, (size_t)sa.n * 8));
    CHECK(!memcmp(sa.values, sb.values, (size_t)(sa.n * dim) * 4));
    CHECK(!memcmp(sa.slots, sb.slots, (size_t)(sa.n * sa.s) * 4));
    CHECK(!memcmp(sa.steps, sb.steps, (size_t)sa.n * 4));
    CHECK(!memcmp(sa.counts, sb.counts, (size_t)sa.n * 4));
    int clean = 1;
    for (int64_t i = 0; i < sb.n; i++) clean &= sb.dirty[i] == 0;
    CHECK(clean);
    /* the same further gradients give the same rows */
    CHECK_EQ_INT(kv_table_apply_gradients(a, keys, N, g, 7, 0, NULL), KV_OK);
    CHECK_EQ_INT(kv_table_apply_gradients(b, keys, N, g, 7, 0, NULL), KV_OK);
    float *fa = malloc(N * dim * 4), *fb = malloc(N * dim * 4);
    kv_table_find(a, keys, N, fa, NULL, NULL);
    kv_table_find(b, keys, N, fb, NULL, NULL);
    CHECK(!memcmp(fa, fb, N * dim * 4));
    /* import with NULL optional arrays: initial slots, step 0, count 0; duplicates: last wins */
    int64_t dk[3] = {keys[0], 5, keys[0]};
    float dv[3 * dim];
    for (int i = 0; i < 3 * dim; i++) dv[i] = (float)i;
    CHECK_EQ_INT(kv_table_import(b, dk, 3, dv, NULL, NULL, NULL), KV_OK);
    snap_t sc = snapshot(b);
    for (int64_t i = 0; i < sc.n; i++) {
        if (sc.keys[i] == keys[0]) {
            CHECK(sc.values[i * dim] == (float)(2 * dim));
            CHECK(sc.steps[i] == 0 && sc.counts[i] == 0 && sc.dirty[i] == 0);
        }
    }
    snap_free(&sc);
    /* max_n == 0 and a cursor past the end are fine */
    int64_t cur = 0, n = -1;
    CHECK_EQ_INT(kv_table_export(b, &cur, 0, 0, NULL, NULL, NULL, NULL, NULL, NULL, &n), KV_OK);
    CHECK_EQ_INT(n, 0);
    cur = 1 << 30;
    CHECK_EQ_INT(kv_table_export(b, &cur, 5, 0, keys, buf, NULL, NULL, NULL, NULL, &n), KV_OK);
    CHECK_EQ_INT(n, 0);
    snap_free(&sa);
    snap_free(&sb);
    free(fa);
    free(fb);
    free(keys);
    free(buf);
    free(g);
    kv_table_destroy(a);
    kv_table_destroy(b);
}

/* ---- argument errors leave the table unchanged ---------------------------------- */

static void test_errors(void) {
    const int32_t dim = 3;
    kv_table_config_t c = config(dim, KV_INIT_UNIFORM, 0, 1);
    kv_table_t *t = NULL;
    CHECK_EQ_INT(kv_table_create(&c, &t), KV_OK);
    int64_t keys[4] = {1, 2, 3, 4};
    float v[4 * dim], out[4 * dim];
    for (int i = 0; i < 4 * dim; i++) v[i] = (float)i;
    CHECK_EQ_INT(kv_table_update(t, keys, 3, v), KV_OK);
    snap_t s0 = snapshot(t);
    int64_t cur = 0, n;
    float bad[4 * dim];
    memcpy(bad, v, sizeof v);
    bad[4 * dim - 1] = NAN;
    float inf[4 * dim];
    memcpy(inf, v, sizeof v);
    inf[2] = INFINITY;
    float huge[4 * dim];
    for (int i = 0; i < 4 * dim; i++) huge[i] = 3e38f;
    int64_t same[4] = {9, 9, 9, 9};
    uint32_t u32[4] = {0};
    int rcs[] = {
        kv_table_find(t, keys, -1, out, NULL, NULL),
        kv_table_find(t, NULL, 2, out, NULL, NULL),
        kv_table_find(t, keys, 2, NULL, NULL, NULL),
        kv_table_find_or_create(t, keys, -1, out, 0, NULL, NULL),
        kv_table_find_or_create(t, NULL, 4, out, 0, NULL, NULL),
        kv_table_find_or_create(t, keys, 4, NULL, 0, NULL, NULL),
        kv_table_update(t, keys, -2, v),
        kv_table_update(t, NULL, 4, v),
        kv_table_update(t, keys, 4, NULL),
        kv_table_delete(t, NULL, 1, NULL),
        kv_table_delete(t, keys, -1, NULL),
        kv_table_apply_gradients(t, keys, 4, v, 0, 0, NULL),
        kv_table_apply_gradients(t, keys, 4, v, -3, 0, NULL),
        kv_table_apply_gradients(t, keys, 4, v, 1, 4, NULL),
        kv_table_apply_gradients(t, keys, 4, NULL, 1, 0, NULL),
        kv_table_apply_gradients(t, NULL, 4, v, 1, 0, NULL),
        kv_table_apply_gradients(t, keys, -1, v, 1, 0, NULL),
        kv_table_export(t, NULL, 4, 0, keys, out, NULL, NULL, NULL, NULL, &n),
        kv_table_export(t, &cur, -1, 0, keys, out, NULL, NULL, NULL, NULL, &n),
        kv_table_export(t, &cur, 4, 8, keys, out, NULL, NULL, NULL, NULL, &n),
        kv_table_export(t, &cur, 4, 0, NULL, out, NULL, NULL, NULL, NULL, &n),
        kv_table_export(t, &cur, 4, 0, keys, NULL, NULL, NULL, NULL, NULL, &n),
        kv_table_export(t, &cur, 4, 0, keys, out, NULL, NULL, NULL, NULL, NULL),
        kv_table_import(t, keys, -1, v, NULL, NULL, NULL),
        kv_table_import(t, NULL, 4, v, NULL, NULL, NULL),
        kv_table_import(t, keys, 4, NULL, NULL, NULL, u32),
        kv_table_stats(t, NULL),
        kv_table_stats(NULL, NULL),
        kv_table_clear(NULL),
    };
    for (size_t i = 0; i < sizeof rcs / sizeof rcs[0]; i++) {
        if (rcs[i] != KV_EINVAL) fprintf(stderr, "EINVAL case %zu returned %d\n", i, rcs[i]);
        CHECK_EQ_INT(rcs[i], KV_EINVAL);
    }
    cur = -5;
    CHECK_EQ_INT(kv_table_export(t, &cur, 4, 0, keys, out, NULL, NULL, NULL, NULL, &n), KV_EINVAL);
    CHECK_EQ_INT(kv_table_update(t, keys, 4, bad), KV_ENONFINITE);
    CHECK_EQ_INT(kv_table_update(t, keys, 4, inf), KV_ENONFINITE);
    CHECK_EQ_INT(kv_table_import(t, keys, 4, bad, NULL, NULL, NULL), KV_ENONFINITE);
    CHECK_EQ_INT(kv_table_apply_gradients(t, keys, 4, inf, 1, KV_APPLY_CREATE_MISSING, NULL), KV_ENONFINITE);
    CHECK_EQ_INT(kv_table_apply_gradients(t, keys, 4, bad, 1, 0, NULL), KV_ENONFINITE);
    /* finite inputs whose duplicate sum overflows */
    CHECK_EQ_INT(kv_table_apply_gradients(t, same, 4, huge, 1, KV_APPLY_CREATE_MISSING, NULL),
                 KV_ENONFINITE);
    if (s0.s > 0) {
        float slots[4 * 64];
        for (int i = 0; i < 4 * s0.s; i++) slots[i] = 1.0f;
        slots[5] = NAN;
        CHECK_EQ_INT(kv_table_import(t, keys, 4, v, slots, NULL, NULL), KV_ENONFINITE);
    }
    /* n == 0 with NULL pointers is a no-op */
    CHECK_EQ_INT(kv_table_find(t, NULL, 0, NULL, NULL, NULL), KV_OK);
    CHECK_EQ_INT(kv_table_find_or_create(t, NULL, 0, NULL, 0, NULL, NULL), KV_OK);
    CHECK_EQ_INT(kv_table_update(t, NULL, 0, NULL), KV_OK);
    CHECK_EQ_INT(kv_table_apply_gradients(t, NULL, 0, NULL, 1, 0, NULL), KV_OK);
    snap_t s1 = snapshot(t);
    CHECK(snap_equal(&s0, &s1));
    snap_free(&s0);
    snap_free(&s1);
    kv_table_destroy(t);

    /* create / initial_values argument checks */
    kv_table_config_t b = c;
    kv_table_t *x = (kv_table_t *)&b; /* must stay untouched on error */
    b.dim = 0;
    CHECK_EQ_INT(kv_table_create(&b, &x), KV_EINVAL);
    b.dim = KV_MAX_DIM + 1;
    CHECK_EQ_INT(kv_table_create(&b, &x), KV_EINVAL);
    b = c;
    b.initial_capacity = -1;
    CHECK_EQ_INT(kv_table_create(&b, &x), KV_EINVAL);
    CHECK_EQ_INT(kv_table_create(NULL, &x), KV_EINVAL);
    CHECK_EQ_INT(kv_table_create(&c, NULL), KV_EINVAL);
    b = c;
    b.init_kind = 17;
    CHECK_EQ_INT(kv_table_create(&b, &x), KV_EINIT);
    CHECK_EQ_INT(kv_initial_values(&b, keys, 1, out), KV_EINIT);
    b.init_kind = KV_INIT_UNIFORM;
    b.init_a = 2;
    b.init_b = 1;
    CHECK_EQ_INT(kv_table_create(&b, &x), KV_EINIT);
    b.init_kind = KV_INIT_NORMAL;
    b.init_b = -1;
    CHECK_EQ_INT(kv_table_create(&b, &x), KV_EINIT);
    b.init_b = NAN;
    CHECK_EQ_INT(kv_table_create(&b, &x), KV_EINIT);
    b = c;
    b.optim.kind = 99;
    CHECK_EQ_INT(kv_table_create(&b, &x), KV_EOPTIM);
    b.optim = c.optim;
    b.optim.lr = -1;
    CHECK_EQ_INT(kv_table_create(&b, &x), KV_EOPTIM);
    CHECK(x == (kv_table_t *)&b);
    CHECK_EQ_INT(kv_initial_values(&c, keys, -1, out), KV_EINVAL);
    CHECK_EQ_INT(kv_initial_values(&c, NULL, 1, out), KV_EINVAL);
    CHECK_EQ_INT(kv_initial_values(NULL, keys, 1, out), KV_EINVAL);
    CHECK(strlen(kv_strerror(KV_ENOMEM)) > 0 && strlen(kv_strerror(12345)) > 0);
    kv_table_destroy(NULL);
}

/* ---- out of memory at every allocation ------------------------------------------ */

enum { OP_FOC, OP_FOC_REF, OP_UPDATE, OP_IMPORT, OP_APPLY_CREATE, OP_APPLY, OP_FIND, OP_RESERVE, OP_N };
static uint32_t g_refs[1 << 14];

static int run_op(kv_table_t *t, int op, const int64_t *keys, int64_t n, float *buf, float *vals) {
    switch (op) {
    case OP_FOC: return kv_table_find_or_create(t, keys, n, buf, 99, NULL, NULL);
    case OP_FOC_REF:
        return n > (1 << 14) ? KV_EINVAL : kv_table_find_or_create_ref(t, keys, n, buf, 99, NULL, g_refs);
    case OP_UPDATE: return kv_table_update(t, keys, n, vals);
    case OP_IMPORT: return kv_table_import(t, keys, n, vals, NULL, NULL, NULL);
    case OP_APPLY_CREATE: return kv_table_apply_gradients(t, keys, n, vals, 3, KV_APPLY_CREATE_MISSING, NULL);
    case OP_APPLY: return kv_table_apply_gradients(t, keys, n, vals, 3, 0, NULL);
    case OP_RESERVE: return kv_table_reserve(t, 8 * n); /* room for new chunks and index */
    default: return kv_table_find(t, keys, n, buf, NULL, NULL);
    }
}

static void test_oom(void) {
    const int32_t dim = 4;
    kv_table_config_t c = config(dim, KV_INIT_UNIFORM, 0, 1);
    enum { BASE = 3000, NEW = 9000 };
    int64_t *keys = malloc((BASE + NEW) * 8);
    float *vals = malloc((BASE + NEW) * dim * 4), *buf = malloc((BASE + NEW) * dim * 4);
    for (int i = 0; i < BASE + NEW; i++) keys[i] = key_of((uint64_t)i);
    for (int i = 0; i < (BASE + NEW) * dim; i++) vals[i] = 0.001f * (float)i;
    fail_alloc_install();
    int saw_nomem_ok = 1, all_done = 1, unchanged = 1;
    for (int op = 0; op < OP_N; op++) {
        int done = 0;
        for (long k = 1; k <= 200 && !done; k++) {
            kv_table_t *t = NULL;
            fail_alloc_arm(0);
            if (kv_table_create(&c, &t) != KV_OK) {
                CHECK(0);
                break;
            }
            /* mixed batch: half existing keys (with a duplicate), half new */
            kv_table_update(t, keys, BASE, vals);
            snap_t s0 = snapshot(t);
            fail_alloc_arm(k);
            int rc = run_op(t, op, keys + BASE / 2, BASE / 2 + NEW, buf, vals);
            fail_alloc_arm(0);
            if (rc == KV_OK) {
                done = 1;
            } else {
                saw_nomem_ok &= rc == KV_ENOMEM;
                snap_t s1 = snapshot(t);
                if (!snap_equal(&s0, &s1)) {
                    fprintf(stderr, "op %d: table changed after failing allocation %ld\n", op, k);
                    unchanged = 0;
                }
                unchanged &= table_consistent(t);
                snap_free(&s1);
            }
            snap_free(&s0);
            kv_table_destroy(t);
        }
        all_done &= done;
    }
    CHECK(saw_nomem_ok);
    CHECK(unchanged);
    CHECK(all_done);
    /* kv_table_create with a failing k-th allocation, including initial capacity */
    int create_ok = 0;
    c.initial_capacity = 50000;
    for (long k = 1; k <= 100; k++) {
        kv_table_t *t = NULL;
        fail_alloc_arm(k);
        int rc = kv_table_create(&c, &t);
        fail_alloc_arm(0);
        if (rc == KV_OK) {
            create_ok = 1;
            kv_table_destroy(t);
            break;
        }
        CHECK_EQ_INT(rc, KV_ENOMEM);
        CHECK(t == NULL);
    }
    CHECK(create_ok);
    kv_set_allocator(NULL, NULL, NULL);
    free(keys);
    free(vals);
    free(buf);
}


/* ---- feature lifecycle: admission, eviction, removed-keys log -------------------- */

static void test_admission(void) {
    const int32_t dim = 3;
    for (int mode = KV_ADMIT_EXACT; mode <= KV_ADMIT_BLOOM; mode++) {
        kv_table_config_t c = config(dim, KV_INIT_CONSTANT, 0.5f, 0);
        c.admit_min_count = 3;
        c.admit_mode = mode;
        c.bloom_counters = 1 << 16;
        kv_table_t *t = NULL;
        CHECK_EQ_INT(kv_table_create(&c, &t), KV_OK);
        int64_t keys[4] = {10, 20, 10, 30}; /* 10 twice in one call: counts once */
        float out[4 * 3], g[4 * 3];
        uint8_t has[4];
        int64_t created = -1, missing = -1;
        for (int i = 0; i < 12; i++) g[i] = 1.0f;
        for (int call = 1; call <= 2; call++) {
            CHECK_EQ_INT(kv_table_find_or_create(t, keys, 4, out, (uint32_t)call, &created, has), KV_OK);
            CHECK_EQ_INT(created, 0);
            CHECK(!has[0] && !has[1] && !has[2] && !has[3]);
            CHECK(out[0] == 0.0f && out[11] == 0.0f); /* the default row */
            CHECK_EQ_INT(kv_table_apply_gradients(t, keys, 4, g, call, KV_APPLY_CREATE_MISSING, &missing), KV_OK);
            CHECK_EQ_INT(missing, 3);
            CHECK_EQ_INT(kv_table_size(t), 0);
        }
        kv_table_stats_t st;
        kv_table_stats(t, &st);
        CHECK_EQ_INT(st.rejected, 8);
        CHECK_EQ_INT(st.dropped_grads, 6);
        CHECK_EQ_INT(st.pending, mode == KV_ADMIT_EXACT ? 3 : 0);
        CHECK(st.admission_bytes > 0);
        /* third sighting of 10 and 20 (not 30): admitted with the initial value */
        CHECK_EQ_INT(kv_table_find_or_create(t, keys, 3, out, 3, &created, has), KV_OK);
        CHECK_EQ_INT(created, 2);
        CHECK(has[0] && has[1] && has[2] && out[0] == 0.5f && out[3] == 0.5f);
        CHECK_EQ_INT(kv_table_apply_gradients(t, keys, 4, g, 3, KV_APPLY_CREATE_MISSING, &missing), KV_OK);
        CHECK_EQ_INT(missing, 1); /* 30 */
        kv_table_stats(t, &st);
        CHECK_EQ_INT(st.admitted, 2);
        CHECK_EQ_INT(st.pending, mode == KV_ADMIT_EXACT ? 1 : 0);
        /* TTL eviction purges exact pending keys last seen before the cut-off */
        int64_t ne = -1;
        CHECK_EQ_INT(kv_table_evict(t, 3, -1, KV_EVICT_LRU, &ne), KV_OK);
        CHECK_EQ_INT(ne, 0);
        kv_table_stats(t, &st);
        CHECK_EQ_INT(st.pending, 0);
        CHECK_EQ_INT(kv_table_size(t), 2);
        CHECK(table_consistent(t));
        kv_table_destroy(t);
    }
    /* settings out of range */
    kv_table_config_t c = config(dim, KV_INIT_ZEROS, 0, 0);
    kv_table_t *x = NULL;
    c.admit_mode = 7;
    CHECK_EQ_INT(kv_table_create(&c, &x), KV_EINVAL);
    c.admit_mode = KV_ADMIT_BLOOM;
    c.admit_min_count = 16;
    CHECK_EQ_INT(kv_table_create(&c, &x), KV_EINVAL);
    CHECK(x == NULL);
}

/* Exact admission counts a key once per step: two lookups in one step (two SSP workers
 * pulling it at their clock t) are one sighting; step 0 (no step) always counts. */
static void test_admission_once_per_step(void) {
    kv_table_config_t c = config(2, KV_INIT_CONSTANT, 0.5f, 0);
    c.admit_min_count = 2;
    kv_table_t *t = NULL;
    CHECK_EQ_INT(kv_table_create(&c, &t), KV_OK);
    int64_t key = 77, created = -1;
    float out[2];
    uint8_t has[1];
    for (int worker = 0; worker < 3; worker++) { /* three pulls of step 5 */
        CHECK_EQ_INT(kv_table_find_or_create(t, &key, 1, out, 5, &created, has), KV_OK);
        CHECK(!has[0] && created == 0);
    }
    CHECK_EQ_INT(kv_table_find_or_create(t, &key, 1, out, 6, &created, has), KV_OK);
    CHECK(has[0] && created == 1); /* the second step: admitted */
    int64_t other = 78;
    CHECK_EQ_INT(kv_table_find_or_create(t, &other, 1, out, 0, &created, has), KV_OK);
    CHECK_EQ_INT(kv_table_find_or_create(t, &other, 1, out, 0, &created, has), KV_OK);
    CHECK(has[0] && created == 1);
    kv_table_destroy(t);
}

/* Admission state out of one table and into another: the second admits exactly when
 * the first would (exact), or never later (Bloom, merged). */
static void test_admission_state(void) {
    for (int mode = KV_ADMIT_EXACT; mode <= KV_ADMIT_BLOOM; mode++) {
        kv_table_config_t c = config(2, KV_INIT_CONSTANT, 0.5f, 0);
        c.admit_min_count = 3;
        c.admit_mode = mode;
        c.bloom_counters = 1 << 12;
        kv_table_t *a = NULL, *b = NULL;
        CHECK_EQ_INT(kv_table_create(&c, &a), KV_OK);
        CHECK_EQ_INT(kv_table_create(&c, &b), KV_OK);
        int64_t keys[3] = {5, 6, 7}, created = -1;
        float out[6];
        uint8_t has[3];
        for (uint32_t s = 1; s <= 2; s++) /* 5, 6, 7 seen in steps 1 and 2: one more */
            CHECK_EQ_INT(kv_table_find_or_create(a, keys, 3, out, s, &created, has), KV_OK);
        if (mode == KV_ADMIT_EXACT) {
            int64_t k[8], cursor = 0, n = -1;
            uint32_t cnt[8], st[8];
            CHECK_EQ_INT(kv_table_export_pending(a, &cursor, 8, k, cnt, st, &n), KV_OK);
            CHECK_EQ_INT(n, 3);
            CHECK(cnt[0] == 2 && st[0] == 2);
            CHECK_EQ_INT(kv_table_import_pending(b, k, cnt, st, n), KV_OK);
            cnt[0] = 0;
            CHECK_EQ_INT(kv_table_import_pending(b, k, cnt, st, 1), KV_EINVAL);
            CHECK_EQ_INT(kv_table_bloom_bytes(a), 0);
        } else {
            int64_t nb = kv_table_bloom_bytes(a);
            CHECK(nb == (1 << 11));
            uint8_t *bytes = malloc((size_t)nb);
            uint64_t adds = 0;
            CHECK_EQ_INT(kv_table_export_bloom(a, bytes, nb, &adds), KV_OK);
            CHECK_EQ_INT(adds, 6);
            CHECK_EQ_INT(kv_table_import_bloom(b, bytes, nb, adds, 1), KV_OK);
            CHECK_EQ_INT(kv_table_import_bloom(b, bytes, nb - 1, adds, 0), KV_EINVAL);
            free(bytes);
        }
        CHECK_EQ_INT(kv_table_find_or_create(b, keys, 3, out, 3, &created, has), KV_OK);
        CHECK_EQ_INT(created, 3); /* the third sighting, as on a */
        kv_table_destroy(a);
        kv_table_destroy(b);
    }
}

/* kv_table_forget_new removes the rows a step created and nothing else. */
static void test_forget_new(void) {
    kv_table_config_t c = config(2, KV_INIT_CONSTANT, 0.5f, 0);
    kv_table_t *t = NULL;
    CHECK_EQ_INT(kv_table_create(&c, &t), KV_OK);
    int64_t keys[3] = {1, 2, 3}, created = -1, gone = -1;
    float out[6], g[6] = {1, 1, 1, 1, 1, 1};
    CHECK_EQ_INT(kv_table_find_or_create(t, keys, 2, out, 1, &created, NULL), KV_OK);
    CHECK_EQ_INT(kv_table_apply_gradients(t, keys, 2, g, 1, 0, NULL), KV_OK); /* 1, 2 trained */
    CHECK_EQ_INT(kv_table_find_or_create(t, keys, 3, out, 2, &created, NULL), KV_OK);
    CHECK_EQ_INT(created, 1); /* 3 is new at step 2, then the step is rejected */
    CHECK_EQ_INT(kv_table_track_removed(t, 1), KV_OK);
    CHECK_EQ_INT(kv_table_forget_new(t, keys, 3, 2, &gone), KV_OK);
    CHECK_EQ_INT(gone, 1);
    CHECK_EQ_INT(kv_table_size(t), 2);
    uint8_t found[3];
    CHECK_EQ_INT(kv_table_find(t, keys, 3, out, found, NULL), KV_OK);
    CHECK(found[0] && found[1] && !found[2]);
    CHECK_EQ_INT(kv_table_forget_new(t, keys, 2, 1, &gone), KV_OK); /* trained: kept */
    CHECK_EQ_INT(gone, 0);
    CHECK_EQ_INT(kv_table_forget_new(NULL, keys, 1, 1, NULL), KV_EINVAL);
    CHECK(table_consistent(t));
    kv_table_destroy(t);
}

/* Brute force: sort (primary, secondary, key) and keep the last max_rows non-TTL rows. */
typedef struct {
    uint32_t a, b;
    int64_t key;
} bf_t;
static int bf_cmp(const void *x, const void *y) {
    const bf_t *p = x, *q = y;
    if (p->a != q->a) return p->a < q->a ? -1 : 1;
    if (p->b != q->b) return p->b < q->b ? -1 : 1;
    return p->key < q->key ? -1 : p->key > q->key;
}
static int cmp_i64(const void *x, const void *y) {
    int64_t a = *(const int64_t *)x, b = *(const int64_t *)y;
    return a < b ? -1 : a > b;
}

static void test_evict_exact(void) {
    const int32_t dim = 2;
    enum { N = 5000 };
    uint64_t seed = 99;
    int64_t *keys = malloc(N * 8), *want = malloc(N * 8);
    uint32_t *steps = malloc(N * 4), *counts = malloc(N * 4);
    float *vals = calloc((size_t)N * dim, 4);
    bf_t *bf = malloc(N * sizeof(bf_t));
    int all_ok = 1;
    for (int trial = 0; trial < 40; trial++) {
        int policy = trial & 1;
        uint32_t span = trial % 4 == 0 ? 4u : trial % 4 == 1 ? 300u : trial % 4 == 2 ? 1u << 20 : 0xffffffffu;
        for (int i = 0; i < N; i++) {
            keys[i] = (int64_t)test_rand(&seed);
            steps[i] = (uint32_t)(test_rand(&seed) % span);
            counts[i] = (uint32_t)(test_rand(&seed) % (span < 8 ? 3 : span > 65536 ? 65536 : span));
        }
        kv_table_config_t c = config(dim, KV_INIT_ZEROS, 0, 0);
        kv_table_t *t = NULL;
        CHECK_EQ_INT(kv_table_create(&c, &t), KV_OK);
        CHECK_EQ_INT(kv_table_import(t, keys, N, vals, NULL, steps, counts), KV_OK);
        uint32_t ttl = trial % 3 == 0 ? 0 : steps[trial] ; /* a cut-off that exists */
        int64_t max_rows = trial % 5 == 4 ? -1 : (int64_t)(test_rand(&seed) % N);
        int64_t nb = 0, nkeep = 0;
        for (int i = 0; i < N; i++) {
            if (steps[i] < ttl) continue;
            bf[nb].a = policy ? counts[i] : steps[i];
            bf[nb].b = policy ? steps[i] : counts[i];
            bf[nb].key = keys[i];
            nb++;
        }
        qsort(bf, (size_t)nb, sizeof(bf_t), bf_cmp);
        int64_t first = max_rows >= 0 && nb > max_rows ? nb - max_rows : 0;
        for (int64_t i = first; i < nb; i++) want[nkeep++] = bf[i].key;
        qsort(want, (size_t)nkeep, 8, cmp_i64);
        int64_t ne = -1;
        CHECK_EQ_INT(kv_table_evict(t, ttl, max_rows, policy, &ne), KV_OK);
        CHECK_EQ_INT(ne, N - nkeep);
        snap_t sn = snapshot(t);
        qsort(sn.keys, (size_t)sn.n, 8, cmp_i64);
        int ok = sn.n == nkeep && !memcmp(sn.keys, want, (size_t)nkeep * 8);
        snap_free(&sn);
        ok = ok && table_consistent(t);
        if (!ok) fprintf(stderr, "evict trial %d (policy %d, ttl %u, max %lld) differs\n",
                         trial, policy, ttl, (long long)max_rows);
        all_ok &= ok;
        kv_table_stats_t st;
        kv_table_stats(t, &st);
        CHECK_EQ_INT(st.evicted, N - nkeep);
        /* evicted rows are reused: re-inserting the keys allocates no new memory */
        int64_t bytes = st.bytes;
        CHECK_EQ_INT(kv_table_import(t, keys, N, vals, NULL, steps, counts), KV_OK);
        kv_table_stats(t, &st);
        CHECK_EQ_INT(st.bytes, bytes);
        CHECK(table_consistent(t));
        kv_table_destroy(t);
    }
    CHECK(all_ok);
    free(keys), free(want), free(steps), free(counts), free(vals), free(bf);
}

static void test_removed_log(void) {
    kv_table_config_t c = config(2, KV_INIT_ZEROS, 0, 0);
    kv_table_t *t = NULL;
    CHECK_EQ_INT(kv_table_create(&c, &t), KV_OK);
    int64_t keys[6] = {1, 2, 3, 4, 5, 6}, got[8], n = -1;
    float out[12];
    CHECK_EQ_INT(kv_table_find_or_create(t, keys, 3, out, 1, NULL, NULL), KV_OK);
    CHECK_EQ_INT(kv_table_find_or_create(t, keys + 3, 3, out, 5, NULL, NULL), KV_OK);
    CHECK_EQ_INT(kv_table_delete(t, keys, 1, NULL), KV_OK); /* not logged: log off */
    CHECK_EQ_INT(kv_table_track_removed(t, 1), KV_OK);
    CHECK_EQ_INT(kv_table_delete(t, keys + 1, 1, NULL), KV_OK);
    CHECK_EQ_INT(kv_table_evict(t, 5, -1, KV_EVICT_LRU, &n), KV_OK); /* key 3 */
    CHECK_EQ_INT(n, 1);
    kv_table_stats_t st;
    kv_table_stats(t, &st);
    CHECK_EQ_INT(st.removed_logged, 2);
    CHECK_EQ_INT(kv_table_take_removed(t, got, 1, &n), KV_OK);
    CHECK_EQ_INT(n, 1);
    CHECK_EQ_INT(kv_table_take_removed(t, got + 1, 8, &n), KV_OK);
    CHECK_EQ_INT(n, 1);
    qsort(got, 2, 8, cmp_i64);
    CHECK(got[0] == 2 && got[1] == 3);
    CHECK_EQ_INT(kv_table_take_removed(t, got, 8, &n), KV_OK);
    CHECK_EQ_INT(n, 0);
    CHECK_EQ_INT(kv_table_evict(t, 0, 1, KV_EVICT_LRU, &n), KV_OK); /* budget: keeps 6 */
    CHECK_EQ_INT(n, 2);
    CHECK_EQ_INT(kv_table_take_removed(t, got, 8, &n), KV_OK);
    qsort(got, 2, 8, cmp_i64);
    CHECK(n == 2 && got[0] == 4 && got[1] == 5);
    CHECK_EQ_INT(kv_table_track_removed(t, 0), KV_OK);
    CHECK_EQ_INT(kv_table_evict(t, 0, 0, KV_EVICT_LRU, &n), KV_OK);
    CHECK_EQ_INT(kv_table_take_removed(t, got, 8, &n), KV_OK);
    CHECK_EQ_INT(n, 0);
    CHECK_EQ_INT(kv_table_size(t), 0);
    CHECK_EQ_INT(kv_table_evict(t, 0, 0, 9, &n), KV_EINVAL);
    CHECK_EQ_INT(kv_table_take_removed(t, NULL, 1, &n), KV_EINVAL);
    kv_table_destroy(t);
}

/* kv_table_evict and admission with a failing k-th allocation: unchanged on error. */
static void test_lifecycle_oom(void) {
    enum { N = 20000 };
    int64_t *keys = malloc(N * 8);
    uint32_t *steps = malloc(N * 4);
    float *vals = calloc((size_t)N * 2, 4);
    uint64_t seed = 5;
    for (int i = 0; i < N; i++) {
        keys[i] = (int64_t)test_rand(&seed);
        steps[i] = (uint32_t)(i % 7);
    }
    fail_alloc_install();
    for (int variant = 0; variant < 3; variant++) {
        int done = 0, unchanged = 1;
        for (long k = 1; k <= 50 && !done; k++) {
            kv_table_config_t c = config(2, KV_INIT_ZEROS, 0, 0);
            c.admit_min_count = variant == 2 ? 2 : 0;
            kv_table_t *t = NULL;
            fail_alloc_arm(0);
            if (kv_table_create(&c, &t) != KV_OK) break;
            kv_table_import(t, keys, N / 2, vals, NULL, steps, NULL);
            kv_table_track_removed(t, 1);
            if (variant == 2) { /* pending keys */
                float out[2 * 1000];
                kv_table_find_or_create(t, keys + N / 2, 1000, out, 3, NULL, NULL);
            }
            snap_t s0 = snapshot(t);
            kv_table_stats_t a, b;
            kv_table_stats(t, &a);
            fail_alloc_arm(k);
            int rc;
            if (variant == 2) {
                float out[2 * 2000];
                rc = kv_table_find_or_create(t, keys + N / 2 + 500, 2000, out, 4, NULL, NULL);
                if (rc == KV_OK) rc = kv_table_evict(t, 4, -1, KV_EVICT_LRU, NULL);
            } else {
                rc = kv_table_evict(t, 2, variant ? 1234 : -1, variant, NULL);
            }
            fail_alloc_arm(0);
            if (rc == KV_OK) {
                done = 1;
            } else {
                CHECK_EQ_INT(rc, KV_ENOMEM);
                snap_t s1 = snapshot(t);
                kv_table_stats(t, &b);
                if (variant < 2) unchanged &= snap_equal(&s0, &s1) && a.pending == b.pending &&
                                              a.removed_logged == b.removed_logged;
                unchanged &= table_consistent(t);
                snap_free(&s1);
            }
            snap_free(&s0);
            kv_table_destroy(t);
        }
        CHECK(done);
        CHECK(unchanged);
    }
    kv_set_allocator(NULL, NULL, NULL);
    free(keys), free(steps), free(vals);
}

/* ---- stats and memory ----------------------------------------------------------- */

static void test_stats(void) {
    kv_table_config_t c = config(16, KV_INIT_ZEROS, 0, 0);
    c.initial_capacity = 1000;
    kv_table_t *t = NULL;
    CHECK_EQ_INT(kv_table_create(&c, &t), KV_OK);
    kv_table_stats_t s;
    CHECK_EQ_INT(kv_table_stats(t, &s), KV_OK);
    CHECK(s.rows == 0 && s.row_capacity >= 1000 && s.index_slots * 0.85 >= 1000);
    CHECK_EQ_INT(s.row_bytes, 16 + 4 * (16 + s.slot_floats));
    CHECK(s.bytes >= s.row_capacity * s.row_bytes + s.index_slots * 4);
    enum { N = 200000 };
    int64_t *keys = malloc(N * 8);
    float *out = malloc((size_t)N * 16 * 4);
    for (int i = 0; i < N; i++) keys[i] = key_of((uint64_t)i);
    CHECK_EQ_INT(kv_table_find_or_create(t, keys, N, out, 1, NULL, NULL), KV_OK);
    CHECK_EQ_INT(kv_table_stats(t, &s), KV_OK);
    CHECK(s.rows == N && s.load_factor <= 0.85 && s.load_factor > 0.3);
    double overhead = (double)(s.bytes - (int64_t)N * 4 * (16 + s.slot_floats)) / N;
    CHECK(overhead > 16 && overhead < 26);
    free(keys);
    free(out);
    kv_table_destroy(t);
}

/* ---- kv_table_reserve: room ahead, invisible but for capacity -------------------- */

/* The stats counts a reserve must not change. */
static int counts_equal(const kv_table_stats_t *a, const kv_table_stats_t *b) {
    return a->rows == b->rows && a->admitted == b->admitted && a->rejected == b->rejected &&
           a->dropped_grads == b->dropped_grads && a->evicted == b->evicted &&
           a->pending == b->pending && a->removed_logged == b->removed_logged &&
           a->row_bytes == b->row_bytes;
}

/* Resident bytes of this process (/proc/self/statm), or -1. */
static int64_t rss_bytes(void) {
    FILE *f = fopen("/proc/self/statm", "r");
    long size = 0, res = -1;
    if (!f) return -1;
    if (fscanf(f, "%ld %ld", &size, &res) != 2) res = -1;
    fclose(f);
    return res < 0 ? -1 : (int64_t)res * 4096; /* x86-64 / aarch64 4 KiB base pages */
}

/* Reserve then insert gives exactly the table insert alone gives; a reserve changes
 * no row, generation, count or change-tracking state, keeps refs valid, and the rows
 * it made room for are created without growing the arena or the index. */
static void test_reserve(void) {
    enum { D = 8, BASE = 30000, NEW = 70000, DEL = 3000 };
    kv_table_config_t c = config(D, KV_INIT_UNIFORM, -1.0f, 1.0f);
    c.admit_min_count = 0;
    for (int admit = 0; admit < 2; admit++) {
        c.admit_min_count = admit ? 2 : 0; /* with admission: an upper bound, unused */
        kv_table_t *a = NULL, *b = NULL;
        CHECK_EQ_INT(kv_table_create(&c, &a), KV_OK);
        CHECK_EQ_INT(kv_table_create(&c, &b), KV_OK);
        int64_t *keys = malloc((BASE + NEW) * 8);
        float *out_a = malloc((size_t)(BASE + NEW) * D * 4);
        float *out_b = malloc((size_t)(BASE + NEW) * D * 4);
        float *g = malloc((size_t)(BASE + NEW) * D * 4);
        uint32_t *ref = malloc((BASE + NEW) * 4), *ref_b = malloc((BASE + NEW) * 4);
        uint32_t *ids = malloc((BASE + NEW) * 4);
        float *prep = malloc((size_t)(BASE + NEW) * (D + 2 * D) * 4);
        for (int i = 0; i < BASE + NEW; i++) keys[i] = key_of((uint64_t)i);
        for (int i = 0; i < (BASE + NEW) * D; i++) g[i] = 0.001f * (float)(i % 13 - 6);
        kv_table_t *both[2] = {a, b};
        uint64_t gen = 0, gen_b = 0;
        for (int k = 0; k < 2; k++) {
            kv_table_t *t = both[k];
            for (int r = 0; r <= admit; r++) /* admission: the second step's sighting */
                CHECK_EQ_INT(kv_table_find_or_create_gen(t, keys, BASE, k ? out_b : out_a,
                                                         (uint32_t)r + 1,
                                                         NULL, k ? ref_b : ref,
                                                         k ? &gen_b : &gen), KV_OK);
            int64_t nd = 0;
            CHECK_EQ_INT(kv_table_delete(t, keys + 1000, DEL, &nd), KV_OK); /* free list */
            CHECK_EQ_INT(nd, DEL);
            CHECK_EQ_INT(kv_table_track_changes(t, 1), KV_OK);
            CHECK_EQ_INT(kv_table_track_removed(t, 1), KV_OK);
            CHECK_EQ_INT(kv_table_apply_gradients(t, keys, 500, g, 1, 0, NULL), KV_OK);
        }
        /* refs of rows that stay (keys 0 .. 999), taken at the generation now */
        CHECK_EQ_INT(kv_table_find_or_create_gen(a, keys, 1000, out_a, 2, NULL, ref, &gen), KV_OK);
        CHECK_EQ_INT(kv_table_find_or_create_gen(b, keys, 1000, out_b, 2, NULL, ref_b, &gen_b),
                     KV_OK);
        snap_t s0 = snapshot(a);
        int64_t nr0, ng0, nr1, ng1;
        int32_t lost0, lost1;
        kv_table_changes_pending(a, &nr0, &ng0, &lost0);
        CHECK_EQ_INT(kv_table_reserve(a, 0), KV_OK);
        kv_table_stats_t z;
        kv_table_stats(a, &z);
        CHECK_EQ_INT(z.bytes, s0.st.bytes);
        CHECK_EQ_INT(z.row_capacity, s0.st.row_capacity);
        CHECK_EQ_INT(kv_table_reserve(a, NEW + DEL), KV_OK); /* the next lookup's rows */
        snap_t s1 = snapshot(a);
        kv_table_changes_pending(a, &nr1, &ng1, &lost1);
        CHECK(rows_equal(&s0, &s1));
        CHECK(counts_equal(&s0.st, &s1.st));
        CHECK(nr0 == nr1 && ng0 == ng1 && lost0 == lost1);
        CHECK(s1.st.row_capacity >= s1.st.rows + NEW + DEL);
        CHECK(s1.st.row_capacity > s0.st.row_capacity);
        CHECK((double)(s1.st.rows + NEW + DEL) <= 0.85 * (double)s1.st.index_slots);
        CHECK(s1.st.bytes > s0.st.bytes);
        CHECK(table_consistent(a));
        /* the refs and the generation still hold: prepare keeps them as they are */
        uint64_t pgen = 0;
        int64_t bad = 0;
        CHECK_EQ_INT(kv_table_prepare_refs(a, keys, ref, 1000, g, 2, gen, prep, ids, &pgen, &bad),
                     KV_OK);
        CHECK(pgen == gen && bad == -1);
        CHECK(!memcmp(ids, ref, 1000 * 4));
        CHECK_EQ_INT(kv_table_apply_refs(a, keys, ref, 1000, g, 2, gen, NULL), KV_OK);
        CHECK_EQ_INT(kv_table_apply_refs(b, keys, ref_b, 1000, g, 2, gen_b, NULL), KV_OK);
        /* the rows it made room for: no arena or index growth, the same table as b */
        kv_table_stats_t before, after;
        kv_table_stats(a, &before);
        int64_t ca = -1, cb = -2;
        CHECK_EQ_INT(kv_table_find_or_create(a, keys, BASE + NEW, out_a, 3, &ca, NULL), KV_OK);
        CHECK_EQ_INT(kv_table_find_or_create(b, keys, BASE + NEW, out_b, 3, &cb, NULL), KV_OK);
        kv_table_stats(a, &after);
        CHECK_EQ_INT(ca, cb);
        CHECK(admit || ca == NEW + DEL);
        CHECK(!memcmp(out_a, out_b, (size_t)(BASE + NEW) * D * 4));
        CHECK_EQ_INT(after.row_capacity, before.row_capacity);
        CHECK_EQ_INT(after.index_slots, before.index_slots);
        /* and later steps too (more rows than were reserved: the table grows as ever) */
        CHECK_EQ_INT(kv_table_find_or_create(a, keys, BASE + NEW, out_a, 4, &ca, NULL), KV_OK);
        CHECK_EQ_INT(kv_table_find_or_create(b, keys, BASE + NEW, out_b, 4, &cb, NULL), KV_OK);
        CHECK_EQ_INT(kv_table_apply_gradients(a, keys, BASE + NEW, g, 4, 0, NULL), KV_OK);
        CHECK_EQ_INT(kv_table_apply_gradients(b, keys, BASE + NEW, g, 4, 0, NULL), KV_OK);
        snap_t sa = snapshot(a), sb = snapshot(b);
        CHECK(rows_equal(&sa, &sb));
        CHECK(counts_equal(&sa.st, &sb.st));
        kv_table_changes_pending(a, &nr0, &ng0, &lost0);
        kv_table_changes_pending(b, &nr1, &ng1, &lost1);
        CHECK(nr0 == nr1 && ng0 == ng1 && lost0 == lost1);
        CHECK(table_consistent(a));
        snap_free(&s0);
        snap_free(&s1);
        snap_free(&sa);
        snap_free(&sb);
        /* errors: nothing changes */
        snap_t e0 = snapshot(a);
        CHECK_EQ_INT(kv_table_reserve(NULL, 1), KV_EINVAL);
        CHECK_EQ_INT(kv_table_reserve(a, -1), KV_EINVAL);
        CHECK_EQ_INT(kv_table_reserve(a, INT64_MAX), KV_EFULL);
        CHECK_EQ_INT(kv_table_reserve(a, (int64_t)UINT32_MAX), KV_EFULL);
        snap_t e1 = snapshot(a);
        CHECK(snap_equal(&e0, &e1));
        CHECK_EQ_INT(e0.st.bytes, e1.st.bytes);
        snap_free(&e0);
        snap_free(&e1);
        free(keys);
        free(out_a);
        free(out_b);
        free(g);
        free(ref);
        free(ref_b);
        free(ids);
        free(prep);
        kv_table_destroy(a);
        kv_table_destroy(b);
    }
}

/* The chunks a reserve allocates are resident after it (pre-faulted), in each mode
 * that pre-faults, and not with KV_PREFAULT_OFF; their memory reads zero. */
static void test_reserve_prefault(void) {
    if (rss_bytes() < 0) return; /* no /proc: nothing to measure */
    enum { D = 64, M = 60000 };
    const int32_t modes[] = {KV_PREFAULT_AUTO, KV_PREFAULT_TOUCH, KV_PREFAULT_OFF};
    for (size_t i = 0; i < 3; i++) {
        kv_table_set_prefault(modes[i]);
        kv_table_config_t c = config(D, KV_INIT_ZEROS, 0, 0);
        kv_table_t *t = NULL;
        CHECK_EQ_INT(kv_table_create(&c, &t), KV_OK);
        kv_table_stats_t s0, s1;
        kv_table_stats(t, &s0);
        int64_t r0 = rss_bytes();
        CHECK_EQ_INT(kv_table_reserve(t, M), KV_OK);
        int64_t r1 = rss_bytes();
        kv_table_stats(t, &s1);
        int64_t arena = (s1.row_capacity - s0.row_capacity) * s1.row_bytes;
        CHECK(arena > (int64_t)M * s1.row_bytes * 9 / 10);
        if (modes[i] == KV_PREFAULT_OFF) {
            CHECK(r1 - r0 < arena / 4); /* only the index the rebuild wrote */
        } else {
            if (r1 - r0 < arena * 9 / 10)
                fprintf(stderr, "prefault mode %d: rss +%lld for %lld arena bytes\n",
                        (int)modes[i], (long long)(r1 - r0), (long long)arena);
            CHECK(r1 - r0 >= arena * 9 / 10);
        }
        /* the reserved rows start from their initial values (zeros) as ever */
        int64_t keys[4] = {11, 12, 13, 14};
        float out[4 * D];
        memset(out, 0xff, sizeof out);
        CHECK_EQ_INT(kv_table_find_or_create(t, keys, 4, out, 1, NULL, NULL), KV_OK);
        int zero = 1;
        for (int e = 0; e < 4 * D; e++) zero &= out[e] == 0.0f;
        CHECK(zero);
        CHECK(table_consistent(t));
        kv_table_destroy(t);
    }
    kv_table_set_prefault(KV_PREFAULT_AUTO);
}

/* The system's transparent huge page mode: 'a' (always), 'm' (madvise), 'n' (never),
 * 0 if unknown (the bracketed word of /sys/kernel/mm/transparent_hugepage/enabled). */
static int thp_mode(void) {
    FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
    char line[128] = {0};
    if (!f) return 0;
    if (!fgets(line, sizeof line, f)) line[0] = 0;
    fclose(f);
    char *b = strchr(line, '[');
    return b ? b[1] : 0;
}

/* smaps' THPeligible of the mapping holding p: 1 or 0, -1 if not found. */
static int thp_eligible(const void *p) {
    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f) return -1;
    char line[512];
    int inside = 0, out = -1;
    unsigned long a = 0, e = 0, at = (unsigned long)p;
    while (out < 0 && fgets(line, sizeof line, f)) {
        if (sscanf(line, "%lx-%lx ", &a, &e) == 2 && strchr(line, '-') < strchr(line, ' '))
            inside = a <= at && at < e;
        else if (inside && !strncmp(line, "THPeligible:", 12))
            out = atoi(line + 12) != 0;
    }
    fclose(f);
    return out;
}

/* kv_set_huge_advice: on (the default), the blocks kv_alloc_huge maps are advised
 * MADV_HUGEPAGE, so where the system gives huge pages only when asked ("madvise") they
 * are eligible for them; off, they are not. (Under "always" or "never" the advice
 * changes nothing: only the switch is checked.) */
static void test_huge_advice(void) {
    CHECK_EQ_INT(kv_huge_advice(), 1);
    int mode = thp_mode();
    for (int on = 1; on >= 0; on--) {
        kv_set_huge_advice(on);
        CHECK_EQ_INT(kv_huge_advice(), on);
        size_t n = (size_t)4 << 20;
        unsigned char *p = kv_alloc_huge(n);
        CHECK(p != NULL);
        if (!p) continue;
        p[0] = p[n - 1] = 1;
        int eligible = thp_eligible(p);
        if (mode == 'm' && eligible >= 0) CHECK_EQ_INT(eligible, on);
        kv_free_huge(p, n);
    }
    kv_set_huge_advice(1);
}

/* ---- two threads: finds never see a torn or foreign row (and set_optim is locked) - */

typedef struct {
    kv_table_t *t;
    volatile int stop;
    int bad;
    long iters;
} thr_t;

enum { TKEYS = 4000, TDIM = 8 };

static void *reader(void *arg) {
    thr_t *s = arg;
    int64_t keys[256];
    float out[256 * TDIM];
    uint8_t found[256];
    uint64_t rng = 7;
    while (!__atomic_load_n(&s->stop, __ATOMIC_ACQUIRE)) {
        for (int i = 0; i < 256; i++) keys[i] = (int64_t)(test_rand(&rng) % TKEYS);
        if (kv_table_find(s->t, keys, 256, out, found, NULL) != KV_OK) s->bad++;
        for (int i = 0; i < 256; i++) {
            if (!found[i]) continue;
            /* writer rows: element 0 = key, all others equal element 1 (a version) */
            if (out[i * TDIM] != (float)keys[i]) s->bad++;
            for (int j = 2; j < TDIM; j++)
                if (out[i * TDIM + j] != out[i * TDIM + 1]) s->bad++;
        }
        kv_table_stats_t st;
        kv_table_stats(s->t, &st);
        /* a learning-rate schedule from another thread, while rows are created */
        kv_optim_t o = g_optim;
        o.lr = (s->iters & 1) ? 0.25f : g_optim.lr;
        if (kv_table_set_optim(s->t, &o) != KV_OK) s->bad++;
        s->iters++;
    }
    return NULL;
}

/* A third thread reserves room ahead meanwhile (as a pipeline's helper does), in
 * growing amounts, so that it allocates full chunks (pre-faulted outside the lock)
 * and rebuilds the index while the writer creates and deletes rows. */
static void *reserver(void *arg) {
    thr_t *s = arg;
    for (int64_t m = 1000; m <= 200000 && !__atomic_load_n(&s->stop, __ATOMIC_ACQUIRE);
         m += 20000)
        if (kv_table_reserve(s->t, m) != KV_OK) s->bad++;
    return NULL;
}

static void test_threads(void) {
    kv_table_config_t c = config(TDIM, KV_INIT_ZEROS, 0, 0);
    kv_table_t *t = NULL;
    CHECK_EQ_INT(kv_table_create(&c, &t), KV_OK);
    thr_t s = {t, 0, 0, 0};
    thr_t r = {t, 0, 0, 0};
    pthread_t th, tr;
    pthread_create(&th, NULL, reader, &s);
    pthread_create(&tr, NULL, reserver, &r);
    uint64_t rng = 99;
    int64_t keys[128];
    float v[128 * TDIM];
    int wbad = 0;
    for (int round = 0; round < 400; round++) {
        for (int i = 0; i < 128; i++) {
            keys[i] = (int64_t)(test_rand(&rng) % TKEYS);
            v[i * TDIM] = (float)keys[i];
            for (int j = 1; j < TDIM; j++) v[i * TDIM + j] = (float)round;
        }
        if (kv_table_update(t, keys, 128, v) != KV_OK) wbad++;
        if (round % 3 == 0 && kv_table_delete(t, keys, 16, NULL) != KV_OK) wbad++;
    }
    __atomic_store_n(&s.stop, 1, __ATOMIC_RELEASE);
    __atomic_store_n(&r.stop, 1, __ATOMIC_RELEASE);
    pthread_join(th, NULL);
    pthread_join(tr, NULL);
    CHECK_EQ_INT(r.bad, 0);
    CHECK_EQ_INT(wbad, 0);
    CHECK_EQ_INT(s.bad, 0);
    CHECK(s.iters > 0);
    CHECK(table_consistent(t));
    kv_table_destroy(t);
}

#ifdef KV_TEST_MAX_ROWS
static void test_full(void) {
    kv_table_config_t c = config(2, KV_INIT_ZEROS, 0, 0);
    kv_table_t *t = NULL;
    CHECK_EQ_INT(kv_table_create(&c, &t), KV_OK);
    int64_t keys[1200];
    float out[1200 * 2];
    memset(out, 0, sizeof out);
    for (int i = 0; i < 1200; i++) keys[i] = i;
    CHECK_EQ_INT(kv_table_find_or_create(t, keys, 990, out, 0, NULL, NULL), KV_OK);
    snap_t s0 = snapshot(t);
    CHECK_EQ_INT(kv_table_find_or_create(t, keys, 1001, out, 0, NULL, NULL), KV_EFULL);
    CHECK_EQ_INT(kv_table_update(t, keys, 1200, out), KV_EFULL);
    CHECK_EQ_INT(kv_table_import(t, keys + 500, 700, out, NULL, NULL, NULL), KV_EFULL);
    CHECK_EQ_INT(kv_table_apply_gradients(t, keys, 1200, out, 1, KV_APPLY_CREATE_MISSING, NULL),
                 KV_EFULL);
    CHECK_EQ_INT(kv_table_reserve(t, 11), KV_EFULL);
    snap_t s1 = snapshot(t);
    CHECK(snap_equal(&s0, &s1));
    snap_free(&s0);
    snap_free(&s1);
    /* exactly at the limit is fine, and deleting makes room again */
    CHECK_EQ_INT(kv_table_reserve(t, 10), KV_OK);
    CHECK_EQ_INT(kv_table_find_or_create(t, keys, 1000, out, 0, NULL, NULL), KV_OK);
    CHECK_EQ_INT(kv_table_size(t), 1000);
    CHECK_EQ_INT(kv_table_find_or_create(t, keys + 1000, 1, out, 0, NULL, NULL), KV_EFULL);
    CHECK_EQ_INT(kv_table_delete(t, keys, 1, NULL), KV_OK);
    CHECK_EQ_INT(kv_table_find_or_create(t, keys + 1000, 1, out, 0, NULL, NULL), KV_OK);
    CHECK(table_consistent(t));
    kv_table_destroy(t);
}
#endif

/* ---- rows by reference: find_or_create_ref + apply_gradients_ref ----------------- */

/* The ref path must leave a table exactly as the key path does: duplicates across
 * batches and within one, refs gone stale (delete), refs that lie, admission. */
static void test_apply_ref(void) {
    enum { dim = 5, N = 600, ROUNDS = 12 };
    int64_t *keys = malloc(N * 8);
    float *out = malloc(N * dim * 4), *g = malloc(N * dim * 4);
    uint32_t *ref = malloc(N * 4);
    for (uint32_t admit = 0; admit <= 2; admit += 2) {
        kv_table_config_t c = config(dim, KV_INIT_NORMAL, 0.0f, 0.1f);
        c.admit_min_count = admit;
        kv_table_t *a = NULL, *b = NULL;
        CHECK_EQ_INT(kv_table_create(&c, &a), KV_OK);
        CHECK_EQ_INT(kv_table_create(&c, &b), KV_OK);
        uint64_t rng = 7 + admit;
        for (int round = 1; round <= ROUNDS; round++) {
            /* half the rounds: distinct keys (one source); else duplicates (several) */
            int distinct = round % 2;
            for (int i = 0; i < N; i++)
                keys[i] = distinct ? key_of((uint64_t)(round * 7919 + i) % 1500)
                                   : key_of(test_rand(&rng) % 900);
            for (int i = 0; i < N * dim; i++) g[i] = (float)(test_rand(&rng) % 1000) * 1e-3f - 0.5f;
            CHECK_EQ_INT(kv_table_find_or_create(a, keys, N, out, (uint32_t)round, NULL, NULL), KV_OK);
            CHECK_EQ_INT(kv_table_find_or_create_ref(b, keys, N, out, (uint32_t)round, NULL, ref), KV_OK);
            if (round == 5) { /* stale: rows freed in between */
                CHECK_EQ_INT(kv_table_delete(a, keys, 10, NULL), KV_OK);
                CHECK_EQ_INT(kv_table_delete(b, keys, 10, NULL), KV_OK);
            }
            if (round == 7 && ref[3] && ref[4]) ref[3] = ref[4]; /* a ref that lies */
            int64_t ma = -1, mb = -2;
            CHECK_EQ_INT(kv_table_apply_gradients(a, keys, N, g, round, KV_APPLY_CREATE_MISSING, &ma),
                         KV_OK);
            CHECK_EQ_INT(kv_table_apply_gradients_ref(b, keys, ref, N, g, round,
                                                      KV_APPLY_CREATE_MISSING |
                                                          (distinct ? KV_APPLY_DISTINCT : 0),
                                                      &mb),
                         KV_OK);
            CHECK_EQ_INT(ma, mb);
        }
        snap_t sa = snapshot(a), sb = snapshot(b);
        CHECK(snap_equal(&sa, &sb));
        CHECK_EQ_INT(sa.st.dropped_grads, sb.st.dropped_grads);
        CHECK(admit == 0 || sb.st.dropped_grads > 0);
        snap_free(&sa);
        snap_free(&sb);
        /* bad input changes nothing */
        CHECK_EQ_INT(kv_table_find_or_create_ref(b, keys, N, out, 99, NULL, ref), KV_OK);
        snap_t s0 = snapshot(b);
        g[7] = NAN;
        CHECK_EQ_INT(kv_table_apply_gradients_ref(b, keys, ref, N, g, 3, 0, NULL), KV_ENONFINITE);
        g[7] = 0.0f;
        CHECK_EQ_INT(kv_table_apply_gradients_ref(b, keys, NULL, N, g, 3, 0, NULL), KV_EINVAL);
        CHECK_EQ_INT(kv_table_apply_gradients_ref(b, keys, ref, N, g, 0, 0, NULL), KV_EINVAL);
        CHECK_EQ_INT(kv_table_apply_gradients_ref(b, keys, ref, N, g, 3, 8, NULL), KV_EINVAL);
        CHECK_EQ_INT(kv_table_find_or_create_ref(b, keys, N, out, 3, NULL, NULL), KV_EINVAL);
        snap_t s1 = snapshot(b);
        CHECK(snap_equal(&s0, &s1));
        snap_free(&s1);
        /* a failing allocation (the duplicate-summing pass) changes nothing either */
        fail_alloc_install();
        int done = 0;
        for (long k = 1; k <= 20 && !done; k++) {
            fail_alloc_arm(k);
            int rc = kv_table_apply_gradients_ref(b, keys, ref, N, g, 3, 0, NULL);
            fail_alloc_arm(0);
            if (rc == KV_OK) {
                done = 1;
            } else {
                CHECK_EQ_INT(rc, KV_ENOMEM);
                s1 = snapshot(b);
                CHECK(snap_equal(&s0, &s1));
                snap_free(&s1);
            }
        }
        kv_set_allocator(NULL, NULL, NULL);
        CHECK(done);
        snap_free(&s0);
        kv_table_destroy(a);
        kv_table_destroy(b);
    }
    free(keys);
    free(out);
    free(g);
    free(ref);
}

/* Updates that would leave a row or a slot NaN/Inf from finite gradients (1e30:
 * Adagrad's and FTRL's accumulators, Adam's second moment overflow; SGD past FLT_MAX)
 * are refused whole by every apply path, and kv_table_check_update names the key. A
 * prepare changes nothing and names the same key; a good prepare + commit equals
 * kv_table_apply_refs. */
static void test_nonfinite_updates(void) {
    enum { N = 64, D = 4 };
    static const int32_t kinds[] = {KV_OPT_SGD,  KV_OPT_ADAGRAD,    KV_OPT_ADAM,
                                    KV_OPT_FTRL, KV_OPT_GROUP_ADAM, KV_OPT_GROUP_ADAGRAD};
    for (size_t k = 0; k < sizeof kinds / sizeof kinds[0]; k++) {
        kv_table_config_t c = config(D, KV_INIT_UNIFORM, -0.1f, 0.1f);
        memset(&c.optim, 0, sizeof c.optim);
        c.optim.kind = kinds[k];
        c.optim.lr = kinds[k] == KV_OPT_SGD ? 10.0f : 0.1f;
        c.optim.beta1 = 0.9f;
        c.optim.beta2 = 0.999f;
        c.optim.epsilon = 1e-7f;
        c.optim.initial_accumulator = 0.1f;
        c.optim.lr_power = -0.5f;
        c.optim.l1 = 0.001f;
        c.optim.l21 = 0.001f;
        if (kv_optim_check(&c.optim) != KV_OK) continue; /* the SGD stub build */
        kv_table_t *t;
        CHECK_EQ_INT(kv_table_create(&c, &t), KV_OK);
        int64_t keys[N];
        float rows[N * D], g[N * D];
        uint32_t ref[N];
        uint64_t gen;
        for (int i = 0; i < N; i++) keys[i] = key_of((uint64_t)i + 1);
        CHECK_EQ_INT(kv_table_find_or_create_gen(t, keys, N, rows, 1, NULL, ref, &gen), KV_OK);
        if (kinds[k] == KV_OPT_SGD) { /* a row near FLT_MAX: w - 10 * g overflows */
            float big[D] = {3e38f, 3e38f, 3e38f, 3e38f};
            CHECK_EQ_INT(kv_table_update(t, &keys[17], 1, big), KV_OK);
        }
        for (int i = 0; i < N * D; i++) g[i] = 0.01f * (float)(i % 7 - 3);
        g[17 * D + 2] = kinds[k] == KV_OPT_SGD ? -1e38f : 1e30f;
        snap_t before = snapshot(t);
        int64_t miss = -1, bad = -2, bkey = 0;
        int32_t what = -1;
        static float out[N * (4 * D + 1)]; /* the widest row: Group Adam */
        uint32_t ids[N];
        uint64_t pgen;
        /* the check names the key and what */
        CHECK_EQ_INT(kv_table_check_update(t, keys, N, g, 2, 0, &bkey, &what), KV_OK);
        int refused = what != 0;
        if (kinds[k] == KV_OPT_SGD || kinds[k] == KV_OPT_ADAGRAD || kinds[k] == KV_OPT_ADAM ||
            kinds[k] == KV_OPT_FTRL)
            CHECK(refused);
        if (refused) {
            CHECK_EQ_INT(what, 2);
            CHECK_EQ_INT(bkey, keys[17]);
            CHECK_EQ_INT(kv_table_apply_gradients(t, keys, N, g, 2, 0, &miss), KV_ENONFINITE);
            CHECK_EQ_INT(kv_table_apply_gradients(t, keys, N, g, 2, KV_APPLY_CREATE_MISSING, &miss),
                         KV_ENONFINITE);
            CHECK_EQ_INT(kv_table_apply_gradients_ref(t, keys, ref, N, g, 2, 0, &miss),
                         KV_ENONFINITE);
            CHECK_EQ_INT(kv_table_apply_gradients_ref(t, keys, ref, N, g, 2, KV_APPLY_DISTINCT,
                                                      &miss), KV_ENONFINITE);
            CHECK_EQ_INT(kv_table_apply_refs(t, keys, ref, N, g, 2, gen, &miss), KV_ENONFINITE);
            CHECK_EQ_INT(kv_table_prepare_refs(t, keys, ref, N, g, 2, gen, out, ids, &pgen, &bad),
                         KV_ENONFINITE);
            CHECK_EQ_INT(bad, 17);
            snap_t after = snapshot(t);
            CHECK(snap_equal(&before, &after));
            snap_free(&after);
        }
        /* a NaN or an Inf gradient makes its row's update NaN/Inf under every rule:
         * the prepare names it without looking at the gradients apart */
        g[17 * D + 2] = 0.0f;
        static const float odd[] = {NAN, INFINITY, -INFINITY};
        for (int k2 = 0; k2 < 3; k2++) {
            g[23 * D + 1] = odd[k2];
            CHECK_EQ_INT(kv_table_prepare_refs(t, keys, ref, N, g, 2, gen, out, ids, &pgen,
                                               &bad), KV_ENONFINITE);
            CHECK_EQ_INT(bad, 23);
        }
        g[23 * D + 1] = 0.0f;
        /* without the bad key: applied, every row and slot finite */
        CHECK_EQ_INT(kv_table_prepare_refs(t, keys, ref, N, g, 2, gen, out, ids, &pgen, &bad),
                     KV_OK);
        CHECK_EQ_INT(bad, -1);
        snap_t mid = snapshot(t);
        CHECK(snap_equal(&before, &mid)); /* a prepare changes nothing */
        snap_free(&mid);
        kv_table_t *twin;
        CHECK_EQ_INT(kv_table_create(&c, &twin), KV_OK);
        CHECK_EQ_INT(kv_table_import(twin, before.keys, before.n, before.values, before.slots,
                                     before.steps, before.counts), KV_OK);
        CHECK_EQ_INT(kv_table_commit_refs(t, NULL, keys, ids, N, out, 2, pgen, &miss), KV_OK);
        CHECK_EQ_INT(miss, 0);
        CHECK_EQ_INT(kv_table_apply_gradients(twin, keys, N, g, 2, 0, &miss), KV_OK);
        snap_t a = snapshot(t), b = snapshot(twin);
        int same = a.n == b.n;
        for (int64_t i = 0; same && i < a.n; i++) { /* twin's arena order: by import */
            int64_t j = 0;
            while (j < b.n && b.keys[j] != a.keys[i]) j++;
            same = j < b.n && !memcmp(a.values + i * D, b.values + j * D, D * 4) &&
                   !memcmp(a.slots + i * a.s, b.slots + j * b.s, (size_t)a.s * 4) &&
                   a.steps[i] == b.steps[j] && a.counts[i] == b.counts[j] && a.dirty[i];
        }
        CHECK(same);
        CHECK(kv_all_finite_test(a.values, (size_t)(a.n * D)));
        CHECK(kv_all_finite_test(a.slots, (size_t)(a.n * a.s)));
        snap_free(&a);
        snap_free(&b);
        snap_free(&before);
        kv_table_destroy(twin);
        /* a new key whose first update is not finite is not created */
        if (refused) {
            int64_t nk = key_of(9999);
            float hg[D] = {0, 1e30f, 0, 0};
            int64_t size0 = kv_table_size(t);
            int rc = kv_table_apply_gradients(t, &nk, 1, hg, 3, KV_APPLY_CREATE_MISSING, &miss);
            if (kinds[k] != KV_OPT_SGD) { /* SGD: a new row - 10 * 1e30 is finite */
                CHECK_EQ_INT(rc, KV_ENONFINITE);
                CHECK_EQ_INT(kv_table_size(t), size0);
                CHECK_EQ_INT(kv_table_check_update(t, &nk, 1, hg, 3, KV_APPLY_CREATE_MISSING,
                                                   &bkey, &what), KV_OK);
                CHECK_EQ_INT(what, 2);
                CHECK_EQ_INT(bkey, nk);
            }
            /* duplicates whose sum overflows: named as the summed gradient */
            float dg[2 * D] = {3e38f, 0, 0, 0, 3e38f, 0, 0, 0};
            int64_t dk[2] = {keys[3], keys[3]};
            CHECK_EQ_INT(kv_table_apply_gradients(t, dk, 2, dg, 3, 0, &miss), KV_ENONFINITE);
            CHECK_EQ_INT(kv_table_check_update(t, dk, 2, dg, 3, 0, &bkey, &what), KV_OK);
            CHECK_EQ_INT(what, 3);
            CHECK_EQ_INT(bkey, keys[3]);
            dg[5] = NAN; /* a NaN as given: named first */
            dk[1] = keys[4];
            CHECK_EQ_INT(kv_table_check_update(t, dk, 2, dg, 3, 0, &bkey, &what), KV_OK);
            CHECK_EQ_INT(what, 1);
            CHECK_EQ_INT(bkey, keys[4]);
        }
        kv_table_destroy(t);
    }
}

int main(int argc, char **argv) {
    pick_optim();
    if (argc > 1 && !strcmp(argv[1], "threads")) {
        test_threads();
        return test_summary();
    }
#ifdef KV_TEST_MAX_ROWS
    test_full();
    /* the other tests need more than KV_TEST_MAX_ROWS rows */
    (void)test_random_ops, (void)test_key_patterns, (void)test_free_list;
    (void)test_init_determinism, (void)test_apply_and_dirty, (void)test_export_import;
    (void)test_errors, (void)test_oom, (void)test_stats, (void)test_chunks;
    (void)test_admission, (void)test_evict_exact, (void)test_removed_log, (void)test_lifecycle_oom;
    (void)test_apply_ref, (void)test_init_normal_accuracy, (void)test_set_optim;
    (void)test_admission_once_per_step, (void)test_forget_new, (void)test_admission_state;
    (void)test_nonfinite_updates, (void)test_reserve;
    (void)test_reserve_prefault, (void)test_huge_advice;
#else
    test_random_ops();
    test_key_patterns();
    test_free_list();
    test_chunks();
    test_init_determinism();
    test_init_normal_accuracy();
    test_apply_and_dirty();
    test_set_optim();
    test_apply_ref();
    test_nonfinite_updates();
    test_export_import();
    test_errors();
    test_oom();
    test_stats();
    test_admission();
    test_admission_once_per_step();
    test_admission_state();
    test_forget_new();
    test_evict_exact();
    test_removed_log();
    test_lifecycle_oom();
    test_reserve();
    test_reserve_prefault();
    test_huge_advice();
    test_threads();
#endif
    return test_summary();
}
