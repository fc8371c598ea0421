"""model.fit on one process: the Keras contract (optimizer, losses, weights, learning
rates, callbacks) with kv.Embedding layers. Multi-rank behaviour: tests/mpi/test_fit.py."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

keras = tf.keras  # the Keras TensorFlow names: Keras 3, or Keras 2 (./dev compat)

import kvcoll as kv  # noqa: E402
from kvcoll.comm import Comm  # noqa: E402
from kvcoll.keras import engine_of  # noqa: E402

VOCAB, DIM, N = 30, 4, 96
BCE = keras.losses.BinaryCrossentropy(from_logits=True)


def data(n=N, seed=1):
    g = np.random.default_rng(seed)
    return ({"user": g.integers(0, VOCAB, n).astype(np.int64),
             "x": g.normal(size=(n, 2)).astype(np.float32)},
            (g.random(n) < 0.5).astype(np.float32))


def build(embed=None, extra=None):
    keras.utils.set_random_seed(2)
    u = keras.Input(shape=(), dtype="int64", name="user")
    x = keras.Input(shape=(2,), dtype="float32", name="x")
    e = (embed or (lambda: kv.Embedding("user", DIM, initializer=("normal", 0, 0.1))))()(u)
    h = keras.layers.Concatenate()([e, x])
    if extra is not None:
        h = extra(h)
    cls = kv.Model if embed is None else keras.Model  # a reference model: Keras alone
    return cls({"user": u, "x": x}, keras.layers.Dense(1, name="out")(h))


def kv_model(opt=None, sparse=None, metrics=None, **build_kw):
    model = build(**build_kw)
    engine_of(model, comm=Comm.local())
    model.compile(optimizer=kv.DistributedOptimizer(opt or keras.optimizers.SGD(0.1),
                                                    sparse=sparse or kv.optimizers.SGD(0.1)),
                  loss=BCE, metrics=metrics)
    return model


def test_distributed_optimizer_is_a_keras_optimizer():
    base = keras.optimizers.Adam(3e-3, beta_1=0.8)
    opt = kv.DistributedOptimizer(base, sparse=kv.optimizers.Adagrad(0.05))
    assert isinstance(opt, keras.optimizers.Adam) and type(opt) is not keras.optimizers.Adam
    assert opt.get_config() == base.get_config()
    again = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(again) is keras.optimizers.Adam      # a saved model records the plain class
    assert isinstance(kv.DistributedOptimizer("sgd"), keras.optimizers.SGD)
    with pytest.raises(kv.InvalidArgumentError, match="row optimizer"):
        kv.DistributedOptimizer(base, sparse=keras.optimizers.SGD(0.1))
    with pytest.raises(kv.InvalidArgumentError, match="wraps a keras.optimizers.Optimizer"):
        kv.DistributedOptimizer(42)


def test_add_loss_and_regularizers_are_part_of_the_loss():
    class AddsThree(keras.layers.Layer):
        def call(self, h):
            self.add_loss(3.0 + 0.0 * tf.reduce_sum(h))
            return h

    x, y = data()
    plain = kv_model()
    extra = kv_model(extra=AddsThree())
    a = plain.test_on_batch(x, y, return_dict=True)["loss"]
    b = extra.test_on_batch(x, y, return_dict=True)["loss"]
    assert b == pytest.approx(a + 3.0, rel=1e-6)
    reg = kv_model(extra=keras.layers.Dense(3, kernel_regularizer=keras.regularizers.L2(10.0)))
    noreg = kv_model(extra=keras.layers.Dense(3))
    w = reg.layers[-2].kernel.numpy()
    gap = reg.test_on_batch(x, y, return_dict=True)["loss"] - \
        noreg.test_on_batch(x, y, return_dict=True)["loss"]
    assert gap == pytest.approx(10.0 * float((w ** 2).sum()), rel=1e-4)


def test_class_weight_equals_the_sample_weights_it_stands_for():
    x, y = data()
    a = kv_model()
    ha = a.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
               class_weight={0: 1.0, 1: 3.0})
    b = kv_model()
    hb = b.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
               sample_weight=np.where(y > 0.5, 3.0, 1.0).astype(np.float32))
    np.testing.assert_allclose(ha.history["loss"], hb.history["loss"], rtol=1e-6)


def test_a_learning_rate_schedule_drives_the_rows():
    """Rows with a LearningRateSchedule (evaluated per step, passed to C) train exactly as
    a Keras embedding does under the same schedule."""
    x, y = data()
    sched = keras.optimizers.schedules.ExponentialDecay(0.5, decay_steps=1, decay_rate=0.7)
    kvm = kv_model(opt=keras.optimizers.SGD(sched), sparse=kv.optimizers.SGD(sched))
    start = kvm.get_layer("out").get_weights()
    h = kvm.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    table = engine_of(kvm).tables["user"]
    assert table.learning_rate == pytest.approx(float(sched(N // 16 - 1)), rel=1e-6)
    ref = build(embed=lambda: keras.layers.Embedding(VOCAB, DIM, name="ref_user"))
    ref.get_layer("out").set_weights(start)
    ref.get_layer("ref_user").set_weights([table.initial_values(np.arange(VOCAB))])
    ref.compile(optimizer=keras.optimizers.SGD(sched), loss=BCE)
    hr = ref.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    np.testing.assert_allclose(h.history["loss"], hr.history["loss"], rtol=1e-5)
    e = table.export()
    np.testing.assert_allclose(e["values"], ref.get_layer("ref_user").get_weights()[0][e["keys"]],
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("callback", ["scheduler", "plateau"])
def test_callbacks_that_change_the_learning_rate_move_the_rows_too(callback):
    x, y = data()
    model = kv_model(opt=keras.optimizers.SGD(0.2), sparse=kv.optimizers.Adagrad(0.05))
    if callback == "scheduler":
        cb = keras.callbacks.LearningRateScheduler(lambda epoch, lr: 0.2 * 0.5 ** epoch)
    else:
        cb = keras.callbacks.ReduceLROnPlateau(monitor="loss", factor=0.5, patience=0,
                                               min_delta=100.0)
    model.fit(x, y, batch_size=32, epochs=3, verbose=0, callbacks=[cb])
    dense_lr = float(model.optimizer.learning_rate.numpy())
    assert dense_lr < 0.2
    # the rows' rate moved by the same factor, applied from the next step
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert engine_of(model).tables["user"].learning_rate == pytest.approx(
        0.05 * dense_lr / 0.2, rel=1e-6)


def test_kvcoll_callbacks(tmp_path):
    x, y = data()
    model = kv_model(metrics=[keras.metrics.AUC(name="auc", from_logits=True)])
    ck = kv.callbacks.Checkpoint(tmp_path / "ck", every_n_steps=4, incremental_every=2)
    stats = kv.callbacks.TableStats(per_table=True)
    ev = kv.callbacks.Evict(every_n_steps=3)
    ex = kv.callbacks.Export(tmp_path / "serve")
    log = tmp_path / "log.csv"
    hist = model.fit(x, y, batch_size=16, epochs=2, verbose=0,
                     callbacks=[ck, stats, ev, ex, keras.callbacks.CSVLogger(str(log))])
    steps = 2 * N // 16
    # a delta needs a parent: the first save is full
    assert [(s.step, s.kind) for s in ck.saves] == \
        [(s, "full" if s % 4 == 0 or s == 2 else "delta") for s in range(2, steps + 1, 2)]
    assert hist.history["user/rows"][-1] == hist.history["kv_rows"][-1] == \
        len(engine_of(model).tables["user"]) > 0 == stats.history[-1]["user"]["evicted"]
    assert "user/rows" in log.read_text().splitlines()[0]
    assert len(ev.pauses) > 1 and ex.exports[0]["tables"]["user"] > 0
    served = tf.saved_model.load(str(tmp_path / "serve" / "saved_model"))
    out = served.signatures["serving_default"](user=tf.constant(x["user"][:5]),
                                               x=tf.constant(x["x"][:5]))["prediction"]
    np.testing.assert_allclose(out.numpy(), model.predict(
        {k: v[:5] for k, v in x.items()}, verbose=0), rtol=1e-5, atol=1e-6)
    # a new model resumes from the latest checkpoint inside fit: the saved run had done
    # its 2 epochs, so a fit of 3 epochs runs the third only (epochs is the total, as
    # with Keras' BackupAndRestore)
    again = kv_model(metrics=[keras.metrics.AUC(name="auc", from_logits=True)])
    resume = kv.callbacks.Checkpoint(tmp_path / "ck", restore=True, save_at_end=False)
    h = again.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[resume])
    assert resume.restored.step == steps and engine_of(again).step == steps + N // 16
    assert len(h.history["loss"]) == 1


def test_models_without_kv_embedding_keep_keras_own_fit():
    keras.utils.set_random_seed(0)
    m = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    m.compile(optimizer="sgd", loss="mse")
    h = m.fit(np.ones((8, 2), np.float32), np.ones(8, np.float32), verbose=0)
    assert len(h.history["loss"]) == 1
    from kvcoll.keras.model import is_distributed_model
    assert not is_distributed_model(m) and is_distributed_model(build())


def test_no_keras_class_is_patched():
    """Importing kvcoll replaces no attribute of keras.Model (or of its bases): opting in
    is per model."""
    names = ("fit", "evaluate", "predict", "train_on_batch", "test_on_batch",
             "predict_on_batch", "make_train_function", "make_test_function",
             "make_predict_function", "stop_training", "reset_metrics", "compile")
    for cls in keras.Model.__mro__:
        for name in names:
            value = cls.__dict__.get(name)
            if value is not None:
                fn = getattr(value, "fget", value)
                assert getattr(fn, "__module__", "").split(".")[0] in ("keras", "tf_keras"), \
                    (cls, name, fn)


def test_a_plain_model_with_kv_embedding_fails_with_the_fix():
    """A keras.Model holding kv.Embedding that did not opt in never trains in silence:
    its first fit, evaluate or predict names the one-line fix."""
    x, y = data()
    u = keras.Input(shape=(), dtype="int64", name="user")
    xx = keras.Input(shape=(2,), dtype="float32", name="x")
    h = keras.layers.Concatenate()([kv.Embedding("user", DIM)(u), xx])
    plain = keras.Model({"user": u, "x": xx}, keras.layers.Dense(1)(h))
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss=BCE)
    for call in (lambda: plain.fit(x, y, epochs=1, verbose=0),
                 lambda: plain.evaluate(x, y, verbose=0),
                 lambda: plain.predict(x, verbose=0)):
        with pytest.raises(kv.InvalidArgumentError, match=r"kv\.distribute\(model\)"):
            call()


def test_distribute_opts_in_an_existing_model_and_equals_kv_model():
    """kv.distribute(model) trains the model as kv.Model does (same losses), touching no
    other instance of its class."""
    x, y = data()
    losses = []
    for how in ("kv.Model", "distribute"):
        keras.utils.set_random_seed(2)
        u = keras.Input(shape=(), dtype="int64", name="user")
        xx = keras.Input(shape=(2,), dtype="float32", name="x")
        h = keras.layers.Concatenate()([kv.Embedding("user", DIM, initializer=("normal", 0, 0.1))(u), xx])
        out = keras.layers.Dense(1)(h)
        m = kv.Model({"user": u, "x": xx}, out) if how == "kv.Model" \
            else kv.distribute(keras.Model({"user": u, "x": xx}, out))
        engine_of(m, comm=Comm.local())
        m.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                    sparse=kv.optimizers.SGD(0.1)), loss=BCE)
        losses.append(m.fit(x, y, batch_size=32, epochs=2, shuffle=False,
                            verbose=0).history["loss"])
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-6)
    other = keras.Model(*[keras.Input((1,))] * 2)
    from kvcoll.keras.model import is_distributed_model
    assert not is_distributed_model(other)


def test_a_custom_train_step_is_refused_with_the_fix():
    class Custom(kv.Model):
        def __init__(self):
            super().__init__()
            self.e = kv.Embedding("u", 2)
            self.d = keras.layers.Dense(1)

        def call(self, x):
            return self.d(self.e(x["user"]))

        def train_step(self, data):
            return super().train_step(data)

    model = Custom()
    engine_of(model, comm=Comm.local())
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=BCE)
    with pytest.raises(kv.InvalidArgumentError, match="override compute_loss"):
        model.fit({"user": np.arange(4)}, np.zeros(4, np.float32), verbose=0)


def test_dense_backend_setting_and_its_errors():
    """dense_backend: "kvcoll" by default, "horovod" on request (or when wrapping Horovod's
    optimizer); Horovod's needs hvd.init() and BSP, and says so."""
    opt = kv.DistributedOptimizer(keras.optimizers.SGD(0.1))
    from kvcoll.keras.optimizer import dense_backend_of
    assert dense_backend_of(opt) == "kvcoll"
    assert dense_backend_of(kv.DistributedOptimizer(opt, dense_backend="horovod")) == "horovod"
    assert dense_backend_of(kv.DistributedOptimizer(
        kv.DistributedOptimizer(opt, dense_backend="horovod"))) == "horovod"   # kept on re-wrap
    with pytest.raises(kv.InvalidArgumentError, match="dense_backend must be one of"):
        kv.DistributedOptimizer(opt, dense_backend="nccl")
    x, y = data()
    model = build()
    engine_of(model, comm=Comm.local())
    model.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                    dense_backend="horovod"), loss=BCE)
    from kvcoll.keras import _horovod
    if not _horovod.initialized():
        with pytest.raises(kv.InvalidArgumentError, match=r"call hvd.init\(\)"):
            model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    ssp = build()
    engine_of(ssp, comm=Comm.local(), step_mode="ssp", staleness=1)
    ssp.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                  dense_backend="horovod"), loss=BCE)
    with pytest.raises(kv.InvalidArgumentError, match="sums the dense gradients of BSP steps"):
        ssp.fit(x, y, batch_size=32, epochs=1, verbose=0)


def test_the_keras_kvcoll_runs_on_is_tf_keras():
    """kvcoll picks the Keras tf.keras names (Keras 3, or Keras 2 with
    TF_USE_LEGACY_KERAS / on TensorFlow 2.15), and a model of another Keras is refused
    with the rule."""
    from kvcoll.keras import _compat
    assert _compat.keras.Model is keras.Model
    assert _compat.KERAS_MAJOR == int(_compat.keras.__version__.split(".")[0])

    class NotKeras:
        pass

    with pytest.raises(kv.InvalidArgumentError, match="TF_USE_LEGACY_KERAS"):
        engine_of(NotKeras(), comm=Comm.local())


def test_save_and_load_model_keep_the_opt_in_and_the_row_optimizer(tmp_path):
    """model.save / keras.models.load_model: the reloaded model is a kv.Model again, and
    its kv.Embedding keeps its own row optimizer (a schedule included)."""
    sched = keras.optimizers.schedules.ExponentialDecay(0.3, decay_steps=10, decay_rate=0.5)
    model = kv_model(embed=None)
    x, y = data()
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    u = keras.Input(shape=(), dtype="int64", name="user")
    xx = keras.Input(shape=(2,), dtype="float32", name="x")
    e = kv.Embedding("user", DIM, optimizer=kv.optimizers.Adagrad(sched))(u)
    m = kv.Model({"user": u, "x": xx}, keras.layers.Dense(1)(keras.layers.Concatenate()([e, xx])))
    path = str(tmp_path / "m.keras")
    m.save(path)
    loaded = keras.models.load_model(path)
    from kvcoll.keras.model import is_distributed_model
    assert is_distributed_model(loaded) and isinstance(loaded, kv.Model)
    layer = next(l for l in loaded.layers if isinstance(l, kv.Embedding))
    assert isinstance(layer.row_optimizer, kv.optimizers.Adagrad)
    assert layer.row_optimizer.learning_rate_at(20) == pytest.approx(0.3 * 0.25, rel=1e-6)
    engine_of(loaded, comm=Comm.local())
    loaded.compile(optimizer=keras.optimizers.SGD(0.1), loss=BCE)
    assert len(loaded.fit(x, y, batch_size=32, epochs=1, verbose=0).history["loss"]) == 1


def test_a_top_level_pair_is_x_and_y_never_ragged_ids():
    """A data set of (ids, integer labels) is (x, y): the labels are not taken for the
    ids' row splits (the rule: a top-level tuple is (x, y, sample_weight))."""
    keras.utils.set_random_seed(3)
    u = keras.Input(shape=(), dtype="int64", name="user")
    m = kv.Model(u, keras.layers.Dense(1)(kv.Embedding("user", DIM)(u)))
    engine_of(m, comm=Comm.local())
    m.compile(optimizer=keras.optimizers.SGD(0.1), loss=BCE)
    ids = np.arange(64, dtype=np.int64) % 7
    labels = (ids % 2).astype(np.int64)
    ds = tf.data.Dataset.from_tensor_slices((ids, labels)).batch(16)
    h = m.fit(ds, epochs=1, verbose=0)
    assert len(h.history["loss"]) == 1 and np.isfinite(h.history["loss"][0])
    assert engine_of(m).step == 4 and len(engine_of(m).tables["user"]) == 7


def test_own_test_step_and_predict_step_run_with_the_rows():
    """A model's own test_step and predict_step run inside kvcoll's steps (the rows are
    there while they run): here they double the outputs, which evaluate's loss and
    predict's outputs show."""
    class Doubled(kv.Model):
        def __init__(self):
            super().__init__()
            self.e = kv.Embedding("user", DIM, initializer=("normal", 0, 0.1))
            self.d = keras.layers.Dense(1)

        def call(self, x):
            return self.d(tf.concat([self.e(x["user"]), x["x"]], axis=1))

        def test_step(self, data):
            x, y = data[0], data[1]
            y_pred = 2.0 * self(x, training=False)
            loss = self.compute_loss(x, y, y_pred)
            if hasattr(self, "_loss_tracker") and self._loss_tracker is not None:
                self._loss_tracker.update_state(loss, sample_weight=tf.shape(y)[0])
            return {}

        def predict_step(self, data):
            return 2.0 * self(data[0], training=False)

    x, y = data()
    keras.utils.set_random_seed(4)
    m = Doubled()
    engine_of(m, comm=Comm.local())
    m.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.SGD(0.1)), loss=BCE)
    m.fit(x, y, batch_size=32, epochs=1, verbose=0)
    # the model's own logits, worked out from its table and weights
    rows = engine_of(m).tables["user"].find(x["user"])
    kernel, bias = m.d.get_weights()
    logits = np.concatenate([rows, x["x"]], axis=1) @ kernel + bias
    np.testing.assert_allclose(m.predict(x, batch_size=32, verbose=0), 2.0 * logits,
                               rtol=1e-5, atol=1e-6)
    want = float(BCE(y[:, None], 2.0 * logits))
    np.testing.assert_allclose(m.evaluate(x, y, batch_size=N, verbose=0), want, rtol=1e-5)


def test_a_resumed_fit_batches_pass_continues_after_the_saved_step(tmp_path):
    """fit_batches() begins its pass when it is made: a resume that positions the source
    must restart that pass, or the resumed fit trains every batch again (found by
    ./dev bench elastic: a relaunch restored step 200 of 600 and ran 600 more)."""
    from kvcoll.data import SyntheticCTR

    synth = SyntheticCTR(num_categorical=2, num_numeric=2, vocab=50, seed=3)

    def make():
        keras.utils.set_random_seed(2)
        ins = {f"C{i}": keras.Input(shape=(), dtype="int64", name=f"C{i}") for i in (1, 2)}
        ins["numeric"] = keras.Input(shape=(2,), dtype="float32", name="numeric")
        h = keras.layers.Concatenate()([kv.Embedding(f"C{i}", DIM)(ins[f"C{i}"])
                                        for i in (1, 2)] + [ins["numeric"]])
        m = kv.Model(ins, keras.layers.Dense(1)(h))
        engine_of(m, comm=Comm.local())
        m.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.SGD(0.1),
                                                    sparse=kv.optimizers.SGD(0.1)), loss=BCE)
        return m

    class StopAfter4(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 3:
                self.model.stop_training = True

    first = make()
    first.fit(synth.batches(32, 0, 1, num_steps=10).fit_batches(), epochs=1, verbose=0,
              callbacks=[kv.callbacks.Checkpoint(tmp_path / "ck", every_n_steps=1),
                         StopAfter4()])
    assert engine_of(first).step == 4
    again = make()
    again.fit(synth.batches(32, 0, 1, num_steps=10).fit_batches(), epochs=1, verbose=0,
              callbacks=[kv.callbacks.Checkpoint(tmp_path / "ck", every_n_steps=100,
                                                 restore=True)])
    assert engine_of(again).step == 10      # the 6 batches left, not 10 more
