/*
 * kv_pool.h - a small pool of threads for the exchange kernels' per-step table work.
 *
 * A pool of T threads is the caller plus T - 1 workers, which sleep on a condition
 * variable between jobs. kv_pool_run(p, n, fn, arg) runs fn(arg, 0), .., fn(arg, n - 1)
 * on them and returns when all have run: tasks are handed out in order from a shared
 * counter, so which thread runs which task varies from run to run. Tasks must therefore
 * write disjoint outputs and must not depend on each other: then what a job computes
 * never depends on the number of threads or the schedule, and the kernels built on it
 * (kv_exchange.c) give the same bits with one thread or many.
 *
 * One job at a time per pool: a kv_pool_run while another is in progress on the same
 * pool (from another thread, or from inside a task) runs its tasks on the calling
 * thread alone, so nested or concurrent use is correct, only not parallel. A NULL pool,
 * or one of one thread, runs everything on the caller: no thread is ever started.
 *
 * kv_pool_create and kv_pool_destroy are not thread-safe with respect to the same pool;
 * kv_pool_run and kv_pool_threads are.
 */
#ifndef KV_POOL_H
#define KV_POOL_H

#include <stdint.h>
#include "kv_status.h"

#define KV_POOL_MAX_THREADS 256

typedef struct kv_pool kv_pool_t;

/* A pool of `threads` threads (1 .. KV_POOL_MAX_THREADS; the caller counts as one).
 * *out is set only on KV_OK. Returns KV_OK, KV_EINVAL, KV_ENOMEM (memory or a thread
 * that could not be started; nothing is left running). */
int kv_pool_create(int32_t threads, kv_pool_t **out);

/* Stop and join the workers, free the pool. p may be NULL. No kv_pool_run may be in
 * progress on p, and none may start after. */
void kv_pool_destroy(kv_pool_t *p);

/* The pool's threads (the caller included); 1 for NULL. */
int32_t kv_pool_threads(const kv_pool_t *p);

/* Run fn(arg, task) for every task in [0, ntasks) (ntasks <= 0: nothing) on the pool's
 * threads, the caller's included; returns when every task has returned. */
void kv_pool_run(kv_pool_t *p, int64_t ntasks, void (*fn)(void *arg, int64_t task),
                 void *arg);

#endif
