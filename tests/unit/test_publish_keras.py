"""kv.callbacks.Publish during model.fit (one process): versions at the cadence asked
for, the dense weights published when they change, and the serving graph: the tables
rebuilt from the published base and deltas, fed to the graph with the published dense
weights, predict what model.predict predicts (1e-5), string and multi-hot ids included.
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

keras = tf.keras

import kvcoll as kv  # noqa: E402
from kvcoll import ids  # noqa: E402
from kvcoll.comm import Comm  # noqa: E402
from kvcoll.keras import engine_of  # noqa: E402
from kvcoll.publish import (apply_version, list_versions, load_base, load_version,  # noqa: E402
                            read_latest, read_manifest)


def build():
    keras.utils.set_random_seed(2)
    u = keras.Input(shape=(), dtype="string", name="user")
    tags = keras.Input(shape=(None,), dtype="int64", name="tags")
    x = keras.Input(shape=(2,), dtype="float32", name="x")
    e = kv.Embedding("user", 4, initializer=("normal", 0, 0.1))(u)
    t = kv.Embedding("tags", 3, combiner="mean", padding_id=-1)(tags)
    h = keras.layers.Concatenate()([e, t, x])
    h = keras.layers.Dense(8, activation="relu")(h)
    return kv.Model({"user": u, "tags": tags, "x": x}, keras.layers.Dense(1, name="out")(h))


def data(n, seed):
    g = np.random.default_rng(seed)
    users = np.array([f"u{i}" for i in g.integers(0, 50, n)], dtype=object)
    tags = g.integers(0, 20, (n, 3))
    tags[g.random((n, 3)) < 0.3] = -1
    return ({"user": users, "tags": tags, "x": g.normal(size=(n, 2)).astype(np.float32)},
            (g.random(n) < 0.5).astype(np.float32))


def trained(directory, **publish):
    model = build()
    engine_of(model, comm=Comm.local())
    model.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                    sparse=kv.optimizers.Adagrad(0.1)),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    x, y = data(256, 1)
    cb = kv.callbacks.Publish(directory, **publish)
    model.fit(x, y, batch_size=32, epochs=1, callbacks=[cb], verbose=0)
    return model, cb


def graph_predict(directory, version, feeds):
    """What kvcoll serve computes, by hand: tables from base + deltas, rows looked up,
    the graph called with the published dense weights."""
    got = list_versions(directory)
    base = max(b for b in got["base"] if b <= version)
    m = read_manifest(directory, "base", base)
    sig = json.load(open(os.path.join(directory, m["dense"]["graph"], "signature.json")))
    tables = {t["name"]: kv.KvTable(t["dim"], name=t["name"]) for t in sig["tables"]}
    dense = load_base(directory, base, tables)["dense"]
    for v in range(base + 1, version + 1):
        loaded = load_version(directory, "delta", v)
        apply_version(tables, loaded)
        dense = loaded["dense"] or dense
    loaded_graph = tf.saved_model.load(os.path.join(directory, m["dense"]["graph"],
                                                    "saved_model"))
    for var, w in zip(loaded_graph.dense, dense):
        var.assign(w)
    args = {}
    for t in sig["tables"]:
        args[t["graph_arg"]] = []
    for e in sig["inputs"]:
        if e["kind"] == "numeric":
            args[e["graph_arg"]] = tf.constant(feeds[e["name"]])
            continue
        raw = feeds[e["name"]]
        if e["multi_hot"]:
            keep = raw != e["padding_id"]
            keys = ids.as_keys(raw[keep])
        else:
            keys = ids.hash_strings(raw, sig["id_hash"]) if e["string"] else ids.as_keys(raw)
        table = sig["tables"][e["table_index"]]
        start = sum(len(a) for a in args[table["graph_arg"]])
        args[table["graph_arg"]].append(tables[table["name"]].find(keys))
        if e["multi_hot"]:
            pos = np.full(raw.shape, -1, np.int64)
            pos[keep] = start + np.arange(keys.size)
        else:
            pos = start + np.arange(keys.size)
        args[e["graph_arg"]] = tf.constant(pos)
    for t in sig["tables"]:
        args[t["graph_arg"]] = tf.constant(np.concatenate(args[t["graph_arg"]]))
    out = loaded_graph.signatures["serving_default"](**args)
    return out["prediction"].numpy()


def test_publish_during_fit_serves_what_predict_predicts(tmp_path):
    d = str(tmp_path / "pub")
    model, cb = trained(d, every_n_steps=2, base_every=3)
    # 8 steps: versions at 2, 4, 6, 8; bases at 1 and 4
    assert [(i.version, i.kinds, i.step) for i in cb.published] == [
        (1, ("base",), 2), (2, ("delta",), 4), (3, ("delta",), 6), (4, ("delta", "base"), 8)]
    assert read_latest(d) == 4
    assert all(i.dense for i in cb.published)  # SGD moves the dense weights every step
    want_dense = [v.numpy() for v in model.variables]
    loaded = load_version(d, "delta", 4)
    for a, b in zip(loaded["dense"], want_dense):
        np.testing.assert_array_equal(a, b)
    feeds, _ = data(16, 9)
    feeds["user"][:3] = ["never-seen", "u3", "u4"]
    want = model.predict(feeds, verbose=0)
    np.testing.assert_allclose(graph_predict(d, 4, feeds), want, rtol=0, atol=1e-5)


def test_every_seconds_picks_steps_and_the_end_publishes(tmp_path):
    d = str(tmp_path / "pub")
    _, cb = trained(d, every_seconds=3600)
    # the first step publishes (a base); an hour is never due again; the end publishes
    assert [i.step for i in cb.published] == [1, 8]
    assert [i.kinds for i in cb.published] == [("base",), ("delta",)]
