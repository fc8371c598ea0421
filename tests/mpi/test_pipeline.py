"""Pipelined steps (kvcoll.step's prefetch: the next batch read, prepared, routed and its
ids exchanged by a helper thread while a step computes) give the unpipelined loop's
results, at any world size: the losses, the dense weights and every row to 1e-6.

The loop (kv.Trainer.train_next) and Keras' fit are run twice on the same data, with
the pipeline on and off, and compared; and what the pipeline must not change: a stop
asked by a callback after step t stops every rank after step t; a known-length epoch
stages nothing past its last step (a one-shot iterator's next epoch starts where it
should); a bad batch in a prefetched element raises the same error on every rank after
the steps before it, with nothing of its own applied.
"""

import os
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

keras = tf.keras

import kvcoll as kv  # noqa: E402
from kvcoll import errors  # noqa: E402
from kvcoll.keras import engine_of  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

B, VOCAB, DIM = 48, 60, 4
BCE = keras.losses.BinaryCrossentropy(from_logits=True)
TOL = dict(rtol=1e-6, atol=1e-6)


def global_batch(step):
    g = np.random.default_rng(100 + step)
    x = {"user": g.integers(0, VOCAB, B).astype(np.int64),
         "item": g.integers(0, VOCAB * (1 + step % 3), B).astype(np.int64),
         "x": g.normal(size=(B, 3)).astype(np.float32)}
    return x, (g.random(B) < 0.4).astype(np.float32)


def mine(step, world, rank):
    """This rank's slice of global batch `step`."""
    x, y = global_batch(step)
    lo, hi = B * rank // world, B * (rank + 1) // world
    return {k: v[lo:hi] for k, v in x.items()}, y[lo:hi]


def build():
    keras.utils.set_random_seed(3)
    u = keras.Input(shape=(), dtype="int64", name="user")
    i = keras.Input(shape=(), dtype="int64", name="item")
    x = keras.Input(shape=(3,), dtype="float32", name="x")
    emb = [kv.Embedding(n, DIM, initializer=("normal", 0.0, 0.1), seed=7)(t)
           for n, t in (("user", u), ("item", i))]
    h = keras.layers.Dense(5, activation="tanh", name="hidden")(
        keras.layers.Concatenate()([*emb, x]))
    return kv.Model({"user": u, "item": i, "x": x}, keras.layers.Dense(1, name="out")(h))


def optimizer():
    return kv.DistributedOptimizer(keras.optimizers.Adam(0.01),
                                   sparse=kv.optimizers.Adagrad(0.1))


def fit_model(prefetch):
    model = build()
    engine_of(model, prefetch=prefetch)
    model.compile(optimizer=optimizer(), loss=BCE,
                  metrics=[keras.metrics.AUC(name="auc", from_logits=True)])
    return model


def rows(engine):
    """This rank's shards, sorted by key: {table: (keys, values, slots)}."""
    out = {}
    for name, t in sorted(engine.tables.items()):
        e = t.export()
        order = np.argsort(e["keys"])
        out[name] = (e["keys"][order], e["values"][order], e["slots"][order])
    return out


def assert_same_state(a_model, b_model):
    for a, b in zip(a_model.get_weights(), b_model.get_weights()):
        np.testing.assert_allclose(a, b, **TOL)
    ra, rb = rows(engine_of(a_model)), rows(engine_of(b_model))
    assert ra.keys() == rb.keys()
    for name in ra:
        np.testing.assert_array_equal(ra[name][0], rb[name][0], err_msg=name)
        np.testing.assert_allclose(ra[name][1], rb[name][1], **TOL, err_msg=name)
        np.testing.assert_allclose(ra[name][2], rb[name][2], **TOL, err_msg=name)


class StepLosses(keras.callbacks.Callback):
    """Every committed step's global loss (the logs hold the epoch's running mean)."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(engine_of(self.model).last_loss)


def test_trainer_pipelined_equals_unpipelined_with_uneven_data(comm):
    """kv.Trainer.train_next over an iterator; rank 0's data ends two steps early (it
    keeps joining with no samples): the same losses and state either way; the batches
    after the first were read by the helper thread."""
    world, rank = comm.size, comm.rank
    steps = 9 if rank else 7
    results = []
    for prefetch in (False, True):
        readers = []

        def batches():
            for step in range(steps):
                readers.append(threading.current_thread().name)
                yield mine(step, world, rank)

        model = build()
        trainer = kv.Trainer(model, BCE, optimizer(), prefetch=prefetch)
        assert trainer.engine.prefetch is prefetch
        it = batches()
        losses = []
        while (loss := trainer.train_next(it)) is not None:
            losses.append(loss)
        assert trainer.train_next(it) is None    # every rank stays done
        results.append((losses, trainer))
        helper = [n for n in readers if n == "kvcoll-prefetch"]
        assert len(helper) == (len(readers) - 1 if prefetch else 0), readers
    (plain, a), (piped, b) = results
    longest = 9 if world > 1 else 7
    assert len(plain) == len(piped) == longest
    np.testing.assert_allclose(piped, plain, **TOL)
    assert_same_state(a.model, b.model)
    assert a.engine.step == b.engine.step == longest
    for t in (a, b):
        t.close()


def test_fit_pipelined_equals_unpipelined_over_epochs(comm):
    """model.fit, 3 epochs: arrays (Keras' own iterator, a new one each epoch), and a
    one-shot generator with steps_per_epoch (the same iterator goes on from epoch to
    epoch: an element staged past an epoch's last step would shift the next epoch)."""
    world, rank = comm.size, comm.rank
    xs, ys = zip(*(mine(s, world, rank) for s in range(6)))
    x = {k: np.concatenate([p[k] for p in xs]) for k in xs[0]}
    y = np.concatenate(ys)
    per_rank = len(ys[0])
    for kind in ("arrays", "one-shot generator"):
        out = []
        for prefetch in (False, True):
            model, rec = fit_model(prefetch), StepLosses()
            if kind == "arrays":
                hist = model.fit(x, y, batch_size=per_rank, epochs=3, shuffle=False,
                                 verbose=0, callbacks=[rec])
            else:
                gen = (mine(s % 12, world, rank) for s in range(100))
                hist = model.fit(gen, steps_per_epoch=4, epochs=3, verbose=0, callbacks=[rec])
                # the next fit goes on with the generator's next element: step 12 (0 again)
                model.fit(gen, steps_per_epoch=2, epochs=1, verbose=0, callbacks=[rec])
            out.append((model, rec.losses, hist.history))
        (a, la, ha), (b, lb, hb) = out
        assert len(la) == len(lb) == (18 if kind == "arrays" else 14), (kind, len(la), len(lb))
        np.testing.assert_allclose(lb, la, **TOL, err_msg=kind)
        for key in ("loss", "auc"):
            np.testing.assert_allclose(hb[key], ha[key], **TOL, err_msg=f"{kind} {key}")
        assert_same_state(a, b)
        assert engine_of(b).loop._staged is None       # nothing left staged


def test_a_stop_after_step_t_stops_every_rank_after_step_t(comm):
    """A callback on the last rank sets stop_training after the third step: with the
    pipeline the fourth step's vote was already sent; every rank still stops after the
    third step, nothing of the fourth applied (the state equals the unpipelined run's)."""
    world, rank = comm.size, comm.rank
    last = world - 1

    class StopAfterThird(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if rank == last and batch == 2:
                self.model.stop_training = True

    out = []
    for prefetch in (False, True):
        model = fit_model(prefetch)
        gen = (mine(s, world, rank) for s in range(10))
        model.fit(gen, steps_per_epoch=10, epochs=2, verbose=0, callbacks=[StopAfterThird()])
        eng = engine_of(model)
        steps = comm.allgather(np.array([eng.step], np.int64))[:, 0]
        assert (steps == 3).all(), (prefetch, steps)
        assert model.stop_training
        assert eng.loop.consumed == 3 and eng.loop._staged is None
        out.append(model)
    assert_same_state(*out)


@pytest.mark.parametrize("where", ["prepare", "read"])
def test_a_bad_prefetched_batch_raises_everywhere_after_the_steps_before(comm, where):
    """Step 4's batch is bad on the last rank (float ids: prepare fails; or its reader
    raises): it was staged while step 3 computed; every rank raises the same error at
    step 4, and the state is that of the three good steps (the unpipelined run's)."""
    world, rank = comm.size, comm.rank
    last = world - 1

    def batches():
        for step in range(6):
            x, y = mine(step, world, rank)
            if step == 3 and rank == last:
                if where == "read":
                    raise ValueError("row 7 of the file: no label")
                x = dict(x, user=x["user"].astype(np.float32) + 0.5)
            yield x, y

    out = []
    for prefetch in (False, True):
        model = build()
        trainer = kv.Trainer(model, BCE, optimizer(), prefetch=prefetch)
        it = batches()
        for _ in range(3):
            trainer.train_next(it)
        with pytest.raises(errors.InvalidArgumentError,
                           match=rf"rank\(s\) \[{last}\] could not use their batch at step 4"):
            trainer.train_next(it)
        assert trainer.engine.step == 3 and trainer.engine.loop.consumed == 3
        out.append(trainer)
    assert_same_state(out[0].model, out[1].model)
    for t in out:
        t.close()
