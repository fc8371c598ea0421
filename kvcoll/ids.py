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
from ._c import check, ffi, lib, ptr

__all__ = ["STRING_HASH_SEED", "arrow_keys", "as_keys", "hash64", "hash_strings"]

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
    hashes. Accepts str, bytes, any array/list of them (numpy 'U', 'S' or object), or
    a pyarrow string/binary array (also large_, view and dictionary-encoded ones, and
    chunked arrays); numpy 'S' and 'U' arrays drop trailing NULs, as numpy itself does.
    Output has the input's shape.

    One C call per array, over its own buffers: numpy 'S' and 'U' arrays in place
    ('U' is encoded to UTF-8 inside C), Arrow arrays through their offsets and bytes,
    object arrays after pyarrow converts them to one binary array (in C++); no Python
    work per id except in that conversion.
    """
    if _is_arrow(values):
        keys, valid = arrow_keys(values)
        if valid is not None:
            raise errors.InvalidArgumentError(
                f"string ids must all be str or bytes, got a null at index "
                f"{int(np.argmin(valid))}; fill nulls first (pyarrow.compute.fill_null)")
        return keys
    arr = np.asarray(values)
    shape = arr.shape
    flat = arr.reshape(-1)
    n = flat.size
    out = np.empty(n, np.int64)
    if arr.dtype.kind == "S":
        buf = np.ascontiguousarray(flat)
        check(lib.kv_hash_fixed(ptr("uint8_t *", buf.view(np.uint8)), arr.dtype.itemsize, n,
                                STRING_HASH_SEED, ptr("int64_t *", out)), "hash_strings")
    elif arr.dtype.kind == "U":
        buf = np.ascontiguousarray(flat, dtype=arr.dtype.newbyteorder("="))
        bad = np.full(1, -1, np.int64)
        status = lib.kv_hash_ucs4(ptr("uint32_t *", buf.view(np.uint32)), arr.dtype.itemsize // 4,
                                  n, STRING_HASH_SEED, ptr("int64_t *", out), ptr("int64_t *", bad))
        if bad[0] >= 0:
            raise errors.InvalidArgumentError(
                f"string ids must be valid text: id {int(bad[0])} ({str(flat[bad[0]])!r}) "
                "holds a code point UTF-8 cannot encode (a lone surrogate)")
        check(status, "hash_strings")
    elif arr.dtype.kind == "O":
        return _hash_objects(flat).reshape(shape)
    else:
        raise errors.InvalidArgumentError(
            f"hash_strings takes strings or bytes, got {arr.dtype}")
    return out.reshape(shape)


def _hash_objects(flat: np.ndarray) -> np.ndarray:
    """Keys of a 1-D object array of str/bytes: pyarrow converts it to one binary array
    (str encoded to UTF-8, bytes as they are) and C hashes that. Anything pyarrow
    refuses (other types, None, bytearray) takes the checking path, which names it."""
    if flat.size:
        binary = None
        try:
            import pyarrow as pa
        except ImportError:
            pa = None
        if pa is not None:
            try:
                binary = pa.array(flat, type=pa.large_binary())
            except (pa.ArrowException, TypeError, ValueError):
                pass                # the checking path below names the culprit
        if binary is not None and binary.null_count == 0:
            return arrow_keys(binary)[0]
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
    n = len(parts)
    lens = np.fromiter((len(p) for p in parts), np.int64, n)
    starts = np.zeros(n, np.int64)
    if n > 1:
        np.cumsum(lens[:-1], out=starts[1:])
    raw = np.frombuffer(b"".join(parts) or b"\0", np.uint8)
    out = np.empty(n, np.int64)
    check(lib.kv_hash_strings(ptr("uint8_t *", raw), ptr("int64_t *", starts),
                              ptr("int64_t *", lens), n, STRING_HASH_SEED,
                              ptr("int64_t *", out)), "hash_strings")
    return out


def _is_arrow(values) -> bool:
    return type(values).__module__.startswith("pyarrow") and hasattr(values, "type")


def arrow_keys(values) -> tuple[np.ndarray, np.ndarray | None]:
    """Keys of a pyarrow string or binary array, and where it is valid.

    Returns (keys int64 [n], valid bool [n] or None when no entry is null); a null's
    key is that of the empty string, for the caller to replace (readers give nulls a
    reserved id). Arrays of the string, binary and their large_ types are hashed over
    their own offsets and bytes, one C call per chunk; view types are cast to
    large_binary first; a dictionary-encoded array hashes its dictionary once and
    takes its keys by index.
    """
    import pyarrow as pa

    if isinstance(values, pa.ChunkedArray):
        parts = [arrow_keys(c) for c in values.chunks]
        keys = np.concatenate([k for k, _ in parts]) if parts else np.empty(0, np.int64)
        if all(v is None for _, v in parts):
            return keys, None
        return keys, np.concatenate([np.ones(k.size, bool) if v is None else v
                                     for k, v in parts])
    t = values.type
    n = len(values)
    valid = None
    if values.null_count:
        valid = values.is_valid().to_numpy(zero_copy_only=False)
    if pa.types.is_dictionary(t):
        dict_keys, dict_valid = arrow_keys(values.dictionary)
        idx = values.indices.fill_null(0).to_numpy(zero_copy_only=False).astype(np.intp)
        if dict_valid is not None and not dict_valid[idx].all():
            valid = dict_valid[idx] if valid is None else valid & dict_valid[idx]
        return (dict_keys[idx] if dict_keys.size else np.zeros(n, np.int64)), valid
    if pa.types.is_string(t) or pa.types.is_binary(t):
        width, fn = 4, lib.kv_hash_offsets32
    elif pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        width, fn = 8, lib.kv_hash_offsets64
    elif t in (pa.string_view(), pa.binary_view()):
        return arrow_keys(values.cast(pa.large_binary()))
    else:
        raise errors.InvalidArgumentError(
            f"string ids must be a pyarrow string or binary array, got {t}")
    bufs = values.buffers()
    offsets = np.frombuffer(bufs[1], np.int32 if width == 4 else np.int64, count=n + 1,
                            offset=values.offset * width)
    data = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None and bufs[2].size else None
    out = np.empty(n, np.int64)
    check(fn(ptr("uint8_t *", data) if data is not None else ffi.NULL,
             ptr("int32_t *" if width == 4 else "int64_t *", offsets), n, STRING_HASH_SEED,
             ptr("int64_t *", out)), "hash_strings")
    return out, valid


def hash64(keys) -> np.ndarray:
    """kvcoll's 64-bit mix of each key (uint64), the hash routing and buckets use."""
    k = as_keys(keys)
    out = np.empty(k.size, np.uint64)
    check(lib.kv_hash_batch(ptr("int64_t *", k), k.size, ptr("uint64_t *", out)), "hash64")
    return out
