/*
 * kv_route.c - hashing, owner choice, unique + partition, and segment sums.
 *
 * Deduplication (kv_unique_partition, kv_segment_sum) uses a scratch
 * open-addressing set: a power-of-two array of uint32 slots, at most half full,
 * each holding (first-appearance id + 1) or 0 for empty; the slot of a key is
 * found by linear probing from kv_mix64(key) & mask and a hit is confirmed by
 * comparing against the array of first-appearance keys. One pass over the keys
 * assigns every distinct key its first-appearance id and writes that id as the
 * provisional inverse.
 *
 * kv_unique_partition then groups the distinct keys by owner with a stable
 * counting sort (counts per owner, exclusive prefix sums, one scatter), so that
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

int kv_owner_batch(const int64_t *keys, int64_t n, int32_t world, int32_t *owner) {
    if (n < 0 || world < 1 || (n > 0 && (!keys || !owner))) return KV_EINVAL;
    for (int64_t i = 0; i < n; i++) owner[i] = kv_owner_of_hash(kv_mix64((uint64_t)keys[i]), world);
    return KV_OK;
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

int kv_unique_partition(const int64_t *keys, int64_t n, int32_t world, int64_t *uniq,
                        int64_t *inverse, int64_t *counts, int64_t *n_unique) {
    if (n < 0 || n > ROUTE_MAX_N || world < 1 || !counts || !n_unique) return KV_EINVAL;
    if (n > 0 && (!keys || !uniq || !inverse)) return KV_EINVAL;
    dedup_set_t s;
    int64_t *first = NULL, *pos = NULL;
    if (dedup_init(&s, n) != KV_OK) return KV_ENOMEM;
    if (world > 1) {
        first = kv_malloc((size_t)n * sizeof(int64_t));
        pos = kv_malloc(((size_t)n + (size_t)world) * sizeof(int64_t));
        if (!first || !pos) {
            kv_free(s.slots);
            kv_free(first);
            kv_free(pos);
            return KV_ENOMEM;
        }
    } else {
        first = uniq; /* world 1: first-appearance order is the answer */
    }

    int64_t nu = 0;
    for (int64_t i = 0; i < n; i++) inverse[i] = dedup_id(&s, first, &nu, keys[i]);
    kv_free(s.slots);

    memset(counts, 0, (size_t)world * sizeof(int64_t));
    if (world == 1) {
        counts[0] = nu;
        *n_unique = nu;
        return KV_OK;
    }
    /* pos[0..nu) = owner of each distinct key, then its grouped position;
     * pos[nu..nu+world) = running write offset of each owner. */
    int64_t *next = pos + nu;
    for (int64_t u = 0; u < nu; u++) {
        int32_t w = kv_owner_of_hash(kv_mix64((uint64_t)first[u]), world);
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
