"""Fixtures for tests that run at any world size under mpirun.

Every rank builds all ranks' inputs from one seed and computes the expected result
itself. A failure on any rank prints its report and aborts the whole job, so the
other ranks never wait in a collective the failed rank will not reach. Before it
aborts, the failed rank asks the ranks on its host (SIGUSR1) to print where each of
their threads is: what the others were doing is often the answer.
"""

import faulthandler
import os
import shutil
import signal
import socket
import sys
import tempfile
import time

import pytest

import kvcoll
from kvcoll.runtime import comm as _comm


_PEERS: list = []   # (host, pid) of every other rank, for the report before an abort


@pytest.fixture(scope="session")
def comm():
    kvcoll.init(argv=[], comm_timeout=60.0)
    c = _comm()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    _PEERS[:] = [(h, p) for r, (h, p) in
                 enumerate(c.allgather_json([socket.gethostname(), os.getpid()])) if r != c.rank]
    yield c


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
        host, asked = socket.gethostname(), 0
        for h, pid in _PEERS:      # (the others print their threads' stacks)
            if h == host:
                try:
                    os.kill(pid, signal.SIGUSR1)
                    asked += 1
                except OSError:
                    pass
        if asked:
            time.sleep(1.0)        # (their stacks reach mpirun before the abort)
        _comm().abort(1)
