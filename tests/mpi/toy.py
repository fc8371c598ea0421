"""The small model and data the multi-rank Keras tests share (ckpt_driver.py too).

Four id features on three tables (single-hot int64 and int32 ids, two multi-hot
features with the mean and sqrtn combiners, one table with its own Adam), three numeric
features. Global batch `step` depends on the step alone, so runs at different world
sizes see the same global batches.
"""

import numpy as np
import tensorflow as tf

import kvcoll as kv

keras = tf.keras  # the Keras TensorFlow names: Keras 3, or Keras 2 (./dev compat)

B = 48  # global batch


def build(item_dtype: str = "int64"):
    keras.utils.set_random_seed(3)
    u = keras.Input(shape=(), dtype="int64", name="user")
    i = keras.Input(shape=(), dtype=item_dtype, name="item")
    h = keras.Input(shape=(None,), dtype="int64", name="history")
    t = keras.Input(shape=(None,), dtype="int64", name="tags")
    x = keras.Input(shape=(3,), dtype="float32", name="x")
    parts = [
        kv.Embedding("user", 4, initializer=("normal", 0, 0.1), seed=1)(u),
        kv.Embedding("item", 3, initializer=("uniform", -0.1, 0.1))(i),
        kv.Embedding("item", 3, combiner="mean", initializer=("uniform", -0.1, 0.1),
                     name="history_emb")(h),
        kv.Embedding("tag", 2, combiner="sqrtn", optimizer=kv.optimizers.Adam(0.01))(t),
        x,
    ]
    z = keras.layers.Dense(6, activation="tanh")(keras.layers.Concatenate()(parts))
    return kv.Model({"user": u, "item": i, "history": h, "tags": t, "x": x},
                       keras.layers.Dense(1)(z))


def global_batch(step, vocab=60, item_dtype=np.int64):
    g = np.random.default_rng([11, step])
    lens = g.integers(0, 4, B)
    tag_lens = g.integers(1, 3, B)
    return {
        "user": g.integers(0, vocab, B).astype(np.int64),
        "item": g.integers(0, vocab // 2, B).astype(item_dtype),
        "history": (g.integers(0, vocab // 2, lens.sum()).astype(np.int64), lens),
        "tags": (g.integers(-5, 5, tag_lens.sum()).astype(np.int64), tag_lens),
        "x": g.normal(size=(B, 3)).astype(np.float32),
        "label": (g.random(B) < 0.4).astype(np.float32),
    }


def take(batch, lo, hi):
    """Samples lo..hi-1 of a global batch, ragged features as (values, row_splits)."""
    out = {}
    for k, v in batch.items():
        if isinstance(v, tuple):
            vals, lens = v
            splits = np.concatenate([[0], np.cumsum(lens)])
            out[k] = (vals[splits[lo]:splits[hi]], splits[lo:hi + 1] - splits[lo])
        else:
            out[k] = v[lo:hi]
    return out


def batches(lo, hi, steps):
    """(features, labels) of samples lo..hi-1 of global batches 0..steps-1."""
    for step in range(steps):
        b = take(global_batch(step), lo, hi)
        label = b.pop("label")
        yield b, label


def train_all(trainer, lo, hi, steps):
    """kv.Trainer.train_next over batches(lo, hi, steps) until every rank is done: the
    losses."""
    it = batches(lo, hi, steps)
    losses = []
    while (loss := trainer.train_next(it)) is not None:
        losses.append(loss)
    return losses
