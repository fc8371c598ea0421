"""Tiny data and models for the docs' examples (tests/docs_examples.py): what a page's
hidden setup needs so that its visible example runs as printed."""

import numpy as np


def small_model(fit: bool = True, strings: bool = False):
    """A kv.Model over one table "user" (and a numeric input), compiled, fitted on a
    few samples of this rank: what the checkpoint and export pages act on."""
    import keras

    import kvcoll as kv
    u = keras.Input(shape=(), dtype="string" if strings else "int64", name="user")
    x = keras.Input(shape=(2,), dtype="float32", name="x")
    e = kv.Embedding("user", 4)(u)
    model = kv.Model({"user": u, "x": x},
                     keras.layers.Dense(1)(keras.layers.Concatenate()([e, x])))
    model.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.Adam(1e-2),
                                                    sparse=kv.optimizers.Adagrad(0.1)),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    if fit:
        xs, y = user_data(128, strings)
        model.fit(xs, y, batch_size=32, epochs=1, verbose=0)
    return model


def user_data(n: int, strings: bool = False, seed: int = 0):
    g = np.random.default_rng(seed)
    users = g.integers(0, 50, n)
    return ({"user": users.astype(str) if strings else users,
             "x": g.normal(size=(n, 2)).astype(np.float32)},
            (g.random(n) < 0.4).astype(np.float32))


def criteo_files(pattern_dir=".", files: int = 2, lines: int = 300, gz: bool = True):
    """day_<i>.gz Criteo TSV files of synthetic lines."""
    import gzip
    g = np.random.default_rng(3)
    for i in range(files):
        rows = []
        for _ in range(lines):
            nums = [str(v) for v in g.integers(0, 50, 13)]
            cats = [f"{v:08x}" for v in g.integers(0, 997, 26)]
            rows.append("\t".join([str(int(g.integers(0, 2))), *nums, *cats]))
        data = ("\n".join(rows) + "\n").encode()
        path = f"{pattern_dir}/day_{i}.{'gz' if gz else 'tsv'}"
        with (gzip.open(path, "wb") if gz else open(path, "wb")) as f:
            f.write(data)


def clicks_parquet(directory="clicks", files: int = 2, rows: int = 200):
    """clicks/part-<i>.parquet: click, price, user (string), item, history (list)."""
    import os

    import pyarrow as pa
    import pyarrow.parquet as pq
    os.makedirs(directory, exist_ok=True)
    g = np.random.default_rng(4)
    for i in range(files):
        pq.write_table(pa.table({
            "click": (g.random(rows) < 0.3).astype(np.int64),
            "price": g.random(rows),
            "user": [f"u{v}" for v in g.integers(0, 100, rows)],
            "item": g.integers(0, 300, rows),
            "history": [list(g.integers(0, 300, g.integers(0, 5))) for _ in range(rows)]}),
            f"{directory}/part-{i}.parquet")


def criteo_model():
    """DeepFM over the 26 Criteo fields (examples/models.py), compiled."""
    import sys
    from pathlib import Path

    import keras

    import kvcoll as kv
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from models import build_deepfm
    model = kv.distribute(build_deepfm(26, 13, 4, lambda f, w: kv.Embedding(f, w),
                                       hidden=(16,)))
    model.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.Adam(1e-3)),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def parquet_trainer():
    """A kv.Trainer over clicks_parquet()'s columns (string user ids arrive hashed)."""
    import keras

    import kvcoll as kv
    user = keras.Input(shape=(), dtype="int64", name="user")
    item = keras.Input(shape=(), dtype="int64", name="item")
    history = keras.Input(shape=(None,), dtype="int64", name="history")
    numeric = keras.Input(shape=(1,), dtype="float32", name="numeric")
    x = keras.layers.Concatenate()([kv.Embedding("user", 4)(user), kv.Embedding("item", 4)(item),
                                    kv.Embedding("item", 4, combiner="mean")(history), numeric])
    model = keras.Model({"user": user, "item": item, "history": history, "numeric": numeric},
                        keras.layers.Dense(1)(x))
    return kv.Trainer(model, keras.losses.BinaryCrossentropy(from_logits=True),
                      kv.DistributedOptimizer(keras.optimizers.Adam(1e-3)))
