/*
 * kv_status.c - status texts and the process-wide allocator hook.
 *
 * Every heap allocation of the C core goes through kv_malloc / kv_calloc /
 * kv_realloc / kv_free, which call the functions installed by kv_set_allocator
 * (malloc, realloc and free by default). The tests install an allocator that fails
 * on the k-th call to walk every out-of-memory path.
 *
 * Invariants:
 *   - the three hooks are always non-NULL (NULL arguments restore the defaults);
 *   - kv_calloc checks count * size for overflow before allocating and zeroes the
 *     memory itself, so a hook needs no calloc;
 *   - kv_malloc(0) / kv_realloc(p, 0) ask the hook for 1 byte, so a non-NULL result
 *     always means success and NULL always means failure;
 *   - kv_free(NULL) does nothing.
 */
#include "kv_status.h"

#include <stdlib.h>
#include <string.h>

static void *(*g_alloc)(size_t) = malloc;
static void *(*g_realloc)(void *, size_t) = realloc;
static void (*g_free)(void *) = free;

const char *kv_strerror(int code) {
    switch (code) {
    case KV_OK: return "success";
    case KV_ENOMEM: return "out of memory (nothing was changed)";
    case KV_EINVAL: return "invalid argument (size, dimension, pointer or flag out of range)";
    case KV_ENONFINITE: return "a value or gradient is NaN or Inf (nothing was changed)";
    case KV_EFULL: return "the table is full (at most 2^32 - 2 rows per shard)";
    case KV_EOPTIM: return "invalid optimizer kind or hyperparameters";
    case KV_EINIT: return "invalid initializer kind or parameters";
    default: return "unknown kvcoll status code";
    }
}

void kv_set_allocator(void *(*alloc)(size_t), void *(*realloc_fn)(void *, size_t),
                      void (*free_fn)(void *)) {
    g_alloc = alloc ? alloc : malloc;
    g_realloc = realloc_fn ? realloc_fn : realloc;
    g_free = free_fn ? free_fn : free;
}

void *kv_malloc(size_t n) { return g_alloc(n ? n : 1); }

void *kv_calloc(size_t count, size_t size) {
    if (size && count > SIZE_MAX / size) return NULL;
    size_t n = count * size;
    void *p = kv_malloc(n);
    if (p) memset(p, 0, n);
    return p;
}

void *kv_realloc(void *p, size_t n) { return g_realloc(p, n ? n : 1); }

void kv_free(void *p) {
    if (p) g_free(p);
}
