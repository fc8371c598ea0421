"""Elastic jobs on three network-namespace hosts (tests/launch/netns.py), one rank each,
under `launch/kvcollrun --elastic` (tests/launch/elastic_job.py: kvcoll's step loop and
checkpoints, BSP, without TensorFlow):

- a lost host (every process on it killed, its runtime daemon too: Open MPI 5.0's
  runtime then ends every rank) is relaunched on the two hosts left, from the latest
  checkpoint, and the job finishes; with --min-np 3 it is not, and kvcollrun says why.

Every process in the hosts is gone at the end of each test, pass or fail.
"""

import json
import os
import re
import signal
import subprocess
import threading
import time

import pytest
from netns import PYTHON, ROOT, Hosts

JOB = ROOT / "tests" / "launch" / "elastic_job.py"
STEPS = 80


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    h = Hosts.create(3, tmp_path_factory.mktemp("hosts"))
    yield h
    h.close()


class Job:
    """kvcollrun --elastic on the hosts, its output lines kept with their arrival time."""

    def __init__(self, hosts, flags: list, job_args: list, env: dict | None = None):
        self.hosts = hosts
        hostfile = hosts.hostfile_for(range(3), slots=[1, 1, 1])
        argv = ["--elastic", *map(str, flags), *hosts.mpi_args(hostfile), PYTHON, JOB,
                *map(str, job_args)]
        cmd = [str(ROOT / "launch" / "kvcollrun"), *argv]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
            env=hosts.env({"KVCOLLRUN_KILL_AFTER": "5", **(env or {})}),
            start_new_session=True)
        self.t0 = time.monotonic()
        self.lines: list = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def wait_for(self, pattern: str, timeout: float = 120) -> float:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, line in list(self.lines):
                if rx.search(line):
                    return t
            if self.proc.poll() is not None:
                break
            time.sleep(0.02)
        pytest.fail(f"no line matching {pattern!r} within {timeout:.0f}s:\n{self.text()[-5000:]}")

    def end(self, timeout: float) -> int:
        """The exit code; past `timeout` the job is killed and the test fails."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"the job did not end within {timeout:.0f}s:\n{self.text()[-5000:]}")
        self._reader.join(timeout=5)
        return code

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def text(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def events(self, kind: str) -> list:
        return [json.loads(m) for m in re.findall(r"kvcoll-elastic (\{.*\})", self.text())
                if json.loads(m).get("event") == kind]


@pytest.fixture
def cleanup(hosts):
    jobs = []
    yield jobs
    for job in jobs:
        job.kill()
    for i in range(3):
        hosts.link_up(i)
        hosts.kill_all(i)


def rank_pid(hosts, i: int) -> int:
    pids = hosts.ranks(i, "elastic_job.py")
    assert len(pids) == 1, pids
    return pids[0]


@pytest.mark.parametrize("min_np", [2, 3])
def test_a_lost_host_is_relaunched_on_the_hosts_left(hosts, tmp_path, cleanup, min_np):
    ck = tmp_path / "ck"
    job = Job(hosts, ["--min-np", min_np, "--cooldown", 600, "--elastic-timeout", 0],
              ["--steps", STEPS, "--ckpt", ck, "--full-every", 20, "--incremental-every", 5,
               "--restore", "--step-ms", 40])
    cleanup.append(job)
    job.wait_for(r"rank 2 step 30$")
    t_loss = time.monotonic()
    hosts.kill_all(2)          # the rank and the host's runtime daemon
    code = job.end(120)
    out = job.text()
    if min_np == 3:
        assert code != 0, out[-4000:]
        assert re.search(r"kvcollrun: lost host\(s\) kvhost3: 2 slot\(s\) left \(kvhost1:1, "
                         r"kvhost2:1\), fewer than --min-np 3", out), out[-4000:]
        assert job.proc.returncode is not None and time.monotonic() - t_loss < 30
        return
    assert code == 0, out[-6000:]
    assert re.search(r"kvcollrun: lost host\(s\) kvhost3: relaunching on 2 rank\(s\) "
                     r"\(kvhost1:1, kvhost2:1\) from the latest checkpoint", out), out[-4000:]
    restored = re.search(r"restored (ckpt-\d+\S*) at step (\d+) on 2 rank\(s\)", out)
    assert restored and int(restored.group(2)) >= 25, out[-4000:]
    assert re.search(rf"step {STEPS} loss", out) and "the job recovered and finished" in out
    assert len(job.events("exit")) == 2, out[-3000:]
