"""An update that would make a row or an optimizer slot NaN/Inf, at any world size
(#29 defect 12; the one-process cases are in tests/unit/test_nonfinite_rows.py).

Huge but finite gradients (1e30: Adagrad's g^2 and Adam's second moment overflow) on
some rank's rows:
- BSP exchange: every rank refuses the step alike (the owner's prepare is its outcome,
  carried in the step's one fused allreduce: no extra collective); the owner's error
  names the table and the key; after the abandon every table on every rank is as
  before (rows, slots, counts, dirty bits; the created rows gone);
- kv.Trainer and model.fit: every rank raises the same NonFiniteError naming the table
  and the key; no row, slot, dense weight or optimizer counter changed; training goes on
  afterwards;
- SSP: the owner refuses the push whole and the error names the table, the key, the
  pushing rank and its step (here the rank's own share; a peer's push ending the job
  is tests/launch/test_nonfinite_ssp.py).
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

keras = tf.keras  # the Keras TensorFlow names: Keras 3, or Keras 2 (./dev compat)

import kvcoll as kv  # noqa: E402
from kvcoll import optimizers  # noqa: E402
from kvcoll.comm import Comm  # noqa: E402
from kvcoll.exchange import OK, Agreement, BspExchange, SspExchange  # noqa: E402
from kvcoll.keras import engine_of  # noqa: E402
from kvcoll.routing import owner_of  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

DIM, B = 4, 24


def tables():
    return {"a": kv.KvTable(DIM, name="a", seed=5, initializer=("uniform", -0.1, 0.1),
                            optimizer=optimizers.Adagrad(0.1)),
            "b": kv.KvTable(3, name="b", seed=5, initializer=("uniform", -0.1, 0.1),
                            optimizer=optimizers.Adam(0.01))}


def state(t):
    e = t.export()
    order = np.argsort(e["keys"])
    return {k: v[order] for k, v in e.items()}


def assert_same(a, b, keys=None):
    """Same rows, slots and headers (last_step aside for the rows a pull looked up)."""
    for k in ("keys", "values", "slots", "counts", "dirty"):
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    other = ~np.isin(a["keys"], keys if keys is not None else [])
    np.testing.assert_array_equal(a["last_step"][other], b["last_step"][other])


def batch(step, world, rank):
    g = np.random.default_rng([4, step])
    full = {"a": g.integers(0, 50, B * world), "b": g.integers(0, 30, B * world)}
    return {n: v[B * rank:B * (rank + 1)].astype(np.int64) for n, v in full.items()}


def step_grads(pull, bad_key=None):
    g = {n: np.full((p.uniq.size, p.rows.shape[1]), 0.01, np.float32) for n, p in pull.items()}
    if bad_key is not None and bad_key in pull["b"].uniq:
        g["b"][list(pull["b"].uniq).index(bad_key), 1] = 1e30
    return g


def test_bsp_every_rank_refuses_the_step_and_nothing_changes(comm):
    world, rank = comm.size, comm.rank
    tabs = tables()
    ex = BspExchange(comm, tabs)
    for step in range(2):  # some trained rows first
        pull = ex.pull(batch(step, world, rank))
        ex.push(pull, step_grads(pull)).commit()
    before = {n: state(t) for n, t in tabs.items()}
    ids = batch(5, world, rank)
    # the last rank's first id of table b gets a huge gradient; its owner refuses
    last = batch(5, world, world - 1)
    bad_key = int(last["b"][0])
    owner = int(owner_of(np.array([bad_key]), world)[0])
    calls0 = dict(comm.calls)
    agreement = Agreement(B)
    pull = ex.pull(ids, agreement)
    agreement.report(OK)
    pushed = ex.push(pull, step_grads(pull, bad_key if rank == world - 1 else None), None,
                     np.zeros(2, np.float32), agreement)
    pushed.reduced()
    assert agreement.outcome_failed == [owner]
    if rank == owner:
        assert isinstance(agreement.outcome_error, kv.NonFiniteError)
        assert f"table 'b': key {bad_key}: step 3:" in str(agreement.outcome_error)
    else:
        assert agreement.outcome_error is None
    ex.abandon(pushed)
    # one collective per phase: the refusal rode the step's allreduce
    calls = {k: comm.calls.get(k, 0) - calls0.get(k, 0) for k in comm.calls}
    assert {k: v for k, v in calls.items() if v} == \
        {"pull:ids": 1, "pull:rows": 1, "push:grads": 1, "allreduce:dense": 1}, calls
    for n, t in tabs.items():  # the rows any rank looked up were stamped with the step
        assert_same(state(t), before[n], np.concatenate(
            [batch(5, world, r)[n] for r in range(world)]))
    assert ex.step == 2
    # the same step without the huge gradient goes through on every rank
    pull = ex.pull(ids)
    assert pull.step == 3
    ex.push(pull, step_grads(pull)).commit()
    total = comm.allreduce(np.array([sum(len(t) for t in tabs.values())], np.int64))[0]
    assert total > 0
    for t in tabs.values():
        assert np.isfinite(t.export()["slots"]).all()
        t.close()


def build():
    keras.utils.set_random_seed(3)
    u = keras.Input(shape=(), dtype="int64", name="user")
    x = keras.Input(shape=(3,), dtype="float32", name="x")
    h = keras.layers.Concatenate()([
        kv.Embedding("user", DIM, initializer=("normal", 0.0, 0.1), seed=7)(u), x])
    return kv.Model({"user": u, "x": x}, keras.layers.Dense(1, name="out")(h))


def compiled(model):
    model.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.Adam(0.01),
                                                    sparse=kv.optimizers.Adagrad(0.2)),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def data(step, world, rank):
    g = np.random.default_rng([9, step])
    n = 8 * world
    x = {"user": g.integers(0, 40, n).astype(np.int64),
         "x": g.normal(size=(n, 3)).astype(np.float32)}
    y = (g.random(n) < 0.4).astype(np.float32)
    sl = slice(8 * rank, 8 * (rank + 1))
    return {k: v[sl] for k, v in x.items()}, y[sl]


def blow_up(model):
    """A kernel of 1e30 for the embedding's inputs: the loss and every gradient stay
    finite (about 1e28), but Adagrad's accumulator, g^2, overflows."""
    w, b = model.get_layer("out").get_weights()
    huge = w.copy()
    huge[:DIM] = 1e30
    model.get_layer("out").set_weights([huge, b])
    return [w, b]


def snapshot(model):
    eng = engine_of(model)
    return ({n: state(t) for n, t in eng.tables.items()}, model.get_weights(),
            int(model.optimizer.iterations.numpy()))


def check_unchanged(model, before, looked_up):
    tables, weights, iterations = snapshot(model)
    for n in tables:
        assert_same(tables[n], before[0][n], looked_up)
    for a, w in zip(weights, before[1]):
        np.testing.assert_array_equal(a, w)
    assert iterations == before[2]


@pytest.mark.parametrize("api", ["trainer", "fit"])
def test_trainer_and_fit_refuse_the_step_on_every_rank(comm, api):
    world, rank = comm.size, comm.rank
    model = build()
    if api == "trainer":
        tr = kv.Trainer(model, keras.losses.BinaryCrossentropy(from_logits=True),
                        kv.DistributedOptimizer(keras.optimizers.Adam(0.01),
                                                sparse=kv.optimizers.Adagrad(0.2)))

        def run(step):
            x, y = data(step, world, rank)
            return tr.train_step(x, y)
    else:
        compiled(model)

        def run(step):
            x, y = data(step, world, rank)
            return model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    kv.broadcast_variables(model.variables, root_rank=0)
    run(0)
    kept = blow_up(model)
    before = snapshot(model)
    step = engine_of(model).loop.step + 1
    with pytest.raises(kv.NonFiniteError,
                       match=rf"failed in step {step}: rank \d+: NonFiniteError: table 'user': "
                             rf"key \d+: step {step}: the update would make its row or its "
                             r"Adagrad slots NaN/Inf") as info:
        run(1)
    key = int(str(info.value).split("key ")[1].split(":")[0])
    everyone = np.concatenate([data(1, world, r)[0]["user"] for r in range(world)])
    assert key in everyone
    check_unchanged(model, before,
                    np.concatenate([data(1, world, r)[0]["user"] for r in range(world)]))
    # the kernel back, the same step trains on every rank
    model.get_layer("out").set_weights(kept)
    run(1)
    assert engine_of(model).loop.step == step
    for t in engine_of(model).tables.values():
        e = t.export()
        assert np.isfinite(e["values"]).all() and np.isfinite(e["slots"]).all()
    assert comm.allreduce(np.array([1], np.int64))[0] == world


def test_ssp_owner_refuses_a_push_and_names_the_pushing_rank_and_step(comm):
    """SSP on this rank alone (its own share is every row): the push raises, naming the
    table, the key, this rank and the step, and nothing of it was applied."""
    local = Comm.local()
    tabs = tables()
    ex = SspExchange(local, tabs, 2)
    try:
        pull = ex.pull(batch(0, 1, 0))
        ex.push(pull, step_grads(pull))
        before = {n: state(t) for n, t in tabs.items()}
        ids = batch(1, 1, 0)
        pull = ex.pull(ids)
        bad_key = int(pull["b"].uniq[2])
        with pytest.raises(kv.NonFiniteError,
                           match=rf"rank 0 refused the push of rank 0's step 2: table 'b': key "
                                 rf"{bad_key}: step 2: .*Adam slots NaN/Inf.*the run ends"):
            ex.push(pull, step_grads(pull, bad_key))
        for n, t in tabs.items():  # rows the pull created stay (the run ends), unchanged
            got = state(t)
            keep = np.isin(got["keys"], before[n]["keys"])
            assert_same({k: v[keep] for k, v in got.items()}, before[n], ids[n])
            assert (got["counts"][~keep] == 0).all()
    finally:
        ex.close()
        for t in tabs.values():
            t.close()
