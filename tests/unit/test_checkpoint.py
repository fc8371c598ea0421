"""Checkpoints and export in one process (a one-rank communicator).

- full + incremental saves restore to the state of a full save at the same step;
- a save that fails part-way leaves `latest` and the previous checkpoint intact, and
  the next incremental save is a full one (the failed save had cleared dirty bits);
- every mismatch or corruption raises CheckpointError and changes nothing;
- the exported SavedModel, loaded in a fresh process that imports only TensorFlow,
  predicts what the trainer predicts (to 1e-6), unknown ids included; the embedding
  dictionary holds every row.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import kvcoll as kv  # noqa: E402
import kvcoll.checkpoint as ck  # noqa: E402
from kvcoll.comm import Comm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "mpi"))
import ckpt_driver as drv  # noqa: E402


def trainer(build=drv.build, sparse=None):
    model = build()
    opt = kv.DistributedOptimizer(keras.optimizers.Adam(0.02),
                                  sparse=sparse or kv.optimizers.Adagrad(0.2))
    return kv.Trainer(model, keras.losses.BinaryCrossentropy(from_logits=True), opt,
                      comm=Comm.local())


def train(tr, steps):
    for _ in range(steps):
        drv.train_step(tr, tr.step + 1)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A trainer at step 5 with a full checkpoint at 2 and deltas at 3, 4, 5 in
    `chain`, a full one at 5 in `full`, and its state at 5."""
    d = tmp_path_factory.mktemp("ckpt")
    tr = trainer()
    train(tr, 2)
    assert kv.save(d / "chain", tr).kind == "full"
    infos = []
    for _ in range(3):
        train(tr, 1)
        infos.append(kv.save(d / "chain", tr, incremental=True))
    kv.save(d / "full", tr)
    snap = drv.state(tr)
    tr.close()
    return d, snap, infos


def test_incremental_chain_equals_full(saved):
    d, snap, infos = saved
    assert [i.kind for i in infos] == ["delta"] * 3
    full_rows = json.loads((d / "full" / "ckpt-0000000005" / "manifest.json").read_text())
    assert all(i.rows < sum(t["rows"] for t in full_rows["tables"].values()) for i in infos)
    for which in ("chain", "full"):
        tr = trainer()
        info = kv.restore(d / which, tr)
        assert info.step == 5 and tr.step == 5
        assert len(info.chain) == (4 if which == "chain" else 1)
        drv.assert_same_state(drv.state(tr), snap)
        tr.close()


def test_failed_save_keeps_previous_and_next_save_is_full(tmp_path, monkeypatch):
    tr = trainer()
    train(tr, 1)
    kv.save(tmp_path, tr)
    train(tr, 1)
    real = ck._write_shard
    calls = []

    def failing(path, *args):
        calls.append(path)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(path, *args)
    monkeypatch.setattr(ck, "_write_shard", failing)
    with pytest.raises(kv.CheckpointError, match="No space left on device.*previous checkpoint"
                                                 " is intact"):
        kv.save(tmp_path, tr, incremental=True)
    monkeypatch.setattr(ck, "_write_shard", real)
    assert (tmp_path / "latest").read_text() == "ckpt-0000000001\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-0000000001", "latest"]
    # the failed save cleared the dirty bits of the first table: a delta would lose them
    info = kv.save(tmp_path, tr, incremental=True)
    assert info.kind == "full"
    snap = drv.state(tr)
    tr2 = trainer()
    kv.restore(tmp_path, tr2)
    drv.assert_same_state(drv.state(tr2), snap)
    for t in (tr, tr2):
        t.close()


def _other_dim():
    keras.utils.set_random_seed(3)
    inputs = {n: keras.Input(shape=(), dtype="int64", name=n) for n in ("user", "item")}
    inputs.update(history=keras.Input(shape=(None,), dtype="int64", name="history"),
                  tags=keras.Input(shape=(None,), dtype="int64", name="tags"),
                  x=keras.Input(shape=(3,), dtype="float32", name="x"))
    parts = [kv.Embedding("user", 5)(inputs["user"]), kv.Embedding("item", 3)(inputs["item"]),
             kv.Embedding("item", 3, combiner="mean", name="h")(inputs["history"]),
             kv.Embedding("tag", 2, combiner="sqrtn",
                          optimizer=kv.optimizers.Adam(0.01))(inputs["tags"]), inputs["x"]]
    z = keras.layers.Dense(6, activation="tanh")(keras.layers.Concatenate()(parts))
    return keras.Model(inputs, keras.layers.Dense(1)(z))


def _other_tables():
    keras.utils.set_random_seed(3)
    u = keras.Input(shape=(), dtype="int64", name="user")
    x = keras.Input(shape=(3,), dtype="float32", name="x")
    z = keras.layers.Concatenate()([kv.Embedding("user", 4)(u), x])
    return keras.Model({"user": u, "x": x}, keras.layers.Dense(1)(z))


def _other_dense():
    keras.utils.set_random_seed(3)
    model = drv.build()
    out = keras.layers.Dense(1)(keras.layers.Dense(2)(model.layers[-2].output))
    return keras.Model(model.inputs, out)


def _corrupt(path: Path):
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))


def _edit_manifest(path: Path, **changes):
    m = json.loads(path.read_text())
    m.update(changes)
    path.write_text(json.dumps(m))


def _shard(d: Path, table="user") -> Path:
    return next(d.glob(f"*-{table}.r0-of-1.kvs"))


MISMATCHES = {
    "another table layout": (dict(build=_other_tables), None,
                             r"tables \['item', 'tag', 'user'\] are not the model's \['user'\]"),
    "another dim": (dict(build=_other_dim), None, "table 'user' has dim 4 in the checkpoint "
                                                  "but 5 in the model"),
    "another optimizer": (dict(sparse=kv.optimizers.Ftrl(0.1)), None,
                          "row optimizer 'adagrad'.*the model uses 'ftrl'"),
    "another dense model": (dict(build=_other_dense), None, "dense model or optimizer differs"),
    "missing shard": ({}, lambda d: _shard(d / "ckpt-0000000005").unlink(),
                      "002-user.r0-of-1.kvs is missing"),
    "corrupt shard": ({}, lambda d: _corrupt(_shard(d / "ckpt-0000000004")),
                      "fails its sha256 check"),
    "truncated shard": ({}, lambda d: _shard(d / "ckpt-0000000002").write_bytes(b"x"),
                        "has 1 bytes, the manifest says"),
    "corrupt dense": ({}, lambda d: _corrupt(d / "ckpt-0000000005" / "dense.index"),
                      "dense.index fails its sha256 check"),
    "newer format": ({}, lambda d: _edit_manifest(d / "ckpt-0000000003" / "manifest.json",
                                                  version=ck.VERSION + 1),
                     f"format version {ck.VERSION + 1}, newer than this kvcoll's "
                     f"{ck.VERSION}; upgrade kvcoll"),
    "corrupt manifest": ({}, lambda d: (d / "ckpt-0000000005" / "manifest.json")
                         .write_text("{not json"), "manifest.json is corrupt"),
    "missing parent": ({}, lambda d: (d / "ckpt-0000000004" / "manifest.json").unlink(),
                       "ckpt-0000000004 is missing or incomplete"),
    "no checkpoint": ({}, lambda d: (d / "latest").unlink(), "has no checkpoint"),
}


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_mismatch_raises_and_changes_nothing(saved, tmp_path, case):
    import shutil

    d, _, _ = saved
    kwargs, damage, match = MISMATCHES[case]
    shutil.copytree(d / "chain", tmp_path / "c")
    if damage:
        damage(tmp_path / "c")
    tr = trainer(**kwargs)
    if case == "another table layout":
        tr.train_step({"user": np.arange(4), "x": np.zeros((4, 3), np.float32)},
                      np.zeros(4, np.float32))
    else:
        train(tr, 1)
    before = drv.state(tr)
    with pytest.raises(kv.CheckpointError, match=match):
        kv.restore(tmp_path / "c", tr)
    drv.assert_same_state(drv.state(tr), before)
    tr.close()


def test_export_serves_with_tensorflow_alone(tmp_path):
    tr = trainer()
    train(tr, 3)
    info = kv.export(tmp_path / "export", tr)
    assert info["tables"] == {n: len(t) for n, t in tr.tables.items()} and info["parts"] == 1
    feats = drv.serving_features()
    want = tr.predict(feats)
    got, imported = drv.serve_with_tensorflow_alone(
        str(tmp_path / "export" / "saved_model"), feats, str(tmp_path))
    assert not [m for m in imported if m.split(".")[0] in ("kvcoll", "mpi4py")], imported
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    # the embedding dictionary: one part per rank (here one), ids in storage order
    emb = tmp_path / "export" / "embeddings"
    index = json.loads((emb / "index.json").read_text())
    assert index["version"] == 2 and index["world_size"] == 1
    for name, t in tr.tables.items():
        spec = index["tables"][name]
        (part,) = spec["parts"]
        ids = np.load(emb / part["ids"])
        vecs = np.load(emb / part["vectors"])
        assert spec["dim"] == t.dim and spec["rows"] == part["rows"] == len(t) == ids.size
        assert np.unique(ids).size == ids.size
        np.testing.assert_array_equal(vecs, t.find(ids))
    tr.close()


def test_export_too_large_to_serve_is_refused_before_anything_is_written(tmp_path):
    """A SavedModel whose tables exceed max_serving_bytes is refused with the sizes;
    the previous export stays; the dictionary alone is written whatever its size, and
    dictionary=False leaves the SavedModel alone."""
    from kvcoll.serving import serving_bytes

    tr = trainer()
    train(tr, 2)
    kv.export(tmp_path / "ex", tr, dictionary=False)
    assert sorted(p.name for p in (tmp_path / "ex").iterdir()) == ["saved_model"]
    need = sum(serving_bytes(len(t), t.dim) for t in tr.tables.values())
    biggest = max(tr.tables, key=lambda n: serving_bytes(len(tr.tables[n]), tr.tables[n].dim))
    with pytest.raises(kv.InvalidArgumentError) as exc:
        kv.export(tmp_path / "ex", tr, max_serving_bytes=need - 1)
    msg = str(exc.value)
    assert f"the SavedModel's tables need {need / 1e9:.2f} GB in one serving process " \
           f"('{biggest}': {len(tr.tables[biggest]):,} rows = " in msg, msg
    assert "above max_serving_bytes = " in msg and "saved_model=False" in msg, msg
    assert sorted(p.name for p in (tmp_path / "ex").iterdir()) == ["saved_model"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".export-")]
    info = kv.export(tmp_path / "ex", tr, saved_model=False, max_serving_bytes=1)
    assert info["serving_bytes"] == 0
    assert sorted(p.name for p in (tmp_path / "ex").iterdir()) == ["embeddings"]
    with pytest.raises(kv.InvalidArgumentError, match="write nothing"):
        kv.export(tmp_path / "ex", tr, saved_model=False, dictionary=False)
    tr.close()


@pytest.mark.parametrize("fails", ["dense model", "tables"])
def test_a_restore_failing_after_verification_leaves_no_half_restored_model(saved, monkeypatch,
                                                                             fails):
    """Loading the dense model (or replaying the tables) fails after every check passed:
    the error is agreed, the dense model is rolled back, and the tables are as before
    (dense) or cleared (a replay cannot be undone), never half of each."""
    from kvcoll import checkpoint

    d, _, _ = saved
    tr = trainer()
    train(tr, 1)
    weights = [w.copy() for w in tr.model.get_weights()]
    rows = {n: t.export() for n, t in tr.tables.items()}

    def broken(*args, **kwargs):
        raise OSError("the disk went away")

    if fails == "dense model":  # the weights change, then the read fails
        from kvcoll.keras.dense_state import DenseState
        read = DenseState.read

        def half_read(self, directory):
            read(self, directory)
            broken()
        monkeypatch.setattr(DenseState, "read", half_read)
    else:
        monkeypatch.setattr(checkpoint._Replay, "apply", broken)
    with pytest.raises(kv.CheckpointError, match="the disk went away") as info:
        kv.restore(d / "chain", tr)
    assert "rolled back" in str(info.value)
    for a, w in zip(tr.model.get_weights(), weights):
        np.testing.assert_array_equal(a, w)
    for n, t in tr.tables.items():
        if fails == "dense model":
            np.testing.assert_array_equal(np.sort(t.export()["keys"]), np.sort(rows[n]["keys"]))
        else:
            assert len(t) == 0
    tr.close()


def test_a_dense_part_in_the_layout_before_dense_state_still_restores(saved, tmp_path):
    """Checkpoints written before kvcoll named the dense variables itself hold
    tf.train.Checkpoint(model=..., optimizer=...)'s layout: they restore as they are."""
    import shutil

    import tensorflow as tf

    from kvcoll import _shards

    d, snap, _ = saved
    tr = trainer()
    kv.restore(d / "full", tr)                      # the state at step 5
    eng = tr.engine
    old = tmp_path / "old"
    shutil.copytree(d / "full", old)
    ckpt = old / "ckpt-0000000005"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    for f in manifest["dense"]:
        (ckpt / f).unlink()
        del manifest["files"][f]
    tf.train.Checkpoint(model=eng.model, optimizer=eng.optimizer).write(str(ckpt / "dense"))
    manifest["dense"] = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("dense."))
    for f in manifest["dense"]:
        sha, nbytes = _shards.sha256_file(str(ckpt / f))
        manifest["files"][f] = {"sha256": sha, "bytes": nbytes, "table": None}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    tr.close()
    fresh = trainer()
    assert kv.restore(old, fresh).step == 5
    drv.assert_same_state(drv.state(fresh), snap)
    fresh.close()
