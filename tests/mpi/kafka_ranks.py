"""kv.data.kafka under MPI. Started by tests/launch/test_mpi.py, which creates a
librdkafka mock cluster in its own process, produces messages to it (before and while
the ranks read) and hands its address to the ranks (KVCOLL_TEST_KAFKA). Rank r reads
partitions p mod world = r; the ranks stop after K batches as a killed job would, and
a second run resumed from every rank's position reads on. Together they read every
message exactly once (the count, the messages, a checksum of the labels), and the
offsets each rank commits for lag reports leave the group no lag."""

import json
import os
import time

import numpy as np
import pytest

from kvcoll.data import for_rank, kafka

CFG = json.loads(os.environ.get("KVCOLL_TEST_KAFKA", "null"))
pytestmark = pytest.mark.skipif(CFG is None, reason="needs the mock cluster that "
                                "tests/launch/test_mpi.py starts")
B, K = 60, 5


def ids(batch):
    return batch["categorical"][:, 0] & ((1 << 33) - 1)


def test_every_message_once_across_a_restart(comm):
    bootstrap, topic, total = CFG["bootstrap"], CFG["topic"], CFG["messages"]
    first = kafka(topic, bootstrap, "kvtest", B, prefetch=2, idle_poll=0.1)
    assert first.mine == [p for p in range(4) if p % comm.size == comm.rank]
    it = iter(first)
    run1 = [next(it) for _ in range(K)]
    time.sleep(0.3)                          # its thread reads ahead meanwhile
    position = first.position_at(K)
    it.close()
    positions = comm.allgather_json(position)            # what a checkpoint holds
    second = kafka(topic, bootstrap, "kvtest", B, prefetch=2, idle_poll=0.1, idle_timeout=3.0)
    second.resume(for_rank(positions, comm.rank, comm.size))
    run2 = list(second)
    batches = run1 + run2
    mine = np.concatenate([ids(b) for b in batches]).astype(np.int64)
    labels = np.concatenate([b["label"] for b in batches])
    got, _ = comm.allgatherv(mine)
    np.testing.assert_array_equal(np.sort(got), np.arange(total))     # every message, once
    sums = comm.allreduce(np.array([mine.size, labels.sum(), (labels * mine).sum()], np.float64))
    want = np.arange(total)
    assert sums.tolist() == [total, float((want % 3 == 0).sum()),
                             float(want[want % 3 == 0].sum())]
    assert second.stats.idle_batches > 0
    # lag reporting: each rank commits its last position; the group then has no lag
    second.commit_offsets(second.position_at(len(run2)))
    comm.barrier()
    if comm.rank == 0:
        import confluent_kafka as ck

        c = ck.Consumer({"bootstrap.servers": bootstrap, "group.id": "kvtest", "log_level": 2})
        tps = [ck.TopicPartition(topic, p) for p in range(4)]
        committed = {tp.partition: tp.offset for tp in c.committed(tps, timeout=10)}
        high = {p: c.get_watermark_offsets(ck.TopicPartition(topic, p), timeout=10)[1]
                for p in range(4)}
        c.close()
        assert committed == high and sum(high.values()) == total
