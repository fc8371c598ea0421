"""The semi-synchronous pipeline (--pipeline semi, prefetch="semi": TorchRec's
semi-sync): the next batch's rows are fetched while a step computes, before its update,
so rows read by two steps in a row are one step stale. Its results are not the exact
loop's, but they are the same at any world size: a distributed run equals a one-rank
run of the whole global batch step by step (losses, dense weights, every row, to 1e-6),
through kv.Trainer.train_next and through model.fit over epochs; and they differ from
the exact pipeline's by the staleness only (close, not equal).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

keras = tf.keras

import kvcoll as kv  # noqa: E402
from kvcoll.comm import Comm  # noqa: E402
from kvcoll.keras import engine_of  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

from toy import B, batches, build, train_all  # noqa: E402

STEPS = 8
TOL = dict(rtol=1e-6, atol=1e-6)
BCE = keras.losses.BinaryCrossentropy(from_logits=True)


def optimizer():
    return kv.DistributedOptimizer(keras.optimizers.Adam(0.02),
                                   sparse=kv.optimizers.Adagrad(0.2))


def train(t, lo, hi):
    return train_all(t, lo, hi, STEPS)


def assert_same_model(dist, ref_model, ref_tables):
    for a, b in zip(dist.model.get_weights(), ref_model.get_weights()):
        np.testing.assert_allclose(a, b, **TOL)
    for name, table in dist.tables.items():
        e = table.export()
        np.testing.assert_allclose(e["values"], ref_tables[name].find(e["keys"]), **TOL,
                                   err_msg=name)


def test_semi_distributed_equals_semi_on_one_rank(comm):
    world, rank = comm.size, comm.rank
    ref = kv.Trainer(build(), BCE, optimizer(), comm=Comm.local(), prefetch="semi")
    dist = kv.Trainer(build(), BCE, optimizer(), prefetch="semi")
    assert dist.engine.prefetch and dist.engine.stale_rows
    kv.broadcast_variables(dist.model.variables, root_rank=0)
    ref_losses = train(ref, 0, B)
    dist_losses = train(dist, B * rank // world, B * (rank + 1) // world)
    assert len(dist_losses) == STEPS
    np.testing.assert_allclose(dist_losses, ref_losses, **TOL)
    assert_same_model(dist, ref.model, ref.tables)
    assert dist.engine.step == STEPS and dist.engine.loop.consumed == STEPS
    # the exact pipeline, the same data: the first step equal, then close, not equal
    exact = kv.Trainer(build(), BCE, optimizer(), comm=Comm.local(), prefetch=True)
    exact_losses = train(exact, 0, B)
    assert exact_losses[0] == ref_losses[0]
    np.testing.assert_allclose(ref_losses, exact_losses, rtol=0.05)
    assert not np.allclose(ref_losses[2:], exact_losses[2:], rtol=1e-6, atol=0)
    for t in (ref, dist, exact):
        t.close()


def test_semi_fit_over_epochs_equals_one_rank(comm):
    """model.fit, a one-shot generator, 2 epochs of 4 steps: nothing is staged (or
    fetched) past an epoch's last step, the same on every world."""
    world, rank = comm.size, comm.rank
    out = []
    for c, lo, hi in ((Comm.local(), 0, B), (None, B * rank // world,
                                             B * (rank + 1) // world)):
        model = build()
        engine_of(model, comm=c, prefetch="semi")
        model.compile(optimizer=optimizer(), loss=BCE)
        if c is None:
            kv.broadcast_variables(model.variables, root_rank=0)
        hist = model.fit(batches(lo, hi, STEPS), steps_per_epoch=4, epochs=2, verbose=0)
        eng = engine_of(model)
        assert eng.stale_rows and eng.loop._staged is None and eng.step == 8
        out.append((model, eng, hist.history["loss"]))
    (ref, ref_eng, ref_loss), (model, eng, loss) = out
    np.testing.assert_allclose(loss, ref_loss, **TOL)
    for a, b in zip(model.get_weights(), ref.get_weights()):
        np.testing.assert_allclose(a, b, **TOL)
    for name, table in eng.tables.items():
        e = table.export()
        np.testing.assert_allclose(e["values"], ref_eng.tables[name].find(e["keys"]),
                                   **TOL, err_msg=name)
