"""kvcoll's Trainer computes what plain TensorFlow computes.

The same model is trained with a kv.Embedding (rows in a kvcoll table, SGD in C) and
with a keras.layers.Embedding over the same small vocabulary (SGD on the dense
variable), from the same initial rows: losses, dense weights and rows must agree.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import kvcoll as kv  # noqa: E402
from kvcoll.comm import Comm  # noqa: E402

VOCAB, DIM, B = 30, 4, 32


def model(embed_user, embed_hist):
    keras.utils.set_random_seed(0)
    u = keras.Input(shape=(), dtype="int64", name="user")
    h = keras.Input(shape=(None,), dtype="int64", name="hist")
    x = keras.Input(shape=(2,), dtype="float32", name="x")
    z = keras.layers.Concatenate()([embed_user(u), embed_hist(h), x])
    z = keras.layers.Dense(5, activation="tanh")(z)
    return keras.Model({"user": u, "hist": h, "x": x}, keras.layers.Dense(1)(z))


def batch(step):
    g = np.random.default_rng([2, step])
    hist = g.integers(0, VOCAB, (B, 3))
    return ({"user": g.integers(0, VOCAB, B), "hist": hist,
             "x": g.normal(size=(B, 2)).astype(np.float32)},
            (g.random(B) < 0.5).astype(np.float32))


@pytest.mark.parametrize("combiner,jit", [("sum", True), ("mean", True), ("sqrtn", True),
                                          ("mean", False)])
def test_trainer_matches_plain_keras(combiner, jit):
    """jit=False runs the dense step eagerly (no tf.function)."""
    kv.init(argv=[])
    lr = 0.5
    kvm = model(lambda u: kv.Embedding("u", DIM, initializer=("uniform", -0.3, 0.3))(u),
                lambda h: kv.Embedding("h", DIM, combiner=combiner,
                                       initializer=("uniform", -0.3, 0.3))(h))
    tr = kv.Trainer(kvm, keras.losses.BinaryCrossentropy(from_logits=True),
                    kv.DistributedOptimizer(keras.optimizers.SGD(lr),
                                            sparse=kv.optimizers.SGD(lr)),
                    comm=Comm.local(), jit=jit)
    ids = np.arange(VOCAB)
    init_u = tr.tables["u"].initial_values(ids)
    init_h = tr.tables["h"].initial_values(ids)

    eu = keras.layers.Embedding(VOCAB, DIM)
    eh = keras.layers.Embedding(VOCAB, DIM)

    def hist_embed(h):
        v = eh(h)
        if combiner == "sum":
            return keras.ops.sum(v, axis=1)
        if combiner == "mean":
            return keras.ops.mean(v, axis=1)
        return keras.ops.sum(v, axis=1) / np.sqrt(3.0)

    tfm = model(eu, hist_embed)
    eu.embeddings.assign(init_u)
    eh.embeddings.assign(init_h)
    dense_kv = kvm.trainable_variables
    dense_tf = [v for v in tfm.trainable_variables if v.shape != (VOCAB, DIM)]
    for a, b in zip(dense_tf, dense_kv):
        a.assign(b)
    sgd = keras.optimizers.SGD(lr)
    bce = keras.losses.BinaryCrossentropy(from_logits=True)
    for step in range(5):
        f, y = batch(step)
        loss_kv = tr.train_step(f, y)
        with tf.GradientTape() as tape:
            out = tfm({k: tf.constant(v) for k, v in f.items()})
            loss_tf = bce(y[:, None], out)
        grads = tape.gradient(loss_tf, tfm.trainable_variables)
        sgd.apply_gradients(zip(grads, tfm.trainable_variables))
        np.testing.assert_allclose(loss_kv, float(loss_tf), rtol=1e-5)
    for a, b in zip(dense_kv, dense_tf):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(tr.tables["u"].find(ids), eu.embeddings.numpy(), atol=1e-5)
    np.testing.assert_allclose(tr.tables["h"].find(ids), eh.embeddings.numpy(), atol=1e-5)
    tr.close()


def test_rows_gradient_summed_in_c_equals_tensorflows():
    """The Trainer takes the rows' gradient out of the compiled step as (values,
    indices) and sums it in C: the same matrix TensorFlow's own conversion gives, for a
    gather gradient (duplicates), a dense gradient and no gradient."""
    from kvcoll.keras.compute import _gathered_grad
    from kvcoll.exchange.kernels import gather_grad

    rows = tf.constant(np.arange(12, dtype=np.float32).reshape(6, 2))
    idx = tf.constant([[4, 1], [4, 0], [5, 4]], tf.int64)
    with tf.GradientTape() as tape:
        tape.watch(rows)
        y = tf.reduce_sum(tf.gather(rows, idx) ** 2) + tf.reduce_sum(tf.gather(rows, [1, 1]))
    g = tape.gradient(y, rows)
    assert isinstance(g, tf.IndexedSlices)
    dense = 3.0 * rows
    for grad, want in ((g, tf.convert_to_tensor(g)), (dense, dense), (None, tf.zeros_like(rows))):
        values, indices = _gathered_grad(grad, rows)
        got = gather_grad(values.numpy(), indices.numpy(), rows.shape[0])
        np.testing.assert_array_equal(got, want.numpy())
