"""Tests marked `faults` (fault trials, and the elastic tests that lose whole hosts) run
in `./dev faults`, which CI runs after the suite; `./dev test` skips them, to stay within
its time budget.

Before each test, the session directories of mpiruns killed earlier are removed (see
mpirun.sweep_stale_sessions): a later mpirun given the same pid would fail to start."""

import os

import pytest
from mpirun import sweep_stale_sessions


def pytest_runtest_setup(item):
    sweep_stale_sessions()


def pytest_collection_modifyitems(config, items):
    if os.environ.get("KVCOLL_TEST_FAULTS"):
        return
    skip = pytest.mark.skip(reason="a fault trial: run by ./dev faults (KVCOLL_TEST_FAULTS=1)")
    for item in items:
        if "faults" in item.keywords:
            item.add_marker(skip)
