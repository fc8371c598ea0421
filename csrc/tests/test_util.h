/*
 * test_util.h - the few helpers the C tests share: CHECK counters, a summary line,
 * a deterministic RNG, and an allocator that fails on purpose.
 *
 * CHECK(cond) counts a pass or prints "file:line: CHECK failed: cond" and counts a
 * failure; test programs end with `return test_summary();`, which prints
 * "N passed, M failed" and returns non-zero if anything failed.
 *
 * fail_alloc_arm(k) makes the k-th allocation from now (k >= 1) return NULL, once;
 * fail_alloc_arm(0) disarms it. Install with kv_set_allocator(fail_malloc,
 * fail_realloc, free) (fail_alloc_install()).
 */
#ifndef KV_TEST_UTIL_H
#define KV_TEST_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "../kv_status.h"

static long g_pass, g_fail;

#define CHECK(cond)                                                               \
    do {                                                                          \
        if (cond) {                                                               \
            g_pass++;                                                             \
        } else {                                                                  \
            g_fail++;                                                             \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
        }                                                                         \
    } while (0)

#define CHECK_EQ_INT(a, b)                                                        \
    do {                                                                          \
        long long va_ = (long long)(a), vb_ = (long long)(b);                     \
        if (va_ == vb_) {                                                         \
            g_pass++;                                                             \
        } else {                                                                  \
            g_fail++;                                                             \
            fprintf(stderr, "%s:%d: CHECK failed: %s == %s (%lld vs %lld)\n",     \
                    __FILE__, __LINE__, #a, #b, va_, vb_);                        \
        }                                                                         \
    } while (0)

static inline int test_summary(void) {
    printf("%ld passed, %ld failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}

/* splitmix64: deterministic test data */
static inline uint64_t test_rand(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

static long g_fail_countdown; /* 0 = disarmed */
static long g_alloc_calls;

static inline void fail_alloc_arm(long k) { g_fail_countdown = k; }

static inline int fail_alloc_should_fail(void) {
    g_alloc_calls++;
    if (g_fail_countdown > 0 && --g_fail_countdown == 0) return 1;
    return 0;
}

static void *fail_malloc(size_t n) { return fail_alloc_should_fail() ? NULL : malloc(n); }
static void *fail_realloc(void *p, size_t n) {
    return fail_alloc_should_fail() ? NULL : realloc(p, n);
}
static inline void fail_alloc_install(void) { kv_set_allocator(fail_malloc, fail_realloc, free); }

#endif
