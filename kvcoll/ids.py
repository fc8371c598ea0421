"""What an id is: the int64 key a table row is stored under, and how ids become one.

Ids are int64; int32 ids are widened, and string ids (str, bytes, or numpy/object arrays
of them) are hashed to int64 keys, the same on every rank and in every run, so equal
strings meet the same row. Anything else (floats, unsigned integers, 2-D arrays) is
refused with a message that says how to fix it, never truncated or cast silently.
`as_keys` is the one place that decides this; tables, routing, the Keras layer and the
readers all call it (or `hash_strings` / `arrow_keys`).

The string hash is part of a model's state, not a constant:
- "farmhash64" (the default for new models): FarmHash Fingerprint64, what TensorFlow's
  tf.fingerprint computes, so an exported SavedModel hashes raw strings in its graph;
- "xxh64": XXH64 with seed 0, what every model used before (a checkpoint whose
  manifest names no "id_hash" used it).
A run has one hash (`id_hash()`): the setting `id_hash` (kv.init(id_hash=...),
--id-hash, KVCOLL_ID_HASH), or with the default "auto" farmhash64 for a new model and,
when a checkpoint is restored before this process hashed any string id, the
checkpoint's own (`adopt_id_hash`). A restore whose hash differs from one the run has
already used or was told to use is refused (never mixed keys), with an error naming
the setting to use.

    >>> as_keys([7, 42])                        # array([ 7, 42]), int64
    >>> as_keys(np.array(["68fd1e64", "80e26c9b"]))   # their keys under id_hash()
    >>> as_keys(np.array([1.5]), table="user")  # InvalidArgumentError naming 'user'
"""

from __future__ import annotations

import threading

import numpy as np

from . import errors
from ._c import check, ffi, lib, ptr
from .config import Config

__all__ = ["DEFAULT_ID_HASH", "ID_HASHES", "LEGACY_ID_HASH", "STRING_HASH_SEED",
           "adopt_id_hash", "arrow_keys", "as_keys", "hash64", "hash_strings", "id_hash",
           "id_hash_conflict", "string_features"]

# The string hashes a model may use (name -> csrc/kv_ids.h constant). A model keeps the
# one it was trained with: its keys are that hash's, so changing it moves every string key.
ID_HASHES = {"farmhash64": lib.KV_ID_FARMHASH64, "xxh64": lib.KV_ID_XXH64}
DEFAULT_ID_HASH = "farmhash64"  # new models
LEGACY_ID_HASH = "xxh64"        # checkpoints written before the hash was recorded
# XXH64's seed for string ids under "xxh64" (fixed: another would move every key).
STRING_HASH_SEED = 0

# The run's hash: name (None until first needed), where it came from ("default",
# "setting", "checkpoint"), whether a string id was hashed with it, and the names of
# inputs that readers fed as strings (for the export's signature).
_run = {"name": None, "source": None, "used": False, "strings": set()}
_lock = threading.Lock()


def _setting() -> str:
    """The id_hash setting before kv.init (KVCOLL_ID_HASH; kv.init applies the run's
    Config itself through configure())."""
    return Config.resolve([]).id_hash


def _current(use: bool) -> str:
    with _lock:
        if _run["name"] is None:
            setting = _setting()
            _run["name"], _run["source"] = (DEFAULT_ID_HASH, "default") if setting == "auto" \
                else (setting, "setting")
        if use:
            _run["used"] = True
        return _run["name"]


def id_hash() -> str:
    """The string hash of this run ("farmhash64" or "xxh64"): see the module docstring."""
    return _current(False)


def configure(setting: str) -> None:
    """Apply the run's id_hash setting (kv.init calls this): "auto" keeps the default (or
    what a restore adopted); a hash name fixes it. Raises InvalidArgumentError if this
    process already hashed string ids with another hash (before kv.init)."""
    with _lock:
        if setting == "auto":
            if _run["name"] is None:
                _run["name"], _run["source"] = DEFAULT_ID_HASH, "default"
            return
        if _run["used"] and _run["name"] != setting:
            raise errors.InvalidArgumentError(
                f"id_hash={setting!r}, but this process already hashed string ids with "
                f"{_run['name']!r} before kv.init; call kv.init (or set KVCOLL_ID_HASH="
                f"{setting}) before reading string ids")
        _run["name"], _run["source"] = setting, "setting"


def _conflict(saved: str, where: str) -> str | None:
    """(Under _lock, the run's hash resolved.)"""
    name = _run["name"]
    if saved == name:
        return None
    if saved not in ID_HASHES:
        return (f"{where} names id_hash {saved!r}, which this kvcoll does not know "
                f"(known: {', '.join(ID_HASHES)}); upgrade kvcoll to restore it")
    if _run["source"] == "setting":
        why = "the id_hash setting says so"
    elif _run["used"]:
        why = "this process already hashed string ids with it"
    else:
        return None  # adoptable
    return (f"{where} was written with id_hash {saved!r}, but this run hashes string ids "
            f"with {name!r} ({why}): string keys would not match. Run with --id-hash {saved} "
            f"(or KVCOLL_ID_HASH={saved}, or kv.init(id_hash={saved!r})), set before any "
            "string id is read")


def id_hash_conflict(saved: str, where: str) -> str | None:
    """Why a checkpoint hashed with `saved` cannot be restored into this run (an error
    message naming the setting to use), or None when it can: the same hash, or a run
    whose hash is still open (default "auto" and no string id hashed yet), which then
    adopts it (`adopt_id_hash`). Changes nothing."""
    _current(False)
    with _lock:
        return _conflict(saved, where)


def adopt_id_hash(saved: str, where: str) -> None:
    """Make `saved` the run's hash (after a restore every rank verified): a no-op when it
    already is. Raises KvcollError if the run can no longer change (a string id was
    hashed since `id_hash_conflict` said yes: a restore racing a reader)."""
    _current(False)
    with _lock:
        err = _conflict(saved, where)
        if err:
            raise errors.KvcollError(err)
        if _run["name"] != saved:
            _run["name"], _run["source"] = saved, "checkpoint"


def note_string_features(names) -> None:
    """Record model input names that a reader feeds with hashed string ids, so the export
    declares them as strings (readers call this; `string_features()` reads it)."""
    with _lock:
        _run["strings"].update(names)


def string_features() -> set:
    """Input names that readers of this process fed with hashed string ids."""
    with _lock:
        return set(_run["strings"])


def _code(hash: str | None) -> int:
    """The C constant of `hash` (None: the run's, marking it used)."""
    if hash is None:
        return ID_HASHES[_current(True)]
    if hash not in ID_HASHES:
        raise errors.InvalidArgumentError(
            f"id hash {hash!r} is unknown; use one of {', '.join(ID_HASHES)}")
    return ID_HASHES[hash]

# The fix for ids of a refused dtype, keyed by dtype kind and size; else _STRING_HINT.
_FIXES = {
    "u4": "; cast them with .astype(np.int64)",
    "u8": "; if they are opaque 64-bit values, view them as int64 with .view(np.int64)",
}
_STRING_HINT = " (string ids are accepted too: they are hashed with kvcoll.ids.hash_strings)"


def as_keys(values, what: str = "ids", *, table: str | None = None) -> np.ndarray:
    """`values` as table keys: a 1-D, C-contiguous int64 array (int64 input as it is).

    int32 is widened; str, bytes and object arrays are hashed with `hash_strings` (the
    run's hash);
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


def hash_strings(values, hash: str | None = None) -> np.ndarray:
    """int64 keys of string ids: `hash` (default: the run's, `id_hash()`) of each id's
    UTF-8 bytes (bytes are hashed as they are). "farmhash64" is FarmHash Fingerprint64,
    bit for bit what tf.bitcast(tf.fingerprint(ids), tf.int64) gives for a 1-D string
    tensor; "xxh64" is the published xxHash64 with seed STRING_HASH_SEED = 0.

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
    code = _code(hash)
    if _is_arrow(values):
        keys, valid = arrow_keys(values, _name(code))
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
                                code, ptr("int64_t *", out)), "hash_strings")
    elif arr.dtype.kind == "U":
        buf = np.ascontiguousarray(flat, dtype=arr.dtype.newbyteorder("="))
        bad = np.full(1, -1, np.int64)
        status = lib.kv_hash_ucs4(ptr("uint32_t *", buf.view(np.uint32)), arr.dtype.itemsize // 4,
                                  n, code, ptr("int64_t *", out), ptr("int64_t *", bad))
        if bad[0] >= 0:
            raise errors.InvalidArgumentError(
                f"string ids must be valid text: id {int(bad[0])} ({str(flat[bad[0]])!r}) "
                "holds a code point UTF-8 cannot encode (a lone surrogate)")
        check(status, "hash_strings")
    elif arr.dtype.kind == "O":
        return _hash_objects(flat, code).reshape(shape)
    else:
        raise errors.InvalidArgumentError(
            f"hash_strings takes strings or bytes, got {arr.dtype}")
    return out.reshape(shape)


def _name(code: int) -> str:
    return next(k for k, v in ID_HASHES.items() if v == code)


def _hash_objects(flat: np.ndarray, code: int) -> np.ndarray:
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
            return arrow_keys(binary, _name(code))[0]
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
                              ptr("int64_t *", lens), n, code,
                              ptr("int64_t *", out)), "hash_strings")
    return out


def _is_arrow(values) -> bool:
    return type(values).__module__.startswith("pyarrow") and hasattr(values, "type")


def arrow_keys(values, hash: str | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Keys of a pyarrow string or binary array under `hash` (default: the run's), and
    where it is valid.

    Returns (keys int64 [n], valid bool [n] or None when no entry is null); a null's
    key is that of the empty string, for the caller to replace (readers give nulls a
    reserved id). Arrays of the string, binary and their large_ types are hashed over
    their own offsets and bytes, one C call per chunk; view types are cast to
    large_binary first; a dictionary-encoded array hashes its dictionary once and
    takes its keys by index.
    """
    import pyarrow as pa

    code = _code(hash)
    hash = _name(code)
    if isinstance(values, pa.ChunkedArray):
        parts = [arrow_keys(c, hash) for c in values.chunks]
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
        dict_keys, dict_valid = arrow_keys(values.dictionary, hash)
        idx = values.indices.fill_null(0).to_numpy(zero_copy_only=False).astype(np.intp)
        if dict_valid is not None and not dict_valid[idx].all():
            valid = dict_valid[idx] if valid is None else valid & dict_valid[idx]
        return (dict_keys[idx] if dict_keys.size else np.zeros(n, np.int64)), valid
    if pa.types.is_string(t) or pa.types.is_binary(t):
        width, fn = 4, lib.kv_hash_offsets32
    elif pa.types.is_large_string(t) or pa.types.is_large_binary(t):
        width, fn = 8, lib.kv_hash_offsets64
    elif t in (pa.string_view(), pa.binary_view()):
        return arrow_keys(values.cast(pa.large_binary()), hash)
    else:
        raise errors.InvalidArgumentError(
            f"string ids must be a pyarrow string or binary array, got {t}")
    bufs = values.buffers()
    offsets = np.frombuffer(bufs[1], np.int32 if width == 4 else np.int64, count=n + 1,
                            offset=values.offset * width)
    data = np.frombuffer(bufs[2], np.uint8) if bufs[2] is not None and bufs[2].size else None
    out = np.empty(n, np.int64)
    check(fn(ptr("uint8_t *", data) if data is not None else ffi.NULL,
             ptr("int32_t *" if width == 4 else "int64_t *", offsets), n, code,
             ptr("int64_t *", out)), "hash_strings")
    return out, valid


def hash64(keys) -> np.ndarray:
    """kvcoll's 64-bit mix of each key (uint64), the hash routing and buckets use."""
    k = as_keys(keys)
    out = np.empty(k.size, np.uint64)
    check(lib.kv_hash_batch(ptr("int64_t *", k), k.size, ptr("uint64_t *", out)), "hash64")
    return out
