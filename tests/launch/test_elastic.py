"""Elastic jobs on three network-namespace hosts (tests/launch/netns.py), one rank each,
under `launch/kvcollrun --elastic` (tests/launch/elastic_job.py: kvcoll's step loop and
checkpoints, BSP, without TensorFlow):

- a lost host (every process on it killed, its runtime daemon too: Open MPI 5.0's
  runtime then ends every rank) is relaunched on the two hosts left, from the latest
  checkpoint, and the job finishes; with --min-np 3 it is not, and kvcollrun says why;
- a killed rank (SIGKILL, in a save or in a step) or a stopped one (SIGSTOP: found by
  the heartbeat; kvcollrun then kills it on its host): the two survivors continue in
  memory and finish, exit 0. Every surviving row, with its optimizer slots and header, and the
  dense model equal an uninterrupted 3-rank run's after the last step applied, bit for
  bit; the lost rank's buckets equal the checkpoint chain's (the latest save); the
  losses after the recovery equal those of a fresh 2-rank run that restores the
  recovered state (dumped by a test hook) to 1e-5, and the losses before it the
  uninterrupted run's exactly. The event has its timings; the progress line says what
  happened; detection and recovery take well under a second;
- a host cut off (its link down): the survivors recover in memory within seconds and
  save; the runtime ends the job (it lost the host's daemon) and kvcollrun relaunches
  on the two hosts left, training again within 30 s; the cut-off rank fences itself;
- a rank busy outside kvcoll for 8 s (past the heartbeat timeout) is no false alarm;
- a host that comes back grows the job again: its rank is lost with the whole host
  (a relaunch on two), and once its cooldown is over the discovery script lists it as
  usable: kvcollrun asks the job to stop after a step and save, and relaunches it on
  three from that checkpoint; the job finishes;
- SSP and ASP (this host, 3 ranks): a killed rank ends the job (their exchange has no
  in-memory recovery), kvcollrun relaunches it on the survivors from the latest
  checkpoint, and it finishes;
- below --min-np (this host, 2 ranks, --min-np 2, one killed): the survivor saves what
  it holds (a delta on the chain) and exits non-zero with the reason within seconds,
  and kvcollrun does not relaunch; that checkpoint restores to the survivor's rows as
  they were (bit for bit) and the lost rank's as the chain had them;
- model.fit of a kv.Model (this host, 3 ranks, tests/launch/elastic_keras_job.py): a
  killed rank's survivors finish every step of SyntheticCTR's global batches (the
  data source continues on each survivor's new part, no batch skipped), the
  WorldChange callback sees 3 -> 2 on both, kv.callbacks.Checkpoint's chain refills the
  lost buckets, and the job exits 0.

Every process in the hosts is gone at the end of each test, pass or fail. The tests
that lose a whole host, the busy rank, growing back, and SSP/ASP run in `./dev faults`
(marked `faults`); `./dev test` runs the in-memory recoveries, below --min-np and fit.
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import netns
import numpy as np
import pytest
from mpirun import MPIRUN
from mpirun import run as mpirun
from netns import PYTHON, ROOT, Hosts

from kvcoll.checkpoint import Checkpointer
from kvcoll.routing import OwnerMap, bucket_of

JOB = ROOT / "tests" / "launch" / "elastic_job.py"
STEPS = 80


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    h = Hosts.create(3, tmp_path_factory.mktemp("hosts"))
    yield h
    h.close()


class Job(netns.Job):
    """kvcollrun --elastic on the hosts, its output lines kept with their arrival time."""

    def __init__(self, hosts, flags: list, job_args: list, env: dict | None = None,
                 hostfile: bool = True):
        self.hosts = hosts
        mpi = hosts.mpi_args(hosts.hostfile_for(range(3), slots=[1, 1, 1]))
        if not hostfile:           # (the hosts come from a discovery script in flags)
            mpi = mpi[2:]
        super().__init__([ROOT / "launch" / "kvcollrun", "--elastic", *flags, *mpi, PYTHON,
                          JOB, *job_args],
                         hosts.env({"KVCOLLRUN_KILL_AFTER": "5", **(env or {})}))

    def wait_for(self, pattern: str, timeout: float = 120) -> float:
        t = self.wait_line(pattern, timeout=timeout)
        if t is None:
            text = self.text()
            said = "\n".join(ln for ln in text.splitlines() if ln.startswith("kvcollrun:"))
            pytest.fail(f"no line matching {pattern!r} within {timeout:.0f}s; kvcollrun "
                        f"said:\n{said}\n...\n{text[-5000:]}")
        return t

    def end(self, timeout: float) -> int:
        """The exit code; past `timeout` the job is killed and the test fails."""
        code = super().end(timeout)
        if code is None:
            pytest.fail(f"the job did not end within {timeout:.0f}s:\n{self.text()[-5000:]}")
        return code

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


@pytest.mark.faults
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


def state_of(directory, checkpoint=None) -> dict:
    """A checkpoint's every row (sorted by key) and dense vector, read on one rank."""
    sys.path.insert(0, str(JOB.parent))
    sys.path.insert(0, str(ROOT / "tests" / "unit"))
    import elastic_job
    from threadcomm import run_ranks

    def read(comm):
        tables = {n: __import__("kvcoll").KvTable(d, name=n, optimizer=__import__(
            "kvcoll").optimizers.Adagrad(0.1)) for n, d in elastic_job.DIMS.items()}
        compute = elastic_job.Linear()
        Checkpointer(tables, comm, dense=elastic_job.Dense(compute)).restore(directory,
                                                                             checkpoint)
        out = {"dense": compute.w.copy()}
        for n, t in tables.items():
            e = t.export()
            order = np.argsort(e["keys"])
            out[n] = {k: e[k][order] for k in ("keys", "values", "slots", "last_step",
                                               "counts")}
            t.close()
        return out
    return run_ranks(1, read)[0]


def where(state: dict, mask: np.ndarray) -> dict:
    return {n: {k: v[mask[bucket_of(cols["keys"])]] for k, v in cols.items()}
            for n, cols in state.items() if n != "dense"}


def same_rows(a: dict, b: dict, what: str, abandoned: int | None = None) -> None:
    """Rows a equal rows b bit for bit: keys, values, slots, update counts and last
    steps. abandoned: a step that was abandoned, whose lookups may have left its number
    as the last step of the rows it read (an eviction hint: the row was read then; the
    exchange's abandon removes the rows it created but does not restore that header)."""
    for n, cols in a.items():
        for k, v in cols.items():
            if k == "last_step" and abandoned is not None:
                ok = (v == b[n][k]) | (v == abandoned)
                assert ok.all(), f"{what}: {n}/{k}: {v[~ok][:5]} vs {b[n][k][~ok][:5]}"
                continue
            np.testing.assert_array_equal(v, b[n][k], err_msg=f"{what}: {n}/{k}")


@pytest.mark.parametrize("fault", ["kill-in-a-save", "kill-in-a-step", "stop"])
def test_a_lost_rank_continues_in_memory(hosts, tmp_path, cleanup, fault):
    lose_a_rank(hosts, tmp_path, cleanup, fault.split("-")[0],
                0.13 if fault == "kill-in-a-step" else 0.0)


def lose_a_rank(hosts, tmp_path, cleanup, fault: str, delay: float, at: int = 30):
    """Rank 2 killed (fault "kill") or stopped ("stop") `delay` s after it said step `at`
    (at 30: right in the save at step 30); the checks of the module docstring."""
    ck, dump = tmp_path / "ck", tmp_path / "dump"
    losses, events = tmp_path / "losses.json", tmp_path / "events.json"
    job = Job(hosts, ["--min-np", 2],
              ["--steps", STEPS, "--ckpt", ck, "--full-every", 20, "--incremental-every", 5,
               "--step-ms", 40, "--dump", dump, "--losses", losses, "--events", events,
               "--log-every", 1 if at % 10 else 10])
    cleanup.append(job)
    job.wait_for(rf"rank 2 step {at}$")
    victim = rank_pid(hosts, 2)
    time.sleep(delay)
    t_kill = time.monotonic()
    os.kill(victim, signal.SIGSTOP if fault == "stop" else signal.SIGKILL)
    t_line = job.wait_for(r"kvcoll: rank 2 \(host kvhost3\) lost at step [\d,]+: continuing "
                          r"on 2 rank\(s\), [\d,]+ rows reverted to step [\d,]+", 30)
    if fault == "stop":   # kvcollrun kills the stopped process on its host
        job.wait_for(rf"kvcollrun: killed the lost process {victim} on kvhost3", 30)
        deadline = time.monotonic() + 10
        while victim in hosts.pids(2) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert victim not in hosts.pids(2)
    code = job.end(120)
    out = job.text()
    assert code == 0, out[-6000:]
    # a dead process: the runtime tells the survivors; a stopped one: the heartbeat
    assert t_line - t_kill < (5 if fault != "stop" else 10), t_line - t_kill
    (ev,) = json.loads(events.read_text())
    s = ev["step"]
    assert ev["kind"] == "lost" and ev["ranks"] == [2] and ev["hosts"] == ["kvhost3"], ev
    assert ev["mode"] == "in-memory" and ev["world"] == [3, 2] and at - 5 <= s < STEPS, ev
    assert 0 <= ev["detect_s"] <= ev["agree_s"] <= ev["shrink_s"] <= ev["refill_s"] <= \
        ev["first_step_after_s"] < 10, ev
    assert ev["reverted_to_step"] == s - s % 5 or ev["reverted_to_step"] == s - s % 5 - 5, ev
    assert ev["rows_reverted"] > 0 and "world change 3 -> 2" in out
    # what the rank saw first: an MPI error class or another rank's vote (never empty)
    assert ev["cause"] and ("MPI error class" in ev["cause"] or "lost" in ev["cause"]
                            or "vote" in ev["cause"]), ev
    assert len(job.events("exit")) == 2 and re.search(rf"step {STEPS} loss", out)
    print(f"\n{fault}: rank 2 lost at step {s}: the progress line {t_line - t_kill:.2f}s "
          f"later; event {ev}")

    # the uninterrupted run, to step s (and its losses)
    ref = tmp_path / "ref"
    code, ref_out = mpirun(3, [JOB, "--steps", s, "--save-at", s, "--save-dir", ref,
                               "--losses", tmp_path / "ref_losses.json"], 120, "reference")
    assert code == 0, ref_out[-4000:]
    recovered, uninterrupted = state_of(dump), state_of(ref / str(s))
    chain = state_of(ck, ev["checkpoint"])
    lost = OwnerMap.even(3).array == 2
    same_rows(where(recovered, ~lost), where(uninterrupted, ~lost), "surviving rows", s + 1)
    same_rows(where(recovered, lost), where(chain, lost), "the lost rank's buckets")
    np.testing.assert_array_equal(recovered["dense"], uninterrupted["dense"])
    got = {int(k): v for k, v in json.loads(losses.read_text()).items()}
    want = {int(k): v for k, v in json.loads((tmp_path / "ref_losses.json").read_text()).items()}
    assert {k: got[k] for k in want} == want          # before the loss: bit for bit

    # a fresh 2-rank run from the recovered state: the same losses
    code, fresh_out = mpirun(2, [JOB, "--steps", STEPS, "--restore-from", dump,
                                 "--losses", tmp_path / "fresh.json"], 120, "fresh 2-rank")
    assert code == 0, fresh_out[-4000:]
    fresh = {int(k): v for k, v in json.loads((tmp_path / "fresh.json").read_text()).items()}
    assert sorted(fresh) == list(range(s + 1, STEPS + 1)), sorted(fresh)
    np.testing.assert_allclose([got[k] for k in sorted(fresh)],
                               [fresh[k] for k in sorted(fresh)], rtol=1e-5)


@pytest.mark.parametrize("sig", ["KILL", "STOP"])
def test_keras_fit_survives_a_killed_rank(tmp_path, sig):
    """A rank of model.fit killed, or stopped. (The stall ./dev bench elastic found with
    a stopped rank, a survivor left in the step's gradient exchange on the revoked
    communicator until its 120 s deadline, needs the bench's larger exchanges: this
    size passes without its fix, Comm._idle_elastic; the bench measures it.)"""
    out_json = tmp_path / "out.json"
    code, out = mpirun(3, [ROOT / "tests" / "launch" / "elastic_keras_job.py",
                           "--ckpt", tmp_path / "ck", "--out", out_json, "--steps", 60,
                           "--kill-rank", 2, "--kill-at", 23, "--signal", sig], 400,
                       "elastic fit",
                       launcher=[ROOT / "launch" / "kvcollrun", "--elastic", "--min-np", 2])
    assert code == 0, out[-6000:]
    got = json.loads(out_json.read_text())
    assert got["step"] == 60 and got["seen"] == [[3, 2]], got
    assert re.search(r"rank 1 of 2 done at step 60, world changes \[\[3, 2\]\]", out)
    (ev,) = got["events"]
    assert ev["step"] == 23 and ev["ranks"] == [2] and ev["checkpoint"] == "ckpt-0000000020"
    assert ev["rows_reverted"] > 0 and ev["first_step_after_s"] < (5 if sig == "KILL" else 10), ev
    assert "kvcoll: rank 2 (host " in out and "rows reverted to step 20" in out
    # a survivor that revoked the communicator says so, and why
    assert re.search(r"kvcoll: rank [01]/3 revoked its communicator at step \d+: \S", out), \
        out[-6000:]
    assert got["history"]["auc"][-1] > 0.5, got


# Run under ULFM on each rank: the slot of ULFM's reliable broadcast before and after
# MPI_Init (kvcoll.comm._guard_ulfm_start, which kv.init runs before MPI_Init)
ULFM_SLOT = """
import mpi4py
mpi4py.rc.finalize = False
from kvcoll import comm
slot = comm._rbcast_slot()
assert slot is not None and not slot.value, "the slot is empty before MPI_Init"
guard, seen = comm._guard_ulfm_start, []
comm._guard_ulfm_start = lambda: seen.append((guard(), slot.value == comm._drop_callback()))
comm._mpi()
print("rank", comm._MPI.COMM_WORLD.Get_rank(), "before", seen, "after",
      slot.value != comm._drop_callback(), bool(slot.value), flush=True)
"""


def test_ulfm_start_drops_a_broadcast_that_comes_before_mpi_init_registers_it(tmp_path):
    """Open MPI 5.0 crashed in MPI_Init now and then under ULFM with the detector thread
    (a peer's first heartbeat came before this rank registered ULFM's reliable broadcast:
    a call through an empty slot). kv.init fills the slot with a callback that drops the
    message, before MPI_Init, and MPI_Init then puts Open MPI's own in its place. (That
    the crash is gone is measured by a loop of starts on a busy machine, see
    kvcoll.comm; a test cannot make it happen on demand.)"""
    script = tmp_path / "slot.py"
    script.write_text(ULFM_SLOT)
    code, out = mpirun(2, [script], 60, "ULFM start",
                       launcher=[MPIRUN, "--oversubscribe", "--bind-to", "none",
                                 "--with-ft", "ulfm", "--mca", "mpi_ft_detector", "true",
                                 "--mca", "mpi_ft_detector_thread", "true"])
    assert code == 0, out[-3000:]
    ranks = re.findall(r"rank (\d) before \[\(True, True\)\] after True True", out)
    assert sorted(ranks) == ["0", "1"], out[-3000:]
    # without ULFM the slot is left as it is
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMPI_MCA_")}
    check = ("from kvcoll import comm; s = comm._rbcast_slot(); "
             "print(comm._guard_ulfm_start(), s is not None and not s.value)")
    got = subprocess.run([sys.executable, "-c", check], env=dict(env, PYTHONPATH=str(ROOT)),
                         capture_output=True, text=True, timeout=60, check=False)
    assert got.stdout.split() == ["False", "True"], got.stdout + got.stderr


def test_below_min_np_the_survivors_save_and_stop(tmp_path):
    ck = tmp_path / "ck"
    t0 = time.monotonic()
    code, out = mpirun(2, [JOB, "--steps", STEPS, "--ckpt", ck, "--full-every", 20,
                           "--incremental-every", 5, "--kill-rank", 1, "--kill-at", 32],
                       120, "below --min-np",
                       launcher=[ROOT / "launch" / "kvcollrun", "--elastic", "--min-np", 2])
    assert code == 3, out[-5000:]
    took = time.monotonic() - t0   # 3 s alone; 62 s once in a suite run: say what ran
    assert took < 60, f"{took:.0f} s\n{out[-5000:]}"
    assert re.search(r"kvcoll: rank 1 \(host \S+\) lost at step 32: 1 rank\(s\) left, fewer "
                     r"than --min-np 2; saved what the survivors hold in \S+ckpt-0000000032; "
                     r"exiting", out), out[-4000:]
    # and it is not relaunched (a launch whose MPI start-up failed, before any step, is:
    # docs/elastic.md)
    stopped = out.find('"event": "below_min_np"')
    assert "kvcollrun: the job stopped below --min-np 2" in out[stopped:], out[-4000:]
    assert stopped >= 0 and "relaunching" not in out[stopped:], out[-4000:]
    saved, chain = state_of(ck), state_of(ck, "ckpt-0000000030")
    ref = tmp_path / "ref"
    code, ref_out = mpirun(2, [JOB, "--steps", 32, "--save-at", 32, "--save-dir", ref], 120,
                           "reference")
    assert code == 0, ref_out[-3000:]
    lost = OwnerMap.even(2).array == 1
    same_rows(where(saved, ~lost), where(state_of(ref / "32"), ~lost), "the survivor's rows",
              33)
    same_rows(where(saved, lost), where(chain, lost), "the lost rank's rows")


@pytest.mark.faults
def test_a_host_cut_off_is_survived_and_its_rank_fences_itself(hosts, tmp_path, cleanup):
    """Host 3's link goes down: the survivors detect it by the heartbeat, continue in
    memory and save what they hold; Open MPI's runtime then ends the job (it lost the
    host's daemon) and kvcollrun relaunches on the two hosts left from the latest
    checkpoint; the job finishes. The cut-off rank finds itself alone, not a majority,
    and exits by itself (KVCOLLRUN_KEEP_LOST: kvcollrun does not kill it, which the test
    hosts' agent could do, unlike ssh to a host cut off)."""
    ck, err = tmp_path / "ck", tmp_path / "err"
    err.mkdir()
    # (the runtime's daemons wait 6 + 5 s instead of 2 + 5 before they give the host up,
    # so that its daemon does not end the cut-off rank before it fences itself: about 6 s,
    # as it must find both others silent, one after the other)
    job = Job(hosts, ["--min-np", 2, "--cooldown", 600,
                      "--prtemca", "oob_tcp_keepalive_time", 6],
              ["--steps", 400, "--ckpt", ck, "--full-every", 20, "--incremental-every", 5,
               "--restore", "--step-ms", 40, "--stderr-dir", err],
              env={"KVCOLLRUN_KEEP_LOST": "1"})
    cleanup.append(job)
    job.wait_for(r"rank 2 step 30$")
    victim = rank_pid(hosts, 2)
    t_cut = time.monotonic()
    hosts.link_down(2)
    t_line = job.wait_for(r"kvcoll: rank 2 \(host kvhost3\) lost at step [\d,]+: continuing "
                          r"on 2 rank\(s\)", 30)
    deadline = time.monotonic() + 20
    while victim in hosts.pids(2) and time.monotonic() < deadline:
        time.sleep(0.05)
    t_gone = time.monotonic()
    assert victim not in hosts.pids(2), "the cut-off rank is still there"
    said = (err / "rank-2.txt").read_text()
    assert re.search(r"kvcoll: rank 2 \(host kvhost3\) is fenced: it is one of 1 rank\(s\) "
                     r"that still reach each other, not a majority of the 3: exiting", said), said
    t_relaunch = job.wait_for(r"kvcollrun: lost host\(s\) kvhost3: relaunching on 2 rank\(s\) "
                              r"\(kvhost1:1, kvhost2:1\) from the latest checkpoint", 60)
    t_restored = job.wait_for(r"restored ckpt-\d+\S* at step \d+ on 2 rank\(s\)", 60)
    code = job.end(180)
    out = job.text()
    assert code == 0, out[-6000:]
    assert re.search(r"step 400 loss", out) and "the job recovered and finished" in out
    assert t_line - t_cut < 10 and t_restored - t_cut < 30, (t_line - t_cut, t_restored - t_cut)
    print(f"\nlink down: survivors recovered in memory after {t_line - t_cut:.1f}s, the "
          f"cut-off rank fenced itself after {t_gone - t_cut:.1f}s, relaunched after "
          f"{t_relaunch - t_cut:.1f}s, training again after {t_restored - t_cut:.1f}s")


@pytest.mark.faults
def test_a_rank_busy_outside_kvcoll_is_no_false_alarm(hosts, tmp_path, cleanup):
    """Rank 1 computes for 8 s without calling MPI (holding the GIL), far past the
    heartbeat timeout: ULFM's detector thread beats on its behalf, no rank is lost."""
    job = Job(hosts, ["--min-np", 2],
              ["--steps", 40, "--busy-rank", 1, "--busy-at", 20, "--busy-s", 8])
    cleanup.append(job)
    code = job.end(120)
    out = job.text()
    assert code == 0, out[-5000:]
    assert re.search(r"step 40 loss", out) and not job.events("lost"), out[-3000:]
    assert len(job.events("exit")) == 3


@pytest.mark.faults
def test_a_host_that_comes_back_grows_the_job(hosts, tmp_path, cleanup):
    ck = tmp_path / "ck"
    listed = tmp_path / "hosts.txt"
    listed.write_text("kvhost1:1\nkvhost2:1\nkvhost3:1\n")
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {listed}\n")
    discover.chmod(0o755)
    job = Job(hosts, ["--min-np", 2, "--cooldown", 5, "--discovery-interval", 1,
                      "--host-discovery-script", discover],
              ["--steps", 300, "--ckpt", ck, "--full-every", 20, "--incremental-every", 5,
               "--restore", "--step-ms", 30], hostfile=False)
    cleanup.append(job)
    job.wait_for(r"rank 2 step 30$")
    hosts.kill_all(2)
    job.wait_for(r"kvcollrun: lost host\(s\) kvhost3: relaunching on 2 rank\(s\)", 60)
    t_ask = job.wait_for(r"kvcollrun: 1 more slot\(s\) usable \(kvhost1:1, kvhost2:1, "
                         r"kvhost3:1\): asking the job to stop after its next step and save, to "
                         r"grow from 2 to 3 rank\(s\)", 60)
    code = job.end(180)
    out = job.text()
    assert code == 0, out[-6000:]
    stopped = re.search(r"stopped at step (\d+) and saved (ckpt-\S+) on 2 rank\(s\)", out)
    assert stopped, out[-4000:]
    assert re.search(rf"restored {stopped.group(2)} at step {stopped.group(1)} on 3 "
                     r"rank\(s\)", out), out[-4000:]
    assert re.search(r"step 300 loss", out) and "the job recovered and finished" in out
    grown = [t for t, line in job.lines if re.search(r"<stdout>: rank 2 step \d+$", line)
             and t > t_ask]
    assert grown, "no rank 2 after growing back"
    print(f"\ngrew back to 3 ranks {grown[0] - t_ask:.1f}s after kvcollrun asked the job to "
          f"stop (at step {stopped.group(1)})")


@pytest.mark.faults
@pytest.mark.parametrize("mode", ["ssp", "asp"])
def test_ssp_and_asp_are_relaunched_on_the_survivors(tmp_path, mode):
    code, out = mpirun(3, [JOB, "--step-mode", mode, "--staleness", 2, "--steps", 80,
                           "--ckpt", tmp_path / "ck", "--full-every", 20,
                           "--incremental-every", 5, "--restore", "--step-ms", 20,
                           "--kill-rank", 2, "--kill-at", 33], 180, f"{mode} kill",
                       launcher=[ROOT / "launch" / "kvcollrun", "--elastic", "--min-np", 2])
    assert code == 0, out[-5000:]
    assert re.search(r"kvcollrun: lost .*: relaunching on 2 rank\(s\) \(this host\) from the "
                     r"latest checkpoint", out), out[-4000:]
    restored = re.search(r"restored ckpt-\d+ at step (\d+) on 2 rank\(s\)", out)
    assert restored and 20 <= int(restored.group(1)) <= 35, out[-4000:]
    # (one launch more for each time Open MPI's start-up crashed and kvcollrun launched
    # again: ULFM's defect, 1-4% of elastic launches, see docs/elastic.md)
    starts = out.count(" did not come up (")
    assert f"the job recovered and finished ({2 + starts} launch(es))" in out, out[-4000:]
