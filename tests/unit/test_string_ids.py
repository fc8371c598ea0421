"""String ids end to end in one process: a string keras.Input feeding kv.Embedding
directly (issue 33, defect 4), the run's string hash recorded in checkpoints (a manifest
without it is xxh64; a differing hash is adopted or refused), and the export taking raw
strings that a process importing only TensorFlow hashes in its graph (farmhash64 with
tf.fingerprint, xxh64 with standard uint64 ops), bit for bit as training did."""

import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

keras = tf.keras  # the Keras TensorFlow names: Keras 3, or Keras 2 (./dev compat)

import kvcoll as kv  # noqa: E402
from kvcoll import ids  # noqa: E402
from kvcoll.comm import Comm  # noqa: E402
from kvcoll.keras import engine_of  # noqa: E402

BCE = keras.losses.BinaryCrossentropy(from_logits=True)
N = 64


@pytest.fixture(autouse=True)
def fresh_run(monkeypatch):
    """kvcoll.ids' process state as in a new process: the hash not chosen yet."""
    monkeypatch.setattr(ids, "_run", {"name": None, "source": None, "used": False,
                                      "strings": set()})
    monkeypatch.delenv("KVCOLL_ID_HASH", raising=False)


NAMES = np.array(["fr", "de", "", "日本", "brasil-" + "x" * 40, "us"])


def countries(n=N, seed=3):
    g = np.random.default_rng(seed)
    return ({"country": NAMES[g.integers(0, 6, n)],
             "x": g.normal(size=(n, 2)).astype(np.float32)},
            (g.random(n) < 0.5).astype(np.float32))


def string_model(comm=None):
    """A functional model whose id inputs are declared as strings."""
    keras.utils.set_random_seed(4)
    c = keras.Input(shape=(), dtype="string", name="country")
    x = keras.Input(shape=(2,), dtype="float32", name="x")
    e = kv.Embedding("country", 3, initializer=("normal", 0, 0.1))(c)
    h = keras.layers.Concatenate()([e, x])
    model = keras.Model({"country": c, "x": x}, keras.layers.Dense(1)(h))
    engine_of(model, comm=comm or Comm.local())
    model.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                    sparse=kv.optimizers.SGD(0.1)), loss=BCE)
    return model


def test_a_string_input_feeds_an_embedding_directly():
    x, y = countries()
    model = string_model()
    hist = model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    assert np.isfinite(hist.history["loss"]).all()
    eng = engine_of(model)
    assert sorted(eng.features) == ["country"]
    # the rows are those of the strings' farmhash64 keys
    keys = np.sort(eng.tables["country"].export()["keys"])
    np.testing.assert_array_equal(keys, np.sort(ids.hash_strings(np.unique(x["country"]),
                                                                 "farmhash64")))
    out = model.predict(x, batch_size=16, verbose=0)
    assert out.shape == (N, 1)
