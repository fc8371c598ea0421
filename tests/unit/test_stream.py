"""kv.data.stream: a directory that keeps receiving files (written under a temporary
name, then renamed), read by every rank in the same order, each its share; empty
batches while idle, idle_timeout, positions and resume, and bad files named."""

import gzip
import json
import os
import threading
import time

import numpy as np
import pytest

from kvcoll import InvalidArgumentError
from kvcoll.data import CriteoFormatError, ParquetFormatError
from kvcoll.data.position import PositionError, for_rank
from kvcoll.data.stream import StreamOrderError, stream

FAST = {"settle": 0.02, "idle_poll": 0.05}


def criteo_text(lo, hi, seed=0):
    """Criteo lines lo..hi-1: line i's first categorical value is i, its label i % 3 == 0."""
    rng = np.random.default_rng(seed + lo)
    out = []
    for i in range(lo, hi):
        ints = [str(int(v)) for v in rng.integers(0, 1000, 13)]
        cats = [format(i, "x")] + [format(int(v), "x") for v in rng.integers(0, 2**32, 25)]
        out.append("\t".join([str(int(i % 3 == 0)), *ints, *cats]) + "\n")
    return "".join(out)


def land(path, data: bytes):
    """Write `data` under a temporary dotfile name beside `path`, then rename it into place,
    as data pipelines do."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.rename(tmp, path)


def land_criteo(root, name, lo, hi, gz=False):
    text = criteo_text(lo, hi).encode()
    land(os.path.join(root, name), gzip.compress(text) if gz else text)


def parquet_bytes(lo, hi, row_group_size=50):
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    end = max(hi, lo + 1)         # typed columns, even for an empty file
    table = pa.table({"click": pa.array([int(i % 3 == 0) for i in range(lo, end)], pa.int8()),
                      "row": pa.array(np.arange(lo, end)),
                      "user": pa.array([f"u{i % 7}" for i in range(lo, end)]),
                      "tags": pa.array([[f"t{j}" for j in range(i % 3)] for i in range(lo, end)],
                                       pa.list_(pa.string())),
                      "price": pa.array(np.arange(lo, end) * 0.5)}).slice(0, hi - lo)
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=row_group_size)
    return buf.getvalue()


PQ = {"label": "click", "numeric": ["price"], "categorical": ["row", "user", "tags"],
      "multi_hot": ["tags"]}


def ids(batch):
    cat = batch["categorical"]
    return cat["row"] if isinstance(cat, dict) else cat[:, 0] & ((1 << 33) - 1)


def drain(s, limit=10_000):
    out = []
    for b in s:
        out.append(b)
        if len(out) >= limit:
            break
    return out


def data_batches(s):
    """A pass over files that all landed before it: its batches without the empty ones
    it yielded while idle at the end (a rank's empty share of a batch stays)."""
    out = drain(s)
    return out[:len(out) - s.stats.idle_batches]


def test_files_landing_while_ranks_read_are_each_read_once(tmp_path):
    root = str(tmp_path / "landing")
    os.makedirs(root)
    land_criteo(root, "dt=1/a.tsv", 0, 300)
    sizes = [(300, 517), (517, 900), (900, 901), (901, 1500)]

    def writer():
        for k, (lo, hi) in enumerate(sizes):
            time.sleep(0.15)
            land_criteo(root, f"dt={2 + k // 2}/f{k}.tsv" + (".gz" if k == 3 else ""), lo, hi,
                        gz=k == 3)
            # names that are not (yet) data: ignored
            land(os.path.join(root, f"dt={2 + k // 2}", "_temporary", "x.tsv"), b"junk")
            land(os.path.join(root, f"dt={2 + k // 2}", f"f{k}.tsv.tmp"), b"junk")

    got = {}

    def read(rank):
        s = stream(os.path.join(root, "dt=*", "*"), 64, rank, 2, format="criteo",
                   idle_timeout=0.6, **FAST)
        got[rank] = (drain(s), s.stats)

    t = threading.Thread(target=writer)
    t.start()
    readers = [threading.Thread(target=read, args=(r,)) for r in range(2)]
    for r in readers:
        r.start()
    t.join()
    for r in readers:
        r.join(30)
    seen = np.concatenate([ids(b) for r in range(2) for b in got[r][0]])
    assert np.array_equal(np.sort(seen), np.arange(1500))          # every line once
    labels = sum(float(b["label"].sum()) for r in range(2) for b in got[r][0])
    assert labels == sum(i % 3 == 0 for i in range(1500))
    for r in range(2):
        batches, stats = got[r]
        idle = [b for b in batches if b["label"].size == 0]
        assert idle and stats.idle_batches == len(idle)     # it waited, yielding empties
        assert all(b["categorical"].shape == (0, 26) and b["numeric"].shape == (0, 13)
                   for b in idle)
        assert stats.files == 5 and stats.rows == sum(b["label"].size for b in batches)
        assert max(b["label"].size for b in batches) <= 32          # its part of B


def test_every_rank_reads_the_files_in_one_order(tmp_path):
    root = str(tmp_path)
    for k in range(6):
        land_criteo(root, f"z{5 - k}.tsv", k * 100, (k + 1) * 100)
        time.sleep(0.01)
    s = stream(os.path.join(root, "*.tsv"), 100, 0, 1, idle_timeout=0.1, **FAST)
    order = [int(ids(b)[0]) // 100 for b in drain(s) if b["label"].size]
    assert order == list(range(6))            # arrival order, not name order


def test_global_split_gives_the_world_one_batches(tmp_path):
    root = str(tmp_path)
    land_criteo(root, "a.tsv", 0, 250)
    land_criteo(root, "b.tsv.gz", 250, 400, gz=True)
    def make(rank, world):
        return stream(os.path.join(root, "*"), 64, rank, world, format="criteo",
                      split="global", idle_timeout=0.1, **FAST)

    one = data_batches(make(0, 1))
    assert [b["label"].size for b in one] == [64, 64, 64, 58, 64, 64, 22]  # never across files
    parts = [data_batches(make(r, 3)) for r in range(3)]
    assert all(len(p) == len(one) for p in parts)
    for t, b in enumerate(one):
        np.testing.assert_array_equal(np.concatenate([ids(p[t]) for p in parts]), ids(b))


def test_idle_timeout_ends_a_stream_and_none_waits(tmp_path):
    s = stream(str(tmp_path / "*.tsv"), 8, 0, 1, idle_timeout=0.3, settle=0, idle_poll=0.05)
    t0 = time.monotonic()
    batches = drain(s)
    took = time.monotonic() - t0
    assert 0.3 <= took < 3
    assert 1 <= len(batches) <= 7 and all(b["label"].size == 0 for b in batches)
    forever = iter(stream(str(tmp_path / "*.tsv"), 8, 0, 1, idle_timeout=None, settle=0,
                          idle_poll=0.02))
    for _ in range(20):                  # keeps yielding empties well past any timeout
        assert next(forever)["label"].size == 0
    forever.close()


def test_success_markers_gate_partitions_when_required(tmp_path):
    root = str(tmp_path)
    land_criteo(root, "p=1/a.tsv", 0, 10)
    land_criteo(root, "p=2/a.tsv", 10, 20)
    s = stream(os.path.join(root, "p=*", "*.tsv"), 100, 0, 1, require_success=True,
               idle_timeout=0.2, **FAST)
    assert all(b["label"].size == 0 for b in drain(s))     # no marker, nothing read
    land(os.path.join(root, "p=2", "_SUCCESS"), b"")
    time.sleep(0.01)
    land(os.path.join(root, "p=1", "_SUCCESS"), b"")
    got = [b for b in drain(s) if b["label"].size]
    assert [int(ids(b)[0]) for b in got] == [10, 0]            # in the markers' order
    # a file added to a partition after its marker, after later files were read: late
    land_criteo(root, "p=2/b.tsv", 20, 30)
    with pytest.raises(StreamOrderError, match="p=2/b.tsv .*arrived .*before p=1/a.tsv"):
        drain(s)
    s2 = stream(os.path.join(root, "p=*", "*.tsv"), 100, 0, 1, require_success=True,
                on_late="skip", idle_timeout=0.2, **FAST)
    it = iter(s2)
    first = [next(it) for _ in range(2)]
    assert [int(ids(b)[0]) for b in first] == [10, 20]     # a fresh pass: all in order
    it.close()


def test_a_late_file_is_left_out_with_on_late_skip(tmp_path):
    root = str(tmp_path)
    land_criteo(root, "p=1/a.tsv", 0, 10)
    land(os.path.join(root, "p=1", "_SUCCESS"), b"")
    land_criteo(root, "p=2/a.tsv", 10, 20)
    land(os.path.join(root, "p=2", "_SUCCESS"), b"")
    s = stream(os.path.join(root, "*", "*.tsv"), 100, 0, 1, require_success=True,
               on_late="skip", idle_timeout=0.3, **FAST)
    it = iter(s)
    assert int(ids(next(it))[0]) == 0
    assert int(ids(next(it))[0]) == 10
    land_criteo(root, "p=1/late.tsv", 20, 30)
    rest = list(it)
    assert all(b["label"].size == 0 for b in rest)
    assert s.stats.late_files == ["p=1/late.tsv"]


def test_parquet_stream_with_lists_and_strings(tmp_path):
    root = str(tmp_path)
    land(os.path.join(root, "h=0", "a.parquet"), parquet_bytes(0, 130))
    land(os.path.join(root, "h=1", "b.parquet"), parquet_bytes(130, 200, row_group_size=30))
    for rank in range(2):
        s = stream(os.path.join(root, "h=*", "*.parquet"), 40, rank, 2, idle_timeout=0.1,
                   **FAST, **PQ)
        got = [b for b in drain(s) if b["label"].size]
        rows = np.concatenate([ids(b) for b in got])
        for b in got:
            values, splits = b["categorical"]["tags"]
            assert splits.size == b["label"].size + 1 and splits[-1] == values.size
            assert b["numeric"].shape == (b["label"].size, 1)
        assert len(set(rows.tolist())) == rows.size
        if rank == 0:
            first = set(rows.tolist())
    assert first.isdisjoint(rows.tolist()) and len(first) + rows.size == 200
    empty = stream(os.path.join(root, "h=*", "*.parquet"), 40, 0, 1, **FAST, **PQ).empty_batch()
    assert empty["categorical"]["tags"][1].tolist() == [0]
    assert empty["numeric"].shape == (0, 1)


# -- positions ----------------------------------------------------------------------------

def same(a, b):
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, tuple):
        return all(same(x, y) for x, y in zip(a, b, strict=True))
    return np.array_equal(a, b)


def landed_tree(root, fmt):
    if fmt == "parquet":
        land(os.path.join(root, "d=0", "a.parquet"), parquet_bytes(0, 333))
        land(os.path.join(root, "d=0", "b.parquet"), parquet_bytes(333, 400, row_group_size=20))
        land(os.path.join(root, "d=1", "c.parquet"), parquet_bytes(400, 401))
        land(os.path.join(root, "d=1", "d.parquet"), parquet_bytes(401, 700, row_group_size=64))
        return os.path.join(root, "d=*", "*.parquet"), PQ
    land_criteo(root, "d=0/a.tsv", 0, 333)
    land_criteo(root, "d=0/b.tsv.gz", 333, 400, gz=True)
    land_criteo(root, "d=1/c.tsv", 400, 401)
    land_criteo(root, "d=1/d.tsv.gz", 401, 700, gz=True)
    land_criteo(root, "d=1/e.tsv", 700, 900)
    return os.path.join(root, "d=*", "*"), {"format": "criteo"}


@pytest.mark.parametrize("fmt", ["criteo", "parquet"])
@pytest.mark.parametrize("split", ["part", "global"])
@pytest.mark.parametrize("rank, world", [(0, 1), (1, 2)])
def test_stream_resumes_where_it_was(tmp_path, fmt, split, rank, world):
    pattern, opts = landed_tree(str(tmp_path), fmt)

    def make():
        return stream(pattern, 32, rank, world, split=split, idle_timeout=0.15, prefetch=3,
                      block_bytes=1024, **FAST, **opts)

    full = data_batches(make())
    n = len(full)
    assert n > 6
    for k in sorted({0, 1, 3, n // 2, n - 1, n}):
        r = make()
        it = iter(r)
        got = [next(it) for _ in range(k)]
        deadline = time.monotonic() + 5
        while r._log.produced < k + 2 and time.monotonic() < deadline:
            time.sleep(0.01)                 # read ahead of what was consumed
        pos = json.loads(json.dumps(r.position_at(k)))
        it.close()
        assert all(same(g, w) for g, w in zip(got, full[:k], strict=True))
        fresh = make()
        fresh.resume(pos)
        rest = data_batches(fresh)
        assert len(rest) == n - k
        assert all(same(g, w) for g, w in zip(rest, full[k:], strict=True))


def test_a_new_pass_goes_on_after_one_that_ran_out(tmp_path):
    root = str(tmp_path)
    land_criteo(root, "a.tsv", 0, 100)
    s = stream(os.path.join(root, "*.tsv"), 64, 0, 1, idle_timeout=0.1, **FAST)
    assert sum(b["label"].size for b in drain(s)) == 100
    land_criteo(root, "b.tsv", 100, 150)
    again = [b for b in drain(s) if b["label"].size]
    assert [int(ids(b)[0]) for b in again] == [100]


def test_resume_needs_the_file_under_way_but_not_finished_ones(tmp_path):
    root = str(tmp_path)
    land_criteo(root, "a.tsv", 0, 100)
    land_criteo(root, "b.tsv", 100, 300)
    s = stream(os.path.join(root, "*.tsv"), 64, 0, 1, idle_timeout=0.1, **FAST)
    it = iter(s)
    for _ in range(3):
        next(it)
    inside_b = s.position_at(3)
    assert inside_b["last"][1] == "b.tsv" and inside_b["at"] is not None
    it.close()
    os.remove(os.path.join(root, "a.tsv"))                      # retention: fine
    fresh = stream(os.path.join(root, "*.tsv"), 64, 0, 1, idle_timeout=0.1, **FAST)
    fresh.resume(inside_b)
    assert int(ids(next(iter(fresh)))[0]) == 164
    os.rename(os.path.join(root, "b.tsv"), os.path.join(root, "c.tsv"))
    fresh.resume(inside_b)
    with pytest.raises(PositionError, match="inside b.tsv .*no longer there"):
        drain(fresh)
    # another world size: fine for split='global' positions, refused for 'part' ones
    land_criteo(root, "b.tsv", 100, 300)
    g = [stream(os.path.join(root, "*.tsv"), 64, r, 2, split="global", **FAST)
         for r in range(2)]
    positions = [x.position_at(0) for x in g]
    stream(os.path.join(root, "*.tsv"), 64, 0, 3, split="global").resume(
        for_rank(positions, 0, 3))
    part = [stream(os.path.join(root, "*.tsv"), 64, r, 2).position_at(0) for r in range(2)]
    with pytest.raises(PositionError, match="split='part'"):
        for_rank(part, 0, 3)


def test_bad_files_are_named(tmp_path):
    root = str(tmp_path)
    land_criteo(root, "a.tsv", 0, 10)
    land(os.path.join(root, "b.tsv"), criteo_text(10, 20).replace("\t", "\tx", 1).encode())
    s = stream(os.path.join(root, "*.tsv"), 64, 0, 1, idle_timeout=0.1, **FAST)
    with pytest.raises(CriteoFormatError, match=r"b\.tsv line 1: column 2"):
        drain(s)
    skip = stream(os.path.join(root, "*.tsv"), 64, 0, 1, idle_timeout=0.1,
                  on_bad_line="skip", **FAST)
    assert sum(b["label"].size for b in drain(skip)) == 19 and skip.stats.skipped == 1
    pq_root = str(tmp_path / "pq")
    land(os.path.join(pq_root, "a.parquet"), b"PAR1 not really")
    with pytest.raises(ParquetFormatError, match=r"cannot read .*a\.parquet"):
        drain(stream(os.path.join(pq_root, "*.parquet"), 8, 0, 1, **FAST, **PQ))
    os.remove(os.path.join(pq_root, "a.parquet"))
    land(os.path.join(pq_root, "b.parquet"), parquet_bytes(0, 10))
    lists = dict(PQ, multi_hot=[])
    with pytest.raises(ParquetFormatError, match=r"b\.parquet: column 'tags' is a list.*multi_hot"):
        drain(stream(os.path.join(pq_root, "*.parquet"), 8, 0, 1, **FAST, **lists))
    land(os.path.join(pq_root, "c.parquet"), parquet_bytes(0, 0))      # empty: skipped
    os.remove(os.path.join(pq_root, "b.parquet"))
    s = stream(os.path.join(pq_root, "*.parquet"), 8, 0, 1, idle_timeout=0.1, **FAST, **PQ)
    assert all(b["label"].size == 0 for b in drain(s)) and s.stats.empty_files == 1


def test_bad_arguments(tmp_path):
    with pytest.raises(InvalidArgumentError, match="does not say which"):
        stream(str(tmp_path / "*"), 8, 0, 1)
    with pytest.raises(InvalidArgumentError, match="need label="):
        stream(str(tmp_path / "*.parquet"), 8, 0, 1)
    with pytest.raises(InvalidArgumentError, match="idle_poll must be"):
        stream(str(tmp_path / "*.tsv"), 8, 0, 1, idle_poll=0)
    with pytest.raises(InvalidArgumentError, match="fixed columns"):
        stream(str(tmp_path / "*.tsv"), 8, 0, 1, label="click")
    with pytest.raises(InvalidArgumentError, match="multi_hot names 'x'"):
        stream(str(tmp_path / "*.parquet"), 8, 0, 1, label="c", categorical=["a"],
               multi_hot=["x"])


def test_stream_dataset_for_fit(tmp_path):
    import tensorflow as tf

    from kvcoll.data.position import source_of

    root = str(tmp_path)
    land_criteo(root, "a.tsv", 0, 100)
    s = stream(os.path.join(root, "*.tsv"), 64, 0, 1, idle_timeout=0.2, **FAST)
    ds = s.dataset()
    assert source_of(ds.prefetch(2)) is s
    sizes = [int(y.shape[0]) for _, y in ds.take(4)]
    assert sizes[:2] == [64, 36] and sizes[2:] == [0, 0]
    assert isinstance(sizes, list) and tf.is_tensor(next(iter(ds))[1])
