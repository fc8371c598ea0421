"""Run every tests/mpi/ module under mpirun at several world sizes.

Each launch has a timeout: a deadlock is a failed test, never a hung CI. The MPI
tests' own conftest aborts the whole job on the first failure on any rank.
"""

import os
from pathlib import Path

import pytest

from mpirun import run

MPI_DIR = Path(__file__).resolve().parent.parent / "mpi"
TIMEOUT = float(os.environ.get("KVCOLL_TEST_MPI_TIMEOUT", "240"))
MODULES = sorted(p.name for p in MPI_DIR.glob("test_*.py"))
WORLDS = (1, 2, 3)


def run_under_mpirun(module: str, world: int, timeout: float = TIMEOUT):
    return run(world, ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", MPI_DIR / module],
               timeout, module)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("module", MODULES)
def test_mpi_module(module, world):
    code, out = run_under_mpirun(module, world)
    assert code == 0, f"{module} failed on {world} ranks (exit {code}):\n{out[-8000:]}"
    assert " passed" in out, out[-4000:]
