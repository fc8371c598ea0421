"""Run every tests/mpi/ module under mpirun at several world sizes, and the Kafka
reader's multi-rank test against a mock cluster this process holds.

The modules of one world size run in one launch (each launch spends 3-4 s of CPU per
rank importing TensorFlow, Keras and kvcoll: one launch per module was a fifth of the
suite's time), and each module is still its own test here: the ranks report every
test's outcome (tests/mpi/conftest.py, KVCOLL_TEST_REPORT). The MPI tests' conftest
aborts the whole job on the first failure on any rank: that module fails, and the
modules it did not reach run in a launch of their own. A launch that reports no test
for TIMEOUT s is killed: a deadlock is a failed test, never a hung CI.
"""

import json
import os
import shutil
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from mpirun import LAUNCH_FAILED, finish, run, start

MPI_DIR = Path(__file__).resolve().parent.parent / "mpi"
TIMEOUT = float(os.environ.get("KVCOLL_TEST_MPI_TIMEOUT", "240"))
MODULES = sorted(p.name for p in MPI_DIR.glob("test_*.py"))
# Every module runs on 2 and 3 ranks; on 1 rank under mpirun only those with a case of
# their own there (the others' single-process paths are unit tests: their 1-rank runs
# took 110 s of the suite's budget and found nothing the unit tests do not).
ONE_RANK_TOO = {"test_comm.py", "test_keras_bsp.py", "test_pipeline.py", "test_readers.py",
                "test_stream_fit.py", "test_xla.py"}
CASES = [(m, w) for m in MODULES for w in ((1, 2, 3) if m in ONE_RANK_TOO else (2, 3))]

_RESULTS: dict = {}   # world -> {module: (passed, what to show when not)}
_SECONDS: dict = {}   # world -> {module: its tests' seconds in the launch (slowest rank)}


@pytest.mark.parametrize("module,world", CASES)
def test_mpi_module(request, module, world):
    if world not in _RESULTS:   # this session's selected modules of this world, at once
        chosen = [it.callspec.params["module"] for it in request.session.items
                  if getattr(it, "originalname", None) == "test_mpi_module"
                  and it.callspec.params["world"] == world]
        _RESULTS[world] = run_modules(world, chosen)
    passed, why = _RESULTS[world][module]
    if module in _SECONDS.get(world, {}):   # shown by conftest.py's summary
        request.node.user_properties.append(("mpi_seconds", _SECONDS[world][module]))
    assert passed, f"{module} failed on {world} ranks: {why}"


def run_modules(world: int, modules: list) -> dict:
    """Run `modules` (tests/mpi) on `world` ranks, in as few launches as their failures
    allow: {module: (passed, why not)}."""
    results, left, retried = {}, list(modules), False
    while left:
        code, out, stalled, ranks = _launch(world, left)
        states = {m: _state(m, ranks, world) for m in left}
        progressed = any(st != "not run" for st in states.values())
        if not progressed and not stalled and not retried \
                and any(m in out for m in LAUNCH_FAILED):
            retried = True      # mpirun could not start: nothing of the program ran
            continue
        for m in left:
            spent = [sum(x.get("seconds", 0.0) for x in lines if "test" in x
                         and _mine(x["test"], m)) for lines in ranks.values()]
            if any(spent):
                _SECONDS.setdefault(world, {})[m] = max(spent)
        failed = [m for m in left if states[m] == "failed"]
        if not failed and (code != 0 or stalled):
            # a crash, an abort without a report, or a stall: the module it was in
            failed = [next((m for m in left if states[m] in ("partly run", "not run")),
                           left[0])]
        clean = code == 0 and not stalled
        how = f"no test reported for {TIMEOUT:.0f}s (deadlock?)" if stalled else f"exit {code}"
        for m in left:
            if m in failed:
                results[m] = (False, f"{how}; the launch ran {left}:\n{out[-8000:]}")
            elif states[m] == "passed":
                results[m] = (True, "")
            elif clean or states[m] == "skipped":   # it ran, and did not pass
                why = f"{states[m]}: no rank ran and passed all its tests:\n{out[-4000:]}"
                results[m] = (False, why)
        # the modules a failure kept from running go again, in a launch of their own
        left = [m for m in left if m not in results]
    return results


def _launch(world: int, modules: list):
    """One launch of pytest over `modules`: (exit code, output, whether it stalled, each
    rank's report lines)."""
    report = Path(tempfile.mkdtemp(prefix="kvtest-report-"))
    try:
        proc = start(world, ["-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "--continue-on-collection-errors",
                             *(MPI_DIR / m for m in modules)],
                     env_extra={"KVCOLL_TEST_REPORT": str(report)})
        out, stalled = finish(proc, TIMEOUT, progress=report)
        ranks = {}
        for path in report.glob("rank*.jsonl"):
            ranks[int(path.stem[4:])] = [json.loads(x) for x in path.read_text().splitlines()
                                         if x.strip()]
        return proc.returncode, out, stalled, ranks
    finally:
        shutil.rmtree(report, ignore_errors=True)


def _state(module: str, ranks: dict, world: int) -> str:
    """What the ranks' reports say of `module`: "passed" (every rank ran all its tests,
    none failed, one passed), "failed" (a rank's test or collection failed), "skipped"
    (every rank ran them all, none passed), "not run" (no rank reported a test of it)
    or "partly run"."""
    started, complete, passed = False, len(ranks) == world, True
    for lines in ranks.values():
        collected = {t for x in lines for t in x.get("collected", ()) if _mine(t, module)}
        got = [x for x in lines if "test" in x and _mine(x["test"], module)]
        if any(x["outcome"] == "failed" for x in got):
            return "failed"
        started = started or bool(got)
        ended = {x["test"] for x in got if x["when"] == "teardown"}
        complete = complete and bool(collected) and not collected - ended
        passed = passed and any(x["when"] == "call" and x["outcome"] == "passed" for x in got)
    if complete:
        return "passed" if passed else "skipped"
    return "partly run" if started else "not run"


def _mine(nodeid: str, module: str) -> bool:
    """Whether the test `nodeid` (as a rank reports it) is one of `module`'s."""
    path = nodeid.split("::")[0]
    return path == module or path.endswith("/" + module)


def criteo_message(i: int) -> bytes:
    """Criteo line i: its first categorical value is i, its label i % 3 == 0."""
    ints = [str(i % 97 + j) for j in range(13)]
    cats = [format(i, "x")] + [format((i * 2654435761 + f) % 2**32, "x") for f in range(25)]
    return "\t".join([str(int(i % 3 == 0)), *ints, *cats]).encode()


@pytest.mark.parametrize("world", (2, 3))
def test_kafka_ranks_read_every_message_once(world):
    """kvcoll.data.kafka on `world` ranks against librdkafka's mock cluster, created
    here (no broker can be installed): its address is handed to the ranks, and messages
    keep arriving while they read (tests/mpi/kafka_ranks.py checks)."""
    ck = pytest.importorskip("confluent_kafka")
    owner = ck.Producer({"test.mock.num.brokers": 1, "log_level": 2})
    brokers = owner.list_topics(timeout=10).brokers.values()
    bootstrap = ",".join(f"{b.host}:{b.port}" for b in brokers)
    topic, total = f"kvtest-{uuid.uuid4().hex[:8]}", 3000
    producer = ck.Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "log_level": 2})

    def produce(lo, hi):
        for i in range(lo, hi):
            producer.produce(topic, value=criteo_message(i), partition=i % 4)
        producer.flush(10)

    produce(0, 1000)                       # made with 4 partitions on first use

    def later():
        for lo in range(1000, total, 400):
            time.sleep(0.4)
            produce(lo, min(total, lo + 400))

    writer = threading.Thread(target=later, daemon=True)
    writer.start()
    cfg = {"bootstrap": bootstrap, "topic": topic, "messages": total}
    code, out = run(world, ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                            MPI_DIR / "kafka_ranks.py"], TIMEOUT, "kafka_ranks.py",
                    env_extra={"KVCOLL_TEST_KAFKA": json.dumps(cfg)})
    writer.join(30)
    del owner
    assert code == 0, f"kafka_ranks.py failed on {world} ranks (exit {code}):\n{out[-8000:]}"
    assert " passed" in out and "skipped" not in out, out[-4000:]
