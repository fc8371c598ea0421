"""Table checkpoints at any world size (kvcoll.checkpoint.Checkpointer, no TensorFlow).

Every rank builds the whole table state from one seed, keeps its own keys, saves a
full checkpoint and a delta; the checkpoint then restores on the same ranks (each
reading its own files only) and, on every rank, into one-rank tables holding every key
(another world size), and under an owner map that is not the even split (each rank
holding exactly the keys it gives it); a file corrupted on one rank makes every rank
raise the same error with nothing changed.
"""

import os

import numpy as np

import pytest
from ckpt_tables import dump, make_tables, play, same

import kvcoll as kv
from kvcoll.checkpoint import Checkpointer
from kvcoll.comm import Comm
from kvcoll.routing import BUCKETS, OwnerMap, owner_of


def test_full_and_delta_restore_on_same_and_one_rank(comm, shared_dir):
    world, rank = comm.size, comm.rank
    tables = make_tables()
    ck = Checkpointer(tables, comm)
    for step in (1, 2):
        play(tables, world, rank, step)
    assert ck.save(shared_dir, 2).kind == "full"
    play(tables, world, rank, 3)
    info = ck.save(shared_dir, 3, incremental=True)
    assert info.kind == "delta"
    ref = dump(tables)

    fresh = make_tables()
    r = Checkpointer(fresh, comm).restore(shared_dir)
    assert r.step == 3 and r.chain == ("ckpt-0000000002", "ckpt-0000000003")
    same(dump(fresh), ref)
    # on the world that wrote it, a rank reads its own files and nothing else
    own = sum(os.path.getsize(os.path.join(shared_dir, c, f)) for c in r.chain
              for f in os.listdir(os.path.join(shared_dir, c))
              if f.endswith(f".r{rank}-of-{world}.kvs"))
    assert r.bytes == own

    # every rank alone: a one-rank world holding every key
    local = make_tables()
    Checkpointer(local, Comm.local()).restore(shared_dir)
    everything = make_tables()
    for step in (1, 2, 3):
        play(everything, 1, 0, step)
    same(dump(local), dump(everything))
    for ts in (tables, fresh, local, everything):
        for t in ts.values():
            t.close()


def test_restore_under_a_map_that_is_not_the_even_split(comm, shared_dir):
    world, rank = comm.size, comm.rank
    tables = make_tables()
    ck = Checkpointer(tables, comm)
    for step in (1, 2, 3):
        play(tables, world, rank, step)
        ck.save(shared_dir, step, incremental=step > 1)  # full, then deltas
    owners = OwnerMap(np.random.default_rng(5).integers(0, world, BUCKETS), world)
    fresh = make_tables()
    r = Checkpointer(fresh, comm, owners=owners).restore(shared_dir)
    assert r.step == 3
    everything = make_tables()
    for step in (1, 2, 3):
        play(everything, 1, 0, step)
    want = dump(everything)
    got = dump(fresh)
    for name, cols in want.items():
        keep = owner_of(cols["keys"], owners) == rank
        same({name: got[name]}, {name: {k: v[keep] for k, v in cols.items()}})
    # the next save records this map; a restore on the even map reads it back
    Checkpointer(fresh, comm, owners=owners).save(shared_dir, 4)
    again = make_tables()
    Checkpointer(again, comm).restore(shared_dir)
    for name, cols in dump(again).items():
        assert (owner_of(cols["keys"], world) == rank).all()
        keep = owner_of(want[name]["keys"], world) == rank
        same({name: cols}, {name: {k: v[keep] for k, v in want[name].items()}})
    for ts in (tables, fresh, everything, again):
        for t in ts.values():
            t.close()


def test_corrupt_file_on_one_rank_fails_everywhere(comm, shared_dir):
    world, rank = comm.size, comm.rank
    tables = make_tables()
    play(tables, world, rank, 1)
    Checkpointer(tables, comm).save(shared_dir, 1)
    comm.barrier()
    bad = world - 1
    if rank == bad:
        ckdir = os.path.join(shared_dir, "ckpt-0000000001")
        path = os.path.join(ckdir, next(f for f in sorted(os.listdir(ckdir))
                                        if f.endswith(f".r{bad}-of-{world}.kvs")))
        data = bytearray(open(path, "rb").read())
        data[-1] ^= 1
        open(path, "wb").write(bytes(data))
    comm.barrier()
    other = make_tables()
    play(other, world, rank, 7)
    before = dump(other)
    with pytest.raises(kv.CheckpointError, match=rf"rank {bad}: .*fails its sha256 check"):
        Checkpointer(other, comm).restore(shared_dir)
    same(dump(other), before)
    for ts in (tables, other):
        for t in ts.values():
            t.close()


def _admitting(admit):
    return {"a": kv.KvTable(3, name="a", admit_min_count=3, admit=admit,
                            optimizer=kv.optimizers.SGD(0.5))}


def _sightings(tables, world, rank, step):
    """Step `step`'s lookups (and updates) of this rank's keys: many keys are seen once
    or twice, so they wait for admission across the save."""
    g = np.random.default_rng([9, step])
    ids = np.unique(g.integers(0, 400, 150))
    ids = ids[owner_of(ids, world) == rank]
    t = tables["a"]
    t.find_or_create(ids, step=step)
    t.apply_gradients(ids, np.ones((ids.size, 3), np.float32), step=step)


@pytest.mark.parametrize("admit", ["exact", "bloom"])
def test_admission_state_survives_a_restore(comm, shared_dir, admit):
    """A run resumed from a checkpoint (full + delta) admits exactly as the uninterrupted
    run: the pending counts (or the Bloom filter) are in every checkpoint. On another
    world size the counts move with their keys (the filters are merged: never later)."""
    world, rank = comm.size, comm.rank
    run = _admitting(admit)
    ck = Checkpointer(run, comm)
    for step in (1, 2):
        _sightings(run, world, rank, step)
    ck.save(shared_dir, 2)
    _sightings(run, world, rank, 3)
    ck.save(shared_dir, 3, incremental=True)
    v1 = os.path.join(shared_dir, "v1")  # format 1 keeps no admission state
    Checkpointer(run, comm, version=1).save(v1, 3)
    resumed, forgetful = _admitting(admit), _admitting(admit)
    Checkpointer(resumed, comm).restore(shared_dir)
    Checkpointer(forgetful, comm).restore(v1)
    for step in (4, 5):
        for ts in (run, resumed, forgetful):
            _sightings(ts, world, rank, step)
    same(dump(resumed), dump(run))
    # without the state a resumed run admits later: the check above can fail
    got = comm.allreduce(np.array([len(forgetful["a"]), len(run["a"])], np.int64))
    assert got[0] < got[1], got
    # another world size: every rank alone holds every key; the exact counts move with
    # their keys, so the one-rank run admits as the whole run did
    local = _admitting(admit)
    Checkpointer(local, Comm.local()).restore(shared_dir)
    everything = _admitting(admit)
    for step in (1, 2, 3):
        _sightings(everything, 1, 0, step)
    for step in (4, 5):
        for ts in (local, everything):
            _sightings(ts, 1, 0, step)
    if admit == "exact":
        same(dump(local), dump(everything))
    else:  # merged filters: never later than the whole run
        assert set(dump(everything)["a"]["keys"]) <= set(dump(local)["a"]["keys"])
    for ts in (run, resumed, forgetful, local, everything):
        for t in ts.values():
            t.close()
