"""SSP and ASP exchange: a service thread per rank, worker clocks, bounded staleness.

Every rank is both a worker (its training thread) and an owner (its service thread):
the owner of a row or of a slice of the dense parameters is the only rank that updates
it. Two private communicators (dups of the trainer's) keep the directions apart:

    requests  workers -> owners   PULL, PUSH, DONE    received by service threads only
    replies   owners -> workers   rows, dense slice   received by training threads only

so each receive side is used by exactly one thread. Between two ranks on one
communicator messages arrive in the order they were sent (MPI's non-overtaking rule),
which is what the clock argument below rests on.

Clocks. A worker's clock is the number of steps it has finished. Step t of worker w:

  1. gate (SSP only): wait until every worker that is not DONE has finished step
     t - S - 1, as this rank's service thread has seen it; so no worker is ever more
     than S steps ahead of the slowest (its lead, t - 1 - min clock, is <= S);
  2. pull: one PULL(t) to every owner with the ids it owns (and "send me your dense
     slice"); an owner serves it only once it has seen PUSH(s) with s >= t - S - 1 from
     every worker that is not DONE (SSP). Since a worker's pushes of step s reach the
     owner before anything it sends later, the rows and the slice served reflect every
     update of every worker's steps <= t - S - 1;
  3. compute, then push: one PUSH(t) to every owner (the gradients of the rows it owns
     and of its dense slice; empty ones too: a PUSH is also the worker's CLOCK(t)).
     Pushes are not waited for (at most a few steps of sends are in flight).

ASP is staleness None: no gate, pulls are served at once. S = 0 is BSP's schedule
(each step sees all of the previous one), though updates are applied per worker.

DONE: a worker whose data ended says so; it no longer holds anyone back. finish()
waits until every rank is DONE (each DONE follows that rank's last push), then a
barrier, so every update everywhere has been applied; then every rank gathers the
whole dense vector. The trainer's next step (a new epoch) makes it active again.

A worker's own share (the rows and the slice this rank owns) takes no message: the
training thread reads it right after the gate, which has checked the same clocks the
service thread would, and applies its own pushes itself before recording its clock.

Rows move with the BSP exchange's kernels (kvcoll.table.TableSet): a pull is planned
in one C call (ids by owner, then table: the layout of a BSP pull, so the Trainer reads
the rows as they come), an owner serves a request in one call straight into its reply
and keeps what it found until that worker's push, which it applies there in one call
(no lookup; the table locks per table: a row's value and its slots change together).
Owners apply row gradients with the table's row optimizer, and dense gradients to their slice
with the C kernel of the dense optimizer (only the service thread touches the slice).
Rows and row gradients travel at the wire's width (wire_dtype: fp32, fp16 or bf16;
kvcoll.exchange.wire), this rank's own share rounded alike; the dense slices and
gradients stay float32. A row that does not fit arrives as Inf and the requester's
compute refuses its step (Pull.check); a gradient that does not fit is its sender's
outcome, and nothing of that push is sent.
A push whose update would make a row or an optimizer slot NaN/Inf is refused whole by
its owner (nothing of it applied); unlike BSP, where every rank refuses such a step
alike, the ranks here have stepped on, so the job ends with an error naming the
table, the key, the pushing rank and its step.
Nothing waits forever: every wait has a deadline and names the rank and operation.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
import weakref

import numpy as np

from ..comm import SPIN, Comm, run_time
from ..errors import CommError, CommTimeoutError, InvalidArgumentError, NonFiniteError
from ..table import KvTable
from .._buffers import aligned_empty
from .bsp import BspExchange, Pull, hold_tables
from .dense import apply_rows, init_slots
from .agreement import FAILED, OK, Agreement
from .doorbell import Doorbells
from .kernels import beside_compute

__all__ = ["SspExchange", "close_all"]

_LIVE: "weakref.WeakSet" = weakref.WeakSet()   # exchanges whose service thread may run


def close_all() -> None:
    """Stop every live service thread (at exit, before MPI_Finalize)."""
    for ex in list(_LIVE):
        ex.close()


_PULL, _PUSH, _DONE, _ABANDON = 1, 2, 3, 4
_IDLE = 0.02   # seconds the service thread waits in C at most before it looks anyway
_TAG_REQ, _TAG_REPLY = 11, 12
_HEADER = 4  # int64 words: kind, clock, flags, reserved
_F_CREATE, _F_DENSE = 1, 2


@dataclasses.dataclass
class _Trace:
    """Per step of this worker: what it waited for and how stale its data was."""

    step: int
    lead: int          # step - 1 - slowest clock seen at the gate
    staleness: int     # step - 1 - slowest clock the owners had seen when they served
    t_start: float     # time.time() after the gate
    t_end: float = 0.0  # time.time() just before its pushes were posted


def _pack(header, ints=(), floats=(), rows=None) -> np.ndarray:
    """A message: int64 header and runs, float32 runs, then `rows` (the wire's values:
    float32 or uint16) last."""
    parts = [np.asarray(header, np.int64)] + [np.ascontiguousarray(a, np.int64) for a in ints] \
        + [np.ascontiguousarray(a, np.float32).reshape(-1) for a in floats]
    if rows is not None:
        parts.append(np.ascontiguousarray(rows).reshape(-1))
    return np.concatenate([p.view(np.uint8) for p in parts])


class _Reader:
    """Reads int64 and float32 runs off a received byte buffer."""

    def __init__(self, buf: np.ndarray):
        self.buf, self.at = buf, 0

    def ints(self, n: int) -> np.ndarray:
        out = self.buf[self.at:self.at + 8 * n].view(np.int64)
        self.at += 8 * n
        return out

    def floats(self, n: int) -> np.ndarray:
        out = self.buf[self.at:self.at + 4 * n].view(np.float32)
        self.at += 4 * n
        return out

    def rows(self, n: int, dtype: np.dtype) -> np.ndarray:
        """n values of the wire's dtype (float32 or uint16)."""
        size = n * dtype.itemsize
        out = self.buf[self.at:self.at + size].view(dtype)
        self.at += size
        return out


class SspExchange:
    """Asynchronous pull/push of rows and dense slices with a staleness bound.

    comm: the trainer's communicator (its dups carry the protocol; it is used itself
        only for finish()'s barrier and gathers). tables: name -> this rank's shard.
    staleness: SSP's bound S (>= 0), or None for ASP.
    dense_size: length of the flat dense parameter vector (0: none). dense_optimizer:
        the kvcoll row optimizer the slice owners apply to it.
    Call start_dense(flat) once (every rank, before its first step or finish) with the
    initial dense vector; each rank keeps only its slice.

    step: the last step this rank started (its clock once pushed); set_step(s) makes
    every worker's clock s (a restore: every rank restores the same step).
    owners: the kvcoll.routing.OwnerMap ids are routed by (default: the even map of
    comm.size).
    wire_dtype: "fp32", "fp16" or "bf16", the rows' and row gradients' width on the wire
    (default: the run's, kv.init(wire_dtype=) / --wire-dtype / KVCOLL_WIRE_DTYPE).
    wire_bytes: bytes this rank has sent to other ranks, by payload ("ids"; "rows", its
    service thread's replies; "grads"), without the messages' headers.
    """

    synchronous = False

    def __init__(self, comm: Comm, tables: dict[str, KvTable], staleness: int | None,
                 dense_size: int = 0, dense_optimizer=None, max_inflight_steps: int = 4,
                 owners=None, wire_dtype=None):
        if staleness is not None and (not isinstance(staleness, int) or staleness < 0):
            raise InvalidArgumentError(
                f"staleness must be an int >= 0 or None (ASP), got {staleness!r}")
        comm.require_threads("SSP/ASP (a service thread per rank)")
        hold_tables(self, comm, tables, owners, wire_dtype)
        self.staleness = staleness
        world, rank = comm.size, comm.rank
        self._world, self._rank = world, rank
        self._bounds = [dense_size * r // world for r in range(world + 1)]
        self.dense_size = int(dense_size)
        self._dense_opt = dense_optimizer
        if dense_size and dense_optimizer is None:
            raise InvalidArgumentError("a dense vector needs a dense_optimizer")
        self._inflight_limit = max(1, max_inflight_steps) * world
        self._req = comm.dup()   # workers -> service threads
        self._rep = comm.dup()   # service threads -> workers
        # State shared by the two threads, guarded by _cv.
        self._cv = threading.Condition()
        self._clock = np.zeros(world, np.int64)   # steps finished by each worker, as seen here
        self._done = np.zeros(world, bool)
        self._master = None       # (1, slice) float32: this rank's dense slice
        self._slots = None
        self._dense_updates = 0
        self._error: BaseException | None = None
        self._stop = False
        # Worker side (training thread only).
        self._sends: collections.deque = collections.deque()
        self._last: Pull | None = None   # the last pull, for push
        self.trace: list[_Trace] = []
        self.staleness_observed = 0
        self.max_lead = 0
        self.last_wait = 0.0     # seconds the last step waited at the staleness gate
        self.pushes_applied = 0   # service side: pushes applied here (rows or dense)
        # Owner side: what each served pull found (TableSet.serve's state: the rows, to
        # apply that push at without a lookup), by (worker, step), until the push.
        self._served: dict[tuple[int, int], tuple] = {}
        self.step = 0
        self._apply_lock = threading.Lock()  # a push's learning rates and its update go together
        self._dense_kernels: dict = {}       # learning rate -> the dense kernel with it
        self._lookups: BspExchange | None = None
        # the profile service_stats() reads: the service side's counters (updated by the
        # service thread, or under _serve_lock), the training thread's own
        self._stats = collections.Counter()
        self._wstats = collections.Counter()
        # Receiving and handling requests: by whoever holds _serve_lock (the service
        # thread, or the training thread while it waits for replies); deferred pulls
        # and replies in flight go with it.
        self._serve_lock = threading.Lock()
        self._deferred: collections.deque = collections.deque()
        self._replies: collections.deque = collections.deque()
        # The service thread idles in C (None: this MPI's probe is not reachable from C;
        # it polls in Python) until a request comes or its doorbell rings: rung by the
        # workers on this machine after their requests, and by _changed().
        self._bells = Doorbells(comm)
        self._waiter = self._req.waiter(_TAG_REQ, bell=self._bells.own,
                                        shared=self._bells.own is not None)
        self._thread = threading.Thread(target=self._serve, name=f"kvcoll-service-{rank}",
                                         daemon=True)
        self._thread.start()
        _LIVE.add(self)

    # -- worker side ---------------------------------------------------------------------

    def set_step(self, step: int) -> None:
        """Continue from `step` (a restore, on every rank between steps): every
        worker's clock becomes `step` and every worker is active."""
        with self._cv:
            self.step = int(step)
            self._clock[:] = self.step
            self._done[:] = False
            self._changed()

    def start_dense(self, flat: np.ndarray, state: np.ndarray | None = None,
                    updates: int = 0, replace: bool = False) -> None:
        """Give this rank's service thread its dense slice (once; later calls are no-ops
        unless `replace`: a restore, when no update is in flight).

        state: optionally the optimizer's per-parameter state, (k, dense_size) for the
        first k slots of the C layout (Adam: m, v; Adagrad: accum), e.g. restored from a
        checkpoint; updates: how many updates it has seen (Adam's bias correction)."""
        with self._cv:
            if (self._master is not None and not replace) or not self.dense_size:
                return
            lo, hi = self._bounds[self._rank], self._bounds[self._rank + 1]
            flat = np.asarray(flat, np.float32).reshape(-1)
            if flat.size != self.dense_size:
                raise InvalidArgumentError(
                    f"start_dense: {flat.size} values, expected {self.dense_size}")
            self._master = flat[lo:hi].copy().reshape(1, -1)
            self._slots = init_slots(self._dense_opt, hi - lo) if hi > lo else None
            if state is not None and hi > lo and len(state):
                state = np.asarray(state, np.float32)
                k = state.shape[0]
                self._slots[0, :k * (hi - lo)] = state[:, lo:hi].reshape(-1)
            self._dense_updates = int(updates)
            self._changed()

    def _changed(self) -> None:
        """Clocks, DONE marks or the dense slice changed: wake the threads waiting on
        them (the gate, and the service thread, which may now answer deferred pulls;
        it looks again by itself after what it handles). Needs _cv."""
        self._cv.notify_all()
        if self._waiter is not None and threading.current_thread() is not self._thread:
            self._waiter.ring()

    def _check(self) -> None:
        if self._error is not None:
            raise CommError(f"rank {self._rank}: the SSP/ASP service thread failed: "
                            f"{type(self._error).__name__}: {self._error}") from self._error
        if not self._thread.is_alive():
            raise CommError(f"rank {self._rank}: the SSP/ASP service thread has stopped")

    def _min_active(self) -> int | None:
        """Slowest clock over the workers that are not DONE (None: all are). Needs _cv."""
        active = ~self._done
        return int(self._clock[active].min()) if active.any() else None

    def wait_turn(self, step: int) -> int:
        """Block (SSP) until `step` may start; returns this worker's lead over the slowest
        worker, step - 1 - (slowest clock seen here)."""
        t_wait = time.perf_counter()
        deadline = run_time() + self.comm.timeout
        behind = None
        with self.comm.waiting(f"ssp:gate at step {step}"), self._cv:
            while True:
                self._check()
                slow = self._min_active()
                if self.staleness is None or slow is None or slow >= step - self.staleness - 1:
                    break
                if run_time() > deadline:
                    behind = [r for r in range(self._world) if not self._done[r]
                              and self._clock[r] < step - self.staleness - 1]
                    break
                self._cv.wait(0.05)
                self.comm.answer_liveness()
            lead = max(0, step - 1 - (slow if slow is not None else step - 1))
        if behind is not None:
            raise self._timed_out(f"ssp:gate at step {step}: rank(s) {behind} did not "
                                  f"finish step {step - self.staleness - 1} within "
                                  f"{self.comm.timeout:g}s")
        self.last_wait = time.perf_counter() - t_wait
        self.max_lead = max(self.max_lead, lead)
        self.trace.append(_Trace(step, lead, 0, time.time()))
        return lead

    def _timed_out(self, what: str) -> CommTimeoutError:
        """The error of a wait of this worker's that timed out (`what`: which, for whom),
        naming who is lost: a rank the wait was for may itself wait for another. Call it
        outside the lock: the service thread goes on serving the others meanwhile."""
        with self.comm.waiting(what):
            _, report = self.comm.liveness()
        return CommTimeoutError(
            f"rank {self._rank}/{self._world}: {what}; "
            f"{report or f'they died, stopped or are cut off from rank {self._rank}'} "
            "(raise the limit with KVCOLL_COMM_TIMEOUT)")

    def pull(self, ids: dict[str, np.ndarray], agreement: Agreement | None = None, *,
             dense: bool = True, create: bool = True) -> Pull | None:
        """Start step self.step + 1: wait for its turn (SSP), then the rows of every
        table's ids (created if new, with create) and, with dense, the whole dense
        vector (Pull.dense), as served by the owners under the staleness rule. The rows
        come in the layout of a BSP pull (owner after owner, then table after table).
        The agreement is this rank's alone here (ranks step on their own): None, with
        nothing pulled, when its own vote does not let the step proceed (a bad batch, no
        samples, a stop)."""
        if agreement is not None and not agreement.settle(None, self._rank).proceeds:
            return None
        step = self.step + 1
        self.comm.step = step  # named by a timeout error
        self.wait_turn(step)
        world, me = self._world, self._rank
        if set(ids) != set(self._names):
            raise InvalidArgumentError(f"pull: ids must name every table exactly; got {sorted(ids)}, "
                             f"tables {self._names}")
        given = [np.ascontiguousarray(ids[n], np.int64) for n in self._names]
        t_plan0 = time.perf_counter()
        plan = self._set.plan(given, self.owners)
        send, counts = plan[0], plan[1]                     # ids by owner, then table
        t_plan = time.perf_counter()
        self._wstats["plan_s"] += t_plan - t_plan0
        id_at, fl_at = self._offsets(counts)
        flags = (_F_CREATE if create else 0) | (_F_DENSE if dense and self.dense_size else 0)
        owners = []
        for r in range(world):
            has_dense = bool(flags & _F_DENSE) and self._bounds[r + 1] > self._bounds[r]
            if r == me or (not has_dense and not counts[r].any()):
                continue
            msg = _pack([_PULL, step, flags if has_dense else flags & ~_F_DENSE, 0],
                        [counts[r], send[id_at[r]:id_at[r + 1]]])
            self._send(self._req, msg, r, f"ssp:pull of step {step} to rank {r}")
            self.wire_bytes["ids"] += 8 * int(id_at[r + 1] - id_at[r])
            owners.append(r)
        payload = aligned_empty(int(fl_at[-1]), np.float32)
        flat = np.empty(self.dense_size, np.float32) if flags & _F_DENSE else None
        t_own = time.perf_counter()
        self._wstats["send_s"] += t_own - t_plan
        # This rank's own share, served here while the peers work on theirs: the gate
        # (wait_turn) has already checked, on this owner's clocks, what serving needs.
        # Peers' requests that are here already go first: their workers wait for them.
        self._help()
        lo, hi = self._bounds[me], self._bounds[me + 1]
        state = self._set.serve(send[id_at[me]:id_at[me + 1]], counts[me:me + 1], step, create,
                                payload[fl_at[me]:fl_at[me + 1]])
        if create:
            self._served[(me, step)] = state
        wire = self.wire
        bad = wire.round(payload[fl_at[me]:fl_at[me + 1]])   # read as if it crossed the wire
        bad = -1 if bad < 0 else int(fl_at[me]) + bad
        with self._cv:
            self._check()
            if flat is not None and hi > lo:
                while self._master is None:   # only before this rank's own start_dense
                    self._cv.wait(0.05)
                    self._check()
                flat[lo:hi] = self._master[0]
            slow = self._min_active()
        stale = 0 if slow is None else step - 1 - slow
        tw = time.perf_counter()
        self._wstats["own_s"] += tw - t_own
        for r in owners:
            _, _, buf = self._rep.recv(r, _TAG_REPLY, poll=self._help, spin=SPIN,
                                       op=f"ssp:pull of step {step} from rank {r}")
            rd = _Reader(buf)
            slow = int(rd.ints(1)[0])
            stale = max(stale, step - 1 - slow)
            if flat is not None and self._bounds[r + 1] > self._bounds[r]:
                flat[self._bounds[r]:self._bounds[r + 1]] = \
                    rd.floats(self._bounds[r + 1] - self._bounds[r])
            n = int(fl_at[r + 1] - fl_at[r])
            _, got = wire.unpack(rd.rows(int(wire.counts(n)), wire.dtype), [n],
                                 out=payload[fl_at[r]:fl_at[r + 1]])
            if got >= 0 and (bad < 0 or fl_at[r] + got < bad):
                bad = int(fl_at[r]) + got
        self._wstats["replies_s"] += time.perf_counter() - tw
        stale = max(0, stale)
        self.staleness_observed = max(self.staleness_observed, stale)
        if self.trace and self.trace[-1].step == step:
            self.trace[-1].staleness = stale
        out = Pull(self._set, self._names, [a.size for a in given], payload, plan)
        out.step, out.dense = step, flat
        if bad >= 0:
            name, key = out.where(bad)
            out.wire_error = wire.overflow_error(f"table {name!r}, key {key}: a value of its row",
                                                 None, step)
        self._last = out if create else None
        self.step = step
        return out

    def lookup(self, ids: dict[str, np.ndarray], agreement: Agreement) -> Pull | None:
        """Rows for evaluation (absent ids read zeros, nothing changes): a BSP collective
        on the trainer's communicator, with BSP's agreement, so call it when no rank is
        stepping (after finish())."""
        if self._lookups is None:
            self._lookups = BspExchange(self.comm, self.tables, wire_dtype=self.wire.name)
        self._lookups.set_step(self.step)
        return self._lookups.lookup(ids, agreement)

    def _offsets(self, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where each owner's ids and rows start in a pull's payloads (counts: (world,
        tables))."""
        id_at = np.zeros(self._world + 1, np.int64)
        fl_at = np.zeros(self._world + 1, np.int64)
        np.cumsum(counts.sum(axis=1), out=id_at[1:])
        np.cumsum((counts * self._dims).sum(axis=1), out=fl_at[1:])
        return id_at, fl_at

    def push(self, pull: Pull | None, grads: dict, dense_grad: np.ndarray | None = None,
             extra: np.ndarray | None = None, agreement: Agreement | None = None,
             lr: dict | None = None, dense_lr: float | None = None) -> "Posted":
        """Send the gradients of pull's rows (and of the dense vector) to their owners,
        and announce that this worker finished that step. Does not wait for them to be
        applied. grads: per group or per table, as for a BSP push (see
        Pull.payload_of); the owners apply them as they are, with lr (table name ->
        learning rate for this step; absent: the table's own) and dense_lr (the dense
        kernel's). Returns a handle like BSP's, whose reduced() is [dense_grad, extra]
        of this rank alone (nothing is summed over ranks here). With an agreement whose
        outcome is not OK nothing is sent: give the step up with abandon().

        This rank's own share is applied here, at once: an update of it that would make
        a row or a slot NaN/Inf raises NonFiniteError (that share unchanged; the parts
        already sent to lower ranks are theirs to apply or refuse), and the run cannot
        go on (see _apply)."""
        world = self._world
        if agreement is not None and agreement.outcome != OK:   # nothing is sent
            agreement.settle_outcome(agreement.outcome_codes(world, self._rank))
            return Posted(None, pull, 0)
        last = pull if pull is not None and pull is self._last else None
        step = pull.step if pull is not None else self.step
        if last is None:
            if any(np.size(g) for g in grads.values()):
                raise InvalidArgumentError(
                    "push: row gradients without this step's pull (create=True) before")
            counts = np.zeros((world, len(self._names)), np.int64)
            payload = np.zeros(0, np.float32)
        else:
            counts, payload = last.counts, last.payload_of(grads)
        wire = self.wire
        _, fl_at = self._offsets(counts)
        per_rank = np.diff(fl_at)
        packed, bad = wire.pack(payload, per_rank)
        at = np.zeros(world + 1, np.int64)      # where each owner's wire values start
        np.cumsum(wire.counts(per_rank), out=at[1:])
        if bad >= 0:    # refused like a failed compute: nothing of it is sent
            name, key = last.where(bad)
            exc = wire.overflow_error(f"table {name!r}, key {key}: a value of its row gradient",
                                      float(payload[bad]), step)
            if agreement is None:
                raise exc    # nothing sent: the step is still this rank's to abandon
            agreement.report(FAILED, exc)
        if agreement is not None:
            agreement.settle_outcome(agreement.outcome_codes(world, self._rank))
            if agreement.outcome_failed:
                return Posted(None, pull, 0)
        if dense_grad is not None:
            dense_grad = np.ascontiguousarray(dense_grad, np.float32).reshape(-1)
            if dense_grad.size != self.dense_size:
                raise InvalidArgumentError(f"push: dense gradient of {dense_grad.size} "
                                           f"values, expected {self.dense_size}")
        # this step's learning rates: one per table, then the dense kernel's (NaN: keep)
        rates = np.full(len(self._names) + 1, np.nan, np.float32)
        for t, name in enumerate(self._names):
            if lr and name in lr:
                rates[t] = lr[name]
        if dense_lr is not None:
            rates[-1] = dense_lr
        if self.trace and self.trace[-1].step == step:
            self.trace[-1].t_end = time.time()   # before any peer can see this step's push
        for r in range(world):
            rg = packed[at[r]:at[r + 1]]
            dg = dense_grad[self._bounds[r]:self._bounds[r + 1]] if dense_grad is not None \
                else None
            if r == self._rank:  # this rank's own share: applied here, in order, at once
                self._apply(r, step, counts[r], wire.unpack(rg, per_rank[r:r + 1])[0], dg,
                            rates)
                continue
            msg = _pack([_PUSH, step, int(dg is not None), 0], [counts[r]],
                        [rates, dg if dg is not None else np.zeros(0, np.float32)], rows=rg)
            self._send(self._req, msg, r, f"ssp:push of step {step} to rank {r}")
            self.wire_bytes["grads"] += rg.size * wire.itemsize
        self._last = None
        parts = [np.asarray(p, np.float32).reshape(-1) for p in (dense_grad, extra)
                 if p is not None]
        return Posted(np.concatenate(parts) if parts else None, None,
                      0 if dense_grad is None else dense_grad.size)

    def abandon(self, step) -> None:
        """Give up this worker's step in flight (its Pull, or the Posted of a push that
        sent nothing because the step failed): the rows its pull created are removed,
        here and (one ABANDON message each) on the owners it pulled from, which also
        drop what they kept for its push; the step counter goes back. Other workers'
        steps are not touched (they step on their own)."""
        pull = step._pull if isinstance(step, Posted) else step
        if pull is None or pull is not self._last:
            return
        self._last = None
        n = pull.step
        state = self._served.pop((self._rank, n), None)
        if state is not None:
            self._set.forget_new(state, n)
        for r in range(self._world):
            if r != self._rank and pull.counts[r].any():
                self._send(self._req, _pack([_ABANDON, n, 0, 0]), r,
                           f"ssp:abandon of step {n} to rank {r}")
        if self.step == n:
            self.step -= 1
        if self.trace and self.trace[-1].step == n:
            self.trace.pop()

    def set_dense(self, flat, state=None, updates: int = 0, replace: bool = False) -> None:
        """The dense vector's initial values (see start_dense)."""
        self.start_dense(flat, state, updates, replace=replace)

    def replan(self, comm: Comm, owners=None) -> None:
        """Continue on another communicator (a new world) and owner map (default: the
        even map of its size), between steps: the service
        thread and its communicators are rebuilt for it, every worker's clock restarts at
        this rank's step, and the dense slices are cut anew: give the dense vector again
        with set_dense before the next step. Moving rows whose owner changed is the
        caller's (the elastic runtime's)."""
        step = self.step
        self.close()
        self.__init__(comm, self.tables, self.staleness, self.dense_size, self._dense_opt,
                      self._inflight_limit // max(1, self._world), owners=owners,
                      wire_dtype=self.wire.name)
        self.set_step(step)

    def _send(self, comm: Comm, msg: np.ndarray, dest: int, op: str) -> None:
        sends = self._sends
        while sends and sends[0].done():
            sends.popleft()
        while len(sends) >= self._inflight_limit:
            sends.popleft().wait()
        sends.append(comm.isend(msg, dest, _TAG_REQ, op))
        if dest != self._rank:
            self._bells.ring(dest)
        elif self._waiter is not None:   # (finish's DONE to itself)
            self._waiter.ring()

    def _drain_sends(self) -> None:
        while self._sends:
            self._sends.popleft().wait()

    def finish(self) -> int:
        """This worker is done (its clock is self.step): announce it, wait until every
        rank is done (all their updates applied here), barrier. Afterwards every update
        of every worker is in every owner's rows and slices. Returns the largest clock
        of any worker, from which every worker continues (self.step becomes it)."""
        step = self.step
        for r in range(self._world):
            self._send(self._req, _pack([_DONE, step, 0, 0]), r,
                       f"ssp:done at step {step} to rank {r}")
        self._drain_sends()
        limit = self.comm.timeout
        deadline = run_time() + limit
        missing = None
        with self.comm.waiting(f"ssp:finish at step {step}"), self._cv:
            seen = (self._clock.sum(), self._done.sum())
            while not self._done.all():
                self._check()
                now = (self._clock.sum(), self._done.sum())
                if now != seen:  # someone made progress: the deadline restarts
                    seen, deadline = now, run_time() + limit
                if run_time() > deadline:
                    missing = [r for r in range(self._world) if not self._done[r]]
                    break
                self._cv.wait(0.05)
                self.comm.answer_liveness()
        if missing is not None:
            raise self._timed_out(f"ssp:finish at step {step}: rank(s) {missing} made no "
                                  f"progress for {limit:g}s and did not finish")
        self.comm.barrier("ssp:finish")
        top = int(self.comm.allreduce(np.array([step], np.int64), op="ssp:finish:clock",
                                      mpi_op="max")[0])
        with self._cv:
            # A next step (new epoch) starts from a common clock, with everyone active.
            self._done[:] = False
            np.maximum(self._clock, top, out=self._clock)
            self._changed()
        self.step = top
        return top

    def dense(self) -> np.ndarray:
        """The whole dense vector, gathered from the slice owners (a collective; call it
        after finish(), when no update is in flight)."""
        with self._cv:
            mine = self._master.reshape(-1).copy() if self._master is not None \
                else np.zeros(0, np.float32)
        flat, _ = self.comm.allgatherv(mine, op="ssp:dense")
        return flat

    def dense_state(self, k: int) -> tuple[np.ndarray, int]:
        """The first k per-parameter slots of the dense optimizer over the whole vector,
        (k, dense_size), and the number of updates applied (a collective, like dense())."""
        lo, hi = self._bounds[self._rank], self._bounds[self._rank + 1]
        with self._cv:
            mine = self._slots[0, :k * (hi - lo)].reshape(k, hi - lo).T.copy() \
                if self._slots is not None else np.zeros((0, k), np.float32)
            updates = self._dense_updates
        state, _ = self.comm.allgatherv(mine, op="ssp:dense_state")
        top = int(self.comm.allreduce(np.array([updates], np.int64), op="ssp:dense_updates",
                                      mpi_op="max")[0])
        return state.T.copy(), top

    def close(self) -> None:
        """Stop the service thread and free the communicators (no messages may be in
        flight: call after finish(), or when abandoning the run). A service thread that
        does not stop within 10 s keeps its communicators (freeing them under it would
        crash the process); MPI_Finalize reclaims them."""
        _LIVE.discard(self)
        if self._thread.is_alive():
            self._stop = True
            if self._waiter is not None:
                self._waiter.ring()
            self._thread.join(timeout=10)
        if self._thread.is_alive():
            return
        for s in self._sends:
            s.done()
        self._sends.clear()
        self._waiter = None
        self._bells.close()
        for c in (self._req, self._rep):
            try:
                c.free()
            except Exception:  # pragma: no cover - a failed free must not hide an error
                pass

    # -- service side (its own thread) ---------------------------------------------------

    def service_stats(self) -> dict:
        """Where this rank's SSP/ASP time went so far (a profile; seconds are wall time):

        service: its service thread's cpu (CPU seconds), polls, waits and waited (its
            idle waits in C and their seconds), sleeps, slept (seconds of sleep asked in
            Python: without the C waiter, or while the training thread served), late
            (seconds woken beyond them: the scheduler's and the GIL's delay), msgs
            and handle_s (requests it received and the time handling them; poll_s the
            time in the receive calls), answers/answer_s (pulls served, by either
            thread) and pushes/push_s (peers' pushes applied);
        worker: its training thread's plan_s (planning pulls), send_s (posting them),
            own_s (serving its own share), replies_s (waiting for the owners' replies),
            and msgs/handle_s/helped: peers' requests it served itself while waiting.
        """
        return {"service": dict(self._stats), "worker": dict(self._wstats)}

    def _serve(self) -> None:
        """The service thread: answer requests as they come. While there are none it
        waits in C (Comm.waiter, with the GIL released: a probe, then pauses of 20 us
        doubling to 1 ms) until a request arrives or its doorbell rings: the workers on
        this machine ring it after each request (kvcoll.exchange.doorbell), and the
        training thread when it changes what deferred pulls wait for (_changed). At
        most _IDLE seconds, then it looks anyway (the replies' deadline). Without the C
        waiter it polls here, sleeping 20 us doubling to 1 ms. Whoever holds
        _serve_lock receives and handles requests: this thread, or the training thread
        while it waits for its pull's replies (_help), so an owner whose worker is
        itself waiting answers at once."""
        pause = 20e-6
        st = self._stats
        clock = time.perf_counter
        cpu0 = time.thread_time()
        try:
            with beside_compute():   # its kernels run beside the dense compute
                while not self._stop and self._error is None:
                    waiter = self._waiter
                    st["polls"] += 1
                    busy = False
                    held = self._serve_lock.acquire(blocking=False)
                    if held:
                        try:
                            busy = self._serve_once(st)
                        finally:
                            self._serve_lock.release()
                    if busy:
                        pause = 20e-6
                    elif held and waiter is not None:
                        t2 = clock()
                        waiter.wait(_IDLE)
                        st["waits"] += 1
                        st["waited"] += clock() - t2
                    else:   # no C waiter, or the training thread is serving (_help)
                        t2 = clock()
                        time.sleep(pause)
                        st["sleeps"] += 1
                        st["slept"] += pause
                        st["late"] += clock() - t2 - pause
                        pause = min(pause * 2, 1e-3)
                    st["cpu"] = time.thread_time() - cpu0
        except BaseException as exc:  # noqa: BLE001 - reported to the training thread
            self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        with self._cv:
            if self._error is None:
                self._error = exc
            self._changed()

    def _serve_once(self, st) -> bool:
        """Receive and handle one request, or answer deferred pulls that may now be
        served; retire replies that were taken. Returns whether anything was done.
        Needs _serve_lock."""
        t0 = time.perf_counter()
        got = self._req.try_recv(-1, _TAG_REQ)
        t1 = time.perf_counter()
        st["poll_s"] += t1 - t0
        deferred, replies = self._deferred, self._replies
        busy = False
        if got is not None:
            src, _, buf = got
            st["msgs"] += 1
            self._handle(src, buf, deferred, replies)
            st["handle_s"] += time.perf_counter() - t1
            busy = True
        elif deferred:
            busy = self._serve_ready(deferred, replies)
        while replies and replies[0][0].done():
            replies.popleft()
        if replies and run_time() - replies[0][1] > self._rep.timeout:
            handle, _, dest, clock = replies[0]
            raise CommTimeoutError(
                f"rank {self._rank}/{self._world}: ssp:reply to rank {dest}'s pull of "
                f"step {clock} was not taken within {self._rep.timeout:g}s; "
                f"{self._rep.describe([dest])} (raise the limit with KVCOLL_COMM_TIMEOUT)")
        return busy

    def _help(self) -> None:
        """Called by the training thread between its polls for replies: serve the
        requests that have arrived, unless the service thread is serving now. An error
        while serving is the service's (the training thread raises it, wrapped, as it
        would the service thread's)."""
        self._check()
        if not self._serve_lock.acquire(blocking=False):
            return
        try:
            while self._serve_once(self._wstats):
                self._wstats["helped"] += 1
        except BaseException as exc:  # noqa: BLE001 - ends the run like the service's
            self._fail(exc)
        finally:
            self._serve_lock.release()
        self._check()

    def _handle(self, src: int, buf: np.ndarray, deferred, replies) -> None:
        rd = _Reader(buf)
        kind, clock, flags, _ = (int(x) for x in rd.ints(_HEADER))
        if kind == _PULL:
            deferred.append((src, clock, flags, rd))
            self._serve_ready(deferred, replies)
        elif kind == _PUSH:
            self._apply_push(src, clock, flags, rd)
        elif kind == _ABANDON:
            state = self._served.pop((src, clock), None)
            if state is not None:
                with self._apply_lock:
                    self._set.forget_new(state, clock)
        elif kind == _DONE:
            with self._cv:
                self._done[src] = True
                self._clock[src] = max(self._clock[src], clock)
                self._changed()
            self._serve_ready(deferred, replies)
        else:
            raise CommError(f"rank {self._rank}: unknown message kind {kind} from rank {src}")

    def _ready(self, clock: int, flags: int) -> bool:
        if flags & _F_DENSE and self._master is None:
            return False
        if self.staleness is None:
            return True
        slow = self._min_active()
        return slow is None or slow >= clock - self.staleness - 1

    def _serve_ready(self, deferred, replies) -> bool:
        """Answer every deferred pull whose clock condition now holds (in arrival order
        per worker). Returns whether any was served."""
        served = False
        kept = collections.deque()
        blocked = set()
        while deferred:
            src, clock, flags, rd = deferred.popleft()
            with self._cv:
                ok = src not in blocked and self._ready(clock, flags)
                slow = self._min_active()
            if not ok:
                blocked.add(src)
                kept.append((src, clock, flags, rd))
                continue
            self._answer(src, clock, flags, rd, clock - 1 if slow is None else slow, replies)
            served = True
        deferred.extend(kept)
        return served

    def _answer(self, src, clock, flags, rd, slow, replies) -> None:
        t0 = time.perf_counter()
        try:
            self._answer_(src, clock, flags, rd, slow, replies)
        finally:
            self._stats["answer_s"] += time.perf_counter() - t0
            self._stats["answers"] += 1

    def _answer_(self, src, clock, flags, rd, slow, replies) -> None:
        counts = rd.ints(len(self._names))
        ids = rd.ints(int(counts.sum()))
        n_rows = int((counts * self._dims).sum())
        n_dense = self._bounds[self._rank + 1] - self._bounds[self._rank] \
            if flags & _F_DENSE else 0
        # the reply: [slow clock (int64)][dense slice (float32)][rows (the wire's values;
        # float32 ones served in place)]
        wire = self.wire
        at = 8 + 4 * n_dense
        msg = np.empty(at + wire.itemsize * int(wire.counts(n_rows)), np.uint8)
        msg[:8].view(np.int64)[0] = slow
        rows = msg[at:].view(wire.dtype)
        served = aligned_empty(n_rows, np.float32) if wire.compact else rows
        state = self._set.serve(ids, counts.reshape(1, -1), max(0, clock),
                                bool(flags & _F_CREATE), served)
        if wire.compact:   # (an overflow arrives as Inf: the requester says so)
            wire.pack(served, [n_rows], out=rows)
        if flags & _F_CREATE:
            self._served[(src, clock)] = state
        if n_dense:
            with self._cv:
                msg[8:at].view(np.float32)[:] = self._master.reshape(-1)
        self.wire_bytes["rows"] += wire.itemsize * int(wire.counts(n_rows))
        replies.append((self._rep.isend(msg, src, _TAG_REPLY, f"ssp:reply of step {clock}"),
                        run_time(), src, clock))

    def _apply_push(self, src, clock, has_dense, rd) -> None:
        t0 = time.perf_counter()
        try:
            self._apply_push_(src, clock, has_dense, rd)
        finally:
            self._stats["push_s"] += time.perf_counter() - t0
            self._stats["pushes"] += 1

    def _apply_push_(self, src, clock, has_dense, rd) -> None:
        counts = rd.ints(len(self._names))
        rates = rd.floats(len(self._names) + 1)
        lo, hi = self._bounds[self._rank], self._bounds[self._rank + 1]
        dense = rd.floats(hi - lo) if has_dense else None
        n = int((counts * self._dims).sum())
        grads, _ = self.wire.unpack(rd.rows(int(self.wire.counts(n)), self.wire.dtype), [n])
        self._apply(src, clock, counts, grads, dense, rates)

    def _dense_kernel(self, rate: float):
        """The dense optimizer with learning rate `rate` (NaN: its own)."""
        if np.isnan(rate):
            return self._dense_opt
        kernel = self._dense_kernels.get(float(rate))
        if kernel is None:
            if len(self._dense_kernels) > 64:
                self._dense_kernels.clear()
            kernel = dataclasses.replace(self._dense_opt, learning_rate=float(rate))
            self._dense_kernels[float(rate)] = kernel
        return kernel

    def _apply(self, src, clock, counts, grads, dense_grad, rates) -> None:
        """Apply worker src's push of step `clock` to this rank's rows and dense slice,
        then record its clock (service thread for peers, training thread for itself).
        The rows are those its pull found here (kv_xapply, no lookup); a row evicted
        in between drops its gradient (counted in the table's dropped_grads). rates:
        the push's learning rate per table, then the dense one (NaN: unchanged).

        A push whose update would make a row or an optimizer slot NaN/Inf (a huge finite
        gradient) is refused whole here: none of its rows, slots or its dense slice
        change, and NonFiniteError names the table, the key, the pushing rank and its
        step. Owners apply pushes as they arrive, so the other ranks cannot agree to
        give that step up (their own parts of it may be applied already): on the
        service thread the error ends the job (the training thread raises it, wrapped,
        at its next wait); for this rank's own share it is raised by push() itself."""
        state = self._served.pop((src, clock), None)
        if counts.any():
            if state is None:
                raise CommError(f"rank {self._rank}: rank {src} pushed row gradients for step "
                                f"{clock} without pulling those rows first")
            with self._apply_lock:
                for t, table in enumerate(self._set.tables):
                    if not np.isnan(rates[t]):
                        table.set_learning_rate(float(rates[t]))
                try:
                    self._set.apply(state, np.ascontiguousarray(grads, np.float32),
                                    max(1, clock))
                except NonFiniteError as exc:
                    # nothing of this push is applied (rows, slots, headers, its dense
                    # slice) and, since owners apply pushes as they come, the ranks
                    # cannot agree to give the step up: the job ends with this error
                    raise NonFiniteError(
                        f"rank {self._rank} refused the push of rank {src}'s step {clock}: "
                        f"{exc}; SSP/ASP cannot give a step up on every rank, so the run "
                        "ends here (its last checkpoint is intact)") from exc
        with self._cv:
            if dense_grad is not None:
                lo, hi = self._bounds[self._rank], self._bounds[self._rank + 1]
                g = dense_grad
                if hi > lo:
                    if self._master is None:
                        raise CommError(f"rank {self._rank}: dense push from rank {src} "
                                        "before this rank's slice was initialised")
                    self._dense_updates += 1
                    apply_rows(self._dense_kernel(rates[-1]), self._master, self._slots,
                               g.reshape(1, -1), self._dense_updates)
            self.pushes_applied += 1
            self._clock[src] = max(self._clock[src], clock)
            self._done[src] = False
            self._changed()


class Posted:
    """An SSP/ASP push, already sent: the same handle as a BSP push (reduced(),
    commit()), with nothing left to wait for."""

    def __init__(self, local: np.ndarray | None, pull, n_dense: int):
        self._local, self._pull, self._n_dense = local, pull, n_dense

    def reduced(self) -> tuple[np.ndarray | None, np.ndarray]:
        """This rank's own (dense_grad, extra): nothing is summed over ranks in SSP/ASP,
        and the dense gradient has gone to the slices' owners (None: nothing to apply
        here)."""
        local = self._local if self._local is not None else np.zeros(0, np.float32)
        return None, local[self._n_dense:]

    def commit(self) -> None:
        """Nothing to do: the owners apply SSP/ASP pushes as they arrive."""
