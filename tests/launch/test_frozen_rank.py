"""A rank frozen with SIGSTOP, as a user might freeze one, is named by every rank that
reports it: which rank made no progress, that its process is stopped, its pid and host
(defect 13 of issue 29: the error said "the ranks issued different calls ... or one is
slower than the deadline").

Two ranks on this host under mpirun, the step deadline KVCOLL_COMM_TIMEOUT = T = 3 s:

- training (tests/launch/fault_job.py: kvcoll's exchange step after step, no
  TensorFlow) in BSP, SSP and ASP: once both ranks are training, one is stopped; the
  other's error says "lost rank(s) [V]" and "rank V (pid P on host H) is stopped";
  no rank says that every rank is alive, or names another rank as lost;
- start-up: a rank stopped right after kv.init() (the others wait in their first
  collective); one stopped after MPI is up but before kv.init() (the others wait in
  kv.init()'s first communicator: named by its rank, its host not known yet; the job
  ends, not hangs in MPI_Finalize); and one stopped before it starts MPI (the others wait
  in MPI_Init, where a watchdog ends them: MPI_Init holds the GIL, no deadline of
  Python's runs there).

Whatever happens, the stopped process is killed at the end (SIGKILL ends a stopped
process too), and so is every process left in the launch's session.
"""

import os
import re
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

from mpirun import start

T = 3.0
JOB = Path(__file__).resolve().parent / "fault_job.py"
ENV = {"KVCOLL_COMM_TIMEOUT": str(T), "KVCOLL_STARTUP_TIMEOUT": str(T)}
STOPPED = "is stopped (SIGSTOP, Ctrl-Z or a debugger; kill -CONT {pid} resumes it)"


class Job:
    """A job under mpirun whose output lines are collected as they come; the pids its
    ranks print ("rank R pid P ...") are killed, with the launch, by close()."""

    def __init__(self, argv: list, env=None):
        self.proc = start(2, argv, {**ENV, **(env or {})})
        self.lines: list[str] = []
        self.pids: dict[int, int] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            self.lines.append(line)
            if m := re.match(r"rank (\d+) pid (\d+)", line):
                self.pids[int(m[1])] = int(m[2])

    def wait_for(self, pattern: str, timeout: float = 120):
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            if any(rx.search(line) for line in list(self.lines)):
                return
            time.sleep(0.02)
        pytest.fail(f"no line matching {pattern!r}:\n{self.text()[-4000:]}")

    def stop(self, rank: int) -> int:
        os.kill(self.pids[rank], signal.SIGSTOP)
        return self.pids[rank]

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not end within {timeout:.0f}s of the stop:\n"
                        f"{self.text()[-4000:]}")

    def session(self) -> list[int]:
        """Every process left in the launcher's session (the ranks have process groups
        of their own there, so killpg would miss them)."""
        left = []
        for p in os.listdir("/proc"):
            try:
                with open(f"/proc/{p}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if p.isdigit() and int(fields[3]) == self.proc.pid:
                left.append(int(p))
        return left

    def close(self):
        """Kill the ranks (stopped or not: SIGKILL ends a stopped process), then
        whatever else is left of the launch."""
        for pid in [*self.pids.values(), *self.session()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait()
        self._reader.join(timeout=10)
        deadline = time.monotonic() + 10
        while self.session() and time.monotonic() < deadline:  # dying, or not yet reaped
            time.sleep(0.05)
        assert not self.session(), f"left running: {self.session()}"

    def text(self) -> str:
        return "\n".join(self.lines)

    def errors(self) -> dict[int, list[str]]:
        """The kvcoll errors printed, by the rank that raised them."""
        out: dict[int, list[str]] = {}
        for m in re.finditer(r"kvcoll\.errors\.\w+: rank (\d+)\b(.*)$", self.text(),
                             re.MULTILINE):
            out.setdefault(int(m[1]), []).append(m[2])
        return out


@pytest.fixture()
def job_factory():
    jobs = []

    def make(argv, env=None):
        jobs.append(Job(argv, env))
        return jobs[-1]

    yield make
    for j in jobs:
        j.close()


def check_named(job: Job, victim: int, pid: int, survivor_says=True):
    """Every kvcoll error names the victim as lost and stopped; the survivor has one."""
    said = job.errors()
    report = job.text()[-6000:]
    host = socket.gethostname()
    if survivor_says:
        assert 1 - victim in said, report
    for rank, messages in said.items():
        for msg in messages:  # a service thread's error may name the rank without pinging
            assert f"lost rank(s) [{victim}]" in msg or f"to rank {victim}'s pull" in msg, msg
            assert f"rank {victim} (pid {pid} on host {host}) " + STOPPED.format(pid=pid) \
                in msg, (rank, msg)
            assert "every rank is alive" not in msg and "different calls" not in msg, msg


@pytest.mark.parametrize("mode,victim", [("bsp", 0), ("bsp", 1), ("ssp", 0), ("asp", 0)])
def test_a_rank_stopped_while_training_is_named(job_factory, mode, victim):
    job = job_factory([JOB, "--step-mode", mode, "--staleness", 2, "--log-every", 10])
    job.wait_for(rf"^rank {victim} step 30$")
    pid = job.stop(victim)
    code = job.wait(T + 30)
    assert code != 0, job.text()[-3000:]
    check_named(job, victim, pid)
    msg = job.errors()[1 - victim][0]
    assert re.search(r"at step \d+|of step \d+", msg), msg
    assert f"within {T:g}s" in msg, msg


AFTER_INIT = """
import os, signal, time, numpy as np, kvcoll as kv
kv.init()
print(f"rank {kv.rank()} pid {os.getpid()}", flush=True)
if kv.rank() == 0:
    os.kill(os.getpid(), signal.SIGSTOP)          # frozen before the first step
kv.allreduce(np.ones(3))
"""


def test_a_rank_stopped_at_start_up_is_named(job_factory):
    job = job_factory(["-c", AFTER_INIT])
    job.wait_for(r"^rank 0 pid \d+")
    code = job.wait(T + 30)
    assert code != 0, job.text()[-3000:]
    check_named(job, 0, job.pids[0])
    assert job.errors()[1][0].startswith("/2: kv.allreduce did not complete within 3s")


BEFORE_INIT = """
import os, signal, kvcoll as kv
rank = int(os.environ["OMPI_COMM_WORLD_RANK"])
print(f"rank {rank} pid {os.getpid()}", flush=True)
if rank == 0:
    os.kill(os.getpid(), signal.SIGSTOP)          # frozen before it starts MPI
kv.init()
print(f"rank {rank} is up", flush=True)
"""


def test_a_rank_stopped_before_it_starts_mpi_ends_the_job_with_the_reason(job_factory):
    job = job_factory(["-c", BEFORE_INIT])
    job.wait_for(r"^rank 0 pid \d+")
    job.wait_for(r"^rank 1 pid \d+")
    t0 = time.monotonic()
    code = job.wait(T + 30)
    assert code != 0 and time.monotonic() - t0 < T + 20, job.text()[-3000:]
    assert "is up" not in job.text(), job.text()[-3000:]
    host, pid = socket.gethostname(), job.pids[1]
    assert (f"kvcoll: rank 1/2 (pid {pid} on host {host}): starting MPI (MPI_Init, in "
            f"kv.init()) did not complete within {T:g}s: it waits for every rank of the job, "
            "and some rank has not started MPI: it is stopped, stuck or slow before "
            f"kv.init(), or dead (on this host, process(es) [{job.pids[0]}] of the same "
            "launcher are stopped") in job.text(), job.text()[-3000:]


IN_INIT = """
import os, signal, mpi4py
mpi4py.rc.thread_level = "multiple"
from mpi4py import MPI                            # MPI up before kvcoll (as Horovod does)
import kvcoll as kv
print(f"rank {MPI.COMM_WORLD.Get_rank()} pid {os.getpid()}", flush=True)
if MPI.COMM_WORLD.Get_rank() == 0:
    os.kill(os.getpid(), signal.SIGSTOP)          # frozen before kv.init()
kv.init()
print(f"rank {kv.rank()} is up", flush=True)
"""


def test_a_rank_stopped_before_kvcoll_starts_is_named_by_its_rank(job_factory):
    """MPI is up, kvcoll's channel not yet: the pings go over COMM_WORLD, and the rank
    that never joined is named (its pid and host are not known yet)."""
    job = job_factory(["-c", IN_INIT])
    job.wait_for(r"^rank 0 pid \d+")
    code = job.wait(T + 30)
    assert code != 0 and "is up" not in job.text(), job.text()[-3000:]
    msg = job.errors()[1][0]
    assert msg.startswith("/2: dup (a new communicator: every rank must create it) did not "
                          "complete within 3s: lost rank(s) [0], no progress and no sign of "
                          "life within 2s: rank 0 (host not known: it has not joined "
                          "kvcoll) is stopped, stuck or slow before kv.init(), dead, or cut "
                          "off from this rank (raise the limit with KVCOLL_STARTUP_TIMEOUT)"), msg
