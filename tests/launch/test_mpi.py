"""Run every tests/mpi/ module under mpirun at several world sizes.

Each launch has a timeout: a deadlock is a failed test, never a hung CI. The MPI
tests' own conftest aborts the whole job on the first failure on any rank.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

MPI_DIR = Path(__file__).resolve().parent.parent / "mpi"
MPIRUN = Path(sys.executable).parent / "mpirun"
TIMEOUT = float(os.environ.get("KVCOLL_TEST_MPI_TIMEOUT", "240"))
MODULES = sorted(p.name for p in MPI_DIR.glob("test_*.py"))
WORLDS = (1, 2, 3)


def run_under_mpirun(module: str, world: int, timeout: float = TIMEOUT):
    cmd = [str(MPIRUN), "--oversubscribe", "--bind-to", "none", "-np", str(world),
           sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
           str(MPI_DIR / module)]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_rmaps_base_oversubscribe="1", TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=str(MPI_DIR.parent.parent))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True, cwd=MPI_DIR.parent.parent)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{module} on {world} ranks did not finish in {timeout:.0f}s "
                    f"(deadlock?)\n{out[-6000:]}")
    return proc.returncode, out


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("module", MODULES)
def test_mpi_module(module, world):
    code, out = run_under_mpirun(module, world)
    assert code == 0, f"{module} failed on {world} ranks (exit {code}):\n{out[-8000:]}"
    assert " passed" in out, out[-4000:]
