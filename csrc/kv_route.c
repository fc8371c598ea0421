/*
 * kv_route.c - hashing, buckets and owners, unique + partition, and segment sums.
 *
 * Deduplication (kv_unique_partition, kv_segment_sum) uses a scratch
 * open-addressing set: a power-of-two array of uint32 slots, at most half full,
 * each holding (first-appearance id + 1) or 0 for empty; the slot of a key is
 * found by linear probing from kv_mix64(key) & mask and a hit is confirmed by
 * comparing against the array of first-appearance keys. One pass over the keys
 * assigns every distinct key its first-appearance id and writes that id as the
 * provisional inverse.
 *
 * kv_unique_partition then looks up each distinct key's owner in the bucket -> rank
 * map (checking it is a rank of the world) and groups the distinct keys by owner with
 * a stable counting sort (counts per owner, exclusive prefix sums, one scatter), so that
 * inside each owner's group the keys keep first-appearance order, and rewrites
 * every inverse entry through the id -> grouped position map. Total work O(n +
 * world); scratch memory about 8 bytes per slot-or-key, freed before returning.
 *
 * kv_segment_sum copies the first row of each key and adds later rows in input
 * order, so its float sums are deterministic for a given input order.
 *
 * Nothing here locks or keeps state. Inputs of more than 2^32 - 2 keys are
 * rejected with KV_EINVAL (the scratch set stores 32-bit ids).
 */
#include "kv_route.h"

#include <string.h>

#define ROUTE_MAX_N ((int64_t)UINT32_MAX - 1)

int kv_hash_batch(const int64_t *keys, int64_t n, uint64_t *out) {
    if (n < 0 || (n > 0 && (!keys || !out))) return KV_EINVAL;
    for (int64_t i = 0; i < n; i++) out[i] = kv_mix64((uint64_t)keys[i]);
    return KV_OK;
}

static int bad_map(const int32_t *owners, int32_t buckets, int32_t world) {
    return buckets < 1 || buckets > KV_MAX_BUCKETS || world < 1 || (world > 1 && !owners);
}

int kv_bucket_batch(const int64_t *keys, int64_t n, int32_t buckets, int32_t *bucket) {
    if (n < 0 || buckets < 1 || buckets > KV_MAX_BUCKETS || (n > 0 && (!keys || !bucket)))
        return KV_EINVAL;
    for (int64_t i = 0; i < n; i++) bucket[i] = kv_bucket_of_hash(kv_mix64((uint64_t)keys[i]), buckets);
    return KV_OK;
}

int kv_owner_batch(const int64_t *keys, int64_t n, const int32_t *owners, int32_t buckets,
                   int32_t world, int32_t *owner) {
    if (n < 0 || bad_map(owners, buckets, world) || (n > 0 && (!keys || !owner))) return KV_EINVAL;
    if (world == 1) {
        if (n) memset(owner, 0, (size_t)n * sizeof(int32_t));
        return KV_OK;
    }
    uint32_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        int32_t w = owners[kv_bucket_of_hash(kv_mix64((uint64_t)keys[i]), buckets)];
        bad |= (uint32_t)w >= (uint32_t)world;
        owner[i] = w;
    }
    return bad ? KV_EINVAL : KV_OK;
}

/* The scratch set: slots hold (id + 1), ids index `first` (the distinct keys). */
typedef struct {
    uint32_t *slots;
    uint64_t mask;
} dedup_set_t;

static int dedup_init(dedup_set_t *s, int64_t n) {
    uint64_t cap = 16;
    while (cap < 2 * (uint64_t)n) cap <<= 1;
    s->slots = kv_calloc(cap, sizeof(uint32_t));
    s->mask = cap - 1;
    return s->slots ? KV_OK : KV_ENOMEM;
}

/* Id of key, inserting it as id *n_first (and appending it to first) if new. */
static inline uint32_t dedup_id(dedup_set_t *s, int64_t *first, int64_t *n_first, int64_t key) {
    uint64_t pos = kv_mix64((uint64_t)key) & s->mask;
    for (;;) {
        uint32_t v = s->slots[pos];
        if (v == 0) {
            uint32_t id = (uint32_t)*n_first;
            s->slots[pos] = id + 1;
            first[id] = key;
            *n_first += 1;
            return id;
        }
        if (first[v - 1] == key) return v - 1;
        pos = (pos + 1) & s->mask;
    }
}

int kv_unique(const int64_t *keys, int64_t n, int64_t *uniq, int64_t *inverse,
              int64_t *n_unique) {
    if (n < 0 || n > ROUTE_MAX_N || !n_unique || (n > 0 && (!keys || !uniq || !inverse)))
        return KV_EINVAL;
    dedup_set_t s;
    if (dedup_init(&s, n) != KV_OK) return KV_ENOMEM;
    int64_t nu = 0;
    for (int64_t i = 0; i < n; i++) inverse[i] = dedup_id(&s, uniq, &nu, keys[i]);
    kv_free(s.slots);
    *n_unique = nu;
    return KV_OK;
}

int kv_unique_partition(const int64_t *keys, int64_t n, const int32_t *owners,
                        int32_t buckets, int32_t world, int64_t *uniq, int64_t *inverse,
                        int64_t *counts, int64_t *n_unique) {
    if (n < 0 || n > ROUTE_MAX_N || bad_map(owners, buckets, world) || !counts || !n_unique)
        return KV_EINVAL;
    if (n > 0 && (!keys || !uniq || !inverse)) return KV_EINVAL;
    if (world == 1) { /* first-appearance order is the answer */
        int rc = kv_unique(keys, n, uniq, inverse, n_unique);
        counts[0] = rc == KV_OK ? *n_unique : 0;
        return rc;
    }
    dedup_set_t s;
    int64_t *first = NULL, *pos = NULL;
    if (dedup_init(&s, n) != KV_OK) return KV_ENOMEM;
    first = kv_malloc((size_t)n * sizeof(int64_t));
    pos = kv_malloc(((size_t)n + (size_t)world) * sizeof(int64_t));
    if (!first || !pos) {
        kv_free(s.slots);
        kv_free(first);
        kv_free(pos);
        return KV_ENOMEM;
    }

    int64_t nu = 0;
    for (int64_t i = 0; i < n; i++) inverse[i] = dedup_id(&s, first, &nu, keys[i]);
    kv_free(s.slots);

    memset(counts, 0, (size_t)world * sizeof(int64_t));
    /* pos[0..nu) = owner of each distinct key, then its grouped position;
     * pos[nu..nu+world) = running write offset of each owner. */
    int64_t *next = pos + nu;
    for (int64_t u = 0; u < nu; u++) {
        int32_t w = owners[kv_bucket_of_hash(kv_mix64((uint64_t)first[u]), buckets)];
        if ((uint32_t)w >= (uint32_t)world) {
            kv_free(first);
            kv_free(pos);
            return KV_EINVAL;
        }
        pos[u] = w;
        counts[w]++;
    }
    int64_t acc = 0;
    for (int32_t w = 0; w < world; w++) {
        next[w] = acc;
        acc += counts[w];
    }
    for (int64_t u = 0; u < nu; u++) {
        int64_t p = next[pos[u]]++;
        pos[u] = p;
        uniq[p] = first[u];
    }
    for (int64_t i = 0; i < n; i++) inverse[i] = pos[inverse[i]];
    *n_unique = nu;
    kv_free(first);
    kv_free(pos);
    return KV_OK;
}

int kv_segment_sum(const int64_t *keys, int64_t n, const float *rows, int32_t dim,
                   int64_t *uniq_keys, float *sums, int64_t *n_unique) {
    if (n < 0 || n > ROUTE_MAX_N || dim < 1 || !n_unique) return KV_EINVAL;
    if (n > 0 && (!keys || !rows || !uniq_keys || !sums)) return KV_EINVAL;
    dedup_set_t s;
    if (dedup_init(&s, n) != KV_OK) return KV_ENOMEM;
    int64_t nu = 0;
    size_t d = (size_t)dim;
    for (int64_t i = 0; i < n; i++) {
        int64_t before = nu;
        uint32_t id = dedup_id(&s, uniq_keys, &nu, keys[i]);
        const float *src = rows + (size_t)i * d;
        float *dst = sums + (size_t)id * d;
        if (nu != before) {
            memcpy(dst, src, d * sizeof(float));
        } else {
            for (size_t j = 0; j < d; j++) dst[j] += src[j];
        }
    }
    kv_free(s.slots);
    *n_unique = nu;
    return KV_OK;
}
