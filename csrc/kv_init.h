/*
 * kv_init.h - a new key's initial embedding (kv_table_config_t's initializer).
 *
 * Element e of key k is a function of (seed, table_id, k, e, initializer) only: never
 * of the batch, its order or split, the rank, the thread or the CPU.
 *
 * The public entry is kv_initial_values (declared in kv_table.h); kv_table.c calls
 * kv_init_check and kv_init_rows.
 */
#ifndef KV_INIT_H
#define KV_INIT_H

#include <stdint.h>
#include "kv_table.h"

/* KV_OK, or KV_EINIT if cfg's initializer (kind, a, b) is invalid. dim is not checked. */
int kv_init_check(const kv_table_config_t *cfg);

/* out[i][0 .. cfg->dim) = the initial embedding of keys[i], i < n; cfg has passed
 * kv_init_check and has 1 <= dim <= KV_MAX_DIM. */
void kv_init_rows(const kv_table_config_t *cfg, const int64_t *keys, int64_t n,
                  float *const *out);

#endif
