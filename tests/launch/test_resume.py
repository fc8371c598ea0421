"""A resume in the middle of an epoch continues where the killed run's checkpoint stood:
the saved epoch and step, and the reader positioned once, so the lineage (the killed run
up to its last checkpoint, then the resumed run) trains on exactly the samples of an
uninterrupted run, in the same order: its losses and its tables equal that run's.

2 ranks, model.fit on a Criteo file read with kv.data.read_criteo(...).dataset() (the
set-up of the new user's report), kv.callbacks.Checkpoint(every_n_steps=5,
restore=True); the first run is SIGKILLed (one rank, which ends the job) mid-epoch.
"""

import json
import os

import numpy as np

from mpirun import run

LINES, BATCH, EPOCHS = 1600, 64, 2          # 25 steps an epoch

FIT = r"""
import json, os, signal, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import keras, numpy as np, kvcoll as kv
kv.init(argv=[])
path, ck_dir, out, kill_at = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
keras.utils.set_random_seed(0)
inputs = {f"C{i}": keras.Input(shape=(), dtype="int64", name=f"C{i}") for i in range(1, 27)}
inputs["numeric"] = keras.Input(shape=(13,), name="numeric")
vecs = [kv.Embedding(f"C{i}", 4, seed=1, initializer=("normal", 0.0, 0.05))(inputs[f"C{i}"])
        for i in range(1, 27)]
h = keras.layers.Concatenate()(vecs + [keras.layers.Normalization(axis=None)(inputs["numeric"])])
model = kv.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(8, activation="relu")(h)))
model.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.Adam(1e-3),
                                                sparse=kv.optimizers.Adagrad(0.05)),
              loss=keras.losses.BinaryCrossentropy(from_logits=True))
data = kv.data.read_criteo(path, %(batch)d, split="global").dataset()

class Record(keras.callbacks.Callback):      # every committed step's own global loss
    def on_train_batch_end(self, batch, logs=None):
        eng = kv.keras.engine_of(self.model)    # (logs hold the epoch's running mean)
        with open(f"{out}.losses", "a") as f:
            f.write(f"{eng.step} {eng.last_loss!r}\n")
        if eng.step == kill_at and kv.rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)

ck = kv.callbacks.Checkpoint(ck_dir, every_n_steps=5, restore=True, save_at_end=False)
model.fit(data, epochs=%(epochs)d, verbose=0, callbacks=[ck, Record()])
eng = kv.keras.engine_of(model)
rows = {n: t.export() for n, t in sorted(eng.tables.items())}
np.savez(f"{out}.r{kv.rank()}.npz", **{f"{n}/{k}": v for n, r in rows.items()
                                       for k, v in r.items() if k in ("keys", "values")})
print("rank", kv.rank(), "done at step", eng.step, flush=True)
""" % {"batch": BATCH, "epochs": EPOCHS}


def write_criteo(path, n, seed=3):
    g = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(n):
            label = int(g.random() < 0.3)
            ints = "\t".join(str(v) for v in g.integers(0, 50, 13))
            cats = "\t".join(f"{v:08x}" for v in g.integers(0, 300, 26))
            f.write(f"{label}\t{ints}\t{cats}\n")


def losses(out):
    got = {}
    for line in open(f"{out}.losses"):
        step, loss = line.split()
        got[int(step)] = float(loss)   # every rank writes the same global loss
    return got


def tables(out):
    merged = {}
    for r in range(2):
        with np.load(f"{out}.r{r}.npz") as z:
            for k in z.files:
                merged.setdefault(k, []).append(z[k])
    out = {}
    for k in merged:
        if k.endswith("/keys"):
            name = k[:-5]
            keys = np.concatenate(merged[k])
            vals = np.concatenate(merged[f"{name}/values"])
            order = np.argsort(keys)
            out[name] = (keys[order], vals[order])
    return out


def test_a_killed_fit_resumes_mid_epoch_on_exactly_the_samples_left(tmp_path):
    data = tmp_path / "day.tsv"
    write_criteo(data, LINES)
    steps = EPOCHS * LINES // BATCH
    # the uninterrupted run
    code, log = run(2, ["-c", FIT, data, tmp_path / "ck-ref", tmp_path / "ref", -1], 300,
                    "the uninterrupted fit")
    assert code == 0, log[-4000:]
    assert f"done at step {steps}" in log
    # killed in the second epoch, 3 steps after the checkpoint at step 35
    code, log = run(2, ["-c", FIT, data, tmp_path / "ck", tmp_path / "a", 38], 300,
                    "the fit that is killed")
    assert code != 0 and "done at step" not in log, log[-3000:]
    assert (tmp_path / "ck" / "latest").read_text() == "ckpt-0000000035\n"
    code, log = run(2, ["-c", FIT, data, tmp_path / "ck", tmp_path / "b", -1], 300,
                    "the resumed fit")
    assert code == 0, log[-4000:]
    assert "kv.callbacks.Checkpoint: restored ckpt-0000000035" in log, log[-3000:]
    assert "the next fit continues at epoch 2, step 10" in log, log[-3000:]
    assert "resumed in epoch 2 after step 10; this epoch is short" in log, log[-3000:]
    assert f"done at step {steps}" in log
    ref, first, second = losses(tmp_path / "ref"), losses(tmp_path / "a"), \
        losses(tmp_path / "b")
    assert sorted(second) == list(range(36, steps + 1))          # none replayed or skipped
    lineage = {s: v for s, v in first.items() if s <= 35} | second
    assert sorted(lineage) == sorted(ref)
    np.testing.assert_allclose([lineage[s] for s in sorted(ref)],
                               [ref[s] for s in sorted(ref)], rtol=1e-6)
    want, got = tables(tmp_path / "ref"), tables(tmp_path / "b")
    assert want.keys() == got.keys()
    for name in want:
        np.testing.assert_array_equal(got[name][0], want[name][0])
        np.testing.assert_allclose(got[name][1], want[name][1], rtol=1e-6, atol=1e-7)
