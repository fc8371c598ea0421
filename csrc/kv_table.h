/*
 * kv_table.h - one rank's shard of one embedding table: int64 key -> row.
 *
 * Layout. Rows live in a chunked arena and never move; the index is a separate
 * open-addressing array of 32-bit slots (linear probing, backward-shift delete),
 * each slot holding (row id + 1) in its low bits and an 8-bit hash tag above them
 * (fewer tag bits once the arena needs more than 24 row-id bits). Growing the table
 * rebuilds the index from the arena; rows stay where they are, so a pointer to a
 * row is stable until the row is deleted.
 *
 * A row is: header { int64 key; uint32 last_step; uint32 meta } followed by
 * dim floats of embedding and kv_optim_slot_floats() floats of optimizer state.
 * meta = update count in bits 0..28 (saturating), bit 29 = changed since the last
 * kv_table_take_changes (publishing), bit 31 = dirty (created or changed since the last
 * export with KV_EXPORT_CLEAR_DIRTY; import_ leaves rows clean).
 *
 * Two change trackers, apart, so neither hides a change from the other: the dirty bit
 * and the removed-keys log serve incremental checkpoints (an export with
 * KV_EXPORT_CLEAR_DIRTY and kv_table_take_removed clear them); the publish bit, its
 * list of changed rows and its removed log serve publishing (kv_table_track_changes,
 * kv_table_take_changes clears them). Publishing costs no byte in a row (the bit is
 * taken from the update count), 4 bytes per row changed since the last take and 8 per
 * key removed since then, and a take reads only those rows: its cost is proportional
 * to the changes, not to the table.
 *
 * Feature lifecycle.
 *   Admission (cfg.admit_min_count = K >= 2): find_or_create gives a key a row only
 *   once it has been seen in K calls (a key repeated inside one call counts once, so
 *   the count does not depend on how a global batch is split over ranks; with
 *   KV_ADMIT_EXACT, calls of the same nonzero step count once too, so SSP/ASP workers
 *   pulling a key in their step t count it once, as BSP's single lookup does). Until then
 *   the key reads zeros, has_row[i] = 0, and no row exists. KV_ADMIT_EXACT counts in
 *   a "pending" map (16 bytes per unadmitted key, purged by kv_table_evict's TTL);
 *   KV_ADMIT_BLOOM counts in a counting Bloom filter of bloom_counters 4-bit counters
 *   (3 hashes, conservative update, all counters halved after bloom_counters
 *   increments): bounded memory, but a key may be admitted early when it collides
 *   with frequent ones (never late). apply_gradients never creates a row for an
 *   unadmitted key: its gradient is dropped and counted (stats.dropped_grads).
 *   Eviction (kv_table_evict): rows whose last_step is below a cut-off (TTL) and,
 *   beyond a row budget, the least recently (LRU) or least frequently (LFU) used
 *   rows. Freed rows go on the free list and are reused first, so memory stays flat.
 *   Removed-keys log (kv_table_track_removed): while on, every key removed by
 *   kv_table_evict or kv_table_delete is appended to a log that kv_table_take_removed
 *   drains, so incremental checkpoints can record removals.
 *
 * Initial values of a new key depend only on (seed, table_id, key, initializer):
 * never on insertion order, batch split, rank or world size.
 *
 * Atomicity. Every batch call validates its whole input and reserves all the
 * memory it needs before it changes anything: on any error code the table is
 * exactly as it was.
 *
 * Locking. Each table has a readers-writer lock.
 *   read lock  (any number at once): kv_table_find, kv_table_stats, kv_table_export
 *              without KV_EXPORT_CLEAR_DIRTY, kv_table_size
 *   write lock (exclusive): every other kv_table_* call (find_or_create, evict,
 *              take_removed, track_removed, set_optim, reserve included)
 * So any two calls may run on one table from two threads at once, except
 * kv_table_destroy, which must be the last call on a table.
 */
#ifndef KV_TABLE_H
#define KV_TABLE_H

#include <stdint.h>
#include "kv_pool.h"
#include "kv_status.h"
#include "kv_optim.h"

#define KV_INIT_ZEROS 0
#define KV_INIT_CONSTANT 1         /* every value = a */
#define KV_INIT_UNIFORM 2          /* uniform in [a, b) */
#define KV_INIT_NORMAL 3           /* mean a, stddev b */
#define KV_INIT_TRUNCATED_NORMAL 4 /* mean a, stddev b, redrawn outside 2 stddev (as TF) */

#define KV_MAX_DIM 65536

/* kv_table_export flags */
#define KV_EXPORT_DIRTY_ONLY 1  /* only rows whose dirty bit is set */
#define KV_EXPORT_CLEAR_DIRTY 2 /* clear the dirty bit of every row returned */

/* kv_table_apply_gradients flags */
#define KV_APPLY_CREATE_MISSING 1 /* create missing keys (initial value) then update;
                                     without it missing keys are skipped and counted */
#define KV_APPLY_DISTINCT 2       /* kv_table_apply_gradients_ref: the caller promises
                                     that no row appears twice (no summing pass) */

/* kv_table_config_t.admit_mode */
#define KV_ADMIT_EXACT 0 /* exact counts of unadmitted keys (pending map) */
#define KV_ADMIT_BLOOM 1 /* counting Bloom filter: bounded memory, K <= KV_BLOOM_MAX_COUNT */
#define KV_BLOOM_MAX_COUNT 15
#define KV_BLOOM_DEFAULT_COUNTERS ((int64_t)1 << 22) /* 2 MiB */

/* kv_table_evict policies for the row budget */
#define KV_EVICT_LRU 0 /* smallest last_step first; ties: smaller count, then smaller key */
#define KV_EVICT_LFU 1 /* smallest count first; ties: smaller last_step, then smaller key */

typedef struct kv_table kv_table_t;

typedef struct kv_table_config {
    int32_t dim;        /* 1 .. KV_MAX_DIM */
    int32_t init_kind;  /* KV_INIT_* */
    float init_a;
    float init_b;
    uint64_t seed;
    uint64_t table_id;  /* e.g. a hash of the table's name */
    int64_t initial_capacity; /* rows to reserve up front, >= 0 */
    kv_optim_t optim;
    uint32_t admit_min_count; /* 0 or 1: a row at first sight; K >= 2: after K sightings */
    int32_t admit_mode;       /* KV_ADMIT_EXACT or KV_ADMIT_BLOOM */
    int64_t bloom_counters;   /* KV_ADMIT_BLOOM: 4-bit counters, 0 = default; <= 2^32 */
} kv_table_config_t;

typedef struct kv_table_stats {
    int64_t rows;             /* live keys */
    int64_t row_capacity;     /* rows the arena can hold without allocating */
    int64_t index_slots;      /* slots in the index */
    int64_t bytes;            /* all memory held: arena chunks, index, bookkeeping */
    int64_t row_bytes;        /* bytes of one row: header + embedding + slots */
    int32_t dim;
    int32_t slot_floats;
    double load_factor;       /* rows / index_slots */
    /* lifecycle counters, cumulative since create */
    int64_t admitted;         /* rows created by find_or_create (training lookups) */
    int64_t rejected;         /* find_or_create lookups of keys not (yet) admitted */
    int64_t dropped_grads;    /* apply_gradients keys skipped: no row (unadmitted, evicted) */
    int64_t evicted;          /* rows removed by kv_table_evict */
    int64_t pending;          /* KV_ADMIT_EXACT: unadmitted keys being counted now */
    int64_t admission_bytes;  /* pending map or Bloom filter (part of bytes) */
    int64_t removed_logged;   /* keys in the removed-keys log now */
} kv_table_stats_t;

/* Create an empty table. *out is set only on KV_OK.
 * Returns KV_OK, KV_EINVAL (dim, capacity, admission settings), KV_EINIT, KV_EOPTIM,
 * KV_ENOMEM. */
int kv_table_create(const kv_table_config_t *cfg, kv_table_t **out);

/* Free everything. t may be NULL. Must be the last call on t. */
void kv_table_destroy(kv_table_t *t);

/* The row width (fixed at create; no lock). 0 for NULL. */
int32_t kv_table_dim(const kv_table_t *t);

/*
 * Replace the table's row-optimizer hyperparameters with a copy of *o, e.g. the
 * learning rate of a schedule, evaluated per step by the training loop. Rows and their
 * slots are untouched: every update after the call uses the new values, rows created
 * after it start from its initial accumulator. The kind and the slot floats per row
 * must stay what they were at create (the rows' state layout).
 *   t   the table
 *   o   the new hyperparameters (not kept: the table copies them)
 * Write lock (so no update runs with half-written values).
 * Returns KV_OK; KV_EINVAL (t or o NULL, or o would change the kind or the slot floats
 * per row); KV_EOPTIM (o fails kv_optim_check). On an error nothing changed.
 */
int kv_table_set_optim(kv_table_t *t, const kv_optim_t *o);

/*
 * Make room for m more rows (beyond the live ones) ahead of the calls that create
 * them, e.g. in a pipeline's helper thread while the step before computes: arena
 * chunks and, when the index's fill limit or its row-id bits need it, an index
 * rebuild, exactly as a find_or_create creating m rows would make them; then the
 * chunks it allocated are pre-faulted (MADV_POPULATE_WRITE where the kernel has it,
 * else one write of a zero per 4 KiB page), so the first writes of new rows take no
 * page fault (on a VM whose host backs memory lazily a fault of fresh memory is the
 * larger part of creating a row). The memory stays zero. A reserve is invisible
 * except for capacity: no key, row, generation, change-tracking state or stats
 * count other than row_capacity, index_slots, load_factor and bytes changes, so
 * refs and generations from kv_table_find_or_create_gen stay valid across it.
 *   t   the table
 *   m   rows to make room for (>= 0; 0 does nothing). The room is kept until rows
 *       use it: an unused reservation costs its memory, never correctness.
 * Write lock for the reserve; the pre-fault by MADV_POPULATE_WRITE runs after it is
 * released (it changes no byte, and chunks are freed only by kv_table_destroy), so
 * the table's other calls are not held up by it; the fallback writes under the lock.
 * Returns KV_OK; KV_EINVAL (t NULL or m < 0); KV_EFULL (m more rows would exceed
 * the shard's row limit); KV_ENOMEM. On an error no row, index or capacity changed.
 */
int kv_table_reserve(kv_table_t *t, int64_t m);

/* How kv_table_reserve pre-faults the chunks it allocates, process-wide (tests and
 * benchmarks; thread-safe, takes effect at the next reserve). */
#define KV_PREFAULT_AUTO 0  /* MADV_POPULATE_WRITE if this kernel has it, else TOUCH */
#define KV_PREFAULT_TOUCH 1 /* one write of a zero per 4 KiB page, under the lock */
#define KV_PREFAULT_OFF 2   /* none: pages are faulted by the first writes of rows */
void kv_table_set_prefault(int32_t mode);

/* Number of live keys. Read lock. */
int64_t kv_table_size(kv_table_t *t);

/* Read-only lookup: out[i][dim] = embedding of keys[i], or default_row (NULL: zeros)
 * if absent; found[i] = 1 or 0 (found may be NULL). Read lock. KV_OK or KV_EINVAL. */
int kv_table_find(kv_table_t *t, const int64_t *keys, int64_t n, float *out,
                  uint8_t *found, const float *default_row);

/* Lookup, creating missing keys with their initial value; out[i][dim] as above.
 * Sets last_step = step on every row it returns. n_created (may be NULL) gets the
 * number of keys created (duplicates in keys create one row). With admission on, a
 * missing key that is not admitted by this call gets no row: out[i] = zeros.
 * has_row[i] (may be NULL) = 1 if keys[i] has a row after the call, else 0.
 * Write lock. KV_OK, KV_EINVAL, KV_ENOMEM, KV_EFULL. */
int kv_table_find_or_create(kv_table_t *t, const int64_t *keys, int64_t n, float *out,
                            uint32_t step, int64_t *n_created, uint8_t *has_row);

/*
 * find_or_create that also says where each row lives, for
 * kv_table_apply_gradients_ref: ref[i] = keys[i]'s row id + 1, or 0 if it has no row
 * (not admitted). On error ref's contents are undefined and nothing changed.
 * Write lock.
 */
int kv_table_find_or_create_ref(kv_table_t *t, const int64_t *keys, int64_t n, float *out,
                                uint32_t step, int64_t *n_created, uint32_t *ref);

/*
 * kv_table_apply_gradients with each key's row given by ref[i] (from
 * kv_table_find_or_create_ref), so no key is looked up: the same result. Every ref is
 * checked against the row it names (the row must be live and hold keys[i]); refs of
 * 0 (no row) are skipped and counted as missing, once per distinct key. Flags:
 * KV_APPLY_CREATE_MISSING as there; KV_APPLY_DISTINCT if no key appears twice (else
 * duplicates are summed first). If a ref went stale (its row was freed or reused since), does not match its
 * key, or a missing key would have to be created, the whole batch goes by key
 * (kv_table_apply_gradients). An update that would make a row or its slots NaN/Inf
 * is refused whole (KV_ENONFINITE), as there. Write lock.
 */
int kv_table_apply_gradients_ref(kv_table_t *t, const int64_t *keys, const uint32_t *ref,
                                 int64_t n, const float *grads, int64_t step, int32_t flags,
                                 int64_t *n_missing);

/*
 * kv_table_find_or_create_ref that also gives the table's generation (*gen, under the
 * same lock): a number that changes whenever any row is freed (kv_table_evict,
 * kv_table_delete, kv_table_clear). While it has not changed, every ref still names
 * the row of its key. Write lock. KV_OK, KV_EINVAL, KV_ENOMEM, KV_EFULL.
 */
int kv_table_find_or_create_gen(kv_table_t *t, const int64_t *keys, int64_t n, float *out,
                                uint32_t step, int64_t *n_created, uint32_t *ref,
                                uint64_t *gen);

/*
 * Apply grads[i] to the row ref[i] names, for refs (and distinct keys) from a
 * kv_table_find_or_create_gen at generation `gen`: no key is looked up and no row is
 * read before its update. Keys must be distinct (one ref per row). Refs of 0 (no row:
 * not admitted) are skipped and counted in n_missing and stats.dropped_grads. If the
 * generation has changed since (a row was freed), or a ref lies outside the arena,
 * the batch goes by key (kv_table_apply_gradients with KV_APPLY_CREATE_MISSING): the
 * same result. The caller is trusted to pass each key with the ref it got for it
 * (kvcoll's exchange keeps both); a mismatched pair updates the wrong row but never
 * touches memory outside the table. NaN/Inf anywhere (in the gradients, or in a row or
 * its slots after the update): KV_ENONFINITE, nothing changed. Write lock. KV_OK,
 * KV_EINVAL, KV_ENONFINITE, KV_ENOMEM, KV_EFULL.
 */
int kv_table_apply_refs(kv_table_t *t, const int64_t *keys, const uint32_t *ref, int64_t n,
                        const float *grads, int64_t step, uint64_t gen, int64_t *n_missing);

/*
 * The update kv_table_apply_refs would make, computed without making it, so that a
 * caller can decide (with other ranks) whether it happens, and then write it with
 * kv_table_commit_refs, or drop it (nothing to undo):
 *   keys, ref, n, grads, step, gen   as kv_table_apply_refs (keys distinct)
 *   out      [n][dim + slot_floats]: row i's embedding and slots after the update
 *            (left alone for a key without a row)
 *   ids      [n]: the row of each key (id + 1; 0: no row, skipped): ref itself while
 *            the generation is still gen; else each key is found again, and a key
 *            whose row was freed since is skipped (not created again)
 *   gen_out  the generation ids belong to
 *   bad      the first i whose row or slots after the update are NaN/Inf (a NaN/Inf
 *            gradient makes them so, whatever the optimizer); -1 if none
 * Read lock. KV_OK; KV_ENONFINITE (*bad says which key); KV_EINVAL. Changes nothing.
 */
int kv_table_prepare_refs(kv_table_t *t, const int64_t *keys, const uint32_t *ref, int64_t n,
                          const float *grads, int64_t step, uint64_t gen, float *out,
                          uint32_t *ids, uint64_t *gen_out, int64_t *bad);

/*
 * Write what kv_table_prepare_refs computed: rows[i] becomes keys[i]'s embedding and
 * slots, with last_step = step, update count + 1 and the dirty bit; ids[i] == 0 is
 * skipped and counted in n_missing (may be NULL) and stats.dropped_grads. While the
 * generation is still gen the rows are those ids names; else each key is found again
 * (a row freed since the prepare is skipped and counted). Between the prepare and the
 * commit the caller changes none of these rows (the commit writes the prepared values
 * over any change). pool (kv_pool.h; may be NULL): a large commit writes its rows by
 * key range on the pool's threads, under the one write lock this call holds. Write
 * lock. KV_OK, KV_EINVAL, KV_ENOMEM (only after a row was freed since the prepare;
 * nothing changed).
 */
int kv_table_commit_refs(kv_table_t *t, kv_pool_t *pool, const int64_t *keys,
                         const uint32_t *ids, int64_t n, const float *rows, int64_t step,
                         uint64_t gen, int64_t *n_missing);

/*
 * Which key of a kv_table_apply_gradients(t, keys, n, grads, step, flags) call would
 * be refused with KV_ENONFINITE, found without changing anything (to name it in an
 * error): the gradients of each key summed over duplicates, applied to a copy of its
 * row (an absent key: its initial row with KV_APPLY_CREATE_MISSING and admission off,
 * else skipped). *key = the key of the first gradient row that is NaN/Inf (*what =
 * 1); else the first key, in order of first appearance, whose gradients summed
 * overflow (*what = 3) or whose row or slots after the update would be NaN/Inf (*what
 * = 2); *what = 0 if none (*key = 0). Read lock. KV_OK, KV_EINVAL, KV_ENOMEM.
 */
int kv_table_check_update(kv_table_t *t, const int64_t *keys, int64_t n, const float *grads,
                          int64_t step, int32_t flags, int64_t *key, int32_t *what);

/* Floats of optimizer state per row (fixed at create; no lock). 0 for NULL. */
int32_t kv_table_slot_floats(const kv_table_t *t);

/* Assign embedding values: values[i][dim] becomes the row of keys[i], creating the
 * row (slots initialised) if absent. Duplicate keys: the last one wins. Marks rows
 * dirty. Write lock. KV_OK, KV_EINVAL, KV_ENONFINITE, KV_ENOMEM, KV_EFULL. */
int kv_table_update(kv_table_t *t, const int64_t *keys, int64_t n, const float *values);

/* Remove keys (absent ones are ignored). n_deleted may be NULL. Removed keys go to
 * the removed-keys log while it is on. Write lock. KV_OK, KV_EINVAL, KV_ENOMEM (log). */
int kv_table_delete(kv_table_t *t, const int64_t *keys, int64_t n, int64_t *n_deleted);

/*
 * Forget the rows a rejected step created: remove every key of keys[n] whose row was
 * created at `step` and never updated (update count 0, last step == step), as if the
 * step's lookup had not happened (its admission sightings stay counted). Other keys
 * are left alone. Removed keys go to the removed-keys log while it is on. n_forgotten
 * may be NULL. Write lock. KV_OK, KV_EINVAL, KV_ENOMEM (log).
 */
int kv_table_forget_new(kv_table_t *t, const int64_t *keys, int64_t n, uint32_t step,
                        int64_t *n_forgotten);

/* Remove every key; keeps the allocated memory. Also forgets admission counts and
 * empties the removed-keys log (a clear is not logged key by key). Write lock. */
int kv_table_clear(kv_table_t *t);

/*
 * Apply gradients with the table's row optimizer. grads[i][dim] belongs to keys[i];
 * duplicate keys are summed first and applied once. The whole batch is checked for
 * NaN/Inf before anything changes (KV_ENONFINITE), and so is every row and slot the
 * update would write: an update that would make one NaN/Inf (a huge gradient whose
 * square overflows Adagrad's accumulator, say) is refused whole with KV_ENONFINITE
 * (kv_table_check_update names the key). `step` (>= 1) feeds Adam's bias
 * correction; every updated row gets last_step = step, count += 1, dirty = 1.
 * Missing keys are skipped and counted in n_missing (may be NULL) and in
 * stats.dropped_grads, unless flags has KV_APPLY_CREATE_MISSING and admission is off
 * (with admission on, rows are only ever created by find_or_create). Write lock.
 * Returns KV_OK, KV_EINVAL, KV_ENONFINITE, KV_ENOMEM, KV_EFULL.
 */
int kv_table_apply_gradients(kv_table_t *t, const int64_t *keys, int64_t n,
                             const float *grads, int64_t step, int32_t flags,
                             int64_t *n_missing);

/*
 * Iterate rows in arena order. *cursor starts at 0; each call writes up to max_n
 * rows and advances it; *n_out < max_n means the end was reached.
 *   keys[max_n], values[max_n][dim]                 required
 *   slots[max_n][slot_floats], last_step[max_n],
 *   counts[max_n], dirty[max_n]                     optional (NULL = skip)
 * flags: KV_EXPORT_DIRTY_ONLY, KV_EXPORT_CLEAR_DIRTY (the latter takes the write
 * lock, else a read lock). Rows created or deleted between calls may be missed or
 * seen once; rows present throughout are seen exactly once.
 */
int kv_table_export(kv_table_t *t, int64_t *cursor, int64_t max_n, int32_t flags,
                    int64_t *keys, float *values, float *slots, uint32_t *last_step,
                    uint32_t *counts, uint8_t *dirty, int64_t *n_out);

/*
 * Insert or overwrite rows with everything they hold (the inverse of export).
 * slots, last_step, counts may be NULL (then: initial slots, 0, 0). Imported rows
 * are marked clean. Duplicate keys: the last one wins. Write lock.
 * Returns KV_OK, KV_EINVAL, KV_ENONFINITE, KV_ENOMEM, KV_EFULL.
 */
int kv_table_import(kv_table_t *t, const int64_t *keys, int64_t n, const float *values,
                    const float *slots, const uint32_t *last_step, const uint32_t *counts);

/*
 * Evict rows. Removes every row with last_step < min_last_step (TTL; 0 = none), then,
 * if more than max_rows (>= 0; negative = no budget) rows remain, the rows beyond
 * max_rows in `policy` order (KV_EVICT_LRU / KV_EVICT_LFU, ties broken as documented
 * there, so the removed set is exactly defined). Exact admission entries last seen
 * before min_last_step are dropped too. The cut-off is found by a two-level radix
 * histogram over the policy's field (O(rows), no sort; only rows tied at the cut-off
 * value are sorted). Freed rows go on the free list; the index is rebuilt in place
 * when more than 1/8 of the rows go, else entries are erased one by one.
 * n_evicted may be NULL. Write lock for the whole call.
 * Returns KV_OK, KV_EINVAL (policy), KV_ENOMEM (nothing changed).
 */
int kv_table_evict(kv_table_t *t, uint32_t min_last_step, int64_t max_rows, int32_t policy,
                   int64_t *n_evicted);

/* Turn the removed-keys log on (on != 0) or off (off also empties it). Write lock. */
int kv_table_track_removed(kv_table_t *t, int32_t on);

/* Move up to max_n keys out of the removed-keys log into out[max_n]; *n_out < max_n
 * means the log is now empty. A key removed twice may appear twice. Write lock. */
int kv_table_take_removed(kv_table_t *t, int64_t *out, int64_t max_n, int64_t *n_out);

/* Fill *out (bytes includes the change trackers' lists). Read lock. */
int kv_table_stats(kv_table_t *t, kv_table_stats_t *out);

/*
 * Change tracking for publishing (see the header comment).
 * kv_table_track_changes: on != 0 starts tracking from now (every row counts as
 *   published: an O(rows) pass clears the publish bits; the lists start empty); 0 stops
 *   it and frees the lists. Rows change as ever either way. Write lock. KV_OK, KV_EINVAL.
 * kv_table_changes_pending: how many row ids (*n_rows: an upper bound of the rows the
 *   next take returns) and removed keys (*n_removed) are listed now, and *lost = 1 if
 *   the next take will be incomplete. Read lock. KV_OK, KV_EINVAL.
 * kv_table_take_changes: under one write lock, the rows changed (or created) since the
 *   last take, keys[i] and values[i][dim] (their values now), and the keys removed
 *   since then, removed[j] (a key removed twice appears twice; a key removed and
 *   created again is in both: apply the removals first), then clear the bits and
 *   empty the lists. Applying them to the state of the last take gives the state now.
 *   If the buffers are too small (max_rows below the listed row ids or max_removed
 *   below the removed keys), nothing is taken and *n_rows = -(ids needed) - 1,
 *   *n_removed = -(keys needed) - 1. *complete = 0 when tracking was lost since the
 *   last take (kv_table_clear, or memory for the list ran out: training calls never
 *   fail because of it): then nothing is returned, every bit is cleared and the caller
 *   must publish the whole table (read after this call). KV_OK; KV_EINVAL (arguments,
 *   or tracking is off).
 * Which calls count as changes: rows created (find_or_create, update, import,
 * apply_gradients with KV_APPLY_CREATE_MISSING), values written (apply_gradients*,
 * update, import); removals by evict, delete and forget_new. kv_table_clear is lost.
 * A removal needs room in the removed log: evict, delete and forget_new return
 * KV_ENOMEM (nothing changed) if it cannot grow, as for the checkpoints' log.
 */
int kv_table_track_changes(kv_table_t *t, int32_t on);
int kv_table_changes_pending(kv_table_t *t, int64_t *n_rows, int64_t *n_removed,
                             int32_t *lost);
int kv_table_take_changes(kv_table_t *t, int64_t max_rows, int64_t *keys, float *values,
                          int64_t max_removed, int64_t *removed, int64_t *n_rows,
                          int64_t *n_removed, int32_t *complete);

/*
 * Admission state, for checkpoints (a resumed run admits exactly as an uninterrupted one).
 * kv_table_export_pending: the KV_ADMIT_EXACT pending map, up to max_n entries (key,
 *   sightings, last sighting's step) from *cursor (start at 0; *cursor advances; fewer
 *   than max_n entries means the end). Read lock. KV_OK, KV_EINVAL.
 * kv_table_import_pending: set those entries (a key that has a row is skipped; counts
 *   must be >= 1); the table must count exactly (else only n = 0 is valid). Write lock.
 *   KV_OK, KV_EINVAL (nothing changed), KV_ENOMEM (nothing changed).
 * kv_table_bloom_bytes: the KV_ADMIT_BLOOM filter's size in bytes (0: no filter).
 * kv_table_export_bloom / kv_table_import_bloom: the filter's bytes and its count of
 *   additions since the last halving; import replaces them, or with merge != 0 keeps
 *   the larger of each counter (filters of several shards merged: may admit a key
 *   earlier, never later). n must be the filter's size. Read / write lock. KV_OK,
 *   KV_EINVAL (nothing changed).
 */
int kv_table_export_pending(kv_table_t *t, int64_t *cursor, int64_t max_n, int64_t *keys,
                            uint32_t *counts, uint32_t *steps, int64_t *n_out);
int kv_table_import_pending(kv_table_t *t, const int64_t *keys, const uint32_t *counts,
                            const uint32_t *steps, int64_t n);
int64_t kv_table_bloom_bytes(kv_table_t *t);
int kv_table_export_bloom(kv_table_t *t, uint8_t *out, int64_t n, uint64_t *adds);
int kv_table_import_bloom(kv_table_t *t, const uint8_t *in, int64_t n, uint64_t adds,
                          int32_t merge);

/* The initial embedding of keys[i] under cfg's seed, table_id and initializer
 * (what find_or_create would create), without a table. Thread-safe. */
int kv_initial_values(const kv_table_config_t *cfg, const int64_t *keys, int64_t n,
                      float *out);

#endif
