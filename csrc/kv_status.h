/*
 * kv_status.h - status codes and the allocator hook shared by every kvcoll C file.
 *
 * Every fallible kvcoll function returns an int: KV_OK (0) or one of the negative
 * KV_E* codes below. C never aborts and never prints; kv_strerror() turns a code
 * into text and the Python layer (kvcoll/table.py, one function) turns it into a
 * typed exception.
 *
 * All heap memory goes through kv_malloc/kv_calloc/kv_realloc/kv_free so the C
 * tests can install an allocator that fails on purpose (kv_set_allocator) and prove
 * that every out-of-memory path returns KV_ENOMEM and leaves the table unchanged.
 */
#ifndef KV_STATUS_H
#define KV_STATUS_H

#include <stddef.h>
#include <stdint.h>

#define KV_OK 0
#define KV_ENOMEM (-1)      /* an allocation failed; nothing was changed */
#define KV_EINVAL (-2)      /* an argument is out of range (dim, sizes, NULL pointer, ...) */
#define KV_ENONFINITE (-3)  /* a gradient or value is NaN or Inf; nothing was changed */
#define KV_EFULL (-4)       /* the table reached its row limit (2^32 - 2 rows per shard) */
#define KV_EOPTIM (-5)      /* bad optimizer kind or hyperparameters */
#define KV_EINIT (-6)       /* bad initializer kind or parameters */

/* Text for a status code; never NULL, static storage. Thread-safe. */
const char *kv_strerror(int code);

/* Replace the allocator (tests only). Passing NULLs restores malloc/realloc/free.
 * Not thread-safe: call before any table exists. */
void kv_set_allocator(void *(*alloc)(size_t), void *(*realloc_fn)(void *, size_t),
                      void (*free_fn)(void *));

void *kv_malloc(size_t n);
void *kv_calloc(size_t count, size_t size); /* overflow-checked, zeroed */
void *kv_realloc(void *p, size_t n);
void kv_free(void *p);

#endif
