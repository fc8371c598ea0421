"""kvcoll.comm's waits: a deadline counts the time this process ran, not time it was
stopped (SIGSTOP then SIGCONT, a paused VM), so a rank continued after a pause does not
blame a peer for it; a peer that stays silent still times out. And how a silent peer is
described: its rank, pid and host, and on this machine whether it is stopped, running or
gone."""

import os
import signal
import subprocess
import sys
import time

import pytest

from kvcoll import comm
from kvcoll.errors import CommTimeoutError


def test_a_silent_peer_times_out():
    t0 = time.monotonic()
    with pytest.raises(CommTimeoutError, match="no answer"):
        comm._poll_until(lambda: False, 0.2, lambda: "no answer")
    assert 0.2 <= time.monotonic() - t0 < 1.0


def test_time_this_process_was_stopped_does_not_count():
    calls = []

    def ready():  # the process is "stopped" for longer than the limit between two polls
        calls.append(time.monotonic())
        if len(calls) == 3:
            time.sleep(comm.STALLED + 0.3)
        return len(calls) >= 50

    comm._poll_until(ready, 1.0, lambda: "no answer")   # before: CommTimeoutError
    assert len(calls) == 50


def test_a_pause_while_spinning_does_not_count():
    """The first polls of a wait spin (SPIN seconds, back to back): a pause there is this
    process's own too (the common case in BSP, where the ranks run in lock step)."""
    calls = []

    def ready():
        calls.append(time.monotonic())
        if len(calls) == 2:       # the second poll is in the spin phase
            time.sleep(comm.STALLED + 0.3)
        return len(calls) >= 50

    comm._poll_until(ready, 1.0, lambda: "no answer", spin=comm.SPIN)   # before: timed out
    assert len(calls) == 50


def test_run_time_leaves_out_pauses():
    """run_time(): seconds this process ran; a gap between two reads longer than STALLED
    is a pause (SIGSTOP, a paused VM), counted in paused() instead."""
    t0, p0 = comm.run_time(), comm.paused()
    time.sleep(comm.STALLED + 0.2)
    t1, p1 = comm.run_time(), comm.paused()
    assert t1 - t0 < 0.05 and p1 - p0 >= comm.STALLED + 0.2
    time.sleep(0.1)
    assert 0.1 <= comm.run_time() - t1 < 0.5 and comm.paused() == p1


@pytest.fixture()
def child():
    """A process of this host (a stand-in for a peer rank), killed whatever happens."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc
    proc.kill()             # SIGKILL ends a stopped process too
    proc.wait()


def test_a_peer_process_on_this_host_is_told_stopped_running_or_exited(child):
    """A silent peer's description: its rank, pid and host, and, on this machine, what
    its process is doing (read from /proc)."""
    me = comm._identity()
    peer = dict(me, pid=child.pid, start=comm._start_time(child.pid))
    assert comm._proc_state(peer) == "running"
    assert comm._describe_silent(3, peer, me) == (
        f"rank 3 (pid {child.pid} on host {me['host']}) is running but not waiting in "
        "kvcoll: busy in other code or stuck (a deadlock, a long computation, a blocking call)")
    os.kill(child.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while comm._proc_state(peer) != "stopped" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert comm._describe_silent(3, peer, me) == (
        f"rank 3 (pid {child.pid} on host {me['host']}) is stopped (SIGSTOP, Ctrl-Z or a "
        f"debugger; kill -CONT {child.pid} resumes it)")
    child.kill()
    child.wait()
    assert comm._proc_state(peer) == "exited"
    assert comm._describe_silent(3, peer, me) == \
        f"rank 3 (pid {child.pid} on host {me['host']}) has exited"
    # a process of another machine (or another pid namespace) cannot be looked at
    other = dict(peer, host="elsewhere", boot="another-boot")
    assert comm._proc_state(other) is None
    assert comm._describe_silent(3, other, me) == (
        f"rank 3 (pid {child.pid} on host elsewhere) is stopped, stuck outside kvcoll, dead, "
        "or cut off from this rank")
    # a rank that never joined (a silent peer during start-up) has no identity yet
    assert comm._describe_silent(3, None, me) == (
        "rank 3 (host not known: it has not joined kvcoll) is stopped, stuck or slow before "
        "kv.init(), dead, or cut off from this rank")
