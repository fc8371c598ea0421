"""Faults across hosts end cleanly, within a stated bound, in BSP, SSP and ASP.

Three test hosts (tests/launch/netns.py), one rank each, running kvcoll's exchange step
after step (tests/launch/fault_job.py) under launch/kvcollrun. Once every rank is
training, host 2 (rank 1) is cut off (its link goes down) or rank 1 is frozen (SIGSTOP).
Then, with the step deadline T = KVCOLL_COMM_TIMEOUT = 3 s and KVCOLLRUN_KILL_AFTER = 5 s:

- every rank's process, the cut-off one included, has ended within T + 10 s of the fault;
- the survivors' errors name the rank they lost (1), the operation and the step; the
  cut-off rank's (written to a file: its output cannot reach the launcher) names the
  ranks it lost (0 and 2);
- the job's exit code is not 0, and kvcollrun has ended, with every process of the job
  on every host gone (daemons and launch agents included), within KILL_AFTER + 3 s of
  the first rank's abort.

Measured on the 2-core VM (-s prints it): every rank ends 5.0-5.5 s after the fault (T,
then the 2 s liveness check that names the lost rank, then the abort), in every mode;
kvcollrun ends 5.1 s after the first abort when a host is cut off (mpirun waits for the
lost host's daemon until the watchdog kills the job) and 0.5-0.6 s after it otherwise.
"""

import os
import re
import signal
import subprocess
import threading
import time

import pytest

from netns import PYTHON, ROOT, Hosts

T = 3.0             # KVCOLL_COMM_TIMEOUT: a step's exchanges
KILL_AFTER = 5.0    # KVCOLLRUN_KILL_AFTER
JOB = ROOT / "tests" / "launch" / "fault_job.py"

pytestmark = [pytest.mark.slow, pytest.mark.faults]   # (./dev faults runs them)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    h = Hosts.create(3, tmp_path_factory.mktemp("hosts"))
    yield h
    h.close()


class Job:
    """A running job whose output lines are collected with their arrival time."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines = proc, []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, pattern: str, timeout: float) -> float:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, line in list(self.lines):
                if rx.search(line):
                    return t
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        pytest.fail(f"no line matching {pattern!r} within {timeout:.0f}s:\n{self.text()[-4000:]}")

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def first(self, pattern: str) -> float | None:
        rx = re.compile(pattern)
        return next((t for t, line in self.lines if rx.search(line)), None)


@pytest.mark.parametrize("fault", ["link-down", "sigstop"])
@pytest.mark.parametrize("mode", ["bsp", "ssp", "asp"])
def test_a_lost_host_ends_the_job_cleanly(hosts, tmp_path, mode, fault):
    errors = tmp_path / "errors"
    errors.mkdir()
    job = Job(hosts.start(
        ["-np", 3, PYTHON, JOB, "--step-mode", mode, "--staleness", 2, "--error-dir", errors],
        env_extra={"KVCOLL_COMM_TIMEOUT": str(T), "KVCOLLRUN_KILL_AFTER": str(KILL_AFTER)}))
    try:
        for r in range(3):
            job.wait_for(rf"^\[\d+,{r}\]<stdout>: rank {r} step 30$", 120)
        ranks = {i: hosts.ranks(i, "fault_job.py") for i in range(3)}
        assert all(len(p) == 1 for p in ranks.values()), ranks
        pids = {r: ranks[r][0] for r in range(3)}       # one rank per host, in order
        t0 = time.monotonic()
        if fault == "link-down":
            hosts.link_down(1)
        else:
            os.kill(pids[1], signal.SIGSTOP)
        ended = {}
        while time.monotonic() - t0 < T + 30 and (job.proc.poll() is None or len(ended) < 3):
            for r, p in pids.items():
                if r not in ended and not os.path.exists(f"/proc/{p}"):
                    ended[r] = time.monotonic() - t0
            time.sleep(0.02)
        code = job.proc.wait(timeout=30)
        t_exit = time.monotonic()
        left = {hosts.names[i]: hosts.pids(i) for i in range(3)}
    finally:
        if job.proc.poll() is None:
            os.killpg(job.proc.pid, signal.SIGKILL)
        hosts.link_up(1)
        for i in range(3):
            hosts.kill_all(i)
    out = job.text()
    report = f"ranks ended {ended} s after the fault; output:\n{out[-6000:]}"
    assert code != 0, report
    assert sorted(ended) == [0, 1, 2] and max(ended.values()) <= T + 10, report
    first_abort = job.first(r"kvcoll: rank \d+ raised \S+; aborting the job")
    assert first_abort is not None, report
    assert t_exit - first_abort <= KILL_AFTER + 3, (t_exit - first_abort, report)
    assert left == {n: [] for n in hosts.names}, (left, report)
    print(f"\n{mode} {fault}: ranks ended {', '.join(f'{ended[r]:.1f}' for r in range(3))} s "
          f"after the fault (bound {T + 10:g}); kvcollrun {t_exit - first_abort:.1f} s after "
          f"the first abort (bound {KILL_AFTER + 3:g})")
    # the survivors' errors (those printed before the first abort ended the job; told
    # apart by what they say, as mpirun may tag only the first of several lines)
    said = {int(r): m for m, r in
            re.findall(r"kvcoll\.errors\.\w+: (rank (\d+)/3: .*)$", out, re.MULTILINE)}
    assert said and set(said) <= {0, 2}, report
    for msg in said.values():
        assert re.search(r"step \d+", msg), msg
        assert re.search(r"lost rank\(s\) \[1\]|rank\(s\) \[1\]|from rank 1\b|to rank 1\b|"
                         r"rank 1's", msg), msg
        assert re.search(r"pull|push|gate|reply|allreduce|finish", msg), msg
    if fault == "link-down":  # the cut-off rank names the others
        msg = (errors / "rank-1.txt").read_text()
        assert re.search(r"step \d+", msg), msg
        assert re.search(r"\[0, 2\]|from rank [02]\b|to rank [02]\b|rank [02]'s", msg), msg
