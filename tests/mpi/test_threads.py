"""Threaded C table work at any world size: the same bits with one thread or many.

Every rank runs the same BSP steps twice over fresh tables, with 1 and then 3 C threads
(kvcoll.exchange.kernels.set_threads): the rows each pull returns and every shard
(values, slots, headers, stats) must be byte-identical. With several ranks an owner
serves ids from several sources (deduplicated per table, summed in payload order),
which one-rank runs do not reach (tests/unit/test_threads.py).
"""

import numpy as np

import kvcoll as kv
from kvcoll.exchange import BspExchange
from kvcoll.exchange.kernels import set_threads


def make_tables():
    return {"a": kv.KvTable(8, name="a", seed=2, initializer=("normal", 0.0, 0.1),
                            optimizer=kv.optimizers.Adagrad(0.2)),
            "b": kv.KvTable(4, name="b", seed=2, initializer=("uniform", -0.1, 0.1),
                            optimizer=kv.optimizers.Adam(0.01))}


def run(comm, threads, steps=3, n=9000):
    set_threads(threads)
    tables = make_tables()
    ex = BspExchange(comm, tables)
    pulled = []
    for step in range(steps):
        g = np.random.default_rng([5, step, comm.rank])
        pull = ex.pull({"a": g.integers(0, 20_000, n), "b": g.zipf(1.2, n) % 3000})
        pulled.append({k: v.copy() for k, v in pull.rows.items()})
        grads = {k: np.cos(np.arange(v.size, dtype=np.float32) + step).astype(np.float32)
                 .reshape(v.shape) * 0.01 for k, v in pull.rows.items()}
        ex.push(pull, grads).commit()
    out = {name: (t.export(), t.stats()) for name, t in tables.items()}
    for t in tables.values():
        t.close()
    return pulled, out


def test_one_thread_or_three_the_same_bits(comm):
    try:
        one = run(comm, 1)
        three = run(comm, 3)
    finally:
        set_threads(None)
    for a, b in zip(one[0], three[0]):
        for k in a:
            assert a[k].tobytes() == b[k].tobytes(), k
    for name, (export, stats) in three[1].items():
        ref, ref_stats = one[1][name]
        assert stats == ref_stats, name
        for col in ref:
            assert export[col].tobytes() == ref[col].tobytes(), (name, col)
