"""The bucket -> rank map (kvcoll.routing.OwnerMap) and routing by it.

- A key's bucket is (mix(key) >> 40) mod BUCKETS and its owner the map's rank of that
  bucket, in every routing function (owner_of, unique_partition, the exchange's plan).
- The even map is contiguous and balanced within one bucket.
- without() and grow() move only the buckets they must (property tests against a plain
  model of what may move), keep the map balanced within one bucket when it was, and
  are deterministic; without() renumbers the survivors densely in their old order.
- The manifest's JSON form round-trips and rejects bad input with an error naming it.
"""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcoll import KvTable
from kvcoll.errors import InvalidArgumentError
from kvcoll.exchange.kernels import TableSet
from kvcoll.ids import hash64
from kvcoll.routing import BUCKETS, OwnerMap, bucket_of, owner_of, owners_for, unique_partition


def test_bucket_and_owner_are_the_hash_bits_and_the_map():
    keys = np.random.default_rng(0).integers(-2**63, 2**63 - 1, 50_000, dtype=np.int64)
    b = ((hash64(keys) >> np.uint64(40)) % np.uint64(BUCKETS)).astype(np.int64)
    np.testing.assert_array_equal(bucket_of(keys), b)
    np.testing.assert_array_equal(bucket_of(keys, 7000),
                                  (hash64(keys) >> np.uint64(40)) % np.uint64(7000))
    m = OwnerMap(np.random.default_rng(1).integers(0, 5, BUCKETS), 5)
    np.testing.assert_array_equal(m.owner_of(keys), m.array[b])
    np.testing.assert_array_equal(owner_of(keys, m), m.array[b])
    np.testing.assert_array_equal(m.bucket_of(keys), b)
    # a world size means its even map
    np.testing.assert_array_equal(owner_of(keys, 3), OwnerMap.even(3).array[b])


def test_unique_partition_and_the_exchange_plan_route_by_the_map():
    rng = np.random.default_rng(2)
    keys = rng.integers(-5000, 5000, 20_000)
    m = OwnerMap(rng.integers(0, 4, 60), 4)  # 60 buckets: the modulo path, uneven
    uniq, inverse, counts = unique_partition(keys, m)
    np.testing.assert_array_equal(uniq[inverse], keys)
    owners = m.owner_of(uniq)
    assert (np.diff(owners) >= 0).all()
    assert counts.tolist() == np.bincount(owners, minlength=4).tolist()
    with KvTable(2, name="a") as a, KvTable(3, name="b") as b:
        ids = [keys[:7000].astype(np.int64), keys[7000:].astype(np.int64)]
        send, cnt, _, _, _, nu = TableSet([a, b]).plan(ids, m)
        at = 0
        for r in range(4):  # segment (r, t) holds table t's unique ids rank r owns
            for t in range(2):
                seg = send[at:at + cnt[r, t]]
                assert (m.owner_of(seg) == r).all()
                assert sorted(seg.tolist()) == sorted(set(ids[t][m.owner_of(ids[t]) == r]
                                                          .tolist()))
                at += cnt[r, t]
        assert at == send.size == int(nu.sum())
        with pytest.raises(InvalidArgumentError, match="needs a kvcoll.routing.OwnerMap"):
            TableSet([a, b]).plan(ids, 4)


def test_even_map_is_contiguous_and_balanced():
    for world in (1, 2, 3, 7, 1000, 1024):
        m = OwnerMap.even(world)
        c = m.counts()
        assert m.buckets == BUCKETS and m.world == world
        assert c.max() - c.min() <= 1 and c.sum() == BUCKETS
        assert (np.diff(m.array) >= 0).all()          # contiguous blocks, in rank order
        assert len(m.to_json()["runs"]) == 2 * world  # a run per rank in the manifest
    assert OwnerMap.even(1000).counts().min() >= 65    # within 1.6% of the mean
    small = OwnerMap.even(5, buckets=3)                # more ranks than buckets
    assert small.counts().tolist() == [1, 1, 0, 1, 0]
    assert OwnerMap.even(3) is OwnerMap.even(3)        # shared, immutable
    with pytest.raises(ValueError):
        OwnerMap.even(3).array[0] = 1


def test_without_renumbers_like_shrink_and_moves_only_the_lost_buckets():
    m = OwnerMap.even(4)
    w = m.without([1])
    assert w.world == 3
    kept = m.array != 1
    # survivors 0, 2, 3 become 0, 1, 2 and keep every bucket
    np.testing.assert_array_equal(w.array[kept], np.array([0, -1, 1, 2])[m.array[kept]])
    assert w.counts().max() - w.counts().min() <= 1
    # rank 1's block goes out in three contiguous runs, one per survivor
    assert len(OwnerMap(w.array[~kept], 3).to_json()["runs"]) == 6
    # the even map of 3 without its middle rank happens to be the even map of 2 ...
    assert OwnerMap.even(3).without([1]) == OwnerMap.even(2)
    # ... but not without its first
    assert OwnerMap.even(3).without([0]) != OwnerMap.even(2)
    assert m.without([]) is m
    with pytest.raises(InvalidArgumentError, match="leaves no rank"):
        m.without(range(4))
    with pytest.raises(InvalidArgumentError, match="must be ranks of the world"):
        m.without([4])


def _maps():
    """Maps to start from: even ones, and ones shaped by earlier losses and growth."""
    world = st.integers(1, 40)
    buckets = st.sampled_from([1, 7, 64, 1000, 4096, BUCKETS])
    even = st.builds(lambda w, b: OwnerMap.even(w, b), world, buckets)

    @st.composite
    def shaped(draw):
        m = draw(even)
        for _ in range(draw(st.integers(0, 3))):
            if m.world > 1 and draw(st.booleans()):
                lost = draw(st.sets(st.integers(0, m.world - 1), min_size=1,
                                    max_size=m.world - 1))
                m = m.without(lost)
            else:
                m = m.grow(m.world + draw(st.integers(1, 5)))
        return m
    return shaped()


def _balanced(m: OwnerMap) -> bool:
    c = m.counts()
    return int(c.max() - c.min()) <= 1


@settings(max_examples=150, deadline=None)
@given(_maps(), st.data())
def test_without_property(m, data):
    if m.world < 2:
        return
    lost = sorted(data.draw(st.sets(st.integers(0, m.world - 1), min_size=1,
                                    max_size=m.world - 1)))
    w = m.without(lost)
    survivors = [r for r in range(m.world) if r not in lost]
    assert w.world == len(survivors) and w.buckets == m.buckets
    renumber = {old: new for new, old in enumerate(survivors)}
    gone = np.isin(m.array, lost)
    # every bucket of a survivor stays with it (renumbered densely, order kept)
    np.testing.assert_array_equal(w.array[~gone],
                                  [renumber[r] for r in m.array[~gone].tolist()])
    # the lost buckets, in bucket order, are one contiguous run per receiving survivor
    got = w.array[gone]
    assert (np.diff(got) >= 0).all()
    # water-filling: a survivor that received lost buckets ends at most one above the
    # least loaded survivor
    before = np.bincount(w.array[~gone], minlength=w.world)
    after = w.counts()
    received = after > before
    if received.any():
        assert after[received].max() <= after.min() + 1
    if _balanced(m):
        assert _balanced(w)
    assert m.without(lost) == w  # deterministic
    assert OwnerMap.from_json(w.to_json()) == w


@settings(max_examples=150, deadline=None)
@given(_maps(), st.integers(1, 30))
def test_grow_property(m, added):
    g = m.grow(m.world + added)
    assert g.world == m.world + added and g.buckets == m.buckets
    stays = g.array < m.world
    # no bucket moves between old ranks; what moves goes to a new rank
    np.testing.assert_array_equal(g.array[stays], m.array[stays])
    new_counts = g.counts()[m.world:]
    assert new_counts.max() - new_counts.min() <= 1
    # the new ranks take no more than an even share, and only from ranks above it
    q = m.buckets // g.world
    assert new_counts.max() <= q + 1
    old_before, old_after = m.counts(), g.counts()[:m.world]
    gave = old_after < old_before
    if gave.any():
        assert old_after[gave].min() >= q
    if _balanced(m):
        assert _balanced(g)
    assert m.grow(m.world + added) == g
    assert OwnerMap.from_json(g.to_json()) == g


def test_grow_moves_the_fewest_buckets():
    m = OwnerMap.even(3)
    g = m.grow(4)
    moved = int((g.array != m.array).sum())
    assert moved == int(g.counts()[3]) == BUCKETS // 4  # exactly rank 3's share
    assert _balanced(g)
    assert m.grow(3) is m


def test_json_round_trip_and_bad_input():
    m = OwnerMap.even(3).without([0]).grow(5)
    j = m.to_json()
    assert j["buckets"] == BUCKETS and j["world"] == 5
    assert OwnerMap.from_json(j) == m
    bad = [
        ({"buckets": 4, "world": 2}, "must be a dict with buckets, world and runs"),
        ({"buckets": 4, "world": 2, "runs": [0, 2, 1]}, "runs must be a list of integers"),
        ({"buckets": 4, "world": 2, "runs": [0, 2, 1, 1]}, "sum to its 4 buckets"),
        ({"buckets": 4, "world": 2, "runs": [0, 5, 1, -1]}, "must be >= 1"),
        ({"buckets": 4, "world": 2, "runs": [0, 2, 2, 2]}, "bucket 2 has rank 2"),
        ({"buckets": 4, "world": 0, "runs": [0, 4]}, "world must be an integer"),
        ({"buckets": 4, "world": 2, "runs": [0, 2.0, 1, 2]}, "runs must be a list"),
        ({"buckets": 4, "world": 2, "runs": [0, 2, 2**64, 2]}, "runs must be a list"),
        ({"buckets": 4, "world": 2, "runs": [0, -2**70, 1, 2]}, "runs must be a list"),
    ]
    for d, match in bad:
        with pytest.raises(InvalidArgumentError, match=match):
            OwnerMap.from_json(d)


def test_bad_maps_are_refused():
    with pytest.raises(InvalidArgumentError, match="bucket 1 has rank 3, outside"):
        OwnerMap([0, 3, 1], 3)
    with pytest.raises(InvalidArgumentError, match="bucket 0 has rank -1"):
        OwnerMap([-1, 0], 2)
    with pytest.raises(InvalidArgumentError, match="integer ranks"):
        OwnerMap([0.0, 1.0], 2)
    with pytest.raises(InvalidArgumentError, match="needs 1 to"):
        OwnerMap([], 1)

    class Comm:
        size, rank = 3, 0
    assert owners_for(Comm()) == OwnerMap.even(3)
    with pytest.raises(InvalidArgumentError, match="OwnerMap of the communicator's 3 ranks"):
        owners_for(Comm(), OwnerMap.even(2))
