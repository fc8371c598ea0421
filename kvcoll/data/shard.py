"""Splitting data over ranks: the even split of a global batch, and `shard` for user data.

Every reader in `kvcoll.data` cuts a global batch of B samples with `even_split`:
rank r gets the contiguous range [lo, hi), the first B % world ranks one sample more
than the others (numpy's `array_split` convention), so concatenating the ranks'
slices in rank order gives back the global batch exactly.

    >>> [even_split(10, r, 3) for r in range(3)]
    [(0, 4), (4, 7), (7, 10)]
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from ..errors import InvalidArgumentError

__all__ = ["even_split", "shard"]


def _check_rank(rank, world) -> tuple[int, int]:
    if isinstance(rank, bool) or isinstance(world, bool):
        raise InvalidArgumentError("rank and world must be integers, got a bool")
    try:
        rank, world = int(rank), int(world)
    except (TypeError, ValueError):
        raise InvalidArgumentError(
            f"rank and world must be integers, got rank={rank!r}, world={world!r}") from None
    if world < 1 or not 0 <= rank < world:
        raise InvalidArgumentError(
            f"need 0 <= rank < world and world >= 1, got rank={rank}, world={world}")
    return rank, world


def even_split(n: int, rank: int, world: int) -> tuple[int, int]:
    """The [lo, hi) range of rank `rank` when n items are split over `world` ranks.

    Sizes differ by at most one; the first n % world ranks get the larger share. Ranks
    may get an empty range when n < world.
    """
    rank, world = _check_rank(rank, world)
    n = int(n)
    if n < 0:
        raise InvalidArgumentError(f"cannot split a negative count, got n={n}")
    q, rem = divmod(n, world)
    lo = rank * q + min(rank, rem)
    return lo, lo + q + (rank < rem)


def _default_rank_world(rank, world) -> tuple[int, int]:
    if rank is not None and world is not None:
        return rank, world
    if rank is not None or world is not None:
        raise InvalidArgumentError("give both rank and world, or neither (to use kvcoll's)")
    from .. import runtime  # imported here so kvcoll.data never loads MPI by itself

    if not runtime.is_initialized():
        raise InvalidArgumentError(
            "shard() without rank and world needs kvcoll.init() first; "
            "or pass rank= and world= explicitly")
    return runtime.rank(), runtime.size()


def shard(data, rank: int | None = None, world: int | None = None):
    """This rank's share of user data: elements rank, rank + world, rank + 2*world, ...

    - a `tf.data.Dataset` (anything with a `.shard(num_shards, index)` method) is
      sharded with that method and returned as a dataset;
    - a sequence (list, tuple, numpy array, anything sliceable with a length) returns
      `data[rank::world]` (a view for numpy arrays);
    - any other iterable returns a lazy iterator over every world-th element.

    rank and world default to kvcoll's (after `kvcoll.init()`). Note that sharding by
    element gives ranks different element counts when the total is not a multiple of
    world; a synchronous training loop must then stop all ranks at the same step.
    """
    rank, world = _check_rank(*_default_rank_world(rank, world))
    shard_method = getattr(data, "shard", None)
    if callable(shard_method) and not isinstance(data, (Sequence, str, bytes)):
        return shard_method(world, rank)
    if isinstance(data, (str, bytes)):
        raise InvalidArgumentError("shard() of a str or bytes is almost surely a mistake; "
                                   "pass a list of records instead")
    if hasattr(data, "__len__") and hasattr(data, "__getitem__"):
        try:
            return data[rank::world]
        except (TypeError, KeyError):
            pass  # a mapping or an object that does not slice: iterate it instead
    if not isinstance(data, Iterable):
        raise InvalidArgumentError(
            f"shard() needs a dataset, a sequence or an iterable, got {type(data).__name__}")
    return itertools.islice(data, rank, None, world)
