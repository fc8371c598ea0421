/*
 * test_exchange.c - the exchange kernels (kv_exchange.h) against plain tables.
 *
 * One process plays `world` ranks: every rank has its own shards of NT tables and a
 * batch of ids per table (duplicates inside a rank and across ranks). The ids travel
 * as the all-to-alls would carry them (a helper concatenates each destination's
 * segments source by source), the owners serve and apply, and the result is compared
 * with reference tables that hold every key (one rank's view of the whole batch):
 *   - the rows a rank gets back at pos[] are the reference rows of its ids;
 *   - after the push, every owner's rows and optimizer slots equal the reference's,
 *     which applied the same scaled gradients with kv_table_apply_gradients (duplicates
 *     summed in the same order);
 *   - NaN gradients, bad arguments and failed allocations leave every table as it was
 *     (apply) or fail cleanly (plan, serve);
 *   - a row freed between serve and apply (generation change) is handled by key;
 *   - ids go to the owner a bucket -> rank map gives them (an uneven map of 60
 *     buckets: the modulo path; a bad map entry is refused);
 *   - kv_xrowgrad sums gather gradients per row exactly as a plain loop does, for
 *     narrow and wide rows, and refuses bad indices.
 */
#include <math.h>
#include <string.h>

#include "../kv_exchange.h"
#include "../kv_route.h"
#include "test_util.h"

#define NT 3
#define MAXW 4
#define B 400 /* ids per table per rank */

#define NB 60 /* buckets of the map (not a power of two: the modulo path) */

static const int32_t DIMS[NT] = {3, 5, 3};
static const int32_t GROUP[NT] = {0, 1, 0};

static kv_table_config_t config(int32_t t) {
    kv_table_config_t c;
    memset(&c, 0, sizeof c);
    c.dim = DIMS[t];
    c.init_kind = KV_INIT_NORMAL;
    c.init_a = 0.0f;
    c.init_b = 0.1f;
    c.seed = 9;
    c.table_id = 100 + (uint64_t)t;
    c.optim.kind = KV_OPT_ADAGRAD;
    c.optim.lr = 0.1f;
    c.optim.initial_accumulator = 0.1f;
    c.optim.epsilon = 1e-7f;
    return c;
}

typedef struct {
    int world;
    int32_t owners[NB]; /* bucket -> rank: uneven, not bucket % world */
    kv_table_t *shard[MAXW][NT], *ref[NT];
    int64_t ids[MAXW][NT][B];
    /* per rank: plan outputs */
    int64_t send[MAXW][NT * B], counts[MAXW][MAXW * NT], inverse[MAXW][NT * B];
    int64_t upos[MAXW][NT * B], pos[MAXW][NT * B], nu[MAXW][NT];
    /* per owner: what it received and its serve state */
    int64_t recv[MAXW][MAXW * NT * B], rcounts[MAXW][MAXW * NT];
    float reply[MAXW][MAXW * NT * B * 5];
    int64_t uidx[MAXW][MAXW * NT * B], ukeys[MAXW][MAXW * NT * B], ustart[MAXW][NT + 1];
    uint32_t urefs[MAXW][MAXW * NT * B];
    uint64_t gens[MAXW][NT];
} sim_t;

static sim_t S;

/* The pool every kernel call here uses: NULL, then pools of several threads; the
 * failing-allocator checks use none (their counter is not thread-safe). */
static kv_pool_t *G_POOL;

static int64_t seg_len(const int64_t *counts, int r, int t) { return counts[r * NT + t]; }

/* floats in segment (r, t) of a payload laid out by counts, and where it starts */
static int64_t seg_at(const int64_t *counts, int world, int r, int t, int floats) {
    int64_t a = 0;
    for (int rr = 0; rr < world; rr++)
        for (int tt = 0; tt < NT; tt++) {
            if (rr == r && tt == t) return a;
            a += counts[rr * NT + tt] * (floats ? DIMS[tt] : 1);
        }
    return a;
}

static void make_tables(int world) {
    S.world = world;
    for (int b = 0; b < NB; b++) S.owners[b] = (b * 7 + b / 5) % world;
    for (int t = 0; t < NT; t++) {
        kv_table_config_t c = config(t);
        CHECK_EQ_INT(kv_table_create(&c, &S.ref[t]), KV_OK);
        for (int r = 0; r < world; r++) CHECK_EQ_INT(kv_table_create(&c, &S.shard[r][t]), KV_OK);
    }
}

static void free_tables(void) {
    for (int t = 0; t < NT; t++) {
        kv_table_destroy(S.ref[t]);
        for (int r = 0; r < S.world; r++) kv_table_destroy(S.shard[r][t]);
    }
}

static void make_ids(uint64_t seed, int universe) {
    for (int r = 0; r < S.world; r++)
        for (int t = 0; t < NT; t++)
            for (int i = 0; i < B; i++)
                S.ids[r][t][i] = (int64_t)(test_rand(&seed) % (uint64_t)universe) * 7919 - 5000;
}

/* plan on every rank, then deliver ids: owner o gets segment (o, t) of every source */
static int plan_and_route(void) {
    int w = S.world;
    for (int r = 0; r < w; r++) {
        const int64_t *ptrs[NT];
        int64_t n[NT];
        for (int t = 0; t < NT; t++) {
            ptrs[t] = S.ids[r][t];
            n[t] = B;
        }
        int rc = kv_xplan(G_POOL, NT, S.owners, NB, w, ptrs, n, GROUP, S.send[r], S.counts[r],
                          S.inverse[r], S.upos[r], S.pos[r], S.nu[r]);
        if (rc != KV_OK) return rc;
    }
    for (int o = 0; o < w; o++) {
        int64_t at = 0;
        for (int s = 0; s < w; s++)
            for (int t = 0; t < NT; t++) {
                int64_t c = seg_len(S.counts[s], o, t);
                memcpy(S.recv[o] + at, S.send[s] + seg_at(S.counts[s], w, o, t, 0),
                       (size_t)c * sizeof(int64_t));
                S.rcounts[o][s * NT + t] = c;
                at += c;
            }
    }
    return KV_OK;
}

static int serve_all(uint32_t step) {
    for (int o = 0; o < S.world; o++) {
        int rc = kv_xserve(G_POOL, S.shard[o], NT, S.world, S.recv[o], S.rcounts[o], step, 1,
                           S.reply[o], S.uidx[o], S.ukeys[o], S.urefs[o], S.ustart[o], S.gens[o]);
        if (rc != KV_OK) return rc;
    }
    return KV_OK;
}

/* the rows rank r gets back: group matrices built from the owners' replies */
static void rows_of(int r, float *g0, float *g1) {
    int w = S.world;
    int64_t at[2] = {0, 0};
    for (int o = 0; o < w; o++)
        for (int t = 0; t < NT; t++) {
            int64_t c = S.rcounts[o][r * NT + t], d = DIMS[t];
            const float *src = S.reply[o] + seg_at(S.rcounts[o], w, r, t, 1);
            float *dst = (GROUP[t] ? g1 : g0) + at[GROUP[t]];
            memcpy(dst, src, (size_t)(c * d) * sizeof(float));
            at[GROUP[t]] += c * d;
        }
}

static float grad_of(int r, int t, int64_t key, int e) { /* deterministic, per rank */
    uint64_t s = (uint64_t)key * 31 + (uint64_t)r * 1000003 + (uint64_t)t * 17 + (uint64_t)e;
    return (float)((int64_t)(test_rand(&s) % 2001) - 1000) * 1e-3f;
}

/* Rank r's gradient payload for owner o: segment (o, t) of its plan, its unique ids'
 * gradients. Returns the concatenation owner o receives (source after source). */
static void grads_for(int o, float *out) {
    int w = S.world;
    int64_t at = 0;
    for (int s = 0; s < w; s++)
        for (int t = 0; t < NT; t++) {
            int64_t c = seg_len(S.counts[s], o, t);
            const int64_t *keys = S.send[s] + seg_at(S.counts[s], w, o, t, 0);
            for (int64_t j = 0; j < c; j++)
                for (int e = 0; e < DIMS[t]; e++) out[at++] = grad_of(s, t, keys[j], e);
        }
}

/* Every row (values and optimizer slots) of the union of parts equals a's row of that
 * key, and they hold as many keys. */
static int same_tables(kv_table_t *a, kv_table_t *const *parts, int nparts) {
    enum { CAP = MAXW * B * 4 };
    static int64_t ak[CAP], pk[CAP];
    static float av[CAP * 5], as[CAP * 5], pv[CAP * 5], ps[CAP * 5];
    int32_t d = kv_table_dim(a);
    int64_t cur = 0, na = 0, np = 0, n = 0;
    if (kv_table_size(a) > CAP) return 0;
    kv_table_export(a, &cur, CAP, 0, ak, av, as, NULL, NULL, NULL, &na);
    for (int p = 0; p < nparts; p++) {
        cur = 0;
        if (np + kv_table_size(parts[p]) > CAP) return 0;
        kv_table_export(parts[p], &cur, CAP - np, 0, pk + np, pv + np * d, ps + np * d, NULL, NULL,
                        NULL, &n);
        np += n;
    }
    if (na != np) return 0;
    for (int64_t i = 0; i < np; i++) {
        int64_t j = 0;
        while (j < na && ak[j] != pk[i]) j++;
        if (j == na || memcmp(av + j * d, pv + i * d, (size_t)d * sizeof(float)) ||
            memcmp(as + j * d, ps + i * d, (size_t)d * sizeof(float)))
            return 0;
    }
    return 1;
}

static void test_round_trip(int world, int universe) {
    make_tables(world);
    for (int step = 1; step <= 3; step++) {
        make_ids((uint64_t)(world * 100 + step), universe);
        CHECK_EQ_INT(plan_and_route(), KV_OK);
        CHECK_EQ_INT(serve_all((uint32_t)step), KV_OK);
        /* reference: every key of every rank, created in any order (values depend on
         * the key alone) */
        for (int r = 0; r < world; r++)
            for (int t = 0; t < NT; t++) {
                float tmp[B * 5];
                kv_table_find_or_create(S.ref[t], S.ids[r][t], B, tmp, (uint32_t)step, NULL, NULL);
            }
        /* each rank reads its ids' reference rows at pos */
        for (int r = 0; r < world; r++) {
            static float g0[MAXW * NT * B * 5], g1[MAXW * NT * B * 5];
            rows_of(r, g0, g1);
            int ok = 1;
            int64_t off = 0;
            for (int t = 0; t < NT; t++) {
                float want[5];
                for (int i = 0; i < B; i++) {
                    kv_table_find(S.ref[t], &S.ids[r][t][i], 1, want, NULL, NULL);
                    const float *got = (GROUP[t] ? g1 : g0) + S.pos[r][off + i] * DIMS[t];
                    ok &= !memcmp(got, want, (size_t)DIMS[t] * sizeof(float));
                    /* inverse and upos agree with pos */
                    int64_t a = 0;
                    for (int tt = 0; tt < t; tt++) a += S.nu[r][tt];
                    ok &= S.upos[r][a + S.inverse[r][off + i]] == S.pos[r][off + i];
                }
                off += B;
            }
            CHECK(ok);
        }
        /* push: scaled gradients, summed over sources in rank order */
        const float scale = 0.25f;
        for (int o = 0; o < world; o++) {
            static float g[MAXW * NT * B * 5];
            grads_for(o, g);
            int64_t miss[NT];
            CHECK_EQ_INT(kv_xapply(G_POOL, S.shard[o], NT, world, S.rcounts[o], g, scale, step,
                                   S.uidx[o], S.ukeys[o], S.urefs[o], S.ustart[o], S.gens[o], miss),
                                   KV_OK);
            CHECK(miss[0] == 0 && miss[1] == 0 && miss[2] == 0);
        }
        for (int t = 0; t < NT; t++) { /* reference: all ranks' unique ids, rank order */
            static int64_t keys[MAXW * B];
            static float gs[MAXW * B * 5];
            int64_t n = 0;
            for (int r = 0; r < world; r++) {
                int64_t a = 0;
                for (int tt = 0; tt < t; tt++) a += S.nu[r][tt];
                /* rank r's unique ids of table t in send order (owner-grouped) */
                for (int o = 0; o < world; o++) {
                    int64_t c = seg_len(S.counts[r], o, t);
                    const int64_t *k = S.send[r] + seg_at(S.counts[r], world, o, t, 0);
                    for (int64_t j = 0; j < c; j++) {
                        keys[n] = k[j];
                        for (int e = 0; e < DIMS[t]; e++)
                            gs[n * DIMS[t] + e] = scale * grad_of(r, t, k[j], e);
                        n++;
                    }
                }
                (void)a;
            }
            /* the owner sums per id in source order; group the reference's input by
             * owner first so its first-appearance order matches per id (sums of one id
             * are in rank order either way) */
            CHECK_EQ_INT(kv_table_apply_gradients(S.ref[t], keys, n, gs, step, 0, NULL), KV_OK);
        }
        for (int t = 0; t < NT; t++) {
            kv_table_t *parts[MAXW];
            for (int r = 0; r < world; r++) parts[r] = S.shard[r][t];
            CHECK(same_tables(S.ref[t], parts, world));
        }
        /* every shard holds only keys the map gives its rank */
        int owned = 1;
        for (int r = 0; r < world; r++)
            for (int t = 0; t < NT; t++) {
                int64_t cur = 0, got = 0, keys[256];
                static float vals[256 * 5];
                do {
                    kv_table_export(S.shard[r][t], &cur, 256, 0, keys, vals, NULL, NULL, NULL,
                                    NULL, &got);
                    for (int64_t i = 0; i < got; i++)
                        owned &= S.owners[kv_bucket_of_hash(kv_mix64((uint64_t)keys[i]), NB)] == r;
                } while (got == 256);
            }
        CHECK(owned);
    }
    free_tables();
}

/* Snapshot of every shard's rows and slots (arena order) to prove "unchanged". */
static uint64_t digest(void) {
    uint64_t h = 1469598103934665603ULL;
    for (int r = 0; r < S.world; r++)
        for (int t = 0; t < NT; t++) {
            int64_t cur = 0, n = 0, keys[64];
            float v[64 * 5], sl[64 * 5];
            uint32_t st[64], cn[64];
            do {
                kv_table_export(S.shard[r][t], &cur, 64, 0, keys, v, sl, st, cn, NULL, &n);
                const unsigned char *p[5] = {(void *)keys, (void *)v, (void *)sl, (void *)st,
                                             (void *)cn};
                size_t len[5] = {(size_t)n * 8, (size_t)n * (size_t)DIMS[t] * 4,
                                 (size_t)n * (size_t)DIMS[t] * 4, (size_t)n * 4, (size_t)n * 4};
                for (int q = 0; q < 5; q++)
                    for (size_t i = 0; i < len[q]; i++) h = (h ^ p[q][i]) * 1099511628211ULL;
            } while (n == 64);
        }
    return h;
}

static void test_errors(void) {
    make_tables(2);
    make_ids(5, 300);
    CHECK_EQ_INT(plan_and_route(), KV_OK);
    CHECK_EQ_INT(serve_all(1), KV_OK);
    static float g[MAXW * NT * B * 5];
    grads_for(0, g);
    uint64_t before = digest();
    /* NaN in the last table: nothing changes anywhere */
    int64_t tot = 0;
    for (int k = 0; k < 2 * NT; k++) tot += S.rcounts[0][k] * DIMS[k % NT];
    float keep = g[tot - 1];
    g[tot - 1] = NAN;
    CHECK_EQ_INT(kv_xapply(G_POOL, S.shard[0], NT, 2, S.rcounts[0], g, 1.0f, 1, S.uidx[0],
                           S.ukeys[0], S.urefs[0], S.ustart[0], S.gens[0], NULL), KV_ENONFINITE);
    g[tot - 1] = keep;
    CHECK_EQ_INT(kv_xapply(G_POOL, S.shard[0], NT, 2, S.rcounts[0], g, INFINITY, 1, S.uidx[0],
                           S.ukeys[0], S.urefs[0], S.ustart[0], S.gens[0], NULL), KV_EINVAL);
    CHECK_EQ_INT(kv_xapply(G_POOL, S.shard[0], NT, 2, S.rcounts[0], g, 1.0f, 0, S.uidx[0],
                           S.ukeys[0], S.urefs[0], S.ustart[0], S.gens[0], NULL), KV_EINVAL);
    int64_t bad = S.uidx[0][0];
    S.uidx[0][0] = 1 << 30; /* an index past the table's distinct ids */
    CHECK_EQ_INT(kv_xapply(G_POOL, S.shard[0], NT, 2, S.rcounts[0], g, 1.0f, 1, S.uidx[0],
                           S.ukeys[0], S.urefs[0], S.ustart[0], S.gens[0], NULL), KV_EINVAL);
    S.uidx[0][0] = bad;
    CHECK(digest() == before);
    /* failed allocations: apply fails cleanly and changes nothing (one thread: the
     * failing allocator's counter is not thread-safe) */
    kv_pool_t *keep_pool = G_POOL;
    G_POOL = NULL;
    fail_alloc_install();
    for (int k = 1; k <= 16; k++) {
        fail_alloc_arm(k);
        int rc = kv_xapply(G_POOL, S.shard[0], NT, 2, S.rcounts[0], g, 1.0f, 1, S.uidx[0],
                           S.ukeys[0], S.urefs[0], S.ustart[0], S.gens[0], NULL);
        fail_alloc_arm(0);
        if (rc == KV_OK) break; /* k passed the last allocation: it applied */
        CHECK_EQ_INT(rc, KV_ENOMEM);
        CHECK(digest() == before);
    }
    kv_set_allocator(NULL, NULL, NULL);
    /* plan and serve with failing allocations: clean errors, no leak (ASan) */
    fail_alloc_install();
    for (int k = 1; k <= 12; k++) {
        fail_alloc_arm(k);
        int rc = plan_and_route();
        if (rc == KV_OK) rc = serve_all(2);
        fail_alloc_arm(0);
        CHECK(rc == KV_OK || rc == KV_ENOMEM);
    }
    kv_set_allocator(NULL, NULL, NULL);
    G_POOL = keep_pool;
    /* arguments */
    const int64_t *ptrs[NT] = {S.ids[0][0], S.ids[0][1], S.ids[0][2]};
    int64_t n[NT] = {B, B, B}, nbad[NT] = {B, -1, B};
    int32_t gbad[NT] = {0, 3, 0};
    int32_t map[NB] = {0}, badmap[NB] = {0};
    for (int b = 0; b < NB; b++) map[b] = b % 2;
    badmap[NB - 1] = 2; /* a rank outside a world of 2 */
    CHECK_EQ_INT(kv_xplan(G_POOL, NT, map, NB, 0, ptrs, n, GROUP, S.send[0], S.counts[0],
                          S.inverse[0], S.upos[0], S.pos[0], S.nu[0]), KV_EINVAL);
    CHECK_EQ_INT(kv_xplan(G_POOL, NT, map, 0, 2, ptrs, n, GROUP, S.send[0], S.counts[0],
                          S.inverse[0], S.upos[0], S.pos[0], S.nu[0]), KV_EINVAL);
    CHECK_EQ_INT(kv_xplan(G_POOL, NT, NULL, NB, 2, ptrs, n, GROUP, S.send[0], S.counts[0],
                          S.inverse[0], S.upos[0], S.pos[0], S.nu[0]), KV_EINVAL);
    CHECK_EQ_INT(kv_xplan(G_POOL, NT, map, NB, 2, ptrs, nbad, GROUP, S.send[0], S.counts[0],
                          S.inverse[0], S.upos[0], S.pos[0], S.nu[0]), KV_EINVAL);
    CHECK_EQ_INT(kv_xplan(G_POOL, NT, map, NB, 2, ptrs, n, gbad, S.send[0], S.counts[0],
                          S.inverse[0], S.upos[0], S.pos[0], S.nu[0]), KV_EINVAL);
    int hit = 0; /* some id of the batch must fall in the bad bucket for the check to bite */
    for (int t = 0; t < NT; t++)
        for (int i = 0; i < B; i++)
            hit |= kv_bucket_of_hash(kv_mix64((uint64_t)S.ids[0][t][i]), NB) == NB - 1;
    CHECK(hit);
    CHECK_EQ_INT(kv_xplan(G_POOL, NT, badmap, NB, 2, ptrs, n, GROUP, S.send[0], S.counts[0],
                          S.inverse[0], S.upos[0], S.pos[0], S.nu[0]), KV_EINVAL);
    CHECK_EQ_INT(kv_xplan(G_POOL, NT, NULL, NB, 1, ptrs, n, GROUP, S.send[0], S.counts[0],
                          S.inverse[0], S.upos[0], S.pos[0], S.nu[0]),
                          KV_OK); /* world 1: no map needed */ int64_t negc[2 * NT] = {1, -1, 0, 0,
                          0, 0};
    CHECK_EQ_INT(kv_xserve(G_POOL, S.shard[0], NT, 2, S.recv[0], negc, 1, 1, S.reply[0], S.uidx[0],
                           S.ukeys[0], S.urefs[0], S.ustart[0], S.gens[0]), KV_EINVAL);
    CHECK_EQ_INT(kv_xserve(G_POOL, S.shard[0], NT, 2, S.recv[0], S.rcounts[0], 1, 1, S.reply[0],
                           NULL, S.ukeys[0], S.urefs[0], S.ustart[0], S.gens[0]), KV_EINVAL);
    free_tables();
}

/* A row freed between serve and apply: the table goes by key, with the same result as
 * a reference that had the row freed too: the freed key's gradient is dropped (counted
 * missing; it is not created again), every other key's is applied. */
static void test_generation(void) {
    make_tables(1);
    make_ids(11, 200);
    CHECK_EQ_INT(plan_and_route(), KV_OK);
    CHECK_EQ_INT(serve_all(1), KV_OK);
    for (int t = 0; t < NT; t++) {
        float tmp[B * 5];
        kv_table_find_or_create(S.ref[t], S.ids[0][t], B, tmp, 1, NULL, NULL);
    }
    int64_t victim = S.ukeys[0][0], nd = 0;
    uint64_t g0 = S.gens[0][0];
    CHECK_EQ_INT(kv_table_delete(S.shard[0][0], &victim, 1, &nd), KV_OK);
    CHECK_EQ_INT(nd, 1);
    CHECK_EQ_INT(kv_table_delete(S.ref[0], &victim, 1, &nd), KV_OK);
    static float g[NT * B * 5];
    grads_for(0, g);
    int64_t missing[NT];
    CHECK_EQ_INT(kv_xapply(G_POOL, S.shard[0], NT, 1, S.rcounts[0], g, 1.0f, 1, S.uidx[0],
                           S.ukeys[0], S.urefs[0], S.ustart[0], S.gens[0], missing), KV_OK);
    CHECK_EQ_INT(missing[0], 1);
    for (int t = 0; t < NT; t++) { /* world 1: the sender's unique ids are the payload */
        int64_t c = S.rcounts[0][t], a = seg_at(S.rcounts[0], 1, 0, t, 0);
        int64_t fa = seg_at(S.rcounts[0], 1, 0, t, 1);
        CHECK_EQ_INT(kv_table_apply_gradients(S.ref[t], S.recv[0] + a, c, g + fa, 1, 0, NULL),
                     KV_OK);
        CHECK(same_tables(S.ref[t], &S.shard[0][t], 1));
        if (t) CHECK_EQ_INT(missing[t], 0);
    }
    uint64_t g1;
    float row[3];
    uint32_t ref;
    CHECK_EQ_INT(kv_table_find_or_create_gen(S.shard[0][0], &victim, 1, row, 2, NULL, &ref, &g1),
                 KV_OK);
    CHECK(g1 != g0);
    free_tables();
}

/* Finite gradients whose update is not finite (Adagrad's g^2 overflows at 1e30): the
 * prepare names the first (table, key) and changes nothing, and so does kv_xapply;
 * a scaled gradient that overflows is named as a gradient; a good prepare changes
 * nothing until its commit, which equals kv_xapply on twin tables. */
static void test_nonfinite(void) {
    make_tables(2);
    make_ids(21, 300);
    CHECK_EQ_INT(plan_and_route(), KV_OK);
    CHECK_EQ_INT(serve_all(1), KV_OK);
    static float g[MAXW * NT * B * 5];
    grads_for(0, g);
    uint64_t before = digest();
    const int64_t *rc0 = S.rcounts[0];
    int64_t nf = kv_xprepare_floats(S.shard[0], NT, S.ustart[0]);
    int64_t want_nf = 0;
    for (int t = 0; t < NT; t++)
        want_nf += (S.ustart[0][t + 1] - S.ustart[0][t]) * (2 * DIMS[t]); /* Adagrad: dim slots */
    CHECK_EQ_INT(nf, want_nf);
    static float rows[MAXW * NT * B * 10];
    static uint32_t ids[MAXW * NT * B];
    uint64_t pg[NT];
    int64_t bad[3];
    /* the first id table 2 received from rank 1: a huge gradient */
    int64_t j1 = seg_at(rc0, 2, 1, 2, 0), f1 = seg_at(rc0, 2, 1, 2, 1);
    CHECK(rc0[1 * NT + 2] > 0);
    float keep[5];
    memcpy(keep, g + f1, 3 * sizeof(float));
    g[f1 + 1] = 1e30f;
    int64_t key = S.ukeys[0][S.ustart[0][2] + S.uidx[0][j1]];
    CHECK_EQ_INT(kv_xprepare(G_POOL, S.shard[0], NT, 2, rc0, g, 1.0f, 1, S.uidx[0], S.ukeys[0],
                             S.urefs[0], S.ustart[0], S.gens[0], rows, ids, pg, bad),
                 KV_ENONFINITE);
    CHECK_EQ_INT(bad[0], 2);
    CHECK_EQ_INT(bad[1], key);
    CHECK_EQ_INT(bad[2], 2);
    CHECK(digest() == before);
    CHECK_EQ_INT(kv_xapply(G_POOL, S.shard[0], NT, 2, rc0, g, 1.0f, 1, S.uidx[0], S.ukeys[0],
                           S.urefs[0], S.ustart[0], S.gens[0], NULL), KV_ENONFINITE);
    CHECK(digest() == before);
    /* 1e30 scaled by 1e10 overflows: the summed gradient, named as such */
    g[f1 + 1] = 1e30f;
    CHECK_EQ_INT(kv_xprepare(G_POOL, S.shard[0], NT, 2, rc0, g, 1e10f, 1, S.uidx[0], S.ukeys[0],
                             S.urefs[0], S.ustart[0], S.gens[0], rows, ids, pg, bad),
                 KV_ENONFINITE);
    CHECK_EQ_INT(bad[0], 2);
    CHECK_EQ_INT(bad[1], key);
    CHECK_EQ_INT(bad[2], 3);
    /* a NaN as received: its table and key */
    g[f1 + 1] = NAN;
    CHECK_EQ_INT(kv_xprepare(G_POOL, S.shard[0], NT, 2, rc0, g, 1.0f, 1, S.uidx[0], S.ukeys[0],
                             S.urefs[0], S.ustart[0], S.gens[0], rows, ids, pg, bad),
                 KV_ENONFINITE);
    CHECK_EQ_INT(bad[0], 2);
    CHECK_EQ_INT(bad[1], key);
    CHECK_EQ_INT(bad[2], 1);
    CHECK(digest() == before);
    memcpy(g + f1, keep, 3 * sizeof(float));
    /* a good push: prepared (nothing changes), then committed; equals kv_xapply on twins */
    kv_table_t *twin[NT];
    for (int t = 0; t < NT; t++) {
        kv_table_config_t c = config(t);
        CHECK_EQ_INT(kv_table_create(&c, &twin[t]), KV_OK);
        int64_t cur = 0, n = 0, keys[B * 8];
        static float v[B * 8 * 5], sl[B * 8 * 5];
        uint32_t st[B * 8], cn[B * 8];
        kv_table_export(S.shard[0][t], &cur, B * 8, 0, keys, v, sl, st, cn, NULL, &n);
        CHECK(n < B * 8);
        CHECK_EQ_INT(kv_table_import(twin[t], keys, n, v, sl, st, cn), KV_OK);
    }
    CHECK_EQ_INT(kv_xprepare(G_POOL, S.shard[0], NT, 2, rc0, g, 0.5f, 3, S.uidx[0], S.ukeys[0],
                             S.urefs[0], S.ustart[0], S.gens[0], rows, ids, pg, bad),
                 KV_OK);
    CHECK_EQ_INT(bad[0], -1);
    CHECK(digest() == before);
    int64_t miss[NT];
    CHECK_EQ_INT(kv_xcommit(G_POOL, S.shard[0], NT, S.ukeys[0], S.ustart[0], ids, pg, rows, 3,
                            miss), KV_OK);
    CHECK(digest() != before);
    /* the twins' refs are by key (other tables: the serve's refs do not name their rows) */
    for (int t = 0; t < NT; t++) {
        int64_t us = S.ustart[0][t], nu = S.ustart[0][t + 1] - us;
        static float tmp[MAXW * B * 5];
        static uint32_t tref[MAXW * B];
        uint64_t tg;
        CHECK_EQ_INT(kv_table_find_or_create_gen(twin[t], S.ukeys[0] + us, nu, tmp, 1, NULL, tref,
                                                 &tg), KV_OK);
        for (int64_t u = 0; u < nu; u++) S.urefs[0][us + u] = tref[u];
        S.gens[0][t] = tg;
        CHECK_EQ_INT(miss[t], 0);
    }
    CHECK_EQ_INT(kv_xapply(G_POOL, twin, NT, 2, rc0, g, 0.5f, 3, S.uidx[0], S.ukeys[0], S.urefs[0],
                           S.ustart[0], S.gens[0], NULL), KV_OK);
    for (int t = 0; t < NT; t++) {
        CHECK(same_tables(twin[t], &S.shard[0][t], 1));
        kv_table_stats_t a, b;
        kv_table_stats(twin[t], &a);
        kv_table_stats(S.shard[0][t], &b);
        CHECK_EQ_INT(a.rows, b.rows);
        kv_table_destroy(twin[t]);
    }
    free_tables();
}

/* One pool or another, the same bits: plan, serve (from 1 and from 3 sources), prepare
 * and commit with no pool and with G_POOL give identical outputs and tables. */
static void test_pool_equivalence(void) {
    static sim_t one;
    static float rows1[MAXW * NT * B * 10];
    static uint32_t ids1[MAXW * NT * B];
    kv_pool_t *pool = G_POOL;
    for (int world = 1; world <= 3; world += 2) {
        uint64_t digests[2];
        for (int pass = 0; pass < 2; pass++) {
            G_POOL = pass ? pool : NULL;
            make_tables(world);
            for (int step = 1; step <= 2; step++) {
                make_ids((uint64_t)(77 + step), 700);
                CHECK_EQ_INT(plan_and_route(), KV_OK);
                CHECK_EQ_INT(serve_all((uint32_t)step), KV_OK);
                static float g[MAXW * NT * B * 5], rows[MAXW * NT * B * 10];
                static uint32_t ids[MAXW * NT * B];
                uint64_t pg[NT];
                int64_t bad[3];
                grads_for(0, g);
                CHECK_EQ_INT(kv_xprepare(G_POOL, S.shard[0], NT, world, S.rcounts[0], g, 0.5f,
                                         step, S.uidx[0], S.ukeys[0], S.urefs[0], S.ustart[0],
                                         S.gens[0], rows, ids, pg, bad), KV_OK);
                int64_t nf = kv_xprepare_floats(S.shard[0], NT, S.ustart[0]);
                if (pass == 0 && step == 2) {
                    memcpy(&one, &S, sizeof S);
                    memcpy(rows1, rows, (size_t)nf * sizeof(float));
                    memcpy(ids1, ids, (size_t)S.ustart[0][NT] * sizeof(uint32_t));
                }
                if (pass == 1 && step == 2) {
                    int same = 1;
                    for (int r = 0; r < world; r++) {
                        int64_t tot = 0, nu = 0;
                        for (int t = 0; t < NT; t++) tot += B, nu += S.nu[r][t];
                        same &= !memcmp(S.send[r], one.send[r], (size_t)nu * 8);
                        same &= !memcmp(S.counts[r], one.counts[r], sizeof S.counts[r]);
                        same &= !memcmp(S.inverse[r], one.inverse[r], (size_t)tot * 8);
                        same &= !memcmp(S.upos[r], one.upos[r], (size_t)nu * 8);
                        same &= !memcmp(S.pos[r], one.pos[r], (size_t)tot * 8);
                        same &= !memcmp(S.nu[r], one.nu[r], sizeof S.nu[r]);
                    }
                    CHECK(same);
                    int64_t tot = 0;
                    for (int k = 0; k < world * NT; k++) tot += S.rcounts[0][k] * DIMS[k % NT];
                    CHECK(!memcmp(S.reply[0], one.reply[0], (size_t)tot * sizeof(float)));
                    CHECK(!memcmp(S.ustart[0], one.ustart[0], sizeof S.ustart[0]));
                    CHECK(!memcmp(S.ukeys[0], one.ukeys[0], (size_t)S.ustart[0][NT] * 8));
                    CHECK(!memcmp(S.urefs[0], one.urefs[0], (size_t)S.ustart[0][NT] * 4));
                    CHECK(!memcmp(rows, rows1, (size_t)nf * sizeof(float)));
                    CHECK(!memcmp(ids, ids1, (size_t)S.ustart[0][NT] * sizeof(uint32_t)));
                }
                CHECK_EQ_INT(kv_xcommit(G_POOL, S.shard[0], NT, S.ukeys[0], S.ustart[0], ids, pg,
                                        rows, step, NULL), KV_OK);
                /* the other owners: apply at once */
                for (int o = 1; o < world; o++) {
                    grads_for(o, g);
                    CHECK_EQ_INT(kv_xapply(G_POOL, S.shard[o], NT, world, S.rcounts[o], g, 0.5f,
                                           step, S.uidx[o], S.ukeys[o], S.urefs[o], S.ustart[o],
                                           S.gens[o], NULL), KV_OK);
                }
            }
            /* row gradients of a big gather */
            enum { ROWS = 3000, N = 20000, D = 7 };
            static float vals[N * D], out[2][ROWS * D];
            static int64_t idx[N];
            uint64_t seed = 5;
            for (int i = 0; i < N; i++) {
                idx[i] = (int64_t)(test_rand(&seed) % ROWS);
                for (int k = 0; k < D; k++)
                    vals[i * D + k] = (float)((int64_t)(test_rand(&seed) % 2001) - 1000) * 1e-3f;
            }
            CHECK_EQ_INT(kv_xrowgrad(G_POOL, ROWS, D, vals, idx, N, out[pass]), KV_OK);
            if (pass) CHECK(!memcmp(out[0], out[1], sizeof out[0]));
            digests[pass] = digest();
            free_tables();
        }
        CHECK(digests[0] == digests[1]);
    }
    G_POOL = pool;
}

static void test_rowgrad(void) {
    static const int32_t dims[] = {1, 3, 4, 8, 9, 16, 17, 32, 33, 40};
    enum { ROWS = 50, N = 700 };
    static float vals[N * 40], out[ROWS * 40], want[ROWS * 40];
    static int64_t idx[N];
    uint64_t x = 12345;
    for (size_t k = 0; k < sizeof dims / sizeof dims[0]; k++) {
        int32_t d = dims[k];
        for (int i = 0; i < N; i++) {
            x = kv_mix64(x + 1);
            idx[i] = (int64_t)(x % (ROWS - 3)); /* the last 3 rows stay zero */
            for (int j = 0; j < d; j++) vals[i * d + j] = (float)((int)(x >> (j + 8)) % 1000) / 7.0f;
        }
        memset(want, 0, sizeof want);
        for (int i = 0; i < N; i++)
            for (int j = 0; j < d; j++) want[idx[i] * d + j] += vals[i * d + j];
        memset(out, 0xff, sizeof out);
        CHECK_EQ_INT(kv_xrowgrad(G_POOL, ROWS, d, vals, idx, N, out), KV_OK);
        CHECK(memcmp(out, want, (size_t)ROWS * (size_t)d * sizeof(float)) == 0);
    }
    /* nothing gathered: zeros; no rows, no gradients: fine */
    memset(out, 0xff, sizeof out);
    CHECK_EQ_INT(kv_xrowgrad(G_POOL, ROWS, 9, vals, idx, 0, out), KV_OK);
    CHECK(out[0] == 0.0f && out[ROWS * 9 - 1] == 0.0f);
    CHECK_EQ_INT(kv_xrowgrad(G_POOL, 0, 9, NULL, NULL, 0, NULL), KV_OK);
    /* bad input: out unchanged */
    memset(out, 0x7f, sizeof out);
    memcpy(want, out, sizeof out);
    idx[N - 1] = ROWS;
    CHECK_EQ_INT(kv_xrowgrad(G_POOL, ROWS, 9, vals, idx, N, out), KV_EINVAL);
    idx[N - 1] = -1;
    CHECK_EQ_INT(kv_xrowgrad(G_POOL, ROWS, 9, vals, idx, N, out), KV_EINVAL);
    idx[N - 1] = 0;
    CHECK_EQ_INT(kv_xrowgrad(G_POOL, ROWS, 0, vals, idx, N, out), KV_EINVAL);
    CHECK_EQ_INT(kv_xrowgrad(G_POOL, -1, 9, vals, idx, N, out), KV_EINVAL);
    CHECK_EQ_INT(kv_xrowgrad(G_POOL, ROWS, 9, NULL, idx, N, out), KV_EINVAL);
    CHECK_EQ_INT(kv_xrowgrad(G_POOL, ROWS, 9, vals, idx, N, NULL), KV_EINVAL);
    CHECK(memcmp(out, want, sizeof out) == 0);
}

int main(int argc, char **argv) {
    /* every test with no pool, then with pools of 2 and 4 threads (the build for these
     * tests lowers the work below which one thread works, so every path is threaded);
     * "threads" (the ThreadSanitizer build): the pools only */
    int tsan = argc > 1 && !strcmp(argv[1], "threads");
    static const int32_t threads[] = {1, 2, 4};
    for (int p = tsan ? 1 : 0; p < 3; p++) {
        G_POOL = NULL;
        if (threads[p] > 1) CHECK_EQ_INT(kv_pool_create(threads[p], &G_POOL), KV_OK);
        for (int w = 1; w <= MAXW; w++) {
            test_round_trip(w, 5000); /* few duplicates across ranks */
            test_round_trip(w, 300);  /* many */
        }
        test_errors();
        test_generation();
        test_nonfinite();
        test_rowgrad();
        if (G_POOL) test_pool_equivalence();
        kv_pool_destroy(G_POOL);
    }
    return test_summary();
}
