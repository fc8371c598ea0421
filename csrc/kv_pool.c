/*
 * kv_pool.c - the exchange kernels' thread pool (see kv_pool.h).
 *
 * State under the mutex m: the job (fn, arg, ntasks), its number gen, the number of
 * workers that finished it, and stop. A job: the caller takes `busy` (trylock: if it
 * is taken, the job runs on the caller alone), publishes the job under m, bumps gen and
 * wakes every worker; then everyone, the caller too, takes task indices from the
 * atomic counter `next` until they run out. Each worker, once out of tasks, counts
 * itself finished under m; the caller returns when all T - 1 have, so no worker still
 * reads the job when the next one is published, and every task's writes happen before
 * kv_pool_run returns (the mutex orders them). A worker that wakes late finds no task
 * left and only counts itself. Workers sleep on a condition variable between jobs (no
 * spinning: on a host whose cores TensorFlow also uses, a spinning thread would take
 * a core from it).
 */
#include "kv_pool.h"

#include <pthread.h>

struct kv_pool {
    int32_t threads;
    pthread_t *workers; /* threads - 1 */
    pthread_mutex_t m;
    pthread_cond_t wake, done;
    pthread_mutex_t busy; /* held by the caller of the job in progress */
    /* under m */
    uint64_t gen;
    int32_t finished;
    int stop;
    void (*fn)(void *, int64_t);
    void *arg;
    int64_t ntasks;
    /* atomic */
    int64_t next;
};

static void run_tasks(kv_pool_t *p, void (*fn)(void *, int64_t), void *arg, int64_t n) {
    for (;;) {
        int64_t i = __atomic_fetch_add(&p->next, 1, __ATOMIC_RELAXED);
        if (i >= n) return;
        fn(arg, i);
    }
}

static void *worker(void *vp) {
    kv_pool_t *p = vp;
    uint64_t seen = 0;
    pthread_mutex_lock(&p->m);
    for (;;) {
        while (p->gen == seen && !p->stop) pthread_cond_wait(&p->wake, &p->m);
        if (p->stop) break;
        seen = p->gen;
        void (*fn)(void *, int64_t) = p->fn;
        void *arg = p->arg;
        int64_t n = p->ntasks;
        pthread_mutex_unlock(&p->m);
        run_tasks(p, fn, arg, n);
        pthread_mutex_lock(&p->m);
        if (++p->finished == p->threads - 1) pthread_cond_signal(&p->done);
    }
    pthread_mutex_unlock(&p->m);
    return NULL;
}

static void stop_workers(kv_pool_t *p, int32_t started) {
    pthread_mutex_lock(&p->m);
    p->stop = 1;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->m);
    for (int32_t i = 0; i < started; i++) pthread_join(p->workers[i], NULL);
}

int kv_pool_create(int32_t threads, kv_pool_t **out) {
    if (!out || threads < 1 || threads > KV_POOL_MAX_THREADS) return KV_EINVAL;
    kv_pool_t *p = kv_calloc(1, sizeof(*p));
    if (!p) return KV_ENOMEM;
    p->threads = threads;
    if (threads > 1) {
        p->workers = kv_calloc((size_t)threads - 1, sizeof(pthread_t));
        if (!p->workers) {
            kv_free(p);
            return KV_ENOMEM;
        }
    }
    if (pthread_mutex_init(&p->m, NULL) || pthread_mutex_init(&p->busy, NULL) ||
        pthread_cond_init(&p->wake, NULL) || pthread_cond_init(&p->done, NULL)) {
        kv_free(p->workers);
        kv_free(p);
        return KV_ENOMEM;
    }
    for (int32_t i = 0; i < threads - 1; i++)
        if (pthread_create(&p->workers[i], NULL, worker, p) != 0) {
            stop_workers(p, i);
            p->threads = 1;
            kv_pool_destroy(p);
            return KV_ENOMEM;
        }
    *out = p;
    return KV_OK;
}

void kv_pool_destroy(kv_pool_t *p) {
    if (!p) return;
    if (p->threads > 1) stop_workers(p, p->threads - 1);
    pthread_mutex_destroy(&p->m);
    pthread_mutex_destroy(&p->busy);
    pthread_cond_destroy(&p->wake);
    pthread_cond_destroy(&p->done);
    kv_free(p->workers);
    kv_free(p);
}

int32_t kv_pool_threads(const kv_pool_t *p) { return p ? p->threads : 1; }

void kv_pool_run(kv_pool_t *p, int64_t ntasks, void (*fn)(void *arg, int64_t task),
                 void *arg) {
    if (ntasks <= 0) return;
    if (!p || p->threads == 1 || ntasks == 1 || pthread_mutex_trylock(&p->busy) != 0) {
        for (int64_t i = 0; i < ntasks; i++) fn(arg, i);
        return;
    }
    pthread_mutex_lock(&p->m);
    p->fn = fn;
    p->arg = arg;
    p->ntasks = ntasks;
    __atomic_store_n(&p->next, 0, __ATOMIC_RELAXED);
    p->finished = 0;
    p->gen++;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->m);
    run_tasks(p, fn, arg, ntasks);
    pthread_mutex_lock(&p->m);
    while (p->finished < p->threads - 1) pthread_cond_wait(&p->done, &p->m);
    pthread_mutex_unlock(&p->m);
    pthread_mutex_unlock(&p->busy);
}
