"""Fixtures for tests that run at any world size under mpirun.

Every rank builds all ranks' inputs from one seed and computes the expected result
itself. A failure on any rank prints its report and aborts the whole job, so the
other ranks never wait in a collective the failed rank will not reach.
"""

import shutil
import sys
import tempfile

import pytest

import kvcoll
from kvcoll.runtime import comm as _comm


@pytest.fixture(scope="session")
def comm():
    kvcoll.init(argv=[], comm_timeout=60.0)
    yield _comm()


@pytest.fixture()
def shared_dir(comm):
    """A fresh directory every rank of the test sees (rank 0 makes and removes it)."""
    path = tempfile.mkdtemp(prefix="kvtest-") if comm.rank == 0 else None
    path = comm.bcast_bytes(path.encode() if path else None).decode()
    yield path
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def pytest_runtest_logreport(report):
    if report.failed and kvcoll.is_initialized() and kvcoll.size() > 1:
        sys.stderr.write(f"\n[rank {kvcoll.rank()}] {report.nodeid} FAILED\n"
                         f"{report.longreprtext}\n")
        sys.stderr.flush()
        _comm().abort(1)
