"""Room reserved ahead (KvTable.reserve, TableSet.reserve, BspExchange.reserve_for): the
pipeline's helper thread makes room in the tables for the rows the next step's fetch
creates, while the step before computes. A reserve is invisible but for capacity: a
table reserved ahead holds exactly what one that was not holds, and a pipelined fit's
tables equal an unpipelined fit's. The C side (kv_table_reserve: refs, generation,
change tracking, out-of-memory, pre-faulting) is tested in csrc/tests/test_table.c."""

import os
import threading

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import kvcoll as kv  # noqa: E402
from kvcoll import errors  # noqa: E402
from kvcoll.comm import Comm  # noqa: E402
from kvcoll.exchange.bsp import BspExchange  # noqa: E402
from kvcoll.exchange.kernels import TableSet  # noqa: E402


def table(name="t", dim=8, **kw):
    return kv.KvTable(dim, name=name, seed=3, initializer=("uniform", -0.1, 0.1),
                      optimizer=kv.optimizers.Adagrad(0.1), **kw)


def export(t):
    e = t.export()
    order = np.argsort(e["keys"])
    return {k: v[order] for k, v in e.items()}


def assert_same_rows(a, b):
    ea, eb = export(a), export(b)
    assert ea.keys() == eb.keys()
    for k in ea:
        np.testing.assert_array_equal(ea[k], eb[k], err_msg=k)


def test_reserve_makes_room_and_changes_no_row():
    g = np.random.default_rng(0)
    base, new = g.integers(-2**62, 2**62, 20_000), g.integers(-2**62, 2**62, 60_000)
    with table() as a, table() as b:
        for t in (a, b):
            t.find_or_create(base, step=1)
            t.apply_gradients(base[:5000], np.full((5000, 8), 0.01, np.float32), step=1)
            t.delete(base[:100])
        before = a.stats()
        a.reserve(0)
        assert a.stats() == before
        a.reserve(new.size)
        after = a.stats()
        assert_same_rows(a, b)
        counts = ("rows", "admitted", "rejected", "dropped_grads", "evicted", "pending")
        assert [getattr(after, c) for c in counts] == [getattr(before, c) for c in counts]
        assert after.row_capacity >= after.rows + new.size > before.row_capacity
        assert after.rows + new.size <= 0.85 * after.index_slots
        assert after.bytes > before.bytes
        # the rows it made room for: created without growing the arena or the index
        ra, rb = a.find_or_create(new, step=2), b.find_or_create(new, step=2)
        np.testing.assert_array_equal(ra, rb)
        grown = a.stats()
        assert (grown.row_capacity, grown.index_slots) == (after.row_capacity,
                                                           after.index_slots)
        assert_same_rows(a, b)


@pytest.mark.parametrize("bad", [-1, True, 1.5, "3", 2**63, None])
def test_reserve_rejects_what_is_not_a_row_count(bad):
    with table("clicks") as t:
        t.find_or_create(np.arange(10))
        before = t.stats()
        with pytest.raises(errors.InvalidArgumentError,
                           match=r"table 'clicks': reserve needs a row count >= 0"):
            t.reserve(bad)
        assert t.stats() == before


def test_reserve_beyond_the_shard_is_a_full_table_and_changes_nothing():
    with table("clicks") as t:
        t.find_or_create(np.arange(10))
        before = t.stats()
        with pytest.raises(errors.TableFullError, match=r"table 'clicks': reserve room for"):
            t.reserve(2**40)
        assert t.stats() == before
    with pytest.raises(errors.ClosedError, match="closed"):
        t.reserve(1)


def test_table_set_reserves_per_table_the_ids_received_for_it(monkeypatch):
    a, b, c = table("a"), table("b", dim=3), table("c")
    try:
        tset = TableSet([a, b, c])
        counts = np.array([[5000, 0, 7], [3000, 0, 9]], np.int64)  # (world, tables)
        before = [t.stats() for t in (a, b, c)]
        tset.reserve(counts)
        after = [t.stats() for t in (a, b, c)]
        assert after[0].row_capacity >= 8000
        assert after[1] == before[1]                       # no id: nothing reserved
        assert after[2].row_capacity >= 16
        # a reservation that fails is skipped: the serve makes its own room as ever
        monkeypatch.setattr(type(a), "reserve",
                            lambda self, n: (_ for _ in ()).throw(errors.CapacityError("no")))
        tset.reserve(counts * 10)
    finally:
        for t in (a, b, c):
            t.close()


def test_reserve_for_only_a_training_pull_that_proceeds():
    with table("a") as a:
        ex = BspExchange(Comm.local(), {"a": a})
        ids = {"a": np.arange(50_000, dtype=np.int64)}
        before = a.stats()
        look = ex.send_ids(ids, create=False)          # an evaluation's lookup
        ex.receive_ids(look)
        ex.reserve_for(look)
        assert a.stats() == before
        ex.fetch(look)
        pending = ex.send_ids(ids)
        ex.reserve_for(pending)                          # its ids are not in yet
        assert a.stats() == before
        assert ex.receive_ids(pending)
        ex.reserve_for(pending)
        assert a.stats().row_capacity >= 50_000
        pull = ex.fetch(pending)
        assert len(a) == 50_000 and pull is not None


# -- a pipelined fit -----------------------------------------------------------------------

DIM, B, STEPS = 4, 64, 8


def fit_data():
    """Ids from a huge vocabulary: nearly every id of every step is new (rows created)."""
    g = np.random.default_rng(11)
    n = B * STEPS
    x = {"user": g.integers(0, 2**40, n).astype(np.int64),
         "item": g.integers(0, 5000, n).astype(np.int64),
         "x": g.normal(size=(n, 2)).astype(np.float32)}
    return x, (g.random(n) < 0.4).astype(np.float32)


def fit_model(prefetch):
    import tensorflow as tf

    from kvcoll.keras import engine_of

    keras = tf.keras
    keras.utils.set_random_seed(5)
    u = keras.Input(shape=(), dtype="int64", name="user")
    i = keras.Input(shape=(), dtype="int64", name="item")
    x = keras.Input(shape=(2,), dtype="float32", name="x")
    emb = [kv.Embedding(n, DIM, initializer=("normal", 0.0, 0.1))(t)
           for n, t in (("user", u), ("item", i))]
    h = keras.layers.Dense(5, activation="tanh")(keras.layers.Concatenate()([*emb, x]))
    model = kv.Model({"user": u, "item": i, "x": x}, keras.layers.Dense(1)(h))
    engine_of(model, comm=Comm.local(), prefetch=prefetch)
    model.compile(optimizer=kv.DistributedOptimizer(keras.optimizers.Adam(0.01),
                                                    sparse=kv.optimizers.Adagrad(0.1)),
                  loss=keras.losses.BinaryCrossentropy(from_logits=True))
    return model


def test_a_pipelined_fit_reserves_ahead_and_its_tables_equal_an_unpipelined_fits(
        monkeypatch):
    """model.fit over steps that create rows, with the pipeline on and off: the same
    keys, rows and slots (bit for bit) and dense weights. With the pipeline the helper
    thread reserved room for every step after the first, so no fetch of those steps
    grew a table; without it the fetches grow the tables as they go."""
    from kvcoll.keras import engine_of

    real_serve, real_reserve = TableSet.serve, BspExchange.reserve_for
    log = {"serve": [], "reserve": []}

    def capacity(tset):
        return [(t.stats().row_capacity, t.stats().index_slots) for t in tset.tables]

    def serve(self, recv_ids, recv_counts, step, create, reply):
        before = capacity(self)
        out = real_serve(self, recv_ids, recv_counts, step, create, reply)
        log["serve"].append((step, capacity(self) != before))
        return out

    def reserve_for(self, pending):
        real_reserve(self, pending)
        log["reserve"].append((pending.step, threading.current_thread().name))

    monkeypatch.setattr(TableSet, "serve", serve)
    monkeypatch.setattr(BspExchange, "reserve_for", reserve_for)
    x, y = fit_data()
    runs = {}
    for prefetch in (False, True):
        log["serve"], log["reserve"] = [], []
        model = fit_model(prefetch)
        model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
        runs[prefetch] = (model, list(log["serve"]), list(log["reserve"]))
    (plain, plain_serves, plain_reserves) = runs[False]
    (piped, piped_serves, piped_reserves) = runs[True]
    assert plain_reserves == []
    assert any(grew for _, grew in plain_serves[1:]), plain_serves
    assert piped_reserves == [(s, "kvcoll-prefetch") for s in range(2, STEPS + 1)]
    assert [s for s, _ in piped_serves] == list(range(1, STEPS + 1))
    assert not any(grew for _, grew in piped_serves[1:]), piped_serves
    for a, b in zip(plain.get_weights(), piped.get_weights()):
        np.testing.assert_array_equal(a, b)
    ta, tb = engine_of(plain).tables, engine_of(piped).tables
    assert sorted(ta) == sorted(tb) == ["item", "user"]
    for name in ta:
        assert len(ta[name]) > (B * STEPS * 0.99 if name == "user" else 400)
        assert_same_rows(ta[name], tb[name])
