"""Collectives at any world size: every rank derives all inputs from one seed."""

import numpy as np
import pytest

from kvcoll.errors import CommError, CommTimeoutError


def sends(world, seed=0):
    """send[s][d] = the rows rank s sends to rank d (some empty)."""
    rng = np.random.default_rng(seed)
    return [[rng.integers(0, 100, size=(rng.integers(0, 3) * (s != d or s == 0), 2))
             for d in range(world)] for s in range(world)]


def test_alltoallv_rows_and_empty_splits(comm):
    world, me = comm.size, comm.rank
    plan = sends(world)
    send = np.concatenate(plan[me]).astype(np.int64).reshape(-1, 2)
    counts = [len(x) for x in plan[me]]
    recv, recv_counts = comm.alltoallv(send, counts).wait()
    expected = np.concatenate([plan[s][me] for s in range(world)]).reshape(-1, 2)
    assert recv_counts.tolist() == [len(plan[s][me]) for s in range(world)]
    np.testing.assert_array_equal(recv, expected)


def test_alltoallv_counts_matrix(comm):
    world, me = comm.size, comm.rank
    # k = 3 parts per destination; rank s sends (s + d + t) % 2 elements of part t to d.
    counts = np.array([[(me + d + t) % 2 for t in range(3)] for d in range(world)])
    send = np.arange(counts.sum(), dtype=np.float32) + 100 * me
    recv, rc = comm.alltoallv(send, counts).wait()
    assert rc.shape == (world, 3)
    assert rc.tolist() == [[(s + me + t) % 2 for t in range(3)] for s in range(world)]
    assert recv.size == rc.sum()


def test_alltoallv_with_known_receive_counts(comm):
    """A reply to an earlier all-to-all knows what it will receive: one phase, the same
    result."""
    world, me = comm.size, comm.rank
    plan = sends(world, seed=1)
    send = np.concatenate(plan[me]).astype(np.int64).reshape(-1, 2)
    counts = [len(x) for x in plan[me]]
    known = [len(plan[s][me]) for s in range(world)]
    recv, recv_counts = comm.alltoallv(send, counts, recv_counts=known).wait()
    assert recv_counts.tolist() == known
    np.testing.assert_array_equal(
        recv, np.concatenate([plan[s][me] for s in range(world)]).reshape(-1, 2))
    with pytest.raises(CommError, match="recv_counts must have the shape"):
        comm.alltoallv(send, counts, recv_counts=known + [0])


def test_allreduce_allgather_bcast(comm):
    world, me = comm.size, comm.rank
    total = comm.allreduce(np.array([me + 1, 2 * me], np.int64))
    assert total.tolist() == [world * (world + 1) // 2, world * (world - 1)]
    gathered = comm.allgather(np.array([me, -me], np.int32))
    assert gathered.tolist() == [[r, -r] for r in range(world)]
    got = comm.bcast_bytes(b"hello kvcoll" if me == 0 else None)
    assert got == b"hello kvcoll"


def test_agree_raises_on_every_rank(comm):
    comm.agree(True, "nothing")
    with pytest.raises(CommError, match=r"rank\(s\) \[0\] failed checking ids"):
        comm.agree(comm.rank != 0, "checking ids")


def test_timeout_names_rank_and_operation(comm):
    if comm.size == 1:
        pytest.skip("needs a peer that does not answer")
    c = comm.dup()
    c.timeout = 0.5
    if comm.rank == 0:
        with pytest.raises(CommTimeoutError, match=r"rank 0/\d+: lonely-barrier did not complete"):
            c.barrier("lonely-barrier")
        for r in range(1, comm.size):  # only now may the others join
            comm.isend(np.zeros(1, np.uint8), r, tag=73, op="rank 0 timed out").wait()
    else:
        comm.recv(0, 73, op="rank 0's timeout", timeout=60.0)
        c.barrier("lonely-barrier")  # matches rank 0's abandoned request
    comm.barrier()
    c.free()


def test_a_ping_left_from_earlier_is_no_sign_of_life(comm):
    """A peer is alive only if it answers this very check: a ping it sent earlier (it
    checked, then stopped or died) is no sign of life now. Rank 1 checks while rank 0 is
    busy outside kvcoll (rank 1's ping stays unanswered in rank 0's queue); then rank 1 is
    busy outside kvcoll while rank 0 checks: rank 0 must find rank 1 silent, and say that
    its process runs (it is on this host) outside kvcoll."""
    if comm.size == 1:
        pytest.skip("needs a peer")
    from mpi4py import MPI

    world, c = MPI.COMM_WORLD, comm.dup()   # the user's own messages; c shares the channel
    if comm.rank == 1:
        lost, report = c.liveness(grace=0.5)
        assert lost == [0], report
        world.send(b"checked", dest=0, tag=71)   # rank 0 may check now
        world.recv(source=0, tag=72)             # busy outside kvcoll meanwhile
    elif comm.rank == 0:
        world.recv(source=1, tag=71)             # busy outside kvcoll while rank 1 checks
        lost, report = c.liveness(grace=0.5)
        world.send(b"checked", dest=1, tag=72)
        assert lost == [1], report               # before: rank 1's old ping counted
        host = comm.hosts[1]
        assert f"rank 1 (pid {comm.peers[1]['pid']} on host {host}) is running but not " \
            "waiting in kvcoll" in report, report
    comm.barrier()
    c.free()


def test_allgatherv_variable_rows(comm):
    world, me = comm.size, comm.rank
    mine = np.full((me % 3, 2), me, np.float32)  # some ranks send nothing
    got, counts = comm.allgatherv(mine)
    assert counts.tolist() == [r % 3 for r in range(world)]
    np.testing.assert_array_equal(
        got, np.concatenate([np.full((r % 3, 2), r, np.float32) for r in range(world)]))


def test_point_to_point_ring_in_order_and_timeout(comm):
    """isend/recv: a ring of messages arrives in send order per sender; a recv nobody
    answers raises CommTimeoutError naming the rank, the peer and the operation."""
    world, me = comm.size, comm.rank
    c = comm.dup()
    right, left = (me + 1) % world, (me - 1) % world
    sends = [c.isend(np.full(k + 1, me * 10 + k, np.uint8), right, tag=k % 2) for k in range(4)]
    for k in range(4):  # different tags, one sender: still in order with tag -1
        src, tag, buf = c.recv(left, -1, op="ring")
        assert (src, tag) == (left, k % 2)
        np.testing.assert_array_equal(buf, np.full(k + 1, left * 10 + k, np.uint8))
    for s in sends:
        s.wait()
        assert s.done()
    assert c.try_recv() is None
    with pytest.raises(CommTimeoutError, match=rf"rank {me}/{world}: quiet: no answer from rank "
                                               rf"{left} within 0.2s"):
        c.recv(left, 5, op="quiet", timeout=0.2)
    comm.barrier()
    c.free()


def test_alltoallv_header_rides_with_the_counts(comm):
    """Every rank's header arrives with the counts; the ranks can then agree to stop
    before the payload (never posted) or go on with it."""
    world, me = comm.size, comm.rank
    plan = sends(world, seed=2)
    send = np.concatenate(plan[me]).astype(np.int64).reshape(-1, 2)
    counts = [len(x) for x in plan[me]]
    h = comm.alltoallv(send, counts, op="hdr:stop", header=[me, 7, -me])
    headers = h.headers()
    assert headers.tolist() == [[s, 7, -s] for s in range(world)]
    # all agree to stop here: the next all-to-all still matches up on every rank
    h = comm.alltoallv(send, counts, op="hdr:go", header=np.array([1], np.int64))
    assert h.headers()[:, 0].tolist() == [1] * world
    recv, rc = h.wait()
    assert rc.tolist() == [len(plan[s][me]) for s in range(world)]
    np.testing.assert_array_equal(
        recv, np.concatenate([plan[s][me] for s in range(world)]).reshape(-1, 2))
    with pytest.raises(CommError, match="header needs the counts phase"):
        comm.alltoallv(send, counts, recv_counts=counts, header=[1])
    with pytest.raises(CommError, match="no header was sent"):
        comm.alltoallv(send, counts).headers()
    comm.barrier()


def test_iallreduce_overlaps_an_alltoallv(comm):
    """A posted all-to-all and an allreduce started after it complete in either wait
    order, with the results of the blocking calls."""
    world, me = comm.size, comm.rank
    plan = sends(world, seed=3)
    send = np.concatenate(plan[me]).astype(np.int64).reshape(-1, 2)
    counts = [len(x) for x in plan[me]]
    known = [len(plan[s][me]) for s in range(world)]
    a2a = comm.alltoallv(send, counts, recv_counts=known)
    red = comm.iallreduce(np.array([me + 1.5, 1.0], np.float64))
    total = red.wait()
    recv, _ = a2a.wait()
    assert total.tolist() == [sum(s + 1.5 for s in range(world)), float(world)]
    np.testing.assert_array_equal(
        recv, np.concatenate([plan[s][me] for s in range(world)]).reshape(-1, 2))
