/*
 * kv_route.h - the 64-bit key mix, owner choice, and the unique + partition kernel.
 *
 * One hash, three disjoint uses of its bits (h = kv_mix64(key)):
 *   bits  0..31  bucket inside a table       (fastrange: (uint32)h * slots >> 32)
 *   bits 32..39  8-bit tag kept in the index  (skips most row reads on a miss)
 *   bits 40..63  the key's model bucket = (h >> 40) % buckets, and its owner rank =
 *                owners[bucket], a bucket -> rank map the same on every rank
 *                (kvcoll.routing.OwnerMap; buckets is fixed for the life of a model)
 * so the keys one rank owns are still spread evenly over its buckets and tags
 * (robin-map's README explains the clustering trap of reusing bits).
 *
 * A map is (owners[buckets], buckets, world): 1 <= buckets <= KV_MAX_BUCKETS, every
 * owners[b] in [0, world). The kernels check each owner they use and fail with
 * KV_EINVAL on one outside [0, world) (outputs then undefined), so a bad map can never
 * write out of bounds.
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

/* The largest bucket count: the 24 hash bits above the table's 40. */
#define KV_MAX_BUCKETS (1 << 24)

/* The model bucket of a hash (buckets in [1, KV_MAX_BUCKETS]; a power of two masks). */
static inline int32_t kv_bucket_of_hash(uint64_t h, int32_t buckets) {
    uint64_t top = h >> 40, b = (uint64_t)buckets;
    return (int32_t)((b & (b - 1)) == 0 ? top & (b - 1) : top % b);
}

/* Same function as Python's kvcoll hash (exposed so tests compare bit for bit).
 * out[i] = kv_mix64((uint64_t)keys[i]). */
int kv_hash_batch(const int64_t *keys, int64_t n, uint64_t *out);

/* String ids to keys (FarmHash Fingerprint64 or XXH64): kv_ids.h. */

/* bucket[i] = the bucket of keys[i] among `buckets` (1 <= buckets <= KV_MAX_BUCKETS).
 * Returns KV_OK or KV_EINVAL. */
int kv_bucket_batch(const int64_t *keys, int64_t n, int32_t buckets, int32_t *bucket);

/* owner[i] = owners[bucket of keys[i]]: the owner rank of each key under the map
 * (owners[buckets], world). Returns KV_OK or KV_EINVAL (a bad size, a NULL buffer, an
 * owner outside [0, world)). */
int kv_owner_batch(const int64_t *keys, int64_t n, const int32_t *owners, int32_t buckets,
                   int32_t world, int32_t *owner);

/*
 * Unique in O(n): uniq[0..n_unique) = the distinct keys in order of first appearance,
 * inverse[i] = the index in uniq of keys[i]. Returns KV_OK, KV_EINVAL or KV_ENOMEM.
 */
int kv_unique(const int64_t *keys, int64_t n, int64_t *uniq, int64_t *inverse,
              int64_t *n_unique);

/*
 * Unique + partition by owner in O(n), one pass over the keys plus one over the
 * unique keys.
 *   keys[n]           input keys, any order, duplicates allowed
 *   owners, buckets, world   the bucket -> rank map (above); with world == 1 every
 *                     key's owner is 0, the map is not read (owners may be NULL), and
 *                     this is plain unique
 *   uniq[n]           out: the unique keys grouped by owner rank 0, 1, ...;
 *                     inside a group, in order of first appearance in keys
 *   inverse[n]        out: uniq[inverse[i]] == keys[i]
 *   counts[world]     out: how many unique keys each owner gets
 *   n_unique          out: number of unique keys (sum of counts)
 * Buffers are the caller's; scratch memory is allocated and freed inside.
 * Returns KV_OK, KV_EINVAL (also: an owner outside [0, world)) or KV_ENOMEM
 * (outputs then undefined).
 */
int kv_unique_partition(const int64_t *keys, int64_t n, const int32_t *owners,
                        int32_t buckets, int32_t world, int64_t *uniq, int64_t *inverse,
                        int64_t *counts, int64_t *n_unique);

/*
 * Sum rows that share a key: given keys[n] and rows[n][dim], write the unique keys
 * (first-appearance order) to uniq_keys and the per-key sums to sums[n_unique][dim].
 * Used by the owner to merge gradients arriving from several ranks.
 * Returns KV_OK, KV_EINVAL or KV_ENOMEM.
 */
int kv_segment_sum(const int64_t *keys, int64_t n, const float *rows, int32_t dim,
                   int64_t *uniq_keys, float *sums, int64_t *n_unique);

#endif
