"""kvcoll's shutdown inside a Horovod job, repeated cheaply (tests/compat/test_horovod_shutdown.py).

A Horovod job that let kvcoll's last MPI call race Horovod's shutdown crashed at exit
about once in seven runs ("An error occurred in MPI_Test on a NULL communicator", exit
code 14): one rank left first, Horovod's shutdown reached every rank, and where Horovod
had initialised MPI (hvd.init() before kv.init()) it finalized MPI under a rank still
polling kvcoll's last collective. Catching a race that rare takes many runs, and a run
that imports TensorFlow costs seconds of CPU per rank. So the imports are paid once, in
a zygote (tests/launch/zygote.py says how):

    python hvd_shutdown.py serve SOCKET
        the zygote: imports TensorFlow, Horovod and kvcoll, prints "ready", then forks
        one child per rank that connects, which runs the rank's CASE.
    mpirun -np 2 python -S hvd_shutdown.py rank SOCKET CASE
        one rank, launched by mpirun: the zygote's child runs it and it ends as that
        child ended. The child initialises MPI itself, as the rank mpirun started would.

CASE is ORDER:SLOW:END, e.g. hvd-first:1:exit:
    ORDER  hvd-first (Horovod initialises MPI, and finalizes it in its shutdown) or
           kv-first (mpi4py does, at exit)
    SLOW   the rank whose main thread is starved at the end: from its last collective on
           it gets the GIL only every 30 ms (a thread holds it, as a busy Python thread
           or a loaded machine would), while the other rank comes 0.1 s late to the last
           synchronisation (the last collective, or kv.shutdown()) and so leaves first.
           This widens the race (seen on a loaded CI machine) so that a few dozen runs
           find it.
    END    shutdown (the script calls kv.shutdown()) or exit (it does not: kvcoll's
           atexit handler must do it).

Each rank does a little of what examples/horovod_keras.py does between the inits and the
exit: Horovod's allreduce of a dense gradient, kvcoll's allreduce and allgather. The
child ends as the interpreter would, with the atexit handlers (kvcoll's, Horovod's) and
MPI_Finalize if mpi4py initialised MPI, then os._exit (it skips the module teardown:
seconds with TensorFlow loaded, and no MPI call in it).
"""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "launch"))
import zygote  # noqa: E402 - the fork server (the standard library only)


def _case(request: dict) -> int:
    """Run one rank's case in a child of the zygote; its exit code."""
    order, slow, end = request["case"].split(":")
    code = zygote.call(lambda: _run(order, int(slow), end))
    return zygote.exit_like_python(code, _MPI4PY_OWNS[0])   # when mpi4py initialised MPI


_MPI4PY_OWNS = [False]


def _run(order: str, slow: int, end: str) -> None:
    import ctypes
    import threading

    import horovod.tensorflow as hvd
    import numpy as np
    import tensorflow as tf

    import kvcoll as kv

    if order == "hvd-first":
        hvd.init()
        kv.init(argv=[])
    else:
        kv.init(argv=[])
        _MPI4PY_OWNS[0] = True
        hvd.init()
    me, world = kv.rank(), kv.size()
    grad = hvd.allreduce(tf.fill([256], float(me + 1)), op=hvd.Sum, name="dense_gradient")
    assert float(grad[0]) == world * (world + 1) / 2
    assert kv.allreduce(np.float32(1.0), op="sum") == world
    assert kv.allgather(np.arange(me + 1)).size == world * (world + 1) // 2
    if me == slow:
        libc = ctypes.PyDLL(None)   # a call through PyDLL keeps the GIL

        def starve():
            while True:
                libc.usleep(30000)

        threading.Thread(target=starve, daemon=True).start()
    # The other rank comes 0.1 s late to the last synchronisation before the exit (the
    # script's last collective, or kv.shutdown()'s), so the starved rank waits there,
    # and the other one leaves first.
    if end == "exit":
        if me != slow:
            time.sleep(0.1)
        kv.allreduce(np.float32(1.0), op="sum")   # the script's last collective
    else:
        kv.allreduce(np.float32(1.0), op="sum")
        if me != slow:
            time.sleep(0.1)
        kv.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "serve":   # imported once, here, for every child
        zygote.serve(sys.argv[2], ("horovod.tensorflow", "numpy", "tensorflow", "kvcoll"),
                     run=_case)
    elif sys.argv[1] == "rank":
        sys.exit(zygote.rank(sys.argv[2], {"case": sys.argv[3]}))
    else:
        raise SystemExit(f"usage: {sys.argv[0]} serve SOCKET | rank SOCKET CASE")
