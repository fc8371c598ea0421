"""KvTable: one rank's shard of one embedding table, backed by the C core.

This is the only module that calls the C library. Every call is one C call per
batch: numpy arrays cross zero-copy after their dtype, shape and contiguity have been
checked here, and the C side validates values (finite, in range) before it changes
anything, so an error leaves the table exactly as it was. Status codes become typed
exceptions in one place, `_check`.

    >>> t = KvTable(4, name="user", optimizer=optimizers.Adagrad(0.1))
    >>> rows = t.find_or_create(np.array([7, 42, 7]))     # (3, 4) float32
    >>> t.apply_gradients(np.array([7, 42]), np.ones((2, 4), np.float32), step=1)
    >>> len(t), t.stats().bytes_per_row_overhead
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading

import numpy as np

from . import errors, optimizers

try:
    from ._kvcoll_c import ffi, lib
except ImportError as exc:  # pragma: no cover - exercised only without a build
    raise ImportError(
        "kvcoll's C extension is not built: run `./dev build` (or `pip install .`) "
        f"from the kvcoll checkout ({exc})"
    ) from exc

__all__ = ["KvTable", "Initializer", "TableStats", "owner_of", "unique_partition",
           "segment_sum", "hash64"]

_OPT_KINDS = {
    "sgd": lib.KV_OPT_SGD,
    "adagrad": lib.KV_OPT_ADAGRAD,
    "adam": lib.KV_OPT_ADAM,
    "ftrl": lib.KV_OPT_FTRL,
    "group_adam": lib.KV_OPT_GROUP_ADAM,
    "group_adagrad": lib.KV_OPT_GROUP_ADAGRAD,
}

_ERRORS = {
    lib.KV_ENOMEM: errors.CapacityError,
    lib.KV_EINVAL: errors.InvalidArgumentError,
    lib.KV_ENONFINITE: errors.NonFiniteError,
    lib.KV_EFULL: errors.TableFullError,
    lib.KV_EOPTIM: errors.InvalidArgumentError,
    lib.KV_EINIT: errors.InvalidArgumentError,
}


def _check(status: int, what: str) -> None:
    """Turn a C status code into the matching exception (the one place that does)."""
    if status == lib.KV_OK:
        return
    text = ffi.string(lib.kv_strerror(status)).decode()
    raise _ERRORS.get(status, errors.KvcollError)(f"{what}: {text}")


@dataclasses.dataclass(frozen=True)
class Initializer:
    """How a new key's embedding is drawn: from (seed, table, key) alone.

    kind: "zeros", "constant" (value a), "uniform" ([a, b)), "normal" (mean a,
    stddev b) or "truncated_normal" (mean a, stddev b, redrawn beyond 2 stddev).
    """

    kind: str = "zeros"
    a: float = 0.0
    b: float = 0.0

    _KINDS = {"zeros": 0, "constant": 1, "uniform": 2, "normal": 3, "truncated_normal": 4}

    def __post_init__(self):
        if self.kind not in self._KINDS:
            raise errors.InvalidArgumentError(
                f"initializer kind {self.kind!r} is unknown; use one of {sorted(self._KINDS)}")
        if self.kind == "uniform" and not self.a < self.b:
            raise errors.InvalidArgumentError(
                f"uniform initializer needs low < high, got [{self.a}, {self.b})")
        if self.kind in ("normal", "truncated_normal") and not self.b > 0:
            raise errors.InvalidArgumentError(
                f"{self.kind} initializer needs stddev > 0, got {self.b}")

    @classmethod
    def parse(cls, spec) -> "Initializer":
        """Accept an Initializer, "zeros", ("constant", v), ("uniform", lo, hi),
        ("normal", mean, std) or ("truncated_normal", mean, std)."""
        if isinstance(spec, Initializer):
            return spec
        if isinstance(spec, str):
            spec = (spec,)
        if not isinstance(spec, (tuple, list)) or not spec or not isinstance(spec[0], str):
            raise errors.InvalidArgumentError(
                f"initializer {spec!r} is not understood; use e.g. 'zeros', "
                "('uniform', -0.05, 0.05) or ('normal', 0.0, 0.01)")
        kind, *params = spec
        arity = {"zeros": 0, "constant": 1, "uniform": 2, "normal": 2, "truncated_normal": 2}
        if kind in arity and len(params) != arity[kind]:
            raise errors.InvalidArgumentError(
                f"initializer {kind!r} takes {arity[kind]} parameter(s), got {len(params)}")
        params = [float(p) for p in params] + [0.0, 0.0]
        return cls(kind, params[0], params[1])


@dataclasses.dataclass(frozen=True)
class TableStats:
    """A snapshot of one shard's size and memory."""

    rows: int
    row_capacity: int
    index_slots: int
    bytes: int
    row_bytes: int
    dim: int
    slot_floats: int
    load_factor: float

    @property
    def bytes_per_row_overhead(self) -> float:
        """Bytes per live row beyond its own floats (embedding + optimizer slots)."""
        if self.rows == 0:
            return 0.0
        return (self.bytes - self.rows * 4 * (self.dim + self.slot_floats)) / self.rows


def _table_id(name: str) -> int:
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


_EMPTY = np.zeros(8, np.int64)  # a valid address for zero-length batches


def _ptr(ctype: str, arr: np.ndarray):
    """Zero-copy pointer into a checked, C-contiguous array (never NULL)."""
    return ffi.cast(ctype, ffi.from_buffer(arr if arr.size else _EMPTY))


class KvTable:
    """One rank's shard of a growable int64 -> float32[dim] table with a row optimizer.

    Thread-safe: finds run concurrently, everything else is serialised by the table's
    own lock in C. Close it explicitly (or use `with`); memory is not left to the GC.
    """

    def __init__(self, dim: int, *, name: str = "table", seed: int = 0,
                 initializer="zeros", optimizer=None,
                 initial_capacity: int = 0):
        if not isinstance(dim, (int, np.integer)) or isinstance(dim, bool) \
                or not 1 <= dim <= lib.KV_MAX_DIM:
            raise errors.InvalidArgumentError(
                f"table {name!r}: dim must be an integer in [1, {lib.KV_MAX_DIM}], got {dim!r}")
        if not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**64:
            raise errors.InvalidArgumentError(
                f"table {name!r}: seed must be an integer in [0, 2**64), got {seed!r}")
        if initial_capacity < 0:
            raise errors.InvalidArgumentError(
                f"table {name!r}: initial_capacity must be >= 0, got {initial_capacity}")
        self.name = name
        self.dim = int(dim)
        self.seed = int(seed)
        self.initializer = Initializer.parse(initializer)
        self.optimizer = optimizer if optimizer is not None else optimizers.SGD(0.01)
        if not hasattr(self.optimizer, "_c_fields"):
            raise errors.InvalidArgumentError(
                f"table {name!r}: optimizer must be a kvcoll.optimizers row optimizer "
                f"(SGD, Adagrad, Adam, Ftrl, GroupAdam, GroupAdagrad), got {optimizer!r}")
        self._cfg = ffi.new("kv_table_config_t *")
        self._cfg.dim = self.dim
        self._cfg.init_kind = Initializer._KINDS[self.initializer.kind]
        self._cfg.init_a = self.initializer.a
        self._cfg.init_b = self.initializer.b
        self._cfg.seed = self.seed
        self._cfg.table_id = _table_id(name)
        self._cfg.initial_capacity = int(initial_capacity)
        fill_optim(self._cfg.optim, self.optimizer)
        self.slot_floats = int(lib.kv_optim_slot_floats(ffi.addressof(self._cfg.optim), self.dim))
        out = ffi.new("kv_table_t **")
        _check(lib.kv_table_create(self._cfg, out), f"table {name!r}: create")
        self._t = out[0]
        self._close_lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._t is None

    def close(self) -> None:
        """Free the table's memory now. Further calls raise ClosedError."""
        with self._close_lock:
            t, self._t = self._t, None
        if t is not None:
            lib.kv_table_destroy(t)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "_t", None) is not None:
            self.close()

    def __len__(self) -> int:
        return int(lib.kv_table_size(self._handle()))

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"rows={len(self)}"
        return (f"KvTable({self.name!r}, dim={self.dim}, "
                f"optimizer={type(self.optimizer).__name__}, {state})")

    def _handle(self):
        t = self._t
        if t is None:
            raise errors.ClosedError(f"table {self.name!r} is closed; create a new KvTable")
        return t

    # -- argument checks ---------------------------------------------------------------

    def _keys(self, keys, what: str = "ids") -> np.ndarray:
        arr = np.asarray(keys)
        if arr.dtype == np.int32 or (arr.dtype == np.int64):
            pass
        elif arr.size == 0 and arr.dtype == np.float64:  # np.asarray([]) is float64
            arr = arr.astype(np.int64)
        else:
            raise errors.InvalidArgumentError(
                f"table {self.name!r}: {what} must be int64 or int32, got {arr.dtype}; "
                "hash string ids to int64 first")
        if arr.ndim != 1:
            raise errors.InvalidArgumentError(
                f"table {self.name!r}: {what} must be 1-D, got shape {arr.shape}; "
                "flatten them (ragged ids: pass the flat values)")
        return np.ascontiguousarray(arr, dtype=np.int64)

    def _rows(self, values, n: int, what: str, width: int | None = None) -> np.ndarray:
        width = self.dim if width is None else width
        arr = np.asarray(values)
        if arr.dtype.kind != "f":
            raise errors.InvalidArgumentError(
                f"table {self.name!r}: {what} must be floating point, got {arr.dtype}")
        if arr.ndim != 2 or arr.shape[1] != width:
            raise errors.DimensionError(
                f"table {self.name!r}: {what} must have shape ({n}, {width}), got "
                f"{arr.shape}; the table's dim is {self.dim}")
        if arr.shape[0] != n:
            raise errors.InvalidArgumentError(
                f"table {self.name!r}: {what} has {arr.shape[0]} rows for {n} ids; "
                "give one row per id")
        return np.ascontiguousarray(arr, dtype=np.float32)

    def _u32(self, values, n: int, what: str) -> np.ndarray | None:
        if values is None:
            return None
        arr = np.asarray(values)
        if arr.dtype.kind not in "iu" or arr.shape != (n,):
            raise errors.InvalidArgumentError(
                f"table {self.name!r}: {what} must be {n} integers, got {arr.dtype} {arr.shape}")
        if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
            raise errors.InvalidArgumentError(
                f"table {self.name!r}: {what} must be in [0, 2**32)")
        return np.ascontiguousarray(arr, dtype=np.uint32)

    # -- batch operations ----------------------------------------------------------------

    def find(self, keys, *, default=None, return_found: bool = False):
        """Rows of `keys` as a new (n, dim) float32 array; absent keys read `default`
        (a dim-vector, zeros if None). With return_found, also a bool mask."""
        k = self._keys(keys)
        out = np.empty((k.size, self.dim), np.float32)
        found = np.empty(k.size, np.uint8)
        dflt = ffi.NULL
        if default is not None:
            d = np.ascontiguousarray(default, np.float32)
            if d.shape != (self.dim,):
                raise errors.DimensionError(
                    f"table {self.name!r}: default must have shape ({self.dim},), got {d.shape}")
            dflt = ffi.cast("float *", ffi.from_buffer(d))
        _check(lib.kv_table_find(self._handle(), _ptr("int64_t *", k), k.size,
                                 _ptr("float *", out), _ptr("uint8_t *", found), dflt),
               f"table {self.name!r}: find")
        return (out, found.astype(bool)) if return_found else out

    def find_or_create(self, keys, *, step: int = 0) -> np.ndarray:
        """Rows of `keys`, creating absent keys with their initial value; marks every
        returned row as touched at `step`."""
        k = self._keys(keys)
        out = np.empty((k.size, self.dim), np.float32)
        created = ffi.new("int64_t *")
        _check(lib.kv_table_find_or_create(self._handle(), _ptr("int64_t *", k), k.size,
                                           _ptr("float *", out), _step32(step), created),
               f"table {self.name!r}: find_or_create")
        return out

    def update(self, keys, values) -> None:
        """Assign rows (creating absent keys). Duplicate keys: the last row wins."""
        k = self._keys(keys)
        v = self._rows(values, k.size, "values")
        _check(lib.kv_table_update(self._handle(), _ptr("int64_t *", k), k.size,
                                   _ptr("float *", v)),
               f"table {self.name!r}: update")

    def delete(self, keys) -> int:
        """Remove keys; absent ones are ignored. Returns how many were removed."""
        k = self._keys(keys)
        n = ffi.new("int64_t *")
        _check(lib.kv_table_delete(self._handle(), _ptr("int64_t *", k), k.size, n),
               f"table {self.name!r}: delete")
        return int(n[0])

    def clear(self) -> None:
        """Remove every key."""
        _check(lib.kv_table_clear(self._handle()), f"table {self.name!r}: clear")

    def apply_gradients(self, keys, grads, *, step: int, create_missing: bool = False) -> int:
        """Apply the row optimizer. Duplicate keys are summed, then applied once.
        Rejects NaN/Inf before changing anything. Returns the number of missing keys
        skipped (0 with create_missing)."""
        k = self._keys(keys)
        g = self._rows(grads, k.size, "gradients")
        if not isinstance(step, (int, np.integer)) or step < 1:
            raise errors.InvalidArgumentError(
                f"table {self.name!r}: step must be an integer >= 1, got {step!r}")
        missing = ffi.new("int64_t *")
        flags = lib.KV_APPLY_CREATE_MISSING if create_missing else 0
        _check(lib.kv_table_apply_gradients(self._handle(), _ptr("int64_t *", k), k.size,
                                            _ptr("float *", g), int(step), flags, missing),
               f"table {self.name!r}: apply_gradients")
        return int(missing[0])

    def export(self, *, dirty_only: bool = False, clear_dirty: bool = False,
               batch: int = 1 << 16) -> dict:
        """Every row (or only the dirty ones) as arrays: keys, values, slots,
        last_step, counts, dirty. Arena order; one C call per `batch` rows."""
        t = self._handle()
        flags = (lib.KV_EXPORT_DIRTY_ONLY if dirty_only else 0) | \
                (lib.KV_EXPORT_CLEAR_DIRTY if clear_dirty else 0)
        cursor = ffi.new("int64_t *", 0)
        n_out = ffi.new("int64_t *")
        parts = []
        while True:
            p = {
                "keys": np.empty(batch, np.int64),
                "values": np.empty((batch, self.dim), np.float32),
                "slots": np.empty((batch, self.slot_floats), np.float32),
                "last_step": np.empty(batch, np.uint32),
                "counts": np.empty(batch, np.uint32),
                "dirty": np.empty(batch, np.uint8),
            }
            _check(lib.kv_table_export(
                t, cursor, batch, flags, _ptr("int64_t *", p["keys"]),
                _ptr("float *", p["values"]), _ptr("float *", p["slots"]),
                _ptr("uint32_t *", p["last_step"]), _ptr("uint32_t *", p["counts"]),
                _ptr("uint8_t *", p["dirty"]), n_out), f"table {self.name!r}: export")
            n = int(n_out[0])
            parts.append({name: a[:n] for name, a in p.items()})
            if n < batch:
                break
        out = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
        out["dirty"] = out["dirty"].astype(bool)
        return out

    def import_(self, keys, values, *, slots=None, last_step=None, counts=None) -> None:
        """Insert or overwrite whole rows (the inverse of export); imported rows are
        clean. Missing slots start at the optimizer's initial state."""
        k = self._keys(keys)
        v = self._rows(values, k.size, "values")
        s = None if slots is None else self._rows(slots, k.size, "slots", self.slot_floats)
        ls = self._u32(last_step, k.size, "last_step")
        c = self._u32(counts, k.size, "counts")
        _check(lib.kv_table_import(
            self._handle(), _ptr("int64_t *", k), k.size, _ptr("float *", v),
            ffi.NULL if s is None else _ptr("float *", s),
            ffi.NULL if ls is None else _ptr("uint32_t *", ls),
            ffi.NULL if c is None else _ptr("uint32_t *", c)),
            f"table {self.name!r}: import")

    def initial_values(self, keys) -> np.ndarray:
        """The value find_or_create would give each key if it were new."""
        k = self._keys(keys)
        out = np.empty((k.size, self.dim), np.float32)
        _check(lib.kv_initial_values(self._cfg, _ptr("int64_t *", k), k.size,
                                     _ptr("float *", out)),
               f"table {self.name!r}: initial_values")
        return out

    def stats(self) -> TableStats:
        """Rows, capacity, bytes held and load factor of this shard."""
        s = ffi.new("kv_table_stats_t *")
        _check(lib.kv_table_stats(self._handle(), s), f"table {self.name!r}: stats")
        return TableStats(int(s.rows), int(s.row_capacity), int(s.index_slots), int(s.bytes),
                          int(s.row_bytes), int(s.dim), int(s.slot_floats),
                          float(s.load_factor))


def fill_optim(c_optim, optimizer) -> None:
    """Copy a row optimizer's hyperparameters into a kv_optim_t and check them in C."""
    for field, value in optimizer._c_fields().items():
        setattr(c_optim, field, _OPT_KINDS[value] if field == "kind" else value)
    _check(lib.kv_optim_check(ffi.addressof(c_optim)), f"optimizer {optimizer!r}")


def _step32(step) -> int:
    if not isinstance(step, (int, np.integer)) or step < 0:
        raise errors.InvalidArgumentError(f"step must be an integer >= 0, got {step!r}")
    return int(step) & 0xFFFFFFFF


def _ids(keys) -> np.ndarray:
    arr = np.asarray(keys)
    if arr.dtype not in (np.int64, np.int32) or arr.ndim != 1:
        raise errors.InvalidArgumentError(
            f"ids must be a 1-D int64 or int32 array, got {arr.dtype} {arr.shape}")
    return np.ascontiguousarray(arr, dtype=np.int64)


def hash64(keys) -> np.ndarray:
    """kvcoll's 64-bit mix of each key (uint64), the hash routing and buckets use."""
    k = _ids(keys)
    out = np.empty(k.size, np.uint64)
    _check(lib.kv_hash_batch(_ptr("int64_t *", k), k.size, _ptr("uint64_t *", out)), "hash64")
    return out


def owner_of(keys, world: int) -> np.ndarray:
    """Owner rank (int32) of each key in a world of `world` ranks."""
    k = _ids(keys)
    out = np.empty(k.size, np.int32)
    _check(lib.kv_owner_batch(_ptr("int64_t *", k), k.size, int(world),
                              _ptr("int32_t *", out)), "owner_of")
    return out


def unique_partition(keys, world: int):
    """Unique keys grouped by owner rank, the inverse index and per-owner counts.

    Rank-local example, world=2, keys=[5, 9, 5, 2] (say 5, 2 -> rank 0; 9 -> rank 1):
    uniq=[5, 2, 9], inverse=[0, 2, 0, 1], counts=[2, 1].
    """
    k = _ids(keys)
    uniq = np.empty(k.size, np.int64)
    inverse = np.empty(k.size, np.int64)
    counts = np.empty(int(world), np.int64)
    n = ffi.new("int64_t *")
    _check(lib.kv_unique_partition(_ptr("int64_t *", k), k.size, int(world),
                                   _ptr("int64_t *", uniq), _ptr("int64_t *", inverse),
                                   _ptr("int64_t *", counts), n), "unique_partition")
    return uniq[: int(n[0])], inverse, counts


def segment_sum(keys, rows):
    """Unique keys (first-appearance order) and the sum of the rows of each."""
    k = _ids(keys)
    r = np.ascontiguousarray(rows, np.float32)
    if r.ndim != 2 or r.shape[0] != k.size:
        raise errors.DimensionError(
            f"rows must have shape ({k.size}, dim), got {r.shape}")
    uniq = np.empty(k.size, np.int64)
    sums = np.empty_like(r)
    n = ffi.new("int64_t *")
    _check(lib.kv_segment_sum(_ptr("int64_t *", k), k.size, _ptr("float *", r), r.shape[1],
                              _ptr("int64_t *", uniq), _ptr("float *", sums), n),
           "segment_sum")
    return uniq[: int(n[0])], sums[: int(n[0])]
