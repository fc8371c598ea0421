"""Checkpointer.refill: the survivors of a lost rank take its buckets back from the
checkpoint chain, and nothing else changes (ranks are threads: tests/unit/threadcomm.py).

- A chain written on 3 ranks (full, deltas with removals), then two more steps that are
  not saved; rank 1 is lost. The survivors replan onto OwnerMap.even(3).without([1])
  and refill the buckets they took: every row of those buckets equals the chain's, bit
  for bit (removals included), every other row is the survivor's own (the unsaved steps
  kept), and only the lost rank's files were read, a fraction of a full restore.
- The refilled rows are clean: the survivors' next delta (in a chain that now mixes a
  3-rank and a 2-rank map) holds only what they changed, and the chain restores on any
  world size to exactly the survivors' state.
- Bad input (a mask of the wrong size, a bucket out of range) and a corrupt chain raise
  before anything changed, on every rank.
"""

import sys
from pathlib import Path

import numpy as np
import pytest

from kvcoll.checkpoint import Checkpointer, check_shared, read_shard
from kvcoll.errors import CheckpointError, InvalidArgumentError
from kvcoll.routing import OwnerMap, bucket_of

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "mpi"))
from ckpt_tables import close, dump, make_tables, merge, play, same  # noqa: E402
from threadcomm import run_ranks  # noqa: E402

THREE = OwnerMap.even(3)
TWO = THREE.without([1])      # rank 1 lost: ranks 0 and 2 become 0 and 1


def in_buckets(state: dict, mask: np.ndarray) -> dict:
    """The rows of `state` whose keys' buckets are in `mask`."""
    out = {}
    for name, cols in state.items():
        keep = mask[bucket_of(cols["keys"])]
        out[name] = {k: v[keep] for k, v in cols.items()}
    return out


def reference(steps):
    tables = make_tables()
    for step in range(1, steps + 1):
        play(tables, 1, 0, step)
    out = dump(tables)
    close(tables)
    return out


@pytest.fixture
def survivors(tmp_path):
    """3 ranks: a full save at 2, deltas at 3 and 4 (step 3 removes keys), steps 5 and 6
    not saved. Returns (directory, the tables of ranks 0 and 2, their checkpointers,
    the bytes a full restore on 2 ranks reads)."""
    d = tmp_path / "ck"

    def rank_main(comm):
        tables = make_tables()
        c = Checkpointer(tables, comm, owners=THREE)
        for step in range(1, 7):
            play(tables, 3, comm.rank, step)
            if 2 <= step <= 4:
                c.save(d, step, incremental=step > 2)
        return tables, c
    ranks = run_ranks(3, rank_main)
    close(ranks[1][0])

    def full(comm):
        t = make_tables()
        n = Checkpointer(t, comm, owners=TWO).restore(d).bytes
        close(t)
        return n
    yield d, [ranks[0][0], ranks[2][0]], [ranks[0][1], ranks[2][1]], max(run_ranks(2, full))
    for t, _ in (ranks[0], ranks[2]):
        close(t)


def test_survivors_refill_the_lost_buckets_from_the_chain(survivors):
    d, tables, cks, full_bytes = survivors
    taken = [(TWO.array == r) & (THREE.array == 1) for r in range(2)]

    def rank_main(comm):
        c = cks[comm.rank]
        c.replan(comm, TWO)
        info = c.refill(d, taken[comm.rank])
        return info, dump(tables[comm.rank])
    out = run_ranks(2, rank_main)
    state = merge([s for _, s in out])
    lost = THREE.array == 1
    # the lost rank's buckets: the chain (step 4), removals included; the others: step 6
    same(in_buckets(state, lost), in_buckets(reference(4), lost))
    same(in_buckets(state, ~lost), in_buckets(reference(6), ~lost))
    infos = [i for i, _ in out]
    assert all(i.name == "ckpt-0000000004" and i.step == 4 for i in infos)
    assert sum(i.rows for i in infos) == sum(len(v["keys"]) for v in
                                             in_buckets(reference(4), lost).values())
    # only the lost rank's files (a third of the rows) were read
    assert all(0 < i.bytes < 0.6 * full_bytes for i in infos), \
        ([i.bytes for i in infos], full_bytes)
    # every row of a survivor is one it owns under the new map
    for r in range(2):
        for name, cols in dump(tables[r]).items():
            assert (TWO.owner_of(cols["keys"]) == r).all(), name


def test_the_chain_goes_on_under_the_new_map(survivors):
    d, tables, cks, _ = survivors
    taken = [(TWO.array == r) & (THREE.array == 1) for r in range(2)]

    def rank_main(comm):
        c = cks[comm.rank]       # its chain goes on: the next delta's parent is ckpt-4
        assert c.parent == "ckpt-0000000004"
        c.replan(comm, TWO)
        c.refill(d, taken[comm.rank])
        for t in tables[comm.rank].values():   # step 7 on the 2 survivors, own rows only
            e = t.export()
            own = e["keys"][THREE.array[bucket_of(e["keys"])] != 1][:5]
            g = np.random.default_rng([7, t.dim])
            t.apply_gradients(own, g.normal(size=(5, t.dim)).astype(np.float32), step=7)
        info = c.save(d, 7, incremental=True)
        return info, dump(tables[comm.rank])
    out = run_ranks(2, rank_main)
    assert out[0][0].kind == "delta"
    state = merge([s for _, s in out])
    # the delta holds the survivors' changes since step 4, and no refilled row
    for f in (d / "ckpt-0000000007").glob("*.kvs"):
        keys = read_shard(str(f))["keys"]
        assert keys.size and not (THREE.array[bucket_of(keys)] == 1).any(), f.name
    for world, owners in ((1, None), (2, None), (3, None), (2, TWO)):
        def restore(comm, owners=owners):
            t = make_tables()
            Checkpointer(t, comm, owners=owners).restore(d)
            s = dump(t)
            close(t)
            return s
        same(merge(run_ranks(world, restore)), state)


def test_bad_input_and_a_corrupt_chain_change_nothing(survivors):
    d, tables, _, _ = survivors
    before = [dump(t) for t in tables]

    def call(mask):
        def rank_main(comm):
            c = Checkpointer(tables[comm.rank], comm, owners=TWO)
            c.refill(d, mask)
        run_ranks(2, rank_main)

    with pytest.raises(InvalidArgumentError, match="must have the map's 65536 entries"):
        call(np.zeros(10, bool))
    with pytest.raises(InvalidArgumentError, match=r"buckets must be in \[0, 65536\)"):
        call(np.array([5, 70_000]))
    page = next((d / "ckpt-0000000003").glob("000-a.r1-of-3.kvs"))
    data = bytearray(page.read_bytes())
    data[100] ^= 0xFF
    page.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="nothing was refilled"):
        call(THREE.array == 1)
    for t, b in zip(tables, before):
        same(dump(t), b)


def test_a_directory_not_every_rank_sees_is_refused_at_the_start(tmp_path):
    """check_shared: rank 0 writes a token, every rank reads it back; ranks that see
    another directory at that path (here: one of their own, as on a host whose path is a
    local disk) are named on every rank, with the fix."""
    shared = tmp_path / "shared"
    run_ranks(3, lambda comm: check_shared(shared, comm))          # all see it: fine
    with pytest.raises(CheckpointError, match=r"rank\(s\) \[1, 2\] do not see the "
                       r"checkpoint directory .* file system every host mounts"):
        run_ranks(3, lambda comm: check_shared(
            shared if comm.rank == 0 else tmp_path / f"local-{comm.rank}", comm))
