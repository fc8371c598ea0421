"""kv.callbacks: Keras callbacks for what is kvcoll's (tables, checkpoints, export).

    model.fit(data, epochs=3, callbacks=[
        kv.callbacks.Checkpoint("ck/", every_n_steps=1000, incremental_every=100),
        kv.callbacks.Evict(every_n_steps=50),
        kv.callbacks.TableStats(),            # rows, bytes, admitted, evicted -> logs
        kv.callbacks.Export("serve/"),        # at the end of training
    ])

Give the same callbacks on every rank: saves, restores, exports and table statistics
are collectives. Steps are kvcoll's global step (BSP) or the rank's clock (SSP/ASP);
in SSP/ASP, where ranks step at their own pace, step-triggered saves happen at the
epoch's sync point after the step count passed the mark.
"""

from __future__ import annotations

import os

import numpy as np

from ..errors import InvalidArgumentError
from ._compat import keras
from .engine import engine_of

__all__ = ["Checkpoint", "Export", "Evict", "TableStats", "WorldChange"]


def _positive(name, value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{name} must be a positive integer or None, got {value!r}")
    return value


class Checkpoint(keras.callbacks.Callback):
    """kvcoll checkpoints during fit (kv.save): a full save every `every_n_steps` steps,
    an incremental one (the rows changed since the previous save) every
    `incremental_every` steps in between, one at every epoch end with `every_epoch`, and
    one at the end of training. restore=True continues from the directory's latest
    checkpoint when training begins (if there is one), on any number of ranks. The save
    at the end is incremental when `incremental_every` is set."""

    def __init__(self, directory, every_n_steps: int | None = None,
                 incremental_every: int | None = None, every_epoch: bool = False,
                 save_at_end: bool = True, restore: bool = False):
        super().__init__()
        self.directory = os.fspath(directory)
        self.every_n_steps = _positive("every_n_steps", every_n_steps)
        self.incremental_every = _positive("incremental_every", incremental_every)
        self.every_epoch = bool(every_epoch)
        self.save_at_end = bool(save_at_end)
        self.restore = bool(restore)
        self.saves = []          # SaveInfo of every save, in order
        self.restored = None     # RestoreInfo, if training began from a checkpoint
        self._last = None        # the step of the last save
        self._due = None         # SSP/ASP: "full" or "delta" owed at the next sync point
        self._checked = False    # the directory is seen by every rank

    def _engine(self):
        return engine_of(self.model)

    def on_train_begin(self, logs=None):
        from ..checkpoint import check_shared
        eng = self._engine()
        eng.checkpoint_dir = self.directory   # (elastic: saves below --min-np)
        if eng.comm.size > 1 and not self._checked:   # every rank must see the directory
            check_shared(self.directory, eng.comm)
            self._checked = True
        if not self.restore:
            return
        if eng.tables is None and eng.declared.kind is None:
            eng.after_setup(self._restore)   # a subclassed model: set up by its first step
        else:
            self._restore()

    def _restore(self) -> None:
        from ..checkpoint import latest
        from .saving import restore
        if latest(self.directory) is not None:
            self.restored = restore(self.directory, self.model)
            self._last = self.restored.step

    def _kind_at(self, step: int) -> str | None:
        if self.every_n_steps and step % self.every_n_steps == 0:
            return "full"
        if self.incremental_every and step % self.incremental_every == 0:
            return "delta"
        return None

    def _save(self, kind: str) -> None:
        from .saving import save
        eng = self._engine()
        if self._last == eng.step:
            return
        info = save(self.directory, self.model, incremental=kind == "delta")
        self.saves.append(info)
        self._last = eng.step
        self.on_save(info)

    def on_save(self, info) -> None:
        """Called after every save with its SaveInfo (override to log it)."""

    def on_train_batch_end(self, batch, logs=None):
        eng = self._engine()
        kind = self._kind_at(eng.step)
        if kind is None:
            return
        if eng.synchronous:
            self._save(kind)
        elif self._due != "full":
            self._due = kind

    def on_epoch_end(self, epoch, logs=None):
        due, eng = self._due, self._engine()
        if not eng.synchronous:  # ranks passed the marks at their own pace: agree
            flags = eng.comm.allreduce(np.array([due == "delta", due == "full"], np.int64),
                                       op="checkpoint:due")
            due = "full" if flags[1] else "delta" if flags[0] else None
        if due is not None or self.every_epoch:
            self._save("full" if due == "full" or self.every_epoch else "delta")
        self._due = None

    def on_train_end(self, logs=None):
        if self.save_at_end:  # a delta when saving incrementally (it names its parent)
            self._save("delta" if self.incremental_every else "full")


class WorldChange(keras.callbacks.Callback):
    """Calls on_change(old_size, new_size) when an elastic run's world changes (ranks
    lost: kvcoll.elastic), after the survivors recovered and before the step that was
    interrupted runs again, on every survivor: e.g. to rescale a learning rate to the
    new number of ranks (Horovod elastic's reset callbacks).

        kv.callbacks.WorldChange(lambda old, new: print(f"{old} -> {new} ranks"))

    Any callback of fit with a method on_world_change(old_size, new_size) is called the
    same way; subclass this one to write one."""

    def __init__(self, on_change=None):
        super().__init__()
        self._on_change = on_change

    def on_world_change(self, old_size, new_size):
        if self._on_change is not None:
            self._on_change(old_size, new_size)


class Export(keras.callbacks.Callback):
    """kv.export at the end of training (and at every epoch end with `every_epoch`): a
    SavedModel that serves with TensorFlow alone, plus the embedding dictionary."""

    def __init__(self, directory, every_epoch: bool = False):
        super().__init__()
        self.directory = os.fspath(directory)
        self.every_epoch = bool(every_epoch)
        self.exports = []

    def _export(self):
        from ..serving import export
        self.exports.append(export(self.directory, self.model))

    def on_epoch_end(self, epoch, logs=None):
        if self.every_epoch:
            self._export()

    def on_train_end(self, logs=None):
        self._export()


class Evict(keras.callbacks.Callback):
    """The tables' eviction policies (kv.Embedding's evict_after_steps, max_rows,
    evict_policy) every `every_n_steps` steps, on this rank's shards (no collective).
    With `stagger`, table i is evicted at steps where (step + i) is a multiple of
    every_n_steps, which spreads the pause over the steps. `pauses` holds the seconds
    each eviction took."""

    def __init__(self, every_n_steps: int = 100, stagger: bool = True):
        super().__init__()
        self.every_n_steps = _positive("every_n_steps", every_n_steps)
        self.stagger = bool(stagger)
        self.pauses = []

    def on_train_batch_end(self, batch, logs=None):
        from .trainer import evict
        eng = self._engine()
        names = [n for i, n in enumerate(eng.tables)
                 if (eng.step + (i if self.stagger else 0)) % self.every_n_steps == 0]
        if names:
            self.pauses.append(evict(eng, tables=names))

    def on_train_end(self, logs=None):
        from .trainer import evict
        self.pauses.append(evict(self._engine()))

    def _engine(self):
        return engine_of(self.model)


class TableStats(keras.callbacks.Callback):
    """Adds the tables' statistics, summed over ranks and tables, to the epoch's logs
    (so the progress bar, History, CSVLogger and TensorBoard record them; put it before
    those): `kv_rows`, `kv_bytes`, `kv_admitted`, `kv_rejected`, `kv_evicted`,
    `kv_dropped_grads`; with per_table=True also `<table>/rows` and so on. A collective
    at every epoch end. `history` keeps every table's figures per epoch."""

    FIELDS = ("rows", "bytes", "admitted", "rejected", "evicted", "dropped_grads")

    def __init__(self, per_table: bool = False):
        super().__init__()
        self.per_table = bool(per_table)
        self.history = []

    def on_epoch_end(self, epoch, logs=None):
        eng = engine_of(self.model)
        local = np.array([[getattr(t.stats(), f) for f in self.FIELDS]
                          for t in eng.tables.values()], np.float64)
        total = eng.comm.allreduce(local.reshape(-1), op="table_stats").reshape(local.shape)
        tables = {name: dict(zip(self.FIELDS, map(int, row)))
                  for name, row in zip(eng.tables, total)}
        self.history.append(tables)
        if logs is None:
            return
        logs.update({f"kv_{f}": float(v) for f, v in zip(self.FIELDS, total.sum(axis=0))})
        if self.per_table:
            logs.update({f"{name}/{f}": float(v) for name, d in tables.items()
                         for f, v in d.items()})
