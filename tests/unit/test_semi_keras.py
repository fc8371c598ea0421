"""--pipeline semi through Keras on one process: model.fit with rows one step stale
trains (close to the exact pipeline, not equal to it), the setting reaches the loop,
and a bad value is refused when the trainer is made. Multi-rank:
tests/mpi/test_semi_pipeline.py."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import kvcoll as kv  # noqa: E402
from kvcoll.comm import Comm  # noqa: E402
from kvcoll.keras import engine_of  # noqa: E402

keras = tf.keras
VOCAB, DIM, N = 50, 8, 256
BCE = keras.losses.BinaryCrossentropy(from_logits=True)


def build():
    keras.utils.set_random_seed(2)
    u = keras.Input(shape=(), dtype="int64", name="user")
    x = keras.Input(shape=(2,), dtype="float32", name="x")
    e = kv.Embedding("user", DIM, initializer=("normal", 0, 0.3))(u)
    return kv.Model({"user": u, "x": x},
                    keras.layers.Dense(1)(keras.layers.Concatenate()([e, x])))


def fit(prefetch):
    g = np.random.default_rng(1)
    x = {"user": g.integers(0, VOCAB, N).astype(np.int64),
         "x": g.normal(size=(N, 2)).astype(np.float32)}
    y = ((x["user"] % 3 == 0) ^ (x["x"][:, 0] > 0)).astype(np.float32)
    model = build()
    engine_of(model, comm=Comm.local(), prefetch=prefetch)
    model.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                    sparse=kv.optimizers.Adagrad(0.1)),
                  loss=BCE)
    hist = model.fit(x, y, batch_size=32, epochs=3, verbose=0, shuffle=False)
    return engine_of(model), hist.history["loss"]


def test_fit_with_stale_rows_trains_close_to_the_exact_pipeline():
    exact, semi = fit(True), fit("semi")
    assert not exact[0].loop.stale_rows and semi[0].loop.stale_rows
    assert semi[0].loop.prefetch and semi[0].step == exact[0].step == 24
    np.testing.assert_allclose(semi[1], exact[1], rtol=0.05)
    assert semi[1] != exact[1]                    # rows read one step stale
    assert semi[1][-1] < semi[1][0]               # and it learns


def test_a_bad_pipeline_setting_is_refused_when_the_trainer_is_made():
    with pytest.raises(kv.InvalidArgumentError,
                       match="prefetch 'async' is unknown; use True/'on', False/'off' or "
                             "'semi'"):
        kv.Trainer(build(), BCE, kv.DistributedOptimizer(keras.optimizers.SGD(0.1)),
                   comm=Comm.local(), prefetch="async")
