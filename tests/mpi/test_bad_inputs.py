"""A catalogue of bad inputs, at any world size.

Each case feeds one bad thing through the public API on the last rank (or on every rank,
for settings) and asserts: every rank raises an error that names the thing, the value
and the fix; the tables and the model are as before; the ranks are still in step (a
collective works afterwards), so nothing hangs. Checkpoint cases (another layout, dim,
optimizer, corrupt, truncated, missing files, a newer format) are in
tests/unit/test_checkpoint.py; configuration cases in tests/unit/test_config.py.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import kvcoll as kv  # noqa: E402
from kvcoll.keras import engine_of  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

N, VOCAB = 12, 30
BCE = keras.losses.BinaryCrossentropy(from_logits=True)


def build():
    keras.utils.set_random_seed(1)
    u = keras.Input(shape=(), dtype="int64", name="user")
    h = keras.Input(shape=(None,), dtype="int64", name="history")
    x = keras.Input(shape=(2,), dtype="float32", name="x")
    z = keras.layers.Concatenate()([
        kv.Embedding("user", 3, initializer=("normal", 0, 0.1))(u),
        kv.Embedding("item", 3, combiner="mean", padding_id=-1,
                     initializer=("normal", 0, 0.1))(h), x])
    model = kv.Model({"user": u, "history": h, "x": x}, keras.layers.Dense(1)(z))
    model.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.Adam(0.01)), loss=BCE,
                  metrics=[keras.metrics.AUC(name="auc", from_logits=True)])
    return model


def good(rank, step=0):
    g = np.random.default_rng([rank, step])
    return ({"user": g.integers(0, VOCAB, N), "history": g.integers(-1, VOCAB, (N, 3)),
             "x": g.normal(size=(N, 2)).astype(np.float32)},
            (g.random(N) < 0.5).astype(np.float32))


def _sparse(n):
    return tf.sparse.from_dense(np.arange(n * 2).reshape(n, 2) % VOCAB)


# name: (how the bad rank's batch is broken, the error's text)
BATCH_CASES = {
    "float ids": (lambda x, y: ({**x, "user": x["user"].astype(np.float32)}, y),
                  "'user': ids must be int64 or int32, got float32"),
    "uint64 ids": (lambda x, y: ({**x, "user": x["user"].astype(np.uint64)}, y),
                   "view them as int64 with .view(np.int64)"),
    "uint32 ids": (lambda x, y: ({**x, "user": x["user"].astype(np.uint32)}, y),
                   "cast them with .astype(np.int64)"),
    "2-D ids of a one-hot feature": (lambda x, y: ({**x, "user": x["user"].reshape(-1, 2)}, y),
                                     "2-D ids need an Embedding with a combiner"),
    "3-D ids": (lambda x, y: ({**x, "history": x["history"].reshape(N, 3, 1)}, y),
                "ids must be 1-D, got shape"),
    "ragged one-hot feature": (lambda x, y: ({**x, "user": (x["user"], np.arange(N + 1))}, y),
                               "multi-hot ids need an Embedding with a combiner"),
    "row_splits that do not fit": (
        lambda x, y: ({**x, "history": (np.arange(5), np.array([0, 2, 9]))}, y),
        "row_splits are not valid for 5 ids"),
    "a SparseTensor of ids": (lambda x, y: ({**x, "history": _sparse(N)}, y),
                              "tf.RaggedTensor.from_sparse"),
    "unknown feature": (lambda x, y: ({**x, "colour": x["user"]}, y), "unknown ['colour']"),
    "missing feature": (lambda x, y: ({k: v for k, v in x.items() if k != "x"}, y),
                        "missing ['x']"),
    "batch sizes that disagree": (lambda x, y: ({**x, "x": x["x"][:-1]}, y),
                                  "different batch sizes"),
    "labels of another length": (lambda x, y: (x, y[:-2]), "different batch sizes"),
    "string numbers": (lambda x, y: ({**x, "x": x["x"].astype(str)}, y),
                       "numeric input must be a number array, got <U"),
    "string labels": (lambda x, y: (x, y.astype(str)), "labels: must be numbers"),
    "no labels after labelled batches": (lambda x, y: (x,), "this batch has no labels"),
    "labels of another structure": (lambda x, y: (x, {"ctr": y}), "labels: structure"),
    "NaN features": (lambda x, y: ({**x, "x": np.full_like(x["x"], np.nan)}, y), "NaN/Inf"),
    "an infinite label": (lambda x, y: (x, np.where(y > 0, np.inf, y).astype(np.float32)),
                          "NaN/Inf"),
}


def _state(model):
    eng = engine_of(model)
    tables = {n: t.export() for n, t in eng.tables.items()}
    return tables, [w.copy() for w in model.get_weights()]


def _same_state(model, before):
    tables, weights = _state(model)
    for n, e in tables.items():
        b = before[0][n]
        assert np.array_equal(np.sort(e["keys"]), np.sort(b["keys"])), n
        common, ia, ib = np.intersect1d(e["keys"], b["keys"], return_indices=True)
        np.testing.assert_array_equal(e["values"][ia], b["values"][ib])
    for a, w in zip(weights, before[1]):
        np.testing.assert_array_equal(a, w)


def _in_step(comm):
    assert comm.allreduce(np.array([1], np.int64))[0] == comm.size


@pytest.fixture(scope="module")
def trained(comm):
    """One model for every bad-batch case, trained a step: each case leaves it as it
    found it but for its good steps (what the cases check), so a model that went through
    every refused batch before still trains and refuses the next (building and tracing
    a model of its own took most of each case's time)."""
    model = build()
    model.fit(iter([good(comm.rank, 0)]), verbose=0)
    return model


@pytest.mark.parametrize("case", sorted(BATCH_CASES))
def test_a_bad_batch_on_one_rank(comm, trained, case):
    world, rank = comm.size, comm.rank
    model = trained
    before = _state(model)
    breaks, text = BATCH_CASES[case]
    bad = rank == world - 1

    def batches():
        yield good(rank, 1)
        x, y = good(rank, 2)
        yield breaks(x, y) if bad else (x, y)
        yield good(rank, 3)

    snapshot = {}

    class AfterFirst(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 0:
                snapshot["state"] = _state(model)

    with pytest.raises(Exception) as info:
        model.fit(batches(), verbose=0, callbacks=[AfterFirst()])
    assert isinstance(info.value, (kv.KvcollError, ValueError)), repr(info.value)
    assert text in str(info.value), f"{type(info.value).__name__}: {info.value}"
    if not bad:  # the other ranks name the rank that failed
        assert f"[{world - 1}]" in str(info.value), str(info.value)
    _same_state(model, snapshot.get("state", before))
    _in_step(comm)


def test_padding_ids_neither_read_nor_train_a_row(comm):
    """A declared padding id is dropped: -1 never becomes a key of the table."""
    rank = comm.rank
    model = build()
    model.fit(iter([good(rank, s) for s in range(3)]), verbose=0)
    keys = engine_of(model).tables["item"].export()["keys"]
    assert -1 not in keys and keys.size > 0
    x, _ = good(rank, 9)
    x["history"][:] = -1                       # every row all padding: the mean reads zeros
    assert np.isfinite(model.predict(x, verbose=0)).all()


def test_an_empty_batch_on_one_rank_is_no_error(comm):
    world, rank = comm.size, comm.rank
    model = build()
    x, y = good(rank)
    if rank == world - 1:
        x, y = {k: v[:0] for k, v in x.items()}, y[:0]
    hist = model.fit(iter([(x, y), good(rank, 1)]), verbose=0)
    assert np.isfinite(hist.history["loss"]).all()
    _in_step(comm)


# name: (what raises, the error's type, its text); raised on every rank alike
API_CASES = {
    "dim 0": (lambda: kv.Embedding("t", 0), kv.InvalidArgumentError,
              "dim must be a positive int, got 0"),
    "an unknown combiner": (lambda: kv.Embedding("t", 2, combiner="max"),
                            kv.InvalidArgumentError, "combiner must be one of"),
    "a padding id without a combiner": (lambda: kv.Embedding("t", 2, padding_id=0),
                                        kv.InvalidArgumentError, "it needs a combiner"),
    "a Keras optimizer for the rows": (
        lambda: kv.DistributedOptimizer(keras.optimizers.Adam(), sparse=keras.optimizers.SGD()),
        kv.InvalidArgumentError, "sparse must be a kvcoll.optimizers row optimizer"),
    "a learning rate of 0": (lambda: kv.optimizers.Adagrad(0.0), kv.InvalidArgumentError,
                             "learning_rate must be > 0"),
    "an unknown step mode": (lambda: kv.StepMode("sync"), kv.InvalidArgumentError,
                             "step mode 'sync' is unknown"),
    "a step past 32 bits": (lambda: kv.KvTable(2).find_or_create([1], step=2 ** 32),
                            kv.InvalidArgumentError, "does not fit the tables' 32-bit"),
    "gradients of another dim": (
        lambda: kv.KvTable(4).apply_gradients([1], np.ones((1, 3), np.float32), step=1),
        kv.DimensionError, "the table's dim is 4"),
    "a collective op that does not exist": (lambda: kv.allreduce(1.0, op="avg"),
                                            kv.InvalidArgumentError, "op must be"),
}


@pytest.mark.parametrize("case", sorted(API_CASES))
def test_bad_api_arguments(comm, case):
    make, kind, text = API_CASES[case]
    with pytest.raises(kind, match=None) as info:
        make()
    assert text in str(info.value), str(info.value)
    _in_step(comm)


def test_models_kvcoll_cannot_run_are_refused_with_the_fix(comm):
    u = keras.Input(shape=(), dtype="int64", name="user")
    cast = keras.ops.cast(u, "int32")
    m = kv.Model(u, keras.layers.Dense(1)(kv.Embedding("u", 2)(cast)))
    m.compile(optimizer=kv.DistributedOptimizer("sgd"), loss="mse")
    with pytest.raises(kv.InvalidArgumentError, match="must be called directly on a model input"):
        m.fit(np.arange(4), np.zeros(4), verbose=0)
    both = keras.layers.Concatenate()([kv.Embedding("v", 2)(u),
                                       keras.ops.expand_dims(keras.ops.cast(u, "float32"), 1)])
    m2 = kv.Model(u, keras.layers.Dense(1)(both))
    m2.compile(optimizer=kv.DistributedOptimizer("sgd"), loss="mse")
    with pytest.raises(kv.InvalidArgumentError, match="feeds a kv.Embedding and other"):
        m2.fit(np.arange(4), np.zeros(4), verbose=0)
    m3 = build()
    with pytest.raises(kv.InvalidArgumentError, match="class_weight has no weight for"):
        m3.fit(*good(comm.rank), class_weight={0: 1.0}, verbose=0)
    uncompiled = kv.Model(u, keras.layers.Dense(1)(kv.Embedding("w", 2)(u)))
    with pytest.raises(kv.InvalidArgumentError, match="call model.compile"):
        uncompiled.fit(np.arange(4), np.zeros(4), verbose=0)
    _in_step(comm)
