"""kvcoll.data's file readers (Criteo TSV and Parquet on pyarrow), one process playing
every rank: every line goes to exactly one rank, global batches do not depend on the
world size (split="global"), each rank reads its own part (split="part"), and bad data
gets an error naming file, line and column, or is skipped and counted."""

import gzip
import os

import numpy as np
import pytest

from kvcoll import InvalidArgumentError
from kvcoll.data import (
    CriteoFormatError,
    ParquetFormatError,
    even_split,
    parse_criteo_lines,
    read_criteo,
    read_parquet,
)
from kvcoll.data._prefetch import Prefetch
from kvcoll.ids import hash_strings

KEYS = ("categorical", "numeric", "label")


def random_lines(n, seed):
    """n Criteo lines with empty fields, negative and upper-case values."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        ints = [("" if rng.random() < 0.15 else str(int(rng.integers(-3, 10**int(rng.integers(1, 7))))))
                for _ in range(13)]
        cats = [("" if rng.random() < 0.1 else format(int(rng.integers(0, 2**32)),
                                                       "X" if rng.random() < 0.1 else "x"))
                for _ in range(26)]
        out.append("\t".join([str(int(rng.integers(0, 2))), *ints, *cats]) + "\n")
    return out


def write_files(tmp_path, lines, split_at, gz=(), last_newline=False):
    """lines cut into files at the given line numbers; files whose index is in gz are
    gzipped; the very last line has no newline unless last_newline."""
    paths, bounds = [], [0, *split_at, len(lines)]
    for k in range(len(bounds) - 1):
        text = "".join(lines[bounds[k]:bounds[k + 1]])
        if k == len(bounds) - 2 and not last_newline:
            text = text.rstrip("\n")
        path = tmp_path / (f"part{k}.tsv" + (".gz" if k in gz else ""))
        if k in gz:
            with gzip.open(path, "wt") as f:
                f.write(text)
        else:
            path.write_text(text)
        paths.append(str(path))
    return paths


def concat(batches):
    return {k: np.concatenate([b[k] for b in batches]) for k in KEYS}


def assert_same(a, b, msg=""):
    for k in KEYS:
        np.testing.assert_array_equal(a[k], b[k], err_msg=f"{msg} {k}")


LINES = random_lines(97, seed=1)
REF = parse_criteo_lines([ln.encode() for ln in LINES])


@pytest.mark.parametrize("layout", ["one file", "three files", "gz", "mixed gz"])
@pytest.mark.parametrize("batch", [10, 97, 128])
def test_criteo_global_batches_do_not_depend_on_the_world_size(tmp_path, layout, batch):
    split_at, gz = {"one file": ([], ()), "three files": ([30, 31], ()),
                    "gz": ([50], (0, 1)), "mixed gz": ([13, 60], (1,))}[layout]
    paths = write_files(tmp_path, LINES, split_at, gz)
    steps = -(-len(LINES) // batch)
    for world in (1, 2, 3):
        per_rank = [list(read_criteo(paths, batch, r, world, block_bytes=4096)) for r in range(world)]
        assert {len(p) for p in per_rank} == {steps}   # every rank, every step
        for t in range(steps):
            size = min(batch, len(LINES) - t * batch)
            for r in range(world):                     # rank r: its even_split part
                lo, hi = even_split(size, r, world)
                assert per_rank[r][t]["label"].size == hi - lo
            want = {k: v[t * batch:t * batch + size] for k, v in REF.items()}
            assert_same(concat([p[t] for p in per_rank]), want, f"world {world} step {t}")


def test_criteo_output_layout_and_drop_remainder(tmp_path):
    paths = write_files(tmp_path, LINES, [40])
    batches = list(read_criteo(paths, 32, drop_remainder=True))
    assert [b["label"].size for b in batches] == [32, 32, 32]
    b = batches[0]
    assert b["categorical"].dtype == np.int64 and b["categorical"].shape == (32, 26)
    assert b["numeric"].dtype == np.float32 and b["numeric"].shape == (32, 13)
    assert b["label"].dtype == np.float32
    assert b["categorical"][:, 5].flags.c_contiguous      # a field's ids, no copy
    last = list(read_criteo(paths, 32, rank=1, world=2))[-1]
    assert last["label"].size == even_split(97 - 96, 1, 2)[1] - even_split(1, 1, 2)[0] == 0


@pytest.mark.parametrize("gz", [(), (0, 1, 2), (1,)])
def test_criteo_part_gives_every_line_to_exactly_one_rank(tmp_path, gz):
    paths = write_files(tmp_path, LINES, [20, 61], gz)
    order = np.lexsort(REF["categorical"].T)
    for world in (1, 2, 3, 4):
        got = []
        for r in range(world):
            reader = read_criteo(paths, 8, r, world, split="part", block_bytes=1000)
            batches = list(reader)
            size = even_split(8, r, world)[1] - even_split(8, r, world)[0]
            assert all(b["label"].size == size for b in batches[:-1])
            assert reader.stats.rows == sum(b["label"].size for b in batches)
            got.append(concat(batches))
        both = concat(got)
        assert both["label"].size == len(LINES)
        idx = np.lexsort(both["categorical"].T)          # the same lines, each once
        assert_same({k: v[idx] for k, v in both.items()}, {k: v[order] for k, v in REF.items()})
        if not gz and world > 1:                          # byte ranges: rank r's lines
            assert got[0]["label"].size not in (0, len(LINES))


def test_criteo_part_note_when_gz_files_are_fewer_than_ranks(tmp_path):
    paths = write_files(tmp_path, LINES, [], gz=(0,))
    reader = read_criteo(paths, 10, 1, 3, split="part")
    assert "cannot be split" in reader.note and reader.pieces is None
    assert read_criteo(paths, 10, 0, 1, split="part").note == ""


def test_criteo_last_line_with_and_without_newline_and_crlf(tmp_path):
    a = write_files(tmp_path / "a", LINES, [50], last_newline=True) \
        if (tmp_path / "a").mkdir() is None else None
    b = write_files(tmp_path, [ln.replace("\n", "\r\n") for ln in LINES], [50])
    for paths in (a, b):
        assert_same(concat(list(read_criteo(paths, 16))), REF)


def test_criteo_iterates_again_and_prefetches(tmp_path):
    paths = write_files(tmp_path, LINES, [])
    reader = read_criteo(paths, 16, prefetch=3)
    first, second = concat(list(reader)), concat(list(reader))
    assert_same(first, second)                           # one pass per iteration
    assert_same(concat(list(read_criteo(paths, 16, prefetch=0))), first)
    assert next(reader)["label"].size == 16
    reader.close()


# -- bad data ---------------------------------------------------------------------------

def bad_file(tmp_path, line_no, text, name="bad.tsv"):
    lines = list(LINES[:20])
    lines[line_no - 1] = text
    path = tmp_path / name
    path.write_text("".join(lines))
    return str(path)


def with_column(col, value):
    cols = LINES[4].rstrip("\n").split("\t")
    cols[col] = value
    return "\t".join(cols) + "\n"


@pytest.mark.parametrize("text,match", [
    ("1\t2\t3\n", "line 7: expected 40 tab-separated columns .* got 3"),
    ("\n", "line 7: expected 40 tab-separated columns .* got 1"),
    (with_column(0, "x"), r"line 7: column 1: the label must be 0 or 1, got 'x'"),
    (with_column(0, "2"), r"line 7: column 1: the label must be 0 or 1, got '2'"),
    (with_column(0, ""), r"line 7: column 1: the label must be 0 or 1, got ''"),
    (with_column(4, "1.5"), r"line 7: column 5: '1.5' is not an integer"),
    (with_column(13, "12345678901234567890"), r"line 7: column 14: '12345678901234567890' is"),
    (with_column(20, "68fd1e6g"), r"line 7: column 21: '68fd1e6g' is not a hex string"),
    (with_column(39, "123456789"), r"line 7: column 40: '123456789' is not a hex string"),
])
@pytest.mark.parametrize("split", ["global", "part"])
def test_criteo_bad_lines_name_file_line_and_column(tmp_path, text, match, split):
    path = bad_file(tmp_path, 7, text)
    with pytest.raises(CriteoFormatError, match=r"criteo: .*bad\.tsv " + match):
        list(read_criteo(path, 4, split=split))
    # the rank that owns line 7 raises: of 2 ranks, rank 1 in global batch 1 (lines
    # 5-8), rank 0 in split="part" (the first half of the bytes)
    owner = 1 if split == "global" else 0
    with pytest.raises(CriteoFormatError, match=r"bad\.tsv " + match):
        list(read_criteo(path, 4, owner, 2, split=split, block_bytes=512))
    reader = read_criteo(path, 4, split=split, on_bad_line="skip")
    got = concat(list(reader))
    keep = [i for i in range(20) if i != 6]
    assert_same(got, {k: v[keep] for k, v in REF.items()})
    assert reader.stats.skipped == 1 and reader.stats.rows == 19
    assert "bad.tsv line 7" in reader.stats.skipped_examples[0]


def test_criteo_skip_keeps_global_batches_world_independent(tmp_path):
    lines = list(LINES)
    for i in (3, 40, 41, 90):
        lines[i] = "garbage\n"
    path = tmp_path / "g.tsv"
    path.write_text("".join(lines))
    keep = [i for i in range(len(lines)) if i not in (3, 40, 41, 90)]
    want = [[i for i in keep if t * 16 <= i < (t + 1) * 16] for t in range(7)]
    for world in (1, 2, 3):
        parts = [list(read_criteo(path, 16, r, world, on_bad_line="skip")) for r in range(world)]
        for t in range(7):
            assert_same(concat([p[t] for p in parts]), {k: v[want[t]] for k, v in REF.items()})


def test_criteo_error_in_a_later_file_names_it_after_earlier_batches(tmp_path):
    paths = write_files(tmp_path, LINES[:30], [10])
    with open(paths[1], "a") as f:
        f.write("\n1\t2\n")
    it = iter(read_criteo(paths, 5, prefetch=2))
    got = [next(it) for _ in range(6)]                       # its 20 lines come first
    assert sum(b["label"].size for b in got) == 30
    with pytest.raises(CriteoFormatError, match=r"part1\.tsv line 21: expected 40"):
        next(it)


def test_criteo_empty_and_unreadable_paths(tmp_path):
    good = write_files(tmp_path, LINES[:10], [])
    empty = tmp_path / "empty.tsv"
    empty.write_text("")
    empty_gz = tmp_path / "empty.tsv.gz"
    with gzip.open(empty_gz, "wt"):
        pass
    with pytest.raises(CriteoFormatError, match=r"empty\.tsv is empty"):
        read_criteo([*good, empty], 4)
    with pytest.raises(CriteoFormatError, match=r"empty\.tsv\.gz is empty"):
        list(read_criteo([*good, empty_gz], 4))
    reader = read_criteo([empty, *good, empty_gz], 4, on_bad_line="skip")
    assert_same(concat(list(reader)), {k: v[:10] for k, v in REF.items()})
    assert reader.stats.empty_files == 2
    with pytest.raises(InvalidArgumentError, match="no such file: .*missing.tsv"):
        read_criteo([*good, tmp_path / "missing.tsv"], 4)
    with pytest.raises(InvalidArgumentError, match="is not a file"):
        read_criteo(tmp_path, 4)
    with pytest.raises(InvalidArgumentError, match="matches no file"):
        read_criteo(str(tmp_path / "*.nothing"), 4)
    assert read_criteo(str(tmp_path / "part*.tsv"), 4).paths == good     # a glob
    corrupt = tmp_path / "corrupt.tsv.gz"
    corrupt.write_bytes(b"\x1f\x8b\x08\x00garbage")
    with pytest.raises(InvalidArgumentError, match=r"cannot read .*corrupt\.tsv\.gz"):
        list(read_criteo(corrupt, 4))


def test_reader_arguments_are_checked(tmp_path):
    path = write_files(tmp_path, LINES[:10], [])
    for kwargs, match in [({"batch_size": 0}, "batch_size must be an int >= 1"),
                          ({"split": "rows"}, "split must be one of"),
                          ({"on_bad_line": "warn"}, "on_bad_line must be one of"),
                          ({"prefetch": -1}, "prefetch must be an int >= 0"),
                          ({"rank": 2, "world": 2}, "rank < world"),
                          ({"rank": 1}, "give both rank and world"),
                          ({"batch_size": 2, "rank": 0, "world": 3, "split": "part"},
                           "batch_size 2 < world 3")]:
        kwargs = {"batch_size": 4, **kwargs}
        with pytest.raises(InvalidArgumentError, match=match):
            read_criteo(path, **kwargs)


def test_prefetch_reraises_on_the_consumer_after_the_good_items():
    def gen():
        yield 1
        yield 2
        raise CriteoFormatError("criteo: f.tsv line 3: column 2: bad")

    it = Prefetch(gen(), depth=1)
    assert [next(it), next(it)] == [1, 2]
    with pytest.raises(CriteoFormatError, match="f.tsv line 3: column 2"):
        next(it)
    with pytest.raises(StopIteration):
        next(it)
    stopped = Prefetch(iter(range(10**9)), depth=2)     # closing ends the thread
    assert next(stopped) == 0
    stopped.close()
    assert not stopped._thread.is_alive()


# -- Parquet ----------------------------------------------------------------------------

def parquet_files(tmp_path, n=701):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(3)
    table = pa.table({
        "click": pa.array(rng.integers(0, 2, n).astype(np.int8)),
        "user": pa.array([f"user{i % 53}" if i % 11 else None for i in range(n)]),
        "item": pa.array(rng.integers(-2**40, 2**40, n)),
        "site": pa.array([f"s{i % 7}" for i in range(n)]).dictionary_encode(),
        "history": pa.array([[f"h{(i * j) % 29}" for j in range(i % 5)] if i % 13 else None
                             for i in range(n)], pa.list_(pa.string())),
        "price": pa.array([float(v) if i % 9 else None for i, v in enumerate(rng.random(n))]),
        "count": pa.array([i % 17 if i % 6 else None for i in range(n)], pa.int32()),
    })
    paths = [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    pq.write_table(table.slice(0, 400), paths[0], row_group_size=150)
    pq.write_table(table.slice(400), paths[1], row_group_size=64)
    return paths, table


PQ = {"label": "click", "numeric": ["price", "count"], "categorical": ["user", "item", "site",
                                                                  "history"]}


def parquet_expected(table):
    return {"label": table["click"].to_numpy().astype(np.float32),
            "user": np.array([hash_strings([v])[0] if v is not None else -1
                              for v in table["user"].to_pylist()]),
            "item": table["item"].to_numpy(),
            "site": hash_strings(np.array(table["site"].to_pylist())),
            "history": [hash_strings(np.array(v or [], dtype=object)) for v in
                        table["history"].to_pylist()],
            "numeric": np.stack([np.nan_to_num(table["price"].to_numpy(zero_copy_only=False)),
                                 table["count"].fill_null(0).to_numpy()], 1).astype(np.float32)}


def rows_of(batches):
    """(label, user, item, site, history lists, numeric) of batches, in order."""
    out = {"label": [], "user": [], "item": [], "site": [], "history": [], "numeric": []}
    for b in batches:
        out["label"].append(b["label"])
        out["numeric"].append(b["numeric"])
        for c in ("user", "item", "site"):
            out[c].append(b["categorical"][c])
        values, splits = b["categorical"]["history"]
        assert splits[0] == 0 and splits[-1] == values.size and splits.size == b["label"].size + 1
        out["history"] += [values[splits[i]:splits[i + 1]] for i in range(splits.size - 1)]
    return {k: (v if k == "history" else np.concatenate(v)) for k, v in out.items()}


def assert_rows(got, want, idx=None):
    idx = np.arange(want["label"].size) if idx is None else idx
    for k in ("label", "user", "item", "site", "numeric"):
        np.testing.assert_array_equal(got[k], want[k][idx], err_msg=k)
    assert len(got["history"]) == idx.size
    for g, i in zip(got["history"], idx):
        np.testing.assert_array_equal(g, want["history"][i])


@pytest.mark.parametrize("batch", [64, 150, 1000])
def test_parquet_global_batches_do_not_depend_on_the_world_size(tmp_path, batch):
    paths, table = parquet_files(tmp_path)
    want = parquet_expected(table)
    n = table.num_rows
    steps = -(-n // batch)
    for world in (1, 2, 3):
        per_rank = [list(read_parquet(paths, batch, r, world, **PQ)) for r in range(world)]
        assert {len(p) for p in per_rank} == {steps}
        for t in range(steps):
            size = min(batch, n - t * batch)
            for r in range(world):
                lo, hi = even_split(size, r, world)
                assert per_rank[r][t]["label"].size == hi - lo
            got = rows_of([p[t] for p in per_rank])
            assert_rows(got, want, np.arange(t * batch, t * batch + size))


def test_parquet_part_assigns_row_groups_and_every_row_once(tmp_path):
    paths, table = parquet_files(tmp_path)
    want = parquet_expected(table)
    for world in (1, 2, 3, 5, 12):                        # 12 > 9 row groups: rows split
        seen = []
        for r in range(world):
            batches = list(read_parquet(paths, 24, r, world, split="part", **PQ))
            size = even_split(24, r, world)[1] - even_split(24, r, world)[0]
            assert all(b["label"].size == size for b in batches[:-1])
            seen.append(rows_of(batches)["item"])
        items = np.concatenate(seen)
        assert np.array_equal(np.sort(items), np.sort(want["item"]))   # each row once


def test_parquet_dataset_for_fit(tmp_path):
    tf = pytest.importorskip("tensorflow")
    paths, table = parquet_files(tmp_path)
    reader = read_parquet(paths, 100, 0, 1, **PQ)
    ds = reader.dataset()
    feats, label = next(iter(ds))
    assert set(feats) == {"user", "item", "site", "history", "numeric"}
    assert isinstance(feats["history"], tf.RaggedTensor)
    want = parquet_expected(table)
    np.testing.assert_array_equal(label.numpy(), want["label"][:100])
    np.testing.assert_array_equal(feats["user"].numpy(), want["user"][:100])
    for i in (0, 1, 4):
        np.testing.assert_array_equal(feats["history"][i].numpy(), want["history"][i])
    assert sum(int(lbl.shape[0]) for _, lbl in ds) == table.num_rows   # again: a new pass


def test_criteo_dataset_for_fit(tmp_path):
    pytest.importorskip("tensorflow")
    paths = write_files(tmp_path, LINES, [33])
    feats, label = next(iter(read_criteo(paths, 40).dataset()))
    assert set(feats) == {f"C{i + 1}" for i in range(26)} | {"numeric"}
    np.testing.assert_array_equal(feats["C3"].numpy(), REF["categorical"][:40, 2])
    np.testing.assert_array_equal(feats["numeric"].numpy(), REF["numeric"][:40])
    np.testing.assert_array_equal(label.numpy(), REF["label"][:40])


def test_parquet_errors_name_file_row_group_and_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    paths, table = parquet_files(tmp_path)
    with pytest.raises(ParquetFormatError, match=r"a\.parquet has no column 'clicks'"):
        read_parquet(paths, 10, label="clicks")
    with pytest.raises(ParquetFormatError, match=r"column 'user' has type string; the label must"):
        read_parquet(paths, 10, label="user")
    with pytest.raises(ParquetFormatError, match=r"column 'price' has type double; a categorical"):
        read_parquet(paths, 10, label="click", categorical=["price"])
    labels = table["click"].to_pylist()
    labels[450] = None                       # b.parquet: row group 0, row 50
    bad = table.set_column(0, "click", pa.array(labels, pa.int8()))
    pq.write_table(bad.slice(400), paths[1], row_group_size=64)
    with pytest.raises(ParquetFormatError, match=r"b\.parquet row group 0 row 50: column "
                                                 r"'click' \(the label\) is null"):
        list(read_parquet(paths, 32, **PQ))
    reader = read_parquet(paths, 32, **PQ, on_bad_line="skip")
    got = rows_of(list(reader))
    assert reader.stats.skipped == 1 and got["label"].size == table.num_rows - 1
    assert_rows(got, parquet_expected(table), np.delete(np.arange(table.num_rows), 450))
    empty = str(tmp_path / "empty.parquet")
    pq.write_table(table.slice(0, 0), empty)
    with pytest.raises(ParquetFormatError, match=r"empty\.parquet is empty"):
        read_parquet([empty, *paths], 10, **PQ)
    assert read_parquet([empty, paths[0]], 10, **PQ, on_bad_line="skip").rows == 400
    notparquet = tmp_path / "x.parquet"
    notparquet.write_text("hello")
    with pytest.raises(ParquetFormatError, match=r"cannot read .*x\.parquet"):
        read_parquet(notparquet, 10, **PQ)
    os.remove(paths[1])
    with pytest.raises(InvalidArgumentError, match=r"no such file: .*b\.parquet"):
        read_parquet(paths, 10, **PQ)


@pytest.mark.parametrize("split", ["global", "part"])
def test_start_step_resumes_where_a_run_stopped(tmp_path, split):
    paths = write_files(tmp_path, LINES, [45])
    pq_paths, _ = parquet_files(tmp_path)
    for world in (1, 2):
        for r in range(world):
            full = list(read_criteo(paths, 8, r, world, split=split, block_bytes=700))
            for s in (0, 3, 6, len(full) - 1, len(full), len(full) + 2):
                later = list(read_criteo(paths, 8, r, world, split=split, block_bytes=700,
                                         start_step=s))
                assert len(later) == max(0, len(full) - s)
                for a, b in zip(later, full[s:]):
                    assert_same(a, b, f"start {s}")
            full = list(read_parquet(pq_paths, 40, r, world, split=split, **PQ))
            later = list(read_parquet(pq_paths, 40, r, world, split=split, start_step=5, **PQ))
            assert len(later) == len(full) - 5
            for a, b in zip(later, full[5:]):
                np.testing.assert_array_equal(a["categorical"]["item"], b["categorical"]["item"])


def test_an_abandoned_pass_stops_its_reading_thread(tmp_path):
    import gc
    import threading

    paths = write_files(tmp_path, LINES, [])
    before = {t.ident for t in threading.enumerate()}
    it = iter(read_criteo(paths, 4, prefetch=1))
    next(it)
    thread = next(t for t in threading.enumerate() if t.ident not in before)
    del it                                  # a loop that breaks early, say
    gc.collect()
    thread.join(timeout=5)
    assert not thread.is_alive()
