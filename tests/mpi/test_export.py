"""kv.export at any world size (the Keras toy model of toy.py on kv.Trainer).

Every rank writes its own part of the embedding dictionary, holding exactly the rows
its shard holds; rank 0 builds the SavedModel from the parts, and the SavedModel,
loaded in a fresh process that imports only TensorFlow, predicts what Trainer.predict
predicts (to 1e-6) on a batch with ids never seen.
"""

import json
import os

import ckpt_driver as drv
import numpy as np

import kvcoll as kv
from kvcoll.routing import OwnerMap, owner_of


def test_parts_and_saved_model(comm, shared_dir):
    tr = drv.make_trainer()
    kv.broadcast_variables(tr.model.variables, root_rank=0)
    for step in range(1, 4):
        drv.train_step(tr, step)
    out = os.path.join(shared_dir, "export")
    info = kv.export(out, tr)
    rows = {n: int(comm.allreduce(np.array([len(t)], np.int64))[0]) for n, t in tr.tables.items()}
    assert info["tables"] == rows and info["parts"] == comm.size
    emb = os.path.join(out, "embeddings")
    with open(os.path.join(emb, "index.json")) as f:
        index = json.load(f)
    assert index["world_size"] == comm.size
    owners = OwnerMap.from_json(index["owners"])  # the map that put each id in its part
    assert owners == OwnerMap.even(comm.size)
    for name, t in tr.tables.items():
        spec = index["tables"][name]
        assert spec["rows"] == rows[name] == sum(p["rows"] for p in spec["parts"])
        part = spec["parts"][comm.rank]
        ids = np.load(os.path.join(emb, part["ids"]))
        vecs = np.load(os.path.join(emb, part["vectors"]))
        assert part["rank"] == comm.rank and ids.size == part["rows"] == len(t)
        assert (owner_of(ids, owners) == comm.rank).all() and np.unique(ids).size == ids.size
        np.testing.assert_array_equal(vecs, t.find(ids))
    feats = drv.serving_features()
    want = tr.predict(feats)  # every rank: the whole batch
    if comm.rank == 0:
        work = os.path.join(shared_dir, "serve")
        os.mkdir(work)
        got, imported = drv.serve_with_tensorflow_alone(os.path.join(out, "saved_model"),
                                                        feats, work)
        assert not [m for m in imported if m.split(".")[0] in ("kvcoll", "mpi4py")], imported
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    comm.barrier()
    tr.close()



def _serve_strings(comm, shared_dir, out, feeds, want):
    """Rank 0: the SavedModel on raw-string feeds in a process importing only
    TensorFlow equals `want` (model.predict on the same strings)."""
    if comm.rank == 0:
        work = os.path.join(shared_dir, "serve")
        os.mkdir(work)
        got, imported = drv.serve_with_tensorflow_alone(os.path.join(out, "saved_model"),
                                                        feeds, work)
        assert not [m for m in imported if m.split(".")[0] in ("kvcoll", "mpi4py")], imported
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    comm.barrier()


def test_raw_string_ids_of_a_parquet_reader(comm, shared_dir):
    """Issue 33: a Parquet reader's string columns (one-hot "user" and "country",
    multi-hot "seen") train on every rank as farmhash64 keys; the SavedModel takes the
    raw strings, hashes them in its graph (tf.fingerprint) and predicts what
    model.predict predicts on the same strings, never-seen ones included."""
    import keras
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kvcoll.data import read_parquet

    g = np.random.default_rng(21)
    n = 240
    users = np.array([f"user-{i}" for i in g.integers(0, 40, n)])
    pool = ["a", "bb", "日本", "", "x" * 70, "zz-top"]
    seen = [[pool[j] for j in g.integers(0, 6, k)] for k in g.integers(0, 4, n)]
    country = np.array(["fr", "de", "us", "br"])[g.integers(0, 4, n)]
    path = os.path.join(shared_dir, "clicks.parquet")
    if comm.rank == 0:
        pq.write_table(pa.table({"user": users, "seen": seen, "country": country,
                                 "y": (g.random(n) < 0.4).astype(np.float32)}), path,
                       row_group_size=40)
    comm.barrier()
    keras.utils.set_random_seed(5)
    u = keras.Input(shape=(), dtype="int64", name="user")
    s = keras.Input(shape=(None,), dtype="int64", name="seen")
    c = keras.Input(shape=(), dtype="int64", name="country")
    z = keras.layers.Concatenate()([kv.Embedding("user", 4)(u),
                                    kv.Embedding("seen", 3, combiner="mean")(s),
                                    kv.Embedding("country", 2)(c)])
    model = kv.Model({"user": u, "seen": s, "country": c}, keras.layers.Dense(1)(z))
    model.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.Adam(0.02)),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    reader = read_parquet(path, 48, label="y", categorical=["user", "seen", "country"])
    model.fit(reader.dataset(), epochs=2, verbose=0)
    out = os.path.join(shared_dir, "export")
    info = kv.export(out, model)
    assert info["string_features"] == ["country", "seen", "user"]
    assert info["id_hash"] == "farmhash64"
    q_users = np.concatenate([users[:30], ["user-never", ""]])
    q_seen = seen[:30] + [["never", "a"], []]
    q_country = np.concatenate([country[:30], ["xx", "fr"]])
    flat = np.array([w for v in q_seen for w in v])
    splits = np.concatenate([[0], np.cumsum([len(v) for v in q_seen])]).astype(np.int64)
    want = model.predict({"user": q_users, "seen": (flat, splits), "country": q_country},
                         batch_size=64, verbose=0)
    _serve_strings(comm, shared_dir, out, {"user": q_users, "seen": flat,
                                           "seen_row_splits": splits, "country": q_country},
                   want)


def test_raw_string_ids_of_a_string_input(comm, shared_dir):
    """A keras.Input(dtype="string") feeding kv.Embedding directly (issue 33, defect 4)
    trains on every rank's slice of string arrays; the export takes those strings."""
    import keras

    g = np.random.default_rng(22)
    n = 96
    names = np.array(["fr", "de", "", "日本", "b" * 50, "us"])
    city = names[g.integers(0, 6, n)]
    x = g.normal(size=(n, 2)).astype(np.float32)
    y = (g.random(n) < 0.5).astype(np.float32)
    keras.utils.set_random_seed(6)
    ci = keras.Input(shape=(), dtype="string", name="city")
    xi = keras.Input(shape=(2,), dtype="float32", name="x")
    z = keras.layers.Concatenate()([kv.Embedding("city", 3)(ci), xi])
    model = kv.Model({"city": ci, "x": xi}, keras.layers.Dense(1)(z))
    model.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    lo, hi = n * comm.rank // comm.size, n * (comm.rank + 1) // comm.size
    model.fit({"city": city[lo:hi], "x": x[lo:hi]}, y[lo:hi], batch_size=16, epochs=2,
              verbose=0, shuffle=False)
    out = os.path.join(shared_dir, "export")
    assert kv.export(out, model)["string_features"] == ["city"]
    feeds = {"city": np.concatenate([city[:20], ["never", "FR"]]),
             "x": g.normal(size=(22, 2)).astype(np.float32)}
    want = model.predict(feeds, batch_size=32, verbose=0)
    _serve_strings(comm, shared_dir, out, feeds, want)
