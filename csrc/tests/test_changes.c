/*
 * test_changes.c - the publishing change tracker (kv_table_track_changes /
 * kv_table_take_changes) against mirrors.
 *
 * A table takes random batches of every kind of change (creating lookups, gradients,
 * assignments, imports, deletes, evictions, forget_new, clears). Two mirrors follow it:
 * the "published" one gets each take (removals, then rows; a full copy when a take
 * says it is incomplete), the "checkpointed" one each dirty-only export that clears
 * the dirty bits plus the removed-keys log (what incremental checkpoints read). The
 * two trackers are drained at different moments, and after every drain its mirror
 * must equal the table, key for key and bit for bit: neither tracker hides a change
 * from the other. Then the edge cases: buffers too small, tracking off, out of memory.
 */
#include <string.h>

#include "../kv_table.h"
#include "test_util.h"

#define DIM 4

static kv_table_config_t config(void) {
    kv_table_config_t c;
    memset(&c, 0, sizeof c);
    c.dim = DIM;
    c.init_kind = KV_INIT_UNIFORM;
    c.init_a = -1.0f;
    c.init_b = 1.0f;
    c.seed = 99;
    c.table_id = 5;
    c.optim.kind = KV_OPT_SGD;
    c.optim.lr = 0.5f;
    return c;
}

typedef struct {
    int64_t n;
    int64_t *keys;
    float *values;
} rows_t;

static int cmp_key(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

/* Every row of t, sorted by key (keys and values side by side in one record). */
static rows_t all_rows(kv_table_t *t) {
    rows_t r;
    int64_t cap = kv_table_size(t) + 1, cursor = 0, n = 0;
    int64_t *keys = malloc((size_t)cap * 8);
    float *values = malloc((size_t)cap * DIM * 4);
    kv_table_export(t, &cursor, cap, 0, keys, values, NULL, NULL, NULL, NULL, &n);
    /* sort records of (key, values) by key */
    size_t rec = 8 + DIM * 4;
    unsigned char *buf = malloc((size_t)(n ? n : 1) * rec);
    for (int64_t i = 0; i < n; i++) {
        memcpy(buf + (size_t)i * rec, &keys[i], 8);
        memcpy(buf + (size_t)i * rec + 8, values + i * DIM, DIM * 4);
    }
    qsort(buf, (size_t)n, rec, cmp_key);
    for (int64_t i = 0; i < n; i++) {
        memcpy(&keys[i], buf + (size_t)i * rec, 8);
        memcpy(values + i * DIM, buf + (size_t)i * rec + 8, DIM * 4);
    }
    free(buf);
    r.n = n;
    r.keys = keys;
    r.values = values;
    return r;
}

static int same_rows(kv_table_t *a, kv_table_t *b) {
    rows_t x = all_rows(a), y = all_rows(b);
    int same = x.n == y.n && !memcmp(x.keys, y.keys, (size_t)x.n * 8) &&
               !memcmp(x.values, y.values, (size_t)x.n * DIM * 4);
    free(x.keys);
    free(x.values);
    free(y.keys);
    free(y.values);
    return same;
}

/* mirror := t, wholly. */
static void copy_all(kv_table_t *t, kv_table_t *mirror) {
    rows_t x = all_rows(t);
    kv_table_clear(mirror);
    if (x.n) kv_table_update(mirror, x.keys, x.n, x.values);
    free(x.keys);
    free(x.values);
}

/* The publish take, applied to `pub`. Returns the rows it held (-1: incomplete). */
static int64_t publish(kv_table_t *t, kv_table_t *pub) {
    int64_t nr, ng;
    int32_t lost, complete = -1;
    CHECK(kv_table_changes_pending(t, &nr, &ng, &lost) == KV_OK);
    int64_t *keys = malloc((size_t)(nr + 1) * 8), *gone = malloc((size_t)(ng + 1) * 8);
    float *values = malloc((size_t)(nr + 1) * DIM * 4);
    int64_t n_rows = 0, n_gone = 0;
    CHECK(kv_table_take_changes(t, nr, keys, values, ng, gone, &n_rows, &n_gone, &complete) ==
          KV_OK);
    CHECK(n_rows >= 0 && n_gone >= 0); /* nothing changed t in between */
    CHECK(complete == !lost);
    if (complete) {
        CHECK(n_rows <= nr);
        if (n_gone) kv_table_delete(pub, gone, n_gone, NULL); /* removals first */
        if (n_rows) kv_table_update(pub, keys, n_rows, values);
    } else {
        copy_all(t, pub);
    }
    free(keys);
    free(gone);
    free(values);
    return complete ? n_rows : -1;
}

/* The incremental checkpoint's reads (dirty rows, removed keys), applied to `ck`. */
static void checkpoint(kv_table_t *t, kv_table_t *ck) {
    int64_t cap = kv_table_size(t) + 1, cursor = 0, n = 0;
    int64_t *keys = malloc((size_t)cap * 8);
    float *values = malloc((size_t)cap * DIM * 4);
    kv_table_stats_t st;
    kv_table_stats(t, &st);
    int64_t ng = st.removed_logged, got = 0;
    int64_t *gone = malloc((size_t)(ng + 1) * 8);
    CHECK(kv_table_take_removed(t, gone, ng + 1, &got) == KV_OK);
    CHECK(kv_table_export(t, &cursor, cap, KV_EXPORT_DIRTY_ONLY | KV_EXPORT_CLEAR_DIRTY, keys,
                          values, NULL, NULL, NULL, NULL, &n) == KV_OK);
    if (ck && got) kv_table_delete(ck, gone, got, NULL);
    if (ck && n) kv_table_update(ck, keys, n, values);
    free(keys);
    free(values);
    free(gone);
}

/* A random batch of changes to t. Imports are restores (their rows are clean for the
 * checkpoint tracker), so the checkpoint mirror ck (if given) gets them too. */
static void random_changes(kv_table_t *t, kv_table_t *ck, uint64_t *rng, uint32_t *step) {
    int64_t keys[64];
    float buf[64 * DIM];
    int64_t n = 1 + (int64_t)(test_rand(rng) % 64);
    for (int64_t i = 0; i < n; i++) keys[i] = (int64_t)(test_rand(rng) % 500) - 100;
    for (int64_t i = 0; i < n * DIM; i++) buf[i] = (float)(test_rand(rng) % 1000) / 100.0f - 5;
    int op = (int)(test_rand(rng) % 8);
    ++*step;
    switch (op) {
    case 0:
    case 1:
        kv_table_find_or_create(t, keys, n, buf, *step, NULL, NULL);
        break;
    case 2:
        kv_table_apply_gradients(t, keys, n, buf, *step, 0, NULL);
        break;
    case 3:
        kv_table_apply_gradients(t, keys, n, buf, *step, KV_APPLY_CREATE_MISSING, NULL);
        break;
    case 4:
        kv_table_update(t, keys, n, buf);
        break;
    case 5:
        /* (a key removed since the last checkpoint and imported clean would be lost by
         * the next checkpoint delta: restores clear first, so drain the log here) */
        if (ck) checkpoint(t, ck);
        kv_table_import(t, keys, n, buf, NULL, NULL, NULL);
        if (ck) kv_table_import(ck, keys, n, buf, NULL, NULL, NULL);
        break;
    case 6:
        kv_table_delete(t, keys, n / 2 + 1, NULL);
        break;
    case 7:
        if (test_rand(rng) % 2)
            kv_table_evict(t, *step > 20 ? *step - 20 : 0, -1, KV_EVICT_LRU, NULL);
        else
            kv_table_evict(t, 0, 150, KV_EVICT_LFU, NULL);
        break;
    }
    if (test_rand(rng) % 5 == 0) { /* a rejected step's new rows */
        kv_table_find_or_create(t, keys, n, buf, *step + 1000000, NULL, NULL);
        kv_table_forget_new(t, keys, n, *step + 1000000, NULL);
    }
}

static void test_mirrors(void) {
    kv_table_config_t c = config();
    kv_table_t *t, *pub, *ck;
    CHECK(kv_table_create(&c, &t) == KV_OK);
    CHECK(kv_table_create(&c, &pub) == KV_OK);
    CHECK(kv_table_create(&c, &ck) == KV_OK);
    uint64_t rng = 7;
    uint32_t step = 0;
    for (int i = 0; i < 50; i++) random_changes(t, NULL, &rng, &step);
    /* tracking from now: both mirrors start as the table is */
    CHECK(kv_table_track_changes(t, 1) == KV_OK);
    CHECK(kv_table_track_removed(t, 1) == KV_OK);
    copy_all(t, pub);
    copy_all(t, ck);
    int64_t cursor = 0, n = 0; /* and the dirty bits as of now */
    int64_t *k = malloc(1000 * 8);
    float *v = malloc(1000 * DIM * 4);
    kv_table_export(t, &cursor, 1000, KV_EXPORT_CLEAR_DIRTY, k, v, NULL, NULL, NULL, NULL, &n);
    free(k);
    free(v);
    int pub_ok = 1, ck_ok = 1, incomplete = 0, deltas = 0;
    for (int round = 0; round < 400; round++) {
        random_changes(t, ck, &rng, &step);
        if (round % 97 == 96) { /* a clear (a restore's first move): not logged key by key */
            kv_table_clear(t);
            random_changes(t, NULL, &rng, &step);
            copy_all(t, ck);
            checkpoint(t, NULL);
        }
        uint64_t r = test_rand(&rng) % 6;
        if (r == 0) {
            incomplete += publish(t, pub) < 0;
            deltas++;
            pub_ok &= same_rows(t, pub);
        } else if (r == 1) {
            checkpoint(t, ck);
            ck_ok &= same_rows(t, ck);
        } else if (r == 2) { /* both, in either order */
            if (test_rand(&rng) % 2) {
                checkpoint(t, ck);
                incomplete += publish(t, pub) < 0;
            } else {
                incomplete += publish(t, pub) < 0;
                checkpoint(t, ck);
            }
            deltas++;
            pub_ok &= same_rows(t, pub);
        }
    }
    CHECK(pub_ok);
    CHECK(ck_ok);
    CHECK(deltas > 50);
    CHECK(incomplete >= 1); /* the clears */
    CHECK(incomplete < deltas / 4);
    kv_table_destroy(t);
    kv_table_destroy(pub);
    kv_table_destroy(ck);
}

static void test_take_exact(void) {
    kv_table_config_t c = config();
    kv_table_t *t;
    CHECK(kv_table_create(&c, &t) == KV_OK);
    int64_t keys[4] = {1, 2, 3, 4}, out[8], gone[8], nr, ng;
    float vals[4 * DIM], ov[8 * DIM];
    for (int i = 0; i < 4 * DIM; i++) vals[i] = (float)i;
    int32_t complete, lost;
    /* off: take refuses, and changes are not tracked */
    CHECK(kv_table_take_changes(t, 8, out, ov, 8, gone, &nr, &ng, &complete) == KV_EINVAL);
    CHECK(kv_table_update(t, keys, 4, vals) == KV_OK);
    CHECK(kv_table_track_changes(t, 1) == KV_OK);
    CHECK(kv_table_take_changes(t, 8, out, ov, 8, gone, &nr, &ng, &complete) == KV_OK);
    CHECK_EQ_INT(nr, 0); /* what existed before tracking began counts as published */
    CHECK_EQ_INT(ng, 0);
    /* a row changed many times is listed once, with its last value */
    for (int j = 0; j < 5; j++) {
        vals[0] = (float)j;
        CHECK(kv_table_update(t, keys, 1, vals) == KV_OK);
    }
    CHECK(kv_table_delete(t, keys + 3, 1, NULL) == KV_OK);
    CHECK(kv_table_changes_pending(t, &nr, &ng, &lost) == KV_OK);
    CHECK_EQ_INT(nr, 1);
    CHECK_EQ_INT(ng, 1);
    CHECK_EQ_INT(lost, 0);
    /* buffers too small: nothing taken, the sizes needed */
    CHECK(kv_table_take_changes(t, 0, NULL, NULL, 8, gone, &nr, &ng, &complete) == KV_OK);
    CHECK_EQ_INT(nr, -2);
    CHECK_EQ_INT(ng, -2);
    CHECK(kv_table_take_changes(t, 8, out, ov, 8, gone, &nr, &ng, &complete) == KV_OK);
    CHECK_EQ_INT(nr, 1);
    CHECK_EQ_INT(out[0], 1);
    CHECK(ov[0] == 4.0f && ov[1] == 1.0f);
    CHECK_EQ_INT(ng, 1);
    CHECK_EQ_INT(gone[0], 4);
    CHECK_EQ_INT(complete, 1);
    CHECK(kv_table_take_changes(t, 8, out, ov, 8, gone, &nr, &ng, &complete) == KV_OK);
    CHECK(nr == 0 && ng == 0);
    /* the checkpoint's trackers still see everything: key 1 dirty, key 4 logged? (the
     * removed log is off here), and taking them does not touch the publish bits */
    int64_t cursor = 0, n = 0;
    CHECK(kv_table_export(t, &cursor, 8, KV_EXPORT_DIRTY_ONLY | KV_EXPORT_CLEAR_DIRTY, out, ov,
                          NULL, NULL, NULL, NULL, &n) == KV_OK);
    CHECK_EQ_INT(n, 3); /* keys 1..3 were written by update since the last export */
    CHECK(kv_table_update(t, keys + 1, 1, vals) == KV_OK);
    cursor = 0;
    CHECK(kv_table_export(t, &cursor, 8, KV_EXPORT_DIRTY_ONLY | KV_EXPORT_CLEAR_DIRTY, out, ov,
                          NULL, NULL, NULL, NULL, &n) == KV_OK);
    CHECK_EQ_INT(n, 1);
    CHECK(kv_table_take_changes(t, 8, out, ov, 8, gone, &nr, &ng, &complete) == KV_OK);
    CHECK(nr == 1 && out[0] == 2);
    /* a clear: the next take is incomplete, and the one after it complete again */
    CHECK(kv_table_clear(t) == KV_OK);
    CHECK(kv_table_update(t, keys, 2, vals) == KV_OK);
    CHECK(kv_table_changes_pending(t, &nr, &ng, &lost) == KV_OK);
    CHECK_EQ_INT(lost, 1);
    CHECK(kv_table_take_changes(t, 8, out, ov, 8, gone, &nr, &ng, &complete) == KV_OK);
    CHECK(complete == 0 && nr == 0 && ng == 0);
    CHECK(kv_table_update(t, keys, 1, vals) == KV_OK);
    CHECK(kv_table_take_changes(t, 8, out, ov, 8, gone, &nr, &ng, &complete) == KV_OK);
    CHECK(complete == 1 && nr == 1 && out[0] == 1);
    /* off frees the lists; stats count their memory while on */
    kv_table_stats_t a, b;
    kv_table_stats(t, &a);
    CHECK(kv_table_track_changes(t, 0) == KV_OK);
    kv_table_stats(t, &b);
    CHECK(b.bytes < a.bytes);
    kv_table_destroy(t);
}

static void test_oom(void) {
    kv_table_config_t c = config();
    kv_table_t *t;
    fail_alloc_install();
    CHECK(kv_table_create(&c, &t) == KV_OK);
    CHECK(kv_table_track_changes(t, 1) == KV_OK);
    int64_t keys[200];
    float vals[200 * DIM];
    for (int i = 0; i < 200; i++) keys[i] = i;
    for (int i = 0; i < 200 * DIM; i++) vals[i] = 1.0f;
    /* every allocation of a creating update, in turn: either the call fails and nothing
     * changed, or it succeeds and the take is complete or says it is not */
    int lost_seen = 0;
    for (long k = 1; k < 30; k++) {
        int64_t more[200];
        for (int i = 0; i < 200; i++) more[i] = 1000 * k + i;
        int64_t before = kv_table_size(t);
        fail_alloc_arm(k);
        int rc = kv_table_update(t, more, 200, vals);
        fail_alloc_arm(0);
        if (rc != KV_OK) {
            CHECK(rc == KV_ENOMEM);
            CHECK_EQ_INT(kv_table_size(t), before);
            continue;
        }
        int64_t nr, ng, out_n, gone_n;
        int32_t lost, complete;
        kv_table_changes_pending(t, &nr, &ng, &lost);
        int64_t *out = malloc((size_t)(nr + 1) * 8);
        float *ov = malloc((size_t)(nr + 1) * DIM * 4);
        CHECK(kv_table_take_changes(t, nr, out, ov, 0, NULL, &out_n, &gone_n, &complete) ==
              KV_OK);
        CHECK(complete ? out_n == 200 : out_n == 0);
        lost_seen += !complete;
        free(out);
        free(ov);
    }
    CHECK(lost_seen >= 1); /* the list's growth failed at least once */
    /* a removal whose publish log cannot grow: KV_ENOMEM, nothing removed */
    CHECK(kv_table_update(t, keys, 200, vals) == KV_OK);
    int64_t nr, ng, out_n, gone_n;
    int32_t complete;
    int64_t *out = malloc(100000 * 8);
    float *ov = malloc(100000 * DIM * 4);
    CHECK(kv_table_take_changes(t, 100000, out, ov, 0, NULL, &out_n, &gone_n, &complete) == KV_OK);
    int64_t before = kv_table_size(t);
    fail_alloc_arm(1);
    int rc = kv_table_delete(t, keys, 200, NULL);
    fail_alloc_arm(0);
    CHECK(rc == KV_ENOMEM);
    CHECK_EQ_INT(kv_table_size(t), before);
    int32_t lost;
    kv_table_changes_pending(t, &nr, &ng, &lost);
    CHECK(nr == 0 && ng == 0 && lost == 0);
    CHECK(kv_table_delete(t, keys, 200, NULL) == KV_OK);
    kv_table_changes_pending(t, &nr, &ng, &lost);
    CHECK_EQ_INT(ng, 200);
    free(out);
    free(ov);
    kv_table_destroy(t);
    kv_set_allocator(NULL, NULL, NULL);
}

int main(void) {
    test_take_exact();
    test_mirrors();
    test_oom();
    return test_summary();
}
