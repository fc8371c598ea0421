"""Tests marked `faults` (fault trials, and the elastic tests that lose whole hosts) run
in `./dev faults`, which CI runs after the suite; `./dev test` skips them, to stay within
its time budget.

Before each test, the session directories of mpiruns killed earlier are removed (see
mpirun.sweep_stale_sessions): a later mpirun given the same pid would fail to start.

The `zygote` fixture: a fork server for the ranks of short jobs (tests/launch/zygote.py)."""

import os
import sys

import pytest
from mpirun import PRELOAD, ROOT, ZYGOTE, base_env, sweep_stale_sessions
from zygote import started


@pytest.fixture(scope="session")
def zygote(tmp_path_factory):
    """The socket of a zygote holding mpirun.PRELOAD (one per pytest process): pass it to
    mpirun.run/start (zygote=...) to start each rank as a fork of it instead of a fresh
    interpreter, which saves each rank the seconds of CPU of those imports."""
    sock = tmp_path_factory.mktemp("zygote") / "zygote.sock"
    with started([sys.executable, ZYGOTE, "serve", sock, *PRELOAD], sock, base_env(),
                 ROOT) as path:
        yield path


def pytest_runtest_setup(item):
    sweep_stale_sessions()


def pytest_collection_modifyitems(config, items):
    if os.environ.get("KVCOLL_TEST_FAULTS"):
        return
    skip = pytest.mark.skip(reason="a fault trial: run by ./dev faults (KVCOLL_TEST_FAULTS=1)")
    for item in items:
        if "faults" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter):
    """The tests/mpi modules that took longest in their launches (test_mpi.py's
    `mpi_seconds`, the slowest rank's): where the suite's time goes."""
    calls = [r for kind in ("passed", "failed") for r in terminalreporter.stats.get(kind, ())
             if r.when == "call"]
    spent = [(dict(r.user_properties)["mpi_seconds"], r.nodeid) for r in calls
             if "mpi_seconds" in dict(r.user_properties)]
    if spent:
        terminalreporter.write_sep("-", "tests/mpi modules, seconds in their launch")
        for seconds, nodeid in sorted(spent, reverse=True)[:12]:
            terminalreporter.write_line(f"{seconds:7.1f}s  {nodeid.split('[', 1)[-1][:-1]}")
