"""model.fit / evaluate / predict for models with kv.Embedding layers.

Keras' own loops run a compiled train function over a tf.data iterator; kvcoll's step
must pull the rows outside the compiled code, in the same order on every rank, and
end every rank's epoch together when data is uneven. So for a model holding a
kv.Embedding, kvcoll runs the loop itself, with Keras' own machinery around it: the
same arguments, Keras' CallbackList (History, the progress bar, every user callback)
called at the same points, `model.stop_training`, `model.history`. Any other model is
untouched: `install()` (run when kvcoll's Keras layer is imported) routes the six
methods below to these functions only for models with a kv.Embedding layer.

What changes with several ranks, as a Horovod user expects:
- each rank passes its own data; batch_size is per rank; an epoch ends on every rank
  when every rank's data has run out (a rank out of data joins the others' steps with
  no samples, so no update is lost and nothing hangs);
- logs are global: the loss and every compiled metric over all ranks' samples (metric
  states are summed over ranks, so AUC is the AUC of all the data, not an average of
  per-rank AUCs), the same on every rank; so EarlyStopping and ReduceLROnPlateau decide
  the same everywhere, and a stop asked for on any rank stops every rank after the same
  step;
- the progress bar prints on rank 0 only; TensorBoard, CSVLogger, ModelCheckpoint,
  BackupAndRestore and RemoteMonitor run on rank 0 only (they write files or talk to
  the outside; with kv.Embedding layers use kv.callbacks.Checkpoint for tables);
- preemption: SIGTERM during fit (what Kubernetes and SLURM send before killing; under
  kvcollrun it reaches the ranks as SIGUSR2, which Open MPI passes on without killing
  them) makes every rank finish its current step and stop after the same step (BSP;
  SSP/ASP: at the epoch's sync point), end training as usual (so kv.callbacks.Checkpoint
  writes its final checkpoint), print a message and exit 0; a restart restores from there.
"""

from __future__ import annotations

import functools
import signal
import threading
import warnings

import numpy as np

from .. import runtime
from ..errors import InvalidArgumentError
from . import _compat
from ._compat import keras
from .embedding import Embedding
from .engine import engine_of
from .batch import DataError
from .feed import Feed, split_validation, with_class_weight

__all__ = ["fit", "evaluate", "predict", "train_on_batch", "test_on_batch", "predict_on_batch",
           "install", "uses_kvcoll"]

_RANK_ZERO_ONLY = ("TensorBoard", "CSVLogger", "ModelCheckpoint", "BackupAndRestore",
                   "RemoteMonitor")


def uses_kvcoll(model) -> bool:
    """Whether the model holds a kv.Embedding layer (then kvcoll runs its loops)."""
    try:
        return any(isinstance(layer, Embedding) for layer in _compat.sublayers(model))
    except Exception:  # noqa: BLE001 - a model that cannot list its layers is not ours
        return False


def install() -> None:
    """Route keras.Model's fit, evaluate, predict and the *_on_batch methods to kvcoll
    for models with kv.Embedding layers (idempotent)."""
    if getattr(keras.Model, "_kvcoll_installed", False):
        return
    for name, ours in (("fit", fit), ("evaluate", evaluate), ("predict", predict),
                       ("train_on_batch", train_on_batch), ("test_on_batch", test_on_batch),
                       ("predict_on_batch", predict_on_batch)):
        original = getattr(keras.Model, name)

        def method(self, *args, _orig=original, _ours=ours, **kwargs):
            if uses_kvcoll(self):
                return _ours(self, *args, **kwargs)
            return _orig(self, *args, **kwargs)

        functools.update_wrapper(method, original)
        setattr(keras.Model, name, method)
    keras.Model._kvcoll_installed = True


def _verbose(engine, verbose) -> int:
    if engine.comm.rank != 0:
        return 0
    return 1 if verbose == "auto" else int(verbose)


def _rank_callbacks(engine, callbacks) -> list:
    """The user's callbacks for this rank: the file-writing ones on rank 0 only."""
    callbacks = list(callbacks or [])
    if engine.comm.rank == 0:
        for cb in callbacks:
            if type(cb).__name__ == "ModelCheckpoint":
                warnings.warn("ModelCheckpoint saves the Keras model, not kvcoll's tables; "
                              "use kv.callbacks.Checkpoint to checkpoint a model with "
                              "kv.Embedding layers", stacklevel=3)
        return callbacks
    return [cb for cb in callbacks if type(cb).__name__ not in _RANK_ZERO_ONLY]


def _num_steps(engine, feed) -> int | None:
    """Steps per epoch over all ranks (the most any rank has), None if unknown anywhere."""
    mine = -1 if feed.num_batches is None else int(feed.num_batches)
    got = engine.comm.allgather(np.array([mine], np.int64), op="fit:steps")[:, 0]
    return None if (got < 0).any() else int(got.max())


def _agree_any(engine, *flags) -> list:
    """For each flag, whether it is set on any rank (one collective)."""
    got = engine.comm.allreduce(np.array([int(bool(f)) for f in flags], np.int64),
                                op="fit:stop", mpi_op="max")
    return [bool(g) for g in got]


def _check_compiled(model, what: str) -> None:
    if not _compat.is_compiled(model) or getattr(model, "optimizer", None) is None \
            and what == "fit":
        raise InvalidArgumentError(
            f"call model.compile(optimizer=kv.DistributedOptimizer(...), loss=...) before "
            f"model.{what}()")


def fit(model, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
        validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
        sample_weight=None, initial_epoch=0, steps_per_epoch=None, validation_steps=None,
        validation_batch_size=None, validation_freq=1):
    """Keras' fit, distributed: see the module docstring."""
    _check_compiled(model, "fit")
    engine = engine_of(model)
    if validation_split and validation_data is None:
        (x, y, sample_weight), validation_data = split_validation(
            x, y, sample_weight, validation_split)
    feed = Feed(x, y, sample_weight, batch_size, shuffle=shuffle, steps=steps_per_epoch,
                class_weight=class_weight)
    targets = engine.begin(_first(feed))
    steps = _num_steps(engine, feed)
    verbose = _verbose(engine, verbose)
    cbs = _compat.callback_list(_rank_callbacks(engine, callbacks), model=model,
                                verbose=verbose, epochs=epochs, steps=steps)
    model.stop_training = False
    with _Preemption() as preempt:
        cbs.on_train_begin()
        logs, training_logs, preempted = {}, None, False
        for epoch in range(initial_epoch, epochs):
            engine.reset_metrics()
            cbs.on_epoch_begin(epoch)
            logs = _train_epoch(engine, model, feed, epoch, targets, cbs, preempt) \
                if targets else {}
            if not engine.synchronous:
                engine.finish()                      # the epoch's sync point
                logs = engine.global_logs(targets)
            epoch_logs = dict(logs)
            if validation_data is not None and _should_eval(epoch, validation_freq) \
                    and not preempt.stop:
                vx, vy, vsw = _unpack_validation(validation_data)
                val = evaluate(model, vx, vy, sample_weight=vsw,
                               batch_size=validation_batch_size or batch_size,
                               steps=validation_steps, callbacks=cbs, return_dict=True,
                               verbose=0)
                epoch_logs.update({f"val_{k}": v for k, v in val.items()})
            cbs.on_epoch_end(epoch, epoch_logs)
            training_logs = epoch_logs
            preempted, stop = _agree_any(engine, preempt.stop, model.stop_training)
            model.stop_training = stop or preempted
            if model.stop_training:
                break
        cbs.on_train_end(logs=training_logs)
    if preempted:
        if engine.comm.rank == 0:
            print(f"kvcoll: preempted (SIGTERM): stopped every rank after step {engine.step} "
                  "(training "
                  "ended as usual, so a kv.callbacks.Checkpoint wrote its checkpoint); "
                  "exiting 0", flush=True)
        raise SystemExit(0)
    return model.history


def _train_epoch(engine, model, feed, epoch, targets, cbs, preempt) -> dict:
    logs = {}
    it = feed.epoch(epoch)
    step = 0
    while True:
        stop = model.stop_training or preempt.stop
        if stop and not engine.synchronous:
            break                 # SSP/ASP: this rank stops; the epoch's end agrees
        batch = _next(it)
        cbs.on_train_batch_begin(step)
        out = engine.train_step(batch, targets=targets, stop=stop)
        if out is None:
            if not engine.synchronous:
                break
            return logs
        logs = out.logs
        cbs.on_train_batch_end(step, logs)
        step += 1
    return logs


class _Preemption:
    """SIGTERM (or SIGUSR2, kvcollrun's relay of it through mpirun) while fit runs, in
    the main thread: noted, not fatal; fit stops every rank after the same step. The
    previous handlers come back when fit returns."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR2)

    def __init__(self):
        self.stop = False
        self._prev = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._prev = {s: signal.signal(s, self._on_signal) for s in self.SIGNALS}
        return self

    def _on_signal(self, signum, frame):
        self.stop = True
        runtime.note_preempted()

    def __exit__(self, *exc):
        for s, prev in self._prev.items():
            signal.signal(s, prev)
        return False


def _next(it):
    """The next element, None at the end. An error raised by the data source comes back
    as a DataError element, so the step reports it to every rank."""
    try:
        return next(it)
    except StopIteration:
        return None
    except Exception as exc:  # noqa: BLE001 - agreed with the other ranks in the step
        return DataError(exc)


def _first(feed):
    """This rank's first element (None if none; a DataError if reading failed)."""
    try:
        return feed.first()
    except Exception as exc:  # noqa: BLE001 - agreed with the other ranks in begin()
        return DataError(exc)


def _should_eval(epoch: int, freq) -> bool:
    if isinstance(freq, int):
        return (epoch + 1) % freq == 0
    return epoch + 1 in freq


def _unpack_validation(data):
    if isinstance(data, tuple):
        if len(data) == 2:
            return data[0], data[1], None
        if len(data) == 3:
            return data
        raise InvalidArgumentError("validation_data must be (x, y), (x, y, sample_weight) "
                                   "or a dataset")
    return data, None, None


def evaluate(model, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
             steps=None, callbacks=None, return_dict=False, **kwargs):
    """Keras' evaluate, distributed: every rank evaluates its own data and gets the
    loss and metrics over all ranks' samples (a collective)."""
    kwargs.pop("_use_cached_eval_dataset", None)
    if kwargs:
        raise InvalidArgumentError(f"evaluate: unknown arguments {sorted(kwargs)}")
    _check_compiled(model, "evaluate")
    engine = engine_of(model)
    feed = Feed(x, y, sample_weight, batch_size, steps=steps)
    engine.sync()
    targets = engine.begin(_first(feed))
    own_cbs = not isinstance(callbacks, keras.callbacks.CallbackList)
    cbs = _compat.callback_list(_rank_callbacks(engine, callbacks), model=model,
                                verbose=_verbose(engine, verbose), epochs=1,
                                steps=_num_steps(engine, feed), add_history=False) \
        if own_cbs else callbacks
    engine.reset_metrics()
    cbs.on_test_begin()
    logs = {}
    if targets is not None:
        it = feed.epoch(0)
        step = 0
        while True:
            batch = _next(it)
            cbs.on_test_batch_begin(step)
            out = engine.test_step(batch, targets=targets)
            if out is None:
                break
            logs = out
            cbs.on_test_batch_end(step, logs)
            step += 1
    cbs.on_test_end(logs)
    if return_dict:
        return logs
    return _compat.flatten_logs(model, logs)


def predict(model, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
    """Keras' predict, distributed: the model's outputs for this rank's x (a
    collective: every rank calls it, with its own data or none)."""
    engine = engine_of(model)
    feed = Feed(x, None, None, batch_size, steps=steps)
    engine.sync()
    if engine.begin(_first(feed), x_only=True) is None:
        return _empty_outputs(model)
    cbs = _compat.callback_list(_rank_callbacks(engine, callbacks), model=model,
                                verbose=_verbose(engine, verbose), epochs=1,
                                steps=_num_steps(engine, feed), add_history=False)
    cbs.on_predict_begin()
    outputs = []
    it = feed.epoch(0)
    step = 0
    while True:
        batch = _next(it)
        cbs.on_predict_batch_begin(step)
        more, out = engine.predict_step(batch)
        if not more:
            break
        if out is not None:
            outputs.append(out)
            cbs.on_predict_batch_end(step, {"outputs": out})
        step += 1
    cbs.on_predict_end()
    return _concat(outputs) if outputs else _empty_outputs(model)


def _concat(outputs):
    first = outputs[0]
    if isinstance(first, dict):
        return {k: np.concatenate([o[k] for o in outputs]) for k in first}
    if isinstance(first, (list, tuple)):
        return type(first)(np.concatenate([o[i] for o in outputs]) for i in range(len(first)))
    return np.concatenate(outputs)


def _empty_outputs(model):
    outs = getattr(model, "outputs", None)
    if outs and len(outs) == 1:
        return np.zeros((0,) + tuple(d or 0 for d in outs[0].shape[1:]), np.float32)
    return np.zeros((0,), np.float32)


def train_on_batch(model, x, y=None, sample_weight=None, class_weight=None,
                   return_dict=False):
    """One training step on this rank's batch (a collective in BSP)."""
    _check_compiled(model, "fit")
    engine = engine_of(model)
    element = with_class_weight((x, y, sample_weight), class_weight)
    targets = engine.begin(element)
    engine.reset_metrics()
    out = engine.train_step(element, targets=targets)
    logs = out.logs if out is not None else {}
    return logs if return_dict else _compat.flatten_logs(model, logs)


def test_on_batch(model, x, y=None, sample_weight=None, return_dict=False):
    """One evaluation step on this rank's batch (a collective)."""
    _check_compiled(model, "evaluate")
    engine = engine_of(model)
    element = (x, y, sample_weight)
    engine.sync()
    targets = engine.begin(element)
    engine.reset_metrics()
    logs = engine.test_step(element, targets=targets) or {}
    return logs if return_dict else _compat.flatten_logs(model, logs)


def predict_on_batch(model, x):
    """The model's outputs for this rank's batch x (a collective)."""
    return predict(model, iter([(x,)]), verbose=0)
