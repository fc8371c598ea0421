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


def searchable_tmp() -> str | None:
    """A temporary directory every user can reach (each directory on its path searchable
    by others): the system's, else /var/tmp or /dev/shm (a machine's /tmp can be 0750)."""
    for top in (tempfile.gettempdir(), "/var/tmp", "/dev/shm"):
        path = Path(top).resolve()
        if path.is_dir() and all(p.stat().st_mode & 0o001 for p in (path, *path.parents)):
            return str(path)
    return None


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv")
                    or not os.path.exists("/usr/bin/python3") or searchable_tmp() is None,
                    reason="needs root, setpriv, /usr/bin/python3 and a temporary directory "
                    "other users can reach, to run as another user")
def test_run_as_root_only_for_root():
    with tempfile.TemporaryDirectory(dir=searchable_tmp()) as tmp:  # the other user's too
        os.chmod(tmp, 0o755)
        argv, root = flags(Path(tmp), ["-np", "1", "true"], user="65534")
    assert root is None and "--oversubscribe" in argv


# A stand-in for an mpirun that hangs after a rank aborted: it reports the abort, starts
# a daemon that detaches (double fork, own session), ignores SIGTERM and never ends. Each
# makes its session directory in TMPDIR, as Open MPI's runtime does (ompi.<pid>,
# prted.<pid>); the daemon maps a shared-memory segment there as a rank does in /dev/shm
# (sm_segment.<host>.<uid>.<job>.<rank>).
HANGS = f"""#!{sys.executable}
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
os.mkdir(os.path.join(os.environ["TMPDIR"], f"ompi.{{os.getpid()}}"))
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.mkdir(os.path.join(os.environ["TMPDIR"], f"prted.{{os.getpid()}}"))
        import mmap
        seg = os.path.join(os.environ["TMPDIR"], f"sm_segment.vm.0.{{os.getpid():x}}.0")
        with open(seg, "wb+") as f:      # a shared-memory segment, mapped as a rank does
            f.truncate(1 << 20)
            held = mmap.mmap(f.fileno(), 1 << 20)
        open(sys.argv[-1], "w").write(str(os.getpid()))
        time.sleep(600)
    os._exit(0)
print("[1,1]<stderr>: kvcoll: rank 1 raised CommTimeoutError; aborting the job", flush=True)
time.sleep(600)
"""


def test_watchdog_kills_a_job_that_does_not_end_after_an_abort(tmp_path):
    """...and removes the session directories of what it killed (left behind, they make a
    later mpirun given the same pid fail to start) and the shared-memory segments its
    processes had mapped (a killed rank leaves its own)."""
    pidfile, sessions = tmp_path / "daemon.pid", tmp_path / "sessions"
    sessions.mkdir()
    env = dict(os.environ, MPIRUN=str(fake(tmp_path, HANGS)), KVCOLLRUN_KILL_AFTER="2",
               TMPDIR=str(sessions))
    env.pop("PRTE_MCA_prte_tmpdir_base", None)
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
    assert list(sessions.iterdir()) == []


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


def test_a_bare_python_runs_the_projects_interpreter_when_no_venv_is_active(tmp_path):
    """`kvcollrun -np 2 python train.py` as the README shows it, typed without the venv
    active: every rank failed with "No module named 'keras'" (issue 33, defect 10)."""
    venv_py = str(ROOT / ".venv" / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "CONDA_PREFIX")}
    env["MPIRUN"] = str(fake(tmp_path, ECHO))
    for prog in ("python", "python3"):
        run = subprocess.run([str(KVCOLLRUN), "-np", "2", "--map-by", "slot", prog, "t.py",
                              "python"], env=env, capture_output=True, text=True, timeout=60)
        argv = json.loads(run.stdout.split("ARGS ", 1)[1].splitlines()[0])["argv"]
        assert argv[-3:] == [venv_py, "t.py", "python"], argv
        assert f"running {venv_py} for `{prog}` (no virtual environment is active" in run.stderr
    # an active venv, or an interpreter named by its path, is left alone
    argv, _ = flags(tmp_path, ["-np", "2", "python", "t.py"], {"VIRTUAL_ENV": "/some/venv"})
    assert argv[-2:] == ["python", "t.py"]
    argv, _ = flags(tmp_path, ["-np", "2", "/usr/bin/python3", "t.py"])
    assert argv[-2:] == ["/usr/bin/python3", "t.py"]
    argv, _ = flags(tmp_path, ["-x", "A=1", "--mca", "btl", "self", "-np", "1", "python"])
    assert argv[-1] == venv_py


# A stand-in for mpirun whose ranks print TensorFlow's start-up notices and a real error.
NOISY = f"""#!{sys.executable}
import sys
lines = [
    "[1,0]<stderr>: WARNING: All log messages before absl::InitializeLog() is called are "
    "written to STDERR",
    "[1,0]<stderr>: I0000 00:00:1795686603.214866    6358 port.cc:153] oneDNN custom "
    "operations are on. You may see slightly different numerical results due to "
    "floating-point round-off errors from different computation orders. To turn them off, "
    "set the environment variable `TF_ENABLE_ONEDNN_OPTS=0`.",
    "[1,1]<stderr>: I0000 00:00:1795686603.252691    6358 cpu_feature_guard.cc:227] This "
    "TensorFlow binary is optimized to use available CPU instructions in "
    "performance-critical operations.",
    "[1,1]<stderr>: To enable the following instructions: AVX2 AVX512F FMA, in other "
    "operations, rebuild TensorFlow with the appropriate compiler flags.",
    "[1,0]<stderr>: I0000 00:00:1795686676.245684    7851 generator_dataset_op.cc:213] "
    "Memory patch applied: M_TRIM_THRESHOLD=128 kb was set.",
    "[1,1]<stderr>: E0000 00:00:1795686676.2 7851 op.cc:12] a real error, oneDNN aside",
    "[1,1]<stderr>: W0000 00:00:1795686676.2 7851 op.cc:13] a real warning",
]
for line in lines:
    print(line, file=sys.stderr)
print("[1,0]<stdout>: Epoch 1/1", flush=True)
"""


def test_tensorflows_startup_notices_are_left_out_and_nothing_else(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCOLLRUN")}
    env["MPIRUN"] = str(fake(tmp_path, NOISY))
    run = subprocess.run([str(KVCOLLRUN), "-np", "2", "/bin/true"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stderr.splitlines() == [
        "[1,1]<stderr>: E0000 00:00:1795686676.2 7851 op.cc:12] a real error, oneDNN aside",
        "[1,1]<stderr>: W0000 00:00:1795686676.2 7851 op.cc:13] a real warning"]
    assert run.stdout == "[1,0]<stdout>: Epoch 1/1\n"
    env["KVCOLLRUN_TF_NOISE"] = "1"
    run = subprocess.run([str(KVCOLLRUN), "-np", "2", "/bin/true"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert len(run.stderr.splitlines()) == 7
