"""Fixtures for tests that run at any world size under mpirun.

Every rank builds all ranks' inputs from one seed and computes the expected result
itself. A failure on any rank prints its report and aborts the whole job, so the
other ranks never wait in a collective the failed rank will not reach.
"""

import sys

import pytest

import kvcoll
from kvcoll.runtime import comm as _comm


@pytest.fixture(scope="session")
def comm():
    kvcoll.init(argv=[], comm_timeout=60.0)
    yield _comm()


def pytest_runtest_logreport(report):
    if report.failed and kvcoll.is_initialized() and kvcoll.size() > 1:
        sys.stderr.write(f"\n[rank {kvcoll.rank()}] {report.nodeid} FAILED\n"
                         f"{report.longreprtext}\n")
        sys.stderr.flush()
        _comm().abort(1)
