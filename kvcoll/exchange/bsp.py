"""BSP exchange: blocking, deterministic pull and push of embedding rows.

One pull, for every table at once:
  1. the sender plans it in one C call (kv_xplan): per table, unique + partition of
     the batch's ids by owner, the payload of every table's unique ids grouped by
     destination, then table, and for every id the row its embedding will land in;
  2. ONE fused all-to-all carries the ids of every table (counts first: a
     (world, tables) matrix, then the payload);
  3. each owner serves every (source, table) segment in one C call (kv_xserve): an id
     several ranks sent is looked up (or created) once, and the rows are written
     straight into the reply;
  4. ONE fused all-to-all returns the rows, grouped by owner, then table.
The rows that come back ARE the rows the model reads, with no copy when every table has
one dim (else one copy splits them into one matrix per dim): Pull.rows[group] is a
(n, dim) matrix and Pull.pos[table] says which row each of the table's ids reads. A
batch's rows are a matrix sized by its unique ids, never the whole table.

One push sends the gradient of every row back over the same routing: the gradient of
Pull.rows is already laid out as the owners want it (one all-to-all); each owner sums
what several ranks sent for one id and computes its row optimizer's update in C at the
rows its serve found, no second lookup, into a buffer (kv_xprepare), and says in the
step's one fused allreduce whether every update is finite. Only when every rank's
outcome is OK does each owner write its buffer (kv_xcommit); otherwise the step is
given up on every rank alike, so an update that would make a row NaN/Inf is refused
like a NaN gradient, with an error naming the table and the key.

Rows and row gradients may cross the wire as fp16 or bf16 (wire_dtype; kvcoll.exchange.
wire): the owner packs the rows it served, the sender the gradients it pushes, each
in one C call, and the receiver unpacks them to float32; everything else stays
float32. A value that does not fit refuses the step on every rank (the rows: the
requester's compute reports it, Pull.check; a gradient: its sender's outcome).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping

import numpy as np

from .._buffers import aligned_empty
from ..comm import Comm
from ..errors import InvalidArgumentError, NonFiniteError
from ..routing import owners_for
from ..table import KvTable
from .agreement import FAILED, OK, Agreement
from .kernels import TableSet
from .wire import wire_of


def group_key(dim: int) -> str:
    """The key of the row matrix that holds every table of this dim."""
    return f"dim{dim}"


def hold_tables(ex, comm: Comm, tables: dict[str, KvTable], owners, wire_dtype) -> None:
    """What an exchange (BSP's, SSP/ASP's) keeps to serve its tables: the communicator
    and owner map (default: the even map of its size), the tables by name and in one
    TableSet with their dims, the rows' wire format and the bytes it has sent."""
    ex.comm = comm
    ex.owners = owners_for(comm, owners)
    ex.tables = dict(tables)
    ex._names = list(ex.tables)
    ex._set = TableSet([ex.tables[n] for n in ex._names])
    ex._dims = ex._set.dims.astype(np.int64)
    ex.wire = wire_of(wire_dtype)
    ex.wire_bytes = {"ids": 0, "rows": 0, "grads": 0}


@dataclasses.dataclass
class Pulled:
    """One table's part of a pull (rank-local), in per-table form."""

    uniq: np.ndarray      # unique ids of this rank's batch, grouped by owner
    inverse: np.ndarray   # batch position -> index into uniq
    rows: np.ndarray      # (len(uniq), dim) float32
    counts: np.ndarray    # unique ids sent to each owner


class Pull(Mapping):
    """What a pull returns: the rows of every table's ids on this rank.

    rows[g]: one float32 matrix per dim group g (group_key(dim)), the rows of every
        table of that dim, owner after owner, then table after table (the layout of
        the reply payload: with one group, rows[g] IS the payload); pos[t]: for each id
        table t was given (in order), its row in rows[group[t]]. As a mapping, pull[t]
        is table t's Pulled (uniq, inverse, rows, counts), built on demand (a copy).

    step: the step it belongs to; headers (BSP): every rank's header, (world, m);
    dense (SSP/ASP): the whole dense vector as the owners served it, or None.

    Built from the sender's plan (TableSet.plan: send_ids, counts (world, tables),
    inverse, upos, pos, n_unique) and the received rows payload."""

    def __init__(self, tset: TableSet, names, n_given, payload: np.ndarray, plan):
        send, counts, inverse, upos, pos, nu = plan
        self.names = list(names)
        self._tset = tset
        self._gkeys = [group_key(d) for d in tset.group_dims]
        self.group = {n: self._gkeys[g] for n, g in zip(self.names, tset.group)}
        self.counts = counts
        self.rows = self._grouped(payload)
        self._gstart = np.zeros(len(self.names) + 1, np.int64)
        np.cumsum(n_given, out=self._gstart[1:])
        at = self._gstart
        self.pos = {n: pos[at[t]:at[t + 1]] for t, n in enumerate(self.names)}
        self._upos = upos
        self._ustart = np.zeros(len(self.names) + 1, np.int64)
        np.cumsum(nu, out=self._ustart[1:])
        self._send, self._inverse = send, inverse
        self.step = 0          # the step it belongs to
        self.headers = None    # BSP: every rank's header, (world, m)
        self.dense = None      # SSP/ASP: the dense vector the owners served
        self.served = None     # BSP: what this rank served, for the push
        self.wire_error = None  # rows that overflowed a 16-bit wire (see check())
        self._cache = {}

    def check(self) -> None:
        """Raise the error of rows that arrived unusable: a value that did not fit a
        16-bit wire (kvcoll.exchange.wire) arrives as Inf. The step loop calls it inside
        the compute's try, so every rank learns of it and refuses the step."""
        if self.wire_error is not None:
            raise self.wire_error

    def where(self, index: int) -> tuple[str, int]:
        """(table, key) of the value at float `index` of this pull's payload layout (its
        rows as they came, or their gradients as they go)."""
        counts = self.counts.reshape(-1)
        ntab = len(self.names)
        floats = counts * np.tile(self._tset.dims.astype(np.int64), counts.size // ntab)
        k = int(np.searchsorted(np.cumsum(floats), index, side="right"))
        t = k % ntab
        row = (index - int(floats[:k].sum())) // int(self._tset.dims[t])
        return self.names[t], int(self._send[int(counts[:k].sum()) + row])

    def _grouped(self, payload: np.ndarray) -> dict[str, np.ndarray]:
        """The received rows as one matrix per group: the payload itself with one group."""
        tset = self._tset
        if len(self._gkeys) == 1:
            return {self._gkeys[0]: payload.reshape(-1, int(tset.group_dims[0]))}
        n = [int(self.counts[:, tset.group == g].sum()) for g in range(len(self._gkeys))]
        mats = [aligned_empty(k * d, np.float32).reshape(k, d)
                for k, d in zip(n, tset.group_dims)]
        tset.regroup(self.counts, payload, mats)
        return dict(zip(self._gkeys, mats))

    def __getitem__(self, name: str) -> Pulled:
        if name not in self._cache:
            if name not in self.group:
                raise KeyError(name)
            t = self.names.index(name)
            counts = self.counts
            # table t's unique ids: its segment of every destination, in rank order
            seg = np.zeros(counts.size, np.int64)
            np.cumsum(counts.reshape(-1)[:-1], out=seg[1:])
            seg = seg.reshape(counts.shape)
            uniq = np.concatenate([self._send[seg[r, t]:seg[r, t] + counts[r, t]]
                                   for r in range(counts.shape[0])])
            inverse = self._inverse[self._gstart[t]:self._gstart[t + 1]]
            self._cache[name] = Pulled(uniq, inverse, self.table_rows(name, self.rows),
                                       counts[:, t].copy())
        return self._cache[name]

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def table_rows(self, name: str, mats: dict) -> np.ndarray:
        """Table `name`'s rows, in its uniq order, of matrices shaped like self.rows
        (the rows themselves, or their gradients)."""
        return mats[self.group[name]][self.table_slice(name)]

    def table_slice(self, name: str) -> np.ndarray:
        """The rows (in the group matrix) of table `name`'s unique ids, in uniq order."""
        t = self.names.index(name)
        return self._upos[self._ustart[t]:self._ustart[t + 1]]

    def payload_of(self, grads: dict) -> np.ndarray:
        """A gradient of these rows as the float32 payload the owners take (the layout
        of the rows that came back). grads: per group, matrices shaped like rows[g]
        (with one group, its matrix is the payload, no copy); or per table, (len(uniq),
        dim) as its Pulled rows."""
        mats = self._group_grads(grads)
        if len(mats) == 1:
            return np.ascontiguousarray(mats[0]).reshape(-1)
        send = np.empty(sum(m.size for m in mats), np.float32)
        self._tset.ungroup(self.counts, [np.ascontiguousarray(m) for m in mats], send)
        return send

    def _group_grads(self, grads: dict) -> list[np.ndarray]:
        """The gradient as one float32 matrix per group, checked against the rows."""
        if set(grads) == set(self.rows):
            out = []
            for g in self._gkeys:
                m = np.asarray(grads[g])
                if m.shape != self.rows[g].shape:
                    raise InvalidArgumentError(f"push: group {g!r}: gradient shape {m.shape}, expected "
                                     f"{self.rows[g].shape}")
                out.append(m if m.dtype == np.float32 else m.astype(np.float32))
            return out
        if set(grads) != set(self.names):
            raise InvalidArgumentError(f"push: gradients must be given per table {self.names} or per "
                             f"group {self._gkeys}, got {sorted(grads)}")
        mats = {g: np.empty_like(m) for g, m in self.rows.items()}
        for t, n in enumerate(self.names):
            g = np.asarray(grads[n], np.float32)
            rows = self.table_slice(n)
            want = (rows.size, int(self._tset.dims[t]))
            if g.shape != want:
                raise InvalidArgumentError(f"push: table {n!r}: gradient shape {g.shape}, expected {want}")
            mats[self.group[n]][rows] = g
        return [mats[g] for g in self._gkeys]


class IdsInFlight:
    """A pull whose ids are on their way (BspExchange.send_ids): the first half of a pull,
    which the prefetch stage runs ahead; BspExchange.receive_ids waits for the ids (and
    settles the vote), BspExchange.fetch serves them.

    proceeds: None until the vote is settled; then whether the step happens. received:
    (the ids this rank serves, their counts) once they are in."""

    __slots__ = ("step", "create", "agreement", "given", "plan", "handle", "proceeds",
                 "received")

    def __init__(self, step, create, agreement, given, plan, handle):
        self.step, self.create, self.agreement = step, create, agreement
        self.given, self.plan, self.handle = given, plan, handle
        self.proceeds = None
        self.received = None


class BspExchange:
    """BSP: every step is a collective of all ranks (see kvcoll.exchange.Exchange for the
    interface). Every rank must call pull() and push() in the same order; an empty id
    array is fine (the rank still answers its peers).

    step: the last step this rank started (restore sets it with set_step).
    owners: the kvcoll.routing.OwnerMap ids are routed by (default: the even map of
    comm.size).
    wire_dtype: "fp32", "fp16" or "bf16", the rows' and row gradients' width on the wire
    (default: the run's, kv.init(wire_dtype=) / --wire-dtype / KVCOLL_WIRE_DTYPE).
    wire_bytes: bytes this rank has sent to other ranks, by payload ("ids", "rows",
    "grads"; a rank's part for itself never crosses the wire and is not counted).
    """

    synchronous = True

    def __init__(self, comm: Comm, tables: dict[str, KvTable], owners=None,
                 wire_dtype=None):
        hold_tables(self, comm, tables, owners, wire_dtype)
        self.step = 0
        self.table_seconds = 0.0  # time spent in the tables' C calls (lookups, updates)

    def _sent(self, what: str, per_rank: np.ndarray, itemsize: int, comm=None) -> None:
        """Count what this rank sends to the others (per_rank: values per destination)."""
        comm = self.comm if comm is None else comm
        self.wire_bytes[what] += (int(per_rank.sum()) - int(per_rank[comm.rank])) * itemsize

    def set_step(self, step: int) -> None:
        """Continue from `step` (a restore): the next pull is step + 1."""
        self.step = int(step)

    # -- pull ---------------------------------------------------------------------------------

    def pull(self, ids: dict[str, np.ndarray], agreement: Agreement | None = None, *,
             dense: bool = False) -> Pull | None:
        """Start step self.step + 1: the rows of every table's ids (absent ids are
        created, admission permitting), once every rank's `agreement` vote is in and the
        step proceeds; None (nothing served anywhere) when it does not. Without an
        agreement the step always happens. `dense` is for the asynchronous modes (BSP's
        dense parameters are every rank's own)."""
        return self.fetch(self.send_ids(ids, agreement))

    def lookup(self, ids: dict[str, np.ndarray], agreement: Agreement | None = None
               ) -> Pull | None:
        """The rows of every table's ids for evaluation: absent ids read zeros and no
        table changes. A collective, like pull."""
        return self.fetch(self.send_ids(ids, agreement, create=False))

    def send_ids(self, ids: dict[str, np.ndarray], agreement: Agreement | None = None,
                 create: bool = True, *, step: int | None = None,
                 comm: Comm | None = None) -> IdsInFlight:
        """The first half of a pull: plan it (unique + partition, one C call) and post
        the id all-to-all, whose counts phase carries the agreement's vote. Nothing is
        served: a step's lookups must wait until the previous step's update is applied
        (fetch). The prefetch stage runs this for the next step while this one computes,
        in a thread of its own: `step` is then the step it is for (default: the next
        one) and `comm` a communicator of that thread's (a dup of this one's, so its
        collectives never interleave with the step's own; default this one's)."""
        if set(ids) != set(self._names):
            unknown = sorted(set(ids) - set(self._names))
            missing = sorted(set(self._names) - set(ids))
            raise InvalidArgumentError(f"pull: ids must name every table exactly; unknown "
                                       f"{unknown}, missing {missing}")
        given = [np.ascontiguousarray(ids[n], np.int64) for n in self._names]
        plan = self._set.plan(given, self.owners)
        if step is None:
            step = self.step + 1 if create else self.step
        comm = self.comm if comm is None else comm
        comm.step = step  # named by a timeout error of this step's collectives
        handle = comm.alltoallv(plan[0], plan[1], op="pull:ids",
                                header=None if agreement is None else agreement.header())
        self._sent("ids", plan[1].sum(axis=1), 8, comm)
        return IdsInFlight(step, create, agreement, given, plan, handle)

    def receive_ids(self, pending: IdsInFlight) -> bool:
        """Complete the id all-to-all of `pending` (any thread; nothing is served): settle
        the agreement and, when the step proceeds, wait for the ids this rank serves.
        Returns whether the step proceeds (every rank decides the same). A prefetched
        element that is dropped is drained with it, on every rank alike."""
        if pending.proceeds is None:
            agreement = pending.agreement
            pending.proceeds = agreement is None or \
                agreement.settle(pending.handle.headers()).proceeds
        if pending.proceeds and pending.received is None:
            pending.received = pending.handle.wait()
        return pending.proceeds

    def reserve_for(self, pending: IdsInFlight) -> None:
        """Make room ahead in this rank's tables for the rows `pending`'s serve can
        create (TableSet.reserve: per table, as many rows as ids this rank received for
        it, an upper bound; over-reservation is bounded by one step's ids per table and
        the room is kept for later steps). The prefetch helper calls it right after
        receive_ids, while the step before computes, so that the fetch, on the critical
        path, creates its rows in memory already allocated and faulted in, with the
        index already grown. Only for a training pull that proceeds and whose ids are
        in; nothing otherwise. Safe beside the main thread's prepare and commit of the
        step in flight: each table's lock serializes them, and a reserve moves no row
        and changes no generation, so the refs that step holds stay valid."""
        if pending.create and pending.proceeds and pending.received is not None:
            self._set.reserve(pending.received[1])

    def fetch(self, pending: IdsInFlight, *, ahead: bool = False,
              comm: Comm | None = None) -> Pull | None:
        """The second half of a pull: settle the agreement; when the step proceeds, the
        owners serve the ids and the rows come back (and a training pull's step
        becomes this rank's step).

        ahead: the semi-synchronous pipeline's helper fetches the next step's rows while
        the step before it computes, before that step's update is applied (so its rows
        miss that update), on `comm`, the helper's communicator; the step becomes this
        rank's only when the loop takes the pull (begin), and the serve's time is not
        the step's (not in `table_seconds`)."""
        if not self.receive_ids(pending):
            return None  # every rank decides the same: nobody posts the payload
        recv_ids, recv_counts = pending.received
        pending.received = None
        dims = self._dims
        reply = aligned_empty(int((recv_counts * dims).sum()), np.float32)
        t0 = time.perf_counter()
        served = self._set.serve(recv_ids, recv_counts, pending.step, pending.create, reply)
        if not ahead:
            self.table_seconds += time.perf_counter() - t0
        counts = pending.plan[1]
        comm = self.comm if comm is None else comm
        comm.step = pending.step
        wire = self.wire
        per_rank, expect = (recv_counts * dims).sum(axis=1), (counts * dims).sum(axis=1)
        send, _ = wire.pack(reply, per_rank)   # (an overflow arrives as Inf: see below)
        try:
            got, _ = comm.alltoallv(send, wire.counts(per_rank), op="pull:rows",
                                    recv_counts=wire.counts(expect)).wait()
        except BaseException:       # (a lost peer) the rows this step created go again
            self._set.forget_new(served, pending.step)
            raise
        self._sent("rows", wire.counts(per_rank), wire.itemsize, comm)
        rows, bad = wire.unpack(got, expect)
        out = Pull(self._set, self._names, [a.size for a in pending.given], rows, pending.plan)
        out.step, out.served = pending.step, served
        if bad >= 0:
            name, key = out.where(bad)
            out.wire_error = wire.overflow_error(f"table {name!r}, key {key}: a value of its row",
                                                 None, pending.step)
        if pending.create and not ahead:
            self.begin(out)
        return out

    def begin(self, pull: Pull) -> None:
        """A training pull's step becomes this rank's step (fetch does it, except for a
        pull fetched ahead, always a training one: the loop calls it when the step
        before has committed)."""
        self.step = pull.step

    # -- push ---------------------------------------------------------------------------------

    def push(self, pull: Pull, grads: dict, dense_grad: np.ndarray | None = None,
             extra: np.ndarray | None = None, agreement: Agreement | None = None,
             lr: dict | None = None, dense_lr: float | None = None) -> "Pushed":
        """Send the gradient of pull's rows to their owners; as the owner, wait for the
        gradients of the rows this rank owns and compute every updated row and slot
        without writing them (TableSet.prepare, one C call); then start one fused
        allreduce of [every rank's outcome code, dense_grad, extra] (float32; dense_grad
        and extra may be None) and return. The handle's reduced() waits for that sum (and
        settles the agreement's outcome); commit() then writes the prepared rows (lr:
        table name -> its learning rate for this step; absent: unchanged). A step whose
        outcome failed on any rank is given up with abandon(pushed) instead.

        An update that would make a row or an optimizer slot NaN/Inf (a huge finite
        gradient) is this owner's outcome: FAILED, with a NonFiniteError naming the table
        and the key. It rides the same allreduce, so every rank refuses the step alike
        and nothing is applied anywhere (no second collective). A rank whose own compute
        did not succeed skips the prepare (the step is refused anyway).

        grads: per group, a matrix shaped like pull.rows[group]; or per table,
        (len(uniq), dim) as its Pulled rows. dense_lr: unused (BSP's dense parameters are
        updated by the Keras optimizer of every rank)."""
        if pull is None or getattr(pull, "served", None) is None:
            raise InvalidArgumentError("push() needs the Pull of this step's pull()")
        given = agreement is not None
        agreement = agreement if given else Agreement(1).settle(None)
        send = pull.payload_of(grads)
        state = pull.served
        recv_counts = state[0]
        dims = self._dims
        wire = self.wire
        per_rank, expect = (pull.counts * dims).sum(axis=1), (recv_counts * dims).sum(axis=1)
        packed, bad = wire.pack(send, per_rank)
        if bad >= 0 and agreement.outcome == OK:   # refused on every rank: the outcome
            name, key = pull.where(bad)
            agreement.report(FAILED, wire.overflow_error(
                f"table {name!r}, key {key}: a value of its row gradient", float(send[bad]),
                pull.step))
        rows = self.comm.alltoallv(packed, wire.counts(per_rank), op="push:grads",
                                   recv_counts=wire.counts(expect))
        self._sent("grads", wire.counts(per_rank), wire.itemsize)
        prepared, rates_before = None, None
        if agreement.outcome == OK:
            got, _ = rows.wait()
            got, _ = wire.unpack(got, expect)
            t0 = time.perf_counter()
            rates_before = self._set_rates(lr)
            try:
                prepared = self._set.prepare(state, np.ascontiguousarray(got, np.float32),
                                             pull.step)
            except NonFiniteError as exc:
                if getattr(exc, "what", 0) == 1:
                    # a gradient as received is NaN/Inf: its sender's own check voted
                    # NONFINITE on this same allreduce, which refuses the step; this
                    # rank's outcome stays its compute's (commit() raises it if not)
                    prepared = exc
                else:
                    agreement.report(FAILED, exc)
            self.table_seconds += time.perf_counter() - t0
        world = self.comm.size
        parts = [agreement.outcome_codes(world, self.comm.rank)]
        parts += [np.asarray(p, np.float32).reshape(-1) for p in (dense_grad, extra)
                  if p is not None]
        reduce = self.comm.iallreduce(np.concatenate(parts), op="allreduce:dense")
        n_dense = 0 if dense_grad is None else int(np.size(dense_grad))
        return Pushed(self, pull, rows, reduce, agreement, n_dense, prepared, rates_before,
                      given)

    def _set_rates(self, lr: dict | None) -> dict:
        """Give each table of `lr` its learning rate; returns the rates they had."""
        before = {}
        for name, rate in (lr or {}).items():
            table = self.tables[name]
            before[name] = table.learning_rate
            table.set_learning_rate(rate)
        return before

    def abandon(self, step) -> None:
        """Give the step in flight up, on every rank alike (a Pull not yet pushed, or a
        Pushed not committed): its exchanges are completed, no row is updated, the rows
        its lookups created are removed, and the step counter goes back, so every table
        is as before the step."""
        if isinstance(step, Pushed):
            step._abandon()
            return
        if isinstance(step, Pull) and step.served is not None:
            state, step.served = step.served, None
            self._set.forget_new(state, step.step)
            if self.step == step.step:
                self.step -= 1

    def finish(self) -> int:
        """This rank's data has run out: nothing is in flight between BSP steps (the step
        loop keeps the rank in the others' steps until all are out). Returns the step."""
        return self.step

    def set_dense(self, flat, state=None, updates: int = 0, replace: bool = False) -> None:
        """Nothing: BSP's dense parameters are every rank's own."""

    def dense(self):
        """None: every rank holds the dense parameters (SSP/ASP return them gathered)."""
        return None

    def replan(self, comm: Comm, owners=None) -> None:
        """Continue on another communicator (a new world) and owner map (default: the
        even map of its size): the next step is planned for them. The rows each rank
        holds stay; moving the rows whose owner changed is the caller's (the elastic
        runtime's)."""
        self.comm = comm
        self.owners = owners_for(comm, owners)

    def close(self) -> None:
        """Nothing to release: BSP holds no thread and no communicator of its own."""


class Pushed:
    """A push in flight (BspExchange.push): reduced() and commit() complete it."""

    def __init__(self, exchange: BspExchange, pull: Pull, rows, reduce, agreement, n_dense,
                 prepared, rates_before, given):
        self._ex, self._pull, self._rows, self._reduce = exchange, pull, rows, reduce
        self.agreement, self._n_dense = agreement, n_dense
        self._prepared, self._rates_before, self._given = prepared, rates_before, given
        self._total = None

    def _wait_reduce(self) -> np.ndarray:
        if self._total is None:
            world = self._ex.comm.size
            self._total = self._reduce.wait()
            self.agreement.settle_outcome(self._total[:world])
        return self._total

    def reduced(self) -> tuple[np.ndarray | None, np.ndarray]:
        """(the dense gradient summed over ranks, or None if none was pushed; extra
        summed over ranks). Settles the agreement's outcome."""
        total = self._wait_reduce()
        at = self._ex.comm.size
        dense = total[at:at + self._n_dense] if self._n_dense else None
        return dense, total[at + self._n_dense:]

    def commit(self) -> None:
        """Write the rows this rank's prepare computed. Only for a step whose outcome
        succeeded on every rank. Without an agreement of the caller's (push(...,
        agreement=None)), a step some rank refused is abandoned here and its error
        raised: this rank's own (naming the table and the key), or one naming the
        ranks that refused."""
        self._wait_reduce()
        failed = self.agreement.outcome_failed
        if failed:
            if not self._given:
                self._abandon()
                own = self.agreement.outcome_error
                if own is not None:
                    raise own
                raise NonFiniteError(
                    f"step {self._pull.step}: rank(s) {failed} refused the update (a row or "
                    "an optimizer slot would have become NaN/Inf, see the error there); "
                    "nothing was applied")
            raise AssertionError(f"commit() of a step that failed on ranks {failed}: "
                                 "abandon it")
        self._rows.wait()
        gate = getattr(self._ex.comm, "gate", None)
        if gate is not None:        # elastic: every survivor commits this step, or none
            gate()
        prepared, self._prepared = self._prepared, None
        if isinstance(prepared, NonFiniteError):  # a NaN no rank voted for (no agreement)
            self._abandon()
            raise prepared
        self._pull.served = None
        ex = self._ex
        t0 = time.perf_counter()
        ex._set.commit(prepared)
        ex.table_seconds += time.perf_counter() - t0

    def _abandon(self) -> None:
        """Complete the exchanges, apply nothing (BspExchange.abandon): the prepared rows
        are dropped and the tables' learning rates are put back, and the rows the pull
        created go, even when a wait fails (a lost peer)."""
        try:
            self._wait_reduce()
            self._rows.wait()
        finally:
            self._prepared = None
            if self._rates_before:
                self._ex._set_rates(self._rates_before)
                self._rates_before = None
            self._ex.abandon(self._pull)
