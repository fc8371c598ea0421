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

Feature lifecycle (per table): `admit_min_count=K` gives a key a row only once it has
been seen in K find_or_create calls (exactly, or with `admit="bloom"` through a
counting Bloom filter of bounded size); until then it reads zeros and its gradients
are dropped (and counted). `evict()` removes rows not touched for `evict_after_steps`
steps and, beyond `max_rows`, the least recently (or frequently) used ones. String
ids are hashed to int64 with XXH64 (seed 0): see `hash_strings`.

    >>> t = KvTable(8, name="item", admit_min_count=3, max_rows=1_000_000,
    ...             evict_after_steps=10_000)
    >>> t.evict(step)                     # at a cadence, and before saves
    >>> t.find_or_create(np.array(["68fd1e64", "80e26c9b"]), step=step)
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading

import numpy as np

from . import errors, optimizers
from ._buffers import aligned_empty

try:
    from ._kvcoll_c import ffi, lib
except ImportError as exc:  # pragma: no cover - exercised only without a build
    raise ImportError(
        "kvcoll's C extension is not built: run `./dev build` (or `pip install .`) "
        f"from the kvcoll checkout ({exc})"
    ) from exc

__all__ = ["KvTable", "TableSet", "Initializer", "TableStats", "owner_of", "unique_partition",
           "gather_grad",
           "segment_sum", "hash64", "hash_strings", "STRING_HASH_SEED", "slot_floats", "init_slots", "apply_rows",
           "SynthPermutation", "SynthModel", "SYNTH_PERM_ROUNDS"]

# XXH64's seed for string ids. Fixed forever: changing it would move every string key.
STRING_HASH_SEED = 0
_ADMIT = {"exact": lib.KV_ADMIT_EXACT, "bloom": lib.KV_ADMIT_BLOOM}
_POLICY = {"lru": lib.KV_EVICT_LRU, "lfu": lib.KV_EVICT_LFU}

_OPT_KINDS = {
    "sgd": lib.KV_OPT_SGD,
    "adagrad": lib.KV_OPT_ADAGRAD,
    "adam": lib.KV_OPT_ADAM,
    "ftrl": lib.KV_OPT_FTRL,
    "group_adam": lib.KV_OPT_GROUP_ADAM,
    "group_adagrad": lib.KV_OPT_GROUP_ADAGRAD,
}

_OPT_FLAGS = {"eps_inside_sqrt": lib.KV_OPTF_EPS_INSIDE_SQRT}

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
    admitted: int = 0        # rows created by training lookups (find_or_create)
    rejected: int = 0        # lookups of keys not yet admitted (they read zeros)
    dropped_grads: int = 0   # gradient rows skipped because their key had no row
    evicted: int = 0         # rows removed by evict()
    pending: int = 0         # exact admission: unadmitted keys being counted now
    admission_bytes: int = 0  # memory of the pending map or Bloom filter (in `bytes`)
    removed_logged: int = 0  # removed keys waiting for the next checkpoint

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
                 initial_capacity: int = 0, admit_min_count: int = 0, admit: str = "exact",
                 bloom_counters: int = 0, max_rows: int | None = None,
                 evict_after_steps: int | None = None, evict_policy: str = "lru"):
        """admit_min_count: 0 or 1 gives every key a row at once; K >= 2 only once it
        has been seen in K find_or_create calls (duplicates in a call count once).
        admit: "exact" (counts every unadmitted key: 16 bytes each until admitted or
        purged by evict's TTL) or "bloom" (a counting Bloom filter of bloom_counters
        4-bit counters, default 2^22 = 2 MiB; K <= 15; may admit a key early, never
        late). max_rows, evict_after_steps, evict_policy ("lru" or "lfu"): what
        evict(step) enforces on this shard (None: no budget / no TTL)."""
        if not isinstance(dim, (int, np.integer)) or isinstance(dim, bool) \
                or not 1 <= dim <= lib.KV_MAX_DIM:
            raise errors.InvalidArgumentError(
                f"table {name!r}: dim must be an integer in [1, {lib.KV_MAX_DIM}], got {dim!r}")
        if not isinstance(seed, (int, np.integer)) or not 0 <= seed < 2**64:
            raise errors.InvalidArgumentError(
                f"table {name!r}: seed must be an integer in [0, 2**64), got {seed!r}")
        if admit not in _ADMIT:
            raise errors.InvalidArgumentError(
                f"table {name!r}: admit must be 'exact' or 'bloom', got {admit!r}")
        if not isinstance(admit_min_count, (int, np.integer)) or admit_min_count < 0 or \
                (admit == "bloom" and admit_min_count > lib.KV_BLOOM_MAX_COUNT):
            raise errors.InvalidArgumentError(
                f"table {name!r}: admit_min_count must be an integer >= 0 (<= "
                f"{lib.KV_BLOOM_MAX_COUNT} with admit='bloom'), got {admit_min_count!r}")
        if not 0 <= bloom_counters <= 2**32:
            raise errors.InvalidArgumentError(
                f"table {name!r}: bloom_counters must be in [0, 2**32], got {bloom_counters}")
        if max_rows is not None and max_rows < 0:
            raise errors.InvalidArgumentError(
                f"table {name!r}: max_rows must be >= 0 or None, got {max_rows}")
        if evict_after_steps is not None and evict_after_steps < 1:
            raise errors.InvalidArgumentError(
                f"table {name!r}: evict_after_steps must be >= 1 or None, got "
                f"{evict_after_steps}")
        if evict_policy not in _POLICY:
            raise errors.InvalidArgumentError(
                f"table {name!r}: evict_policy must be 'lru' or 'lfu', got {evict_policy!r}")
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
        self._cfg.admit_min_count = int(admit_min_count)
        self._cfg.admit_mode = _ADMIT[admit]
        self._cfg.bloom_counters = int(bloom_counters)
        self.admit_min_count, self.admit = int(admit_min_count), admit
        self.max_rows = None if max_rows is None else int(max_rows)
        self.evict_after_steps = None if evict_after_steps is None else int(evict_after_steps)
        self.evict_policy = evict_policy
        fill_optim(self._cfg.optim, self.optimizer)
        self._learning_rate = self.optimizer.learning_rate_at(0)
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
        if arr.dtype.kind in "USO" and arr.size:
            arr = hash_strings(arr)  # string ids: XXH64 keys (the 1-D check still applies)
        if arr.dtype == np.int32 or (arr.dtype == np.int64):
            pass
        elif arr.size == 0 and arr.dtype == np.float64:  # np.asarray([]) is float64
            arr = arr.astype(np.int64)
        else:
            raise errors.InvalidArgumentError(
                f"table {self.name!r}: {what} must be int64 or int32, got {arr.dtype} "
                "(string ids are accepted too: they are hashed with hash_strings)")
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

    def _check_apply_step(self, step) -> None:
        if not isinstance(step, (int, np.integer)) or step < 1:
            raise errors.InvalidArgumentError(
                f"table {self.name!r}: step must be an integer >= 1, got {step!r}")

    def _u32(self, values, n: int, what: str) -> np.ndarray | None:
        if values is None:
            return None
        arr = np.asarray(values)
        if arr.dtype == np.uint32 and arr.shape == (n,):
            return np.ascontiguousarray(arr)
        if arr.dtype.kind not in "iu" or arr.shape != (n,):
            raise errors.InvalidArgumentError(
                f"table {self.name!r}: {what} must be {n} integers, got {arr.dtype} {arr.shape}")
        if arr.size and (arr.min() < 0 or arr.max() >= 2**32):
            raise errors.InvalidArgumentError(
                f"table {self.name!r}: {what} must be in [0, 2**32)")
        return np.ascontiguousarray(arr, dtype=np.uint32)

    # -- batch operations ----------------------------------------------------------------

    def _out(self, out, n: int) -> np.ndarray:
        """A caller's output array for n rows, checked (or a new one if None)."""
        if out is None:
            return np.empty((n, self.dim), np.float32)
        if (not isinstance(out, np.ndarray) or out.dtype != np.float32
                or out.shape != (n, self.dim) or not out.flags.c_contiguous
                or not out.flags.writeable):
            raise errors.InvalidArgumentError(
                f"table {self.name!r}: out must be a writeable C-contiguous float32 array "
                f"of shape ({n}, {self.dim})")
        return out

    def find(self, keys, *, default=None, return_found: bool = False,
             out: np.ndarray | None = None):
        """Rows of `keys` as an (n, dim) float32 array (`out` if given); absent keys
        read `default` (a dim-vector, zeros if None). With return_found, also a bool
        mask."""
        k = self._keys(keys)
        out = self._out(out, k.size)
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

    def find_or_create(self, keys, *, step: int = 0, return_has_row: bool = False):
        """Rows of `keys`, creating absent (admitted) keys with their initial value;
        marks every returned row as touched at `step`. With admission, keys not yet
        admitted read zeros and get no row; return_has_row adds a bool mask of the
        keys that have a row."""
        k = self._keys(keys)
        out = np.empty((k.size, self.dim), np.float32)
        has = np.empty(k.size, np.uint8) if return_has_row else None
        created = ffi.new("int64_t *")
        _check(lib.kv_table_find_or_create(self._handle(), _ptr("int64_t *", k), k.size,
                                           _ptr("float *", out), _step32(step), created,
                                           ffi.NULL if has is None else _ptr("uint8_t *", has)),
               f"table {self.name!r}: find_or_create")
        return (out, has.astype(bool)) if return_has_row else out

    def find_or_create_ref(self, keys, *, step: int = 0, out: np.ndarray | None = None):
        """find_or_create that also says where each row lives, for a later
        apply_gradients_ref: returns (rows, refs). refs[i] (uint32) is 0 for a key
        without a row (not admitted). `out`, if given, is a C-contiguous float32
        (n, dim) array the rows are written to (and returned as rows)."""
        k = self._keys(keys)
        out = self._out(out, k.size)
        refs = np.empty(k.size, np.uint32)
        _check(lib.kv_table_find_or_create_ref(
            self._handle(), _ptr("int64_t *", k), k.size, _ptr("float *", out),
            _step32(step), ffi.NULL, _ptr("uint32_t *", refs)),
            f"table {self.name!r}: find_or_create")
        return out, refs

    def apply_gradients_ref(self, keys, refs, grads, *, step: int,
                            create_missing: bool = False, distinct: bool = False) -> int:
        """apply_gradients with the refs of a find_or_create_ref of the same keys: no
        lookup, the same result (refs are checked; if one went stale, e.g. by eviction
        in between, the batch goes by key). distinct=True promises that no key appears
        twice. Returns the number of keys without a row (skipped)."""
        k = self._keys(keys)
        g = self._rows(grads, k.size, "gradients")
        r = self._u32(refs, k.size, "refs")
        self._check_apply_step(step)
        missing = ffi.new("int64_t *")
        flags = (lib.KV_APPLY_CREATE_MISSING if create_missing else 0) | \
            (lib.KV_APPLY_DISTINCT if distinct else 0)
        _check(lib.kv_table_apply_gradients_ref(
            self._handle(), _ptr("int64_t *", k), _ptr("uint32_t *", r), k.size,
            _ptr("float *", g), int(step), flags, missing),
            f"table {self.name!r}: apply_gradients")
        return int(missing[0])

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

    @property
    def learning_rate(self) -> float:
        """The row optimizer's learning rate now (the C side holds it as float32)."""
        return self._learning_rate

    def set_learning_rate(self, lr: float) -> None:
        """Use learning rate `lr` (> 0, finite) from the next update on, e.g. the value
        of a schedule at this step (optimizer.learning_rate_at(step)). The other
        hyperparameters, the rows and their slots stay as they are; a no-op when lr is
        the current one. Locked in C against concurrent updates."""
        t = self._handle()
        lr = optimizers._checked_learning_rate(lr, f"table {self.name!r}: learning_rate")
        if lr == self._learning_rate:
            return
        o = ffi.new("kv_optim_t *", self._cfg.optim)
        o.lr = lr
        _check(lib.kv_table_set_optim(t, o),
               f"table {self.name!r}: set_learning_rate({lr!r})")
        self._cfg.optim.lr, self._learning_rate = o.lr, lr

    def clear(self) -> None:
        """Remove every key."""
        _check(lib.kv_table_clear(self._handle()), f"table {self.name!r}: clear")

    def apply_gradients(self, keys, grads, *, step: int, create_missing: bool = False) -> int:
        """Apply the row optimizer. Duplicate keys are summed, then applied once.
        Rejects NaN/Inf before changing anything. Returns the number of missing keys
        skipped (0 with create_missing)."""
        k = self._keys(keys)
        g = self._rows(grads, k.size, "gradients")
        self._check_apply_step(step)
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
        """Rows, capacity, bytes held, load factor and lifecycle counters of this shard."""
        s = ffi.new("kv_table_stats_t *")
        _check(lib.kv_table_stats(self._handle(), s), f"table {self.name!r}: stats")
        return TableStats(int(s.rows), int(s.row_capacity), int(s.index_slots), int(s.bytes),
                          int(s.row_bytes), int(s.dim), int(s.slot_floats),
                          float(s.load_factor), int(s.admitted), int(s.rejected),
                          int(s.dropped_grads), int(s.evicted), int(s.pending),
                          int(s.admission_bytes), int(s.removed_logged))

    # -- lifecycle ----------------------------------------------------------------------

    def evict(self, step: int | None = None, *, min_last_step: int | None = None,
              max_rows: int | None = -1, policy: str | None = None) -> int:
        """Remove rows; returns how many. By default applies the table's own policy at
        `step`: rows not touched in the last evict_after_steps steps (last_step <=
        step - evict_after_steps), then the rows beyond max_rows in evict_policy order
        (LRU: oldest last_step first, ties by smaller update count, then smaller key;
        LFU: smaller count first, then older, then smaller key). min_last_step (rows
        with last_step below it go), max_rows (None: no budget) and policy override the
        table's. Evicted keys that reappear start again from their initial value (and
        must be admitted again). One C call under the table's write lock."""
        if min_last_step is None:
            ttl = self.evict_after_steps
            min_last_step = 0 if ttl is None or step is None else max(0, int(step) - ttl + 1)
        if max_rows == -1:
            max_rows = self.max_rows
        policy = self.evict_policy if policy is None else policy
        if policy not in _POLICY:
            raise errors.InvalidArgumentError(
                f"table {self.name!r}: policy must be 'lru' or 'lfu', got {policy!r}")
        if not 0 <= min_last_step < 2**32:
            raise errors.InvalidArgumentError(
                f"table {self.name!r}: min_last_step must be in [0, 2**32), got {min_last_step}")
        n = ffi.new("int64_t *")
        _check(lib.kv_table_evict(self._handle(), int(min_last_step),
                                  -1 if max_rows is None else int(max_rows), _POLICY[policy], n),
               f"table {self.name!r}: evict")
        return int(n[0])

    def track_removed(self, on: bool = True) -> None:
        """Start (or stop, discarding it) the log of removed keys that take_removed()
        drains; checkpoints turn it on to record evictions in incremental saves."""
        _check(lib.kv_table_track_removed(self._handle(), 1 if on else 0),
               f"table {self.name!r}: track_removed")

    def take_removed(self, batch: int = 1 << 20) -> np.ndarray:
        """Keys removed (evicted or deleted) since the last call, as int64; empties the
        log. A key removed twice may appear twice."""
        t = self._handle()
        n = ffi.new("int64_t *")
        parts = []
        while True:
            buf = np.empty(batch, np.int64)
            _check(lib.kv_table_take_removed(t, _ptr("int64_t *", buf), batch, n),
                   f"table {self.name!r}: take_removed")
            parts.append(buf[:int(n[0])])
            if int(n[0]) < batch:
                break
        return np.concatenate(parts)


def fill_optim(c_optim, optimizer) -> None:
    """Copy a row optimizer's hyperparameters into a kv_optim_t and check them in C."""
    for field, value in optimizer._c_fields().items():
        if field == "kind":
            value = _OPT_KINDS[value]
        elif field == "flags":
            value = sum(_OPT_FLAGS[name] for name in set(value))
        setattr(c_optim, field, value)
    _check(lib.kv_optim_check(ffi.addressof(c_optim)), f"optimizer {optimizer!r}")


def _c_optim(optimizer):
    if not hasattr(optimizer, "_c_fields"):
        raise errors.InvalidArgumentError(
            f"optimizer must be a kvcoll.optimizers row optimizer, got {optimizer!r}")
    o = ffi.new("kv_optim_t *")
    fill_optim(o[0], optimizer)
    return o


def _dim_ok(dim) -> int:
    if not isinstance(dim, (int, np.integer)) or not 1 <= dim <= (2**31 - 2) // 3:
        raise errors.InvalidArgumentError(
            f"row width must be an integer in [1, {(2**31 - 2) // 3}], got {dim!r}")
    return int(dim)


def slot_floats(optimizer, dim: int) -> int:
    """Floats of optimizer state per row of width dim (0 for SGD)."""
    return int(lib.kv_optim_slot_floats(_c_optim(optimizer), _dim_ok(dim)))


def init_slots(optimizer, dim: int, nrows: int = 1) -> np.ndarray:
    """The initial optimizer state of `nrows` rows of width dim: (nrows, slot_floats)."""
    o = _c_optim(optimizer)
    dim = _dim_ok(dim)
    out = np.zeros((int(nrows), int(lib.kv_optim_slot_floats(o, dim))), np.float32)
    if out.shape[1]:
        for r in range(out.shape[0]):
            lib.kv_optim_init_slots(o, dim, ffi.cast("float *", ffi.from_buffer(out[r])))
    return out


def apply_rows(optimizer, w: np.ndarray, slots: np.ndarray, g: np.ndarray, step: int) -> None:
    """Apply a row optimizer in place to any float32 rows outside a table (the dense
    slices of SSP/ASP): w (nrows, dim) and slots (nrows, slot_floats) are updated with
    the gradient g (nrows, dim); `step` (>= 1) drives Adam's bias correction. Checks
    every argument and that g is finite before changing anything.

    Not locked: the caller makes sure no other thread touches w and slots meanwhile.
    """
    o = _c_optim(optimizer)
    if not (isinstance(w, np.ndarray) and w.dtype == np.float32 and w.ndim == 2
            and w.flags.c_contiguous and w.flags.writeable):
        raise errors.InvalidArgumentError(
            "apply_rows: w must be a writable C-contiguous float32 (nrows, dim) array, got "
            f"{getattr(w, 'dtype', type(w))} {getattr(w, 'shape', '')}")
    nrows, dim = w.shape
    dim = _dim_ok(dim)
    ns = int(lib.kv_optim_slot_floats(o, dim))
    if not (isinstance(slots, np.ndarray) and slots.dtype == np.float32
            and slots.shape == (nrows, ns) and slots.flags.c_contiguous
            and slots.flags.writeable):
        raise errors.InvalidArgumentError(
            f"apply_rows: slots must be a writable C-contiguous float32 ({nrows}, {ns}) array, "
            f"got {getattr(slots, 'dtype', type(slots))} {getattr(slots, 'shape', '')}")
    g = np.ascontiguousarray(g, np.float32)
    if g.shape != w.shape:
        raise errors.DimensionError(f"apply_rows: gradient shape {g.shape}, expected {w.shape}")
    if not np.isfinite(g).all():
        raise errors.NonFiniteError("apply_rows: the gradient holds NaN or Inf; nothing changed")
    if not isinstance(step, (int, np.integer)) or step < 1:
        raise errors.InvalidArgumentError(f"apply_rows: step must be an integer >= 1, got {step!r}")
    if nrows == 0:
        return
    lib.kv_optim_apply_rows(o, dim, nrows, _ptr("float *", w),
                            _ptr("float *", slots) if ns else ffi.NULL,
                            _ptr("float *", g), int(step))


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
    _check(lib.kv_hash_strings(ffi.cast("uint8_t *", ffi.from_buffer(raw if raw.size else _EMPTY)),
                               _ptr("int64_t *", starts), _ptr("int64_t *", lens), n,
                               STRING_HASH_SEED, _ptr("int64_t *", out)), "hash_strings")
    return out.reshape(shape)


def hash64(keys) -> np.ndarray:
    """kvcoll's 64-bit mix of each key (uint64), the hash routing and buckets use."""
    k = _ids(keys)
    out = np.empty(k.size, np.uint64)
    _check(lib.kv_hash_batch(_ptr("int64_t *", k), k.size, _ptr("uint64_t *", out)), "hash64")
    return out


class TableSet:
    """An ordered set of this rank's table shards, for the exchange kernels
    (csrc/kv_exchange.h): each phase of a BSP exchange is one C call over every table.

    Tables of one dim form a group (numbered in order of first appearance); a pull's
    rows come back as one matrix per group. Arrays are checked by the caller
    (kvcoll.exchange.bsp builds them); this class only checks what C needs to stay in
    bounds (dtype, contiguity, sizes).
    """

    def __init__(self, tables):
        self.tables = list(tables)
        if not self.tables:
            raise errors.InvalidArgumentError("TableSet needs at least one table")
        self.dims = np.array([t.dim for t in self.tables], np.int32)
        first = {}
        self.group = np.array([first.setdefault(int(d), len(first)) for d in self.dims], np.int32)
        self.group_dims = list(first)  # dim of each group

    def _handles(self):
        return ffi.new("kv_table_t *[]", [t._handle() for t in self.tables])

    def plan(self, ids: list, world: int):
        """Sender side of a pull (kv_xplan): returns (send_ids, counts (world, ntab),
        inverse, upos, pos, n_unique); ids[t] are int64 C-contiguous arrays."""
        ntab = len(self.tables)
        n = np.array([a.size for a in ids], np.int64)
        bufs = [ffi.from_buffer(a if a.size else _EMPTY) for a in ids]
        ptrs = ffi.new("int64_t *[]", [ffi.cast("int64_t *", b) for b in bufs])
        total = int(n.sum())
        send = np.empty(total, np.int64)
        counts = np.empty((int(world), ntab), np.int64)
        inverse = np.empty(total, np.int64)
        upos = np.empty(total, np.int64)
        pos = np.empty(total, np.int64)
        nu = np.empty(ntab, np.int64)
        _check(lib.kv_xplan(ntab, int(world), ptrs, _ptr("int64_t *", n),
                            _ptr("int32_t *", self.group), _ptr("int64_t *", send),
                            _ptr("int64_t *", counts), _ptr("int64_t *", inverse),
                            _ptr("int64_t *", upos), _ptr("int64_t *", pos),
                            _ptr("int64_t *", nu)), "exchange: plan")
        return send[:int(nu.sum())], counts, inverse, upos[:int(nu.sum())], pos, nu

    def serve(self, recv_ids: np.ndarray, recv_counts: np.ndarray, step: int, create: bool,
              reply: np.ndarray):
        """Owner side of a pull (kv_xserve): writes the rows into `reply` (float32, payload
        layout). Returns the state kv_xapply needs (create=True), else None."""
        ntab, world = len(self.tables), recv_counts.shape[0]
        rc = np.ascontiguousarray(recv_counts, np.int64)
        total = int(rc.sum())
        if recv_ids.dtype != np.int64 or recv_ids.size != total or \
                reply.dtype != np.float32 or reply.size != int((rc * self.dims).sum()):
            raise errors.InvalidArgumentError("exchange: serve: payload sizes do not match counts")
        if not create:
            _check(lib.kv_xserve(self._handles(), ntab, world, _ptr("int64_t *", recv_ids),
                                 _ptr("int64_t *", rc), _step32(step), 0, _ptr("float *", reply),
                                 ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL),
                   "exchange: serve")
            return None
        uidx = np.empty(total, np.int64)
        ukeys = np.empty(total, np.int64)
        urefs = np.empty(total, np.uint32)
        ustart = np.empty(ntab + 1, np.int64)
        gens = np.empty(ntab, np.uint64)
        _check(lib.kv_xserve(self._handles(), ntab, world, _ptr("int64_t *", recv_ids),
                             _ptr("int64_t *", rc), _step32(step), 1, _ptr("float *", reply),
                             _ptr("int64_t *", uidx), _ptr("int64_t *", ukeys),
                             _ptr("uint32_t *", urefs), _ptr("int64_t *", ustart),
                             _ptr("uint64_t *", gens)), "exchange: serve")
        return (rc, uidx, ukeys, urefs, ustart, gens)

    def apply(self, state, grads: np.ndarray, step: int, scale: float = 1.0) -> np.ndarray:
        """Owner side of a push (kv_xapply): scale * grads (float32, payload layout) of
        the ids a serve returned `state` for. Returns the ids without a row, per table."""
        rc, uidx, ukeys, urefs, ustart, gens = state
        if grads.dtype != np.float32 or not grads.flags.c_contiguous or \
                grads.size != int((rc * self.dims).sum()):
            raise errors.InvalidArgumentError("exchange: apply: gradient payload does not match "
                                              "the served ids")
        if not isinstance(step, (int, np.integer)) or step < 1:
            raise errors.InvalidArgumentError(f"exchange: step must be an integer >= 1, got {step!r}")
        missing = np.zeros(len(self.tables), np.int64)
        _check(lib.kv_xapply(self._handles(), len(self.tables), rc.shape[0], _ptr("int64_t *", rc),
                             _ptr("float *", grads), float(scale), int(step),
                             _ptr("int64_t *", uidx),
                             _ptr("int64_t *", ukeys), _ptr("uint32_t *", urefs),
                             _ptr("int64_t *", ustart), _ptr("uint64_t *", gens),
                             _ptr("int64_t *", missing)), "exchange: apply gradients")
        return missing

    def regroup(self, counts: np.ndarray, payload: np.ndarray, out: list) -> None:
        """Payload rows (layout of counts) into out[g], one float32 matrix per group."""
        bufs = [ffi.from_buffer(o) for o in out]
        _check(lib.kv_xregroup(len(self.tables), counts.shape[0],
                               _ptr("int64_t *", np.ascontiguousarray(counts, np.int64)),
                               _ptr("int32_t *", self.dims), _ptr("int32_t *", self.group),
                               _ptr("float *", payload),
                               ffi.new("float *[]", [ffi.cast("float *", b) for b in bufs])),
               "exchange: regroup")

    def ungroup(self, counts: np.ndarray, mats: list, payload: np.ndarray) -> None:
        """The group matrices mats[g] into payload (layout of counts)."""
        bufs = [ffi.from_buffer(m) for m in mats]
        _check(lib.kv_xungroup(len(self.tables), counts.shape[0],
                               _ptr("int64_t *", np.ascontiguousarray(counts, np.int64)),
                               _ptr("int32_t *", self.dims), _ptr("int32_t *", self.group),
                               ffi.new("float *[]", [ffi.cast("float *", b) for b in bufs]),
                               _ptr("float *", payload)),
               "exchange: ungroup")


def gather_grad(values: np.ndarray, indices: np.ndarray, n_rows: int) -> np.ndarray:
    """The gradient of an (n_rows, dim) matrix from the gradient of gathers of it:
    row r is the sum of values[i] over the i with indices[i] == r (zeros if none), in
    order of i. values: (n, dim) float32, one row per gathered position (what
    tf.gather's backward gives, as tf.IndexedSlices); indices: (n,) int64. The result
    is 64-byte aligned (TensorFlow and the push take it without a copy).

        values=[[1, 1], [2, 2], [3, 3]], indices=[2, 0, 2], n_rows=3
        -> [[2, 2], [0, 0], [4, 4]]
    """
    v = np.ascontiguousarray(values, np.float32)
    i = np.ascontiguousarray(indices, np.int64)
    if v.ndim != 2 or i.shape != (v.shape[0],):
        raise errors.InvalidArgumentError(
            f"gather_grad: values must be (n, dim) and indices (n,), got {v.shape} and "
            f"{i.shape}")
    dim = v.shape[1]
    out = aligned_empty(int(n_rows) * dim, np.float32).reshape(int(n_rows), dim)
    _check(lib.kv_xrowgrad(int(n_rows), dim, _ptr("float *", v), _ptr("int64_t *", i),
                           i.size, _ptr("float *", out)),
           f"gather_grad: an index outside [0, {int(n_rows)}), or a bad size")
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


# ---- the SyntheticCTR kernel (kvcoll.data.synthetic; csrc/kv_synth.h) ---------------

SYNTH_PERM_ROUNDS = lib.KV_SYNTH_PERM_ROUNDS


def _synth_array(value, dtype, shape, what: str) -> np.ndarray:
    """value as a C-contiguous array, checked to be exactly dtype and shape (a None in
    shape matches any length)."""
    arr = np.asarray(value)
    if arr.dtype != dtype:
        raise errors.InvalidArgumentError(f"{what} must be {np.dtype(dtype)}, got {arr.dtype}")
    if arr.ndim != len(shape) or any(s is not None and s != a for s, a in zip(shape, arr.shape)):
        want = "(" + ", ".join("n" if s is None else str(s) for s in shape) + ")"
        raise errors.DimensionError(f"{what} must have shape {want}, got {arr.shape}")
    return np.ascontiguousarray(arr)


class SynthPermutation:
    """SyntheticCTR's per-field id scrambling in C (kv_synth_perm_t, kv_synth.h).

    vocab, mask, shift: uint64 [F]; add, mul, inv: uint64 [SYNTH_PERM_ROUNDS, F];
    rot: uint64 [SYNTH_PERM_ROUNDS - 1, F]. The C side checks them once, here.
    """

    def __init__(self, vocab, mask, shift, add, mul, inv, rot):
        nf = np.asarray(vocab).size
        r = SYNTH_PERM_ROUNDS
        u64 = np.uint64
        arrays = {"vocab": _synth_array(vocab, u64, (nf,), "vocab"),
                  "mask": _synth_array(mask, u64, (nf,), "mask"),
                  "shift": _synth_array(shift, u64, (nf,), "shift"),
                  "add": _synth_array(add, u64, (r, nf), "add"),
                  "mul": _synth_array(mul, u64, (r, nf), "mul"),
                  "inv": _synth_array(inv, u64, (r, nf), "inv"),
                  "rot": _synth_array(rot, u64, (r - 1, nf), "rot")}
        self.num_fields = nf
        self._arrays = arrays                       # the C struct points into these
        self._c = ffi.new("kv_synth_perm_t *")
        self._c.num_fields = nf
        for name, arr in arrays.items():
            setattr(self._c, name, _ptr("uint64_t *", arr))
        _check(lib.kv_synth_perm_check(self._c), "synthetic id permutation")

    def apply(self, values, inverse: bool = False) -> np.ndarray:
        """perm_f (or its inverse) of every values[i, f] (uint64 [n, F], < vocab_f)."""
        x = _synth_array(values, np.uint64, (None, self.num_fields), "values")
        out = np.empty_like(x)
        _check(lib.kv_synth_permute(self._c, _ptr("uint64_t *", x), x.shape[0], int(bool(inverse)),
                                    _ptr("uint64_t *", out)), "synthetic id permutation")
        return out


class SynthModel:
    """SyntheticCTR's sample generator and planted model in C (kv_synth_t, kv_synth.h).

    perm: a SynthPermutation (F fields); zipf_c, per field, float64 [F]; offsets int64
    [F]; param_keys uint64 [F]; w_mul, w_sub, v_mul, v_sub float32 [F]; mu, sigma,
    center, beta float32 [D]. The C side checks them once, here.
    """

    def __init__(self, perm: SynthPermutation, *, num_numeric: int, log_uniform: bool,
                 zipf_exponent: float, zipf_c, offsets, param_keys, w_mul, w_sub, v_mul,
                 v_sub, mu, sigma, center, beta, bias: float = 0.0):
        nf, nd = perm.num_fields, int(num_numeric)
        if nd < 0:
            raise errors.InvalidArgumentError(f"num_numeric must be >= 0, got {nd}")
        f32 = np.float32
        arrays = {"zipf_c": ("double *", _synth_array(zipf_c, np.float64, (nf,), "zipf_c")),
                  "offsets": ("int64_t *", _synth_array(offsets, np.int64, (nf,), "offsets")),
                  "param_keys": ("uint64_t *",
                                 _synth_array(param_keys, np.uint64, (nf,), "param_keys"))}
        for name, value in (("w_mul", w_mul), ("w_sub", w_sub), ("v_mul", v_mul),
                            ("v_sub", v_sub)):
            arrays[name] = ("float *", _synth_array(value, f32, (nf,), name))
        for name, value in (("mu", mu), ("sigma", sigma), ("center", center), ("beta", beta)):
            arrays[name] = ("float *", _synth_array(value, f32, (nd,), name))
        self.num_fields, self.num_numeric = nf, nd
        self._perm = perm                           # the C structs point into these
        self._arrays = arrays
        self._c = ffi.new("kv_synth_t *")
        self._c.perm = perm._c[0]
        self._c.num_numeric = nd
        self._c.log_uniform = int(bool(log_uniform))
        self._c.zipf_exponent = float(zipf_exponent)
        self._c.bias = float(bias)
        for name, (ctype, arr) in arrays.items():
            setattr(self._c, name, _ptr(ctype, arr))
        _check(lib.kv_synth_check(self._c), "synthetic data parameters")

    def samples(self, keys, first: int, n: int, *, logit: bool = False):
        """Samples first, ..., first + n - 1 of the stream with channel keys `keys`
        (uint64 [F + D + 1]): ({"categorical", "numeric", "label"}, logit float64 [n]
        or None)."""
        nf, nd, n = self.num_fields, self.num_numeric, int(n)
        k = _synth_array(keys, np.uint64, (nf + nd + 1,), "keys")
        if n < 0:
            raise errors.InvalidArgumentError(f"n must be >= 0, got {n}")
        out = {"categorical": np.empty((n, nf), np.int64),
               "numeric": np.empty((n, nd), np.float32),
               "label": np.empty(n, np.float32)}
        lg = np.empty(n, np.float64) if logit else None
        _check(lib.kv_synth_samples(
            self._c, _ptr("uint64_t *", k), int(first), n,
            _ptr("int64_t *", out["categorical"]), _ptr("float *", out["numeric"]),
            _ptr("float *", out["label"]), ffi.NULL if lg is None else _ptr("double *", lg)),
            "synthetic samples")
        return out, lg

    def logit(self, ranks, numeric) -> np.ndarray:
        """The planted logit (float64 [n]) of ranks (uint64 [n, F], not ids) and
        numeric (float32 [n, D]): bit for bit the one `samples` drew the labels from."""
        r = _synth_array(ranks, np.uint64, (None, self.num_fields), "ranks")
        x = _synth_array(numeric, np.float32, (r.shape[0], self.num_numeric), "numeric")
        out = np.empty(r.shape[0], np.float64)
        _check(lib.kv_synth_logit(self._c, _ptr("uint64_t *", r), _ptr("float *", x), r.shape[0],
                                  _ptr("double *", out)), "synthetic planted logit")
        return out

