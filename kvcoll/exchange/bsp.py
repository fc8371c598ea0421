"""BSP exchange: blocking, deterministic pull and push of embedding rows.

One pull, for every table at once:
  1. per table, unique + partition the batch's ids by owner (one C call);
  2. ONE fused all-to-all carries the ids of every table (counts first: a
     (world, tables) matrix, then the payload, grouped by source, then table);
  3. each owner looks its ids up, creating new keys, one C call per (source, table)
     segment, which writes the rows straight into the reply and remembers where
     each row lives (its "ref");
  4. ONE fused all-to-all returns the rows (flattened floats, same layout).
The caller receives, per table, the unique rows in `uniq` order and the inverse
index: the batch's rows are `rows[inverse]`, never the whole table.

One push sends the gradient of every unique row back over the same routing (one
all-to-all); owners apply their row optimizer in C at the remembered refs (no second
lookup), summing duplicates (the same id pushed by several ranks) first.
"""

from __future__ import annotations

import dataclasses
import time

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
        self._dims = np.array([self.tables[n].dim for n in self._names], np.int64)
        self._served = None  # what this rank served in the last pull, for push
        self._pulled = None
        self.table_seconds = 0.0  # time spent in the tables' C calls (lookups, updates)

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
        parts = [unique_partition(ids[n], world) for n in self._names]
        # Fused id payload: for each destination, table 0's ids, then table 1's, ...
        counts = np.stack([p[2] for p in parts], axis=1)  # (world, T)
        send = _group_by_dest([p[0] for p in parts], counts)
        recv_ids, recv_counts = self.comm.alltoallv(send, counts, op="pull:ids").wait()
        # Owner side: rows of every (source, table) segment, written into the reply.
        dims = self._dims
        id_at, row_at = _starts(recv_counts), _starts(recv_counts * dims)
        reply = aligned_empty(int((recv_counts * dims).sum()), np.float32)
        refs = np.empty(recv_ids.size, np.uint32) if create else None
        t0 = time.perf_counter()
        for t, name in enumerate(self._names):
            table, dim = self.tables[name], int(dims[t])
            for r in range(world):
                a, n, b = id_at[r, t], recv_counts[r, t], row_at[r, t]
                keys, out = recv_ids[a:a + n], reply[b:b + n * dim].reshape(n, dim)
                if create:
                    _, refs[a:a + n] = table.find_or_create_ref(keys, step=step, out=out)
                else:
                    table.find(keys, out=out)
        self.table_seconds += time.perf_counter() - t0
        if create:
            self._served = (recv_ids, refs, recv_counts)
        got, _ = self.comm.alltoallv(reply, (recv_counts * dims).sum(axis=1), op="pull:rows",
                                     recv_counts=(counts * dims).sum(axis=1)).wait()
        out = {}
        mine = _split_by_table(got, counts * dims)
        for t, n in enumerate(self._names):
            uniq, inverse, c = parts[t]
            out[n] = Pulled(uniq, inverse, mine[t].reshape(-1, int(dims[t])), c)
        if create:
            self._pulled = out
        return out

    def push(self, grads: dict[str, np.ndarray], step: int, scale: float = 1.0) -> None:
        """Send scale * d(loss)/d(rows) of the last pull back to the owners and apply
        them.

        grads[name] has the shape of the pulled rows: (len(uniq), dim)."""
        if self._served is None:
            raise RuntimeError("push() needs a pull() first")
        world, dims = self.comm.size, self._dims
        counts = np.stack([self._pulled[n].counts for n in self._names], axis=1)
        flat = []
        for n in self._names:
            g = np.asarray(grads[n], np.float32)
            want = self._pulled[n].rows.shape
            if g.shape != want:
                raise ValueError(f"push: table {n!r}: gradient shape {g.shape}, expected {want}")
            flat.append(g.reshape(-1))
        # the payload: grouped by destination, then table (each table's rows are
        # grouped by owner already), then scaled in place
        send = np.empty(int((counts * dims).sum()), np.float32)
        np.concatenate(flat if world == 1 else _by_dest(flat, counts * dims), out=send)
        send *= np.float32(scale)
        recv_ids, refs, recv_counts = self._served
        got, _ = self.comm.alltoallv(send, (counts * dims).sum(axis=1), op="push:grads",
                                     recv_counts=(recv_counts * dims).sum(axis=1)).wait()
        keys = _split_by_table(recv_ids, recv_counts)
        ref = _split_by_table(refs, recv_counts)
        per_table_grads = _split_by_table(got, recv_counts * dims)
        t0 = time.perf_counter()
        for t, n in enumerate(self._names):
            # one source sends each id once; several may send the same id
            self.tables[n].apply_gradients_ref(
                keys[t], ref[t], per_table_grads[t].reshape(-1, int(dims[t])),
                step=step, create_missing=True, distinct=world == 1)
        self.table_seconds += time.perf_counter() - t0
        self._served = None


def _starts(counts: np.ndarray) -> np.ndarray:
    """Start offsets of the (source, table) segments of a payload laid out source by
    source, table by table, with counts[r, t] elements each."""
    flat = counts.reshape(-1)
    starts = np.zeros(flat.size, np.int64)
    np.cumsum(flat[:-1], out=starts[1:])
    return starts.reshape(counts.shape)


def _group_by_dest(arrays: list[np.ndarray], counts: np.ndarray) -> np.ndarray:
    """Interleave per-table arrays, each already grouped by destination with counts[:, t]
    elements per destination, into one payload grouped by destination, then table."""
    if counts.shape[0] == 1:
        return np.concatenate(arrays) if arrays else np.zeros(0, np.int64)
    pieces = _by_dest(arrays, counts)
    if not pieces:
        return np.zeros(0, arrays[0].dtype if arrays else np.int64)
    return np.concatenate(pieces)


def _by_dest(arrays: list[np.ndarray], counts: np.ndarray) -> list[np.ndarray]:
    """The pieces of _group_by_dest's payload, in order (views)."""
    world, ntab = counts.shape
    offsets = np.zeros((world + 1, ntab), np.int64)
    np.cumsum(counts, axis=0, out=offsets[1:])
    return [arrays[t][offsets[r, t]:offsets[r + 1, t]] for r in range(world) for t in range(ntab)]


def _split_by_table(payload: np.ndarray, counts: np.ndarray) -> list[np.ndarray]:
    """Inverse of _group_by_dest on the receiving side: per table, the elements from
    every source in source order. The tables lie back to back in one 64-byte aligned
    buffer (the payload itself when there is one source), so a consumer can take
    several as one block (see keras._model_inputs)."""
    world, ntab = counts.shape
    starts = _starts(counts)
    if world == 1:
        return [payload[starts[0, t]:starts[0, t] + counts[0, t]] for t in range(ntab)]
    ends = starts + counts
    out = aligned_empty(payload.shape[0], payload.dtype)
    np.concatenate([payload[starts[r, t]:ends[r, t]] for t in range(ntab) for r in range(world)],
                   out=out)
    bounds = np.zeros(ntab + 1, np.int64)
    np.cumsum(counts.sum(axis=0), out=bounds[1:])
    return [out[bounds[t]:bounds[t + 1]] for t in range(ntab)]


def aligned_empty(n: int, dtype, align: int = 64) -> np.ndarray:
    """np.empty(n, dtype) starting on an `align`-byte boundary (what TensorFlow needs
    to use the memory without a copy)."""
    dtype = np.dtype(dtype)
    raw = np.empty(n * dtype.itemsize + align, np.uint8)
    off = -raw.ctypes.data % align
    return raw[off:off + n * dtype.itemsize].view(dtype)
