"""kv.save and kv.restore: checkpoints of a Keras model with kv.Embedding layers (or a
kv.Trainer), through kvcoll.checkpoint's Checkpointer (the tables, TF-free) and
DenseState (the dense model and its optimizer, in names every Keras version reads).
Both are collectives: every rank calls them with the same arguments.

Retention (kvcoll.retention) protects what a job needs: a restore holds a lease on the
checkpoint it reads while it reads it, and rank 0 then keeps a lease, for as long as the
process lives, on the checkpoint its next incremental save will name as parent when that
is not the one `latest` names (which every prune keeps); a save
with max_to_keep prunes the directory on rank 0 after the save committed.
"""

from __future__ import annotations

import os
import warnings
import weakref

from .. import retention, runtime
from ..checkpoint import Checkpointer, RestoreInfo, SaveInfo, latest
from .dense_state import DenseState
from .engine import Engine, engine_of
from .model import progress_of, resume_from

__all__ = ["save", "restore", "engine_for"]

_checkpointers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# rank 0: the lease on the checkpoint the engine's next delta names as parent
_parent_leases: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# per engine, what its last restore put in each table: {name: (rows, admitted counter)}
restored_rows: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# rank 0, per engine: the checkpoints its last save's retention deleted
pruned: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def engine_for(obj) -> Engine:
    """The engine behind a Keras model, a kv.Trainer, or an engine, set up (a functional
    model sets up from its declared inputs: a collective)."""
    eng = obj if isinstance(obj, Engine) else getattr(obj, "engine", None)
    if eng is None:
        eng = engine_of(obj)
    if eng.tables is None:
        eng.setup_from_model()
    return eng


def _checkpointer(eng: Engine) -> Checkpointer:
    ck = _checkpointers.get(eng)
    if ck is None:
        ck = Checkpointer(eng.tables, eng.comm, dense=DenseState(eng.model, eng.optimizer),
                          owners=eng.loop.ex.owners)   # the exchange's owner map
        _checkpointers[eng] = ck
        if eng.elastic is not None:   # its chain refills a lost rank's buckets
            eng.elastic.checkpointer = ck
    return ck


def _hold_parent(eng: Engine, directory: str, name: str) -> None:
    """Rank 0: lease `name` (the parent of the next delta) for the process's life,
    releasing the lease on the previous parent. Not needed, and not taken, when `name`
    is the one `latest` names (every prune keeps that one): only after a restore of an
    older checkpoint."""
    if eng.comm.rank != 0:
        return
    old = _parent_leases.pop(eng, None)
    try:
        if latest(directory) != name:
            _parent_leases[eng] = retention.hold(directory, name, ttl=None,
                                                 holder="a training job's next delta")
    except OSError as exc:
        warnings.warn(f"kvcoll: cannot lease {name} in {directory} ({exc}): a prune by "
                      "another process could delete the parent of this job's next "
                      "incremental save", stacklevel=3)
    if old is not None:
        old.release()


def save(directory, model, *, incremental: bool = False,
         max_to_keep: int | None = None) -> SaveInfo:
    """Checkpoint a model with kv.Embedding layers (or a kv.Trainer) at its current
    step (a collective).

    Full by default: every row of every table (values, optimizer slots, row headers),
    the Keras model and its optimizer, the step. incremental=True writes only the rows
    changed since this model's previous save (or restore) in the same directory;
    without one it writes a full checkpoint. In SSP/ASP every rank first waits until
    every update is applied (a sync point), so the checkpoint is consistent.
    max_to_keep=N then deletes, on rank 0, the checkpoints of `directory` beyond the
    newest N, except those a kept checkpoint needs (a delta's parents, down to its full
    checkpoint) and those a live lease holds (kvcoll.retention); None keeps every one.
    Returns a SaveInfo. Its collectives wait up to the I/O deadline
    (KVCOLL_IO_TIMEOUT).

    Raises CheckpointError (a save that failed: the previous checkpoint stays the
    latest), CommTimeoutError (a rank did not take part in time), InvalidArgumentError
    (max_to_keep not a positive integer or None: before anything is written)."""
    if max_to_keep is not None:
        retention.plan([], max_to_keep)   # checks it, on every rank, before the save
    eng = engine_for(model)
    eng.sync()

    def attempt():      # (an elastic run saves again on the survivors after a loss)
        with eng.comm.deadline("io"):
            return _checkpointer(eng).save(directory, eng.step, incremental=incremental,
                                           progress=progress_of(eng.model))
    info = attempt() if eng.elastic is None else eng.elastic.run(attempt)
    directory = os.path.abspath(os.fspath(directory))
    _hold_parent(eng, directory, info.name)
    if max_to_keep is not None and eng.comm.rank == 0:
        try:
            pruned[eng] = retention.prune(directory, max_to_keep, pinned=[info.name]).delete
        except OSError as exc:  # the save itself succeeded
            warnings.warn(f"kvcoll: saved {info.name}, but deleting old checkpoints of "
                          f"{directory} failed: {exc}", stacklevel=2)
    return info


def restore(directory, model, *, checkpoint: str | None = None,
            buffer_bytes: int | None = None, resume: bool = False) -> RestoreInfo:
    """Restore a model with kv.Embedding layers (or a kv.Trainer) from `directory`'s
    latest checkpoint (or `checkpoint`, a name such as "ckpt-0000000400"), on any number
    of ranks (a collective). Tables, dense model, optimizer and step become the saved
    ones, bit for bit, and training continues from that step in every step mode.
    Each rank reads only the parts of the checkpoint that hold its keys, and uses at
    most `buffer_bytes` (default RESTORE_BUFFER, 256 MiB) beyond its tables. Rank 0
    chooses the checkpoint and holds a lease on it while the ranks read it, so a
    concurrent prune (kvcoll.retention) cannot delete it. Its collectives wait up to
    the I/O deadline (KVCOLL_IO_TIMEOUT). With resume=True (what
    kv.callbacks.Checkpoint(restore=True) does: a restarted job) the next fit continues
    where the saved one stood: its epoch and step (`epochs` is then the total, as with
    Keras' BackupAndRestore), and, when it reads a kvcoll data source, its data's
    position, so no sample is seen twice or skipped. Returns a RestoreInfo.

    Raises CheckpointError on every rank, before anything changes, when there is no
    checkpoint, or on any mismatch or corruption; CommTimeoutError when a rank did not
    take part in time."""
    eng = engine_for(model)
    eng.sync()
    directory = os.path.abspath(os.fspath(directory))
    lease = None
    with eng.comm.deadline("io"):
        if eng.comm.rank == 0:
            checkpoint, lease = _lease_for_restore(directory, checkpoint)
        name = eng.comm.bcast_bytes((checkpoint or "").encode() if eng.comm.rank == 0
                                    else None, op="restore:name").decode() or None
        try:
            info = _checkpointer(eng).restore(directory, name, buffer_bytes=buffer_bytes)
        finally:
            if lease is not None:
                lease.release()
    eng.set_step(info.step)
    restored_rows[eng] = {n: (len(t), t.stats().admitted) for n, t in eng.tables.items()}
    _hold_parent(eng, directory, info.name)
    said = resume_from(eng.model, info.progress, eng.comm) if resume else None
    if eng.comm.rank == 0 and said:
        print(f"kvcoll: the next fit continues at {said}", flush=True)
    return info


def _lease_for_restore(directory: str, checkpoint: str | None):
    """Rank 0: the checkpoint to restore (the latest unless named) and a lease on it,
    taken before checking that it is still there (a prune that ran before the lease
    existed may have deleted it: then the new latest is read again)."""
    for _ in range(5):
        name = checkpoint or latest(directory)
        if name is None or not os.path.isdir(directory):
            return checkpoint, None
        ttl = 2 * runtime.config().io_timeout if runtime.is_initialized() else 3600.0
        try:
            lease = retention.hold(directory, name, ttl=ttl, holder="a restore")
        except OSError:   # a read-only directory: nobody can prune it either
            return name, None
        if os.path.isdir(os.path.join(directory, name)) or checkpoint is not None:
            return name, lease
        lease.release()
    return checkpoint or latest(directory), None
