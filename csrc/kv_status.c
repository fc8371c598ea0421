/*
 * kv_status.c - status texts and the process-wide allocator hook.
 *
 * Every heap allocation of the C core goes through kv_malloc / kv_calloc /
 * kv_realloc / kv_free, which call the functions installed by kv_set_allocator
 * (malloc, realloc and free by default). The tests install an allocator that fails
 * on the k-th call to walk every out-of-memory path. Large table blocks use
 * kv_alloc_huge: 2 MiB-aligned anonymous mappings advised MADV_HUGEPAGE (unless
 * kv_set_huge_advice(0)), or the hook while a test allocator is installed.
 *
 * Invariants:
 *   - the three hooks are always non-NULL (NULL arguments restore the defaults);
 *   - kv_calloc checks count * size for overflow before allocating and zeroes the
 *     memory itself, so a hook needs no calloc;
 *   - kv_malloc(0) / kv_realloc(p, 0) ask the hook for 1 byte, so a non-NULL result
 *     always means success and NULL always means failure;
 *   - kv_free(NULL) does nothing;
 *   - kv_alloc_huge / kv_free_huge / kv_huge_size agree on the path of a block of n
 *     bytes (mmap or the hook) because the rule depends only on n and on whether a
 *     test allocator is installed, which never changes while a block is live.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "kv_status.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

static void *(*g_alloc)(size_t) = malloc;
static void *(*g_realloc)(void *, size_t) = realloc;
static void (*g_free)(void *) = free;
static int g_custom; /* a test allocator is installed: huge blocks go through it */

const char *kv_strerror(int code) {
    switch (code) {
    case KV_OK: return "success";
    case KV_ENOMEM: return "out of memory (nothing was changed)";
    case KV_EINVAL: return "invalid argument (size, dimension, pointer or flag out of range)";
    case KV_ENONFINITE: return "a value or gradient is NaN or Inf (nothing was changed)";
    case KV_EFULL: return "the shard is full (32-bit row ids: about 3.4e9 rows at dim 16, fewer for wide rows); use more ranks";
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
    g_custom = alloc || realloc_fn || free_fn;
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

/* ---- huge blocks ---------------------------------------------------------------- */

#define HUGE_ALIGN ((size_t)2 << 20)
#define PAGE ((size_t)4096)

static int use_mmap(size_t n) { return !g_custom && n >= KV_HUGE_MIN; }

static int g_huge_advice = 1; /* kv_set_huge_advice: advise MADV_HUGEPAGE (default) */

void kv_set_huge_advice(int on) { __atomic_store_n(&g_huge_advice, on != 0, __ATOMIC_RELAXED); }

int kv_huge_advice(void) { return __atomic_load_n(&g_huge_advice, __ATOMIC_RELAXED); }

size_t kv_huge_size(size_t n) {
    return use_mmap(n) ? (n + PAGE - 1) & ~(PAGE - 1) : n;
}

void *kv_alloc_huge(size_t n) {
    if (!use_mmap(n)) {
        void *p = kv_malloc(n);
        if (p) memset(p, 0, n);
        return p;
    }
    size_t len = kv_huge_size(n);
    if (len < n || len > SIZE_MAX - HUGE_ALIGN) return NULL;
    /* map 2 MiB - 4 KiB more, then unmap the unaligned head and the tail */
    size_t span = len + HUGE_ALIGN - PAGE;
    unsigned char *m = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return NULL;
    uintptr_t a = ((uintptr_t)m + HUGE_ALIGN - 1) & ~(uintptr_t)(HUGE_ALIGN - 1);
    unsigned char *p = (unsigned char *)a;
    size_t head = (size_t)(p - m), tail = span - head - len;
    if (head) munmap(m, head);
    if (tail) munmap(p + len, tail);
#ifdef MADV_HUGEPAGE
    if (kv_huge_advice()) (void)madvise(p, len, MADV_HUGEPAGE); /* 4 KiB pages if it fails */
#endif
    return p; /* anonymous mappings are zero-filled */
}

void kv_free_huge(void *p, size_t n) {
    if (!p) return;
    if (use_mmap(n))
        munmap(p, kv_huge_size(n));
    else
        g_free(p);
}
