"""Table checkpoints at any world size (kvcoll.checkpoint.Checkpointer, no TensorFlow).

Every rank builds the whole table state from one seed, keeps its own keys, saves a
full checkpoint and a delta; the checkpoint then restores on the same ranks (each
reading its own files only) and, on every rank, into one-rank tables holding every key
(another world size); a file corrupted on one rank makes every rank raise the same
error with nothing changed.
"""

import os

import pytest
from ckpt_tables import dump, make_tables, play, same

import kvcoll as kv
from kvcoll.checkpoint import Checkpointer
from kvcoll.comm import Comm


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
