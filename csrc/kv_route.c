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

/* ---- XXH64 ------------------------------------------------------------------------- */

#define XP1 0x9E3779B185EBCA87ULL
#define XP2 0xC2B2AE3D27D4EB4FULL
#define XP3 0x165667B19E3779F9ULL
#define XP4 0x85EBCA77C2B2AE63ULL
#define XP5 0x27D4EB2F165667C5ULL

static inline uint64_t rotl64(uint64_t x, unsigned r) { return (x << r) | (x >> (64 - r)); }
static inline uint64_t rd64(const uint8_t *p) { /* little-endian */
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}
static inline uint64_t rd32(const uint8_t *p) {
    return (uint64_t)p[0] | (uint64_t)p[1] << 8 | (uint64_t)p[2] << 16 | (uint64_t)p[3] << 24;
}
static inline uint64_t xround(uint64_t acc, uint64_t in) {
    acc += in * XP2;
    return rotl64(acc, 31) * XP1;
}
static inline uint64_t xmerge(uint64_t acc, uint64_t v) {
    acc ^= xround(0, v);
    return acc * XP1 + XP4;
}

static uint64_t xxh64(const uint8_t *p, uint64_t len, uint64_t seed) {
    const uint8_t *end = p + len;
    uint64_t h;
    if (len >= 32) {
        uint64_t v1 = seed + XP1 + XP2, v2 = seed + XP2, v3 = seed, v4 = seed - XP1;
        for (; p + 32 <= end; p += 32) {
            v1 = xround(v1, rd64(p));
            v2 = xround(v2, rd64(p + 8));
            v3 = xround(v3, rd64(p + 16));
            v4 = xround(v4, rd64(p + 24));
        }
        h = rotl64(v1, 1) + rotl64(v2, 7) + rotl64(v3, 12) + rotl64(v4, 18);
        h = xmerge(xmerge(xmerge(xmerge(h, v1), v2), v3), v4);
    } else {
        h = seed + XP5;
    }
    h += len;
    for (; p + 8 <= end; p += 8) h = rotl64(h ^ xround(0, rd64(p)), 27) * XP1 + XP4;
    if (p + 4 <= end) {
        h = rotl64(h ^ (rd32(p) * XP1), 23) * XP2 + XP3;
        p += 4;
    }
    for (; p < end; p++) h = rotl64(h ^ (*p * XP5), 11) * XP1;
    h ^= h >> 33;
    h *= XP2;
    h ^= h >> 29;
    h *= XP3;
    h ^= h >> 32;
    return h;
}

int kv_hash_strings(const uint8_t *bytes, const int64_t *starts, const int64_t *lens,
                    int64_t n, uint64_t seed, int64_t *out) {
    if (n < 0 || (n > 0 && (!starts || !lens || !out))) return KV_EINVAL;
    for (int64_t i = 0; i < n; i++)
        if (starts[i] < 0 || lens[i] < 0 || (lens[i] > 0 && !bytes)) return KV_EINVAL;
    for (int64_t i = 0; i < n; i++)
        out[i] = (int64_t)xxh64(lens[i] ? bytes + starts[i] : (const uint8_t *)"",
                                (uint64_t)lens[i], seed);
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
