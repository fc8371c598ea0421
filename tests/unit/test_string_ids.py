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


# (tests/unit/conftest.py starts every test with the run's hash not chosen yet)
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
    model = kv.Model({"country": c, "x": x}, keras.layers.Dense(1)(h))
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


SERVE = """
import json, sys
import numpy as np
import tensorflow as tf
m = tf.saved_model.load(sys.argv[1])
sig = m.signatures[sys.argv[4]]
feeds = {k: tf.constant(v) for k, v in np.load(sys.argv[2]).items()}
np.save(sys.argv[3], sig(**feeds)["prediction"].numpy())
print(json.dumps({"imported": sorted(k for k in sys.modules
                                     if k.split(".")[0] in ("kvcoll", "mpi4py", "keras")),
                  "inputs": {k: v.dtype.name
                             for k, v in sig.structured_input_signature[1].items()}}))
"""


def serve(saved_model, feeds: dict, workdir, signature="serving_default"):
    """Predictions of a SavedModel in a fresh process that imports only TensorFlow, and
    {"imported": kvcoll/mpi4py/keras modules it imported, "inputs": {name: dtype}}."""
    path, out = os.path.join(workdir, "feeds.npz"), os.path.join(workdir, "out.npy")
    np.savez(path, **feeds)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_"))}
    proc = subprocess.run([sys.executable, "-c", SERVE, str(saved_model), path, out, signature],
                          capture_output=True, text=True, timeout=180, cwd=workdir, check=False,
                          env=dict(env, TF_CPP_MIN_LOG_LEVEL="2"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return np.load(out), json.loads(proc.stdout.strip().splitlines()[-1])


UNSEEN = np.array(["never-seen", "FR", "日本", "", "x" * 300, "us"])


@pytest.mark.parametrize("id_hash", ["farmhash64", "xxh64"])
def test_the_export_takes_raw_strings_and_hashes_them_as_training_did(tmp_path, id_hash):
    """Raw strings in, the model's predictions out, in a process without kvcoll: with
    farmhash64 (tf.fingerprint) and with xxh64 (a model trained before it)."""
    if id_hash == "xxh64":
        ids.configure("xxh64")
    x, y = countries()
    model = string_model()
    model.fit(x, y, batch_size=16, epochs=2, verbose=0)
    info = kv.export(tmp_path / "export", model)
    assert info["id_hash"] == id_hash and info["string_features"] == ["country"]
    g = np.random.default_rng(9)
    feeds = {"country": np.concatenate([x["country"][:20], UNSEEN]),
             "x": g.normal(size=(26, 2)).astype(np.float32)}
    want = model.predict(feeds, batch_size=26, verbose=0)
    got, seen = serve(tmp_path / "export" / "saved_model", feeds, str(tmp_path))
    assert not [m for m in seen["imported"] if m.split(".")[0] in ("kvcoll", "mpi4py")]
    assert seen["inputs"] == {"country": "string", "x": "float32"}
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    # "serving_keys": the same model on the keys, for a caller that hashes itself
    keyed = dict(feeds, country=ids.hash_strings(feeds["country"], id_hash))
    got_keys, seen = serve(tmp_path / "export" / "saved_model", keyed, str(tmp_path),
                           "serving_keys")
    assert seen["inputs"]["country"] == "int64"
    np.testing.assert_array_equal(got_keys, got)


def test_the_graph_hashes_equal_the_c_hashes_on_every_length():
    """kvcoll.serving.string_keys (TensorFlow ops alone) against kvcoll.ids' C, both
    hashes: every length 0..300 of random bytes, unicode, an empty batch."""
    from kvcoll.serving import string_keys

    g = np.random.default_rng(2)
    words = [bytes(g.integers(0, 256, n, dtype=np.uint8)) for n in range(301)]
    words += [w.encode() for w in ("ümlaut", "日本語", "🙂")] + [b"z" * 4099]
    for h in ("farmhash64", "xxh64"):
        fn = tf.function(lambda s, h=h: string_keys(s, h))
        np.testing.assert_array_equal(fn(tf.constant(words)).numpy(),
                                      ids.hash_strings(np.array(words, dtype=object), h))
        assert fn(tf.constant([], tf.string)).numpy().size == 0


def test_export_string_features_must_name_id_inputs(tmp_path):
    x, y = countries()
    model = string_model()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    with pytest.raises(kv.InvalidArgumentError, match=r"string_features \['x'\] are not id "
                                                      r"inputs of the model; its id inputs.*"
                                                      r"\['country'\]"):
        kv.export(tmp_path / "e", model, string_features=["x"])
    assert not (tmp_path / "e").exists()


# -- the hash in checkpoints -------------------------------------------------------------

def _strip_id_hash(ckpt_dir):
    """Make a checkpoint look written before the field existed."""
    for name in os.listdir(ckpt_dir):
        path = os.path.join(ckpt_dir, name, "manifest.json")
        if os.path.exists(path):
            with open(path) as f:
                m = json.load(f)
            m.pop("id_hash")
            with open(path, "w") as f:
                json.dump(m, f)


def test_checkpoints_record_the_hash_and_one_without_it_restores_as_xxh64(tmp_path,
                                                                         monkeypatch):
    x, y = countries()
    ids.configure("xxh64")
    model = string_model()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    kv.save(tmp_path / "ck", model)
    (name,) = [n for n in os.listdir(tmp_path / "ck") if n.startswith("ckpt-")]
    manifest = json.loads((tmp_path / "ck" / name / "manifest.json").read_text())
    assert manifest["id_hash"] == "xxh64" and manifest["version"] >= 2
    want = model.predict(x, batch_size=16, verbose=0)
    _strip_id_hash(tmp_path / "ck")
    # a new process (the default hash, nothing hashed yet) adopts xxh64 from the checkpoint
    monkeypatch.setattr(ids, "_run", {"name": None, "source": None, "used": False,
                                      "strings": set()})
    again = string_model()
    kv.restore(tmp_path / "ck", again)
    assert ids.id_hash() == "xxh64"
    np.testing.assert_allclose(again.predict(x, batch_size=16, verbose=0), want, rtol=1e-6)
    again.fit(x, y, batch_size=16, epochs=1, verbose=0)  # keeps training with xxh64
    keys = engine_of(again).tables["country"].export()["keys"]
    assert set(keys) <= set(ids.hash_strings(NAMES, "xxh64"))
    kv.save(tmp_path / "ck", again)
    assert json.loads((tmp_path / "ck" / kv.checkpoint.latest(tmp_path / "ck")
                       / "manifest.json").read_text())["id_hash"] == "xxh64"


@pytest.mark.parametrize("how", ["setting", "used"])
def test_a_checkpoint_of_another_hash_is_refused_and_nothing_changes(tmp_path, monkeypatch,
                                                                     how):
    x, y = countries()
    model = string_model()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)   # farmhash64
    kv.save(tmp_path / "ck", model)
    _strip_id_hash(tmp_path / "ck")                       # now an xxh64 checkpoint
    monkeypatch.setattr(ids, "_run", {"name": None, "source": None, "used": False,
                                      "strings": set()})
    if how == "setting":
        ids.configure("farmhash64")
    other = string_model()
    other.fit(x, y, batch_size=16, epochs=1, verbose=0)   # hashes with farmhash64
    before = {n: t.export()["keys"] for n, t in engine_of(other).tables.items()}
    weights = other.get_weights()
    why = "the id_hash setting says so" if how == "setting" else \
        "this process already hashed string ids with it"
    with pytest.raises(kv.CheckpointError, match=(
            rf"was written with id_hash 'xxh64', but this run hashes string ids with "
            rf"'farmhash64' \({why}\).*Run with --id-hash xxh64 \(or KVCOLL_ID_HASH=xxh64, "
            rf"or kv.init\(id_hash='xxh64'\)\)")):
        kv.restore(tmp_path / "ck", other)
    for n, t in engine_of(other).tables.items():
        np.testing.assert_array_equal(t.export()["keys"], before[n])
    for a, b in zip(other.get_weights(), weights):
        np.testing.assert_array_equal(a, b)
    assert ids.id_hash() == "farmhash64"
