/*
 * kv_poll.h - waiting for an MPI message without Python, and doorbells that end the
 * wait at once: the SSP/ASP service thread's idle loop.
 *
 * A service thread (kvcoll/exchange/ssp.py) answers its peers' requests as they come.
 * Polling for them in Python cost about 20 us of CPU a poll (the GIL, the sleep's
 * syscall) and, at a 1 ms back-off, up to a millisecond and more before a pull was seen.
 *
 * kv_poll_wait polls here instead, with the GIL released (cffi does): MPI_Iprobe (about
 * 0.2 us), then a pause, doubling from first_ns to max_ns, under a timer slack of 1 us
 * for the calling thread (Linux's default of 50 us would stretch every short pause).
 * It returns as soon as a message of `tag` from `source` has arrived (the caller then
 * receives it as before), when its doorbell `*bell` was rung, or after budget_ns.
 *
 * The pause is a futex wait on the doorbell, so kv_poll_ring ends it at once: a rank
 * on the same machine rings its owner's doorbell (a word in shared memory; `shared` 1)
 * after sending it a request, and the training thread rings its own service thread's
 * when it changes what that thread waits for. A request from a rank that cannot ring
 * (another machine) is found by the next probe, within max_ns.
 *
 * MPI is not linked here: `iprobe` is the address of the process's MPI_Iprobe (found by
 * kvcoll.comm through mpi4py's library), called with the communicator's handle as the
 * MPI's ABI has it: a pointer (Open MPI; handle_is_int 0) or an int (MPICH's family;
 * handle_is_int 1). `status` is a buffer of at least the MPI's sizeof(MPI_Status).
 * MPI must run at MPI_THREAD_MULTIPLE (kvcoll's SSP/ASP already requires it).
 *
 * kv_poll_wait returns KV_POLL_MESSAGE, KV_POLL_RUNG (the doorbell is silenced again),
 * KV_POLL_IDLE (the budget ran out), or the negated non-zero code MPI_Iprobe returned
 * (the caller's own receive reports it, with the rank and the operation). bell may be
 * NULL (plain sleeps). shared: 1 for a word other processes map (a shared futex), 0 for
 * one of this process only.
 *
 * kv_poll_drop is a message callback of Open MPI's transports (a BTL's receive callback:
 * (module, descriptor) -> void) that drops the message. kvcoll.comm installs it, before
 * MPI_Init, for the one tag a peer may send to before this rank registers it (ULFM's
 * reliable broadcast, during start-up); MPI_Init then puts Open MPI's own in its place.
 */
#ifndef KV_POLL_H
#define KV_POLL_H

#include <stdint.h>

#define KV_POLL_IDLE 0
#define KV_POLL_MESSAGE 1
#define KV_POLL_RUNG 2

int32_t kv_poll_wait(void *iprobe, int32_t handle_is_int, intptr_t comm, int32_t source,
                     int32_t tag, void *status, int64_t first_ns, int64_t max_ns,
                     int64_t budget_ns, int32_t *bell, int32_t shared);
void kv_poll_ring(int32_t *bell, int32_t shared);
void kv_poll_drop(void *module, const void *descriptor);

#endif
