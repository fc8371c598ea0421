"""KvTable: one rank's shard of one embedding table, backed by the C core (with
Initializer, how a new key's row is drawn, and TableStats, what a shard holds).

Every call is one C call per batch: ids are checked by `kvcoll.ids.as_keys`, other
numpy arrays here (dtype, shape, contiguity), and all cross zero-copy; the C side
validates values (finite, in range) before it changes anything, so an error leaves the
table exactly as it was. Status codes become typed exceptions in one place,
`kvcoll._c.check`.

    >>> t = KvTable(4, name="user", optimizer=optimizers.Adagrad(0.1))
    >>> rows = t.find_or_create(np.array([7, 42, 7]))     # (3, 4) float32
    >>> t.apply_gradients(np.array([7, 42]), np.ones((2, 4), np.float32), step=1)
    >>> len(t), t.stats().bytes_per_row_overhead

Feature lifecycle (per table): `admit_min_count=K` gives a key a row only once it has
been seen in K find_or_create calls (exactly, or with `admit="bloom"` through a
counting Bloom filter of bounded size); until then it reads zeros and its gradients
are dropped (and counted). `evict()` removes rows not touched for `evict_after_steps`
steps and, beyond `max_rows`, the least recently (or frequently) used ones. String
ids are hashed to int64 with the run's id hash (farmhash64 for new models): see `kvcoll.ids`.

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
from ._c import check, ffi, lib, ptr, step32
from .ids import as_keys

__all__ = ["KvTable", "Initializer", "TableStats", "fill_optim", "nonfinite_update_error",
           "first_nonfinite_row"]

_ADMIT = {"exact": lib.KV_ADMIT_EXACT, "bloom": lib.KV_ADMIT_BLOOM}
_POLICY = {"lru": lib.KV_EVICT_LRU, "lfu": lib.KV_EVICT_LFU}

_OPT_KINDS = {
    "sgd": lib.KV_OPT_SGD,
    "adagrad": lib.KV_OPT_ADAGRAD,
    "adam": lib.KV_OPT_ADAM,
    "ftrl": lib.KV_OPT_FTRL,
    "group_adam": lib.KV_OPT_GROUP_ADAM,
    "group_adagrad": lib.KV_OPT_GROUP_ADAGRAD,
    "rowwise_adagrad": lib.KV_OPT_ROWWISE_ADAGRAD,
}

_OPT_FLAGS = {"eps_inside_sqrt": lib.KV_OPTF_EPS_INSIDE_SQRT, "wd_l2": lib.KV_OPTF_WD_L2,
              "wd_decoupled": lib.KV_OPTF_WD_DECOUPLED}

# What KvTable.export reads of a row, in kv_table_export's argument order.
_EXPORT_COLUMNS = ("keys", "values", "slots", "last_step", "counts", "dirty")


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
                f"(SGD, Adagrad, Adam, Ftrl, GroupAdam, GroupAdagrad, RowWiseAdagrad), got "
                f"{optimizer!r}")
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
        check(lib.kv_table_create(self._cfg, out), f"table {name!r}: create")
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
        k = as_keys(keys, table=self.name)
        out = self._out(out, k.size)
        found = np.empty(k.size, np.uint8)
        dflt = ffi.NULL
        if default is not None:
            d = np.ascontiguousarray(default, np.float32)
            if d.shape != (self.dim,):
                raise errors.DimensionError(
                    f"table {self.name!r}: default must have shape ({self.dim},), got {d.shape}")
            dflt = ffi.cast("float *", ffi.from_buffer(d))
        check(lib.kv_table_find(self._handle(), ptr("int64_t *", k), k.size,
                                ptr("float *", out), ptr("uint8_t *", found), dflt),
              f"table {self.name!r}: find")
        return (out, found.astype(bool)) if return_found else out

    def find_or_create(self, keys, *, step: int = 0, return_has_row: bool = False):
        """Rows of `keys`, creating absent (admitted) keys with their initial value;
        marks every returned row as touched at `step`. With admission, keys not yet
        admitted read zeros and get no row; return_has_row adds a bool mask of the
        keys that have a row."""
        k = as_keys(keys, table=self.name)
        out = np.empty((k.size, self.dim), np.float32)
        has = np.empty(k.size, np.uint8) if return_has_row else None
        created = ffi.new("int64_t *")
        check(lib.kv_table_find_or_create(self._handle(), ptr("int64_t *", k), k.size,
                                          ptr("float *", out), step32(step), created,
                                          ffi.NULL if has is None else ptr("uint8_t *", has)),
              f"table {self.name!r}: find_or_create")
        return (out, has.astype(bool)) if return_has_row else out

    def find_or_create_ref(self, keys, *, step: int = 0, out: np.ndarray | None = None):
        """find_or_create that also says where each row lives, for a later
        apply_gradients_ref: returns (rows, refs). refs[i] (uint32) is 0 for a key
        without a row (not admitted). `out`, if given, is a C-contiguous float32
        (n, dim) array the rows are written to (and returned as rows)."""
        k = as_keys(keys, table=self.name)
        out = self._out(out, k.size)
        refs = np.empty(k.size, np.uint32)
        check(lib.kv_table_find_or_create_ref(
            self._handle(), ptr("int64_t *", k), k.size, ptr("float *", out),
            step32(step), ffi.NULL, ptr("uint32_t *", refs)),
            f"table {self.name!r}: find_or_create")
        return out, refs

    def apply_gradients_ref(self, keys, refs, grads, *, step: int,
                            create_missing: bool = False, distinct: bool = False) -> int:
        """apply_gradients with the refs of a find_or_create_ref of the same keys: no
        lookup, the same result (refs are checked; if one went stale, e.g. by eviction
        in between, the batch goes by key). distinct=True promises that no key appears
        twice. Returns the number of keys without a row (skipped)."""
        k = as_keys(keys, table=self.name)
        g = self._rows(grads, k.size, "gradients")
        r = self._u32(refs, k.size, "refs")
        self._check_apply_step(step)
        missing = ffi.new("int64_t *")
        flags = (lib.KV_APPLY_CREATE_MISSING if create_missing else 0) | \
            (lib.KV_APPLY_DISTINCT if distinct else 0)
        status = lib.kv_table_apply_gradients_ref(
            self._handle(), ptr("int64_t *", k), ptr("uint32_t *", r), k.size,
            ptr("float *", g), int(step), flags, missing)
        if status == lib.KV_ENONFINITE:
            self._refused(k, g, step, flags)
        check(status, f"table {self.name!r}: apply_gradients")
        return int(missing[0])

    def reserve(self, n: int) -> None:
        """Make room for n more rows (beyond the live ones) ahead of the calls that
        create them: arena memory, allocated and faulted in now, and the index grown
        now if n more rows need it, so that creating up to n rows later allocates
        nothing, takes no page fault and rebuilds no index. For a thread that knows the
        next batch's ids before they are served (the pipeline's helper, through
        BspExchange.reserve_for). Invisible but for capacity: no row, key, generation,
        count or change tracking changes, only stats() row_capacity, index_slots,
        load_factor and bytes; room that no row uses stays allocated (memory, never a
        difference in results). Raises TableFullError when n more rows would not fit
        the shard, CapacityError when memory runs out; then nothing changed."""
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 0 <= n < 2**63:
            raise errors.InvalidArgumentError(
                f"table {self.name!r}: reserve needs a row count >= 0, got {n!r}")
        check(lib.kv_table_reserve(self._handle(), int(n)),
              f"table {self.name!r}: reserve room for {int(n)} more rows")

    def update(self, keys, values) -> None:
        """Assign rows (creating absent keys). Duplicate keys: the last row wins."""
        k = as_keys(keys, table=self.name)
        v = self._rows(values, k.size, "values")
        check(lib.kv_table_update(self._handle(), ptr("int64_t *", k), k.size,
                                  ptr("float *", v)),
              f"table {self.name!r}: update")

    def delete(self, keys) -> int:
        """Remove keys; absent ones are ignored. Returns how many were removed."""
        k = as_keys(keys, table=self.name)
        n = ffi.new("int64_t *")
        check(lib.kv_table_delete(self._handle(), ptr("int64_t *", k), k.size, n),
              f"table {self.name!r}: delete")
        return int(n[0])

    def export_admission(self, batch: int = 1 << 20) -> dict:
        """The admission state, for checkpoints: {"keys" int64, "counts" uint32, "steps"
        uint32} of the exact pending counts (empty arrays otherwise) and "bloom" (uint8
        bytes of the Bloom filter, or None) with "bloom_adds"."""
        t = self._handle()
        parts = {"keys": [], "counts": [], "steps": []}
        cursor = ffi.new("int64_t *", 0)
        n = ffi.new("int64_t *")
        while True:
            k = np.empty(batch, np.int64)
            c = np.empty(batch, np.uint32)
            s = np.empty(batch, np.uint32)
            check(lib.kv_table_export_pending(t, cursor, batch, ptr("int64_t *", k),
                                              ptr("uint32_t *", c), ptr("uint32_t *", s), n),
                  f"table {self.name!r}: export admission state")
            for name, arr in zip(parts, (k, c, s)):
                parts[name].append(arr[:int(n[0])])
            if int(n[0]) < batch:
                break
        out = {name: np.concatenate(p) for name, p in parts.items()}
        nb = int(lib.kv_table_bloom_bytes(t))
        out["bloom"], out["bloom_adds"] = None, 0
        if nb:
            bloom = np.empty(nb, np.uint8)
            adds = ffi.new("uint64_t *")
            check(lib.kv_table_export_bloom(t, ptr("uint8_t *", bloom), nb, adds),
                  f"table {self.name!r}: export the Bloom filter")
            out["bloom"], out["bloom_adds"] = bloom, int(adds[0])
        return out

    @property
    def bloom_counters_bytes(self) -> tuple[int, int]:
        """(counters, bytes) of the admission Bloom filter; (0, 0) without one."""
        nb = int(lib.kv_table_bloom_bytes(self._handle()))
        if not nb:
            return 0, 0
        return int(self._cfg.bloom_counters) or int(lib.KV_BLOOM_DEFAULT_COUNTERS), nb

    def import_admission(self, state: dict, *, merge: bool = False) -> None:
        """Restore admission state from export_admission (pending keys this rank does
        not own may be left out by the caller); merge=True keeps the larger of each
        Bloom counter (several shards' filters: may admit earlier, never later)."""
        t = self._handle()
        keys = as_keys(state["keys"], "pending keys", table=self.name)
        counts = np.ascontiguousarray(state["counts"], np.uint32)
        steps = np.ascontiguousarray(state["steps"], np.uint32)
        if counts.shape != keys.shape or steps.shape != keys.shape:
            raise errors.InvalidArgumentError(
                f"table {self.name!r}: admission state: {keys.size} keys, {counts.size} counts "
                f"and {steps.size} steps; they must be as many")
        check(lib.kv_table_import_pending(t, ptr("int64_t *", keys), ptr("uint32_t *", counts),
                                          ptr("uint32_t *", steps), keys.size),
              f"table {self.name!r}: import admission state (this table counts "
              f"{'exactly' if self.admit == 'exact' else 'with a Bloom filter'} from "
              f"{self.admit_min_count} sightings)")
        bloom = state.get("bloom")
        if bloom is not None:
            b = np.ascontiguousarray(bloom, np.uint8)
            check(lib.kv_table_import_bloom(t, ptr("uint8_t *", b), b.size,
                                            int(state.get("bloom_adds", 0)), int(bool(merge))),
                  f"table {self.name!r}: import the Bloom filter ({b.size} bytes; this table's "
                  f"has {int(lib.kv_table_bloom_bytes(t))})")

    def forget_new(self, keys, step: int) -> int:
        """Remove the rows of `keys` that step `step` created and nothing updated (a
        rejected step's new rows); other keys stay. Returns how many were removed."""
        k = as_keys(keys, table=self.name)
        n = ffi.new("int64_t *")
        check(lib.kv_table_forget_new(self._handle(), ptr("int64_t *", k), k.size,
                                      step32(step), n), f"table {self.name!r}: forget_new")
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
        check(lib.kv_table_set_optim(t, o),
              f"table {self.name!r}: set_learning_rate({lr!r})")
        self._cfg.optim.lr, self._learning_rate = o.lr, lr

    def clear(self) -> None:
        """Remove every key."""
        check(lib.kv_table_clear(self._handle()), f"table {self.name!r}: clear")

    def apply_gradients(self, keys, grads, *, step: int, create_missing: bool = False) -> int:
        """Apply the row optimizer. Duplicate keys are summed, then applied once.
        Rejects NaN/Inf before changing anything, in the gradients and in what the update
        would write: an update that would make a row or an optimizer slot NaN/Inf (a
        huge finite gradient) raises NonFiniteError naming the key, and nothing changes
        (such a row could not be checkpointed). Returns the number of missing keys
        skipped (0 with create_missing)."""
        k = as_keys(keys, table=self.name)
        g = self._rows(grads, k.size, "gradients")
        self._check_apply_step(step)
        missing = ffi.new("int64_t *")
        flags = lib.KV_APPLY_CREATE_MISSING if create_missing else 0
        status = lib.kv_table_apply_gradients(self._handle(), ptr("int64_t *", k), k.size,
                                              ptr("float *", g), int(step), flags, missing)
        if status == lib.KV_ENONFINITE:
            self._refused(k, g, step, flags)
        check(status, f"table {self.name!r}: apply_gradients")
        return int(missing[0])

    def _refused(self, keys: np.ndarray, grads: np.ndarray, step: int, flags: int) -> None:
        """An apply came back KV_ENONFINITE (nothing changed): raise the error naming
        the key (kv_table_check_update finds it, read-only) when there is one."""
        key = ffi.new("int64_t *")
        what = ffi.new("int32_t *")
        check(lib.kv_table_check_update(self._handle(), ptr("int64_t *", keys), keys.size,
                                        ptr("float *", grads), int(step), int(flags), key,
                                        what), f"table {self.name!r}: apply_gradients")
        if what[0]:
            raise nonfinite_update_error(self, int(key[0]), int(what[0]), step)

    def export(self, *, dirty_only: bool = False, clear_dirty: bool = False,
               batch: int = 1 << 16) -> dict:
        """Every row (or only the dirty ones) as arrays: keys, values, slots,
        last_step, counts, dirty. Arena order; one C call per `batch` rows."""
        parts = list(self.export_batches(dirty_only=dirty_only, clear_dirty=clear_dirty,
                                         batch=batch))
        out = {name: np.concatenate([p[name] for p in parts]) for name in parts[0]}
        if "dirty" in out:
            out["dirty"] = out["dirty"].astype(bool)
        return out

    def export_batches(self, *, dirty_only: bool = False, clear_dirty: bool = False,
                       batch: int = 1 << 16, columns=_EXPORT_COLUMNS):
        """export() one batch at a time: yields dicts of up to `batch` rows (fresh
        arrays each time; the last one may be empty), so a caller can stream a table
        without holding it twice. `columns` picks what to read (keys and values are
        always read; dirty is uint8 here)."""
        t = self._handle()
        flags = (lib.KV_EXPORT_DIRTY_ONLY if dirty_only else 0) | \
                (lib.KV_EXPORT_CLEAR_DIRTY if clear_dirty else 0)
        unknown = set(columns) - set(_EXPORT_COLUMNS)
        if unknown:
            raise errors.InvalidArgumentError(
                f"table {self.name!r}: export columns {sorted(unknown)} are unknown; "
                f"choose from {list(_EXPORT_COLUMNS)}")
        width = {"values": (self.dim,), "slots": (self.slot_floats,)}
        dtype = {"keys": np.int64, "values": np.float32, "slots": np.float32,
                 "last_step": np.uint32, "counts": np.uint32, "dirty": np.uint8}
        ctype = {"keys": "int64_t *", "values": "float *", "slots": "float *",
                 "last_step": "uint32_t *", "counts": "uint32_t *", "dirty": "uint8_t *"}
        names = [c for c in _EXPORT_COLUMNS if c in ("keys", "values") or c in columns]
        cursor = ffi.new("int64_t *", 0)
        n_out = ffi.new("int64_t *")
        while True:
            p = {c: np.empty((batch,) + width.get(c, ()), dtype[c]) for c in names}
            args = [ptr(ctype[c], p[c]) if c in p else ffi.NULL for c in _EXPORT_COLUMNS]
            check(lib.kv_table_export(t, cursor, batch, flags, *args, n_out),
                  f"table {self.name!r}: export")
            n = int(n_out[0])
            yield {c: a[:n] for c, a in p.items()}
            if n < batch:
                break

    def import_(self, keys, values, *, slots=None, last_step=None, counts=None) -> None:
        """Insert or overwrite whole rows (the inverse of export); imported rows are
        clean. Missing slots start at the optimizer's initial state."""
        k = as_keys(keys, table=self.name)
        v = self._rows(values, k.size, "values")
        s = None if slots is None else self._rows(slots, k.size, "slots", self.slot_floats)
        ls = self._u32(last_step, k.size, "last_step")
        c = self._u32(counts, k.size, "counts")
        check(lib.kv_table_import(
            self._handle(), ptr("int64_t *", k), k.size, ptr("float *", v),
            ffi.NULL if s is None else ptr("float *", s),
            ffi.NULL if ls is None else ptr("uint32_t *", ls),
            ffi.NULL if c is None else ptr("uint32_t *", c)),
            f"table {self.name!r}: import")

    def initial_values(self, keys) -> np.ndarray:
        """The value find_or_create would give each key if it were new."""
        k = as_keys(keys, table=self.name)
        out = np.empty((k.size, self.dim), np.float32)
        check(lib.kv_initial_values(self._cfg, ptr("int64_t *", k), k.size,
                                    ptr("float *", out)),
              f"table {self.name!r}: initial_values")
        return out

    def stats(self) -> TableStats:
        """Rows, capacity, bytes held, load factor and lifecycle counters of this shard."""
        s = ffi.new("kv_table_stats_t *")
        check(lib.kv_table_stats(self._handle(), s), f"table {self.name!r}: stats")
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
        check(lib.kv_table_evict(self._handle(), int(min_last_step),
                                 -1 if max_rows is None else int(max_rows), _POLICY[policy], n),
              f"table {self.name!r}: evict")
        return int(n[0])

    def track_removed(self, on: bool = True) -> None:
        """Start (or stop, discarding it) the log of removed keys that take_removed()
        drains; checkpoints turn it on to record evictions in incremental saves."""
        check(lib.kv_table_track_removed(self._handle(), 1 if on else 0),
              f"table {self.name!r}: track_removed")

    def take_removed(self, batch: int = 1 << 20) -> np.ndarray:
        """Keys removed (evicted or deleted) since the last call, as int64; empties the
        log. A key removed twice may appear twice."""
        t = self._handle()
        n = ffi.new("int64_t *")
        parts = []
        while True:
            buf = np.empty(batch, np.int64)
            check(lib.kv_table_take_removed(t, ptr("int64_t *", buf), batch, n),
                  f"table {self.name!r}: take_removed")
            parts.append(buf[:int(n[0])])
            if int(n[0]) < batch:
                break
        return np.concatenate(parts)


    # -- change tracking for publishing (kvcoll.publish) -----------------------------------

    def track_changes(self, on: bool = True) -> None:
        """Start (or stop) tracking the rows changed and the keys removed for
        take_changes(), apart from the checkpoints' dirty bits and removed-keys log (so
        neither hides a change from the other). On: from now on (the rows as they are
        count as published; an O(rows) pass). Costs no byte per row, 4 bytes per row
        changed and 8 per key removed until the next take."""
        check(lib.kv_table_track_changes(self._handle(), 1 if on else 0),
              f"table {self.name!r}: track_changes")

    def take_changes(self) -> dict | None:
        """The rows changed (or created) since the last take, with their values now, and
        the keys removed since then, as {"keys" int64 [n], "values" float32 [n, dim],
        "removed" int64 [m]} (apply the removals first, then the rows: that gives the
        table as it is now); the trackers start over. None when tracking was lost since
        the last take (a clear, e.g. a restore, or no memory for the list): publish the
        whole table then. One C call under the table's write lock; its cost is
        proportional to the changes. Raises InvalidArgumentError if tracking is off."""
        t = self._handle()
        nr, ng, n_rows, n_gone = (ffi.new("int64_t *") for _ in range(4))
        lost, complete = ffi.new("int32_t *"), ffi.new("int32_t *")
        check(lib.kv_table_changes_pending(t, nr, ng, lost),
              f"table {self.name!r}: take_changes")
        want_rows, want_gone = int(nr[0]), int(ng[0])
        while True:
            keys = np.empty(want_rows, np.int64)
            values = np.empty((want_rows, self.dim), np.float32)
            gone = np.empty(want_gone, np.int64)
            rc = lib.kv_table_take_changes(t, want_rows, ptr("int64_t *", keys),
                                           ptr("float *", values), want_gone,
                                           ptr("int64_t *", gone), n_rows, n_gone, complete)
            if rc == lib.KV_EINVAL and not self.closed:
                raise errors.InvalidArgumentError(
                    f"table {self.name!r}: take_changes needs change tracking on; call "
                    "track_changes() first")
            check(rc, f"table {self.name!r}: take_changes")
            if not complete[0]:
                return None
            if n_rows[0] >= 0:
                break
            # changed since the count: the sizes it needs now, with room to grow
            want_rows = -int(n_rows[0]) - 1 + 1024
            want_gone = -int(n_gone[0]) - 1 + 1024
        return {"keys": keys[:int(n_rows[0])], "values": values[:int(n_rows[0])],
                "removed": gone[:int(n_gone[0])]}

    def changes_pending(self) -> tuple[int, int]:
        """(row ids, removed keys) the change tracker lists now (the row count is an
        upper bound of the rows the next take returns)."""
        nr, ng, lost = ffi.new("int64_t *"), ffi.new("int64_t *"), ffi.new("int32_t *")
        check(lib.kv_table_changes_pending(self._handle(), nr, ng, lost),
              f"table {self.name!r}: changes_pending")
        return int(nr[0]), int(ng[0])


def nonfinite_update_error(table: KvTable, key: int, what: int,
                           step: int) -> errors.NonFiniteError:
    """The error of an update refused because it is not finite (kv_table_check_update's
    or kv_xprepare's `what`: 1 a gradient of the key is NaN/Inf; 3 its gradients summed
    over the ranks and duplicates that sent them overflow float32; 2 its row or optimizer
    slots after the update would be NaN/Inf), naming the table and the key. The
    exception's `what` attribute keeps the code."""
    if what == 1:
        why = "its gradient is NaN/Inf"
    elif what == 3:
        why = ("its gradients summed over the ranks and duplicates that sent them overflow "
               "float32")
    else:
        why = (f"the update would make its row or its {type(table.optimizer).__name__} "
               "slots NaN/Inf (a finite gradient too large for float32: e.g. Adagrad's "
               "g^2 or Adam's second moment overflows)")
    exc = errors.NonFiniteError(
        f"table {table.name!r}: key {key}: step {step}: {why}; nothing was applied "
        "(clip the gradients, scale the loss down, or lower the learning rate)")
    exc.what = what
    return exc


def first_nonfinite_row(values: np.ndarray) -> int:
    """The index of the first row of a 2-D float32 array that holds a NaN or an Inf,
    or -1 (one C pass, no temporary array)."""
    v = np.ascontiguousarray(values, np.float32)
    if v.ndim != 2:
        raise errors.InvalidArgumentError(f"first_nonfinite_row: a 2-D array, got {v.shape}")
    row = ffi.new("int64_t *")
    check(lib.kv_xfind_nonfinite(ptr("float *", v), v.shape[0], v.shape[1], row),
          "first_nonfinite_row")
    return int(row[0])


def fill_optim(c_optim, optimizer) -> None:
    """Copy a row optimizer's hyperparameters into a kv_optim_t and check them in C."""
    for field, value in optimizer._c_fields().items():
        if field == "kind":
            value = _OPT_KINDS[value]
        elif field == "flags":
            value = sum(_OPT_FLAGS[name] for name in set(value))
        setattr(c_optim, field, value)
    check(lib.kv_optim_check(ffi.addressof(c_optim)), f"optimizer {optimizer!r}")
