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
 * meta = update count in bits 0..29 (saturating), bit 31 = dirty (created or changed
 * since the last export with KV_EXPORT_CLEAR_DIRTY; import_ leaves rows clean).
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
 *   write lock (exclusive): every other kv_table_* call
 * So any two calls may run on one table from two threads at once, except
 * kv_table_destroy, which must be the last call on a table.
 */
#ifndef KV_TABLE_H
#define KV_TABLE_H

#include <stdint.h>
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
} kv_table_stats_t;

/* Create an empty table. *out is set only on KV_OK.
 * Returns KV_OK, KV_EINVAL (dim, capacity), KV_EINIT, KV_EOPTIM, KV_ENOMEM. */
int kv_table_create(const kv_table_config_t *cfg, kv_table_t **out);

/* Free everything. t may be NULL. Must be the last call on t. */
void kv_table_destroy(kv_table_t *t);

/* Number of live keys. Read lock. */
int64_t kv_table_size(kv_table_t *t);

/* Read-only lookup: out[i][dim] = embedding of keys[i], or default_row (NULL: zeros)
 * if absent; found[i] = 1 or 0 (found may be NULL). Read lock. KV_OK or KV_EINVAL. */
int kv_table_find(kv_table_t *t, const int64_t *keys, int64_t n, float *out,
                  uint8_t *found, const float *default_row);

/* Lookup, creating missing keys with their initial value; out[i][dim] as above.
 * Sets last_step = step on every row it returns. n_created (may be NULL) gets the
 * number of keys created (duplicates in keys create one row).
 * Write lock. KV_OK, KV_EINVAL, KV_ENOMEM, KV_EFULL. */
int kv_table_find_or_create(kv_table_t *t, const int64_t *keys, int64_t n, float *out,
                            uint32_t step, int64_t *n_created);

/* Assign embedding values: values[i][dim] becomes the row of keys[i], creating the
 * row (slots initialised) if absent. Duplicate keys: the last one wins. Marks rows
 * dirty. Write lock. KV_OK, KV_EINVAL, KV_ENONFINITE, KV_ENOMEM, KV_EFULL. */
int kv_table_update(kv_table_t *t, const int64_t *keys, int64_t n, const float *values);

/* Remove keys (absent ones are ignored). n_deleted may be NULL.
 * Write lock. KV_OK or KV_EINVAL. */
int kv_table_delete(kv_table_t *t, const int64_t *keys, int64_t n, int64_t *n_deleted);

/* Remove every key; keeps the allocated memory. Write lock. */
int kv_table_clear(kv_table_t *t);

/*
 * Apply gradients with the table's row optimizer. grads[i][dim] belongs to keys[i];
 * duplicate keys are summed first and applied once. The whole batch is checked for
 * NaN/Inf before anything changes (KV_ENONFINITE). `step` (>= 1) feeds Adam's bias
 * correction; every updated row gets last_step = step, count += 1, dirty = 1.
 * Missing keys are skipped and counted in n_missing (may be NULL) unless flags has
 * KV_APPLY_CREATE_MISSING. Write lock.
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

/* Fill *out. Read lock. */
int kv_table_stats(kv_table_t *t, kv_table_stats_t *out);

/* The initial embedding of keys[i] under cfg's seed, table_id and initializer
 * (what find_or_create would create), without a table. Thread-safe. */
int kv_initial_values(const kv_table_config_t *cfg, const int64_t *keys, int64_t n,
                      float *out);

#endif
