"""A fork server for tests that start many short MPI jobs: the imports (TensorFlow, Keras,
kvcoll: seconds of CPU per rank) are paid once, and every rank of every job is a fork of
a process that holds them.

    python zygote.py serve SOCKET MODULE...
        the zygote: imports the modules, prints "ready", then forks one child per rank
        that connects; the child runs the rank's script and the zygote reports how it
        ended. It stops when the process that started it is gone.
    mpirun -np N python -S zygote.py rank SOCKET SCRIPT ARG...   (or -c CODE, -m MODULE)
        one rank, launched by mpirun: hands its environment (the MPI launcher's
        variables), working directory, argv and stdin/stdout/stderr to the zygote, and
        ends as the child that ran the rank ended: with its exit code, or killed by the
        same signal (so mpirun and kvcollrun see a SIGKILLed rank as one). If the rank
        process is killed (mpirun ending the job), the zygote SIGKILLs the child at once.

The child initialises MPI itself, as the rank mpirun started would, runs SCRIPT as
`python SCRIPT ARG...` would (as __main__, its directory first on sys.path; `-c CODE` and
`-m MODULE` as python runs them), then ends as
the interpreter does: the atexit handlers, MPI_Finalize if mpi4py initialised MPI and
may finalize it, then os._exit (the module teardown is skipped: seconds with TensorFlow
loaded, and no MPI call in it).

The imports must not start MPI or a thread the child needs (a fork keeps only the thread
that forked): TensorFlow's, Keras's and kvcoll's do not (kvcoll starts MPI in kv.init
and its C threads at the first step).
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

_LEN = struct.Struct("!I")
_CODE = struct.Struct("!i")


# -- the rank (python -S: the standard library only) ---------------------------------------

def rank(path: str, request: dict) -> int:
    """Have the zygote at `path` run `request` (plus this process's environment, working
    directory and stdio) in a child; the child's exit code, or this process killed by the
    signal that killed the child."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    payload = json.dumps({"env": dict(os.environ), "cwd": os.getcwd(), **request}).encode()
    fds = array.array("i", [0, 1, 2]).tobytes()
    s.sendmsg([_LEN.pack(len(payload)) + payload], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    got = b""
    while len(got) < _CODE.size:
        chunk = s.recv(_CODE.size - len(got))
        if not chunk:
            sys.stderr.write("zygote rank: the zygote closed the connection without a status\n")
            return 99
        got += chunk
    code = _CODE.unpack(got)[0]
    if code < 0:   # killed by signal -code: die of it too
        sys.stdout.flush()
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        return 128 - code
    return code


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


def call(fn) -> int:
    """fn() as a script's main code: the exit code it would leave (a traceback printed
    for an uncaught exception)."""
    try:
        fn()
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - reported, then the rank fails
        import traceback

        traceback.print_exc()
        return 1
    return 0


def exit_like_python(code: int, finalize_mpi: bool) -> int:
    """What the interpreter does at exit before the module teardown: the atexit
    handlers, then (finalize_mpi) mpi4py's own exit hook, MPI_Finalize."""
    import atexit

    atexit._run_exitfuncs()
    mpi = sys.modules.get("mpi4py.MPI")
    if finalize_mpi and mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    return code


def run_script(request: dict) -> int:
    """The default runner: request["argv"] as `python ARG...` would run it (MPI started by
    mpi4py, as kv.init() does): `SCRIPT ARG...`, `-c CODE ARG...` or `-m MODULE ARG...`;
    the exit code."""
    import runpy

    argv = list(request["argv"])
    if argv[0] == "-c" and len(argv) >= 2:
        import types

        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        main = types.ModuleType("__main__")     # (this file's functions keep their own)
        sys.modules["__main__"] = main
        code = call(lambda: exec(compile(argv[1], "<string>", "exec"), main.__dict__))
    elif argv[0] == "-m" and len(argv) >= 2:
        sys.argv = [argv[1], *argv[2:]]     # runpy puts the module's path in argv[0]
        sys.path[0] = os.getcwd()
        code = call(lambda: runpy.run_module(argv[1], run_name="__main__", alter_sys=True))
    else:
        script = argv[0]
        sys.argv = argv
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        code = call(lambda: runpy.run_path(script, run_name="__main__"))
    mpi4py = sys.modules.get("mpi4py")
    return exit_like_python(code, mpi4py is not None and mpi4py.rc.finalize is not False)


def _child(request: dict, fds: list, run) -> int:
    """Run one rank in a forked child: stdio, environment and directory are the rank's."""
    for i, fd in enumerate(fds):
        os.dup2(fd, i)
        os.close(fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    try:
        code = run(request)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def serve(path: str, modules=(), run=run_script) -> None:
    """Import `modules`, then fork a child that calls run(request) for each rank that
    connects to `path`, until the process that started this one is gone."""
    import importlib

    for name in modules:
        importlib.import_module(name)
    parent = os.getppid()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(path))
    srv.listen(64)
    print("ready", flush=True)
    children: dict = {}   # pid -> the rank's connection
    while os.getppid() == parent:
        ready, _, _ = select.select([srv, *children.values()], [], [], 0.05)
        for sock in ready:
            if sock is srv:
                conn, _ = srv.accept()
                try:
                    request, fds = _receive(conn)
                except (OSError, ValueError) as exc:
                    print(f"zygote: bad request: {exc}", file=sys.stderr, flush=True)
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    srv.close()
                    for c in children.values():
                        c.close()
                    conn.close()
                    os._exit(_child(request, fds, run))
                for fd in fds:
                    os.close(fd)
                children[pid] = conn
            else:   # a rank's connection: readable only when its process is gone
                pid = next(p for p, c in children.items() if c is sock)
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
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


@contextlib.contextmanager
def started(serve_argv: list, sock, env: dict, cwd, timeout: float = 120):
    """Run a zygote (`serve_argv`: its command line, which serves at `sock`) for the
    duration of the block: yields `sock`. The zygote and every child it forked are
    SIGKILLed after, and a zygote that never says "ready" fails the caller."""
    log_path = Path(f"{sock}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(a) for a in serve_argv], stdout=log,
                                stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + timeout
        while "ready" not in log_path.read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the zygote did not start:\n{log_path.read_text()}")
            time.sleep(0.1)
        yield sock
    finally:
        os.killpg(proc.pid, signal.SIGKILL)   # its session: the zygote and its children
        proc.wait()


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "serve":
        serve(sys.argv[2], sys.argv[3:])
    elif len(sys.argv) >= 4 and sys.argv[1] == "rank":
        sys.exit(rank(sys.argv[2], {"argv": sys.argv[3:]}))
    else:
        raise SystemExit(f"usage: {sys.argv[0]} serve SOCKET MODULE... | "
                         f"rank SOCKET SCRIPT ARG...")
