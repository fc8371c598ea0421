"""The exchange's topology (kvcoll._topology) and the two-level all-to-all, in one
process, no MPI:

- the plan: flat or two-level from every rank's host, and the setting (auto, flat,
  two-level; a two-level world it cannot serve is an error naming the shape and the fix);
- the block arithmetic (permute_blocks and the three orders) against plain numpy;
- kvcoll.comm.TwoLevelHandle itself, for every rank of a world of virtual ranks on a
  fake MPI (messages delivered within this process), against the flat all-to-all's
  results computed here: the same bytes, counts, order and headers, bit for bit, on
  hosts filled in order, round robin or shuffled, with empty blocks and empty ranks.
"""

import numpy as np
import pytest

import kvcoll.comm as kc
from kvcoll import Config, InvalidArgumentError
from kvcoll._topology import (
    AUTO_TWO_LEVEL_MIN_RANKS,
    describe_shape,
    level1_order,
    level2_order,
    permute_blocks,
    plan,
    source_order,
)

# -- the plan -------------------------------------------------------------------------


def test_auto_is_two_level_on_several_equal_hosts_only():
    n = AUTO_TWO_LEVEL_MIN_RANKS
    t = plan(["a"] * (n // 2) + ["b"] * (n // 2))
    assert t.two_level and t.grid.tolist() == [list(range(n // 2)), list(range(n // 2, n))]
    assert (t.hosts, t.per_host) == (2, n // 2) and t.where(n // 2) == (1, 0)
    t = plan(["a", "b"] * (n // 2))                     # round robin
    assert t.two_level and t.grid.tolist() == [list(range(0, n, 2)), list(range(1, n, 2))]
    assert not plan(["a"] * n).two_level                # one host
    assert "one host" in plan(["a", "a"]).why
    assert not plan([f"h{i}" for i in range(n)]).two_level     # one rank per host
    assert not plan(["x"]).two_level
    uneven = plan(["a"] * n + ["b"])
    assert not uneven.two_level and "different sizes" in uneven.why
    assert not plan(["a"] * (n // 2) + ["b"] * (n // 2), "flat").two_level


def test_auto_stays_flat_below_the_worlds_where_two_level_pays():
    """bench/results/scale.md: below AUTO_TWO_LEVEL_MIN_RANKS ranks the two-level
    exchange's extra rounds cost more than the messages it saves (measured 1.4x slower
    at 3 hosts x 2, bench/results/topology.md)."""
    n = AUTO_TWO_LEVEL_MIN_RANKS
    assert 4 < n <= 1024
    for labels in (["a", "a", "b", "b"], ["a", "b"] * 3,
                   [f"h{i // 2}" for i in range(2 * ((n - 1) // 2))]):   # just below n
        t = plan(labels)
        assert not t.two_level, labels
        assert f"{len(labels)} ranks, fewer than {n}" in t.why and "scale.md" in t.why
        assert plan(labels, "two-level").two_level                 # forced: as before
    m = 2 * ((n + 1) // 2)                                            # n, or n + 1
    t = plan([f"h{i // 2}" for i in range(m)])
    assert t.two_level and f"{m} ranks, at least {n}" in t.why


def test_forced_two_level():
    assert plan(["a", "a"], "two-level").grid.tolist() == [[0, 1]]     # even shapes serve
    assert plan(["a", "b"], "two-level").grid.tolist() == [[0], [1]]
    with pytest.raises(InvalidArgumentError) as err:
        plan(["h1", "h1", "h2", "h3", "h3"], "two-level")
    msg = str(err.value)
    assert "same number of ranks on every host" in msg
    assert "5 rank(s) on 3 host(s): h1 2, h2 1, h3 2" in msg
    assert "--exchange-topology" in msg and "KVCOLL_EXCHANGE_TOPOLOGY" in msg
    # a world that changed (a lost host): flat, no error
    t = plan(["h1", "h1", "h2"], "two-level", strict=False)
    assert not t.two_level and "different sizes" in t.why
    with pytest.raises(InvalidArgumentError, match="exchange_topology 'tree' is unknown"):
        plan(["a"], "tree")


def test_describe_shape_is_short_for_many_hosts():
    text = describe_shape([f"h{i // 2}" for i in range(200)], most=3)
    assert text.startswith("200 rank(s) on 100 host(s): h0 2, h1 2, h2 2, ... (97 more)")


def test_setting_from_code_flag_or_environment():
    assert Config().exchange_topology == "auto"
    assert Config.resolve([], {"KVCOLL_EXCHANGE_TOPOLOGY": "flat"}).exchange_topology == "flat"
    assert Config.resolve(["--exchange-topology", "two-level"],
                          {"KVCOLL_EXCHANGE_TOPOLOGY": "flat"}).exchange_topology == "two-level"
    assert Config.resolve(["--exchange-topology=flat"], {},
                          exchange_topology="auto").exchange_topology == "auto"
    with pytest.raises(InvalidArgumentError, match="exchange_topology 'tree' is unknown; use "
                                                   "one of auto, flat, two-level"):
        Config.resolve([], {"KVCOLL_EXCHANGE_TOPOLOGY": "tree"})
    # KVCOLL_TEST_* is the test suite's (KVCOLL_TEST_HOSTS), never a setting
    assert Config.resolve([], {"KVCOLL_TEST_HOSTS": "a,b"}) == Config()


# -- the block arithmetic ---------------------------------------------------------------


def blocks_of(buf, lens):
    at = np.r_[0, np.cumsum(lens)]
    return [buf[at[i]:at[i + 1]] for i in range(len(lens))]


def test_permute_blocks_example_and_identity():
    out = permute_blocks(np.array([1, 2, 3, 4, 5]), [2, 0, 3], [2, 1, 0])
    assert out.tolist() == [3, 4, 5, 1, 2]
    buf = np.arange(6)
    assert permute_blocks(buf, [1, 2, 3], None) is buf
    assert permute_blocks(buf, [1, 2, 3], [0, 1, 2]) is buf      # nothing moves: no copy
    assert permute_blocks(buf, [0, 6, 0], [2, 1, 0]) is buf      # one non-empty block
    with pytest.raises(ValueError, match="blocks of 5 rows in a buffer of 6"):
        permute_blocks(buf, [1, 4], [1, 0])


@pytest.mark.parametrize("seed", range(20))
def test_permute_blocks_equals_concatenation(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 12))
    lens = rng.integers(0, 4, n) * (rng.random(n) < 0.7)
    buf = rng.standard_normal((int(lens.sum()), 3)).astype(np.float32)
    order = rng.permutation(n)
    parts = blocks_of(buf, lens)
    want = np.concatenate([parts[i] for i in order]) if n else buf
    got = permute_blocks(buf, lens, order)
    np.testing.assert_array_equal(got, want)
    out = np.full_like(buf, np.nan)
    assert permute_blocks(buf, lens, order, out=out) is out
    np.testing.assert_array_equal(out, want)


def test_orders():
    grid = np.array([[0, 1, 2], [3, 4, 5]])                # 2 hosts x 3, filled in order
    assert level1_order(grid).tolist() == [0, 3, 1, 4, 2, 5]
    # level 1's blocks (l, h') in l-major order -> (h', l)
    assert level2_order(2, 3).tolist() == [0, 2, 4, 1, 3, 5]
    assert source_order(grid) is None
    rr = np.array([[0, 2, 4], [1, 3, 5]])                  # round robin
    assert source_order(rr).tolist() == [0, 3, 1, 4, 2, 5]
    assert rr.reshape(-1)[source_order(rr)].tolist() == list(range(6))


# -- TwoLevelHandle on a fake MPI -----------------------------------------------------


class FakeRequest:
    def __init__(self, test):
        self._test = test

    def Test(self):
        return self._test()


class FakeMPI:
    INT64_T, INT32_T, UINT16_T, UINT8_T, FLOAT, DOUBLE, BYTE = range(7)


@pytest.fixture(autouse=True)
def _fake_mpi(monkeypatch):
    """kvcoll.comm's MPI is the fake one here (no MPI_Init in a unit test)."""
    monkeypatch.setattr(kc, "_MPI", FakeMPI)


class Post:
    """The messages in flight of one world: (sub-communicator, source, dest, tag) ->
    queue of payloads (copies)."""

    def __init__(self):
        self.boxes = {}
        self.sent = 0


class FakeSub:
    """One rank's view of a sub-communicator: ranks `members` (world ranks, in order)."""

    def __init__(self, post, name, members, me):
        self.post, self.name, self.members, self.me = post, name, members, me

    def Isend(self, spec, dest, tag):
        buf = spec[0]
        self.post.boxes.setdefault((self.name, self.me, dest, tag), []).append(buf.copy())
        self.post.sent += 1
        return FakeRequest(lambda: True)

    def Irecv(self, spec, source, tag):
        buf = spec[0]
        key = (self.name, source, self.me, tag)
        done = []

        def test():
            if not done:
                q = self.post.boxes.get(key)
                if not q:
                    return False
                msg = q.pop(0)
                assert msg.shape == buf.shape, (key, msg.shape, buf.shape)
                buf[...] = msg
                done.append(1)
            return True
        return FakeRequest(test)


class FakeComm:
    """What TwoLevelHandle needs of a Comm, for world rank `rank` of a grid."""

    def __init__(self, post, grid, rank):
        H, L = grid.shape
        h, l = (int(x) for x in np.argwhere(grid == rank)[0])
        self.rank, self.size = rank, grid.size
        self.calls, self.messages = {}, {}
        two = object.__new__(kc._TwoLevel)
        two.grid, two.hosts, two.per_host, two.h, two.l = grid, H, L, h, l
        two.order1, two.order2 = level1_order(grid), level2_order(H, L)
        two.order3 = source_order(grid)
        two.intra = FakeSub(post, ("intra", h), list(grid[h]), l)
        two.inter = FakeSub(post, ("inter", l), list(grid[:, l]), h)
        two.seq, two.inflight = 0, []
        self._two = two

    def _count(self, op):
        self.calls[op] = self.calls.get(op, 0) + 1

    def _sent(self, op, n):
        self.messages[op] = self.messages.get(op, 0) + n


def drive(handles, headers_first=False):
    """Advance every rank's handle until all are done (ranks take turns, as MPI's
    progress would let them); with headers_first, every rank reads its headers (the
    counts only) before any waits for the payload, as a BSP pull does."""
    for _ in range(100):
        if all(h._stage >= h.COUNTED for h in handles):
            break
        for h in handles:
            h._advance()
    if headers_first:
        assert all(h._stage == h.COUNTED for h in handles)   # nothing posted yet
    for h in handles:
        h._go = True
    for _ in range(100):
        if all(h._stage == h.DONE for h in handles):
            return [h._result for h in handles]
        for h in handles:
            h._advance()
    raise AssertionError("the two-level all-to-all did not complete")


def flat_result(sends, counts, me):
    """What a flat all-to-all gives rank `me`: (rows from every rank in rank order,
    recv_counts)."""
    P = len(sends)
    parts, rc = [], []
    for s in range(P):
        c = np.asarray(counts[s]).reshape(P, -1)
        at = np.r_[0, np.cumsum(c.sum(axis=1))]
        parts.append(sends[s][at[me]:at[me + 1]])
        rc.append(c[me])
    return np.concatenate(parts), np.array(rc)


GRIDS = {
    "2x2 in order": np.array([[0, 1], [2, 3]]),
    "2x2 round robin": np.array([[0, 2], [1, 3]]),
    "3x2 in order": np.arange(6).reshape(3, 2),
    "2x3 shuffled": np.array([[4, 0, 5], [2, 3, 1]]),
    "1x4": np.arange(4).reshape(1, 4),
    "4x1": np.arange(4).reshape(4, 1),
    "3x3 round robin": np.arange(9).reshape(3, 3).T.copy(),
}


def inputs(rng, P, k, row_shape, dtype, empty_rank):
    counts, sends = [], []
    for s in range(P):
        c = rng.integers(0, 4, (P, k)) * (rng.random((P, k)) < 0.6)
        if s == empty_rank:
            c[:] = 0
        counts.append(c if k > 1 else c[:, 0])
        n = int(c.sum())
        sends.append((rng.standard_normal((n,) + row_shape) * 100).astype(dtype))
    return counts, sends


@pytest.mark.parametrize("grid", list(GRIDS), ids=list(GRIDS))
@pytest.mark.parametrize("case", ["ids", "rows", "known", "header", "uint16"])
def test_two_level_equals_flat(grid, case):
    grid = GRIDS[grid]
    P = grid.size
    rng = np.random.default_rng([P, len(case)])
    k, row_shape, dtype = {"ids": (3, (), np.int64), "rows": (1, (2, 3), np.float32),
                           "known": (2, (), np.float64), "header": (3, (), np.int64),
                           "uint16": (1, (4,), np.uint16)}[case]
    for trial in range(3):
        counts, sends = inputs(rng, P, k, row_shape, dtype, empty_rank=trial % P)
        post = Post()
        handles = []
        for r in range(P):
            c = FakeComm(post, grid, r)
            known = flat_result(sends, counts, r)[1] if case == "known" else None
            if known is not None and k == 1:
                known = known[:, 0]
            header = [r, 7 * r, -1] if case == "header" else None
            handles.append(kc.TwoLevelHandle(c, sends[r], counts[r], "test", recv_counts=known,
                                             header=header))
        results = drive(handles, headers_first=case == "header")
        for r, (recv, rc) in enumerate(results):
            want, want_rc = flat_result(sends, counts, r)
            assert recv.dtype == want.dtype and recv.shape == want.shape
            assert recv.tobytes() == want.tobytes()                # bit for bit
            assert rc.tolist() == (want_rc[:, 0] if k == 1 else want_rc).tolist()
            assert recv.ctypes.data % 64 == 0 or recv.size == 0    # TensorFlow takes it as is
            if case == "header":
                assert handles[r]._headers.tolist() == [[s, 7 * s, -1] for s in range(P)]
        H, L = grid.shape
        # per rank per phase: (L-1) + (H-1) counts messages, at most as many payload ones
        for h in handles:
            sent = h._c.messages["test"]
            counts_msgs = (L - 1) + (0 if case == "known" else H - 1)
            assert counts_msgs <= sent <= counts_msgs + (L - 1) + (H - 1)
        assert not any(post.boxes.values())                        # nothing left over


def test_counts_arrive_in_any_order_of_ranks():
    """The ranks advance in different orders (later ranks first): same results."""
    grid = np.array([[0, 2], [1, 3]])
    rng = np.random.default_rng(5)
    counts, sends = inputs(rng, 4, 2, (), np.int64, empty_rank=1)
    post = Post()
    handles = [kc.TwoLevelHandle(FakeComm(post, grid, r), sends[r], counts[r], "x")
               for r in range(4)]
    for h in handles:
        h._go = True
    for _ in range(50):
        for h in reversed(handles):
            h._advance()
    for r, h in enumerate(handles):
        want, want_rc = flat_result(sends, counts, r)
        assert h._stage == h.DONE
        np.testing.assert_array_equal(h._result[0], want)
        np.testing.assert_array_equal(h._result[1], want_rc)


def test_bad_arguments_are_refused_like_the_flat_exchange():
    c = FakeComm(Post(), np.array([[0, 1], [2, 3]]), 0)
    with pytest.raises(kc.CommError, match="counts must have one row per rank"):
        kc.TwoLevelHandle(c, np.zeros(2, np.int64), [1, 1], "x")
    with pytest.raises(kc.CommError, match="counts sum to 3 but send has 2 rows"):
        kc.TwoLevelHandle(c, np.zeros(2, np.int64), [1, 1, 1, 0], "x")
    with pytest.raises(kc.CommError, match="a header needs the counts phase"):
        kc.TwoLevelHandle(c, np.zeros(2, np.int64), [1, 1, 0, 0], "x",
                          recv_counts=[0, 0, 0, 0], header=[1])


# -- Comm's planning (no MPI call on these paths) ---------------------------------------


def stub_comm(peers, rank=0):
    from types import SimpleNamespace

    c = object.__new__(kc.Comm)
    c._live, c.rank, c.size, c._two = SimpleNamespace(peers=peers), rank, len(peers), None
    return c


def peer(host, setting="auto"):
    return {"host": "real", "topology_host": host, "exchange_topology": setting}


def test_comm_plans_from_every_ranks_host():
    c = stub_comm([peer("a"), peer("a"), peer("b")])
    c._plan_topology("auto", True)
    assert not c.topology.two_level and c._two is None
    with pytest.raises(InvalidArgumentError, match="3 rank\\(s\\) on 2 host\\(s\\): a 2, b 1"):
        stub_comm([peer("a"), peer("a"), peer("b")])._plan_topology("two-level", True)
    c = stub_comm([peer("a"), peer("a"), peer("b")])
    c._plan_topology("two-level", False)           # a world after a loss: flat
    assert not c.topology.two_level and "different sizes" in c.topology.why


def test_ranks_given_different_settings_are_refused_alike():
    for rank in (0, 1):
        c = stub_comm([peer("a", "auto"), peer("a", "flat")], rank)
        with pytest.raises(kc.CommError, match=rf"rank {rank}: the ranks were given different "
                                               r"exchange_topology settings \['auto', 'flat'\]"):
            c._plan_topology("auto", True)


def test_test_hosts_label_per_launch_rank(monkeypatch):
    monkeypatch.delenv("KVCOLL_TEST_HOSTS", raising=False)
    import socket

    assert kc._topology_host() == socket.gethostname()
    monkeypatch.setenv("KVCOLL_TEST_HOSTS", "x,y,x,y")
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "1")
    assert kc._topology_host() == "y"
    monkeypatch.setenv("OMPI_COMM_WORLD_RANK", "7")
    assert kc._topology_host() is None
    with pytest.raises(kc.CommError, match="KVCOLL_TEST_HOSTS .* must give a host label to "
                                           "every launch rank"):
        stub_comm([peer("x"), peer(None)])._plan_topology("auto", True)
