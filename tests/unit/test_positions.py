"""The data position protocol (kvcoll/data/position.py) on every finite source: a reader
read k batches ahead of what the loop consumed (prefetch on), its position_at(k) handed
to a fresh reader, gives exactly the batches an uninterrupted pass gives after batch k;
the pass after a resume is a full one; global positions resume on another world size,
part positions refuse to; the log's bounds, bad positions and source_of are checked."""

import gzip
import json
import time

import numpy as np
import pytest

from kvcoll.data import SyntheticCTR, read_criteo, read_parquet
from kvcoll.data.position import PositionError, for_rank, source_of

N, B = 1003, 64


def criteo_lines(n, seed=5, bad=()):
    """n Criteo lines; line i's first categorical value is i (its id names it); the
    lines in `bad` have a bad label."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ints = [str(int(v)) if v >= 0 else "" for v in rng.integers(-2, 1000, 13)]
        cats = [format(i, "x")] + [format(int(v), "x") for v in rng.integers(0, 2**32, 25)]
        label = "x" if i in bad else str(int(rng.integers(0, 2)))
        out.append("\t".join([label, *ints, *cats]) + "\n")
    return out


def criteo_files(tmp_path, gz=True, bad=()):
    """N lines in three files (plain, .gz or plain, plain without a final newline)."""
    lines = criteo_lines(N, bad=bad)
    paths = [tmp_path / "a.tsv", tmp_path / ("b.tsv.gz" if gz else "b.tsv"), tmp_path / "c.tsv"]
    paths[0].write_text("".join(lines[:400]))
    if gz:
        with gzip.open(paths[1], "wt") as f:
            f.write("".join(lines[400:700]))
    else:
        paths[1].write_text("".join(lines[400:700]))
    paths[2].write_text("".join(lines[700:]).rstrip("\n"))
    return [str(p) for p in paths]


def parquet_files(tmp_path, n=701, null_labels=()):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(3)
    table = pa.table({
        "click": pa.array([None if i in null_labels else int(v)
                           for i, v in enumerate(rng.integers(0, 2, n))], pa.int8()),
        "row": pa.array(np.arange(n)),
        "user": pa.array([f"user{i % 53}" for i in range(n)]),
        "history": pa.array([[f"h{(i * j) % 29}" for j in range(i % 5)] for i in range(n)],
                            pa.list_(pa.string())),
        "price": pa.array(rng.random(n)),
    })
    paths = [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    pq.write_table(table.slice(0, 400), paths[0], row_group_size=150)
    pq.write_table(table.slice(400), paths[1], row_group_size=64)
    return paths


PQ = {"label": "click", "numeric": ["price"], "categorical": ["row", "user", "history"]}


def same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, tuple):
        return isinstance(b, tuple) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return np.array_equal(np.asarray(a), np.asarray(b))


def assert_same_batches(got, want):
    assert len(got) == len(want), f"{len(got)} batches, want {len(want)}"
    for i, (g, w) in enumerate(zip(got, want)):
        assert same(g, w), f"batch {i} differs"


def take_ahead(reader, k):
    """k batches of a new pass, with the reader's thread let run ahead of them; then the
    position after those k, through JSON (what a checkpoint stores)."""
    it = iter(reader)
    got = [next(it) for _ in range(k)]
    deadline = time.monotonic() + 5
    thread = getattr(it, "_thread", None)
    while (reader._log.produced < k + min(2, reader.prefetch) and thread is not None
           and thread.is_alive() and time.monotonic() < deadline):
        time.sleep(0.01)                       # the reading thread runs ahead
    pos = reader.position_at(k)
    it.close()
    return got, json.loads(json.dumps(pos))


def check_resume(make, ks):
    full = list(make())
    assert len(full) > 3
    for k in ks(len(full)):
        r = make()
        got, pos = take_ahead(r, k)
        assert_same_batches(got, full[:k])
        fresh = make()
        fresh.resume(pos)
        assert fresh.position_at(0) == pos or k == len(full)
        assert_same_batches(list(fresh), full[k:] if k < len(full) else full)
        assert_same_batches(list(fresh), full)        # the pass after is a full one


def ks(n):
    return sorted({min(k, n) for k in (0, 1, 2, 5, n // 2, n - 1, n)})


@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize("rank, world", [(0, 1), (1, 3)])
def test_criteo_global_resumes_where_it_was(tmp_path, gz, rank, world):
    paths = criteo_files(tmp_path, gz=gz)
    check_resume(lambda: read_criteo(paths, B, rank, world, prefetch=3,
                                     block_bytes=4096), ks)


@pytest.mark.parametrize("gz", [True, False])
@pytest.mark.parametrize("rank, world", [(0, 1), (0, 2), (2, 3)])
def test_criteo_part_resumes_where_it_was(tmp_path, gz, rank, world):
    paths = criteo_files(tmp_path, gz=gz)
    check_resume(lambda: read_criteo(paths, B, rank, world, split="part", prefetch=3,
                                     block_bytes=4096), ks)


def test_criteo_part_with_more_gz_files_than_ranks(tmp_path):
    lines = criteo_lines(900)
    paths = []
    for k in range(4):
        p = tmp_path / f"f{k}.tsv.gz"
        with gzip.open(p, "wt") as f:
            f.write("".join(lines[k * 225:(k + 1) * 225]))
        paths.append(str(p))
    for rank in range(2):
        check_resume(lambda rank=rank: read_criteo(paths, B, rank, 2, split="part", prefetch=2),
                     ks)


@pytest.mark.parametrize("split", ["global", "part"])
def test_criteo_skipped_bad_lines_stay_skipped_after_a_resume(tmp_path, split):
    paths = criteo_files(tmp_path, gz=False, bad={3, 64, 65, 130, 401, 1000})
    check_resume(lambda: read_criteo(paths, B, 0, 2, split=split, on_bad_line="skip",
                                     prefetch=3, block_bytes=2048), ks)


def test_criteo_drop_remainder_and_start_step(tmp_path):
    paths = criteo_files(tmp_path)
    for split in ("global", "part"):
        def make(split=split):
            return read_criteo(paths, B, 1, 2, split=split, prefetch=2, drop_remainder=True,
                               start_step=2)

        check_resume(make, ks)
        # position_at(0) before any pass: where the pass will start, start_step included
        r = make()
        fresh = make()
        fresh.resume(r.position_at(0))
        assert_same_batches(list(fresh), list(make()))


@pytest.mark.parametrize("split", ["global", "part"])
@pytest.mark.parametrize("rank, world", [(0, 1), (1, 2), (2, 3), (4, 5)])
def test_parquet_resumes_where_it_was(tmp_path, split, rank, world):
    paths = parquet_files(tmp_path)
    check_resume(lambda: read_parquet(paths, B, rank, world, split=split, prefetch=3, **PQ), ks)


@pytest.mark.parametrize("split", ["global", "part"])
def test_parquet_dropped_rows_stay_dropped_after_a_resume(tmp_path, split):
    paths = parquet_files(tmp_path, null_labels={0, 63, 64, 150, 151, 399, 400, 700})
    check_resume(lambda: read_parquet(paths, B, 1, 2, split=split, prefetch=3,
                                      on_bad_line="skip", **PQ), ks)


def test_synthetic_batches_resume_where_they_were():
    data = SyntheticCTR(num_categorical=4, num_numeric=2, vocab=1000, seed=3)
    check_resume(lambda: data.batches(100, 1, 3, start_step=4, num_steps=12, prefetch=3), ks)
    # an endless source: resume at k, compare the next 5
    endless = data.batches(100, 0, 2, prefetch=2)
    _, pos = take_ahead(endless, 7)
    fresh = data.batches(100, 0, 2, prefetch=2)
    fresh.resume(pos)
    it = iter(fresh)
    for step in range(7, 12):
        assert same(next(it), data.batch(step, 100, 0, 2))


# -- another world size ----------------------------------------------------------------

def global_rows(batches_per_rank, key):
    """The global batches of a run, put together from each rank's slices."""
    return [np.concatenate([key(b[t]) for b in batches_per_rank])
            for t in range(len(batches_per_rank[0]))]


@pytest.mark.parametrize("kind", ["criteo", "parquet", "synthetic"])
def test_global_positions_resume_on_another_world_size(tmp_path, kind):
    if kind == "criteo":
        paths = criteo_files(tmp_path)

        def make(rank, world):
            return read_criteo(paths, B, rank, world, prefetch=2)

        def key(b):
            return b["categorical"][:, 0]
    elif kind == "parquet":
        paths = parquet_files(tmp_path)

        def make(rank, world):
            return read_parquet(paths, B, rank, world, prefetch=2, **PQ)

        def key(b):
            return b["categorical"]["row"]
    else:
        data = SyntheticCTR(num_categorical=3, num_numeric=1, vocab=10**6, seed=1)

        def make(rank, world):
            return data.batches(B, rank, world, num_steps=9, prefetch=2)

        def key(b):
            return b["categorical"][:, 0]
    whole = global_rows([list(make(0, 1))], key)
    k = 5
    positions = [take_ahead(make(r, 2), k)[1] for r in range(2)]
    resumed = []
    for r in range(3):
        reader = make(r, 3)
        reader.resume(for_rank(positions, r, 3))
        resumed.append(list(reader))
    for got, want in zip(global_rows(resumed, key), whole[k:], strict=True):
        np.testing.assert_array_equal(got, want)
    # a global position resumes another world size given directly, too
    reader = make(1, 3)
    reader.resume(positions[0])
    assert len(list(reader)) == len(whole) - k


def test_part_positions_refuse_another_world_size(tmp_path):
    paths = parquet_files(tmp_path)
    positions = [take_ahead(read_parquet(paths, B, r, 2, split="part", **PQ), 3)[1]
                 for r in range(2)]
    with pytest.raises(PositionError, match="split='part' was taken on 2 ranks and cannot "
                                            "resume on 3"):
        for_rank(positions, 0, 3)
    reader = read_parquet(paths, B, 0, 3, split="part", **PQ)
    with pytest.raises(PositionError, match="taken on 2 ranks with split='part'"):
        reader.resume(positions[0])
    same_world = read_parquet(paths, B, 1, 2, split="part", **PQ)
    with pytest.raises(PositionError, match="rank 0's, this is rank 1"):
        same_world.resume(positions[0])
    same_world.resume(for_rank(positions, 1, 2))


def test_for_rank_refuses_ranks_at_different_global_positions(tmp_path):
    paths = criteo_files(tmp_path)
    positions = [take_ahead(read_criteo(paths, B, r, 2), 3 + r)[1] for r in range(2)]
    assert for_rank(positions, 1, 2) == positions[1]           # the same world: its own
    with pytest.raises(PositionError, match="different positions"):
        for_rank(positions, 0, 3)
    with pytest.raises(PositionError, match="in rank order"):
        for_rank(positions[::-1], 0, 3)


# -- the log and bad positions -----------------------------------------------------------

def test_position_log_bounds_are_errors(tmp_path):
    paths = criteo_files(tmp_path)
    r = read_criteo(paths, B, prefetch=0)
    r.position_log = 4
    with pytest.raises(PositionError, match="no pass has begun"):
        r.position_at(1)
    it = iter(r)
    for _ in range(10):
        next(it)
    assert r.position_at(10)["rows"] == 10 * B
    assert r.position_at(7)["rows"] == 7 * B
    assert r.position_at(0)["rows"] == 0
    with pytest.raises(PositionError, match=r"batches 7\.\.10 of this pass only \(position_log=4"):
        r.position_at(6)
    with pytest.raises(PositionError, match="has produced only 10 batches"):
        r.position_at(11)
    with pytest.raises(PositionError, match="an int count"):
        r.position_at(2.0)


def test_bad_positions_are_refused_clearly(tmp_path):
    paths = criteo_files(tmp_path)
    r = read_criteo(paths, B)
    _, pos = take_ahead(read_criteo(paths, B), 3)
    with pytest.raises(PositionError, match="lacks kind"):
        r.resume({"rows": 3})
    with pytest.raises(PositionError, match="version 9, newer"):
        r.resume(dict(pos, version=9))
    with pytest.raises(PositionError, match="'parquet' one, this is a 'criteo'"):
        r.resume(dict(pos, kind="parquet"))
    with pytest.raises(PositionError, match="not a whole number of batches of 64"):
        r.resume(dict(pos, rows=100))
    with pytest.raises(PositionError, match="other files"):
        read_criteo(paths[:2], B).resume(pos)
    with pytest.raises(PositionError, match="split='global', this source reads split='part'"):
        read_criteo(paths, B, split="part").resume(pos)
    with pytest.raises(PositionError, match="a dict"):
        r.resume("rows=3")
    # a batch size that divides the rows resumes at the same row
    half = read_criteo(paths, B // 2)
    half.resume(pos)
    assert next(iter(half))["categorical"][0, 0] == 3 * B


# -- finding the source ------------------------------------------------------------------

def test_source_of_finds_the_reader_behind_what_fit_is_given(tmp_path):
    import tensorflow as tf

    paths = criteo_files(tmp_path)
    r = read_criteo(paths, B)
    assert source_of(r) is r
    assert source_of(r.fit_batches()) is r
    ds = r.dataset()
    assert source_of(ds) is r
    mapped = ds.map(lambda x, y: (x, y * 2)).prefetch(2).with_options(tf.data.Options())
    assert source_of(mapped) is r
    assert source_of(mapped.map(lambda x, y: (x, y), num_parallel_calls=2)) is r
    with pytest.raises(PositionError, match="Repeat"):
        source_of(ds.repeat(2))
    with pytest.raises(PositionError, match="Filter"):
        source_of(ds.map(lambda x, y: (x, y)).filter(lambda x, y: True))
    assert source_of(tf.data.Dataset.range(3).map(lambda x: x)) is None
    assert source_of([1, 2]) is None
    # the dataset's pass is the reader's pass: positions count its batches
    taken = 0
    for _ in ds.prefetch(4).take(5):
        taken += 1
    assert r.position_at(taken)["rows"] == 5 * B
    data = SyntheticCTR(num_categorical=2, num_numeric=1, vocab=100)
    src = data.batches(32, num_steps=4)
    sds = src.dataset()
    assert source_of(sds) is src
    assert len(list(sds)) == 4
