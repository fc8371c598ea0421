/*
 * kv_pool.c - the exchange kernels' thread pool (see kv_pool.h).
 *
 * A job: the caller takes `busy` (trylock: if it is taken, the job runs on the caller
 * alone), publishes the job under the mutex m (fn, arg, ntasks; a new job number in the
 * high 32 bits of the atomic `ticket`, its next task index, 0, in the low 32) and
 * wakes the workers; then everyone, the caller too, claims task indices from the ticket
 * with a compare-and-swap that succeeds only while the ticket still carries the job
 * number the thread joined, until the indices run out.
 *
 * The caller does not wait for workers to wake up: a worker that is still asleep when
 * the tasks run out has nothing left to do, and on a host whose cores are busy (with
 * TensorFlow, with other ranks) a wake-up can take milliseconds. It waits only while
 * some worker is `active`, i.e. has joined a job (counted under m) and may be running
 * one of its tasks, so every task has returned, and its writes are visible (the mutex
 * orders them), when kv_pool_run returns. A worker that wakes late, even after the
 * next job was published, joins with the job number it read under m: its claim fails
 * on a ticket of another job or past the end, so it never runs a task of a job that
 * has returned (nor one of a later job with an earlier job's fn and arg), and it never
 * takes an index another job needs. Workers sleep on a condition variable between jobs
 * (no spinning: a spinning thread would take a core from TensorFlow).
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
    uint32_t job;   /* the latest job's number */
    int32_t active; /* workers inside a job */
    int stop;
    void (*fn)(void *, int64_t);
    void *arg;
    int64_t ntasks;
    /* atomic: job number << 32 | next task index */
    uint64_t ticket;
};

/* Claim the next task of job `job` (< n): its index, or -1 when there is none left or
 * the ticket belongs to another job. */
static int64_t claim(kv_pool_t *p, uint32_t job, int64_t n) {
    uint64_t t = __atomic_load_n(&p->ticket, __ATOMIC_RELAXED);
    for (;;) {
        if ((uint32_t)(t >> 32) != job || (int64_t)(t & 0xffffffffu) >= n) return -1;
        if (__atomic_compare_exchange_n(&p->ticket, &t, t + 1, 1, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED))
            return (int64_t)(t & 0xffffffffu);
    }
}

static void run_tasks(kv_pool_t *p, uint32_t job, void (*fn)(void *, int64_t), void *arg,
                      int64_t n) {
    for (int64_t i; (i = claim(p, job, n)) >= 0;) fn(arg, i);
}

static void *worker(void *vp) {
    kv_pool_t *p = vp;
    uint32_t seen = 0;
    pthread_mutex_lock(&p->m);
    for (;;) {
        while (p->job == seen && !p->stop) pthread_cond_wait(&p->wake, &p->m);
        if (p->stop) break;
        uint32_t job = seen = p->job;
        void (*fn)(void *, int64_t) = p->fn;
        void *arg = p->arg;
        int64_t n = p->ntasks;
        p->active++;
        pthread_mutex_unlock(&p->m);
        run_tasks(p, job, fn, arg, n);
        pthread_mutex_lock(&p->m);
        if (--p->active == 0) pthread_cond_broadcast(&p->done);
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
    if (!p || p->threads == 1 || ntasks == 1 || ntasks > INT32_MAX ||
        pthread_mutex_trylock(&p->busy) != 0) {
        for (int64_t i = 0; i < ntasks; i++) fn(arg, i);
        return;
    }
    pthread_mutex_lock(&p->m);
    uint32_t job = ++p->job;
    if (!job) job = ++p->job; /* 0 is every worker's "seen nothing yet" */
    p->fn = fn;
    p->arg = arg;
    p->ntasks = ntasks;
    __atomic_store_n(&p->ticket, (uint64_t)job << 32, __ATOMIC_RELAXED);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->m);
    run_tasks(p, job, fn, arg, ntasks);
    pthread_mutex_lock(&p->m);
    while (p->active > 0) pthread_cond_wait(&p->done, &p->m);
    pthread_mutex_unlock(&p->m);
    pthread_mutex_unlock(&p->busy);
}
