"""The wire dtype through Keras on one process: model.fit and kv.Trainer with fp16/bf16
rows train like fp32 (within the wire's rounding), the tables keep float32, and a bad
value is refused when the trainer is made. Multi-rank: tests/mpi/test_wire.py."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import kvcoll as kv  # noqa: E402
from kvcoll.comm import Comm  # noqa: E402
from kvcoll.exchange.wire import Wire  # noqa: E402
from kvcoll.keras import engine_of  # noqa: E402

keras = tf.keras
VOCAB, DIM, N = 50, 8, 256
BCE = keras.losses.BinaryCrossentropy(from_logits=True)


def data(seed=1):
    g = np.random.default_rng(seed)
    x = {"user": g.integers(0, VOCAB, N).astype(np.int64),
         "x": g.normal(size=(N, 2)).astype(np.float32)}
    return x, ((x["user"] % 3 == 0) ^ (x["x"][:, 0] > 0)).astype(np.float32)


def build():
    keras.utils.set_random_seed(2)
    u = keras.Input(shape=(), dtype="int64", name="user")
    x = keras.Input(shape=(2,), dtype="float32", name="x")
    e = kv.Embedding("user", DIM, initializer=("normal", 0, 0.3))(u)
    h = keras.layers.Concatenate()([e, x])
    return kv.Model({"user": u, "x": x}, keras.layers.Dense(1)(h))


def fit(wire_dtype):
    model = build()
    engine_of(model, comm=Comm.local(), wire_dtype=wire_dtype)
    model.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                    sparse=kv.optimizers.Adagrad(0.1)),
                  loss=BCE)
    x, y = data()
    hist = model.fit(x, y, batch_size=32, epochs=3, verbose=0, shuffle=False)
    table = engine_of(model).tables["user"]
    rows = table.find(np.arange(VOCAB))
    assert engine_of(model).loop.ex.wire.name == wire_dtype
    return hist.history["loss"], rows, model.predict(x, batch_size=64, verbose=0)


def test_fit_with_16_bit_rows_trains_like_fp32():
    """Three epochs of 8 steps: measured, fp16 moves the losses and rows by <= 8e-6 and
    the logits by 3e-4; bf16 by 8e-5 and 2e-3 (its step is 8 times fp16's)."""
    loss32, rows32, pred32 = fit("fp32")
    for wire, tol in (("fp16", 1e-4), ("bf16", 1e-3)):
        loss, rows, pred = fit(wire)
        np.testing.assert_allclose(loss, loss32, atol=tol)
        np.testing.assert_allclose(rows, rows32, atol=tol)
        np.testing.assert_allclose(pred, pred32, atol=10 * tol)
        assert rows.dtype == np.float32
        as16 = rows.copy()
        Wire(wire).round(as16)
        assert (as16 != rows).mean() > 0.5          # the table keeps float32
        assert not np.array_equal(rows, rows32)     # and the wire did round


def test_a_bad_wire_dtype_is_refused_when_the_trainer_is_made():
    with pytest.raises(kv.InvalidArgumentError,
                       match="wire_dtype 'half' is unknown; use one of fp32, fp16, bf16"):
        kv.Trainer(build(), BCE, kv.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                   comm=Comm.local(), wire_dtype="half")
