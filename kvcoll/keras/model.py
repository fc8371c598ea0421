"""Keras drives kvcoll's step loop, per model: `kv.Model` and `kv.distribute`.

A model opts in once: built as `kv.Model(inputs, outputs)` (a keras.Model subclass,
which subclassed models can inherit from too), or passed through `kv.distribute(model)`
(for a model that exists already: a Sequential, one loaded from a file, one a library
built; its class becomes a subclass of its own class with kvcoll's step functions, for
that one instance). Nothing in Keras' classes is replaced. A plain keras.Model holding
kv.Embedding layers that did not opt in fails at its first step with the error of
kv.Embedding, which names the fix: it never trains wrongly in silence.

Keras keeps its own loops. In both Keras majors `fit` calls `make_train_function()` and
then `train_function(iterator)` once per step (evaluate and predict likewise); an
opted-in model returns step functions that run kvcoll's loop (kvcoll.step):

- the step function reads the iterator itself, so a rank whose data ran out still takes
  part in the step's agreement with no samples, until every rank's data has run out;
  then it raises StopIteration on every rank at the same step and Keras ends the epoch;
  fit/evaluate first agree on each rank's number of batches: when they differ (or one
  is unknown), every rank's data is made of unknown length, so Keras lets the step
  functions end the epoch;
- logs are global: the loss and every compiled metric over all ranks' samples, and the
  model's metric variables hold that global state, which is what Keras reads at an
  epoch's end; so EarlyStopping and ReduceLROnPlateau decide the same everywhere;
- `model.stop_training = True` on any rank (a callback) stops every rank after the same
  step: the request rides the next step's agreement, and `stop_training` reads True
  once the ranks agreed (at the latest at the epoch's end);
- preemption: SIGTERM (or SIGUSR2, kvcollrun's relay of it) during fit stops every rank
  after the same step; training ends as usual (kv.callbacks.Checkpoint writes its
  checkpoint) and fit returns its History with `history.preempted = True`;
- the progress bar prints on rank 0 only; TensorBoard, CSVLogger, ModelCheckpoint,
  BackupAndRestore and RemoteMonitor (and their subclasses) run on rank 0 only;
- SSP/ASP: each rank steps at its own pace; the epoch's end is a sync point (every
  update applied everywhere, the same dense model on every rank, global logs).

A user's `compute_loss`, `call` and `add_loss` work as in Keras; `test_step` and
`predict_step` overrides run inside kvcoll's steps (the rows are there while they run);
a `train_step` override cannot (kvcoll applies the dense gradients after summing them
over ranks, and the rows' on their owners) and is refused with the reason.
"""

from __future__ import annotations

import signal
import threading
import warnings
import weakref

import numpy as np
import tensorflow as tf

from .. import runtime
from ..errors import InvalidArgumentError
from ..step import END, IDLE, DataFailure, Loop
from . import _compat, feed
from ._compat import keras
from .engine import engine_of, find_engine
from .feed import split_validation, with_class_weight

__all__ = ["Model", "distribute", "is_distributed_model"]

_RANK_ZERO_ONLY = tuple(getattr(keras.callbacks, n) for n in (
    "TensorBoard", "CSVLogger", "ModelCheckpoint", "BackupAndRestore", "RemoteMonitor")
    if hasattr(keras.callbacks, n))


class _Run:
    """What one model's step functions keep between calls: whether the next call begins
    a new fit/evaluate/predict (the layout agreement), the agreed targets, the epoch's
    length when known (SSP's sync point), and whether the pass has ended."""

    def __init__(self):
        self.begin = {"train": True, "test": True, "predict": True}
        self.targets = {"train": None, "test": None}
        self.ended = {"train": False, "test": False, "predict": False}
        self.epoch_steps = None     # train: steps per epoch when every rank knows it
        self.steps = 0              # train: steps taken this epoch
        self.outputs_given = False  # predict: this call returned outputs
        # a Python iterable of batches kvcoll reads itself (Keras gets a stand-in)
        self.source = {"train": None, "test": None, "predict": None}
        self.epoch = 0              # train: the epoch in progress
        self.position = None        # train: the kvcoll data source whose position is saved
        self.resume = None          # train: a restored progress, applied at the next epoch
        self.skip = 0               # train: elements to pass over (a resume without position)
        self.first_epoch = True     # train: the next epoch is fit's first
        self.steps_given = False    # train: fit was given steps_per_epoch
        self.keras_skipped = 0      # train: steps Keras itself leaves out of this epoch
                                    # (Keras 2 starts a resumed epoch at its saved step)


_RUNS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _run(model) -> _Run:
    run = _RUNS.get(model)
    if run is None:
        run = _RUNS[model] = _Run()
    return run


class _Kvcoll:
    """The step functions and loop wrappers an opted-in model has (see the module
    docstring); mixed into kv.Model and into the class kv.distribute gives a model."""

    _kvcoll_model = True

    # -- stop_training: a request on any rank, agreed before it reads True ---------------

    @property
    def stop_training(self):
        return bool(self.__dict__.get("_kv_stop_agreed", False))

    @stop_training.setter
    def stop_training(self, value):
        self.__dict__["_kv_stop_asked"] = bool(value)
        if not value:
            self.__dict__["_kv_stop_agreed"] = False

    # -- the step functions Keras calls ---------------------------------------------------

    def make_train_function(self, force=False):
        if getattr(self, "train_function", None) is not None and not force:
            return self.train_function
        custom = [n for n in ("train_step",) if _overrides(self, n)]
        if custom:
            raise InvalidArgumentError(
                f"{type(self).__name__} overrides train_step: kvcoll runs its own training "
                "step (the rows are pulled before the model runs, the dense gradients are "
                "summed over ranks before the optimizer applies them, the rows' are applied "
                "on their owners), so a train_step that applies gradients itself cannot "
                "run; override compute_loss (or use call/add_loss) instead")
        model = self

        def train_function(iterator):
            return _steps(model, iterator, _train_step)

        self.train_function = train_function
        return train_function

    def make_test_function(self, force=False):
        if getattr(self, "test_function", None) is not None and not force:
            return self.test_function
        model = self

        def test_function(iterator):
            return _steps(model, iterator, _test_step)

        self.test_function = test_function
        return test_function

    def make_predict_function(self, force=False):
        if getattr(self, "predict_function", None) is not None and not force:
            return self.predict_function
        model = self

        def predict_function(data):
            return _predict(model, data)

        self.predict_function = predict_function
        return predict_function

    # -- the loops, around Keras' own --------------------------------------------------------

    def compile(self, *args, **kwargs):
        out = super().compile(*args, **kwargs)
        eng = find_engine(self)
        if eng is not None:
            eng.recompiled()
        for name in ("train_function", "test_function", "predict_function"):
            if hasattr(self, name):
                setattr(self, name, None)
        return out

    def reset_metrics(self):
        super().reset_metrics()
        if _has_engine(self):
            engine_of(self).reset_metrics()

    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None,
            validation_split=0.0, validation_data=None, shuffle=True, class_weight=None,
            sample_weight=None, initial_epoch=0, steps_per_epoch=None, **kwargs):
        eng = engine_of(self)
        run = _run(self)
        run.begin["train"], run.ended["train"] = True, False
        run.first_epoch, run.steps_given = True, steps_per_epoch is not None
        val = {"data": validation_data, "split": validation_split}

        def local():
            nonlocal x, y, sample_weight, class_weight
            _check_compiled(self, "fit")
            if class_weight and not feed.is_source(x):   # arrays: weights checked here
                x, y, sample_weight = with_class_weight((x, y, sample_weight), class_weight)
                class_weight = None
            if val["split"] and val["data"] is None and not feed.is_source(x):
                (x, y, sample_weight), val["data"] = split_validation(
                    x, y, sample_weight, val["split"])
                val["split"] = 0.0
            return feed.local_data(run, "train", x, y, sample_weight, batch_size, class_weight,
                               steps_per_epoch)

        run.position = _position_source(x)
        mine, known = feed.agreed(eng, "fit:batches", local)
        if not eng.synchronous:   # SSP/ASP: each rank runs its own steps to its epoch's end
            known = mine
        x, y, sample_weight, class_weight, steps_per_epoch = feed.keras_data(
            run, "train", mine, known, x, y, sample_weight, batch_size, shuffle,
            class_weight, steps_per_epoch)
        validation_data, validation_split = val["data"], val["split"]
        if validation_data is not None:
            vbatch, vsteps = kwargs.get("validation_batch_size") or batch_size, \
                kwargs.get("validation_steps")
            vx, vy, vsw = _unpack_validation(validation_data)
            vmine, vknown = feed.agreed(eng, "fit:validation_batches", lambda: feed.local_data(
                run, "test", vx, vy, vsw, vbatch, None, vsteps))
            vx, vy, vsw, _, vsteps = feed.keras_data(run, "test", vmine, vknown, vx, vy, vsw,
                                                 vbatch, False, None, vsteps)
            validation_data = tuple(p for p in (vx, vy, vsw) if p is not None) \
                if vy is not None else vx
            if vsteps is not None or "validation_steps" in kwargs:
                kwargs["validation_steps"] = vsteps
        run.epoch_steps = known
        if run.resume is not None:   # kv.restore before fit: continue at the saved epoch
            initial_epoch = max(initial_epoch, _resumed_epoch(run.resume))
            _compat.set_initial_counters(self, _resumed_epoch(run.resume),
                                         _resumed_step(run.resume))
        callbacks = _rank_callbacks(eng, callbacks)
        callbacks.append(_EpochHooks())
        eng.fit_callbacks = callbacks   # (kvcoll.elastic calls their on_world_change)
        verbose = _verbose(eng, verbose)
        preempt = _Preemption(self)
        with _joined_on_failure(eng, run, "train"), preempt, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*ran out of data.*")
            warnings.filterwarnings("ignore", message=".*shuffle=True. was passed.*")
            history = super().fit(
                x, y, batch_size=batch_size, epochs=epochs, verbose=verbose,
                callbacks=callbacks, validation_split=validation_split,
                validation_data=validation_data, shuffle=shuffle, class_weight=class_weight,
                sample_weight=sample_weight, initial_epoch=initial_epoch,
                steps_per_epoch=steps_per_epoch, **kwargs)
        run.source["train"] = run.source["test"] = None
        _compat.set_initial_counters(self, None, None)
        preempted = bool(eng.comm.allreduce(np.array([int(preempt.signalled)], np.int64),
                                            op="fit:preempted", mpi_op="max")[0])
        if history is not None:
            history.preempted = preempted
        if preempted:
            runtime.note_preempted()
            if eng.comm.rank == 0:
                print(f"kvcoll: preempted (SIGTERM): every rank stopped after step "
                      f"{eng.step}; training ended as usual (a kv.callbacks.Checkpoint "
                      "wrote its checkpoint); fit returned with history.preempted = True",
                      flush=True)
        return history

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None,
                 steps=None, callbacks=None, return_dict=False, **kwargs):
        eng = engine_of(self)
        eng.sync()
        run = _run(self)
        run.begin["test"], run.ended["test"] = True, False
        cached = kwargs.get("_use_cached_eval_dataset")
        if cached:                   # fit's validation: its data was agreed by fit
            if run.source["test"] is not None:
                run.source["test"].new_pass()
        else:
            def local():
                _check_compiled(self, "evaluate")
                return feed.local_data(run, "test", x, y, sample_weight, batch_size, None, steps)

            mine, shared = feed.agreed(eng, "evaluate:batches", local)
            x, y, sample_weight, _, steps = feed.keras_data(
                run, "test", mine, shared, x, y, sample_weight, batch_size, False, None, steps)
        if not isinstance(callbacks, keras.callbacks.CallbackList):
            callbacks = _rank_callbacks(eng, callbacks)
            verbose = _verbose(eng, verbose)
        with _joined_on_failure(eng, run, "test"):
            out = super().evaluate(x, y, batch_size=batch_size, verbose=verbose,
                                   sample_weight=sample_weight, steps=steps,
                                   callbacks=callbacks, return_dict=return_dict, **kwargs)
        if not cached:
            run.source["test"] = None
        return out

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None,
                **kwargs):
        eng = engine_of(self)
        eng.sync()
        run = _run(self)
        run.begin["predict"], run.ended["predict"] = True, False
        run.outputs_given = False
        out = None
        with _joined_on_failure(eng, run, "predict"):
            local = feed.local_batches(x, batch_size, steps)
            if feed.is_python_source(x):
                run.source["predict"] = feed.Source(x, steps)
                x, local = feed.stand_in(None), None
            x = feed.keras_arrays(x)
            if local != 0:   # (Keras 2 refuses data with no batch: this rank joins after)
                out = super().predict(x, batch_size=batch_size,
                                      verbose=_verbose(eng, verbose), steps=steps,
                                      callbacks=_rank_callbacks(eng, callbacks), **kwargs)
        run.source["predict"] = None
        _finish_predict(self, eng, run)
        return out if out is not None else _empty_outputs(self)

    def train_on_batch(self, x, y=None, sample_weight=None, class_weight=None, **kwargs):
        run = _run(self)
        run.begin["train"], run.ended["train"] = True, False
        run.epoch_steps, run.source["train"] = None, None
        if class_weight is not None:
            x, y, sample_weight = with_class_weight((x, y, sample_weight), class_weight)
        return super().train_on_batch(x, y, sample_weight=sample_weight, **kwargs)

    def test_on_batch(self, x, y=None, sample_weight=None, **kwargs):
        engine_of(self).sync()
        run = _run(self)
        run.begin["test"], run.ended["test"], run.source["test"] = True, False, None
        return super().test_on_batch(x, y, sample_weight=sample_weight, **kwargs)

    def predict_on_batch(self, x):
        eng = engine_of(self)
        eng.sync()
        run = _run(self)
        run.begin["predict"], run.ended["predict"] = True, False
        run.outputs_given, run.source["predict"] = False, None
        out = super().predict_on_batch(x)
        _finish_predict(self, eng, run)
        return out


class Model(_Kvcoll, keras.Model):
    """A keras.Model whose fit, evaluate and predict run kvcoll's step loop: build it as
    `kv.Model(inputs, outputs)` (Keras' functional arguments: inputs, outputs, name),
    or inherit from it in a subclassed model. Everything else is Keras'.

    What fit/evaluate/predict then do: each rank passes its own part of the data (its
    batch_size); a rank whose data ran out keeps taking part with no samples until
    every rank's has, then the epoch ends everywhere at the same step; the logs and
    metrics are global (over every rank's samples), so EarlyStopping and
    ReduceLROnPlateau decide the same everywhere; `stop_training` on any rank stops
    every rank after the same step; SIGTERM (or kvcollrun's SIGUSR2) stops every rank
    after the same step and fit returns with `history.preempted = True`; the progress
    bar prints on rank 0, and TensorBoard, CSVLogger, ModelCheckpoint, BackupAndRestore
    and RemoteMonitor run on rank 0 only.

    Raises (from fit/evaluate/predict, on every rank at the same step, nothing applied)
    InvalidArgumentError for bad batches (float ids, an unknown feature, layouts that
    differ between ranks) and for a train_step override (kvcoll applies the gradients
    itself: override compute_loss instead), NonFiniteError for a NaN/Inf loss or
    input, CommTimeoutError when a rank does not take part within the step deadline."""

    def __new__(cls, *args, **kwargs):
        # kv.Model(inputs, outputs) is a functional model, as keras.Model(inputs,
        # outputs) is: made here as a class of its own, so that Keras never rewrites
        # kv.Model's bases (its functional "injection"), which would break subclassing it
        if cls is Model and _functional_arguments(args, kwargs):
            return super().__new__(_FunctionalModel, *args, **kwargs)
        return super().__new__(cls, *args, **kwargs)


class _FunctionalModel(Model, _compat.functional_class()):
    """What kv.Model(inputs, outputs) makes: a functional model that runs kvcoll's
    steps (saved as kvcoll>Model, loaded as one)."""


_FunctionalModel.__name__ = _FunctionalModel.__qualname__ = "Model"
_FunctionalModel = keras.saving.register_keras_serializable(
    package="kvcoll", name="Model")(_FunctionalModel)


def _functional_arguments(args, kwargs) -> bool:
    """Keras' rule for a functional model's constructor: (inputs, outputs)."""
    return len(args) == 2 or (len(args) == 1 and "outputs" in kwargs) or \
        ("inputs" in kwargs and "outputs" in kwargs)

_CLASSES: dict = {}


def distribute(model):
    """Opt an existing model in (a Sequential, a loaded model, a functional model built
    as keras.Model): returns the same model, whose class is now a subclass of its own
    class with kvcoll's step functions (this instance only; Keras' classes are not
    touched). Saving records the model's own class, so a reloaded model is passed
    through kv.distribute again (or built as kv.Model). Its fit, evaluate and predict
    then behave as kv.Model's. Calling it twice returns the model unchanged.

    model: a keras.Model. Raises InvalidArgumentError for anything else."""
    if not isinstance(model, keras.Model):
        raise InvalidArgumentError(
            f"kv.distribute takes a {keras.__name__}.Model, got {type(model).__name__}")
    if is_distributed_model(model):
        return model
    base = type(model)
    cls = _CLASSES.get(base)
    if cls is None:
        cls = type(base.__name__, (_Kvcoll, base), {"__module__": base.__module__,
                                                    "__qualname__": base.__qualname__})
        _CLASSES[base] = cls
    model.__class__ = cls
    return model


def is_distributed_model(model) -> bool:
    """Whether the model runs kvcoll's steps (built as kv.Model or kv.distribute'd)."""
    return bool(getattr(type(model), "_kvcoll_model", False))


# -- one step ------------------------------------------------------------------------------

def _steps(model, iterator, one):
    """Keras' step function: steps_per_execution steps; StopIteration once the pass has
    ended on every rank."""
    kind = "train" if one is _train_step else "test"
    source = _run(model).source[kind]
    if source is not None:     # Keras' iterator is a stand-in that only counts steps
        iterator = source.iterator()
    logs = None
    for _ in range(_compat.steps_per_execution(model)):
        out = one(model, iterator)
        if out is None:
            break
        logs = out
    if logs is None:
        raise StopIteration
    return logs


def _begin(model, kind: str, iterator, x_only: bool = False):
    """The first element of a pass, after the layout agreement (a collective) on the
    pass's first call; None for later calls."""
    run = _run(model)
    eng = engine_of(model)
    element = Loop.read(iterator)
    first = None if element is END or isinstance(element, DataFailure) else element
    error = element.exc if isinstance(element, DataFailure) else None
    targets = eng.begin(first, error, x_only=x_only)
    run.begin[kind] = False
    run.ended[kind] = targets is None
    if kind in run.targets:
        run.targets[kind] = targets
    return element


def _train_step(model, iterator):
    run = _run(model)
    if run.begin["train"]:
        element = _begin(model, "train", iterator)
    elif run.skip:
        element = Loop.read(iterator)
    else:
        element = None
    if run.ended["train"]:
        return None
    while run.skip and element is not END:   # a resume without a data position
        run.skip -= 1
        element = Loop.read(iterator)
    eng = engine_of(model)
    loop, compute = eng.loop, eng.compute
    compute.targets = run.targets["train"]
    first = [element] if element is not None else []
    # prefetch: never stage past the last step Keras calls in an epoch of known length
    calls = None if run.epoch_steps is None else run.epoch_steps - run.keras_skipped
    stage = calls is None or run.steps + 1 < calls

    def attempt():                 # (an elastic run repeats it on the survivors)
        loop.stop_asked = bool(model.__dict__.get("_kv_stop_asked", False))
        source = run.source["train"]   # (a world change may have begun a new pass)
        it = source.iterator() if source is not None else iterator
        return loop.train_next(it, stage, first.pop() if first else None)
    step = attempt if eng.elastic is None else lambda: eng.elastic.run(attempt)
    out = step()
    while out is IDLE:             # every rank waits for data: keep the ranks in step
        if loop.synchronous:       # BSP: every rank is at the same idle round
            for cb in eng.fit_callbacks:
                if hasattr(cb, "on_idle"):
                    cb.on_idle()   # (kv.callbacks.Publish: the last steps reach serving)
        out = step()
    if out is None:                # every rank is out of data, or a stop was agreed
        run.ended["train"] = True
        if loop.stop_asked:
            model.__dict__["_kv_stop_agreed"] = True
        if not loop.synchronous:
            loop.finish()          # the epoch's sync point: global logs in the metrics
        return None
    run.steps += 1
    if not loop.synchronous and run.epoch_steps is not None and run.steps >= run.epoch_steps:
        run.ended["train"] = True
        return loop.finish()
    return out.logs


def _test_step(model, iterator):
    run = _run(model)
    element = _begin(model, "test", iterator) if run.begin["test"] else None
    if run.ended["test"]:
        return None
    eng = engine_of(model)
    eng.compute.targets = run.targets["test"]
    if element is None:
        element = Loop.read(iterator)
    logs = eng.loop.evaluate(element)
    if logs is None:
        run.ended["test"] = True
    return logs


def _predict(model, data):
    """Keras 3 hands predict_function a list of elements, Keras 2 an iterator."""
    run = _run(model)
    elements = list(data) if isinstance(data, (list, tuple)) else None
    if run.source["predict"] is not None:   # data from Keras is a stand-in
        data, elements = run.source["predict"].iterator(), None
    outs = []
    for i in range(len(elements) if elements is not None
                   else _compat.steps_per_execution(model)):
        if run.ended["predict"]:
            break
        if run.begin["predict"]:
            if elements is not None:
                element = elements[i]
                first = element
                engine_of(model).begin(first, None, x_only=True)
                run.begin["predict"] = False
            else:
                element = _begin(model, "predict", data, x_only=True)
        else:
            element = elements[i] if elements is not None else Loop.read(data)
        more, out = engine_of(model).loop.predict(element)
        if not more:
            run.ended["predict"] = True
            break
        outs.append(out if out is not None else _empty_outputs(model))
    if not outs:
        if run.outputs_given:
            raise StopIteration
        outs.append(_empty_outputs(model))   # Keras 2 needs one output per predict
    run.outputs_given = True
    return tf.nest.map_structure(tf.constant, _concat(outs))  # Keras converts tensors


# -- progress: what a checkpoint records of the data, and a resume --------------------

def progress_of(model) -> dict | None:
    """This rank's progress for a checkpoint: the epoch in progress, the steps it has
    committed, whether it is complete, and the position of its data source after the
    committed steps (never after a prefetched one); None for a model fit never ran."""
    run = _RUNS.get(model)
    eng = find_engine(model)
    if run is None or eng is None or eng.loop is None:
        return None
    # a stop or preemption ends the epoch early, unless it came with the data's end
    # (the loop's last step that did not happen is the one that ended the pass)
    stopped = bool(model.__dict__.get("_kv_stop_agreed", False)) and \
        not (run.ended["train"] and eng.loop.data_ended)
    complete = (run.ended["train"] and not stopped) or (run.epoch_steps is not None
                                                        and run.steps >= run.epoch_steps)
    position = None
    if run.position is not None:
        position = run.position.position_at(eng.loop.consumed)
    return {"epoch": int(run.epoch), "step": int(run.steps), "complete": bool(complete),
            "position": position}


def resume_from(model, progress, comm) -> str | None:
    """After a restore: the next fit of `model` continues where the saved run stood
    (its epoch and step, its data source's position), once. progress: every saving
    rank's (RestoreInfo.progress). Returns what it will do, for the log (None: no
    progress was saved)."""
    if not progress or all(p is None for p in progress):
        return None
    from ..data.position import for_rank

    mine = progress[comm.rank] if len(progress) == comm.size else progress[0]
    positions = [p.get("position") for p in progress]
    position = None
    if all(p is not None for p in positions):
        position = for_rank(positions, comm.rank, comm.size)
    run = _run(model)
    run.resume = dict(mine, position=position)
    epoch, step = _resumed_epoch(run.resume), _resumed_step(run.resume)
    _compat.set_initial_counters(model, epoch, step)
    return f"epoch {epoch + 1}, step {step}" + ("" if position is not None or not step else
                                              " (no data position: the epoch's first "
                                              f"{step} batches are passed over)")


def _resumed_epoch(progress) -> int:
    return int(progress["epoch"]) + (1 if progress["complete"] else 0)


def _resumed_step(progress) -> int:
    return 0 if progress["complete"] else int(progress["step"])


def _position_source(x):
    """The kvcoll data source behind fit's x, whose position checkpoints record (None:
    not one, or transformed so that its k-th batch is not the k-th step's)."""
    from ..data.position import PositionError, source_of

    try:
        return source_of(x)
    except PositionError as exc:
        warnings.warn(f"kvcoll: checkpoints will not record where the data stood: {exc}",
                      stacklevel=4)
        return None


def _resume_data(model, run, epoch: int) -> None:
    """At the first epoch after a resume: the data source continues at its saved
    position (or, with none, the epoch's first steps are passed over); the log says
    how short this epoch is."""
    resume, run.resume = run.resume, None
    step = _resumed_step(resume)
    run.keras_skipped = step if _compat.KERAS_MAJOR < 3 else 0
    if resume.get("position") is not None and run.position is not None:
        run.position.resume(resume["position"])
        data = run.source["train"].data if run.source["train"] is not None else None
        if data is not run.position and hasattr(data, "restart"):
            data.restart()   # a one-pass wrapper (fit_batches()) began its pass before
    elif step:
        run.skip = step
    eng = engine_of(model)
    if eng.comm.rank == 0 and step:
        total = run.epoch_steps
        left = f" of {total}: {total - step} left" if total else ""
        print(f"kvcoll: resumed in epoch {epoch + 1} after step {step}{left}; this epoch "
              "is short", flush=True)


def _check_compiled(model, what: str) -> None:
    if not _compat.is_compiled(model) or (what == "fit" and model.optimizer is None):
        raise InvalidArgumentError(
            f"call model.compile(optimizer=kv.DistributedOptimizer(...), loss=...) before "
            f"model.{what}()")


class _joined_on_failure:
    """A failure on this rank before its first step of a pass (Keras' own set-up, an
    argument kvcoll checks) while the other ranks wait in the pass's first collective
    (the layout agreement): this rank joins it with its error, so every rank raises it."""

    def __init__(self, eng, run, kind):
        self.eng, self.run, self.kind = eng, run, kind

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is not None and isinstance(exc, Exception) and self.run.begin[self.kind]:
            self.run.begin[self.kind] = False
            self.eng.begin(None, exc, x_only=self.kind == "predict")
        return False


def _finish_predict(model, eng, run) -> None:
    """After Keras' predict loop: join the steps of ranks with more data (a rank that
    never stepped joins the layout agreement first)."""
    if run.begin["predict"]:
        run.begin["predict"] = False
        eng.begin(None, x_only=True)
    while eng.loop is not None and not run.ended["predict"]:
        more, _ = eng.loop.predict(END)
        if not more:
            run.ended["predict"] = True


# -- callbacks and the epoch's end -------------------------------------------------------

class _EpochHooks(keras.callbacks.Callback):
    """kvcoll's own callback, last in fit's list: a new pass at every epoch's start;
    at its end every rank agrees on stopping (what EarlyStopping and the like set on
    their rank, and a preemption)."""

    def on_epoch_begin(self, epoch, logs=None):
        run = _run(self.model)
        ran_out, run.ended["train"] = run.ended["train"], False
        first, run.first_epoch = run.first_epoch, False
        run.epoch, run.steps, run.keras_skipped = epoch, 0, 0
        if run.resume is not None:
            _resume_data(self.model, run, epoch)
        src = run.source["train"]
        if src is not None:
            src.new_pass()
        # The data's pass goes on across epochs when Keras keeps its iterator (the user
        # gave steps_per_epoch and the data did not run out) or kvcoll reads a one-shot
        # iterator: then `consumed` goes on counting too, so that a checkpoint's data
        # position is the one after every step of the pass, not of the epoch alone.
        goes_on = src._one_shot if src is not None else run.steps_given
        eng = engine_of(self.model)
        if eng.loop is not None and (first or ran_out or not goes_on):
            eng.loop.new_pass()

    def on_world_change(self, old_size, new_size):
        """An elastic run lost ranks: a kvcoll data source of global batches continues on
        this rank's new part, from the first batch not yet trained on."""
        from ..elastic import replan_source
        source = _run(self.model).source["train"]
        eng = engine_of(self.model)
        if source is not None and replan_source(source.data, eng.comm.rank, eng.comm.size,
                                                eng.loop.consumed):
            source.new_pass()
            eng.loop.new_pass()   # positions count from the replanned source's resume

    def on_epoch_end(self, epoch, logs=None):
        model = self.model
        asked = bool(model.__dict__.get("_kv_stop_asked", False))
        eng = engine_of(model)
        agreed = bool(eng.comm.allreduce(np.array([int(asked)], np.int64), op="fit:stop",
                                         mpi_op="max")[0])
        model.__dict__["_kv_stop_agreed"] = agreed


def _rank_callbacks(eng, callbacks):
    """The user's callbacks for this rank: the file-writing ones on rank 0 only (a
    CallbackList the caller built is taken as it is)."""
    if isinstance(callbacks, keras.callbacks.CallbackList):
        return callbacks
    callbacks = list(callbacks or [])
    if eng.comm.rank == 0:
        for cb in callbacks:
            if isinstance(cb, keras.callbacks.ModelCheckpoint):
                warnings.warn("ModelCheckpoint saves the Keras model, not kvcoll's tables; "
                              "use kv.callbacks.Checkpoint to checkpoint a model with "
                              "kv.Embedding layers", stacklevel=3)
        return callbacks
    return [cb for cb in callbacks if not isinstance(cb, _RANK_ZERO_ONLY)]


def _verbose(eng, verbose):
    if eng.comm.rank != 0:
        return 0
    return verbose


class _Preemption:
    """SIGTERM (or SIGUSR2, kvcollrun's relay of it through mpirun) while fit runs, in
    the main thread: noted, not fatal; it asks to stop, which every rank agrees on after
    the same step. The previous handlers come back when fit returns."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR2)

    def __init__(self, model):
        self.model = model
        self.signalled = False
        self._prev = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._prev = {s: signal.signal(s, self._on_signal) for s in self.SIGNALS}
        if runtime.preempted():   # it came before fit (a restore, kv.init): stop at once
            self._on_signal(None, None)
        return self

    def _on_signal(self, signum, frame):
        self.signalled = True
        self.model.__dict__["_kv_stop_asked"] = True
        runtime.note_preempted()

    def __exit__(self, *exc):
        for s, prev in self._prev.items():
            signal.signal(s, prev)
        return False


# -- helpers ------------------------------------------------------------------------------

def _has_engine(model) -> bool:
    return find_engine(model) is not None


def _overrides(model, name: str) -> bool:
    own = getattr(type(model), name, None)
    return own is not None and own is not getattr(keras.Model, name) and \
        getattr(own, "__module__", "").split(".")[0] not in ("keras", "tf_keras")


def _unpack_validation(data):
    if isinstance(data, tuple):
        if len(data) in (2, 3):
            return tuple(data) + (None,) * (3 - len(data))
        raise InvalidArgumentError("validation_data must be (x, y), (x, y, sample_weight) "
                                   "or a dataset")
    return data, None, None


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
    if outs:
        return [np.zeros((0,) + tuple(d or 0 for d in o.shape[1:]), np.float32) for o in outs]
    return np.zeros((0,), np.float32)
