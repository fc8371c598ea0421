"""The two-level all-to-all under MPI, at any world size, on hosts pretended with
KVCOLL_TEST_HOSTS (kvcoll's tests only: a host label per launch rank): on every even
shape of the world (H hosts x L ranks, filled in order or round robin) its results equal
the flat all-to-all's bit for bit (counts, rows, order, headers; empty blocks and an
empty rank included); auto chooses it only on several hosts of more than one rank, and
from AUTO_TWO_LEVEL_MIN_RANKS ranks; a forced two-level on hosts of different sizes is
refused on every rank; exchanges in flight progress whatever a rank waits in; a dup has
sub-communicators of its own and runs beside its parent; a BSP exchange over it equals
one over the flat communicator.

tests/launch/test_mpi.py runs it on 2 and 3 ranks, tests/launch/test_exchange_topology.py
on 4 (2 "hosts" x 2).
"""

import os
import threading

import numpy as np
import pytest

from kvcoll import KvTable, optimizers
from kvcoll._topology import AUTO_TWO_LEVEL_MIN_RANKS
from kvcoll.comm import Comm, TwoLevelHandle
from kvcoll.errors import InvalidArgumentError
from kvcoll.exchange import BspExchange


@pytest.fixture(scope="module")
def flat(comm):
    """The reference: a communicator whose all-to-alls are flat whatever the hosts."""
    c = Comm(timeout=60.0, topology="flat")
    yield c
    c.barrier()
    c.free()


def layouts(world: int) -> list[tuple[str, list[str]]]:
    """Every even shape of `world` ranks: hosts filled in order, and round robin."""
    out = []
    for per_host in range(1, world + 1):
        if world % per_host:
            continue
        hosts = world // per_host
        out.append((f"{hosts}x{per_host} in order", [f"h{r // per_host}" for r in range(world)]))
        if hosts > 1 and per_host > 1:
            out.append((f"{hosts}x{per_host} round robin", [f"h{r % hosts}" for r in range(world)]))
    return out


def made(labels: list[str], setting: str = "two-level") -> Comm:
    """A communicator over every rank whose ranks run on the pretended hosts `labels`."""
    old = os.environ.get("KVCOLL_TEST_HOSTS")
    os.environ["KVCOLL_TEST_HOSTS"] = ",".join(labels)
    try:
        return Comm(timeout=60.0, topology=setting)
    finally:
        if old is None:
            os.environ.pop("KVCOLL_TEST_HOSTS")
        else:
            os.environ["KVCOLL_TEST_HOSTS"] = old


def busiest(world: int) -> list[str]:
    """The layout with the most of both levels (round robin when there is one)."""
    return layouts(world)[-1][1] if world > 1 else ["h0"]


def inputs(world, seed, k, row_shape, dtype):
    """Every rank's counts (world, k) and rows, from one seed; rank seed % world sends
    nothing."""
    rng = np.random.default_rng(seed)
    counts = [rng.integers(0, 4, (world, k)) * (rng.random((world, k)) < 0.6)
              for _ in range(world)]
    counts[seed % world][:] = 0
    sends = [(rng.standard_normal((int(c.sum()),) + row_shape) * 100).astype(dtype)
             for c in counts]
    return counts, sends


def expected(counts, sends, me):
    parts, rc = [], []
    for c, s in zip(counts, sends):
        at = np.r_[0, np.cumsum(c.sum(axis=1))]
        parts.append(s[at[me]:at[me + 1]])
        rc.append(c[me])
    return np.concatenate(parts), np.array(rc)


CASES = {"ids": (3, (), np.int64), "rows": (1, (2, 3), np.float32),
         "known": (2, (), np.float64), "header": (3, (), np.int64),
         "uint16": (1, (4,), np.uint16)}


def one_case(c: Comm, flat: Comm, case: str, seed: int) -> None:
    world, me = c.size, c.rank
    k, shape, dtype = CASES[case]
    counts, sends = inputs(world, seed, k, shape, dtype)
    mine = counts[me] if k > 1 else counts[me][:, 0]
    want, want_rc = expected(counts, sends, me)
    known = None
    if case == "known":
        known = want_rc if k > 1 else want_rc[:, 0]
    header = [me, seed, -me] if case == "header" else None
    results = []
    for comm in (c, flat):
        h = comm.alltoallv(sends[me], mine, op=f"t:{case}", recv_counts=known, header=header)
        if header is not None:
            assert h.headers().tolist() == [[s, seed, -s] for s in range(world)]
        results.append(h.wait())
    (recv, rc), (frecv, frc) = results
    assert recv.dtype == frecv.dtype == want.dtype and recv.shape == frecv.shape == want.shape
    assert recv.tobytes() == frecv.tobytes() == want.tobytes()
    assert rc.tolist() == frc.tolist() == (want_rc if k > 1 else want_rc[:, 0]).tolist()


def test_every_layout_equals_flat(comm, flat):
    world = comm.size
    for name, labels in layouts(world):
        c = made(labels)
        try:
            assert c.topology.two_level, (name, str(c.topology))
            hosts, per_host = c.topology.grid.shape
            assert hosts * per_host == world
            assert sorted(c.topology.grid.reshape(-1).tolist()) == list(range(world))
            if world > 1:
                assert type(c.alltoallv(np.zeros(0, np.int64), [0] * world)) is TwoLevelHandle
            for seed, case in enumerate(CASES):
                one_case(c, flat, case, seed + 10 * world)
            # (L-1) + (H-1) counts messages a phase, at most as many payload messages
            per_phase = (per_host - 1) + (hosts - 1)
            assert c.messages.get("t:ids", 0) <= 2 * per_phase, (name, c.messages)
            assert c.messages.get("t:known", 0) <= per_phase + (per_host - 1), (name, c.messages)
        finally:
            c.barrier()
            c.free()


def test_auto_chooses_from_the_shape(comm):
    world = comm.size
    shapes = [(["h0"] * world, False)]                                    # one host
    if world > 1:
        shapes.append(([f"h{r}" for r in range(world)], False))          # one rank per host
    if world >= 4 and world % 2 == 0:
        shapes.append(([f"h{r * 2 // world}" for r in range(world)],    # 2 hosts: two-level
                       world >= AUTO_TWO_LEVEL_MIN_RANKS))               # from that many
    if world >= 3:
        shapes.append((["h0"] * (world - 1) + ["h1"], False))            # uneven
    for labels, two in shapes:
        c = made(labels, "auto")
        try:
            assert c.topology.two_level == two, (labels, str(c.topology))
            assert (c._two is not None) == two
        finally:
            c.free()


def test_kvcolls_communicator_follows_the_setting(comm):
    """kv.init's communicator: two-level when KVCOLL_EXCHANGE_TOPOLOGY says so (the
    launch test that runs kvcoll's tests on it), flat on this one host otherwise."""
    if os.environ.get("KVCOLL_EXCHANGE_TOPOLOGY") == "two-level":
        assert comm.topology.two_level and comm._two is not None, str(comm.topology)
    elif not os.environ.get("KVCOLL_TEST_HOSTS"):
        assert not comm.topology.two_level and comm._two is None, str(comm.topology)


def test_two_level_on_uneven_hosts_is_refused_on_every_rank(comm):
    if comm.size < 3:
        pytest.skip("needs hosts of different sizes: 3 ranks at least")
    labels = ["h0"] * (comm.size - 1) + ["h1"]
    with pytest.raises(InvalidArgumentError, match=rf"exchange_topology 'two-level' needs the "
                                                   rf"same number of ranks on every host, but "
                                                   rf"this world has {comm.size} rank\(s\) on 2 "
                                                   rf"host\(s\): h0 {comm.size - 1}, h1 1"):
        made(labels)
    comm.barrier()


def test_exchanges_progress_whatever_a_rank_waits_in(comm, flat):
    """The push's pattern: a reply all-to-all (known counts) is posted, and a rank whose
    step failed waits for the allreduce before it (the others after): it completes, as a
    flat MPI all-to-all would. Then three in flight, waited in reverse order."""
    world, me = comm.size, comm.rank
    c = made(busiest(world))
    try:
        counts, sends = inputs(world, 3, 2, (2,), np.float32)
        want, want_rc = expected(counts, sends, me)
        a = c.alltoallv(sends[me], counts[me], op="t:reply", recv_counts=want_rc)
        if me % 2:
            total = c.iallreduce(np.array([me], np.int64)).wait()
            recv, _ = a.wait()
        else:
            recv, _ = a.wait()
            total = c.iallreduce(np.array([me], np.int64)).wait()
        assert int(total[0]) == world * (world - 1) // 2
        assert recv.tobytes() == want.tobytes()
        hs, wants = [], []
        for seed in (4, 5, 6):
            counts, sends = inputs(world, seed, 1, (), np.int64)
            want, want_rc = expected(counts, sends, me)
            wants.append((want, want_rc[:, 0]))
            hs.append(c.alltoallv(sends[me], counts[me][:, 0], op="t:many",
                                  header=[seed] if seed == 4 else None,
                                  recv_counts=want_rc[:, 0] if seed == 5 else None))
        for h, (want, want_rc) in reversed(list(zip(hs, wants))):
            recv, rc = h.wait()
            assert recv.tobytes() == want.tobytes() and rc.tolist() == want_rc.tolist()
        assert hs[0].headers()[:, 0].tolist() == [4] * world
    finally:
        c.barrier()
        c.free()


def test_a_dup_has_its_own_and_runs_beside_its_parent(comm, flat):
    """The pipelined step runs the id exchange on a helper thread over a dup: the dup's
    sub-communicators are its own, and exchanges on both at once do not mix."""
    world, me = comm.size, comm.rank
    c = made(busiest(world))
    d = c.dup()
    try:
        assert d.topology.two_level and d._two is not None and d._two is not c._two
        assert d._two.intra is not c._two.intra and d._two.inter is not c._two.inter
        failures = []

        def run(comm_, seed0):
            try:
                for i in range(15):
                    counts, sends = inputs(world, seed0 + i, 2, (), np.int64)
                    want, want_rc = expected(counts, sends, me)
                    recv, rc = comm_.alltoallv(sends[me], counts[me], op="t:side").wait()
                    assert recv.tobytes() == want.tobytes() and rc.tolist() == want_rc.tolist()
            except BaseException as exc:  # noqa: BLE001 - reported below
                failures.append(exc)

        helper = threading.Thread(target=run, args=(d, 100))
        helper.start()
        run(c, 200)
        helper.join(120)
        assert not helper.is_alive() and not failures, failures
    finally:
        c.barrier()
        d.free()
        c.free()
    assert c._two is None and d._two is None


DIMS = {"a": 4, "b": 1}


def tables():
    return {n: KvTable(d, name=n, seed=7, initializer=("uniform", -0.1, 0.1),
                       optimizer=optimizers.Adagrad(0.3)) for n, d in DIMS.items()}


def test_bsp_exchange_equals_flat(comm, flat):
    """pull, push and commit over the two-level communicator give the flat one's rows and
    tables, bit for bit."""
    world, me = comm.size, comm.rank
    c = made(busiest(world))
    mine, ref = tables(), tables()
    ex, fx = BspExchange(c, mine), BspExchange(flat, ref)
    try:
        for step in range(1, 6):
            rng = np.random.default_rng([9, step])
            full = {n: rng.integers(0, 200, 300).astype(np.int64) for n in DIMS}
            lo, hi = (0, 0) if me == world - 1 and world > 1 else \
                (300 * me // world, 300 * (me + 1) // world)       # the last rank: nothing
            ids = {n: a[lo:hi] for n, a in full.items()}
            pulls = [x.pull(ids) for x in (ex, fx)]
            for g in pulls[0].rows:
                assert pulls[0].rows[g].tobytes() == pulls[1].rows[g].tobytes()
            for x, p in zip((ex, fx), pulls):
                grads = {g: (np.sin(m * 3 + step) * 0.5).astype(np.float32)
                         for g, m in p.rows.items()}
                x.push(p, grads).commit()
        for n in DIMS:
            a, b = mine[n].export(), ref[n].export()
            for key in ("keys", "values", "slots"):
                assert a[key].tobytes() == b[key].tobytes(), (n, key)
        assert ex.wire_bytes == fx.wire_bytes
    finally:
        for t in list(mine.values()) + list(ref.values()):
            t.close()
        c.barrier()
        c.free()
