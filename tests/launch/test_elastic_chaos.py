"""The chaos test of elastic training (issue #30), run by `./dev faults` (skipped
otherwise, unless KVCOLL_TEST_FAULTS=1):

One job of 4 ranks on four network-namespace hosts (tests/launch/netns.py, one rank
each, Open MPI over TCP) under `launch/kvcollrun --elastic --min-np 2 --max-np 4`, with
a short --cooldown and a discovery script (a file of `host:1` lines the test edits), so
that a host that lost its rank rejoins the job once its cooldown is over. The job
(tests/launch/elastic_chaos_job.py) trains the DeepFM demo with model.fit on
SyntheticCTR's global batches (the global batch of step t does not depend on the world
size), BSP, with kv.callbacks.Checkpoint saving a delta every 10 steps and a full
checkpoint every 100, restoring at start.

While it trains, EVENTS (10) events drawn with a fixed seed (KVCOLL_TEST_CHAOS_SEED,
default 30), each at a random moment after the job recovered from the one before:

- kill: SIGKILL of a rank (its host stays up): the survivors continue in memory;
- stop: SIGSTOP of a rank (a silent process, found by the heartbeat): in memory, and
  kvcollrun kills the stopped process on its host;
- link: a host's link goes down (and it leaves the discovery script's list): the
  survivors recover in memory, Open MPI's runtime then ends the job (it lost the
  host's daemon) and kvcollrun relaunches it on the hosts left; once the job trains
  again the link comes back up and the host is listed again.

An event takes one rank, and only when the job has more than --min-np ranks: when it
has --min-np, the test waits for it to grow back first. The victim's host is drawn
among the job's hosts, rank 0's included. The job must finish its steps (exit 0);
then its final checkpoint and that of an uninterrupted run of the same job (same flags
and steps, no event; on two of the hosts, BASE_NP: the same model, sooner), each
restored on one process, are evaluated on EVAL_SAMPLES (200,000) held-out samples
(SyntheticCTR's eval stream, fixed seed): their AUCs must be within AUC_BOUND (0.003).

pytest -s prints every event with its recovery time (from the fault to the first step
trained afterwards) and mode (in-memory / relaunch), the growths, the two AUCs and
where the time went.

Also here: a stopped rank among four hosts (rank 0 or 2; the TF-free job of
tests/launch/elastic_job.py) is survived in memory, the defect the chaos test found
first (the survivors' agreement waited for the stopped rank until its deadline).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import netns
from netns import PYTHON, ROOT, Hosts

JOB = ROOT / "tests" / "launch" / "elastic_chaos_job.py"
MARK = "elastic_chaos_job.py"
SEED = int(os.environ.get("KVCOLL_TEST_CHAOS_SEED", "30"))
EVENTS = 10
KINDS = ("kill", "link", "stop")
NHOSTS = 4
MIN_NP = 2
BASE_NP = 2             # ranks of the uninterrupted run
COOLDOWN = 4            # seconds a host that lost its rank is held out (--cooldown)
# (in the runs so far all 10 events came before step 1,000: the last at step 625 on
# 2026-11-28, at 439 on 2026-12-02; 29-65 ms a step on 4 ranks: 1,500 steps leave 875
# past the latest; the two runs' AUCs differed by 0.00005 at 2,500 steps, 0.00003 at 2,000)
STEPS = int(os.environ.get("KVCOLL_TEST_CHAOS_STEPS", "1500"))
AUC_BOUND = 0.003
EVAL_SAMPLES = 200_000
JOB_ARGS = ["--steps", STEPS, "--batch", 4096, "--full-every", 100, "--incremental-every", 10]
STEP_RX = re.compile(r"chaos step (\d+) world (\d+) launch (\d+)$")

pytestmark = [pytest.mark.slow, pytest.mark.faults]   # (./dev faults runs it)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    h = Hosts.create(NHOSTS, tmp_path_factory.mktemp("hosts"))
    yield h
    h.close()


class Listed:
    """The discovery script's hosts: a file the script prints, edited by the test."""

    def __init__(self, hosts: Hosts, tmp_path: Path):
        self.hosts, self.file = hosts, tmp_path / "listed.txt"
        self.script = tmp_path / "discover.sh"
        self.script.write_text(f"#!/bin/sh\ncat {self.file}\n")
        self.script.chmod(0o755)
        self.up = set(range(hosts.n))
        self._write()

    def _write(self) -> None:
        tmp = self.file.with_suffix(".new")
        tmp.write_text("".join(f"{self.hosts.names[i]}:1\n" for i in sorted(self.up)))
        tmp.replace(self.file)      # (the script never reads half a file)

    def remove(self, i: int) -> None:
        self.up.discard(i)
        self._write()

    def add(self, i: int) -> None:
        self.up.add(i)
        self._write()


class Step:
    def __init__(self, t: float, step: int, world: int, launch: int):
        self.t, self.step, self.world, self.launch = t, step, world, launch


class Job(netns.Job):
    """kvcollrun --elastic with the discovery script on the hosts; its output lines with
    their arrival time, and rank 0's step lines."""

    def __init__(self, hosts: Hosts, listed: Listed, ckpt: Path, log: Path):
        mpi = hosts.mpi_args()[2:]          # (the hosts come from the discovery script)
        self.log = open(log, "w", encoding="utf-8")   # noqa: SIM115 - closed by end()
        self.steps: list[Step] = []
        super().__init__([ROOT / "launch" / "kvcollrun", "--elastic", "--min-np", MIN_NP,
                          "--max-np", NHOSTS, "--cooldown", COOLDOWN,
                          "--discovery-interval", 1, "--host-discovery-script",
                          listed.script, *mpi, PYTHON, JOB, *JOB_ARGS, "--ckpt", ckpt],
                         hosts.env({"KVCOLLRUN_KILL_AFTER": "5"}))

    def on_line(self, t: float, line: str) -> None:
        self.log.write(f"{t - self.t0:9.3f} {line}\n")
        m = STEP_RX.search(line)
        if m:
            self.steps.append(Step(t, *map(int, m.groups())))

    def wait_step(self, ok, timeout: float, what: str, fail: bool = True) -> Step | None:
        """The first step line for which ok(step) holds, waiting up to `timeout` s (then
        the test fails; with fail=False, None)."""
        deadline, seen = time.monotonic() + timeout, 0
        while time.monotonic() < deadline:
            steps = self.steps
            for s in steps[seen:]:
                if ok(s):
                    return s
            seen = len(steps)
            if self.proc.poll() is not None:
                self._reader.join(timeout=5)
                if len(self.steps) == seen:
                    break
            time.sleep(0.02)
        if not fail:
            return None
        state = "ended" if self.proc.poll() is not None else "running"
        pytest.fail(f"{what}: not within {timeout:.0f}s (the job {state}):\n{self.text(80)}")

    def note(self, what: str) -> None:
        """A line of the test's own in the job's log (an event, when it was sent)."""
        self.log.write(f"{time.monotonic() - self.t0:9.3f} TEST: {what}\n")
        self.log.flush()

    def end(self, timeout: float) -> int:
        code = super().end(timeout)
        if code is None:
            pytest.fail(f"the job did not end within {timeout:.0f}s:\n{self.text(80)}")
        self.log.close()
        return code


@pytest.fixture
def cleanup(hosts):
    jobs = []
    yield jobs
    for job in jobs:
        job.kill()
    for i in range(hosts.n):
        hosts.link_up(i)
        hosts.kill_all(i)


def job_hosts(hosts: Hosts) -> dict:
    """{host index: pid} of the hosts running one rank of the job."""
    out = {}
    for i in range(hosts.n):
        pids = hosts.ranks(i, MARK)
        if len(pids) == 1:
            out[i] = pids[0]
    return out


def settled(job: Job, hosts: Hosts, listed: Listed, timeout: float, what: str
            ) -> tuple[Step, dict]:
    """Wait until the job trains on more than --min-np ranks, not in the middle of
    growing, with one rank process on each host of its world; (its last step, those
    hosts' rank pids)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = job.steps[-1] if job.steps else None
        asked = job.since(job.t0, r"kvcollrun: \d+ more slot\(s\) usable")
        growing = bool(asked) and s is not None and s.launch <= asked_launch(job, asked[-1][0])
        if s is not None and s.world > MIN_NP and not growing and \
                time.monotonic() - s.t < 1.0:
            ranks = job_hosts(hosts)
            if len(ranks) == s.world and set(ranks) <= listed.up:
                return s, ranks
            time.sleep(0.1)         # (a lost rank's process still going: ask less often)
        if job.proc.poll() is not None:
            last = job.steps[-1].step if job.steps else 0
            pytest.fail(f"{what}: the job ended (step {last} of {STEPS}) before it (this "
                        "machine trains faster than the events come: raise "
                        f"KVCOLL_TEST_CHAOS_STEPS):\n{job.text(80)}")
        time.sleep(0.05)
    pytest.fail(f"{what}: the job did not train on more than {MIN_NP} ranks, settled, "
                f"within {timeout:.0f}s (ranks on hosts: {job_hosts(hosts)}):\n{job.text(80)}")


def asked_launch(job: Job, t: float) -> int:
    """The launch that was running when kvcollrun asked the job to grow at t."""
    before = [s for s in job.steps if s.t <= t]
    return before[-1].launch if before else 1


def run_events(job: Job, hosts: Hosts, listed: Listed, rng: random.Random) -> list[dict]:
    """The EVENTS events (see the module docstring); what each did."""
    done = []
    for n in range(EVENTS):
        what = f"event {n + 1}"
        pause, kind, pick = rng.uniform(0.3, 2.5), rng.choice(KINDS), rng.random()
        settled(job, hosts, listed, 150, what)
        time.sleep(pause)                                  # a random moment of a step
        cur, ranks = settled(job, hosts, listed, 60, what)
        victim = sorted(ranks)[int(pick * len(ranks))]
        pid, name = ranks[victim], hosts.names[victim]
        job.note(f"event {n + 1}: {kind} {name} (pid {pid})")
        t_fault = time.monotonic()
        if kind == "kill":
            os.kill(pid, signal.SIGKILL)
        elif kind == "stop":
            os.kill(pid, signal.SIGSTOP)
        else:
            listed.remove(victim)
            hosts.link_down(victim)
        ev = {"n": n + 1, "kind": kind, "host": name, "step": cur.step,
              "world": cur.world, "launch": cur.launch}
        first = job.wait_step(lambda s, w=cur.world, la=cur.launch, t=t_fault:
                              s.t > t and (s.world < w or s.launch != la), 90,
                              f"event {n + 1} ({kind} on {name}): training again")
        if kind == "link" and first.launch == cur.launch:
            # the runtime ends the job a few seconds later (it lost the host's daemon)
            first = job.wait_step(lambda s, la=cur.launch: s.launch > la, 40,
                                  f"event {n + 1} (link down on {name}): the relaunch",
                                  fail=False) or first
        if kind == "link":
            ev["left_on_host"] = hosts.ranks(victim, MARK)
            hosts.link_up(victim)
            listed.add(victim)
        else:
            gone = time.monotonic() + 15   # kvcollrun kills a lost (stopped) process
            while pid in hosts.pids(victim) and time.monotonic() < gone:
                time.sleep(0.05)
            ev["left_on_host"] = [pid] if pid in hosts.pids(victim) else []
        # a relaunch because the job failed (not one to grow back), before training again
        failed = [t for t, _ in job.since(t_fault, r"kvcollrun: lost .*: relaunching")
                  if t < first.t]
        until = failed[0] if failed else first.t
        # the survivors' line: recovered in memory (after a link down, when they got
        # that far before the runtime ended the job), and their save of what they held
        lost = [t for t, _ in job.since(t_fault, rf"kvcoll: rank \d+ \(host {name}\) lost "
                                                  r"at step") if t < until]
        ev["recovered_s"] = lost[0] - t_fault if lost else None
        ev["saved"] = any(t < until for t, _ in job.since(
            t_fault, r"kvcoll: saved what the survivors hold"))
        ev["training_s"] = first.t - t_fault
        ev["after"] = first.world
        ev["mode"] = "relaunch" if failed else "in-memory"
        ev["grew_first"] = not failed and first.launch != cur.launch
        ev["recovery_s"] = ev["recovered_s"] if ev["grew_first"] else ev["training_s"]
        done.append(ev)
        said = f"training again on {first.world} ranks after {ev['training_s']:.2f}s"
        if ev["mode"] == "relaunch":
            said = f"{said} (the survivors " + (
                "had not recovered in memory" if not lost else
                f"recovered in memory after {ev['recovered_s']:.2f}s"
                + (" and saved what they held" if ev["saved"] else ", not saved")) + \
                " when the runtime ended the job)"
        elif ev["grew_first"]:
            said = f"recovered after {ev['recovered_s']:.2f}s; {said} (grew back first)"
        print(f"event {n + 1:2d}: {kind:4s} {name} (step {cur.step}, {cur.world} ranks): "
              f"{ev['mode']}, {said}", flush=True)
        job.note(f"event {n + 1}: {ev['mode']}, {said}")
        assert not ev["left_on_host"], (
            f"event {n + 1}: the lost rank's process {ev['left_on_host']} is still on "
            f"{name}:\n{job.text(80)}")
    return done


def growths(job: Job) -> list[str]:
    """Each time kvcollrun grew the job: asked -> first step on the larger world."""
    out = []
    for t, line in job.since(job.t0, r"kvcollrun: \d+ more slot\(s\) usable"):
        m = re.search(r"grow from (\d+) to (\d+)", line)
        la = asked_launch(job, t)
        first = next((s for s in job.steps if s.t > t and s.launch > la), None)
        out.append(f"{m.group(1)} -> {m.group(2)} ranks: training again "
                   + (f"{first.t - t:.1f}s after kvcollrun asked" if first else "never"))
    return out


@pytest.mark.parametrize("victim", [0, 2])
def test_a_stopped_rank_among_four_hosts_is_survived_in_memory(hosts, tmp_path, cleanup,
                                                               victim):
    """A rank of four stopped (SIGSTOP): found by the heartbeat, the three survivors
    agree, shrink and finish in memory. (Found by the chaos test: with ULFM's failure
    propagation through the runtime, only the rank that watches the stopped one learnt
    of it, and the survivors' agreement waited for the stopped rank until its 120 s
    deadline; kvcollrun now has ULFM propagate it by reliable broadcast.) The TF-free
    job of tests/launch/elastic_job.py."""
    cmd = [str(ROOT / "launch" / "kvcollrun"), "--elastic", "--min-np", str(MIN_NP),
           *hosts.mpi_args(), PYTHON, str(ROOT / "tests" / "launch" / "elastic_job.py"),
           "--steps", "120", "--ckpt", str(tmp_path / "ck"), "--full-every", "20",
           "--incremental-every", "5", "--step-ms", "30"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=ROOT, start_new_session=True,
                            env=hosts.env({"KVCOLLRUN_KILL_AFTER": "5"}))
    lines: list = []
    reader = threading.Thread(target=lambda: lines.extend(
        (time.monotonic(), x.rstrip("\n")) for x in proc.stdout), daemon=True)
    reader.start()

    class _Job:          # (what the cleanup fixture ends)
        def kill(self):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    cleanup.append(_Job())

    def seen(pattern: str, after: float = 0.0) -> float | None:
        return next((t for t, x in list(lines) if t > after and re.search(pattern, x)), None)

    deadline = time.monotonic() + 60
    while seen(r"step 30 loss") is None and time.monotonic() < deadline:
        time.sleep(0.05)
    pids = hosts.ranks(victim, "elastic_job.py")
    assert len(pids) == 1, "\n".join(x for _, x in lines[-40:])
    t_stop = time.monotonic()
    os.kill(pids[0], signal.SIGSTOP)
    try:
        code = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        _Job().kill()
        code = None
    reader.join(timeout=5)
    out = "\n".join(x for _, x in lines)
    t_lost = seen(rf"kvcoll: rank {victim} \(host kvhost{victim + 1}\) lost at step", t_stop)
    assert code == 0 and t_lost is not None, out[-6000:]
    assert t_lost - t_stop < 10 and re.search(r"step 120 loss", out), out[-3000:]
    print(f"\nrank {victim} of 4 stopped: the survivors went on in memory after "
          f"{t_lost - t_stop:.2f}s")


def test_ten_random_events_and_the_job_ends_as_an_uninterrupted_run(hosts, tmp_path,
                                                                     cleanup):
    t_test = time.monotonic()
    rng = random.Random(SEED)
    listed = Listed(hosts, tmp_path)
    print(f"\nchaos: seed {SEED}, {EVENTS} events of {', '.join(KINDS)}, {NHOSTS} hosts, "
          f"--min-np {MIN_NP}, --cooldown {COOLDOWN}, {STEPS} steps", flush=True)
    job = Job(hosts, listed, tmp_path / "ck", tmp_path / "chaos.log")
    cleanup.append(job)
    job.wait_step(lambda s: s.world == NHOSTS, 120, "the job training on 4 ranks")
    t_train = time.monotonic()
    events = run_events(job, hosts, listed, rng)
    t_events = time.monotonic()
    last = job.steps[-1]
    code = job.end(600)
    t_chaos = time.monotonic()
    out = "\n".join(line for _, line in job.lines)
    for g in growths(job):
        print(f"grew {g}")
    assert code == 0, out[-8000:]
    assert re.search(rf"chaos rank 0 of \d done at step {STEPS}$", out, re.MULTILINE), out[-4000:]
    assert "the job recovered and finished" in out
    assert last.step < STEPS, f"all {EVENTS} events must come before the last step"
    assert max(s.step for s in job.steps) == STEPS, "the job trained past its steps"
    launches = max(s.launch for s in job.steps)

    # the uninterrupted run on two of the hosts: SyntheticCTR's global batch of step t
    # does not depend on the world size, so BSP trains the same model (up to the order
    # of float sums), and two ranks on this machine's two cores take less time than four
    (tmp_path / "two").mkdir()
    two = Listed(hosts, tmp_path / "two")
    for i in range(BASE_NP, NHOSTS):
        two.remove(i)
    base = Job(hosts, two, tmp_path / "base", tmp_path / "base.log")
    cleanup.append(base)
    code = base.end(600)
    t_base = time.monotonic()
    base_out = "\n".join(line for _, line in base.lines)
    assert code == 0, base_out[-6000:]
    assert re.search(rf"chaos rank 0 of {BASE_NP} done at step {STEPS}$", base_out, re.MULTILINE), \
        base_out[-4000:]
    assert {s.world for s in base.steps} == {BASE_NP} and max(s.launch for s in base.steps) == 1

    done = subprocess.run([PYTHON, str(JOB), *map(str, JOB_ARGS), "--eval",
                           str(tmp_path / "ck"), str(tmp_path / "base"),
                           "--eval-samples", str(EVAL_SAMPLES)], check=False, capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=hosts.env())
    t_eval = time.monotonic()
    aucs = {Path(d).name: (int(s), float(a)) for d, s, a in
            re.findall(r"chaos auc (\S+) (\d+) (\S+)", done.stdout)}
    assert done.returncode == 0 and len(aucs) == 2, done.stdout[-3000:] + done.stderr[-3000:]
    (s_chaos, auc_chaos), (s_base, auc_base) = aucs["ck"], aucs["base"]
    print(f"AUC on {EVAL_SAMPLES:,} held-out samples: after the {EVENTS} events "
          f"{auc_chaos:.5f}, uninterrupted {auc_base:.5f} (difference "
          f"{auc_chaos - auc_base:+.5f}, bound {AUC_BOUND})")
    print(f"time: chaos job {t_chaos - t_test:.0f}s (first step on 4 ranks after "
          f"{t_train - t_test:.0f}s, the events {t_events - t_train:.0f}s, then to the end "
          f"{t_chaos - t_events:.0f}s; {launches} launches), uninterrupted run "
          f"{t_base - t_chaos:.0f}s, evaluation {t_eval - t_base:.0f}s; whole test "
          f"{t_eval - t_test:.0f}s", flush=True)
    assert s_chaos == s_base == STEPS, aucs
    assert auc_base > 0.7, f"the uninterrupted run learnt little: AUC {auc_base:.4f}"
    assert abs(auc_chaos - auc_base) <= AUC_BOUND, (auc_chaos, auc_base, events)
    assert all(ev["recovered_s"] is not None for ev in events if ev["mode"] == "in-memory"), \
        events
