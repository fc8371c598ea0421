"""A small CTR model and its data for the compatibility suite, in tf.keras (Keras 3 or
Keras 2, whichever the lane's TensorFlow names) and TensorFlow ops only.

One single-hot table, one multi-hot table (mean), numeric features; the global batch of
step s depends on s alone, so runs on any number of ranks (and in any lane) see the same
data."""

import numpy as np
import tensorflow as tf

import kvcoll as kv

keras = tf.keras
B, VOCAB = 32, 50


def build(seed: int = 3):
    keras.utils.set_random_seed(seed)
    u = keras.Input(shape=(), dtype="int64", name="user")
    h = keras.Input(shape=(None,), dtype="int64", name="history")
    x = keras.Input(shape=(3,), dtype="float32", name="x")
    z = keras.layers.Concatenate()([
        kv.Embedding("user", 4, initializer=("normal", 0.0, 0.1), seed=1)(u),
        kv.Embedding("item", 3, combiner="mean", initializer=("uniform", -0.1, 0.1))(h),
        x])
    z = keras.layers.Dense(6, activation="tanh", name="hidden")(z)
    return kv.Model({"user": u, "history": h, "x": x}, keras.layers.Dense(1, name="out")(z))


def compile_(model):
    model.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.Adam(0.02),
                                                    sparse=kv.optimizers.Adagrad(0.2)),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True),
                  metrics=[keras.metrics.AUC(name="auc", from_logits=True)])
    return model


def batch(step: int, rank: int = 0, world: int = 1):
    """This rank's slice of global batch `step`: (x, y), history as (values, row_splits)."""
    g = np.random.default_rng([7, step])
    lens = g.integers(0, 4, B)
    vals = g.integers(0, VOCAB, lens.sum()).astype(np.int64)
    splits = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    user = g.integers(0, VOCAB, B).astype(np.int64)
    x = g.normal(size=(B, 3)).astype(np.float32)
    y = (g.random(B) < 0.4).astype(np.float32)
    lo, hi = B * rank // world, B * (rank + 1) // world
    return ({"user": user[lo:hi], "history": (vals[splits[lo]:splits[hi]],
                                              splits[lo:hi + 1] - splits[lo]), "x": x[lo:hi]},
            y[lo:hi])


def batches(first: int, n: int, rank: int = 0, world: int = 1):
    for s in range(first, first + n):
        yield batch(s, rank, world)
