/*
 * kv_route.h - the 64-bit key mix, owner choice, and the unique + partition kernel.
 *
 * One hash, three disjoint uses of its bits (h = kv_mix64(key)):
 *   bits  0..31  bucket inside a table       (fastrange: (uint32)h * slots >> 32)
 *   bits 32..39  8-bit tag kept in the index  (skips most row reads on a miss)
 *   bits 40..63  owner rank = (h >> 40) % world
 * so the keys one rank owns are still spread evenly over its buckets and tags
 * (robin-map's README explains the clustering trap of reusing bits).
 *
 * None of these functions lock anything or keep state: all are thread-safe.
 */
#ifndef KV_ROUTE_H
#define KV_ROUTE_H

#include <stdint.h>
#include "kv_status.h"

/* A bijective 64-bit mix (murmur3 fmix64 / splitmix64 finaliser). */
static inline uint64_t kv_mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

static inline int32_t kv_owner_of_hash(uint64_t h, int32_t world) {
    return (int32_t)((h >> 40) % (uint64_t)world);
}

/* Same function as Python's kvcoll hash (exposed so tests compare bit for bit).
 * out[i] = kv_mix64((uint64_t)keys[i]). */
int kv_hash_batch(const int64_t *keys, int64_t n, uint64_t *out);

/* String ids to keys (FarmHash Fingerprint64 or XXH64): kv_ids.h. */

/* owner[i] = owner rank of keys[i] for a world of `world` ranks (world >= 1).
 * Returns KV_OK or KV_EINVAL. */
int kv_owner_batch(const int64_t *keys, int64_t n, int32_t world, int32_t *owner);

/*
 * Unique + partition by owner in O(n), one pass over the keys plus one over the
 * unique keys.
 *   keys[n]           input keys, any order, duplicates allowed
 *   world             number of ranks (>= 1); world == 1 is plain unique
 *   uniq[n]           out: the unique keys grouped by owner rank 0, 1, ...;
 *                     inside a group, in order of first appearance in keys
 *   inverse[n]        out: uniq[inverse[i]] == keys[i]
 *   counts[world]     out: how many unique keys each owner gets
 *   n_unique          out: number of unique keys (sum of counts)
 * Buffers are the caller's; scratch memory is allocated and freed inside.
 * Returns KV_OK, KV_EINVAL or KV_ENOMEM (outputs then undefined).
 */
int kv_unique_partition(const int64_t *keys, int64_t n, int32_t world, int64_t *uniq,
                        int64_t *inverse, int64_t *counts, int64_t *n_unique);

/*
 * Sum rows that share a key: given keys[n] and rows[n][dim], write the unique keys
 * (first-appearance order) to uniq_keys and the per-key sums to sums[n_unique][dim].
 * Used by the owner to merge gradients arriving from several ranks.
 * Returns KV_OK, KV_EINVAL or KV_ENOMEM.
 */
int kv_segment_sum(const int64_t *keys, int64_t n, const float *rows, int32_t dim,
                   int64_t *uniq_keys, float *sums, int64_t *n_unique);

#endif
