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
what several ranks sent for one id and applies its row optimizer in C at the rows its
serve found, no second lookup (kv_xapply).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping

import numpy as np

from .._buffers import aligned_empty
from ..comm import Comm
from ..errors import InvalidArgumentError
from ..routing import owners_for
from ..table import KvTable
from .kernels import TableSet


def group_key(dim: int) -> str:
    """The key of the row matrix that holds every table of this dim."""
    return f"dim{dim}"


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
        self._cache = {}

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


class BspExchange:
    """BSP: every step is a collective of all ranks (see kvcoll.exchange for the
    interface). Every rank must call pull() and push() in the same order; an empty id
    array is fine (the rank still answers its peers).

    step: the last step this rank started (restore sets it with set_step).
    owners: the kvcoll.routing.OwnerMap ids are routed by (default: the even map of
    comm.size).
    """

    synchronous = True

    def __init__(self, comm: Comm, tables: dict[str, KvTable], owners=None):
        self.comm = comm
        self.owners = owners_for(comm, owners)
        self.tables = dict(tables)
        self._names = list(self.tables)
        self._set = TableSet([self.tables[n] for n in self._names])
        self._dims = self._set.dims.astype(np.int64)
        self.step = 0
        self.table_seconds = 0.0  # time spent in the tables' C calls (lookups, updates)

    def set_step(self, step: int) -> None:
        """Continue from `step` (a restore): the next pull is step + 1."""
        self.step = int(step)

    def pull(self, ids: dict[str, np.ndarray], *, header=None, proceed=None,
             dense: bool = False) -> Pull | None:
        """Start step self.step + 1: the rows of every table's ids (absent ids are
        created, admission permitting).

        header: a few int64 this rank sends every rank with its id counts (e.g. "I have
        data", "my batch is valid"); the Pull's `headers` holds every rank's, (world,
        m). proceed(headers), called on every rank as soon as they are in, may raise
        (then nothing was served anywhere) or return False: then the pull stops there
        on every rank and returns None (the step did not happen). `dense` is for the
        asynchronous modes (BSP's dense parameters are every rank's own)."""
        out = self._pull(ids, self.step + 1, True, header, proceed)
        if out is not None:
            self.step += 1
        return out

    def lookup(self, ids: dict[str, np.ndarray], *, header=None, proceed=None) -> Pull | None:
        """The rows of every table's ids for evaluation: absent ids read zeros and no
        table changes. A collective, like pull (same header and proceed)."""
        return self._pull(ids, self.step, False, header, proceed)

    def _pull(self, ids, step, create, header, proceed):
        if set(ids) != set(self._names):
            unknown = sorted(set(ids) - set(self._names))
            missing = sorted(set(self._names) - set(ids))
            raise InvalidArgumentError(f"pull: ids must name every table exactly; unknown "
                                       f"{unknown}, missing {missing}")
        given = [np.ascontiguousarray(ids[n], np.int64) for n in self._names]
        plan = self._set.plan(given, self.owners)
        send, counts = plan[0], plan[1]
        self.comm.step = step  # named by a timeout error of this step's collectives
        handle = self.comm.alltoallv(send, counts, op="pull:ids", header=header)
        headers = None if header is None else handle.headers()
        if proceed is not None and not proceed(headers):
            return None
        recv_ids, recv_counts = handle.wait()
        dims = self._dims
        reply = aligned_empty(int((recv_counts * dims).sum()), np.float32)
        t0 = time.perf_counter()
        served = self._set.serve(recv_ids, recv_counts, step, create, reply)
        self.table_seconds += time.perf_counter() - t0
        got, _ = self.comm.alltoallv(reply, (recv_counts * dims).sum(axis=1), op="pull:rows",
                                     recv_counts=(counts * dims).sum(axis=1)).wait()
        out = Pull(self._set, self._names, [a.size for a in given], got, plan)
        out.headers, out.step, out.served = headers, step, served
        return out

    def push(self, pull: Pull, grads: dict, dense_grad: np.ndarray | None = None,
             extra: np.ndarray | None = None, lr: dict | None = None,
             dense_lr: float | None = None) -> "Pushed":
        """Post the gradient of pull's rows to their owners and start one fused
        allreduce of [dense_grad, extra] (float32, either may be None); return at once.
        The handle's reduced() is that sum over ranks; commit() waits for the rows'
        gradients and applies them with each table's row optimizer (lr: table name ->
        its learning rate for this step; absent: unchanged).

        grads: per group, a matrix shaped like pull.rows[group]; or per table,
        (len(uniq), dim) as its Pulled rows."""
        if pull is None or getattr(pull, "served", None) is None:
            raise InvalidArgumentError("push() needs the Pull of this step's pull()")
        send = pull.payload_of(grads)
        state, pull.served = pull.served, None
        recv_counts = state[0]
        dims = self._dims
        rows = self.comm.alltoallv(send, (pull.counts * dims).sum(axis=1), op="push:grads",
                                   recv_counts=(recv_counts * dims).sum(axis=1))
        parts = [np.asarray(p, np.float32).reshape(-1) for p in (dense_grad, extra)
                 if p is not None]
        reduce = self.comm.iallreduce(np.concatenate(parts) if len(parts) > 1 else parts[0],
                                      op="allreduce:dense") if parts else None
        return Pushed(self, pull.step, rows, state, reduce, lr)


class Pushed:
    """A push in flight (BspExchange.push): reduced() and commit() complete it."""

    def __init__(self, exchange: BspExchange, step: int, rows, state, reduce, lr):
        self._ex, self._step, self._rows, self._state = exchange, step, rows, state
        self._reduce, self._lr, self._total = reduce, lr, None

    def reduced(self) -> np.ndarray | None:
        """The fused allreduce's result: [dense_grad, extra] summed over ranks."""
        if self._total is None and self._reduce is not None:
            self._total = self._reduce.wait()
        return self._total

    def commit(self, apply: bool = True) -> None:
        """Wait for the gradients this rank owns and apply them (apply=False: the step is
        rejected, e.g. a rank's gradient was NaN: complete the exchange, apply nothing,
        and remove the rows this step's lookups created, so the tables are as before)."""
        got, _ = self._rows.wait()
        if not apply:
            self._ex._set.forget_new(self._state, self._step)
        if apply:
            ex = self._ex
            t0 = time.perf_counter()
            for name, rate in (self._lr or {}).items():
                ex.tables[name].set_learning_rate(rate)
            ex._set.apply(self._state, np.ascontiguousarray(got, np.float32), self._step)
            ex.table_seconds += time.perf_counter() - t0
