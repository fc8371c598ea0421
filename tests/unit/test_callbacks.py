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


# -- defect 7: restore=True says what it did ------------------------------------------------

def test_restore_true_names_the_checkpoint_it_restored(tmp_path, capsys):
    x, y = data()
    model = model_()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0,
              callbacks=[kv.callbacks.Checkpoint(tmp_path / "ck", incremental_every=1)])
    capsys.readouterr()
    again = model_()
    ck = kv.callbacks.Checkpoint(tmp_path / "ck", restore=True, save_at_end=False)
    again.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[ck])
    out = capsys.readouterr().out
    assert ck.restored is not None and ck.restored.step == 3
    assert re.search(rf"kv.callbacks.Checkpoint: restored {ck.restored.name} from "
                     rf"{re.escape(str(tmp_path / 'ck'))} \(step 3; a full checkpoint and 2 "
                     r"incremental one\(s\)\) in [\d.]+s", out), out


def test_restore_true_says_when_there_is_nothing_to_restore(tmp_path, capsys):
    x, y = data()
    for where, why in [(tmp_path / "typo", "the directory does not exist"),
                       (tmp_path, "it holds no complete checkpoint")]:
        ck = kv.callbacks.Checkpoint(where, restore=True, save_at_end=False)
        model_().fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[ck])
        out = capsys.readouterr().out
        assert ck.restored is None
        assert f"no checkpoint to restore in {where} ({why}" in out, out
        assert "training starts from scratch" in out
    quiet = kv.callbacks.Checkpoint(tmp_path / "typo", restore=True, save_at_end=False,
                                    verbose=0)
    model_().fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[quiet])
    assert capsys.readouterr().out == ""


# -- defect 9: TableStats after a restore ------------------------------------------------------

def test_table_stats_counts_restored_rows_as_admitted(tmp_path):
    x, y = data()
    model = model_()
    first = kv.callbacks.TableStats()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0,
              callbacks=[first, kv.callbacks.Checkpoint(tmp_path / "ck")])
    rows = first.history[-1]["user"]["rows"]
    assert first.history[-1]["user"]["admitted"] == rows > 0
    again = model_()
    stats = kv.callbacks.TableStats()
    # the restored run had done its epoch: epochs=2 (the total) runs one more
    hist = again.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[
        kv.callbacks.Checkpoint(tmp_path / "ck", restore=True, save_at_end=False), stats])
    assert hist.history["kv_rows"] == [rows]
    assert hist.history["kv_admitted"] == [rows]     # was 0: the rows came from a restore
    # new ids after the restore are counted on top
    more = {"user": x["user"] + VOCAB, "x": x["x"]}
    hist = again.fit(more, y, batch_size=32, epochs=1, verbose=0, callbacks=[stats])
    new = len(np.unique(more["user"]))
    assert hist.history["kv_rows"] == [rows + new]
    assert hist.history["kv_admitted"] == [rows + new]


# -- defect 12: throughput in the logs --------------------------------------------------------

class Slow(keras.callbacks.Callback):
    """Stands for a checkpoint write after every step and a slow validation. `epochs`
    keeps each epoch's wall time and the seconds this callback slept in it."""

    def __init__(self):
        super().__init__()
        self.epochs = []

    def on_epoch_begin(self, epoch, logs=None):
        import time
        self.epochs.append({"t0": time.perf_counter(), "slept": 0.0})

    def _sleep(self, s):
        import time
        time.sleep(s)
        self.epochs[-1]["slept"] += s

    def on_train_batch_end(self, batch, logs=None):
        self._sleep(0.2)

    def on_test_begin(self, logs=None):
        self._sleep(0.5)

    def on_epoch_end(self, epoch, logs=None):
        import time
        self.epochs[-1]["wall"] = time.perf_counter() - self.epochs[-1]["t0"]


def test_throughput_counts_the_training_steps_only(capsys):
    x, y = data(n=128)
    model = model_()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)   # traced: later steps are quick
    tp = kv.callbacks.Throughput()
    slow = Slow()
    # every step of an epoch runs between slow's on_epoch_begin and on_epoch_end
    hist = model.fit(x, y, batch_size=32, epochs=2, verbose=0, validation_data=(x, y),
                     callbacks=[slow, tp])
    rate = hist.history["samples_per_sec"]
    assert len(rate) == 2 and [h["samples"] for h in tp.history] == [128, 128]
    for r, h, e in zip(rate, tp.history, slow.epochs):
        assert r == pytest.approx(128 / h["seconds"])
        assert e["slept"] == pytest.approx(4 * 0.2 + 0.5)
        # what Keras' ms/step would have counted includes the sleeps; Throughput's
        # seconds leave them out, however slow the steps themselves are
        assert 0 < h["seconds"] <= e["wall"] - e["slept"]
    assert not hasattr(model.train_function, "_kv_timed")   # unwrapped at the end
    # the progress line shows it
    model.fit(x, y, batch_size=32, epochs=1, verbose=2, callbacks=[kv.callbacks.Throughput()])
    assert "samples_per_sec" in capsys.readouterr().out


# -- defect 6: retention through kv.save and the callback ------------------------------------

def _ckpts(d):
    return sorted(e for e in os.listdir(d) if e.startswith("ckpt-"))


def test_max_to_keep_keeps_the_newest_chains_and_they_restore(tmp_path):
    x, y = data(n=320)
    model = model_()
    ck = kv.callbacks.Checkpoint(tmp_path / "ck", every_n_steps=4, incremental_every=1,
                                 max_to_keep=2)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[ck])   # 10 steps
    # saves at steps 1..10 (full at 4 and 8, deltas between); the newest two (9, 10)
    # need the full one at 8 and the delta at 9
    assert _ckpts(tmp_path / "ck") == ["ckpt-0000000008", "ckpt-0000000009",
                                       "ckpt-0000000010"]
    assert sorted(ck.pruned) == [f"ckpt-{s:010d}" for s in range(1, 8)]
    want = engine_of(model).tables["user"].export()
    again = model_()
    again.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[
        kv.callbacks.Checkpoint(tmp_path / "ck", restore=True, save_at_end=False)])
    restored = kv.restore(tmp_path / "ck", again)
    assert restored.step == 10 and restored.chain[0] == "ckpt-0000000008"
    got = engine_of(again).tables["user"].export()
    order_w, order_g = np.argsort(want["keys"]), np.argsort(got["keys"])
    np.testing.assert_array_equal(want["values"][order_w], got["values"][order_g])


def test_kv_save_max_to_keep_and_leases(tmp_path):
    from kvcoll import retention
    x, y = data()
    model = model_()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    first = kv.save(tmp_path / "ck", model)
    # a server reads the first checkpoint: it stays, whatever max_to_keep says
    with retention.hold(tmp_path / "ck", first.name):
        for _ in range(3):
            model.fit(x, y, batch_size=32, epochs=1, verbose=0)
            last = kv.save(tmp_path / "ck", model, max_to_keep=1)
        assert _ckpts(tmp_path / "ck") == [first.name, last.name]
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    newest = kv.save(tmp_path / "ck", model, incremental=True, max_to_keep=1)
    assert _ckpts(tmp_path / "ck") == [last.name, newest.name]   # the delta's parent
    assert not os.path.exists(tmp_path / "ck" / retention.LEASES)   # all released
    # a job that resumed from an older checkpoint leases it (its next delta's parent),
    # so a prune by another process leaves it
    other = model_()
    other.fit(x, y, batch_size=32, epochs=1, verbose=0)
    kv.restore(tmp_path / "ck", other, checkpoint=last.name)
    assert list(retention.live_leases(tmp_path / "ck")) == [last.name]
    kv.save(tmp_path / "ck", other, incremental=True)
    assert retention.live_leases(tmp_path / "ck") == {}   # its parent is now the latest
    with pytest.raises(kv.InvalidArgumentError, match="max_to_keep"):
        kv.save(tmp_path / "ck", model, max_to_keep=0)
    with pytest.raises(kv.InvalidArgumentError, match="max_to_keep"):
        kv.callbacks.Checkpoint(tmp_path / "ck", max_to_keep=-2)
