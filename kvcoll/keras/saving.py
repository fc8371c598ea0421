"""kv.save and kv.restore: checkpoints of a Keras model with kv.Embedding layers (or a
kv.Trainer), through kvcoll.checkpoint's Checkpointer (the tables, TF-free) and
DenseState (the dense model and its optimizer, in names every Keras version reads).
Both are collectives: every rank calls them with the same arguments.
"""

from __future__ import annotations

import weakref

from ..checkpoint import Checkpointer, RestoreInfo, SaveInfo
from .dense_state import DenseState
from .engine import Engine, engine_of

__all__ = ["save", "restore", "engine_for"]

_checkpointers: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


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


def save(directory, model, *, incremental: bool = False) -> SaveInfo:
    """Checkpoint a model with kv.Embedding layers (or a kv.Trainer) at its current
    step (a collective).

    Full by default: every row of every table (values, optimizer slots, row headers),
    the Keras model and its optimizer, the step. incremental=True writes only the rows
    changed since this model's previous save (or restore) in the same directory;
    without one it writes a full checkpoint. In SSP/ASP every rank first waits until
    every update is applied (a sync point), so the checkpoint is consistent. Returns a
    SaveInfo. Its collectives wait up to the I/O deadline (KVCOLL_IO_TIMEOUT).

    Raises CheckpointError (a save that failed: the previous checkpoint stays the
    latest), CommTimeoutError (a rank did not take part in time)."""
    eng = engine_for(model)
    eng.sync()

    def attempt():      # (an elastic run saves again on the survivors after a loss)
        with eng.comm.deadline("io"):
            return _checkpointer(eng).save(directory, eng.step, incremental=incremental)
    return attempt() if eng.elastic is None else eng.elastic.run(attempt)


def restore(directory, model, *, checkpoint: str | None = None,
            buffer_bytes: int | None = None) -> RestoreInfo:
    """Restore a model with kv.Embedding layers (or a kv.Trainer) from `directory`'s
    latest checkpoint (or `checkpoint`, a name such as "ckpt-0000000400"), on any number
    of ranks (a collective). Tables, dense model, optimizer and step become the saved
    ones, bit for bit, and training continues from that step in every step mode; any
    mismatch or corruption raises CheckpointError on every rank before anything
    changes. Each rank reads only the parts of the checkpoint that hold its keys, and
    uses at most `buffer_bytes` (default RESTORE_BUFFER, 256 MiB) beyond its tables.
    Its collectives wait up to the I/O deadline (KVCOLL_IO_TIMEOUT). Returns a
    RestoreInfo."""
    eng = engine_for(model)
    eng.sync()
    with eng.comm.deadline("io"):
        info = _checkpointer(eng).restore(directory, checkpoint, buffer_bytes=buffer_bytes)
    eng.set_step(info.step)
    return info
