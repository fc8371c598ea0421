/*
 * test_pool.c - the exchange kernels' thread pool (kv_pool.h).
 *
 *   - every task of a job runs exactly once, whatever the pool's size (1 .. 8) and the
 *     number of tasks (0, 1, fewer and many more than the threads), and its writes are
 *     seen by the caller when kv_pool_run returns;
 *   - the tasks really run on several threads when the pool has them;
 *   - a run from inside a task, or from a second thread while a job is in progress,
 *     runs on its own caller (correct, not parallel) and does not deadlock;
 *   - thousands of small jobs in a row (the pool's hand-over between jobs);
 *   - bad arguments; a NULL pool.
 * Built with ASan/UBSan by `make test` and with ThreadSanitizer by `make tsan`.
 */
#include <pthread.h>
#include <string.h>

#include "../kv_pool.h"
#include "test_util.h"

typedef struct {
    int64_t *hits;
    pthread_t *who;
} count_job_t;

static void count_task(void *arg, int64_t i) {
    count_job_t *j = arg;
    __atomic_fetch_add(&j->hits[i], 1, __ATOMIC_RELAXED);
    j->who[i] = pthread_self();
}

static void test_every_task_once(void) {
    enum { N = 5000 };
    static int64_t hits[N];
    static pthread_t who[N];
    for (int32_t threads = 1; threads <= 8; threads++) {
        kv_pool_t *p = NULL;
        CHECK_EQ_INT(kv_pool_create(threads, &p), KV_OK);
        CHECK_EQ_INT(kv_pool_threads(p), threads);
        static const int64_t sizes[] = {0, 1, 2, 3, 7, 64, N};
        for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
            memset(hits, 0, sizeof hits);
            count_job_t j = {hits, who};
            kv_pool_run(p, sizes[s], count_task, &j);
            int ok = 1;
            for (int64_t i = 0; i < N; i++) ok &= hits[i] == (i < sizes[s]);
            CHECK(ok);
        }
        kv_pool_destroy(p);
    }
    kv_pool_destroy(NULL);
    CHECK_EQ_INT(kv_pool_threads(NULL), 1);
}

/* Slow tasks on a pool of 4: more than one thread takes part. */
static void slow_task(void *arg, int64_t i) {
    count_job_t *j = arg;
    volatile double x = 0;
    for (int k = 0; k < 200000; k++) x += k * 1e-9;
    j->who[i] = pthread_self();
    (void)x;
}

static void test_parallel(void) {
    enum { N = 64 };
    int64_t hits[N];
    pthread_t who[N];
    kv_pool_t *p;
    CHECK_EQ_INT(kv_pool_create(4, &p), KV_OK);
    count_job_t j = {hits, who};
    int distinct = 1;
    for (int attempt = 0; attempt < 20 && distinct < 2; attempt++) {
        kv_pool_run(p, N, slow_task, &j);
        distinct = 1;
        for (int i = 1; i < N; i++)
            if (!pthread_equal(who[i], who[0])) distinct = 2;
    }
    CHECK_EQ_INT(distinct, 2);
    kv_pool_destroy(p);
}

/* A task that runs a job of its own on the same pool. */
typedef struct {
    kv_pool_t *p;
    int64_t inner[16][8];
} nest_job_t;

static void inner_task(void *arg, int64_t i) { ((int64_t *)arg)[i] += 1; }

static void outer_task(void *arg, int64_t i) {
    nest_job_t *j = arg;
    kv_pool_run(j->p, 8, inner_task, j->inner[i]);
}

static void test_nested(void) {
    kv_pool_t *p;
    CHECK_EQ_INT(kv_pool_create(3, &p), KV_OK);
    static nest_job_t j;
    memset(&j, 0, sizeof j);
    j.p = p;
    kv_pool_run(p, 16, outer_task, &j);
    int ok = 1;
    for (int i = 0; i < 16; i++)
        for (int k = 0; k < 8; k++) ok &= j.inner[i][k] == 1;
    CHECK(ok);
    kv_pool_destroy(p);
}

/* Two threads running jobs on one pool at once, many times. */
typedef struct {
    kv_pool_t *p;
    int64_t sum;
} racer_t;

static void add_task(void *arg, int64_t i) {
    __atomic_fetch_add((int64_t *)arg, i, __ATOMIC_RELAXED);
}

static void *racer(void *arg) {
    racer_t *r = arg;
    for (int k = 0; k < 2000; k++) kv_pool_run(r->p, 10, add_task, &r->sum);
    return NULL;
}

static void test_concurrent_callers(void) {
    kv_pool_t *p;
    CHECK_EQ_INT(kv_pool_create(2, &p), KV_OK);
    racer_t a = {p, 0}, b = {p, 0};
    pthread_t ta, tb;
    CHECK_EQ_INT(pthread_create(&ta, NULL, racer, &a), 0);
    CHECK_EQ_INT(pthread_create(&tb, NULL, racer, &b), 0);
    pthread_join(ta, NULL);
    pthread_join(tb, NULL);
    CHECK_EQ_INT(a.sum, 2000 * 45);
    CHECK_EQ_INT(b.sum, 2000 * 45);
    kv_pool_destroy(p);
}

/* Many small jobs in a row: a worker that wakes late never runs a task twice, nor a
 * task of a job that has returned (each job's tasks count into that job's own slots). */
typedef struct {
    int64_t *slots;
} small_job_t;

static void small_task(void *arg, int64_t i) {
    small_job_t *j = arg;
    __atomic_fetch_add(&j->slots[i], 1, __ATOMIC_RELAXED);
}

static void test_many_small_jobs(void) {
    enum { JOBS = 20000, TASKS = 3 };
    static int64_t slots[JOBS][TASKS];
    memset(slots, 0, sizeof slots);
    kv_pool_t *p;
    CHECK_EQ_INT(kv_pool_create(4, &p), KV_OK);
    for (int k = 0; k < JOBS; k++) {
        small_job_t j = {slots[k]};
        kv_pool_run(p, TASKS, small_task, &j);
    }
    int ok = 1;
    for (int k = 0; k < JOBS; k++)
        for (int i = 0; i < TASKS; i++) ok &= slots[k][i] == 1;
    CHECK(ok);
    kv_pool_destroy(p);
}

static void test_errors(void) {
    kv_pool_t *p = (kv_pool_t *)&p;
    CHECK_EQ_INT(kv_pool_create(0, &p), KV_EINVAL);
    CHECK_EQ_INT(kv_pool_create(KV_POOL_MAX_THREADS + 1, &p), KV_EINVAL);
    CHECK_EQ_INT(kv_pool_create(2, NULL), KV_EINVAL);
    CHECK(p == (kv_pool_t *)&p); /* untouched */
    int64_t sum = 0;
    kv_pool_run(NULL, 10, add_task, &sum); /* no pool: the caller runs them */
    CHECK_EQ_INT(sum, 45);
    /* a failed allocation: a clean error */
    fail_alloc_install();
    for (int k = 1; k <= 2; k++) {
        fail_alloc_arm(k);
        kv_pool_t *q = NULL;
        CHECK_EQ_INT(kv_pool_create(3, &q), KV_ENOMEM);
        CHECK(q == NULL);
        fail_alloc_arm(0);
    }
    kv_set_allocator(NULL, NULL, NULL);
}

int main(void) {
    test_every_task_once();
    test_parallel();
    test_nested();
    test_concurrent_callers();
    test_many_small_jobs();
    test_errors();
    return test_summary();
}
