"""BSP exchange: blocking, deterministic pull and push of embedding rows.

One pull, for every table at once:
  1. per table, unique + partition the batch's ids by owner (one C call);
  2. ONE fused all-to-all carries the ids of every table (counts first: a
     (world, tables) matrix, then the payload);
  3. each owner looks its ids up, creating new keys (one C call per table);
  4. ONE fused all-to-all returns the rows (flattened floats, tables in order).
The caller receives, per table, the unique rows in `uniq` order and the inverse
index: the batch's rows are `rows[inverse]`, never the whole table.

One push sends the gradient of every unique row back over the same routing (one
all-to-all); owners apply their row optimizer in C, which sums duplicates (the same
id pushed by several ranks) before applying them once.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from ..comm import Comm
from ..table import KvTable, unique_partition


@dataclasses.dataclass
class Pulled:
    """What a pull returns for one table (rank-local)."""

    uniq: np.ndarray      # unique ids of this rank's batch, grouped by owner
    inverse: np.ndarray   # batch position -> index into uniq
    rows: np.ndarray      # (len(uniq), dim) float32
    counts: np.ndarray    # unique ids sent to each owner


class BspExchange:
    """Pull rows and push gradients for a fixed, ordered set of tables.

    Every rank must call pull() and push() in the same order with the same tables;
    an empty id array is fine (the rank still answers its peers).
    """

    def __init__(self, comm: Comm, tables: dict[str, KvTable]):
        self.comm = comm
        self.tables = dict(tables)
        self._names = list(self.tables)
        self._served = None  # what this rank served in the last pull, for push

    def pull(self, ids: dict[str, np.ndarray], step: int, create: bool = True
             ) -> dict[str, Pulled]:
        """Rows of every table's ids. create=False (evaluation) reads absent ids as
        zeros and changes nothing; create=True creates them and prepares push()."""
        world = self.comm.size
        if set(ids) != set(self._names):
            unknown = sorted(set(ids) - set(self._names))
            missing = sorted(set(self._names) - set(ids))
            raise ValueError(f"pull: ids must name every table exactly; unknown {unknown}, "
                             f"missing {missing}")
        parts = {}
        for name in self._names:
            uniq, inverse, counts = unique_partition(ids[name], world)
            parts[name] = (uniq, inverse, counts)
        # Fused id payload: for each destination, table 0's ids, then table 1's, ...
        counts = np.stack([parts[n][2] for n in self._names], axis=1)  # (world, T)
        send = _group_by_dest([parts[n][0] for n in self._names], counts)
        recv_ids, recv_counts = self.comm.alltoallv(send, counts, op="pull:ids").wait()
        # Owner side: look every received id up, per table.
        per_table_ids = _split_by_table(recv_ids, recv_counts)
        if create:
            rows = [self.tables[n].find_or_create(per_table_ids[i], step=step)
                    for i, n in enumerate(self._names)]
            self._served = (per_table_ids, recv_counts)
        else:
            rows = [self.tables[n].find(per_table_ids[i]) for i, n in enumerate(self._names)]
        dims = np.array([self.tables[n].dim for n in self._names], np.int64)
        # Return rows in the layout the ids came in: per source, per table.
        send_rows = _group_by_dest([r.reshape(-1) for r in rows], recv_counts * dims)
        got, _ = self.comm.alltoallv(send_rows, (recv_counts * dims).sum(axis=1),
                                     op="pull:rows").wait()
        out = {}
        mine = _split_by_table(got, counts * dims)
        for i, n in enumerate(self._names):
            uniq, inverse, c = parts[n]
            out[n] = Pulled(uniq, inverse, mine[i].reshape(-1, self.tables[n].dim), c)
        if create:
            self._pulled = out
        return out

    def push(self, grads: dict[str, np.ndarray], step: int) -> None:
        """Send d(loss)/d(rows) of the last pull back to the owners and apply them.

        grads[name] has the shape of the pulled rows: (len(uniq), dim)."""
        if self._served is None:
            raise RuntimeError("push() needs a pull() first")
        dims = np.array([self.tables[n].dim for n in self._names], np.int64)
        counts = np.stack([self._pulled[n].counts for n in self._names], axis=1)
        flat = []
        for n in self._names:
            g = np.ascontiguousarray(grads[n], np.float32)
            want = self._pulled[n].rows.shape
            if g.shape != want:
                raise ValueError(f"push: table {n!r}: gradient shape {g.shape}, expected {want}")
            flat.append(g.reshape(-1))
        send = _group_by_dest(flat, counts * dims)
        got, _ = self.comm.alltoallv(send, (counts * dims).sum(axis=1), op="push:grads").wait()
        per_table_ids, recv_counts = self._served
        per_table_grads = _split_by_table(got, recv_counts * dims)
        for i, n in enumerate(self._names):
            self.tables[n].apply_gradients(
                per_table_ids[i], per_table_grads[i].reshape(-1, self.tables[n].dim),
                step=step, create_missing=True)
        self._served = None


def _group_by_dest(arrays: list[np.ndarray], counts: np.ndarray) -> np.ndarray:
    """Interleave per-table arrays, each already grouped by destination with counts[:, t]
    elements per destination, into one payload grouped by destination, then table."""
    world, ntab = counts.shape
    offsets = np.zeros((world + 1, ntab), np.int64)
    np.cumsum(counts, axis=0, out=offsets[1:])
    pieces = [arrays[t][offsets[r, t]:offsets[r + 1, t]] for r in range(world) for t in range(ntab)]
    if not pieces:
        return np.zeros(0, arrays[0].dtype if arrays else np.int64)
    return np.concatenate(pieces)


def _split_by_table(payload: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
    """Inverse of _group_by_dest on the receiving side: per table, the elements from
    every source in source order."""
    world, ntab = counts.shape
    flat = counts.reshape(-1)
    starts = np.concatenate([[0], np.cumsum(flat)[:-1]])
    out = []
    for t in range(ntab):
        idx = [slice(starts[r * ntab + t], starts[r * ntab + t] + flat[r * ntab + t])
               for r in range(world)]
        out.append(np.concatenate([payload[s] for s in idx]) if idx else payload[:0])
    return out
