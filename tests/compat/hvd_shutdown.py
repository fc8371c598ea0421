"""kvcoll's shutdown inside a Horovod job, repeated cheaply (tests/compat/test_horovod_shutdown.py).

A Horovod job that let kvcoll's last MPI call race Horovod's shutdown crashed at exit
about once in seven runs ("An error occurred in MPI_Test on a NULL communicator", exit
code 14): one rank left first, Horovod's shutdown reached every rank, and where Horovod
had initialised MPI (hvd.init() before kv.init()) it finalized MPI under a rank still
polling kvcoll's last collective. Catching a race that rare takes many runs, and a run
that imports TensorFlow costs seconds of CPU per rank. So the imports are paid once:

    python hvd_shutdown.py serve SOCKET
        the zygote: imports TensorFlow, Horovod and kvcoll, prints "ready", then forks
        one child per rank that connects, and reports each child's exit status back.
    mpirun -np 2 python -S hvd_shutdown.py rank SOCKET CASE
        one rank, launched by mpirun: hands its environment (the MPI launcher's
        variables), its argv and its stdin/stdout/stderr to the zygote, and exits with
        the status of the child that ran the rank. The child initialises MPI itself,
        as the rank mpirun started would.

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

import array
import json
import os
import select
import socket
import struct
import sys
import time

_LEN = struct.Struct("!I")
_CODE = struct.Struct("!i")


# -- the rank (python -S: the standard library only) ---------------------------------------

def rank(path: str, case: str) -> int:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    payload = json.dumps({"env": dict(os.environ), "case": case}).encode()
    fds = array.array("i", [0, 1, 2]).tobytes()
    s.sendmsg([_LEN.pack(len(payload)) + payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    got = b""
    while len(got) < _CODE.size:
        chunk = s.recv(_CODE.size - len(got))
        if not chunk:
            sys.stderr.write("hvd_shutdown rank: the zygote closed the connection without a "
                             "status\n")
            return 99
        got += chunk
    code = _CODE.unpack(got)[0]
    return code if code >= 0 else 128 - code   # a signal -n as a shell reports it


# -- the zygote ---------------------------------------------------------------------------

def _receive(conn):
    """(request dict, [fd0, fd1, fd2]) from a rank's connection."""
    fds = array.array("i")
    data, anc, _, _ = conn.recvmsg(65536, socket.CMSG_LEN(3 * fds.itemsize))
    for level, kind, raw in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(raw[:len(raw) - len(raw) % fds.itemsize])
    while len(data) < _LEN.size or len(data) < _LEN.size + _LEN.unpack(data[:_LEN.size])[0]:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError("a rank hung up mid-request")
        data += chunk
    n = _LEN.unpack(data[:_LEN.size])[0]
    return json.loads(data[_LEN.size:_LEN.size + n]), list(fds)


def _child(request: dict, fds: list) -> int:
    """Run one rank in a forked child: stdio and environment are the rank's."""
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    order, slow, end = request["case"].split(":")
    code = 0
    try:
        _run(order, int(slow), end)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported, then the rank fails
        import traceback

        traceback.print_exc()
        code = 1
    import atexit

    atexit._run_exitfuncs()      # what the interpreter runs at exit: kvcoll's, Horovod's
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and not mpi.Is_finalized() and _MPI4PY_OWNS[0]:
        mpi.Finalize()           # mpi4py's own exit hook, when it initialised MPI
    sys.stdout.flush()
    sys.stderr.flush()
    return code


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


def serve(path: str) -> None:
    import horovod.tensorflow  # noqa: F401 - imported once, here, for every child
    import numpy  # noqa: F401
    import tensorflow  # noqa: F401

    import kvcoll  # noqa: F401

    parent = os.getppid()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(64)
    print("ready", flush=True)
    children: dict = {}   # pid -> the rank's connection
    while os.getppid() == parent:   # the test that started us is gone: stop
        ready, _, _ = select.select([srv], [], [], 0.05)
        if ready:
            conn, _ = srv.accept()
            try:
                request, fds = _receive(conn)
            except (OSError, ValueError) as exc:
                print(f"hvd_shutdown zygote: bad request: {exc}", file=sys.stderr, flush=True)
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                srv.close()
                for c in children.values():
                    c.close()
                conn.close()
                os._exit(_child(request, fds))
            for fd in fds:
                os.close(fd)
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(_CODE.pack(os.waitstatus_to_exitcode(status)))
                except OSError:
                    pass
                conn.close()


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        serve(sys.argv[2])
    elif sys.argv[1] == "rank":
        sys.exit(rank(sys.argv[2], sys.argv[3]))
    else:
        raise SystemExit(f"usage: {sys.argv[0]} serve SOCKET | rank SOCKET CASE")
