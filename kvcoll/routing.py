"""Where keys go: the owner rank of each key, and a batch's ids deduplicated and
grouped by owner before they cross ranks.

The owner is (mix(key) >> 40) mod world, the top 24 bits of kvcoll's 64-bit mix
(`kvcoll.ids.hash64`; a table's buckets use the low bits), so it depends on the key and
the world size only: every rank routes a key to the same owner, and a checkpoint
reshards by recomputing it. Each function is one C call over the whole batch
(csrc/kv_route.h); ids are checked by `kvcoll.ids.as_keys`.
"""

from __future__ import annotations

import numpy as np

from . import errors
from ._c import check, ffi, lib, ptr
from .ids import as_keys

__all__ = ["owner_of", "unique_partition", "segment_sum"]


def owner_of(keys, world: int) -> np.ndarray:
    """Owner rank (int32) of each key in a world of `world` ranks."""
    k = as_keys(keys)
    out = np.empty(k.size, np.int32)
    check(lib.kv_owner_batch(ptr("int64_t *", k), k.size, int(world),
                             ptr("int32_t *", out)), "owner_of")
    return out


def unique_partition(keys, world: int):
    """Unique keys grouped by owner rank, the inverse index and per-owner counts.

    Rank-local example, world=2, keys=[5, 9, 5, 2] (say 5, 2 -> rank 0; 9 -> rank 1):
    uniq=[5, 2, 9], inverse=[0, 2, 0, 1], counts=[2, 1].
    """
    k = as_keys(keys)
    uniq = np.empty(k.size, np.int64)
    inverse = np.empty(k.size, np.int64)
    counts = np.empty(int(world), np.int64)
    n = ffi.new("int64_t *")
    check(lib.kv_unique_partition(ptr("int64_t *", k), k.size, int(world),
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
