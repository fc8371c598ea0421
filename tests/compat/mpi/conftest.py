"""The MPI tests' fixtures (tests/mpi/conftest.py): kvcoll's communicator, and a failure
on any rank aborts the whole job."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "_kvcoll_mpi_conftest", Path(__file__).resolve().parents[2] / "mpi" / "conftest.py")
_mpi = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_mpi)

comm = _mpi.comm
pytest_runtest_logreport = _mpi.pytest_runtest_logreport
