"""kvcoll.data's file readers under MPI, at any world size: every rank writes the same
files (from one seed), reads its own part with kvcoll's rank and world, and checks
with every other rank that each line went to exactly one rank, in the same global
batches as on one rank; model.fit trains on a reader's tf.data.Dataset, and a bad line
on one rank stops every rank with its file and line."""

import gzip

import keras
import numpy as np
import pytest

import kvcoll as kv
from kvcoll.data import even_split, read_criteo, read_parquet

N, B = 1003, 64


def criteo_files(tmp_path):
    """N lines in three files (plain, .gz, plain without a final newline); line i's
    first categorical value is i, so its id names it."""
    rng = np.random.default_rng(5)
    lines = []
    for i in range(N):
        ints = [str(int(v)) if v >= 0 else "" for v in rng.integers(-2, 1000, 13)]
        cats = [format(i, "x")] + [format(int(v), "x") for v in rng.integers(0, 2**32, 25)]
        lines.append("\t".join([str(i % 2), *ints, *cats]) + "\n")
    paths = [tmp_path / "a.tsv", tmp_path / "b.tsv.gz", tmp_path / "c.tsv"]
    paths[0].write_text("".join(lines[:400]))
    with gzip.open(paths[1], "wt") as f:
        f.write("".join(lines[400:700]))
    paths[2].write_text("".join(lines[700:]).rstrip("\n"))
    return [str(p) for p in paths]


def line_ids(batch):
    return batch["categorical"][:, 0]          # field 0's id = the line number


@pytest.mark.parametrize("gz", [True, False])
def test_criteo_global_batches_are_the_one_rank_batches(comm, tmp_path, gz):
    paths = criteo_files(tmp_path)
    if not gz:
        paths = [paths[0], paths[2]]
    lines = np.arange(N) if gz else np.r_[0:400, 700:N]
    batches = list(read_criteo(paths, B))        # kvcoll's rank and world
    steps = -(-lines.size // B)
    assert len(batches) == steps
    assert comm.allgather(np.array([len(batches)]))[:, 0].tolist() == [steps] * comm.size
    for t, b in enumerate(batches):
        size = min(B, lines.size - t * B)
        lo, hi = even_split(size, comm.rank, comm.size)
        assert b["label"].size == hi - lo
        got, _ = comm.allgatherv(line_ids(b))
        np.testing.assert_array_equal(got, lines[t * B:t * B + size])   # rank order = batch


def test_criteo_part_gives_every_line_to_exactly_one_rank(comm, tmp_path):
    paths = criteo_files(tmp_path)
    plain = [paths[0], paths[2]]
    for files, lines in ((plain, np.r_[0:400, 700:N]), (paths, np.arange(N))):
        mine = np.concatenate([line_ids(b) for b in read_criteo(files, B, split="part")])
        got, counts = comm.allgatherv(mine)
        np.testing.assert_array_equal(np.sort(got), lines)     # each line once
        if comm.size > 1 and files is plain:
            assert (counts > 0).all()                              # byte ranges: all read


def parquet_files(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"y": pa.array(np.arange(N) % 2, pa.float32()),
                      "row": pa.array(np.arange(N)),
                      "tag": pa.array([f"t{i % 7}" for i in range(N)]),
                      "hist": pa.array([[i] * (i % 3) for i in range(N)], pa.list_(pa.int64())),
                      "x": pa.array(np.arange(N, dtype=np.float64))})
    paths = [str(tmp_path / "a.parquet"), str(tmp_path / "b.parquet")]
    pq.write_table(table.slice(0, 500), paths[0], row_group_size=100)
    pq.write_table(table.slice(500), paths[1], row_group_size=77)
    return paths


@pytest.mark.parametrize("split", ["global", "part"])
def test_parquet_every_row_to_one_rank(comm, tmp_path, split):
    paths = parquet_files(tmp_path)
    reader = read_parquet(paths, B, label="y", numeric=["x"], categorical=["row", "tag", "hist"],
                          split=split)
    batches = list(reader)
    if split == "global":
        assert len(batches) == -(-N // B)
        for t, b in enumerate(batches):
            got, _ = comm.allgatherv(b["categorical"]["row"])
            np.testing.assert_array_equal(got, np.arange(t * B, min(N, (t + 1) * B)))
            np.testing.assert_array_equal(b["numeric"][:, 0], b["categorical"]["row"])
            _, splits = b["categorical"]["hist"]
            np.testing.assert_array_equal(np.diff(splits), b["categorical"]["row"] % 3)
    rows = np.concatenate([b["categorical"]["row"] for b in batches])
    got, _ = comm.allgatherv(rows)
    np.testing.assert_array_equal(np.sort(got), np.arange(N))


def criteo_model():
    keras.utils.set_random_seed(1)
    inputs = {f"C{i + 1}": keras.Input(shape=(), dtype="int64", name=f"C{i + 1}")
              for i in range(26)}
    inputs["numeric"] = keras.Input(shape=(13,), name="numeric")
    parts = [kv.Embedding("ids", 2, name=f"emb{i}")(inputs[f"C{i + 1}"]) for i in range(26)]
    out = keras.layers.Dense(1)(keras.layers.Concatenate()([*parts, inputs["numeric"]]))
    model = kv.Model(inputs, out)
    model.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.Adam(1e-3),
                                                    sparse=kv.optimizers.Adagrad(0.05)),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model


@pytest.mark.parametrize("split", ["global", "part"])
def test_fit_on_a_criteo_dataset(comm, tmp_path, split):
    paths = criteo_files(tmp_path)
    model = criteo_model()
    hist = model.fit(kv.data.criteo_dataset(paths, B, split=split), epochs=2, verbose=0)
    assert len(hist.history["loss"]) == 2 and np.isfinite(hist.history["loss"]).all()
    seen = comm.allreduce(np.array([sum(1 for _ in read_criteo(paths, B, split=split))]))
    assert seen[0] >= -(-N // B)


def test_a_bad_line_on_one_rank_stops_every_rank_in_fit(comm, tmp_path):
    paths = criteo_files(tmp_path)
    with open(paths[0]) as f:
        text = f.read().splitlines(keepends=True)
    # global batch 2 is lines 128..191; its last line belongs to the last rank
    text[191] = "1\t2\t3\n"
    with open(paths[0], "w") as f:
        f.write("".join(text))
    import tensorflow as tf

    # through tf.data, TensorFlow re-raises a reader's error as its own, message kept
    for data in (kv.data.criteo_dataset(paths, B), read_criteo(paths, B).fit_batches()):
        model = criteo_model()
        with pytest.raises((kv.KvcollError, ValueError, tf.errors.OpError),
                           match=r"a\.tsv line 192: expected 40"):
            model.fit(data, epochs=1, verbose=0)
    assert comm.allreduce(np.array([1], np.int64))[0] == comm.size   # still in step
