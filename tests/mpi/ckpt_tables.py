"""Tables for the checkpoint tests that need no TensorFlow (tests/mpi/test_checkpoint.py,
tests/unit/test_checkpoint_streaming.py): three tables with
three row optimizers, the global updates (and removals) of a step restricted to a
rank's keys, and a set of tables' every row as sorted arrays to compare.

Not a test module: the tests import it.
"""

import numpy as np

import kvcoll as kv
from kvcoll.routing import owner_of

KEYS = 3000


def make_tables(dims=(4, 3, 2)):
    return {"a": kv.KvTable(dims[0], name="a", seed=1, initializer=("normal", 0, 0.1),
                            optimizer=kv.optimizers.Adagrad(0.1)),
            "b": kv.KvTable(dims[1], name="b", optimizer=kv.optimizers.Adam(0.01)),
            "c": kv.KvTable(dims[2], name="c", optimizer=kv.optimizers.SGD(0.5))}


def play(tables, world, rank, step, keys=KEYS):
    """Global updates of `step` (and, at odd steps after the first, removals),
    restricted to this rank's keys."""
    g = np.random.default_rng([5, step])
    for t in tables.values():
        ids = np.unique(g.integers(0, keys, keys // 4))
        grads = g.normal(size=(ids.size, t.dim)).astype(np.float32)
        mine = owner_of(ids, world) == rank
        t.apply_gradients(ids[mine], grads[mine], step=step, create_missing=True)
        if step > 1 and step % 2:
            gone = np.unique(g.integers(0, keys, keys // 10))
            t.delete(gone[owner_of(gone, world) == rank])


def dump(tables):
    """Every row of each table (keys, values, slots, headers), sorted by key."""
    out = {}
    for name, t in tables.items():
        e = t.export()
        order = np.argsort(e["keys"])
        out[name] = {k: e[k][order] for k in ("keys", "values", "slots", "last_step", "counts")}
    return out


def merge(dumps):
    """The dumps of several ranks' tables as one (sorted by key)."""
    out = {}
    for name in dumps[0]:
        cols = {k: np.concatenate([d[name][k] for d in dumps]) for k in dumps[0][name]}
        order = np.argsort(cols["keys"])
        out[name] = {k: v[order] for k, v in cols.items()}
    return out


def same(a, b):
    assert sorted(a) == sorted(b)
    for name in a:
        for k in a[name]:
            np.testing.assert_array_equal(a[name][k], b[name][k], err_msg=f"{name}/{k}")


def close(tables):
    for t in tables.values():
        t.close()
