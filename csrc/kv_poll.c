/* kv_poll.c - see kv_poll.h. */
#include "kv_poll.h"

#include <linux/futex.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

typedef int (*iprobe_ptr_t)(int source, int tag, void *comm, int *flag, void *status);
typedef int (*iprobe_int_t)(int source, int tag, int comm, int *flag, void *status);

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* 1 us of timer slack for this thread (once): its short pauses end when asked. */
static void tighten_slack(void) {
    static __thread int done;
    if (!done) {
        (void)prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
        done = 1;
    }
}

/* Sleep `ns`, or until *bell leaves 0 (rung: at once). */
static void pause_on(int32_t *bell, int32_t shared, int64_t ns) {
    struct timespec ts = {(time_t)(ns / 1000000000), (long)(ns % 1000000000)};
    if (!bell) {
        nanosleep(&ts, NULL);
        return;
    }
    /* returns at once if *bell is no longer 0; EINTR and EAGAIN end the pause too */
    (void)syscall(SYS_futex, bell, shared ? FUTEX_WAIT : FUTEX_WAIT_PRIVATE, 0, &ts, NULL, 0);
}

int32_t kv_poll_wait(void *iprobe, int32_t handle_is_int, intptr_t comm, int32_t source,
                     int32_t tag, void *status, int64_t first_ns, int64_t max_ns,
                     int64_t budget_ns, int32_t *bell, int32_t shared) {
    tighten_slack();
    if (first_ns < 1000) first_ns = 1000;
    if (max_ns < first_ns) max_ns = first_ns;
    int64_t start = now_ns(), pause = first_ns;
    for (;;) {
        int flag = 0, rc;
        if (handle_is_int)
            rc = ((iprobe_int_t)iprobe)(source, tag, (int)comm, &flag, status);
        else
            rc = ((iprobe_ptr_t)iprobe)(source, tag, (void *)comm, &flag, status);
        if (rc != 0) return rc > 0 ? -rc : rc;
        if (flag) return KV_POLL_MESSAGE;
        if (bell && __atomic_exchange_n(bell, 0, __ATOMIC_ACQ_REL)) return KV_POLL_RUNG;
        int64_t left = budget_ns - (now_ns() - start);
        if (left <= 0) return KV_POLL_IDLE;
        pause_on(bell, shared, pause < left ? pause : left);
        if (pause < max_ns) pause = pause * 2 < max_ns ? pause * 2 : max_ns;
    }
}

void kv_poll_ring(int32_t *bell, int32_t shared) {
    if (__atomic_exchange_n(bell, 1, __ATOMIC_ACQ_REL) == 0)
        (void)syscall(SYS_futex, bell, shared ? FUTEX_WAKE : FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
}

void kv_poll_drop(void *module, const void *descriptor) {
    (void)module;
    (void)descriptor;
}
