/*
 * kv_init.h - a new key's initial embedding (kv_table_config_t's initializer).
 *
 * Element e of key k is a function of (seed, table_id, k, e, initializer) only: never
 * of the batch, its order or split, the rank, the thread or the CPU. On x86-64 the
 * batch kernel is compiled for the baseline ISA, AVX2 and AVX-512 and picked at run
 * time; every copy gives the same bits (see kv_init.c).
 *
 * The public entry is kv_initial_values (declared in kv_table.h); kv_table.c calls
 * kv_init_check and kv_init_rows.
 */
#ifndef KV_INIT_H
#define KV_INIT_H

#include <stdint.h>
#include "kv_table.h"

/* Which compiled copy of the kernel runs. All give the same bits. */
#define KV_INIT_ISA_BEST 0   /* the fastest this CPU runs (what tables use) */
#define KV_INIT_ISA_BASE 1   /* baseline (x86-64: SSE2) */
#define KV_INIT_ISA_AVX2 2   /* x86-64 with AVX2 */
#define KV_INIT_ISA_AVX512 3 /* x86-64 with AVX-512 F, DQ, VL, BW */

/* KV_OK, or KV_EINIT if cfg's initializer (kind, a, b) is invalid. dim is not checked. */
int kv_init_check(const kv_table_config_t *cfg);

/* out[i][0 .. cfg->dim) = the initial embedding of keys[i], i < n; cfg has passed
 * kv_init_check and has 1 <= dim <= KV_MAX_DIM. */
void kv_init_rows(const kv_table_config_t *cfg, const int64_t *keys, int64_t n,
                  float *const *out);

/* The highest KV_INIT_ISA_* level this CPU (and this build) runs. */
int kv_init_best_isa(void);

/* kv_initial_values computed by one given copy of the kernel (for tests and
 * benchmarks). KV_EINVAL if isa is neither BEST nor a level <= kv_init_best_isa(). */
int kv_initial_values_isa(const kv_table_config_t *cfg, const int64_t *keys, int64_t n,
                          float *out, int32_t isa);

#endif
