/*
 * test_poll.c - kv_poll_wait and kv_poll_ring (kv_poll.h) against stand-ins for
 * MPI_Iprobe.
 *
 * Checked: a message already there returns at once; one that arrives after k probes is
 * found on the k-th, with the caller's source, tag, communicator and status passed
 * through (as a pointer and as an int handle); a doorbell rung before the wait returns
 * KV_POLL_RUNG at once and is silenced by it; one rung mid-pause by another thread (a
 * private futex) or by another process (a shared one, on a MAP_SHARED page, across
 * fork) ends a pause of seconds at once; the budget returns KV_POLL_IDLE, neither early
 * nor much late, with the pauses doubling up to max_ns (the number of probes); with no
 * doorbell the pauses are plain sleeps; an MPI error comes back negated, at once.
 */
#include <pthread.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../kv_poll.h"
#include "test_util.h"

static int g_probes, g_ready_at, g_rc, g_src, g_tag;
static void *g_comm_ptr;
static int g_comm_int;
static void *g_status;

static int fake_ptr(int source, int tag, void *comm, int *flag, void *status) {
    g_probes++;
    g_src = source, g_tag = tag, g_comm_ptr = comm, g_status = status;
    if (g_rc) return g_rc;
    *flag = g_ready_at > 0 && g_probes >= g_ready_at;
    return 0;
}

static int fake_int(int source, int tag, int comm, int *flag, void *status) {
    g_comm_int = comm;
    return fake_ptr(source, tag, NULL, flag, status);
}

static void reset(int ready_at, int rc) {
    g_probes = 0, g_ready_at = ready_at, g_rc = rc;
    g_src = g_tag = g_comm_int = 0;
    g_comm_ptr = g_status = NULL;
}

static double seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void nap_ms(int ms) {
    struct timespec ts = {0, ms * 1000L * 1000L};
    nanosleep(&ts, NULL);
}

static int32_t g_bell;

static void *ring_later(void *arg) {
    (void)arg;
    nap_ms(20);
    kv_poll_ring(&g_bell, 0);
    return NULL;
}

int main(void) {
    char status[64];
    int32_t bell = 0;
    const int64_t us = 1000, ms = 1000 * 1000, s = 1000 * ms;

    /* a message already there: found by the first probe */
    reset(1, 0);
    CHECK_EQ_INT(kv_poll_wait((void *)fake_ptr, 0, (intptr_t)0x1234, -1, 11, status, 20 * us,
                              200 * us, s, &bell, 0), KV_POLL_MESSAGE);
    CHECK_EQ_INT(g_probes, 1);
    CHECK_EQ_INT(g_src, -1);
    CHECK_EQ_INT(g_tag, 11);
    CHECK(g_comm_ptr == (void *)0x1234);
    CHECK(g_status == (void *)status);

    /* after 5 probes; an int handle; no doorbell */
    reset(5, 0);
    CHECK_EQ_INT(kv_poll_wait((void *)fake_int, 1, 91, 3, 12, status, 20 * us, 200 * us, s,
                              NULL, 0), KV_POLL_MESSAGE);
    CHECK_EQ_INT(g_probes, 5);
    CHECK_EQ_INT(g_comm_int, 91);
    CHECK_EQ_INT(g_src, 3);

    /* rung before the wait: at once, and silenced */
    reset(0, 0);
    kv_poll_ring(&bell, 0);
    CHECK_EQ_INT(bell, 1);
    kv_poll_ring(&bell, 0);   /* rung twice: still one call's worth */
    CHECK_EQ_INT(kv_poll_wait((void *)fake_ptr, 0, 1, -1, 11, status, 20 * us, 200 * us, s,
                              &bell, 0), KV_POLL_RUNG);
    CHECK_EQ_INT(g_probes, 1);
    CHECK_EQ_INT(bell, 0);

    /* rung by another thread during a pause of 5 s */
    reset(0, 0);
    g_bell = 0;
    pthread_t th;
    double t0 = seconds();
    CHECK_EQ_INT(pthread_create(&th, NULL, ring_later, NULL), 0);
    CHECK_EQ_INT(kv_poll_wait((void *)fake_ptr, 0, 1, -1, 11, status, 5 * s, 5 * s, 10 * s,
                              &g_bell, 0), KV_POLL_RUNG);
    double waited = seconds() - t0;
    pthread_join(th, NULL);
    CHECK(waited >= 0.015 && waited < 2.0);
    CHECK(g_probes <= 3);

    /* rung by another process: a shared futex on a MAP_SHARED page */
    int32_t *shared = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(shared != MAP_FAILED);
    if (shared != MAP_FAILED) {
        *shared = 0;
        pid_t child = fork();
        if (child == 0) {
            nap_ms(30);
            kv_poll_ring(shared, 1);
            _exit(0);
        }
        reset(0, 0);
        t0 = seconds();
        CHECK_EQ_INT(kv_poll_wait((void *)fake_ptr, 0, 1, -1, 11, status, 5 * s, 5 * s, 10 * s,
                                  shared, 1), KV_POLL_RUNG);
        waited = seconds() - t0;
        CHECK(waited >= 0.02 && waited < 2.0);
        int st = -1;
        CHECK_EQ_INT(waitpid(child, &st, 0), child);
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0);
        munmap(shared, 4096);
    }

    /* the budget: 30 ms of nothing; pauses 20 us doubling to 1 ms, then 1 ms each */
    for (int with_bell = 0; with_bell < 2; with_bell++) {
        reset(0, 0);
        bell = 0;
        t0 = seconds();
        CHECK_EQ_INT(kv_poll_wait((void *)fake_ptr, 0, 1, -1, 11, status, 20 * us, 1 * ms,
                                  30 * ms, with_bell ? &bell : NULL, 0), KV_POLL_IDLE);
        waited = seconds() - t0;
        CHECK(waited >= 0.030 && waited < 1.0);
        /* 20+40+...+640 us = 1.26 ms in 6 probes, then at most one a ms: about 35 probes
         * on time; fewer on a loaded machine, never more (a probe per pause) */
        CHECK(g_probes >= 6 && g_probes <= 36);
    }

    /* a zero budget probes once */
    reset(0, 0);
    CHECK_EQ_INT(kv_poll_wait((void *)fake_ptr, 0, 1, -1, 11, status, 20 * us, 1 * ms, 0,
                              &bell, 0), KV_POLL_IDLE);
    CHECK_EQ_INT(g_probes, 1);

    /* an MPI error: negated, at once */
    reset(0, 75);
    CHECK_EQ_INT(kv_poll_wait((void *)fake_ptr, 0, 1, -1, 11, status, 20 * us, 1 * ms, s,
                              &bell, 0), -75);
    CHECK_EQ_INT(g_probes, 1);
    return test_summary();
}
