"""model.fit / evaluate / predict at any world size.

Every rank passes its own slice of one global data set; the results must equal one
process holding all of it: plain Keras with a fixed-vocabulary keras.layers.Embedding
(SGD), or kvcoll itself on a one-rank communicator (Adagrad rows).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

keras = tf.keras  # the Keras TensorFlow names: Keras 3, or Keras 2 (./dev compat)

import kvcoll as kv  # noqa: E402
from kvcoll.comm import Comm  # noqa: E402
from kvcoll.keras import engine_of  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

B, STEPS, VOCAB, DIM = 48, 5, 40, 4
N = B * STEPS
BCE = keras.losses.BinaryCrossentropy(from_logits=True)


def data(n=N, seed=5):
    g = np.random.default_rng(seed)
    x = {"user": g.integers(0, VOCAB, n).astype(np.int64),
         "item": g.integers(0, VOCAB, n).astype(np.int64),
         "x": g.normal(size=(n, 3)).astype(np.float32)}
    return x, (g.random(n) < 0.4).astype(np.float32), g.uniform(0.5, 2.0, n).astype(np.float32)


def rank_rows(world, rank, n=N, b=B):
    """This rank's samples: its slice of every global batch of b."""
    lo, hi = b * rank // world, b * (rank + 1) // world
    return np.concatenate([np.arange(s * b + lo, s * b + hi) for s in range(n // b)])


def take(tree, idx):
    return {k: v[idx] for k, v in tree.items()} if isinstance(tree, dict) else tree[idx]


def build(embed, seed=3):
    keras.utils.set_random_seed(seed)
    u = keras.Input(shape=(), dtype="int64", name="user")
    i = keras.Input(shape=(), dtype="int64", name="item")
    x = keras.Input(shape=(3,), dtype="float32", name="x")
    h = keras.layers.Concatenate()([embed("user")(u), embed("item")(i), x])
    h = keras.layers.Dense(5, activation="tanh", name="hidden",
                           kernel_regularizer=keras.regularizers.L2(1e-2))(h)
    cls = kv.Model if embed is kv_embed else keras.Model  # a reference: Keras alone
    return cls({"user": u, "item": i, "x": x}, keras.layers.Dense(1, name="out")(h))


def kv_embed(name):
    return kv.Embedding(name, DIM, initializer=("normal", 0.0, 0.1), seed=7)


def dense_weights(model):
    return [w for name in ("hidden", "out") for w in model.get_layer(name).get_weights()]


def test_fit_equals_single_process_keras(comm):
    """Per-epoch losses and final weights equal plain Keras' fit of the whole global
    batch with a fixed-vocabulary embedding, SGD, an L2 regularizer and sample weights."""
    world, rank = comm.size, comm.rank
    x, y, sw = data()
    mine = rank_rows(world, rank)
    lr = 0.1
    model = build(kv_embed)
    start = {n: model.get_layer(n).get_weights() for n in ("hidden", "out")}
    model.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.SGD(lr),
                                                    sparse=kv.optimizers.SGD(lr)), loss=BCE)
    hist = model.fit(take(x, mine), y[mine], sample_weight=sw[mine], batch_size=B // world,
                     epochs=3, shuffle=False, verbose=0)
    tables = engine_of(model).tables

    ref = build(lambda name: keras.layers.Embedding(VOCAB, DIM, name=f"ref_{name}"))
    for name, weights in start.items():
        ref.get_layer(name).set_weights(weights)
    for name in ("user", "item"):  # the rows start where kvcoll's start
        ref.get_layer(f"ref_{name}").set_weights(
            [tables[name].initial_values(np.arange(VOCAB, dtype=np.int64))])
    ref.compile(optimizer=keras.optimizers.SGD(lr), loss=BCE)
    ref_hist = ref.fit(x, y, sample_weight=sw, batch_size=B, epochs=3, shuffle=False, verbose=0)

    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-5)
    for a, b in zip(dense_weights(model), dense_weights(ref)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for name in ("user", "item"):
        e = tables[name].export()
        want = ref.get_layer(f"ref_{name}").get_weights()[0][e["keys"]]
        np.testing.assert_allclose(e["values"], want, rtol=1e-5, atol=1e-6)


def make_adagrad_model(comm=None):
    model = build(kv_embed)
    if comm is not None:
        engine_of(model, comm=comm)
    model.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.Adam(0.01),
                                                    sparse=kv.optimizers.Adagrad(0.1)),
                  loss=BCE, metrics=[keras.metrics.AUC(name="auc", from_logits=True),
                                     keras.metrics.BinaryAccuracy(name="acc", threshold=0.0)])
    return model


def test_fit_equals_one_rank_kvcoll_with_adagrad_rows(comm):
    world, rank = comm.size, comm.rank
    x, y, sw = data()
    mine = rank_rows(world, rank)
    ref = make_adagrad_model(Comm.local())
    ref_hist = ref.fit(x, y, sample_weight=sw, batch_size=B, epochs=2, shuffle=False, verbose=0)
    model = make_adagrad_model()
    hist = model.fit(take(x, mine), y[mine], sample_weight=sw[mine], batch_size=B // world,
                     epochs=2, shuffle=False, verbose=0)
    for key in ("loss", "auc", "acc"):
        np.testing.assert_allclose(hist.history[key], ref_hist.history[key], rtol=1e-5,
                                   err_msg=key)
    for a, b in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    ref_tables = engine_of(ref).tables
    for name, t in engine_of(model).tables.items():
        e = t.export()
        np.testing.assert_allclose(e["values"], ref_tables[name].find(e["keys"]),
                                   rtol=1e-5, atol=1e-6)


def test_metrics_are_exact_over_all_ranks_with_uneven_data(comm):
    """AUC and accuracy in evaluate's logs (and fit's) equal the metric of one process
    over every rank's samples, on every rank, though ranks hold different amounts."""
    world, rank = comm.size, comm.rank
    x, y, _ = data(n=300, seed=9)
    cuts = np.linspace(0, 300, world + 1).astype(int) + np.r_[0, np.arange(1, world) * 7, 0]
    mine = np.arange(cuts[rank], cuts[rank + 1])
    model = make_adagrad_model()
    hist = model.fit(take(x, mine), y[mine], batch_size=16, epochs=2, verbose=0)
    logs = model.evaluate(take(x, mine), y[mine], batch_size=13, return_dict=True, verbose=0)
    pred = model.predict(take(x, mine), batch_size=11, verbose=0)
    assert pred.shape == (mine.size, 1)
    every = comm.allgather(np.array([mine.size], np.int64))[:, 0]
    allp, _ = comm.allgatherv(pred[:, 0].astype(np.float64))
    ally, _ = comm.allgatherv(y[mine].astype(np.float64))
    assert allp.size == every.sum() == 300
    auc = keras.metrics.AUC(from_logits=True)
    auc.update_state(ally, allp)
    acc = keras.metrics.BinaryAccuracy(threshold=0.0)
    acc.update_state(ally, allp)
    np.testing.assert_allclose(logs["auc"], float(auc.result()), rtol=1e-6)
    np.testing.assert_allclose(logs["acc"], float(acc.result()), rtol=1e-6)
    # every rank logged the same values
    for key in ("loss", "auc", "acc"):
        got = comm.allgather(np.array(hist.history[key] + [logs[key]], np.float64))
        np.testing.assert_allclose(got, got[:1].repeat(world, 0), rtol=1e-7, err_msg=key)


def test_early_stopping_and_a_stop_on_one_rank_stop_every_rank_together(comm):
    world, rank = comm.size, comm.rank
    x, y, _ = data()
    mine = rank_rows(world, rank)
    model = make_adagrad_model()
    stop = keras.callbacks.EarlyStopping(monitor="loss", min_delta=10.0, patience=1)
    hist = model.fit(take(x, mine), y[mine], batch_size=B // world, epochs=6, verbose=0,
                     callbacks=[stop])
    epochs = comm.allgather(np.array([len(hist.history["loss"])], np.int64))[:, 0]
    assert (epochs == 2).all(), epochs

    class StopOnRank0(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if rank == 0 and batch == 2:
                self.model.stop_training = True

    before = engine_of(model).step
    model.fit(take(x, mine), y[mine], batch_size=B // world, epochs=3, verbose=0,
              callbacks=[StopOnRank0()])
    steps = comm.allgather(np.array([engine_of(model).step - before], np.int64))[:, 0]
    assert (steps == 3).all(), steps   # steps 0, 1, 2 ran; the stop came with step 3


def test_multi_output_model_with_per_output_losses_and_metrics(comm):
    world, rank = comm.size, comm.rank
    x, y, _ = data()
    y2 = (np.random.default_rng(2).random(N) < 0.2).astype(np.float32)
    mine = rank_rows(world, rank)
    keras.utils.set_random_seed(4)
    u = keras.Input(shape=(), dtype="int64", name="user")
    i = keras.Input(shape=(), dtype="int64", name="item")
    h = keras.layers.Concatenate()([kv_embed("user")(u), kv_embed("item")(i)])
    ctr = keras.layers.Dense(1, name="ctr")(h)
    cvr = keras.layers.Dense(1, name="cvr")(keras.layers.Dense(4, activation="relu")(h))
    model = kv.Model({"user": u, "item": i}, {"ctr": ctr, "cvr": cvr})
    model.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.Adam(0.02)),
                  loss={"ctr": BCE, "cvr": BCE}, loss_weights={"ctr": 1.0, "cvr": 0.5},
                  metrics={"ctr": [keras.metrics.AUC(name="auc")],
                           "cvr": [keras.metrics.AUC(name="auc")]})
    xs = {"user": x["user"][mine], "item": x["item"][mine]}
    hist = model.fit(xs, {"ctr": y[mine], "cvr": y2[mine]}, batch_size=B // world, epochs=4,
                     verbose=0)
    h = hist.history
    for key in ("loss", "ctr_loss", "cvr_loss", "ctr_auc", "cvr_auc"):
        assert key in h, sorted(h)
    assert h["loss"][-1] < h["loss"][0]
    got = comm.allgather(np.array(h["loss"], np.float64))
    np.testing.assert_allclose(got, got[:1].repeat(world, 0), rtol=1e-7)
    out = model.predict(xs, verbose=0)
    assert set(out) == {"ctr", "cvr"} and out["ctr"].shape == (mine.size, 1)


class TwoTower(kv.Model):
    """A subclassed model: ragged history ids, string city ids, one-hot user ids."""

    def __init__(self):
        super().__init__()
        self.user = kv.Embedding("user", DIM, initializer=("normal", 0.0, 0.1))
        self.hist = kv.Embedding("item", DIM, combiner="mean",
                                 initializer=("normal", 0.0, 0.1))
        self.city = kv.Embedding("city", 2, initializer=("normal", 0.0, 0.1))
        self.head = keras.layers.Dense(1)

    def call(self, inputs):
        z = tf.concat([self.user(inputs["user"]), self.hist(inputs["history"]),
                       self.city(inputs["city"])], axis=1)
        return self.head(z)


def ragged_data(n=N, seed=8):
    g = np.random.default_rng(seed)
    lens = g.integers(0, 4, n)
    vals = g.integers(0, VOCAB, lens.sum()).astype(np.int64)
    splits = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    city = np.array([f"city-{c}" for c in g.integers(0, 7, n)])
    return {"user": g.integers(0, VOCAB, n).astype(np.int64), "history": (vals, splits),
            "city": city}, (g.random(n) < 0.5).astype(np.float32)


def select(x, idx):
    vals, splits = x["history"]
    lens = np.diff(splits)[idx]
    parts = [vals[splits[i]:splits[i + 1]] for i in idx]
    return {"user": x["user"][idx], "city": x["city"][idx],
            "history": tf.RaggedTensor.from_row_lengths(
                np.concatenate(parts) if parts else np.zeros(0, np.int64), lens)}


def make_two_tower(comm=None):
    keras.utils.set_random_seed(6)
    model = TwoTower()
    if comm is not None:
        engine_of(model, comm=comm)
    model.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.Adam(0.02)), loss=BCE)
    return model


def test_subclassed_model_ragged_and_string_ids_and_a_dataset(comm):
    """A subclassed model with ragged and string id features trains like one process
    holding every sample, from numpy arrays and from a tf.data.Dataset alike."""
    world, rank = comm.size, comm.rank
    x, y = ragged_data()
    mine = rank_rows(world, rank)
    ref = make_two_tower(Comm.local())
    ref_hist = ref.fit(select(x, np.arange(N)), y, batch_size=B, epochs=2, shuffle=False,
                       verbose=0)
    model = make_two_tower()
    hist = model.fit(select(x, mine), y[mine], batch_size=B // world, epochs=2, shuffle=False,
                     verbose=0)
    np.testing.assert_allclose(hist.history["loss"], ref_hist.history["loss"], rtol=1e-5)
    for a, b in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # the same from a tf.data.Dataset of this rank's batches
    again = make_two_tower()
    ds = tf.data.Dataset.from_tensor_slices((select(x, mine), y[mine])).batch(B // world)
    hist2 = again.fit(ds, epochs=2, verbose=0)
    np.testing.assert_allclose(hist2.history["loss"], ref_hist.history["loss"], rtol=1e-5)
    # kv.data.shard cuts one dataset by rank
    full = tf.data.Dataset.from_tensor_slices(np.arange(12))
    assert list(kv.data.shard(full).as_numpy_iterator()) == list(range(rank, 12, world))


@pytest.fixture(scope="module")
def trained(comm):
    """One model, trained an epoch, for every bad-input case: each leaves it as it found
    it but for its good steps (what the cases check), so a model that went through every
    refused batch before still trains and refuses the next (building and tracing a model
    of its own took most of each case's time)."""
    x, y, _ = data()
    mine = rank_rows(comm.size, comm.rank)
    model = make_adagrad_model()
    model.fit(take(x, mine), y[mine], batch_size=B // comm.size, epochs=1, verbose=0)
    return model


@pytest.mark.parametrize("case", ["float ids", "unknown feature", "batch sizes", "nan loss",
                                  "error on one rank"])
@pytest.mark.parametrize("call", ["fit", "evaluate", "predict"])
def test_bad_input_raises_the_same_error_everywhere(comm, trained, case, call):
    """A bad batch on the last rank only: every rank raises, nothing changes, no hang."""
    world, rank = comm.size, comm.rank
    if case == "nan loss" and call == "predict":
        pytest.skip("predict computes no loss")
    x, y, _ = data()
    mine = rank_rows(world, rank)
    model = trained
    eng = engine_of(model)
    before = {n: t.export() for n, t in eng.tables.items()}
    weights = model.get_weights()
    bad = rank == world - 1
    xs, ys = take(x, mine), y[mine].copy()

    def batches():
        for s in range(STEPS):
            sl = slice(s * (B // world), (s + 1) * (B // world))
            xb, yb = {k: v[sl] for k, v in xs.items()}, ys[sl]
            if bad and s == 2:
                if case == "float ids":
                    xb["user"] = xb["user"].astype(np.float32)
                elif case == "unknown feature":
                    xb["colour"] = xb["user"]
                elif case == "batch sizes":
                    xb["x"] = xb["x"][:-1]
                elif case == "nan loss":
                    xb["x"] = np.full_like(xb["x"], np.nan)
                elif case == "error on one rank":
                    raise ValueError("this rank's reader broke")
            yield (xb, yb) if call != "predict" else (xb,)

    expected = kv.NonFiniteError if case == "nan loss" and call == "fit" else kv.KvcollError \
        if case != "error on one rank" or not bad else ValueError
    if case == "nan loss" and call == "evaluate":
        logs = model.evaluate(batches(), verbose=0, return_dict=True)
        assert np.isnan(logs["loss"])
        return
    class Snapshot(keras.callbacks.Callback):
        """fit: the state after the last good step (batch 1); the bad one is batch 2."""

        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                before.update({n: t.export() for n, t in eng.tables.items()})
                weights[:] = model.get_weights()

    kwargs = {"callbacks": [Snapshot()]} if call == "fit" else {}
    with pytest.raises((expected, ValueError)) as info:
        getattr(model, call)(batches(), verbose=0, **kwargs)
    text = str(info.value)
    assert {"float ids": "int64 or int32", "unknown feature": "unknown ['colour']",
            "batch sizes": "different batch sizes", "nan loss": "NaN/Inf",
            "error on one rank": "reader broke"}[case] in text, text
    for n, t in eng.tables.items():
        after = t.export()
        order, border = np.argsort(after["keys"]), np.argsort(before[n]["keys"])
        # the rejected step's lookups created no row that stayed
        np.testing.assert_array_equal(after["keys"][order], before[n]["keys"][border])
        common, ia, ib = np.intersect1d(after["keys"], before[n]["keys"], return_indices=True)
        np.testing.assert_array_equal(after["values"][ia], before[n]["values"][ib])
    for a, w in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(a, w)
    # the ranks are still in step: a collective works
    assert comm.allreduce(np.array([1], np.int64))[0] == world


def test_validation_data_and_rank_zero_only_callbacks(comm, tmp_path):
    """val_ logs equal evaluate() on the same data; CSVLogger and TensorBoard write on
    rank 0 only (each rank here names its own file: only rank 0's appears)."""
    world, rank = comm.size, comm.rank
    x, y, _ = data()
    mine = rank_rows(world, rank)
    vx, vy, _ = data(n=90, seed=4)
    vmine = np.arange(90)[rank::world]
    model = make_adagrad_model()
    log = tmp_path / f"log{rank}.csv"
    hist = model.fit(take(x, mine), y[mine], batch_size=B // world, epochs=2, verbose=0,
                     validation_data=(take(vx, vmine), vy[vmine]),
                     callbacks=[keras.callbacks.CSVLogger(str(log))])
    logs = model.evaluate(take(vx, vmine), vy[vmine], batch_size=B // world, verbose=0,
                          return_dict=True)
    for key in ("loss", "auc", "acc"):
        np.testing.assert_allclose(hist.history[f"val_{key}"][-1], logs[key], rtol=1e-6)
    assert log.exists() == (rank == 0)


def test_public_collective_helpers(comm):
    world, rank = comm.size, comm.rank
    assert kv.rank() == rank and kv.size() == world
    assert 0 <= kv.local_rank() < kv.local_size() <= world
    assert kv.allreduce(np.array([rank, 1.0]), op="sum").tolist() == \
        [world * (world - 1) / 2, world]
    assert kv.allreduce(float(rank)) == pytest.approx((world - 1) / 2)      # mean
    assert kv.allreduce(np.int64(rank), op="max") == world - 1
    t = kv.allreduce(tf.constant([[1.0, 2.0]]) * (rank + 1), op="mean")
    assert isinstance(t, tf.Tensor) and t.shape == (1, 2)
    np.testing.assert_allclose(t.numpy(), np.array([[1.0, 2.0]]) * np.mean(np.arange(1, world + 1)))
    got = kv.allgather(np.full(rank + 1, rank, np.int32))
    assert got.tolist() == [r for r in range(world) for _ in range(r + 1)]
    b = kv.broadcast(tf.constant([rank, rank], tf.int64), root_rank=world - 1)
    assert isinstance(b, tf.Tensor) and b.numpy().tolist() == [world - 1] * 2
    with pytest.raises(kv.InvalidArgumentError, match="op must be"):
        kv.allreduce(1.0, op="avg")
