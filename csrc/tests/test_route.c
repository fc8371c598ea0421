/*
 * test_route.c - hashing, buckets, owners under a bucket -> rank map, unique +
 * partition and segment sums against quadratic reference implementations, over random
 * inputs with many duplicates, several world sizes and maps (even, uneven, power-of-two
 * and other bucket counts), empty inputs, bad arguments and maps, and failing
 * allocations.
 */
#include <string.h>

#include "../kv_route.h"
#include "test_util.h"

/* Naive unique + partition: first-appearance order, then a stable pass per owner. */
/* The owner of a key by the definition: map[(mix(key) >> 40) % buckets]. */
static int32_t ref_owner(int64_t key, const int32_t *map, int32_t buckets) {
    return map[(kv_mix64((uint64_t)key) >> 40) % (uint64_t)buckets];
}

static int64_t naive_unique(const int64_t *keys, int64_t n, const int32_t *map,
                            int32_t buckets, int32_t world, int64_t *uniq, int64_t *inverse,
                            int64_t *counts) {
    int64_t *first = malloc((size_t)(n + 1) * 8);
    int64_t nf = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t j = 0;
        while (j < nf && first[j] != keys[i]) j++;
        if (j == nf) first[nf++] = keys[i];
    }
    int64_t p = 0;
    for (int32_t w = 0; w < world; w++) {
        counts[w] = 0;
        for (int64_t j = 0; j < nf; j++)
            if ((world == 1 ? 0 : ref_owner(first[j], map, buckets)) == w) {
                uniq[p++] = first[j];
                counts[w]++;
            }
    }
    for (int64_t i = 0; i < n; i++) {
        int64_t j = 0;
        while (uniq[j] != keys[i]) j++;
        inverse[i] = j;
    }
    free(first);
    return nf;
}

static void test_hash_owner(void) {
    int64_t keys[5] = {0, 1, -1, INT64_MIN, INT64_MAX};
    uint64_t h[5];
    int32_t o[5], b[5];
    CHECK_EQ_INT(kv_hash_batch(keys, 5, h), KV_OK);
    int ok = 1;
    for (int i = 0; i < 5; i++) ok &= h[i] == kv_mix64((uint64_t)keys[i]);
    CHECK(ok);
    CHECK(h[0] == 0); /* fmix64(0) == 0: known property of the finaliser */
    CHECK(h[1] == 0xb456bcfc34c2cb2cULL);
    int32_t nbs[] = {1, 3, 60, 1 << 16, KV_MAX_BUCKETS};
    for (int k = 0; k < 5; k++) {
        CHECK_EQ_INT(kv_bucket_batch(keys, 5, nbs[k], b), KV_OK);
        for (int i = 0; i < 5; i++) ok &= b[i] == (int32_t)((h[i] >> 40) % (uint64_t)nbs[k]);
    }
    CHECK(ok);
    int32_t map[3] = {2, 0, 1};
    CHECK_EQ_INT(kv_owner_batch(keys, 5, map, 3, 3, o), KV_OK);
    for (int i = 0; i < 5; i++) ok &= o[i] == map[(h[i] >> 40) % 3];
    CHECK(ok);
    CHECK_EQ_INT(kv_owner_batch(keys, 5, NULL, 3, 1, o), KV_OK); /* world 1: no map */
    for (int i = 0; i < 5; i++) ok &= o[i] == 0;
    CHECK(ok);
    int32_t bad[3] = {0, 3, 1}; /* rank 3 in a world of 3 */
    int32_t neg[3] = {0, -1, 1};
    int64_t hit = 0; /* key 0 hashes to bucket 0, so only keys in bucket 1 see the bad entry */
    for (int i = 0; i < 5; i++) hit += (h[i] >> 40) % 3 == 1;
    CHECK(hit > 0);
    CHECK_EQ_INT(kv_owner_batch(keys, 5, bad, 3, 3, o), KV_EINVAL);
    CHECK_EQ_INT(kv_owner_batch(keys, 5, neg, 3, 3, o), KV_EINVAL);
    CHECK_EQ_INT(kv_owner_batch(keys, 5, map, 3, 0, o), KV_EINVAL);
    CHECK_EQ_INT(kv_owner_batch(keys, 5, map, 0, 3, o), KV_EINVAL);
    CHECK_EQ_INT(kv_owner_batch(keys, 5, NULL, 3, 3, o), KV_EINVAL);
    CHECK_EQ_INT(kv_owner_batch(keys, -1, map, 3, 3, o), KV_EINVAL);
    CHECK_EQ_INT(kv_owner_batch(NULL, 2, map, 3, 3, o), KV_EINVAL);
    CHECK_EQ_INT(kv_bucket_batch(keys, 5, 0, b), KV_EINVAL);
    CHECK_EQ_INT(kv_bucket_batch(keys, 5, KV_MAX_BUCKETS + 1, b), KV_EINVAL);
    CHECK_EQ_INT(kv_bucket_batch(keys, 1, 4, NULL), KV_EINVAL);
    CHECK_EQ_INT(kv_hash_batch(keys, -1, h), KV_EINVAL);
    CHECK_EQ_INT(kv_hash_batch(keys, 1, NULL), KV_EINVAL);
    CHECK_EQ_INT(kv_hash_batch(NULL, 0, NULL), KV_OK);
    /* buckets are balanced: 100k keys over 7 and over 64 buckets */
    int64_t cnt[64] = {0};
    for (int64_t k = 0; k < 100000; k++) cnt[kv_bucket_of_hash(kv_mix64((uint64_t)k), 7)]++;
    for (int w = 0; w < 7; w++) ok &= cnt[w] > 13500 && cnt[w] < 15100;
    memset(cnt, 0, sizeof cnt);
    for (int64_t k = 0; k < 100000; k++) cnt[kv_bucket_of_hash(kv_mix64((uint64_t)k), 64)]++;
    for (int w = 0; w < 64; w++) ok &= cnt[w] > 1350 && cnt[w] < 1780;
    CHECK(ok);
}

/* A map of `buckets` buckets over `world` ranks: kind 0 contiguous even blocks, kind 1
 * random (some ranks may get nothing). */
static void make_map(int32_t *map, int32_t buckets, int32_t world, int kind, uint64_t *rng) {
    for (int32_t b = 0; b < buckets; b++)
        map[b] = kind == 0 ? (int32_t)((int64_t)b * world / buckets)
                           : (int32_t)(test_rand(rng) % (uint64_t)world);
}

static void test_unique_partition(void) {
    uint64_t rng = 5;
    int32_t worlds[] = {1, 2, 3, 8, 1000};
    int32_t nbs[] = {1000, 4096, 65536, 7000};
    for (int round = 0; round < 80; round++) {
        int32_t world = worlds[round % 5], buckets = nbs[(round / 5) % 4];
        int32_t *map = malloc((size_t)buckets * sizeof(int32_t));
        make_map(map, buckets, world, round % 2, &rng);
        int64_t n = round == 0 ? 0 : (int64_t)(test_rand(&rng) % 3000);
        uint64_t range = 1 + test_rand(&rng) % (round % 3 == 0 ? 10 : 5000);
        int64_t *keys = malloc((size_t)(n + 1) * 8);
        for (int64_t i = 0; i < n; i++) keys[i] = (int64_t)(test_rand(&rng) % range) * -977;
        int64_t *u1 = malloc((size_t)(n + 1) * 8), *u2 = malloc((size_t)(n + 1) * 8);
        int64_t *i1 = malloc((size_t)(n + 1) * 8), *i2 = malloc((size_t)(n + 1) * 8);
        int64_t *c1 = malloc((size_t)world * 8), *c2 = malloc((size_t)world * 8);
        int32_t *o = malloc((size_t)(n + 1) * sizeof(int32_t));
        int64_t nu = -1;
        CHECK_EQ_INT(kv_unique_partition(keys, n, map, buckets, world, u1, i1, c1, &nu), KV_OK);
        int64_t nn = naive_unique(keys, n, map, buckets, world, u2, i2, c2);
        CHECK_EQ_INT(nu, nn);
        CHECK(!memcmp(u1, u2, (size_t)nn * 8));
        CHECK(!memcmp(i1, i2, (size_t)n * 8));
        CHECK(!memcmp(c1, c2, (size_t)world * 8));
        CHECK_EQ_INT(kv_owner_batch(keys, n, map, buckets, world, o), KV_OK);
        int ok = 1;
        for (int64_t i = 0; i < n; i++) ok &= o[i] == ref_owner(keys[i], map, buckets);
        CHECK(ok);
        /* plain unique: the first-appearance order */
        CHECK_EQ_INT(kv_unique(keys, n, u1, i1, &nu), KV_OK);
        int64_t w1[1];
        naive_unique(keys, n, map, buckets, 1, u2, i2, w1);
        CHECK_EQ_INT(nu, nn);
        CHECK(!memcmp(u1, u2, (size_t)nn * 8));
        CHECK(!memcmp(i1, i2, (size_t)n * 8));
        free(map);
        free(keys);
        free(u1);
        free(u2);
        free(i1);
        free(i2);
        free(c1);
        free(c2);
        free(o);
    }
    int64_t k[3] = {1, 2, 1}, u[3], inv[3], cnt[2], nu;
    int32_t map[4] = {0, 1, 1, 0}, bad[4] = {2, 2, 2, 2};
    CHECK_EQ_INT(kv_unique_partition(k, 3, map, 4, 0, u, inv, cnt, &nu), KV_EINVAL);
    CHECK_EQ_INT(kv_unique_partition(k, 3, map, 0, 2, u, inv, cnt, &nu), KV_EINVAL);
    CHECK_EQ_INT(kv_unique_partition(k, 3, NULL, 4, 2, u, inv, cnt, &nu), KV_EINVAL);
    CHECK_EQ_INT(kv_unique_partition(k, 3, bad, 4, 2, u, inv, cnt, &nu), KV_EINVAL);
    CHECK_EQ_INT(kv_unique_partition(k, -1, map, 4, 1, u, inv, cnt, &nu), KV_EINVAL);
    CHECK_EQ_INT(kv_unique_partition(k, 3, map, 4, 1, NULL, inv, cnt, &nu), KV_EINVAL);
    CHECK_EQ_INT(kv_unique_partition(k, 3, map, 4, 1, u, NULL, cnt, &nu), KV_EINVAL);
    CHECK_EQ_INT(kv_unique_partition(k, 3, map, 4, 1, u, inv, NULL, &nu), KV_EINVAL);
    CHECK_EQ_INT(kv_unique_partition(k, 3, map, 4, 1, u, inv, cnt, NULL), KV_EINVAL);
    CHECK_EQ_INT(kv_unique_partition(k, 3, map, 4, 2, u, inv, cnt, &nu), KV_OK);
    CHECK_EQ_INT(nu, 2);
    CHECK_EQ_INT(kv_unique_partition(k, 3, NULL, 4, 1, u, inv, cnt, &nu), KV_OK);
    CHECK(nu == 2 && cnt[0] == 2);
    CHECK_EQ_INT(kv_unique(k, 3, u, inv, NULL), KV_EINVAL);
    CHECK_EQ_INT(kv_unique(k, -1, u, inv, &nu), KV_EINVAL);
    CHECK_EQ_INT(kv_unique(NULL, 0, NULL, NULL, &nu), KV_OK);
    CHECK_EQ_INT(nu, 0);
}

static void test_segment_sum(void) {
    uint64_t rng = 11;
    for (int round = 0; round < 40; round++) {
        int32_t dim = 1 + (int32_t)(test_rand(&rng) % 9);
        int64_t n = round == 0 ? 0 : (int64_t)(test_rand(&rng) % 2000);
        uint64_t range = 1 + test_rand(&rng) % 300;
        int64_t *keys = malloc((size_t)(n + 1) * 8), *uk = malloc((size_t)(n + 1) * 8);
        float *rows = malloc((size_t)(n * dim + 1) * 4), *sums = malloc((size_t)(n * dim + 1) * 4);
        float *ref = calloc((size_t)(n * dim + 1), 4);
        int64_t *rk = malloc((size_t)(n + 1) * 8);
        for (int64_t i = 0; i < n; i++) keys[i] = (int64_t)(test_rand(&rng) % range);
        for (int64_t i = 0; i < n * dim; i++) rows[i] = (float)(test_rand(&rng) % 100) * 0.25f;
        int64_t nr = 0;
        for (int64_t i = 0; i < n; i++) {
            int64_t j = 0;
            while (j < nr && rk[j] != keys[i]) j++;
            if (j == nr) rk[nr++] = keys[i];
            for (int32_t e = 0; e < dim; e++) ref[j * dim + e] += rows[i * dim + e];
        }
        int64_t nu = -1;
        CHECK_EQ_INT(kv_segment_sum(keys, n, rows, dim, uk, sums, &nu), KV_OK);
        CHECK_EQ_INT(nu, nr);
        CHECK(!memcmp(uk, rk, (size_t)nr * 8));
        CHECK(!memcmp(sums, ref, (size_t)(nr * dim) * 4)); /* exact: quarters sum exactly */
        free(keys);
        free(uk);
        free(rows);
        free(sums);
        free(ref);
        free(rk);
    }
    int64_t k[2] = {1, 1}, uk[2], nu;
    float r[2] = {1, 2}, s[2];
    CHECK_EQ_INT(kv_segment_sum(k, 2, r, 0, uk, s, &nu), KV_EINVAL);
    CHECK_EQ_INT(kv_segment_sum(k, -2, r, 1, uk, s, &nu), KV_EINVAL);
    CHECK_EQ_INT(kv_segment_sum(k, 2, NULL, 1, uk, s, &nu), KV_EINVAL);
    CHECK_EQ_INT(kv_segment_sum(k, 2, r, 1, uk, s, NULL), KV_EINVAL);
    CHECK_EQ_INT(kv_segment_sum(k, 2, r, 1, uk, s, &nu), KV_OK);
    CHECK(nu == 1 && s[0] == 3.0f);
}

static void test_oom(void) {
    enum { N = 500 };
    int64_t keys[N], u[N], inv[N], cnt[4], nu;
    int32_t map[16];
    for (int b = 0; b < 16; b++) map[b] = b % 4;
    float rows[N], sums[N];
    for (int i = 0; i < N; i++) keys[i] = i % 77;
    for (int i = 0; i < N; i++) rows[i] = 1.0f;
    fail_alloc_install();
    int got_ok = 0;
    for (long k = 1; k <= 10 && !got_ok; k++) {
        fail_alloc_arm(k);
        int rc = kv_unique_partition(keys, N, map, 16, 4, u, inv, cnt, &nu);
        fail_alloc_arm(0);
        if (rc == KV_OK) got_ok = 1;
        else CHECK_EQ_INT(rc, KV_ENOMEM);
    }
    CHECK(got_ok && nu == 77);
    fail_alloc_arm(1);
    CHECK_EQ_INT(kv_unique(keys, N, u, inv, &nu), KV_ENOMEM);
    fail_alloc_arm(0);
    fail_alloc_arm(1);
    CHECK_EQ_INT(kv_segment_sum(keys, N, rows, 1, u, sums, &nu), KV_ENOMEM);
    fail_alloc_arm(0);
    CHECK_EQ_INT(kv_segment_sum(keys, N, rows, 1, u, sums, &nu), KV_OK);
    kv_set_allocator(NULL, NULL, NULL);
    /* allocator contract */
    void *p = kv_calloc(SIZE_MAX / 2, 4);
    CHECK(p == NULL);
    p = kv_calloc(3, 5);
    CHECK(p != NULL && ((unsigned char *)p)[14] == 0);
    p = kv_realloc(p, 100);
    CHECK(p != NULL);
    kv_free(p);
    kv_free(NULL);
}

int main(void) {
    test_hash_owner();
    test_unique_partition();
    test_segment_sum();
    test_oom();
    return test_summary();
}
