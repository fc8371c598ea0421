"""What an id is: the int64 key a table row is stored under, and how ids become one.

Ids are int64; int32 ids are widened, and string ids (str, bytes, or numpy/object arrays
of them) are hashed to int64 with XXH64, the same on every rank and in every run, so
equal strings meet the same row. Anything else (floats, unsigned integers, 2-D arrays)
is refused with a message that says how to fix it, never truncated or cast silently.
`as_keys` is the one place that decides this; tables, routing and the Keras layer all
call it.

    >>> as_keys([7, 42])                        # array([ 7, 42]), int64
    >>> as_keys(np.array(["68fd1e64", "80e26c9b"]))   # their XXH64 keys
    >>> as_keys(np.array([1.5]), table="user")  # InvalidArgumentError naming 'user'
"""

from __future__ import annotations

import numpy as np

from . import errors
from ._c import check, lib, ptr

__all__ = ["as_keys", "hash_strings", "hash64", "STRING_HASH_SEED"]

# XXH64's seed for string ids. Fixed forever: changing it would move every string key.
STRING_HASH_SEED = 0

# The fix for ids of a refused dtype, keyed by dtype kind and size; else _STRING_HINT.
_FIXES = {
    "u4": "; cast them with .astype(np.int64)",
    "u8": "; if they are opaque 64-bit values, view them as int64 with .view(np.int64)",
}
_STRING_HINT = " (string ids are accepted too: they are hashed with kvcoll.ids.hash_strings)"


def as_keys(values, what: str = "ids", *, table: str | None = None) -> np.ndarray:
    """`values` as table keys: a 1-D, C-contiguous int64 array (int64 input as it is).

    int32 is widened; str, bytes and object arrays are hashed with `hash_strings`;
    an empty float64 array (what np.asarray([]) gives) is an empty batch. Anything
    else raises InvalidArgumentError naming `table` (when given), `what`, the dtype or
    shape, and the fix.
    """
    where = "" if table is None else f"table {table!r}: "
    arr = np.asarray(values)
    if arr.dtype.kind in "USO":
        try:
            arr = hash_strings(arr)
        except errors.InvalidArgumentError as exc:
            if table is None:
                raise
            raise errors.InvalidArgumentError(f"{where}{exc}") from None
    elif arr.size == 0 and arr.dtype == np.float64:
        arr = arr.astype(np.int64)
    elif arr.dtype != np.int64 and arr.dtype != np.int32:
        fix = _FIXES.get(f"{arr.dtype.kind}{arr.dtype.itemsize}", _STRING_HINT)
        raise errors.InvalidArgumentError(
            f"{where}{what} must be int64 or int32, got {arr.dtype}{fix}")
    if arr.ndim != 1:
        raise errors.InvalidArgumentError(
            f"{where}{what} must be 1-D, got shape {arr.shape}; "
            "flatten them (ragged ids: pass the flat values)")
    return np.ascontiguousarray(arr, dtype=np.int64)


def hash_strings(values) -> np.ndarray:
    """int64 keys of string ids: XXH64 (the published xxHash64, seed STRING_HASH_SEED
    = 0) of each id's UTF-8 bytes (bytes are hashed as they are).

    Equal strings get equal keys on every rank, in every run and process (unlike
    Python's salted hash()), so they meet the same row. Distinct strings may collide:
    among n distinct ids the probability of any collision is at most n(n-1)/2^65
    (about 2.7e-4 for 10^8 ids, 2.7 % for 10^9); a collision makes two ids share a
    row, it never loses one. Keys are not stored: export and checkpoints hold the
    hashes. Accepts str, bytes, or any array/list of them (numpy 'U', 'S' or object);
    numpy 'S' arrays drop trailing NUL bytes, as numpy itself does. Output has the
    input's shape.
    """
    arr = np.asarray(values)
    shape = arr.shape
    flat = arr.reshape(-1)
    n = flat.size
    if arr.dtype.kind == "S" and arr.dtype.itemsize:
        buf = np.ascontiguousarray(flat)
        lens = np.char.str_len(buf).astype(np.int64)
        starts = np.arange(n, dtype=np.int64) * arr.dtype.itemsize
        raw = buf.view(np.uint8)
    elif arr.dtype.kind in "USO":
        try:
            parts = [v.encode("utf-8") if isinstance(v, str) else bytes(v)
                     if isinstance(v, (bytes, bytearray, memoryview)) else None
                     for v in flat.tolist()]
        except UnicodeEncodeError as exc:
            raise errors.InvalidArgumentError(f"string ids must be valid text: {exc}") from None
        bad = [v for v, p in zip(flat.tolist(), parts) if p is None]
        if bad:
            raise errors.InvalidArgumentError(
                f"string ids must all be str or bytes, got {type(bad[0]).__name__} "
                f"{bad[0]!r}; convert mixed ids with str() first")
        lens = np.fromiter((len(p) for p in parts), np.int64, n)
        starts = np.zeros(n, np.int64)
        if n > 1:
            np.cumsum(lens[:-1], out=starts[1:])
        raw = np.frombuffer(b"".join(parts) or b"\0", np.uint8)
    else:
        raise errors.InvalidArgumentError(
            f"hash_strings takes strings or bytes, got {arr.dtype}")
    out = np.empty(n, np.int64)
    check(lib.kv_hash_strings(ptr("uint8_t *", raw), ptr("int64_t *", starts),
                              ptr("int64_t *", lens), n, STRING_HASH_SEED,
                              ptr("int64_t *", out)), "hash_strings")
    return out.reshape(shape)


def hash64(keys) -> np.ndarray:
    """kvcoll's 64-bit mix of each key (uint64), the hash routing and buckets use."""
    k = as_keys(keys)
    out = np.empty(k.size, np.uint64)
    check(lib.kv_hash_batch(ptr("int64_t *", k), k.size, ptr("uint64_t *", out)), "hash64")
    return out
