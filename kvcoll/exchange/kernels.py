"""The exchange's C kernels: each phase of a step as one C call over every table.

`TableSet` wraps csrc/kv_exchange.h for this rank's shards: the sender plans a pull
(unique + partition of every table's ids), the owner serves the rows and later applies
the push at the rows it served, and the rows are regrouped into one matrix per dim.
`gather_grad` sums the gradient of gathered rows per row. The step modes (bsp.py,
ssp.py) move the payloads between ranks; nothing here calls MPI.

Threads. The kernels split their work over a pool of C threads (csrc/kv_pool.h), by
table and by key range, with the same bits as one thread. A process has two pools, made
at their first kernel call: one for the kernels a step waits for (the step's serve,
apply and gradient sums, while TensorFlow's threads are idle), of `core_share()`
threads, the rank's cores; and one for the kernels that run beside TensorFlow's compute
(the pipeline's helper thread, the SSP/ASP service thread: code run inside
`beside_compute()`), of `default_threads()` threads, the cores TensorFlow leaves free,
so they take no core from it. The run's `threads` setting (KVCOLL_THREADS,
kv.init(threads=...)), when not 0 (the default), sizes both (they are then one pool).
`set_threads(n)` replaces them (tests and benchmarks, between steps).
"""

from __future__ import annotations

import contextlib
import sys
import threading

import numpy as np

from .. import errors, runtime
from ..config import Config
from .._buffers import aligned_empty
from .._c import EMPTY, check, ffi, lib, ptr, step32
from ..routing import OwnerMap
from ..runtime import core_share  # (the pools are sized from it)
from ..table import nonfinite_update_error

__all__ = ["TableSet", "Prepared", "gather_grad", "threads", "default_threads", "core_share",
           "set_threads", "pool", "beside_compute"]


# -- the thread pool ---------------------------------------------------------------------

_WAITED, _BESIDE = "waited", "beside"   # the two pools (see the module's docstring)
_pools: dict = {}            # which -> (threads, handle): the pools made so far
_pool_lock = threading.Lock()
_local = threading.local()   # .beside: this thread's kernels run beside the compute


def default_threads() -> int:
    """The cores TensorFlow leaves free on this rank: core_share() less TensorFlow's
    intra-op threads (when TensorFlow is loaded: its setting, where 0, the default, means
    the whole share), at least 1. TensorFlow runs a step's dense compute on every core
    it may use, so on a host whose ranks' cores TensorFlow takes whole (this 2-core
    machine: 1 rank with TensorFlow's default, or 2 ranks) it is 1."""
    share = core_share()
    used = 0
    tf = sys.modules.get("tensorflow")
    if tf is not None and hasattr(tf, "config"):
        intra = int(tf.config.threading.get_intra_op_parallelism_threads())
        used = share if intra <= 0 else min(intra, share)
    return max(1, share - used)


@contextlib.contextmanager
def beside_compute():
    """The kernels this thread calls inside run beside TensorFlow's compute (a helper or
    service thread): on the pool of default_threads() threads, not the rank's cores."""
    before = getattr(_local, "beside", False)
    _local.beside = True
    try:
        yield
    finally:
        _local.beside = before


def _setting() -> int:
    """The run's `threads` setting (kv.init's, else KVCOLL_THREADS), read once."""
    cfg = runtime.config() if runtime.is_initialized() else Config.resolve([])
    return cfg.threads


def threads() -> int:
    """The C threads the kernels called from this thread use (made now if not yet)."""
    return int(lib.kv_pool_threads(_handle()))


def pool():
    """The C thread pool this thread's kernels run on (made now if not yet; ffi.NULL:
    one thread), for other batch kernels of a step (kvcoll.exchange.wire's conversions)."""
    return _handle()


def _handle():
    """The pool for the calling thread's kernels (ffi.NULL: one thread), made on first
    use."""
    which = _BESIDE if getattr(_local, "beside", False) else _WAITED
    made = _pools.get(which)
    if made is not None:
        return made[1]
    with _pool_lock:
        if which not in _pools:
            _make(which, _default_size(which), "KVCOLL_THREADS")
    return _pools[which][1]


def _default_size(which: str) -> int:
    """Pool `which`'s size unless set_threads says otherwise: the run's setting, else
    the cores TensorFlow leaves free (beside the compute) or the rank's cores."""
    return _setting() or (default_threads() if which == _BESIDE else core_share())


def _make(which: str, n: int, what: str) -> None:
    """Replace pool `which` by one of n threads (_pool_lock held); two pools of one size
    are one."""
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or \
            not 1 <= n <= lib.KV_POOL_MAX_THREADS:
        raise errors.InvalidArgumentError(
            f"{what}: the C threads per rank must be an integer in [1, "
            f"{lib.KV_POOL_MAX_THREADS}], got {n!r}")
    other = _pools.get(_BESIDE if which == _WAITED else _WAITED)
    old = _pools.get(which)
    if old is not None and old[0] == n:   # already that size
        return
    if other is not None and other[0] == n:
        handle = other[1]
    elif n > 1:
        out = ffi.new("kv_pool_t **")
        check(lib.kv_pool_create(int(n), out), f"{what}: starting {n} threads")
        handle = out[0]
    else:
        handle = ffi.NULL
    _pools[which] = (int(n), handle)
    if old is not None and old[1] != ffi.NULL and old[1] != handle and \
            (other is None or old[1] != other[1]):
        lib.kv_pool_destroy(old[1])


def set_threads(n: int | None) -> int:
    """Use n C threads from now on, in both pools (None: the run's setting, or the
    defaults, again); returns how many this thread's kernels use. For tests and
    benchmarks, between steps: no kernel may be running."""
    with _pool_lock:
        for which in (_WAITED, _BESIDE):
            _make(which, n if n is not None else _default_size(which), "set_threads")
    return threads()


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
        self._spare = None  # the last commit's (rows, ids) buffers, for the next prepare
        self._spare_lock = threading.Lock()

    def _handles(self):
        return ffi.new("kv_table_t *[]", [t._handle() for t in self.tables])

    def plan(self, ids: list, owners: OwnerMap):
        """Sender side of a pull (kv_xplan): each id goes to its owner under `owners`
        (a kvcoll.routing.OwnerMap); returns (send_ids, counts (world, ntab), inverse,
        upos, pos, n_unique); ids[t] are int64 C-contiguous arrays."""
        if not isinstance(owners, OwnerMap):
            raise errors.InvalidArgumentError(
                f"exchange: plan needs a kvcoll.routing.OwnerMap, got {owners!r:.100}")
        world = owners.world
        ntab = len(self.tables)
        n = np.array([a.size for a in ids], np.int64)
        bufs = [ffi.from_buffer(a if a.size else EMPTY) for a in ids]
        ptrs = ffi.new("int64_t *[]", [ffi.cast("int64_t *", b) for b in bufs])
        total = int(n.sum())
        send = np.empty(total, np.int64)
        counts = np.empty((int(world), ntab), np.int64)
        inverse = np.empty(total, np.int64)
        upos = np.empty(total, np.int64)
        pos = np.empty(total, np.int64)
        nu = np.empty(ntab, np.int64)
        check(lib.kv_xplan(_handle(), ntab, owners._ptr, owners.buckets, world, ptrs,
                           ptr("int64_t *", n),
                           ptr("int32_t *", self.group), ptr("int64_t *", send),
                           ptr("int64_t *", counts), ptr("int64_t *", inverse),
                           ptr("int64_t *", upos), ptr("int64_t *", pos),
                           ptr("int64_t *", nu)), "exchange: plan")
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
            check(lib.kv_xserve(_handle(), self._handles(), ntab, world,
                                ptr("int64_t *", recv_ids),
                                ptr("int64_t *", rc), step32(step), 0, ptr("float *", reply),
                                ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL),
                  "exchange: serve")
            return None
        uidx = np.empty(total, np.int64)
        ukeys = np.empty(total, np.int64)
        urefs = np.empty(total, np.uint32)
        ustart = np.empty(ntab + 1, np.int64)
        gens = np.empty(ntab, np.uint64)
        check(lib.kv_xserve(_handle(), self._handles(), ntab, world,
                            ptr("int64_t *", recv_ids),
                            ptr("int64_t *", rc), step32(step), 1, ptr("float *", reply),
                            ptr("int64_t *", uidx), ptr("int64_t *", ukeys),
                            ptr("uint32_t *", urefs), ptr("int64_t *", ustart),
                            ptr("uint64_t *", gens)), "exchange: serve")
        return (rc, uidx, ukeys, urefs, ustart, gens)

    def reserve(self, recv_counts: np.ndarray) -> None:
        """Make room ahead, in each table, for the rows a serve of ids received in these
        counts (recv_counts: (world, tables), as serve() takes them) can create: per
        table, as many rows as ids were received for it (KvTable.reserve: the memory is
        allocated and faulted in, the index grown, now rather than in the serve). The
        ids received are an upper bound of the rows the serve creates (ids the table
        holds already, ids sent by several ranks and ids not admitted create none), so
        a table holds at most one step's ids of rows beyond what it needs: the room is
        kept for the steps after. One C call per table. A reservation that fails (a
        full shard, no memory) is skipped: the serve makes its own room as ever, and
        reports the error if the rows it must create do not fit."""
        per_table = np.asarray(recv_counts, np.int64).reshape(-1, len(self.tables)).sum(axis=0)
        for table, n in zip(self.tables, per_table.tolist()):
            if n:
                try:
                    table.reserve(n)
                except errors.CapacityError:    # TableFullError too
                    pass

    def prepare(self, state, grads: np.ndarray, step: int, scale: float = 1.0) -> "Prepared":
        """Owner side of a push, first half (kv_xprepare): every row and optimizer slot
        scale * grads (float32, payload layout) would give the ids a serve returned
        `state` for, computed without changing any table. Raises NonFiniteError naming
        the table and the key when an update (or a gradient) is not finite: then the
        step must be given up (nothing to undo). commit() writes what it computed."""
        rc, uidx, ukeys, urefs, ustart, gens = state
        if grads.dtype != np.float32 or not grads.flags.c_contiguous or \
                grads.size != int((rc * self.dims).sum()):
            raise errors.InvalidArgumentError("exchange: apply: gradient payload does not match "
                                              "the served ids")
        if not isinstance(step, (int, np.integer)) or step < 1:
            raise errors.InvalidArgumentError(
                f"exchange: step must be an integer >= 1, got {step!r}")
        handles = self._handles()
        ntab = len(self.tables)
        floats = int(lib.kv_xprepare_floats(handles, ntab, ptr("int64_t *", ustart)))
        check(lib.KV_EINVAL if floats < 0 else lib.KV_OK, "exchange: prepare")
        with self._spare_lock:
            spare, self._spare = self._spare, None
        rows, ids = spare if spare is not None else (None, None)
        if rows is None or rows.size < floats:
            rows = aligned_empty(max(floats, 1), np.float32)
        if ids is None or ids.size < int(ustart[-1]):
            ids = np.empty(max(int(ustart[-1]), 1), np.uint32)
        pgens = np.empty(ntab, np.uint64)
        bad = np.zeros(3, np.int64)
        status = lib.kv_xprepare(_handle(), handles, ntab, rc.shape[0], ptr("int64_t *", rc),
                                 ptr("float *", grads), float(scale), int(step),
                                 ptr("int64_t *", uidx), ptr("int64_t *", ukeys),
                                 ptr("uint32_t *", urefs), ptr("int64_t *", ustart),
                                 ptr("uint64_t *", gens), ptr("float *", rows),
                                 ptr("uint32_t *", ids), ptr("uint64_t *", pgens),
                                 ptr("int64_t *", bad))
        if status == lib.KV_ENONFINITE and bad[0] >= 0:
            self._spare = (rows, ids)
            raise nonfinite_update_error(self.tables[int(bad[0])], int(bad[1]), int(bad[2]),
                                         int(step))
        if status != lib.KV_OK:
            self._spare = (rows, ids)
        check(status, "exchange: apply gradients")
        return Prepared(state, rows, ids, pgens, int(step))

    def commit(self, prepared: "Prepared") -> np.ndarray:
        """Owner side of a push, second half (kv_xcommit): write what prepare() computed.
        Between the two, nothing else may change these rows. Returns the ids without a
        row, per table."""
        _, _, ukeys, _, ustart, _ = prepared.state
        missing = np.zeros(len(self.tables), np.int64)
        check(lib.kv_xcommit(_handle(), self._handles(), len(self.tables),
                             ptr("int64_t *", ukeys),
                             ptr("int64_t *", ustart), ptr("uint32_t *", prepared.ids),
                             ptr("uint64_t *", prepared.gens), ptr("float *", prepared.rows),
                             prepared.step, ptr("int64_t *", missing)),
              "exchange: apply gradients")
        self._spare, prepared.rows = (prepared.rows, prepared.ids), None
        return missing

    def apply(self, state, grads: np.ndarray, step: int, scale: float = 1.0) -> np.ndarray:
        """Owner side of a push at once: prepare() then commit(), so an update that is
        not finite changes nothing (NonFiniteError naming the table and the key).
        Returns the ids without a row, per table."""
        return self.commit(self.prepare(state, grads, step, scale))

    def forget_new(self, state, step: int) -> int:
        """Undo a rejected step's lookups: the rows its serve (`state`) created, never
        updated, are removed from every table. Returns how many."""
        _, _, ukeys, _, ustart, _ = state
        return sum(t.forget_new(ukeys[ustart[i]:ustart[i + 1]], step)
                   for i, t in enumerate(self.tables))

    def regroup(self, counts: np.ndarray, payload: np.ndarray, out: list) -> None:
        """Payload rows (layout of counts) into out[g], one float32 matrix per group."""
        bufs = [ffi.from_buffer(o) for o in out]
        check(lib.kv_xregroup(len(self.tables), counts.shape[0],
                              ptr("int64_t *", np.ascontiguousarray(counts, np.int64)),
                              ptr("int32_t *", self.dims), ptr("int32_t *", self.group),
                              ptr("float *", payload),
                              ffi.new("float *[]", [ffi.cast("float *", b) for b in bufs])),
              "exchange: regroup")

    def ungroup(self, counts: np.ndarray, mats: list, payload: np.ndarray) -> None:
        """The group matrices mats[g] into payload (layout of counts)."""
        bufs = [ffi.from_buffer(m) for m in mats]
        check(lib.kv_xungroup(len(self.tables), counts.shape[0],
                              ptr("int64_t *", np.ascontiguousarray(counts, np.int64)),
                              ptr("int32_t *", self.dims), ptr("int32_t *", self.group),
                              ffi.new("float *[]", [ffi.cast("float *", b) for b in bufs]),
                              ptr("float *", payload)),
              "exchange: ungroup")


class Prepared:
    """A push computed by TableSet.prepare and not yet written: the serve's state, every
    updated row and slot (rows), the row each goes to (ids) and the tables' generations
    they were found at, and the step."""

    __slots__ = ("state", "rows", "ids", "gens", "step")

    def __init__(self, state, rows, ids, gens, step):
        self.state, self.rows, self.ids, self.gens, self.step = state, rows, ids, gens, step


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
    check(lib.kv_xrowgrad(_handle(), int(n_rows), dim, ptr("float *", v),
                          ptr("int64_t *", i),
                          i.size, ptr("float *", out)),
          f"gather_grad: an index outside [0, {int(n_rows)}), or a bad size")
    return out
