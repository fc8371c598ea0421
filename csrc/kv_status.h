/*
 * kv_status.h - status codes and the allocator hook shared by every kvcoll C file.
 *
 * Every fallible kvcoll function returns an int: KV_OK (0) or one of the negative
 * KV_E* codes below. C never aborts and never prints; kv_strerror() turns a code
 * into text and the Python layer (kvcoll/_c.py, one function) turns it into a
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
#define KV_EFULL (-4)       /* the shard ran out of 32-bit row ids */
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

/*
 * Large, zeroed, 2 MiB-aligned blocks for the table's arena chunks and index.
 * With the default allocator, a block of at least KV_HUGE_MIN bytes is an anonymous
 * mapping of kv_huge_size(n) bytes (n rounded up to whole 4 KiB pages), aligned to
 * 2 MiB and advised MADV_HUGEPAGE, so transparent huge pages can back it and a
 * random access costs no 4 KiB TLB miss; smaller blocks, and every block while a
 * test allocator is installed, come from kv_malloc (zeroed here, no alignment
 * promised), so the out-of-memory tests reach these allocations too.
 * kv_free_huge needs the n given to kv_alloc_huge, and the allocator must not change
 * while a block is live (kv_set_allocator: only when no table exists).
 */
#define KV_HUGE_MIN ((size_t)1 << 20)
void *kv_alloc_huge(size_t n);
void kv_free_huge(void *p, size_t n);
size_t kv_huge_size(size_t n); /* bytes a block of n bytes really holds */
/* Whether kv_alloc_huge advises MADV_HUGEPAGE (on by default), process-wide, for the
 * blocks it maps from now on (thread-safe). Off, a block gets huge pages only where the
 * system gives them unasked (transparent_hugepage "always"). Huge pages spare random
 * row accesses the 4 KiB TLB misses, but where a host backs a VM's memory lazily their
 * first touch can cost several times that of 4 KiB pages (kvcoll.Config huge_pages). */
void kv_set_huge_advice(int on);
int kv_huge_advice(void);

#endif
