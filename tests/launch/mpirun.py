"""Start a command under mpirun from a test, with a timeout: a deadlock fails the test
(the whole process group is killed), it never hangs the suite."""

import functools
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent
MPIRUN = Path(sys.executable).parent / "mpirun"
ZYGOTE = Path(__file__).resolve().parent / "zygote.py"
# what a zygote imports for the jobs it forks (tests/launch/zygote.py): seconds of CPU
# each rank would otherwise spend on it
PRELOAD = ("tensorflow", "keras", "kvcoll", "kvcoll.keras")


# What Open MPI's launcher prints when it could not start at all; nothing of the program
# ran, so it is run again. Its cause: the session directory (TMPDIR/ompi.<pid>) of an
# earlier mpirun killed with SIGKILL whose pid the new one got (reproduced in a pid
# namespace); sweep_stale_sessions removes those before each launch.
LAUNCH_FAILED = ("The PMIx server's listener thread failed to start",)


def sweep_stale_sessions(base: str = "/tmp") -> None:
    """Remove Open MPI's session directories (ompi.<pid>, prted.<pid>) whose process is
    gone: mpiruns and launch agents the tests killed leave them, and pids come round
    again (TensorFlow's threads use them up fast)."""
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        kind, _, pid = name.partition(".")
        if kind in ("ompi", "prted") and pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)


def sweep_stale_segments(shm: str = "/dev/shm", age: float = 60.0) -> None:
    """Remove Open MPI's shared-memory segments (sm_segment.*) that no live process maps
    and that are older than `age` seconds (none being made): the ranks the fault tests
    kill leave theirs (kvcollrun removes those of the jobs it kills itself)."""
    try:
        names = [n for n in os.listdir(shm) if n.startswith("sm_segment.")]
    except OSError:
        return
    if not names:
        return
    live = _kvcollrun().shm_segments(int(p) for p in os.listdir("/proc") if p.isdigit())
    now = time.time()
    for name in names:
        path = os.path.join(shm, name)
        try:
            if path not in live and now - os.stat(path).st_mtime > age:
                os.unlink(path)
        except OSError:
            pass


@functools.cache
def _kvcollrun():
    """launch/kvcollrun as a module (its main() runs only as a script)."""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.SourceFileLoader("kvcollrun", str(ROOT / "launch" / "kvcollrun"))
    spec = importlib.util.spec_from_loader("kvcollrun", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def run(world: int, argv: list, timeout: float, what: str, env_extra=None, launcher=None,
        zygote=None):
    """Run `python argv...` on `world` ranks; return (exit code, combined output).
    launcher: the command before `-np world` (default: this venv's mpirun with the flags
    a small shared host needs). zygote: see start(). A launch that failed before any
    rank started (see LAUNCH_FAILED) is tried once more."""
    code, out = _run(world, argv, timeout, what, env_extra, launcher, zygote)
    if code != 0 and any(m in out for m in LAUNCH_FAILED):
        print(f"{what}: mpirun could not start ({out.strip()[:200]!r}); trying again")
        code, out = _run(world, argv, timeout, what, env_extra, launcher, zygote)
    return code, out


def base_env() -> dict:
    """The environment every launch starts from (start()'s, before its env_extra)."""
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=str(ROOT))
    env.pop("KVCOLL_STEP_MODE", None)
    return env


def start(world: int, argv: list, env_extra=None, launcher=None, zygote=None
          ) -> subprocess.Popen:
    """Start `python argv...` on `world` ranks and return at once: the launcher's process,
    in a session of its own (os.killpg(proc.pid, ...) reaches every rank), its stdout
    and stderr merged into proc.stdout (text). zygote: the socket of a zygote (the
    `zygote` fixture): each rank is then a fork of it, which holds PRELOAD already, and
    mpirun's rank process stands for it (tests/launch/zygote.py); for jobs on this host
    that signal their ranks by the pids the ranks report, if at all (the rank's
    environment is the launch's, but what the imports read of it at import time is the
    zygote's)."""
    sweep_stale_sessions()
    sweep_stale_segments()
    launcher = launcher or [str(MPIRUN), "--oversubscribe", "--bind-to", "none"]
    python = [sys.executable] if zygote is None else \
        [sys.executable, "-S", str(ZYGOTE), "rank", str(zygote)]
    cmd = [*map(str, launcher), "-np", str(world), *python, *map(str, argv)]
    env = base_env()
    if world > (os.cpu_count() or 1):
        # More ranks than cores: TensorFlow's pools, sized to every core in each rank,
        # fight over them (tests/mpi on 3 ranks here: 151 s, with one thread each 123 s)
        env.setdefault("TF_NUM_INTRAOP_THREADS", "1")
        env.setdefault("TF_NUM_INTEROP_THREADS", "1")
    env.update(env_extra or {})
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True, cwd=ROOT)


def _run(world: int, argv: list, timeout: float, what: str, env_extra, launcher, zygote):
    proc = start(world, argv, env_extra, launcher, zygote)
    out, timed_out = finish(proc, timeout)
    if timed_out:
        pytest.fail(f"{what} on {world} ranks did not finish in {timeout:.0f}s "
                    f"(deadlock?)\n{out[-6000:]}")
    return proc.returncode, out


def finish(proc: subprocess.Popen, timeout: float, progress: Path | None = None):
    """Wait for a process start() made: (its output, whether it was killed). Killed (the
    whole process group) after `timeout` s; with `progress`, a directory the program
    writes to as it goes, after `timeout` s without a write there instead."""
    if progress is None:
        try:
            return proc.communicate(timeout=timeout)[0], False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            return proc.communicate()[0], True
    chunks: list = []
    reader = threading.Thread(target=lambda: chunks.append(proc.stdout.read()), daemon=True)
    reader.start()
    started, killed = time.time(), False
    while proc.poll() is None:
        time.sleep(1.0)
        heard = max((p.stat().st_mtime for p in progress.iterdir()), default=started)
        if time.time() - max(heard, started) > timeout:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            killed = True
    reader.join(30)
    return "".join(chunks), killed
