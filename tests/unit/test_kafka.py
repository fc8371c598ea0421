"""kv.data.kafka against librdkafka's mock cluster (no Kafka broker can be installed
here): rank r reads partitions p mod world = r; every message once; empty batches while
idle and idle_timeout; positions (next offsets) resume exactly, on another world size
too; offsets committed only on request; Criteo, JSON and decode= messages, bad ones
named by partition and offset."""

import json
import threading
import time
import uuid

import numpy as np
import pytest

from kvcoll import InvalidArgumentError

ck = pytest.importorskip("confluent_kafka")

from kvcoll.data.kafka import KafkaFormatError, KafkaReadError, KafkaStats, kafka  # noqa: E402
from kvcoll.data.position import PositionError, for_rank, source_of  # noqa: E402

FAST = {"idle_poll": 0.1}
# How long a read waits after its last message before it ends. The mock cluster's first
# fetch after a reader starts took more than 0.3 s with the unit tests running over 2
# workers on 2 cores (a read ended before its first message): 1 s leaves room.
IDLE = 1.0


@pytest.fixture(scope="module")
def cluster():
    """A mock cluster living in this process (its brokers listen on localhost ports),
    its bootstrap address, and a producer on it. Topics are made on first use, with 4
    partitions."""
    owner = ck.Producer({"test.mock.num.brokers": 1, "log_level": 2})
    md = owner.list_topics(timeout=10)
    bootstrap = ",".join(f"{b.host}:{b.port}" for b in md.brokers.values())
    producer = ck.Producer({"bootstrap.servers": bootstrap, "linger.ms": 1, "log_level": 2})
    yield bootstrap, producer
    producer.flush(10)
    del owner


def topic_name():
    return "t" + uuid.uuid4().hex[:10]


def line(i):
    """A Criteo line whose first categorical value is i and whose label is i % 3 == 0."""
    rng = np.random.default_rng(i)
    ints = [str(int(v)) for v in rng.integers(0, 1000, 13)]
    cats = [format(i, "x")] + [format(int(v), "x") for v in rng.integers(0, 2**32, 25)]
    return "\t".join([str(int(i % 3 == 0)), *ints, *cats]).encode()


def produce(producer, topic, lo, hi, value=line):
    for i in range(lo, hi):
        producer.produce(topic, value=value(i), partition=i % 4)
    producer.flush(10)


def ids(batch):
    cat = batch["categorical"]
    return cat["row"] if isinstance(cat, dict) else cat[:, 0] & ((1 << 33) - 1)


def read_all(reader, limit=100_000):
    out = []
    for b in reader:
        out.append(b)
        if len(out) >= limit:
            break
    return out


def test_ranks_read_their_partitions_each_message_once(cluster):
    bootstrap, producer = cluster
    topic = topic_name()
    produce(producer, topic, 0, 300)

    def late():
        time.sleep(0.4)
        produce(producer, topic, 300, 700)

    writer = threading.Thread(target=late)
    writer.start()
    got = {}

    def read(rank):
        r = kafka(topic, bootstrap, "g", 64, rank, 2, idle_timeout=1.0, prefetch=2, **FAST)
        got[rank] = (read_all(r), r)

    threads = [threading.Thread(target=read, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    writer.join()
    for t in threads:
        t.join(60)
    everything = []
    for rank in range(2):
        batches, r = got[rank]
        assert r.mine == [rank, rank + 2]
        rows = np.concatenate([ids(b) for b in batches])
        assert set((rows % 4).tolist()) <= {rank, rank + 2}         # its partitions only
        for p in r.mine:                                           # in offset order
            assert np.all(np.diff(rows[rows % 4 == p]) > 0)
        assert max(b["label"].size for b in batches) <= 32
        idle = [b for b in batches if b["label"].size == 0]
        assert idle and r.stats.idle_batches == len(idle)
        assert all(b["categorical"].shape == (0, 26) for b in idle)
        assert r.stats.messages == rows.size == r.stats.rows
        everything.append(rows)
    np.testing.assert_array_equal(np.sort(np.concatenate(everything)), np.arange(700))
    labels = sum(float(b["label"].sum()) for rank in range(2) for b in got[rank][0])
    assert labels == sum(i % 3 == 0 for i in range(700))


def test_positions_resume_exactly_and_commit_only_on_request(cluster):
    bootstrap, producer = cluster
    topic = topic_name()
    produce(producer, topic, 0, 1000)
    for rank in range(2):
        r = kafka(topic, bootstrap, "g", 50, rank, 2, idle_timeout=IDLE, prefetch=3, **FAST)
        it = iter(r)
        first = [next(it) for _ in range(7)]
        deadline = time.monotonic() + 5
        while r._log.produced < 9 and time.monotonic() < deadline:
            time.sleep(0.01)                     # the thread has read ahead
        pos = json.loads(json.dumps(r.position_at(7)))
        it.close()
        assert pos["split"] == "partitions" and set(pos["partitions"]) == {str(rank),
                                                                          str(rank + 2)}
        fresh = kafka(topic, bootstrap, "g", 50, rank, 2, idle_timeout=IDLE, **FAST)
        fresh.resume(pos)
        assert fresh.position_at(0) == pos
        rest = read_all(fresh)
        seen = np.concatenate([ids(b) for b in first + rest])
        mine = np.arange(1000)
        mine = mine[(mine % 4 == rank) | (mine % 4 == rank + 2)]
        np.testing.assert_array_equal(np.sort(seen), mine)          # each once, none lost
        # nothing was committed for the group while reading
        c = ck.Consumer({"bootstrap.servers": bootstrap, "group.id": "g", "log_level": 2})
        tps = [ck.TopicPartition(topic, p) for p in (rank, rank + 2)]
        assert all(tp.offset < 0 for tp in c.committed(tps, timeout=10))
        fresh.commit_offsets(pos)
        assert {tp.partition: tp.offset for tp in c.committed(tps, timeout=10)} == {
            int(p): o for p, o in pos["partitions"].items()}
        c.close()
        # start="committed" begins there; "latest" at the end
        committed = kafka(topic, bootstrap, "g", 50, rank, 2, start="committed",
                          idle_timeout=IDLE, **FAST)
        assert sum(b["label"].size for b in read_all(committed)) == mine.size - 7 * 25
        latest = kafka(topic, bootstrap, "g", 50, rank, 2, start="latest", idle_timeout=IDLE,
                       **FAST)
        assert sum(b["label"].size for b in read_all(latest)) == 0


def test_positions_merge_for_another_world_size(cluster):
    bootstrap, producer = cluster
    topic = topic_name()
    produce(producer, topic, 0, 400)
    positions, seen = [], []
    for rank in range(2):
        r = kafka(topic, bootstrap, "g", 40, rank, 2, prefetch=2, **FAST)
        it = iter(r)
        seen += [ids(next(it)) for _ in range(3)]
        positions.append(r.position_at(3))
        it.close()
    with pytest.raises(PositionError, match="for_rank"):
        kafka(topic, bootstrap, "g", 40, 0, 3, **FAST).resume(positions[0])
    for rank in range(3):
        r = kafka(topic, bootstrap, "g", 40, rank, 3, idle_timeout=IDLE, **FAST)
        r.resume(for_rank(positions, rank, 3))
        seen += [ids(b) for b in read_all(r)]
    np.testing.assert_array_equal(np.sort(np.concatenate(seen)), np.arange(400))


def test_idle_timeout_and_an_offset_gone(cluster):
    bootstrap, producer = cluster
    topic = topic_name()
    produce(producer, topic, 0, 4)
    r = kafka(topic, bootstrap, "g", 8, 0, 1, idle_timeout=0.5, idle_poll=0.1)
    t0 = time.monotonic()
    batches = read_all(r)
    assert 0.5 <= time.monotonic() - t0 < 5
    assert sum(b["label"].size for b in batches) == 4 and len(batches) >= 3
    forever = kafka(topic, bootstrap, "g", 8, 0, 1, start="latest", idle_poll=0.05)
    forever.resume(forever.position_at(0))     # before any pass: still as `start` says
    it = iter(forever)
    assert all(next(it)["label"].size == 0 for _ in range(10))
    assert forever.position_at(10)["partitions"] == {str(p): 1 for p in range(4)}  # concrete
    it.close()
    ahead = kafka(topic, bootstrap, "g", 8, 0, 1, **FAST)
    pos = ahead.position_at(0)
    ahead.resume(dict(pos, partitions={"0": 10**6}))
    with pytest.raises(KafkaReadError, match="partition 0 .*no longer in the topic"):
        read_all(ahead)


class Message:
    def __init__(self, offset):
        self._offset = offset

    def error(self):
        return None

    def partition(self):
        return 0

    def offset(self):
        return self._offset

    def value(self):
        return line(self._offset)


class LaggingConsumer:
    """A consumer whose next batch comes one empty poll after the last was taken (a
    client still fetching), `batches` batches of `size` messages in all."""

    def __init__(self, size, batches):
        self.size, self.left, self.offset, self.lag = size, batches, 0, False

    def consume(self, num_messages, timeout):
        if self.lag or not self.left:
            self.lag = False
            return []
        got = [Message(self.offset + i) for i in range(min(num_messages, self.size))]
        self.offset += len(got)
        self.left -= 1
        self.lag = True
        return got


def test_the_time_a_batch_waits_to_be_taken_is_not_idle(cluster):
    """idle_timeout counts the topic's silence only: a batch that waited longer than it to
    be taken (a slow step, a full prefetch queue) does not end the read at the next
    empty poll."""
    bootstrap, producer = cluster
    topic = topic_name()
    produce(producer, topic, 0, 1)           # (the topic, made; its messages not read here)
    r = kafka(topic, bootstrap, "g", 8, 0, 1, idle_timeout=0.3, **FAST)
    got = []
    for batch, _ in r._pass(LaggingConsumer(8, 4), {0: 0}, KafkaStats()):
        if batch["label"].size:
            got.append(batch)
            time.sleep(0.45)                    # the step that takes it is slow
    assert [int(x) for b in got for x in ids(b)] == list(range(32))


def test_json_and_decode_messages(cluster):
    bootstrap, producer = cluster
    topic = topic_name()

    def obj(i):
        return json.dumps({"click": i % 2, "row": i, "user": f"u{i % 5}" if i % 7 else None,
                           "tags": [f"t{j}" for j in range(i % 3)], "price": i / 2,
                           "extra": "ignored"}).encode()

    produce(producer, topic, 0, 100, obj)
    opts = {"format": "json", "label": "click", "numeric": ["price"],
            "categorical": ["row", "user", "tags"], "multi_hot": ["tags"]}
    r = kafka(topic, bootstrap, "g", 32, 0, 1, idle_timeout=IDLE, **opts, **FAST)
    batches = [b for b in read_all(r) if b["label"].size]
    rows = np.concatenate([ids(b) for b in batches])
    np.testing.assert_array_equal(np.sort(rows), np.arange(100))
    b = batches[0]
    i = int(b["categorical"]["row"][0])
    _, splits = b["categorical"]["tags"]
    assert splits[1] - splits[0] == i % 3
    assert b["numeric"][0, 0] == i / 2 and b["label"][0] == i % 2
    nulls = np.concatenate([x["categorical"]["user"][ids(x) % 7 == 0] for x in batches])
    assert (nulls == -1).all()
    ds = r.dataset()
    assert source_of(ds) is r
    # a bad message is named by its partition and offset
    produce(producer, topic, 100, 101, lambda i: b"{not json")
    produce(producer, topic, 101, 102, lambda i: json.dumps({"row": 1, "click": None}).encode())
    bad = kafka(topic, bootstrap, "g", 200, 0, 1, idle_timeout=IDLE, **opts, **FAST)
    with pytest.raises(KafkaFormatError, match=r"partition 0 offset 25: the message is not JSON"):
        read_all(bad)
    skip = kafka(topic, bootstrap, "g", 200, 0, 1, idle_timeout=IDLE, on_bad_line="skip",
                 **opts, **FAST)
    assert sum(b["label"].size for b in read_all(skip)) == 100 and skip.stats.skipped == 2

    def decode(values):
        x = np.array([int(v) for v in values], np.int64)
        return {"categorical": {"row": x}, "numeric": np.zeros((x.size, 0), np.float32),
                "label": (x % 2).astype(np.float32)}

    topic2 = topic_name()
    produce(producer, topic2, 0, 50, lambda i: str(i).encode())
    d = kafka(topic2, bootstrap, "g", 16, 0, 1, decode=decode, idle_timeout=IDLE, **FAST)
    assert sorted(np.concatenate([ids(b) for b in read_all(d)]).tolist()) == list(range(50))
    feats, label = d.features(d.empty_batch())
    assert list(feats) == ["row"] and label.size == 0
    spec = d._signature(__import__("tensorflow"))
    assert list(spec[0]) == ["row"]


def test_a_bad_criteo_message_is_named(cluster):
    bootstrap, producer = cluster
    topic = topic_name()
    produce(producer, topic, 0, 8)
    produce(producer, topic, 8, 9, lambda i: line(i) + b"\n" + line(i))
    r = kafka(topic, bootstrap, "g", 100, 0, 1, idle_timeout=IDLE, **FAST)
    with pytest.raises(KafkaFormatError, match="partition 0 offset 2: a message holds more than "
                                               "one line"):
        read_all(r)


def test_bad_arguments(cluster):
    bootstrap, producer = cluster
    topic = topic_name()
    produce(producer, topic, 0, 1)
    with pytest.raises(InvalidArgumentError, match="enable.auto.commit"):
        kafka(topic, bootstrap, "g", 8, 0, 1, config={"enable.auto.commit": True})
    with pytest.raises(InvalidArgumentError, match="topic 'nope.*Unknown topic"):
        kafka("nope" + topic, bootstrap, "g", 8, 0, 1)
    with pytest.raises(KafkaReadError, match="cannot reach 127.0.0.1:1 within 1.0 s"):
        kafka(topic, "127.0.0.1:1", "g", 8, 0, 1, timeout=1.0, config={"log_level": 0})
    with pytest.raises(InvalidArgumentError, match="needs label="):
        kafka(topic, bootstrap, "g", 8, 0, 1, format="json")
    with pytest.raises(InvalidArgumentError, match="start must be"):
        kafka(topic, bootstrap, "g", 8, 0, 1, start="beginning")
    r = kafka(topic, bootstrap, "g", 8, 0, 1)
    with pytest.raises(PositionError, match="topic 'other'"):
        r.resume(dict(r.position_at(0), topic="other"))
