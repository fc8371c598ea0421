"""examples/online.py (./dev demo --online), small, end to end, with a timeout:

- a run of 3 synthetic hours: every landed sample is trained (the training job's
  ranks' counts add up to what landed), the served version moves on live (versions
  applied, gRPC answers at several versions), the served model beats the model frozen
  at the first hour on the last hour's data, the freshness lag stays within a few
  publish intervals, the PNG and the metrics JSON are written, and the training job
  stopped cleanly (exit 0, a checkpoint at the end);
- the driver stopped by SIGTERM in the middle of the stream stops every process it
  started (the training job's and the server's process groups are empty after it).
Neither leaves a process behind: the test looks for the process groups the driver
names and for any process naming the run's work directory (mpirun's ranks).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
ONLINE = ROOT / "examples" / "online.py"
TIMEOUT = float(os.environ.get("KVCOLL_TEST_ONLINE_TIMEOUT", "600"))
SMALL = ["--hours", "3", "--hour-seconds", "10", "--files-per-hour", "4",
         "--batches-per-file", "12", "--eval-rows", "3000"]
GROUPS = re.compile(r"processes: training job \(mpirun\) group (\d+), kvcoll serve group (\d+)")


def start(args):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, str(ONLINE), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, cwd=ROOT, start_new_session=True)


def alive(pgid: int) -> list:
    """Processes still in process group pgid."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(d))
    return out


def finish(proc, timeout):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"examples/online.py did not finish in {timeout:.0f} s\n"
                             f"{out[-6000:]}") from None
    return proc.returncode, out


def naming(text: str) -> list:
    """Live processes whose command line holds `text` (the ranks, in process groups of
    their own, name the work directory)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    cmd = f.read().decode(errors="replace")
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if text in cmd and stat[stat.rindex(")") + 2] != "Z":
                out.append(int(d))
    return out


def everything_gone(out, work):
    m = GROUPS.search(out)
    assert m, f"the driver did not name its processes:\n{out[-3000:]}"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (naming(str(work)) or
                                           any(alive(int(g)) for g in m.groups())):
        time.sleep(0.2)
    for pgid in map(int, m.groups()):
        assert not alive(pgid), f"process group {pgid} outlived the driver: {alive(pgid)}"
    assert not naming(str(work)), f"processes of the run outlived it: {naming(str(work))}"


def test_online_demo_small(tmp_path):
    work, png, metrics = tmp_path / "work", tmp_path / "online.png", tmp_path / "m.json"
    code, out = finish(start([*SMALL, "--workdir", work, "--plot", png,
                              "--metrics-out", metrics]), TIMEOUT)
    assert code == 0, f"exit {code}\n{out[-6000:]}"
    everything_gone(out, work)
    m = json.loads(metrics.read_text())
    assert m["train_exit"] == 0
    assert m["trained_samples"] == m["landed_samples"] == 3 * 4 * 12 * 1024, m
    hours = {h["hour"]: h for h in m["hours"]}
    assert sorted(hours) == [0, 1, 2], out[-3000:]
    assert all("frozen_auc" in hours[h] for h in (1, 2))
    last = hours[2]
    assert last["served_auc"] > last["frozen_auc"] + 0.05, (last, out[-3000:])
    assert last["served_auc"] > 0.6, last
    st = m["final_status"]
    assert st["applied"] >= 4 and st["refused"] == [], st
    assert len({f["version"] for f in m["files"]}) >= 4, m["files"]
    fresh = [f["freshness_s"] for f in m["freshness"]]
    assert len(fresh) >= 10 and sorted(fresh)[len(fresh) // 2] < 15.0, fresh
    assert png.stat().st_size > 10_000
    assert (work / "checkpoints" / "latest").exists()
    assert "training stopped at step" in (work / "train.log").read_text()
    for line in ("hour 1: AUC served", "hour 2: AUC served", "served vs frozen"):
        assert line in out, out[-3000:]


def test_a_stopped_driver_stops_everything(tmp_path):
    work = tmp_path / "work"
    proc = start([*SMALL, "--hours", "20", "--workdir", work, "--plot", ""])
    seen, deadline = "", time.monotonic() + TIMEOUT
    try:
        while time.monotonic() < deadline:   # until it serves and has landed a few files
            line = proc.stdout.readline()
            if not line:
                break
            seen += line
            if GROUPS.search(seen):
                time.sleep(8)
                break
        assert GROUPS.search(seen), f"the demo never served:\n{seen[-3000:]}"
        os.kill(proc.pid, signal.SIGTERM)
        code, out = finish(proc, 180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    out = seen + out
    assert code == 130, f"exit {code}\n{out[-3000:]}"
    assert "every process it started is stopped" in out
    everything_gone(out, work)
