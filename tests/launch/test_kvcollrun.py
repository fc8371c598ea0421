"""launch/kvcollrun, against a stand-in for mpirun (MPIRUN=...): the flags it adds where
they apply, and its watchdog.

- on this host alone it adds --oversubscribe; with --hostfile/-H, inside a SLURM
  allocation or with a default hostfile it does not; a program's own --host flag is the
  program's; the Kubeflow MPI operator's OMPI_MCA_orte_default_hostfile becomes
  --hostfile (Open MPI 5 ignores that variable); KVCOLL_* settings are exported with -x;
- run as root is allowed only for root;
- watchdog: a job that announced a rank's abort and whose mpirun then ignores SIGTERM
  and never ends, with a daemon that detached itself, is killed whole
  KVCOLLRUN_KILL_AFTER seconds later, and kvcollrun exits 1;
- SIGTERM (a preemption) reaches mpirun as SIGUSR2, which mpirun passes on to the ranks
  without killing them; SIGINT is passed on as it is; kvcollrun returns mpirun's own exit
  code.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
KVCOLLRUN = ROOT / "launch" / "kvcollrun"

# A stand-in for mpirun: prints its arguments and the variables kvcollrun sets.
ECHO = """#!/usr/bin/env python3
import json, os, sys
print("ARGS " + json.dumps({"argv": sys.argv[1:], "root": os.environ.get(
    "OMPI_ALLOW_RUN_AS_ROOT")}), flush=True)
"""


def fake(tmp_path, text: str) -> Path:
    path = tmp_path / "mpirun"
    path.write_text(text)
    path.chmod(0o755)
    return path


def flags(tmp_path, argv: list, env_extra: dict | None = None, user: str | None = None):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("KVCOLL", "SLURM_", "PBS_", "LSB_", "OMPI_", "PRTE_"))}
    env.update(MPIRUN=str(fake(tmp_path, ECHO)), **(env_extra or {}))
    cmd = [str(KVCOLLRUN), *argv]
    if user:  # the system's python3 and a copy of kvcollrun (a standalone script): the
        # venv and the checkout may live where the user cannot read (/root/...)
        copy = tmp_path / "kvcollrun"
        shutil.copy(KVCOLLRUN, copy)
        copy.chmod(0o755)
        cmd = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", str(copy),
               *argv]
        env["PATH"] = "/usr/bin:/bin"
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60,
                         check=True).stdout
    got = json.loads(out.split("ARGS ", 1)[1].splitlines()[0])
    return got["argv"], got["root"]


def test_small_host_flags_only_where_they_apply(tmp_path):
    prog = [sys.executable, "train.py", "--host", "0.0.0.0"]
    argv, root = flags(tmp_path, ["-np", "2", *prog])
    assert argv == ["--bind-to", "none", "--tag-output", "--oversubscribe", "-np", "2", *prog]
    assert root == ("1" if os.geteuid() == 0 else None)
    for many in (["--hostfile", "hosts"], ["-H", "a:2,b:2"], ["--host=a,b"]):
        argv, _ = flags(tmp_path, [*many, "-np", "4", *prog])
        assert "--oversubscribe" not in argv and argv[-len(prog) - 2:-len(prog)] == ["-np", "4"]
    argv, _ = flags(tmp_path, ["-np", "4", *prog], {"SLURM_JOB_ID": "17"})
    assert "--oversubscribe" not in argv
    argv, _ = flags(tmp_path, ["--bind-to", "core", "--map-by", "ppr:1:node:OVERSUBSCRIBE",
                               "-np", "4", *prog])
    assert argv.count("--bind-to") == 1 and "--oversubscribe" not in argv


def test_the_mpi_operators_hostfile_and_kvcoll_settings_reach_mpirun(tmp_path):
    argv, _ = flags(tmp_path, ["-np", "4", "python", "t.py"],
                    {"OMPI_MCA_orte_default_hostfile": "/etc/mpi/hostfile",
                     "OMPI_MCA_plm_rsh_args": "-o ConnectionAttempts=10",
                     "KVCOLL_COMM_TIMEOUT": "30", "KVCOLL_STEP_MODE": "ssp"})
    i = argv.index("--hostfile")
    assert argv[i + 1] == "/etc/mpi/hostfile" and "--oversubscribe" not in argv
    i = argv.index("plm_ssh_args")
    assert argv[i - 1] == "--prtemca" and argv[i + 1] == "-o ConnectionAttempts=10"
    assert ["-x", "KVCOLL_COMM_TIMEOUT"] == argv[argv.index("KVCOLL_COMM_TIMEOUT") - 1:][:2]
    assert "KVCOLL_STEP_MODE" in argv
    argv, _ = flags(tmp_path, ["-x", "KVCOLL_STEP_MODE=bsp", "-np", "1", "python", "t.py"],
                    {"KVCOLL_STEP_MODE": "ssp"})
    assert argv.count("KVCOLL_STEP_MODE") == 0 and "KVCOLL_STEP_MODE=bsp" in argv


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv")
                    or not os.path.exists("/usr/bin/python3"),
                    reason="needs root, setpriv and /usr/bin/python3 to run as another user")
def test_run_as_root_only_for_root():
    with tempfile.TemporaryDirectory() as tmp:   # readable by the other user
        os.chmod(tmp, 0o755)
        argv, root = flags(Path(tmp), ["-np", "1", "true"], user="65534")
    assert root is None and "--oversubscribe" in argv


# A stand-in for an mpirun that hangs after a rank aborted: it reports the abort, starts
# a daemon that detaches (double fork, own session), ignores SIGTERM and never ends.
HANGS = f"""#!{sys.executable}
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        open(sys.argv[-1], "w").write(str(os.getpid()))
        time.sleep(600)
    os._exit(0)
print("[1,1]<stderr>: kvcoll: rank 1 raised CommTimeoutError; aborting the job", flush=True)
time.sleep(600)
"""


def test_watchdog_kills_a_job_that_does_not_end_after_an_abort(tmp_path):
    pidfile = tmp_path / "daemon.pid"
    env = dict(os.environ, MPIRUN=str(fake(tmp_path, HANGS)), KVCOLLRUN_KILL_AFTER="2")
    t0 = time.monotonic()
    proc = subprocess.run([str(KVCOLLRUN), "-np", "2", "true", str(pidfile)], env=env,
                          capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "aborting the job" in proc.stdout
    assert "mpirun had not ended the job 2s later: killed 2 process(es)" in proc.stderr, \
        proc.stderr
    assert 2 <= elapsed < 6, elapsed
    daemon = int(pidfile.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(daemon, 0)


TERM = f"""#!{sys.executable}
import signal, sys, time
signal.signal(signal.SIGUSR2, lambda *a: sys.exit(3))
signal.signal(signal.SIGINT, lambda *a: sys.exit(4))
signal.signal(signal.SIGTERM, lambda *a: sys.exit(5))
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("sent,code", [(signal.SIGTERM, 3), (signal.SIGINT, 4)])
def test_signals_are_passed_on_to_mpirun(tmp_path, sent, code):
    env = dict(os.environ, MPIRUN=str(fake(tmp_path, TERM)))
    proc = subprocess.Popen([str(KVCOLLRUN), "-np", "1", "true"], env=env,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(sent)
    assert proc.wait(timeout=20) == code
