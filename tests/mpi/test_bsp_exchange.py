"""BSP pull/push at any world size equals one table on one rank, with ids routed by the
even owner map or by one that is not (each rank then holds exactly the keys that map
gives it)."""

import numpy as np
import pytest

from kvcoll import KvTable, optimizers
from kvcoll.exchange import BspExchange
from kvcoll.routing import BUCKETS, OwnerMap, owner_of

DIMS = {"a": 4, "b": 3, "c": 1}


def make_tables():
    return {n: KvTable(d, name=n, seed=7, initializer=("uniform", -0.1, 0.1),
                       optimizer=optimizers.SGD(0.5)) for n, d in DIMS.items()}


def batch(step, size=97):
    rng = np.random.default_rng([3, step])
    return {n: rng.integers(0, 60, size).astype(np.int64) for n in DIMS}


def grad_of(rows, uniq, inverse):
    """Loss = sum over batch positions of sum(row * w(id)) / 2 + 0.5 * |row|^2."""
    mult = np.bincount(inverse, minlength=uniq.size)[:, None]
    w = ((uniq[:, None] % 5) - 2).astype(np.float32)
    return (mult * (w / 2 + rows)).astype(np.float32)


def my_slice(n, world, rank, uneven):
    if uneven:  # rank 0 gets nothing; the others split the batch
        if rank == 0 and world > 1:
            return 0, 0
        parts = world - 1 if world > 1 else 1
        r = rank - 1 if world > 1 else 0
        return n * r // parts, n * (r + 1) // parts
    return n * rank // world, n * (rank + 1) // world


@pytest.mark.parametrize("owners", ["even", "random"])
@pytest.mark.parametrize("uneven", [False, True])
def test_sharded_equals_single_table(comm, uneven, owners):
    world, me = comm.size, comm.rank
    dist = make_tables()
    ref = make_tables()
    # "random": every bucket to a rank drawn from one seed, the same on every rank
    owners = OwnerMap.even(world) if owners == "even" else \
        OwnerMap(np.random.default_rng(11).integers(0, world, BUCKETS), world)
    ex = BspExchange(comm, dist, owners=None if owners == OwnerMap.even(world) else owners)
    assert ex.owners == owners
    before = dict(comm.calls)
    steps = 6
    for step in range(1, steps + 1):
        full = batch(step)
        lo, hi = my_slice(97, world, me, uneven)
        pulled = ex.pull({n: ids[lo:hi] for n, ids in full.items()})
        assert pulled.step == ex.step == step
        for n, p in pulled.items():  # rows match the reference before this step
            expect = ref[n].find_or_create(p.uniq, step=step)
            np.testing.assert_allclose(p.rows, expect, rtol=1e-5, atol=1e-6)
        ex.push(pulled, {n: grad_of(p.rows, p.uniq, p.inverse) for n, p in pulled.items()}
                ).commit()
        # Reference: one table sees the global batch; each rank's gradient (computed
        # from its own slice) is summed per id and applied once.
        for n, ids in full.items():
            u = np.unique(ids)
            rows = ref[n].find_or_create(u, step=step)
            g = np.zeros_like(rows)
            for r in range(world):
                a, b = my_slice(97, world, r, uneven)
                ur, invr = np.unique(ids[a:b], return_inverse=True)
                pos = np.searchsorted(u, ur)
                g[pos] += grad_of(rows[pos], ur, invr)
            ref[n].apply_gradients(u, g, step=step)
    calls = {k: comm.calls.get(k, 0) - before.get(k, 0) for k in comm.calls}
    assert calls["pull:ids"] == steps and calls["pull:rows"] == steps
    assert calls["push:grads"] == steps
    for n, t in dist.items():
        e = t.export()
        assert (owner_of(e["keys"], owners) == me).all()
        np.testing.assert_allclose(e["values"], ref[n].find(e["keys"]), rtol=1e-5, atol=1e-6)
        total = int(comm.allreduce(np.array([len(t)], np.int64))[0])
        assert total == len(ref[n])
    for t in list(dist.values()) + list(ref.values()):
        t.close()
