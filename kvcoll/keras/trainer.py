"""kv.Trainer: a step loop of your own, on the same engine as model.fit.

    trainer = kv.Trainer(model, keras.losses.BinaryCrossentropy(from_logits=True),
                         kv.DistributedOptimizer(keras.optimizers.Adam(1e-3),
                                                 sparse=kv.optimizers.Adagrad(0.05)))
    for features, labels in my_batches:            # this rank's slice of each step
        loss = trainer.train_step(features, labels)
    trainer.finish()                               # uneven data: keep the others company

It compiles the model with the loss and optimizer and runs kvcoll's step loop
(kvcoll.step) one step at a time: the same exchange, the same agreement on bad batches,
the same results as fit. BSP: train_step returns the global mean loss and every rank
must call it (or be in finish()); SSP/ASP: each rank steps on its own and gets its own
loss, and finish() is the collective that ends the run.
"""

from __future__ import annotations

import time

import numpy as np

from ..errors import InvalidArgumentError
from ..step import END, IDLE, DataFailure, Loop, StepResult
from .engine import Engine, replace_engine

__all__ = ["Trainer"]


class Trainer:
    """Runs training and evaluation of a Keras model with kv.Embedding layers, step by
    step. loss: a Keras loss (or a callable (labels, outputs) -> per-sample loss);
    optimizer: kv.DistributedOptimizer(...) (a plain Keras optimizer gives the rows the
    default row optimizer, and says so); step_mode: "bsp", "ssp", "asp" or a
    kv.StepMode (default: the run's --step-mode); staleness: SSP's bound. model: any
    keras.Model with kv.Embedding layers (no kv.Model needed). jit: compile the step
    with tf.function; xla: with XLA (default: the run's --xla); comm: kvcoll's
    communicator (default the run's); prefetch: BSP, pipelined steps in
    `train_next(iterator)`: True/"on", False/"off", or "semi" (the next batch's rows
    fetched while a step computes, one step stale; docs/performance.md) (default: the
    run's --pipeline); wire_dtype: "fp32", "fp16"
    or "bf16", the rows and row gradients on the wire (default: the run's --wire-dtype;
    docs/wire-dtype.md).

    `train_step(features, labels)` returns the step's global mean loss; `finish()`
    keeps a rank whose data ended in step with the others until every rank's has;
    `evaluate`, `predict` (unknown ids read zeros, no table changes) and `evict()`
    follow. A Trainer is what kv.save, kv.restore and kv.export take, as a model.

    Raises InvalidArgumentError for a bad step mode or optimizer and (from its steps,
    on every rank at once, nothing applied) for bad batches; NonFiniteError for a
    NaN/Inf loss or input; CommTimeoutError when a rank does not take part in time."""

    def __init__(self, model, loss, optimizer, *, jit: bool = True, comm=None, step_mode=None,
                 staleness: int | None = None, prefetch: bool | str | None = None,
                 xla: bool | None = None, wire_dtype: str | None = None):
        model.compile(optimizer=optimizer, loss=loss)
        self.engine = Engine(model, comm=comm, step_mode=step_mode, staleness=staleness,
                             jit=jit, prefetch=prefetch, xla=xla, wire_dtype=wire_dtype)
        replace_engine(model, self.engine)
        self.model = model
        self.opt = model.optimizer
        self.comm = self.engine.comm
        self.step_mode = self.engine.mode
        self._began = False
        if getattr(model, "inputs", None):  # a functional model: its tables exist at once
            self.engine.setup_from_model()

    # -- what the engine knows ------------------------------------------------------------

    @property
    def step(self) -> int:
        return self.engine.step

    @step.setter
    def step(self, value: int) -> None:
        self.engine.set_step(value)

    @property
    def tables(self) -> dict:
        return self.engine.tables or {}

    @property
    def features(self) -> dict:
        return self.engine.features

    @property
    def timings(self) -> dict:
        return self.engine.timings

    @property
    def local_steps(self) -> int:
        return self.engine.local_steps

    @property
    def staleness_observed(self) -> int:
        """The most steps any data this rank read was behind (0 in BSP)."""
        return getattr(self._loop().ex, "staleness_observed", 0)

    @property
    def max_lead(self) -> int:
        """The most steps this rank ran ahead of the slowest rank it knew of (0 in BSP)."""
        return getattr(self._loop().ex, "max_lead", 0)

    def _loop(self):
        if self.engine.loop is None:
            raise InvalidArgumentError("the trainer has not stepped yet: call train_step first")
        return self.engine.loop

    # -- steps ------------------------------------------------------------------------------

    def _begin(self, element, x_only=False) -> None:
        if not self._began or x_only:
            first = None if element is END else element
            self.engine.begin(first, x_only=x_only)
            self._began = self._began or not x_only

    def train_step(self, features: dict, labels) -> float:
        """One step on this rank's slice of the global batch. BSP: returns the global
        mean loss; every rank must call it (or be inside finish()). SSP/ASP: returns this
        rank's mean loss; ranks step independently."""
        element = (features, labels)
        self._begin(element)
        out = self.engine.loop.train(element)
        return out.loss if isinstance(out, StepResult) else float("nan")

    def train_next(self, batches) -> float | None:
        """One step on the next (features, labels) of the iterator `batches` (read here;
        a rank whose data ran out still joins the step). With prefetch (BSP), the batch
        after it is read, prepared, routed and its ids exchanged while this step
        computes: the same results, steps overlapped. Returns the loss as train_step
        does; None once every rank's data has run out (or a rank asked to stop).

            it = iter(my_batches)
            while (loss := trainer.train_next(it)) is not None:
                ...
        """
        first = None
        if not self._began:      # the first batch: the layout agreement (a collective)
            first = Loop.read(batches)
            err = first.exc if isinstance(first, DataFailure) else None
            self.engine.begin(None if first is END or err is not None else first, err)
            self._began = True
        loop = self.engine.loop
        if loop is None:         # no rank had data
            return None
        out = loop.train_next(batches, element=first)
        while out is IDLE:
            out = loop.train_next(batches)
        return out.loss if isinstance(out, StepResult) else None

    def finish(self) -> int:
        """This rank's data has run out: keeps answering the other ranks' steps (BSP)
        or waits for every rank (SSP/ASP) until everyone is done; afterwards every update
        is applied and (SSP/ASP) every rank holds the same dense model. Returns the
        steps this rank served with no data of its own (BSP)."""
        self._begin(END)
        before = self.engine.step
        self.engine.loop.finish()
        return self.engine.step - before if self.engine.synchronous else 0

    def predict(self, features: dict) -> np.ndarray:
        """Model outputs for this rank's samples; a collective (every rank calls it,
        possibly with zero samples). Unknown ids read zeros; tables are unchanged."""
        self.engine.sync()
        self._begin(features, x_only=True)
        _, out = self.engine.loop.predict(features)
        return out

    def table_stats(self) -> dict:
        """Per table: rows and bytes summed over all ranks (a collective)."""
        tables = self.tables
        local = np.array([[len(t), t.stats().bytes] for t in tables.values()], np.int64)
        total = self.comm.allreduce(local.reshape(-1), op="table_stats").reshape(-1, 2)
        return {n: {"rows": int(r), "bytes": int(b)} for n, (r, b) in zip(tables, total)}

    def evict(self, step: int | None = None, tables=None) -> float:
        """Apply the eviction policy of every table (or the named `tables`) to this rank's
        shards as of `step` (default: now). Local, not a collective. Returns the seconds
        it took: the pause it adds to training (stagger the tables over steps)."""
        return evict(self.engine, step, tables)

    def close(self) -> None:
        self.engine.close()


def evict(engine, step: int | None = None, tables=None) -> float:
    """Every table's (or the named tables') eviction policy on this rank's shards as of
    `step` (default: the engine's). Returns the seconds it took."""
    step = engine.step if step is None else int(step)
    t0 = time.perf_counter()
    for name in (engine.tables if tables is None else tables):
        engine.tables[name].evict(step)
    return time.perf_counter() - t0
