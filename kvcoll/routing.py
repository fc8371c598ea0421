"""Where keys go: each key's bucket, the bucket -> rank map that owns it, and a batch's
ids deduplicated and grouped by owner before they cross ranks.

A key's bucket is (mix(key) >> 40) mod BUCKETS: bits 40..55 of kvcoll's 64-bit mix
(`kvcoll.ids.hash64`; a table's own buckets use bits 0..31 and its tags bits 32..39,
so the keys a rank owns still spread evenly inside its tables). BUCKETS is fixed for
the life of a model: every checkpoint records it, and every shard file groups its
rows by these buckets. A key's owner is `OwnerMap.array[bucket]`, a map the same on
every rank; the default is the even split of the buckets into contiguous blocks
(`OwnerMap.even(world)`). A change of world moves only whole buckets, and only the
ones it must (`without`, `grow`), so a checkpoint restores on any map by reading the
pages of the buckets the map gives each rank.

Why 65,536 buckets: balance, the map's size, and pages. Up to 1,024 ranks every rank
holds at least 64 buckets, so "within one bucket" is within 1.6% of the mean (within
0.4% up to 256 ranks), far below the hash's own noise on a small table; the map is
256 KiB of int32 in memory and, stored as runs of one rank's consecutive buckets, a
few numbers per rank in a manifest (the even map: 2 per rank); and the count costs a
checkpoint nothing, since a shard file's pages hold consecutive buckets up to a page's
size (kvcoll._shards), so a small delta is one page whatever BUCKETS is. A power of
two also makes the bucket a mask of the hash, not a division. More buckets would
double the map for balance no one needs; 2^24 (every bit left) would make it 64 MiB.

Each function is one C call over the whole batch (csrc/kv_route.h); ids are checked
by `kvcoll.ids.as_keys`.
"""

from __future__ import annotations

import numpy as np

from . import errors
from ._c import check, ffi, lib, ptr
from .ids import as_keys

__all__ = [
    "BUCKETS",
    "OwnerMap",
    "bucket_of",
    "owner_of",
    "owners_for",
    "segment_sum",
    "unique_partition",
]

BUCKETS = 1 << 16
MAX_BUCKETS = int(lib.KV_MAX_BUCKETS)


def _int(value, what: str, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low \
            or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise errors.InvalidArgumentError(f"{what} must be an integer {bound}, got {value!r}")
    return int(value)


class OwnerMap:
    """The bucket -> rank map: `array[b]` (int32) owns bucket b, for `buckets` buckets
    over a world of `world` ranks (a rank may own none). Immutable; every rank computes
    the same map from the same inputs.

        m = OwnerMap.even(3)          # buckets 0..21845 -> 0, ..21844 more -> 1, ... -> 2
        m.owner_of(keys)              # owner rank of each key
        m.without([1])                # rank 1 lost: world 2, only its buckets move
        m.grow(4)                     # rank 3 added: only the buckets it takes move
    """

    __slots__ = ("_ptr", "array", "buckets", "world")

    def __init__(self, array, world: int | None = None):
        a = np.asarray(array).reshape(-1)
        if not 1 <= a.size <= MAX_BUCKETS:
            raise errors.InvalidArgumentError(
                f"an owner map needs 1 to {MAX_BUCKETS} buckets, got {a.size}")
        if a.dtype.kind not in "iu":
            raise errors.InvalidArgumentError(
                f"an owner map must hold integer ranks, got dtype {a.dtype}")
        top = int(a.max()) + 1
        world = top if world is None else _int(world, "world", 1, 1 << 30)
        if int(a.min()) < 0 or top > world:
            bad = int(np.flatnonzero((a < 0) | (a >= world))[0])
            raise errors.InvalidArgumentError(
                f"an owner map of world {world}: bucket {bad} has rank {int(a[bad])}, "
                f"outside [0, {world})")
        arr = np.ascontiguousarray(a, np.int32).copy()
        arr.flags.writeable = False
        self.buckets, self.world, self.array = int(arr.size), int(world), arr
        self._ptr = ptr("int32_t *", arr)

    # -- construction ------------------------------------------------------------------

    @classmethod
    def even(cls, world: int, buckets: int = BUCKETS) -> OwnerMap:
        """The even split: rank r owns the contiguous buckets [ceil(r B / W),
        ceil((r + 1) B / W)), so every rank has floor or ceil of B / W."""
        world = _int(world, "world", 1, 1 << 30)
        buckets = _int(buckets, "buckets", 1, MAX_BUCKETS)
        m = _EVEN.get((world, buckets))
        if m is None:
            b = np.arange(buckets, dtype=np.int64)
            m = cls(b * world // buckets, world)
            if len(_EVEN) < 64:  # maps are immutable: share the common ones
                _EVEN[(world, buckets)] = m
        return m

    def without(self, lost_ranks) -> OwnerMap:
        """The map after losing `lost_ranks`: the survivors are renumbered densely in
        their old order (as MPI_Comm_shrink does: survivor s becomes the number of
        survivors before it), keep every bucket they had, and share the lost ranks'
        buckets so that the fewest-loaded get them first (water-filling: the result is
        within one bucket of even if this map was). The lost buckets are handed out in
        bucket order, survivor after survivor, so each survivor gets one contiguous
        run of a lost rank's block. Nothing else moves."""
        lost = np.unique(np.asarray(list(lost_ranks), dtype=np.int64))
        if lost.size and (lost[0] < 0 or lost[-1] >= self.world):
            raise errors.InvalidArgumentError(
                f"without: lost ranks {lost.tolist()} must be ranks of the world "
                f"[0, {self.world})")
        if lost.size >= self.world:
            raise errors.InvalidArgumentError(
                f"without: losing ranks {lost.tolist()} leaves no rank of {self.world}")
        if not lost.size:
            return self
        survivors = np.setdiff1d(np.arange(self.world), lost)
        renumber = np.full(self.world, -1, np.int64)
        renumber[survivors] = np.arange(survivors.size)
        new = renumber[self.array]
        freed = np.flatnonzero(new < 0)
        counts = np.bincount(new[new >= 0], minlength=survivors.size)
        quota = _fill_up(counts, freed.size)
        new[freed] = np.repeat(np.arange(survivors.size), quota)
        return OwnerMap(new, survivors.size)

    def grow(self, new_world: int) -> OwnerMap:
        """The map after adding ranks world .. new_world - 1: the new ranks take
        buckets from the most loaded ranks until the world is as even as it can be
        without moving any bucket between old ranks (within one bucket of even if this
        map was). Each old rank gives up the last of its buckets; the new ranks take
        the given-up buckets in bucket order, rank after rank. Nothing else moves."""
        new_world = _int(new_world, "grow: new_world", self.world, 1 << 30)
        if new_world == self.world:
            return self
        counts = np.bincount(self.array, minlength=self.world)
        q, rem = divmod(self.buckets, new_world)
        # the old ranks that keep q + 1: the fullest first (ties: the lower rank)
        order = np.lexsort((np.arange(self.world), -counts))
        target = np.full(self.world, q, np.int64)
        big = order[:rem][counts[order[:rem]] > q]
        target[big] = q + 1
        keep = np.minimum(counts, target)
        # each old rank keeps its first `keep` buckets (in bucket order)
        by_rank = np.argsort(self.array, kind="stable")
        start = np.concatenate([[0], np.cumsum(counts)[:-1]])
        nth = np.empty(self.buckets, np.int64)
        nth[by_rank] = np.arange(self.buckets) - np.repeat(start, counts)
        freed = np.flatnonzero(nth >= keep[self.array])
        added = new_world - self.world
        share = np.full(added, freed.size // added, np.int64)
        share[:freed.size % added] += 1
        new = self.array.astype(np.int64)
        new[freed] = self.world + np.repeat(np.arange(added), share)
        return OwnerMap(new, new_world)

    # -- lookups -----------------------------------------------------------------------

    def owner_of(self, keys) -> np.ndarray:
        """Owner rank (int32) of each key."""
        k = as_keys(keys)
        out = np.empty(k.size, np.int32)
        check(lib.kv_owner_batch(ptr("int64_t *", k), k.size, self._ptr, self.buckets,
                                 self.world, ptr("int32_t *", out)), "owner_of")
        return out

    def bucket_of(self, keys) -> np.ndarray:
        """Bucket (int32) of each key among this map's buckets."""
        return bucket_of(keys, self.buckets)

    def counts(self) -> np.ndarray:
        """Buckets each rank owns (int64 [world])."""
        return np.bincount(self.array, minlength=self.world)

    def buckets_of_rank(self, rank: int) -> np.ndarray:
        """The buckets `rank` owns, ascending (int64)."""
        return np.flatnonzero(self.array == _int(rank, "rank", 0, self.world - 1))

    # -- the manifest ------------------------------------------------------------------

    def to_json(self) -> dict:
        """{"buckets", "world", "runs"}: runs is [rank, length, rank, length, ...], the
        map's runs of consecutive buckets of one rank in bucket order (2 numbers per
        rank for the even map)."""
        a = self.array
        starts = np.flatnonzero(np.concatenate([[True], a[1:] != a[:-1]]))
        lengths = np.diff(np.concatenate([starts, [a.size]]))
        runs = np.stack([a[starts].astype(np.int64), lengths], axis=1).reshape(-1)
        return {"buckets": self.buckets, "world": self.world, "runs": runs.tolist()}

    @classmethod
    def from_json(cls, d) -> OwnerMap:
        """The map to_json wrote; InvalidArgumentError naming what is wrong otherwise."""
        if not isinstance(d, dict) or not {"buckets", "world", "runs"} <= set(d):
            raise errors.InvalidArgumentError(
                f"an owner map must be a dict with buckets, world and runs, got {d!r:.200}")
        buckets = _int(d["buckets"], "owner map: buckets", 1, MAX_BUCKETS)
        world = _int(d["world"], "owner map: world", 1, 1 << 30)
        runs = d["runs"]
        if not isinstance(runs, list) or len(runs) % 2 or len(runs) > 2 * buckets or \
                not all(isinstance(x, int) and not isinstance(x, bool) and
                        abs(x) < 1 << 62 for x in runs):
            raise errors.InvalidArgumentError(
                "owner map: runs must be a list of integers [rank, length, ...] (each "
                f"below 2**62), at most 2 per bucket, got {runs!r:.200}")
        pairs = np.array(runs, np.int64).reshape(-1, 2)
        if (pairs[:, 1] < 1).any() or int(pairs[:, 1].sum()) != buckets:
            raise errors.InvalidArgumentError(
                f"owner map: run lengths must be >= 1 and sum to its {buckets} buckets, "
                f"got a sum of {int(pairs[:, 1].sum())}")
        return cls(np.repeat(pairs[:, 0], pairs[:, 1]), world)

    # -- value semantics ---------------------------------------------------------------

    def __eq__(self, other) -> bool:
        return isinstance(other, OwnerMap) and self.world == other.world and \
            self.buckets == other.buckets and np.array_equal(self.array, other.array)

    def __hash__(self) -> int:
        return hash((self.world, self.buckets, self.array.tobytes()))

    def __repr__(self) -> str:
        c = self.counts()
        even = self == OwnerMap.even(self.world, self.buckets)
        return (f"OwnerMap({'even, ' if even else ''}world={self.world}, "
                f"buckets={self.buckets}, per rank {int(c.min())}..{int(c.max())})")


_EVEN: dict = {}


def _fill_up(counts: np.ndarray, extra: int) -> np.ndarray:
    """How many of `extra` new buckets each rank gets so that the least loaded are
    filled first (water-filling): the largest level T with sum(max(0, T - counts)) <=
    extra, then one more to the lowest ranks at T until none is left."""
    counts = counts.astype(np.int64)
    lo, hi = int(counts.min()), int(counts.min()) + extra
    while lo < hi:  # largest T whose fill fits
        mid = (lo + hi + 1) // 2
        if int(np.maximum(0, mid - counts).sum()) <= extra:
            lo = mid
        else:
            hi = mid - 1
    quota = np.maximum(0, lo - counts)
    left = extra - int(quota.sum())
    at_level = np.flatnonzero(counts + quota == lo)
    quota[at_level[:left]] += 1
    return quota


def _owners(owners) -> OwnerMap:
    """An OwnerMap, or the even map of a world size."""
    if isinstance(owners, OwnerMap):
        return owners
    return OwnerMap.even(_int(owners, "world", 1, 1 << 30))


def owners_for(comm, owners=None) -> OwnerMap:
    """The map an exchange or a checkpointer on `comm` routes by: `owners` (an
    OwnerMap of comm.size ranks), or by default the even map of comm.size."""
    if owners is None:
        return OwnerMap.even(comm.size)
    if not isinstance(owners, OwnerMap) or owners.world != comm.size:
        raise errors.InvalidArgumentError(
            f"owners must be a kvcoll.routing.OwnerMap of the communicator's {comm.size} "
            f"ranks, got {owners!r:.200}; build one with OwnerMap.even({comm.size}) or "
            "from the map of a smaller or larger world with without() / grow()")
    return owners


def owner_of(keys, owners) -> np.ndarray:
    """Owner rank (int32) of each key under `owners`: an OwnerMap, or a world size
    (its even map)."""
    return _owners(owners).owner_of(keys)


def bucket_of(keys, buckets: int = BUCKETS) -> np.ndarray:
    """Bucket (int32) of each key among `buckets`: (mix(key) >> 40) mod buckets."""
    buckets = _int(buckets, "buckets", 1, MAX_BUCKETS)
    k = as_keys(keys)
    out = np.empty(k.size, np.int32)
    check(lib.kv_bucket_batch(ptr("int64_t *", k), k.size, buckets, ptr("int32_t *", out)),
          "bucket_of")
    return out


def unique_partition(keys, owners):
    """Unique keys grouped by owner rank, the inverse index and per-owner counts;
    `owners` is an OwnerMap or a world size (its even map).

    Rank-local example, world=2, keys=[5, 9, 5, 2] (say 5, 2 -> rank 0; 9 -> rank 1):
    uniq=[5, 2, 9], inverse=[0, 2, 0, 1], counts=[2, 1].
    """
    m = _owners(owners)
    k = as_keys(keys)
    uniq = np.empty(k.size, np.int64)
    inverse = np.empty(k.size, np.int64)
    counts = np.empty(m.world, np.int64)
    n = ffi.new("int64_t *")
    check(lib.kv_unique_partition(ptr("int64_t *", k), k.size, m._ptr, m.buckets, m.world,
                                  ptr("int64_t *", uniq), ptr("int64_t *", inverse),
                                  ptr("int64_t *", counts), n), "unique_partition")
    return uniq[: int(n[0])], inverse, counts


def segment_sum(keys, rows):
    """Unique keys (first-appearance order) and the sum of the rows of each."""
    k = as_keys(keys)
    r = np.ascontiguousarray(rows, np.float32)
    if r.ndim != 2 or r.shape[0] != k.size:
        raise errors.DimensionError(
            f"rows must have shape ({k.size}, dim), got {r.shape}")
    uniq = np.empty(k.size, np.int64)
    sums = np.empty_like(r)
    n = ffi.new("int64_t *")
    check(lib.kv_segment_sum(ptr("int64_t *", k), k.size, ptr("float *", r), r.shape[1],
                             ptr("int64_t *", uniq), ptr("float *", sums), n),
          "segment_sum")
    return uniq[: int(n[0])], sums[: int(n[0])]
