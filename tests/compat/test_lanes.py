"""The Keras path in this lane on 1 and 2 ranks, under mpirun, with the main suite's own
tests: fit / evaluate / predict equal one process (tests/mpi/test_fit.py), kv.Trainer's
BSP steps equal one rank's (test_keras_bsp.py), SSP and ASP with Keras' optimizer state
(test_ssp.py); and checkpoints and export (tests/compat/mpi/test_lane.py)."""

import os

import pytest

from compat_env import HERE, ROOT
from mpirun import run

TIMEOUT = float(os.environ.get("KVCOLL_TEST_MPI_TIMEOUT", "400"))
MODULES = [*(ROOT / "tests" / "mpi" / m for m in ("test_fit.py", "test_keras_bsp.py", "test_ssp.py")),
           HERE / "mpi" / "test_lane.py"]


@pytest.mark.parametrize("world", (1, 2))
def test_keras_path_under_mpirun(world):
    """The four modules in one launch a world size (each launch spends seconds of CPU a
    rank importing TensorFlow: one launch per module was a third of a lane's suite)."""
    code, out = run(world, ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *MODULES],
                    TIMEOUT, ", ".join(m.name for m in MODULES))
    assert code == 0, f"the Keras path failed on {world} ranks (exit {code}):\n{out[-8000:]}"
    assert " passed" in out and " error" not in out, out[-4000:]
