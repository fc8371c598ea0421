"""kvcoll's shutdown inside a Horovod job, 50 times (the Horovod lane): no rank may be left
in kvcoll's MPI calls when Horovod's shutdown, started by the first rank to exit,
finalizes MPI on every rank (issue 29, defect 17: "MPI_Test on a NULL communicator",
exit code 14, about once in seven runs of examples/horovod_keras.py).

Each run is a fresh 2-rank job under mpirun, forked from a zygote that imported
TensorFlow, Horovod and kvcoll once (tests/compat/hvd_shutdown.py says how, and which
cases run): a run costs MPI's and Horovod's start-up, not TensorFlow's import. One rank's
main thread is starved of the GIL at the end, which widens the race; before the fix
(kvcoll/runtime.py: shutdown ends with a barrier through Horovod, and runs at exit while
Horovod still does) 16 and 17 of 50 runs crashed this way in two runs, with the error
the issue reports ("MPI_Test", "MPI_Improbe" or "MPI_Comm_free on a NULL communicator",
exit code 14); after it, 0 of 50 in three.
"""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from compat_env import HERE, ROOT
from mpirun import LAUNCH_FAILED, sweep_stale_sessions
from zygote import started

pytest.importorskip("horovod.tensorflow", reason="the Horovod lane only (./dev compat tf215)")

RUNS = 50
AT_ONCE = 2          # jobs in flight at once (each mostly waits for MPI's start-up)
RUN_TIMEOUT = 120    # seconds per job: a hung shutdown fails the test, never the suite
BIN = Path(sys.executable).parent


def cases():
    """RUNS cases: Horovod first in 4 of 5 (the order that crashed), kvcoll first in the
    rest; the starved rank alternating; kv.shutdown() called, or left to the exit."""
    for i in range(RUNS):
        order = "kv-first" if i % 5 == 4 else "hvd-first"
        end = "exit" if (i // 2) % 2 else "shutdown"
        yield f"{order}:{i % 2}:{end}"


def _env():
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=str(ROOT))
    env.pop("KVCOLL_STEP_MODE", None)
    return env


@pytest.fixture
def zygote(tmp_path):
    """The zygote's socket path; the zygote and every child it forked are killed after."""
    sock = tmp_path / "zygote.sock"
    with started([sys.executable, HERE / "hvd_shutdown.py", "serve", sock], sock, _env(),
                 ROOT) as path:
        yield path


def _launch(sock, case):
    sweep_stale_sessions()
    cmd = [str(BIN / "mpirun"), "--oversubscribe", "--bind-to", "none", "-np", "2",
           sys.executable, "-S", str(HERE / "hvd_shutdown.py"), "rank", str(sock), case]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(), cwd=ROOT, start_new_session=True)


def _finish(proc, case, sock=None):
    """None if the job ended well, else what went wrong. A job whose mpirun could not
    start (LAUNCH_FAILED: no rank ran, so it says nothing of the shutdown) is launched
    once more, given the zygote's socket."""
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return f"{case}: did not finish in {RUN_TIMEOUT}s (a hung shutdown?)\n{out[-3000:]}"
    if proc.returncode != 0 and sock is not None and any(m in out for m in LAUNCH_FAILED):
        print(f"{case}: mpirun could not start ({out.strip()[:120]!r}); launched again")
        return _finish(_launch(sock, case), case)
    if proc.returncode != 0:
        return f"{case}: exit code {proc.returncode}\n{out[-3000:]}"
    return None


def test_shutdown_never_races_horovods(zygote):
    t0 = time.monotonic()
    todo, running, failed = list(cases()), [], []
    while todo or running:
        while todo and len(running) < AT_ONCE:
            case = todo.pop(0)
            running.append((case, _launch(zygote, case)))
        case, proc = running.pop(0)
        problem = _finish(proc, case, zygote)
        if problem:
            failed.append(problem)
    seconds = time.monotonic() - t0
    print(f"{RUNS} Horovod jobs shut down in {seconds:.0f} s, {len(failed)} failed")
    assert not failed, f"{len(failed)} of {RUNS} jobs failed at shutdown; the first:\n{failed[0]}"
