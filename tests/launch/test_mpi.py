"""Run every tests/mpi/ module under mpirun at several world sizes, and the Kafka
reader's multi-rank test against a mock cluster this process holds.

Each launch has a timeout: a deadlock is a failed test, never a hung CI. The MPI
tests' own conftest aborts the whole job on the first failure on any rank.
"""

import json
import os
import threading
import time
import uuid
from pathlib import Path

import pytest

from mpirun import run

MPI_DIR = Path(__file__).resolve().parent.parent / "mpi"
TIMEOUT = float(os.environ.get("KVCOLL_TEST_MPI_TIMEOUT", "240"))
MODULES = sorted(p.name for p in MPI_DIR.glob("test_*.py"))
# Every module runs on 2 and 3 ranks; on 1 rank under mpirun only those with a case of
# their own there (the others' single-process paths are unit tests: their 1-rank runs
# took 110 s of the suite's budget and found nothing the unit tests do not).
ONE_RANK_TOO = {"test_comm.py", "test_keras_bsp.py", "test_pipeline.py", "test_readers.py",
                "test_stream_fit.py", "test_xla.py"}
CASES = [(m, w) for m in MODULES for w in ((1, 2, 3) if m in ONE_RANK_TOO else (2, 3))]


def run_under_mpirun(module: str, world: int, timeout: float = TIMEOUT):
    return run(world, ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", MPI_DIR / module],
               timeout, module)


@pytest.mark.parametrize("module,world", CASES)
def test_mpi_module(module, world):
    code, out = run_under_mpirun(module, world)
    assert code == 0, f"{module} failed on {world} ranks (exit {code}):\n{out[-8000:]}"
    assert " passed" in out, out[-4000:]


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
