"""What a new user meets around fit in one process (issue 33): the directories kv.export
and kv.save make (their mode), what kv.callbacks.Checkpoint(restore=True) says,
TableStats after a restore, and kv.callbacks.Throughput. Multi-rank: tests/mpi."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import re  # noqa: E402
import stat  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

keras = tf.keras

import kvcoll as kv  # noqa: E402
from kvcoll.comm import Comm  # noqa: E402
from kvcoll.keras import engine_of  # noqa: E402

VOCAB, DIM, N = 40, 4, 96
BCE = keras.losses.BinaryCrossentropy(from_logits=True)


def data(n=N, seed=1):
    g = np.random.default_rng(seed)
    return ({"user": g.integers(0, VOCAB, n).astype(np.int64),
             "x": g.normal(size=(n, 2)).astype(np.float32)},
            (g.random(n) < 0.5).astype(np.float32))


def model_(**embedding):
    keras.utils.set_random_seed(2)
    u = keras.Input(shape=(), dtype="int64", name="user")
    x = keras.Input(shape=(2,), dtype="float32", name="x")
    e = kv.Embedding("user", DIM, initializer=("normal", 0, 0.1), **embedding)(u)
    model = kv.Model({"user": u, "x": x},
                     keras.layers.Dense(1)(keras.layers.Concatenate()([e, x])))
    engine_of(model, comm=Comm.local())
    model.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                    sparse=kv.optimizers.SGD(0.1)), loss=BCE)
    return model


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    yield 0o022
    os.umask(old)


def _modes(root):
    """{path relative to root: permission bits} of every directory under root."""
    out = {".": stat.S_IMODE(os.stat(root).st_mode)}
    for d, subdirs, _ in os.walk(root):
        for s in subdirs:
            p = os.path.join(d, s)
            out[os.path.relpath(p, root)] = stat.S_IMODE(os.stat(p).st_mode)
    return out


# -- defect 5: directories as mkdir makes them ----------------------------------------------

def test_the_export_directory_is_readable_by_others_as_the_umask_allows(tmp_path, umask022):
    """A serving process running as another user must read the export: its directories
    are 0777 & ~umask (0755 here), as mkdir makes them, not mkdtemp's 0700."""
    x, y = data()
    model = model_()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    kv.export(tmp_path / "serve", model)
    modes = _modes(tmp_path / "serve")
    assert {"saved_model", "embeddings"} <= set(modes)
    assert {p: m for p, m in modes.items() if m != 0o755} == {}
    for f in os.listdir(tmp_path / "serve" / "embeddings"):
        assert stat.S_IMODE(os.stat(tmp_path / "serve" / "embeddings" / f).st_mode) == 0o644


def test_the_export_follows_a_stricter_umask_too(tmp_path):
    old = os.umask(0o077)
    try:
        x, y = data()
        model = model_()
        model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        kv.export(tmp_path / "serve", model, saved_model=False)
    finally:
        os.umask(old)
    assert set(_modes(tmp_path / "serve").values()) == {0o700}


def test_checkpoint_directories_are_made_as_mkdir_makes_them(tmp_path, umask022):
    x, y = data()
    model = model_()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    kv.save(tmp_path / "ck", model)
    kv.save(tmp_path / "ck", model, incremental=True)
    modes = _modes(tmp_path / "ck")
    assert len(modes) == 3
    assert set(modes.values()) == {0o755}
