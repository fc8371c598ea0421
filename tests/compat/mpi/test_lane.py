"""Checkpoints and export through the Keras path in this lane, at any world size.

A run saved mid-way and restored into a new model continues along the same losses as
the uninterrupted run (tables, dense weights, optimizer state and step restored); the
exported SavedModel, loaded by TensorFlow alone, predicts what model.predict does.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import kvcoll as kv  # noqa: E402
from kvcoll.keras import engine_of  # noqa: E402

from model import batch, batches, build, compile_  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)


@pytest.fixture()
def shared(comm, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("lane")) if comm.rank == 0 else None
    return comm.bcast_bytes(path.encode() if path else None).decode()


def table_state(model) -> dict:
    """Every rank's rows of every table, sorted by key, gathered to every rank."""
    comm = engine_of(model).comm
    out = {}
    for name, t in engine_of(model).tables.items():
        e = t.export()
        for k in ("keys", "values", "slots"):
            out[f"{name}/{k}"], _ = comm.allgatherv(e[k])
        order = np.argsort(out[f"{name}/keys"])
        for k in ("keys", "values", "slots"):
            out[f"{name}/{k}"] = out[f"{name}/{k}"][order]
    return out


def test_checkpoint_round_trip_continues_the_run(comm, shared):
    rank, world = comm.rank, comm.size
    a = compile_(build())
    a.fit(batches(0, 6, rank, world), epochs=1, steps_per_epoch=6, verbose=0)
    kv.save(shared, a)
    saved_tables, saved_weights = table_state(a), a.get_weights()
    after = a.fit(batches(6, 5, rank, world), epochs=1, steps_per_epoch=5, verbose=0)

    b = compile_(build(seed=99))           # other initial weights: all must come back
    info = kv.restore(shared, b)
    assert info.step == 6 and engine_of(b).step == 6
    restored = table_state(b)
    for k, v in saved_tables.items():
        np.testing.assert_array_equal(restored[k], v, err_msg=k)
    for x, y in zip(b.get_weights(), saved_weights):
        np.testing.assert_array_equal(x, y)
    again = b.fit(batches(6, 5, rank, world), epochs=1, steps_per_epoch=5, verbose=0)
    np.testing.assert_allclose(again.history["loss"], after.history["loss"], rtol=1e-6)
    np.testing.assert_allclose(again.history["auc"], after.history["auc"], rtol=1e-6)
    for x, y in zip(b.get_weights(), a.get_weights()):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)


def test_export_serves_with_tensorflow_alone(comm, shared):
    rank, world = comm.rank, comm.size
    model = compile_(build())
    model.fit(batches(0, 4, rank, world), epochs=1, steps_per_epoch=4, verbose=0)
    x, _ = batch(50, rank, world)
    want = model.predict(x, verbose=0)
    out = os.path.join(shared, "serve")
    info = kv.export(out, model)
    assert info["tables"]["user"] > 0
    served = tf.saved_model.load(os.path.join(out, "saved_model"))
    vals, splits = x["history"]
    got = served.signatures["serving_default"](
        user=tf.constant(x["user"]), history=tf.constant(vals),
        history_row_splits=tf.constant(splits), x=tf.constant(x["x"]))["prediction"]
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6)
