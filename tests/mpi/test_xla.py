"""The dense step under XLA (kv.Trainer(xla=True), --xla on) at any world size: XLA runs
compare with XLA runs (XLA may fuse and approximate beyond float order): the distributed
run equals a one-rank XLA run of the whole global batch step by step, pipelined, with
single- and multi-hot features whose unique counts and widths change every step; the
padded shapes keep the compiled step to one trace and a few compilations.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

keras = tf.keras

import kvcoll as kv  # noqa: E402
from kvcoll.comm import Comm  # noqa: E402
from kvcoll.keras.compute import bucket  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

from toy import B, build, train_all  # noqa: E402

STEPS = 8


def trainer(comm=None, xla=True, prefetch=True):
    opt = kv.DistributedOptimizer(keras.optimizers.Adam(0.02), sparse=kv.optimizers.Adagrad(0.2))
    return kv.Trainer(build(), keras.losses.BinaryCrossentropy(from_logits=True), opt,
                      comm=comm, xla=xla, prefetch=prefetch)


def train(t, lo, hi):
    return train_all(t, lo, hi, STEPS)


def test_xla_distributed_equals_xla_on_one_rank(comm):
    world, rank = comm.size, comm.rank
    ref = trainer(Comm.local())
    dist = trainer()
    kv.broadcast_variables(dist.model.variables, root_rank=0)
    ref_losses = train(ref, 0, B)
    dist_losses = train(dist, B * rank // world, B * (rank + 1) // world)
    assert len(dist_losses) == STEPS
    np.testing.assert_allclose(dist_losses, ref_losses, rtol=1e-5)
    for a, b in zip(dist.model.get_weights(), ref.model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for name, table in dist.tables.items():
        e = table.export()
        np.testing.assert_allclose(e["values"], ref.tables[name].find(e["keys"]),
                                   rtol=1e-5, atol=1e-6, err_msg=name)
    compute = dist.engine.compute
    assert compute.xla and compute.tracing_count("train") == 1
    for t in (ref, dist):
        t.close()


def test_xla_moves_the_loss_little_from_the_plain_step(comm):
    """Not equal (XLA fuses): close. The demo's figure is in docs/performance.md."""
    if comm.size > 1:
        return
    plain, xla = trainer(Comm.local(), xla=False), trainer(Comm.local())
    a, b = train(plain, 0, B), train(xla, 0, B)
    np.testing.assert_allclose(b, a, rtol=1e-3)
    for t in (plain, xla):
        t.close()


def test_buckets():
    sizes = set()
    for n in range(1, 5000):
        b = bucket(n)
        assert n <= b <= max(16, n * 1.25), (n, b)
        sizes.add(b)
    # four sizes an octave
    assert len([s for s in sizes if 1024 < s <= 2048]) == 4
