"""kv.callbacks: Keras callbacks for what is kvcoll's (tables, checkpoints, export).

    model.fit(data, epochs=3, callbacks=[
        kv.callbacks.Checkpoint("ck/", every_n_steps=1000, incremental_every=100,
                                max_to_keep=3, restore=True),
        kv.callbacks.Evict(every_n_steps=50),
        kv.callbacks.TableStats(),            # rows, bytes, admitted, evicted -> logs
        kv.callbacks.Throughput(),            # samples/s of the training steps -> logs
        kv.callbacks.Export("serve/"),        # at the end of training
        kv.callbacks.Publish("pub/", every_seconds=30),  # deltas for `kvcoll serve`
    ])

Give the same callbacks on every rank: saves, restores, exports and table statistics
are collectives. Steps are kvcoll's global step (BSP) or the rank's clock (SSP/ASP);
in SSP/ASP, where ranks step at their own pace, step-triggered saves happen at the
epoch's sync point after the step count passed the mark.
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np

from ..errors import InvalidArgumentError
from ._compat import keras
from .engine import engine_of

__all__ = ["Checkpoint", "Export", "Evict", "Publish", "TableStats", "Throughput",
           "WorldChange"]


def _say(comm, text: str) -> None:
    """Print one line on rank 0 (what a callback tells the user)."""
    if comm.rank == 0:
        print(text, file=sys.stdout, flush=True)


def _positive(name, value):
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgumentError(f"{name} must be a positive integer or None, got {value!r}")
    return value


class Checkpoint(keras.callbacks.Callback):
    """kvcoll checkpoints during fit (kv.save), and a resume from them (kv.restore).

    Saves a full checkpoint every `every_n_steps` steps, an incremental one (the rows
    changed since the previous save) every `incremental_every` steps in between, one at
    every epoch end with `every_epoch`, and one at the end of training (`save_at_end`;
    incremental when `incremental_every` is set). max_to_keep=N keeps the newest N
    checkpoints of `directory` and every checkpoint they need (a delta's parents down
    to its full checkpoint), deleting the others after each save (kvcoll.retention:
    what a live lease holds, a restoring job's or a server's, stays); None keeps all.
    restore=True continues, when training begins, from the directory's latest
    checkpoint, on any number of ranks, where the saved run stood: its epoch and step
    (fit's `epochs` is then the total, as with Keras' BackupAndRestore) and the position
    of a kvcoll data source (a reader, a stream, Kafka), so a restarted job sees every
    sample once; it says on rank 0 which checkpoint it restored or that none was found
    and where it looked (then training starts from scratch).
    verbose=0 silences those lines.

    Arguments: directory (a path; a shared file system with several hosts),
    every_n_steps, incremental_every, max_to_keep (positive integers or None),
    every_epoch, save_at_end, restore (bools), verbose (0 or 1).
    Raises InvalidArgumentError for a count that is not a positive integer (when made),
    and what kv.save and kv.restore raise (CheckpointError, CommTimeoutError) during fit.
    `saves` holds every save's SaveInfo, `restored` the RestoreInfo of the resume (or
    None), `pruned` the checkpoints retention deleted (on rank 0)."""

    def __init__(self, directory, every_n_steps: int | None = None,
                 incremental_every: int | None = None, every_epoch: bool = False,
                 save_at_end: bool = True, restore: bool = False,
                 max_to_keep: int | None = None, verbose: int = 1):
        super().__init__()
        self.directory = os.fspath(directory)
        self.every_n_steps = _positive("every_n_steps", every_n_steps)
        self.incremental_every = _positive("incremental_every", incremental_every)
        self.max_to_keep = _positive("max_to_keep", max_to_keep)
        self.every_epoch = bool(every_epoch)
        self.save_at_end = bool(save_at_end)
        self.restore = bool(restore)
        self.verbose = int(verbose)
        self.saves = []          # SaveInfo of every save, in order
        self.restored = None     # RestoreInfo, if training began from a checkpoint
        self.pruned = []         # names of the checkpoints retention deleted (rank 0)
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
        where = os.path.abspath(self.directory)
        comm = self._engine().comm
        # rank 0 looks; every rank follows its answer (a collective either way)
        found = latest(where) is not None if comm.rank == 0 else None
        found = bool(comm.bcast(np.array([found or 0], np.int64), op="checkpoint:found")[0])
        if not found:
            if self.verbose:
                why = "the directory does not exist" if not os.path.isdir(where) else \
                    "it holds no complete checkpoint (no 'latest' file)"
                _say(comm, f"kv.callbacks.Checkpoint: no checkpoint to restore in {where} "
                           f"({why}): training starts from scratch")
            return
        info = self.restored = restore(where, self.model, resume=True)
        self._last = info.step
        if self.verbose:
            deltas = len(info.chain) - 1
            _say(comm, f"kv.callbacks.Checkpoint: restored {info.name} from {where} "
                       f"(step {info.step}; a full checkpoint"
                       f"{f' and {deltas} incremental one(s)' if deltas else ''}) "
                       f"in {info.seconds:.1f}s")

    def _kind_at(self, step: int) -> str | None:
        if self.every_n_steps and step % self.every_n_steps == 0:
            return "full"
        if self.incremental_every and step % self.incremental_every == 0:
            return "delta"
        return None

    def _save(self, kind: str) -> None:
        from .saving import pruned, save
        eng = self._engine()
        if self._last == eng.step:
            return
        info = save(self.directory, self.model, incremental=kind == "delta",
                    max_to_keep=self.max_to_keep)
        self.pruned += pruned.pop(eng, ())
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
    SavedModel that serves with TensorFlow alone, plus the embedding dictionary.
    directory: where the export goes (replaced each time); `exports` holds what each
    export returned. Raises what kv.export raises (InvalidArgumentError,
    CommTimeoutError), from fit."""

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
    each eviction took. Arguments: every_n_steps (a positive integer), stagger (bool).
    Raises InvalidArgumentError for an every_n_steps that is not a positive integer."""

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
    at every epoch end. `history` keeps every table's figures per epoch.

    `admitted` counts the rows admitted since training began, counting the rows a
    restore brought back as admitted (the run that wrote them admitted them); the
    other counters (rejected, evicted, dropped_grads) count this process's steps.
    Arguments: per_table (bool). Raises CommTimeoutError when a rank does not reach the
    epoch's end in time."""

    FIELDS = ("rows", "bytes", "admitted", "rejected", "evicted", "dropped_grads")

    def __init__(self, per_table: bool = False):
        super().__init__()
        self.per_table = bool(per_table)
        self.history = []

    def on_epoch_end(self, epoch, logs=None):
        from .saving import restored_rows
        eng = engine_of(self.model)
        base = restored_rows.get(eng, {})
        rows = []
        for name, t in eng.tables.items():
            s = t.stats()
            got = {f: getattr(s, f) for f in self.FIELDS}
            if name in base:   # rows restored + admitted since the restore
                got["admitted"] = base[name][0] + max(0, s.admitted - base[name][1])
            rows.append([got[f] for f in self.FIELDS])
        local = np.array(rows, np.float64).reshape(len(eng.tables), len(self.FIELDS))
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


class Publish(keras.callbacks.Callback):
    """Versioned deltas for `kvcoll serve` while training (kvcoll.publish): every
    `every_seconds` seconds and/or every `every_n_steps` steps, the rows changed and the
    keys evicted since the last version (each rank its part, values only), the dense
    weights when they changed, and a full base every `base_every` versions; the newest
    `keep_bases` bases and the deltas after them are kept. The first version of a run
    is a base. `publish_at_end` publishes once more when training ends.

    every_seconds is wall time: after each step rank 0 looks at its clock and one
    8-byte broadcast tells every rank whether to publish after this step (BSP), so the
    cadence holds when the pace of the steps changes, as it does on a stream that
    catches up with its backlog and then waits for data. While the data is late (BSP:
    the idle rounds kvcoll's loop runs while every rank waits, one each idle_poll of a
    kv.data.stream), the steps not yet published are published once every_seconds have
    passed, without waiting for the next step: the last rows before a pause reach
    serving too. In SSP/ASP the ranks step at their own pace: a due publish (by each
    rank's clock) happens at the epoch's end (with an unbounded stream, an epoch is
    steps_per_epoch steps). `published` holds a PublishInfo per version."""

    def __init__(self, directory, every_seconds: float | None = None,
                 every_n_steps: int | None = None, base_every: int = 10,
                 keep_bases: int = 2, publish_at_end: bool = True,
                 reader_ttl: float = 120.0):
        super().__init__()
        if every_seconds is not None and not (isinstance(every_seconds, (int, float))
                                              and every_seconds > 0):
            raise InvalidArgumentError(f"Publish: every_seconds must be a number > 0 or "
                                       f"None, got {every_seconds!r}")
        self.directory = os.fspath(directory)
        self.every_seconds = every_seconds
        self.every_n_steps = _positive("every_n_steps", every_n_steps)
        self.base_every = _positive("base_every", base_every)
        self.keep_bases = _positive("keep_bases", keep_bases)
        self.publish_at_end = bool(publish_at_end)
        self.reader_ttl = float(reader_ttl)
        self.published = []      # PublishInfo of every version, in order
        self._publisher = None
        self._last = None        # time.monotonic() of the last publish (every_seconds)
        self._due = False        # SSP/ASP: a publish owed at the next epoch end

    def _engine(self):
        return engine_of(self.model)

    def _make(self, eng):
        from ..publish import Publisher
        from .serving_graph import ServingDense
        owners = eng.loop.ex.owners
        if self._publisher is None:
            self._publisher = Publisher(eng.tables, eng.comm, ServingDense(eng), owners=owners,
                                        base_every=self.base_every, keep_bases=self.keep_bases,
                                        reader_ttl=self.reader_ttl)
        elif self._publisher.owners is not owners:  # the world changed: a new chain
            self._publisher.comm = eng.comm
            self._publisher.set_owners(owners)
        return self._publisher

    def _is_due(self, eng) -> bool:
        if self.every_n_steps and eng.step % self.every_n_steps == 0:
            return True
        return self._time_is_due(eng)

    def _time_is_due(self, eng) -> bool:
        if self.every_seconds is None:
            return False
        due = self._last is None or time.monotonic() - self._last >= self.every_seconds
        if not eng.synchronous:  # this rank's clock; the epoch's end agrees (on_epoch_end)
            return due
        # BSP: rank 0's clock decides for every rank, after the same step
        flag = np.array([int(due) if eng.comm.rank == 0 else 0], np.int64)
        return bool(eng.comm.bcast(flag, op="publish:due")[0])

    def publish(self):
        """Publish a version now (a collective: every rank calls it)."""
        eng = self._engine()
        pub = self._make(eng)
        eng.sync()
        with eng.comm.deadline("io"):
            info = pub.publish(self.directory, eng.step)
            self.published.append(info)
        self._last = time.monotonic()
        self.on_publish(info)
        return info

    def on_publish(self, info) -> None:
        """Called after every publish with its PublishInfo (override to log it)."""

    def on_train_batch_end(self, batch, logs=None):
        eng = self._engine()
        if not self._is_due(eng):
            return
        if eng.synchronous:
            self.publish()
        else:
            self._due = True

    def on_idle(self):
        """BSP, every rank at the same idle round of fit (its data late): publish the
        steps trained since the last version once every_seconds have passed."""
        eng = self._engine()
        if self.every_seconds is None or not self.published or \
                self.published[-1].step == eng.step:    # (the same on every rank)
            return
        if self._time_is_due(eng):
            self.publish()

    def on_epoch_end(self, epoch, logs=None):
        eng = self._engine()
        if eng.synchronous:
            return
        flag = eng.comm.allreduce(np.array([int(self._due)], np.int64), op="publish:due")
        self._due = False
        if flag[0]:
            self.publish()

    def on_train_end(self, logs=None):
        eng = self._engine()
        if not self.publish_at_end:
            return
        if eng.synchronous and self.published and self.published[-1].step == eng.step:
            return  # (BSP: the same step on every rank; SSP/ASP always publish here)
        self.publish()


class Throughput(keras.callbacks.Callback):
    """Training throughput in the logs: `samples_per_sec`, the samples of every rank's
    training steps per second of those steps, in each epoch's logs (so the progress
    line, History, CSVLogger and TensorBoard show it), and `rank_samples_per_sec`, this
    rank's own so far, in each batch's logs.

    It times Keras' call of the step function alone (reading the batch, kvcoll's step,
    the step's collectives): unlike Keras' ms/step, it leaves out validation, other
    callbacks (checkpoint writes, exports) and the time between epochs. The epoch's
    figure is the sum over ranks of each rank's samples over its step seconds (in BSP
    the ranks step together, so that is the global batch per step time; in SSP/ASP each
    rank's own pace counts). A collective at every epoch end (one small allreduce).
    `history` keeps each epoch's {"samples", "seconds", "samples_per_sec"}; `seconds`
    and `samples` this rank's for the current epoch. Put it before the callbacks that
    read the logs. Arguments: none. Raises nothing of its own."""

    def __init__(self):
        super().__init__()
        self.history = []
        self.samples = 0
        self.seconds = 0.0
        self._wrapped = None

    def on_train_begin(self, logs=None):
        # Keras calls make_train_function, then on_train_begin, then train_function once
        # per step (both majors): time that call, nothing around it.
        inner = getattr(self.model, "train_function", None)
        if inner is None:
            return
        inner = getattr(inner, "_kv_timed", inner)   # a fit that raised left a wrapper
        eng = engine_of(self.model)

        def timed(iterator):
            t0 = time.perf_counter()
            try:
                return inner(iterator)
            finally:
                self.seconds += time.perf_counter() - t0
                self.samples += eng.last_samples

        timed._kv_timed = inner
        self._wrapped = inner
        self.model.train_function = timed

    def on_epoch_begin(self, epoch, logs=None):
        self.samples, self.seconds = 0, 0.0

    def on_train_batch_end(self, batch, logs=None):
        if logs is not None and self.seconds > 0:
            logs["rank_samples_per_sec"] = self.samples / self.seconds

    def on_epoch_end(self, epoch, logs=None):
        eng = engine_of(self.model)
        own = self.samples / self.seconds if self.seconds > 0 else 0.0
        total = eng.comm.allreduce(np.array([own, self.samples, self.seconds], np.float64),
                                   op="throughput")
        entry = {"samples": int(total[1]), "seconds": float(total[2]) / eng.comm.size,
                 "samples_per_sec": float(total[0])}
        self.history.append(entry)
        if logs is not None:
            logs["samples_per_sec"] = entry["samples_per_sec"]

    def on_train_end(self, logs=None):
        if self._wrapped is not None:
            self.model.train_function = self._wrapped
            self._wrapped = None
