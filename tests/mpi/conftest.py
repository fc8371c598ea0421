"""Fixtures for tests that run at any world size under mpirun.

Every rank builds all ranks' inputs from one seed and computes the expected result
itself. A failure on any rank prints its report and aborts the whole job, so the
other ranks never wait in a collective the failed rank will not reach. Before it
aborts, the failed rank asks the ranks on its host (SIGUSR1) to print where each of
their threads is: what the others were doing is often the answer.

With KVCOLL_TEST_REPORT set (a directory), each rank also writes there what it
collected and every test's outcome, one JSON line each, as it goes: tests/launch/
test_mpi.py runs several modules in one launch and reads which passed from it.
"""

import faulthandler
import json
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


_REPORT = os.environ.get("KVCOLL_TEST_REPORT")


def _report(**line) -> None:
    """One line of this rank's report (KVCOLL_TEST_REPORT), written at once."""
    if _REPORT:
        rank = os.environ.get("OMPI_COMM_WORLD_RANK", "0")
        with open(os.path.join(_REPORT, f"rank{rank}.jsonl"), "a") as f:
            f.write(json.dumps(line) + "\n")


def pytest_collection_finish(session):
    _report(collected=[item.nodeid for item in session.items])


def pytest_collectreport(report):
    if report.failed:
        _report(test=report.nodeid, when="collect", outcome="failed")


def pytest_runtest_logreport(report):
    _report(test=report.nodeid, when=report.when, outcome=report.outcome,
            seconds=round(report.duration, 3))
    if report.failed and kvcoll.is_initialized() and kvcoll.size() > 1:
        # (what the test printed, e.g. "revoked its communicator", is in its sections)
        captured = "".join(f"-- {title}\n{text}" for title, text in report.sections)
        sys.stderr.write(f"\n[rank {kvcoll.rank()}] {report.nodeid} FAILED\n"
                         f"{report.longreprtext}\n{captured}")
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
