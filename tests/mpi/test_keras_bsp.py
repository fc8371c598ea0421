"""BSP training through the Keras API at any world size.

Every rank also trains a reference model on a one-rank communicator over the whole
global batch; the distributed run must match it step by step.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

keras = tf.keras  # the Keras TensorFlow names: Keras 3, or Keras 2 (./dev compat)

import kvcoll as kv  # noqa: E402
from kvcoll.comm import Comm  # noqa: E402
from kvcoll.routing import owner_of  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

from toy import B, build, take  # noqa: E402
from toy import global_batch as _global_batch  # noqa: E402


def global_batch(step):
    return _global_batch(step, item_dtype=np.int32)  # int32 ids are widened


def make_trainer(comm=None):
    model = build(item_dtype="int32")
    opt = kv.DistributedOptimizer(keras.optimizers.Adam(0.02), sparse=kv.optimizers.Adagrad(0.2))
    return kv.Trainer(model, keras.losses.BinaryCrossentropy(from_logits=True), opt, comm=comm)


def split(world, rank, n=B):
    return n * rank // world, n * (rank + 1) // world


def run(trainer, steps, slice_of, stop_after=None):
    losses = []
    for step in range(steps):
        if stop_after is not None and step >= stop_after:
            trainer.finish()
            break
        b = take(global_batch(step), *slice_of)
        label = b.pop("label")
        losses.append(trainer.train_step(b, label))
    return losses


def compare_tables(dist, ref, world, rank):
    for name, table in dist.tables.items():
        e = table.export()
        assert (owner_of(e["keys"], world) == rank).all()
        np.testing.assert_allclose(e["values"], ref.tables[name].find(e["keys"]),
                                   rtol=1e-5, atol=1e-6, err_msg=name)
        r = ref.tables[name].export()
        order = np.argsort(r["keys"])
        pos = order[np.searchsorted(r["keys"][order], e["keys"])]
        np.testing.assert_allclose(e["slots"], r["slots"][pos], rtol=1e-5, atol=1e-6)
        assert (e["counts"] == r["counts"][pos]).all()
        total = int(dist.comm.allreduce(np.array([len(table)], np.int64))[0])
        assert total == len(ref.tables[name]), name


def test_bsp_equals_one_rank_step_by_step(comm):
    world, rank = comm.size, comm.rank
    ref = make_trainer(Comm.local())
    dist = make_trainer()
    kv.broadcast_variables(dist.model.variables, root_rank=0)
    before = dict(dist.comm.calls)
    steps = 8
    ref_losses = run(ref, steps, (0, B))
    dist_losses = run(dist, steps, split(world, rank))
    # once, before the first step: the ranks agree on the batch layout
    setup = {k for k in dist.comm.calls if k.startswith("engine:layout")}
    calls = {k: dist.comm.calls.get(k, 0) - before.get(k, 0) for k in dist.comm.calls
             if k not in setup}
    assert all(dist.comm.calls[k] - before.get(k, 0) == 1 for k in setup), dist.comm.calls
    np.testing.assert_allclose(dist_losses, ref_losses, rtol=1e-5)
    for a, b in zip(dist.model.get_weights(), ref.model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    compare_tables(dist, ref, world, rank)
    # 3 tables, one id all-to-all and one row all-to-all per step, one dense allreduce
    assert calls["pull:ids"] == steps and calls["pull:rows"] == steps
    assert calls["push:grads"] == steps and calls["allreduce:dense"] == steps
    # and nothing else: the step's agreement (who has data, is every batch valid)
    # rides on the id all-to-all's counts
    assert sum(calls.values()) == 4 * steps, calls
    # the unique count changes every step; the compiled step was traced once
    assert dist.engine.compute.tracing_count("train") == 1
    for t in (ref, dist):
        t.close()


def test_uneven_data_finishes_and_loses_no_update(comm):
    world, rank = comm.size, comm.rank
    steps, short = 6, 3
    dist = make_trainer()
    kv.broadcast_variables(dist.model.variables, root_rank=0)
    # rank 0 runs out after `short` steps; the others train all `steps`
    run(dist, steps, split(world, rank), stop_after=short if rank == 0 else None)
    if rank != 0:
        dist.finish()
    # reference: after step `short`, rank 0's slice is absent from the global batch
    ref = make_trainer(Comm.local())
    for step in range(steps):
        b = take(global_batch(step), 0, B)
        if step >= short:
            if world == 1:
                break
            lo0, hi0 = split(world, 0)
            b = _select(global_batch(step), np.r_[0:lo0, hi0:B])
        label = b.pop("label")
        ref.train_step(b, label)
    for a, r in zip(dist.model.get_weights(), ref.model.get_weights()):
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-6)
    compare_tables(dist, ref, world, rank)
    for t in (ref, dist):
        t.close()


def _select(batch, idx):
    out = {}
    for k, v in batch.items():
        if isinstance(v, tuple):
            vals, lens = v
            splits = np.concatenate([[0], np.cumsum(lens)])
            out[k] = (np.concatenate([vals[splits[i]:splits[i + 1]] for i in idx]),
                      np.concatenate([[0], np.cumsum(lens[idx])]))
        else:
            out[k] = v[idx]
    return out


@pytest.mark.parametrize("case", ["float ids", "batch sizes", "unknown feature", "nan loss"])
def test_bad_input_errors_on_every_rank(comm, case):
    world, rank = comm.size, comm.rank
    tr = make_trainer()
    kv.broadcast_variables(tr.model.variables, root_rank=0)
    b = take(global_batch(0), *split(world, rank))
    label = b.pop("label")
    tr.train_step(b, label)
    before = {n: t.export() for n, t in tr.tables.items()}
    weights = tr.model.get_weights()
    # the bad rank: the last with samples (every rank works it out alike, so no rank
    # skips a collective test alone)
    bad_rank = max(r for r in range(world) if split(world, r)[1] > split(world, r)[0])
    if rank == bad_rank:
        if case == "float ids":
            b["user"] = b["user"].astype(np.float32)
        elif case == "batch sizes":
            b["x"] = b["x"][:-1] if len(b["x"]) else np.zeros((1, 3), np.float32)
        elif case == "unknown feature":
            b["colour"] = b["user"]
        elif case == "nan loss":
            b["x"] = np.full_like(b["x"], np.nan) if len(b["x"]) else b["x"]
    expected = kv.NonFiniteError if case == "nan loss" else kv.InvalidArgumentError
    match = {"float ids": "could not use their batch.*int64 or int32",
             "batch sizes": "could not use their batch.*different batch sizes",
             "unknown feature": "could not use their batch.*unknown \\['colour'\\]",
             "nan loss": rf"NaN/Inf on rank\(s\) \[{bad_rank}\]"}[case]
    with pytest.raises(expected, match=match):
        tr.train_step(b, label)
    for n, t in tr.tables.items():
        after = t.export()
        np.testing.assert_array_equal(np.sort(after["keys"]), np.sort(before[n]["keys"]))
        common = np.intersect1d(before[n]["keys"], after["keys"])
        np.testing.assert_array_equal(t.find(common), _rows_of(before[n], common))
    for a, w in zip(tr.model.get_weights(), weights):
        np.testing.assert_array_equal(a, w)
    tr.close()


def _rows_of(export, keys):
    order = np.argsort(export["keys"])
    return export["values"][order][np.searchsorted(export["keys"][order], keys)]
