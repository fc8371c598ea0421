"""The one step loop: pull -> compute -> push -> commit, in every step mode, with no
TensorFlow in it.

A `Loop` runs steps over an exchange (kvcoll.exchange: BSP, SSP or ASP) and a
`Compute`, the model's side of a step that the Keras package supplies (the compiled
forward and backward, the dense optimizer's apply, the metrics). One training step:

  1. this rank's data element is prepared (checked, its ids normalised) by the compute;
     reading or preparing it may fail: that is this rank's vote, not an exception yet;
  2. pull: the exchange carries every rank's vote (an `Agreement`: samples, out of data,
     a bad batch, a stop) with the ids; the step happens only if every rank agrees, so a
     bad batch raises the same error on every rank before anything changed;
  3. compute: forward and backward on the pulled rows (a rank with no samples computes
     nothing and pushes zeros);
  4. push: row gradients to their owners; the dense gradient, the loss, the outcome codes
     (a NaN/Inf, a failure) and the metrics' state summed over ranks (BSP);
  5. commit: if every rank's compute succeeded, the owners apply the rows and the compute
     applies the dense update; otherwise the step is abandoned on every rank alike and
     every table, optimizer slot, metric and counter is as before it.

Three seams for what changes the loop:
- `abandon()`: give up the step in flight (its exchange's abandon and the metric state
  untouched), as a lost peer needs;
- `replan(comm)`: continue on a new communicator (a world that changed size);
- prefetch (`prefetch=True`, BSP): a pipeline. While this step's dense compute runs
  (TensorFlow releases the GIL), a helper thread reads the next element, prepares it,
  plans it (unique + route, C) and exchanges its ids and its vote, on a communicator of
  its own (a dup: its collectives never interleave with the step's); its rows are
  looked up only after this step's update, so results are those of the unpipelined
  loop. The helper is joined before the step returns, so nothing runs between steps
  (callbacks, checkpoints see a quiet loop). The data position a checkpoint records is
  `consumed`: elements whose step committed (and the empty ones read while every rank
  waited for data, which move no position), never the prefetched one. A stop asked
  after the next step's vote was sent rides that step's push allreduce: the step is
  abandoned on every rank (nothing applied) and the loop stops, as if the vote had
  carried it. `train_next(it, stage=False)` stages nothing: for the last step of a pass
  of known length, so no collective is posted for a step that will not be called.

`END` marks a rank whose data ran out: in BSP it keeps joining the others' steps with no
samples until every rank is out (then the step returns None on every rank at the same
step); in SSP/ASP a rank decides alone and `finish()` is the epoch's sync point.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Protocol

import numpy as np

from . import errors
from .exchange import FAILED, NONFINITE, OK, Agreement
from .exchange.kernels import beside_compute

__all__ = ["Loop", "Compute", "Grads", "StepResult", "END", "IDLE", "DataFailure"]


class _Marker:
    def __init__(self, name: str):
        self._name = name

    def __repr__(self) -> str:
        return self._name


END = _Marker("END")     # this rank's data has run out
IDLE = _Marker("IDLE")   # no rank had samples, some rank's data goes on: try again


class DataFailure:
    """An element whose reading raised `exc`: this rank's vote says its batch is bad."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException):
        self.exc = exc


@dataclasses.dataclass
class Grads:
    """What a training compute gives back (numpy): the loss weighted by this rank's
    share, the flat dense gradient (None: no dense parameters), each row group's
    gradient, the metrics' state after the batch, and whether all of it is finite."""

    loss: float
    dense: np.ndarray | None
    rows: dict
    state: np.ndarray
    finite: bool = True


@dataclasses.dataclass
class StepResult:
    """A training step's loss (BSP: over the global batch; SSP/ASP: this rank's) and the
    logs callbacks see."""

    loss: float
    logs: dict


class Compute(Protocol):
    """The model's side of a step (kvcoll.keras supplies it; tests use a numpy one).

    n_dense: floats of the dense parameters (0: none); dense_slots: per-parameter
    optimizer state vectors SSP/ASP's slices keep (Adam 2, Adagrad 1, SGD 0). Metric
    states are float32 vectors; `state()` is this rank's as of its last committed step.
    """

    n_dense: int
    dense_slots: int

    def prepare(self, element, x_only: bool = False) -> Any:
        """This rank's element checked and normalised: an object with `.n` samples.
        Raises on bad data (the loop turns that into this rank's vote)."""

    def ids(self, batch) -> dict:
        """Every table's ids of the batch (int64), empty arrays for None."""

    def train(self, batch, pull, weight: float) -> Grads:
        """Forward and backward on the pulled rows; the loss weighted by `weight`."""

    def zero_grads(self, pull) -> Grads:
        """What a rank with no samples pushes: zeros, and its state unchanged."""

    def evaluate(self, batch, pull) -> np.ndarray:
        """The metric state after evaluating the batch on the pulled rows."""

    def predict(self, batch, pull) -> Any:
        """The model's outputs for the batch (numpy)."""

    def state(self) -> np.ndarray:
        """This rank's metric state (as of its last committed step)."""

    def set_state(self, state: np.ndarray) -> None:
        """Make `state` this rank's metric state."""

    def apply(self, dense_sum: np.ndarray | None, state: np.ndarray, step: int) -> dict:
        """Commit a step: apply the summed dense gradient (None: nothing to apply here)
        and return the logs of metric state `state`."""

    def logs(self, state: np.ndarray) -> dict:
        """The logs of metric state `state`."""

    def rates(self, step: int) -> tuple[dict | None, float | None]:
        """(each table's learning rate at `step` or None if unchanged, the dense one)."""

    def dense_values(self) -> tuple[np.ndarray, np.ndarray | None, int]:
        """(the flat dense parameters, their optimizer state (k, n_dense) or None, the
        optimizer's update count): SSP/ASP's slices start from it."""

    def set_dense_values(self, flat: np.ndarray, state=None, updates=None) -> None:
        """Take the flat dense parameters (and optimizer state, update count)."""

    def explain(self, batch) -> str | None:
        """Why a step's loss or gradient was not finite, if the inputs say (a NaN label
        or feature: which, and the row); None otherwise."""


class Loop:
    """kvcoll's step loop over `exchange` and `compute` (see the module docstring).

    prefetch: BSP only, prepare the next element while this step computes (train_next).
    threaded: with prefetch, in a helper thread (False: inline, after this step's pull,
    as a reference the tests compare with).
    stale_rows: with prefetch, TorchRec's semi-synchronous pipeline: the helper also
    fetches the next element's rows while this step computes, before this step's update
    is applied (so a row both steps read misses this step's update in the next one);
    the lookups and the rows' all-to-all leave the step's critical path.
    dense_allreduce: a callable summing the flat dense gradient over ranks in place of
    the exchange's allreduce (Horovod's); BSP only.
    """

    def __init__(self, exchange, compute: Compute, *, prefetch: bool = False,
                 threaded: bool = True, dense_allreduce=None, stale_rows: bool = False):
        self.ex = exchange
        self.compute = compute
        self.prefetch = bool(prefetch) and exchange.synchronous
        self.stale_rows = bool(stale_rows) and self.prefetch
        self.threaded = bool(threaded)
        self.dense_allreduce = dense_allreduce
        self.stop_asked = False     # carried in the next step's vote
        self.data_ended = False     # the last step that did not happen: every rank's data
                                    # had run out (with a stop asked or not)
        self.consumed = 0           # elements whose step committed, this pass
        self.local_steps = 0        # training steps with this rank's own samples
        self.last_loss = 0.0
        self.last_samples = 0
        self.timings = {"exchange": 0.0, "tables": 0.0, "compute": 0.0, "allreduce": 0.0,
                        "apply": 0.0}
        if not exchange.synchronous:
            self.timings["wait"] = 0.0
        self._dense_started = False
        self._inflight = None       # the step in flight (a Pull or a push handle)
        self._staged = None         # prefetch: the next element (a _Staged)
        self._stage_comm = None     # prefetch: the helper thread's communicator (a dup)
        self._helper = None         # prefetch: the helper thread (a _Helper)
        self._pending = None        # predict: a compute error to report at the next step
        self._current = None        # (iterator, element) of the training step in flight
        self._held = None           # (iterator, [elements]) an abandoned step held back

    # -- what the loop knows ----------------------------------------------------------------

    @property
    def step(self) -> int:
        """Steps started: BSP's global step; SSP/ASP: this rank's clock."""
        return self.ex.step

    @property
    def comm(self):
        return self.ex.comm

    @property
    def synchronous(self) -> bool:
        return self.ex.synchronous

    def new_pass(self) -> None:
        """A new pass over the data begins (an epoch): `consumed` counts from 0, and an
        element prefetched from the last pass's iterator is dropped (on every rank), and
        the elements an abandoned step held back."""
        self.consumed = 0
        self.drop_staged()
        self._current = self._held = None

    # -- reading ----------------------------------------------------------------------------

    @staticmethod
    def read(iterator):
        """The next element of `iterator`: END when it is exhausted, a DataFailure when
        reading raised (the step reports it to every rank)."""
        try:
            return next(iterator)
        except StopIteration:
            return END
        except Exception as exc:  # noqa: BLE001 - a data error is this rank's vote
            if type(exc).__name__ == "OutOfRangeError":  # a tf.data iterator's end
                return END
            return DataFailure(exc)

    def _next(self, iterator):
        """The next element of `iterator`: first those an abandoned step held back (see
        abandon), then read()'s."""
        held = self._held
        if held is not None and held[0] is iterator:
            element = held[1].pop(0)
            if not held[1]:
                self._held = None
            return element
        return self.read(iterator)

    def _prepare(self, element, x_only: bool = False):
        """(batch or None, this rank's error or None)."""
        if element is END or element is None:
            return None, None
        if isinstance(element, DataFailure):
            return None, element.exc
        try:
            return self.compute.prepare(element, x_only=x_only), None
        except Exception as exc:  # noqa: BLE001 - agreed with the other ranks first
            return None, exc

    def _vote(self, element, batch, err, stop: bool = False) -> Agreement:
        return Agreement(batch.n if batch is not None else 0, done=element is END, error=err,
                         stop=stop)

    # -- training ---------------------------------------------------------------------------

    def train_next(self, iterator, stage: bool = True, element=None):
        """One training step on the next element of `iterator` (read here, so a rank
        whose data ran out still joins the step). Returns what train() returns.

        With prefetch, the element after it is staged while this step computes, unless
        `stage` is False (every rank alike: the last step of a pass of known length).
        An element staged from another iterator is dropped first. `element`: the next
        element, already read from `iterator` (a pass's first, read for its layout)."""
        staged = self._staged
        if staged is not None and (staged.iterator is not iterator or element is not None):
            self.drop_staged()
            staged = None
        if self._held is not None and (self._held[0] is not iterator or element is not None):
            self._held = None
        self._staged = None
        if staged is not None:
            element = staged.element
            args = (staged.batch, staged.err, staged.agreement,
                    _Fetched(staged.pull) if self.stale_rows else staged.pending)
        else:
            if element is None:
                element = self._next(iterator)
            args = (*self._prepare(element), None, None)
        self._current = (iterator, element)
        out = self._train(element, *args, iterator=iterator, stage=stage)
        self._current = None    # (raised: abandon() may hold its element back for a retry)
        return out

    def train(self, element) -> StepResult | None:
        """One training step on this rank's element (END: its data has run out).

        Returns the StepResult; None when the step did not happen because every rank's
        data has run out or a rank asked to stop (BSP: on every rank at the same step;
        SSP/ASP: this rank's own data or stop); IDLE when no rank had samples but some
        rank's data goes on. Raises the agreed error when a rank's batch was bad or its
        compute failed: the same error class on every rank (BSP), nothing changed.
        An element train_next prefetched is dropped first (every rank alike)."""
        self.drop_staged()
        self._current = None
        batch, err = self._prepare(element)
        return self._train(element, batch, err, None, None)

    def _train(self, element, batch, err, agreement, pending, iterator=None, stage=True):
        ex, compute = self.ex, self.compute
        if not ex.synchronous:
            self.start_dense()      # SSP/ASP: the slices start from the compute's values
        t0 = time.perf_counter()
        if isinstance(pending, _Fetched):     # semi-synchronous: fetched ahead
            pull = pending.pull
            if pull is not None:
                ex.begin(pull)
        elif pending is not None:
            pull = ex.fetch(pending)
        else:
            agreement = self._vote(element, batch, err, self.stop_asked)
            dense = batch is not None and batch.n > 0
            pull = ex.pull(compute.ids(batch), agreement, dense=dense)
        t1 = time.perf_counter()
        if pull is None:
            if agreement.failed:
                self._raise_batch_error(agreement, err, self.step + 1,
                                        alone=not ex.synchronous)
            if agreement.stopped:
                self.stop_asked = True
            self.data_ended = agreement.all_done
            if agreement.idle and element is not END:
                self.consumed += 1   # an empty batch read while waiting: done with, like a step's
            return IDLE if agreement.idle else None
        self._inflight = pull
        if "wait" in self.timings:
            self.timings["wait"] += getattr(ex, "last_wait", 0.0)
        if self.prefetch and iterator is not None and stage:
            self._stage_next(iterator, pull.step + 1)
        t2 = time.perf_counter()
        n = batch.n if batch is not None else 0
        # a stop asked after this step's vote went out (prefetch: before the callbacks
        # of the last step ran) rides this step's allreduce: the step is given up
        stop_late = self.stop_asked and not agreement.stop
        fail = None
        if stop_late:
            n = 0
        if n:
            if pull.dense is not None:
                compute.set_dense_values(pull.dense)
            weight = n / agreement.total_samples if ex.synchronous else 1.0 / self.comm.size
            try:
                _check_rows(pull)
                grads = compute.train(batch, pull, weight)
                agreement.report(OK if grads.finite else NONFINITE)
            except Exception as exc:  # noqa: BLE001 - every rank must learn of it
                fail = exc
                agreement.report(FAILED, exc)
        if not n or fail is not None:
            grads = compute.zero_grads(pull)
        t3 = time.perf_counter()
        if self.stale_rows and self._staged is not None:
            # the next step's rows were read before this step's update: their fetch ends
            # before the push (nothing of it runs beside this step's tables)
            self._staged.join()
        row_lr, dense_lr = compute.rates(pull.step)
        by_horovod = self.dense_allreduce is not None and compute.n_dense > 0
        dense_grad = grads.dense if compute.n_dense and not by_horovod else None
        if dense_grad is None and compute.n_dense and not by_horovod and ex.synchronous:
            dense_grad = np.zeros(compute.n_dense, np.float32)
        if not ex.synchronous and not n:
            dense_grad = None
        extra = np.concatenate([np.array([grads.loss, float(stop_late)], np.float32),
                                np.asarray(grads.state, np.float32)])
        pushed = ex.push(pull, grads.rows, dense_grad, extra, agreement, lr=row_lr,
                         dense_lr=dense_lr)
        self._inflight = pushed
        t4 = time.perf_counter()
        dense_sum, total = pushed.reduced()
        if by_horovod:
            dense_sum = self.dense_allreduce(
                grads.dense if grads.dense is not None else np.zeros(compute.n_dense,
                                                                      np.float32))
        t5 = time.perf_counter()
        if ex.synchronous and total[1] > 0:     # some rank asked to stop: no step
            self.drop_staged()      # first: its rows fetched ahead were created after ours
            ex.abandon(pushed)
            self._inflight = None
            self.stop_asked = True
            self.data_ended = False
            return None
        if agreement.outcome_failed:
            self.drop_staged()      # first: its rows fetched ahead were created after ours
            ex.abandon(pushed)
            self._inflight = None
            self._raise_outcome_error(agreement, fail, batch, pull.step,
                                      alone=not ex.synchronous)
        pushed.commit()
        t6 = time.perf_counter()
        if n:
            compute.set_state(grads.state)
            self.local_steps += 1
        shown = total[2:] if ex.synchronous else np.asarray(grads.state, np.float32)
        logs = compute.apply(dense_sum if ex.synchronous else None, shown, pull.step)
        self._inflight = None
        if element is not END:
            self.consumed += 1
        t7 = time.perf_counter()
        if self._staged is not None:
            self._staged.join()    # the next element is ready (its ids are in)
        tm = self.timings
        tm["stage_wait"] = tm.get("stage_wait", 0.0) + time.perf_counter() - t7
        loss = float(total[0]) if ex.synchronous else float(grads.loss) * self.comm.size
        self.last_loss, self.last_samples = loss, n
        tm["exchange"] += (t1 - t0) + (t4 - t3) + (t6 - t5)
        tm["tables"] = getattr(ex, "table_seconds", 0.0)
        tm["compute"] += t3 - t2
        tm["allreduce"] += t5 - t4
        tm["apply"] += t7 - t6
        return StepResult(loss, logs)

    def _stage_next(self, iterator, step: int) -> None:
        """Prefetch: read and prepare the next element (for `step`) and exchange its ids
        and vote (BSP), in the helper thread while this step computes (or here, not
        threaded); its rows are fetched by the next step, after this one's update."""
        staged = _Staged(self, iterator, step, self._helper_comm() if self.threaded else None,
                         self.threaded)
        self._staged = staged
        if self.threaded:
            if self._helper is None:
                self._helper = _Helper()
            staged.start(self._helper)
        else:
            staged.run()

    def _helper_comm(self):
        """The helper thread's communicator: a dup of the step's (made here, on the main
        thread, at the same step on every rank: a dup is a collective)."""
        comm = self.comm
        if comm.size == 1 or not hasattr(comm, "dup"):
            return None                 # the exchange's own (one rank: no MPI call)
        if self._stage_comm is None or self._stage_comm[0] is not comm:
            self._free_stage_comm()
            self._stage_comm = (comm, comm.dup())
        return self._stage_comm[1]

    def _free_stage_comm(self) -> None:
        held, self._stage_comm = self._stage_comm, None
        if held is not None and hasattr(held[1], "free"):
            held[1].free()

    def quiesce(self) -> None:
        """Wait until the prefetch helper has finished its job (it then makes no MPI call
        until the next step stages again); what it staged, and any error it raised, stay
        for the step that takes them. kvcoll.elastic calls it before every agreement:
        Open MPI's ULFM agreement (5.0, ERA) can return a wrong value while another
        thread of the process runs collectives, even on another communicator (all three
        ranks voting yes agreed on no, in 17 of 3000 agreements here)."""
        staged = self._staged
        if staged is not None and staged.done is not None:
            staged.done.wait()

    def drop_staged(self) -> None:
        """Drop the prefetched element, if any: its helper is joined and its id exchange
        completed (every rank staged it, so every rank drains it alike); its errors are
        dropped with it. The element is not consumed: a checkpoint's data position
        (`consumed`) never counted it."""
        staged, self._staged = self._staged, None
        if staged is not None:
            staged.join(drain=True)

    # -- evaluation and prediction ------------------------------------------------------------

    def evaluate(self, element) -> dict | None:
        """One evaluation step (a collective in every mode): this rank's element (END:
        none left). Returns the logs over every rank's samples so far; None when every
        rank's data has run out."""
        batch, err = self._prepare(element)
        agreement = self._vote(element, batch, err)
        pull = self.ex.lookup(self.compute.ids(batch), agreement)
        if pull is None:
            if agreement.failed:
                self._raise_batch_error(agreement, err, self.step)
            return None
        state, fail = self.compute.state(), None
        if batch is not None and batch.n:
            try:
                _check_rows(pull)
                state = self.compute.evaluate(batch, pull)
            except Exception as exc:  # noqa: BLE001 - every rank must learn of it
                fail = exc
        agreement.report(FAILED if fail is not None else OK, fail)
        world = self.comm.size
        total = self.comm.allreduce(
            np.concatenate([agreement.outcome_codes(world, self.comm.rank),
                            np.asarray(state, np.float32)]), op="evaluate")
        agreement.settle_outcome(total[:world])
        if agreement.outcome_failed:
            self._raise_outcome_error(agreement, fail, batch, self.step)
        self.compute.set_state(state)
        if element is not END:
            self.consumed += 1
        return self.compute.logs(total[world:])

    def predict(self, element) -> tuple[bool, Any]:
        """One prediction step (a collective): this rank's element (END: none left).
        Returns (whether any rank had data, this rank's outputs or None). A compute that
        fails here is reported to every rank by the next step's agreement (the last one
        comes when every rank is out of data), so every rank raises it."""
        batch, err = self._prepare(element, x_only=True)
        if self._pending is not None:  # the previous step's compute failed here
            batch, err, self._pending = None, self._pending, None
        agreement = self._vote(element, batch, err)
        pull = self.ex.lookup(self.compute.ids(batch), agreement)
        if pull is None:
            if agreement.failed:
                self._raise_batch_error(agreement, err, self.step)
            return False, None
        if batch is None:
            return True, None
        try:
            _check_rows(pull)
            return True, self.compute.predict(batch, pull)
        except Exception as exc:  # noqa: BLE001 - every rank learns of it at the next step
            self._pending = exc
            return True, None

    # -- the epoch's end -----------------------------------------------------------------------

    def finish(self) -> dict | None:
        """This rank's data has run out. BSP: keep joining the other ranks' steps with no
        samples until every rank is out. SSP/ASP: wait until every rank is done, then
        every update is applied and every rank holds the same dense model; returns the
        logs over every rank's samples since the metrics were reset."""
        if self.ex.synchronous:
            while True:
                got = self.train(END)
                if got is None:
                    return None
        self.sync()
        return self.global_logs()

    def sync(self) -> None:
        """A consistent snapshot on every rank (before a save, an export, an evaluation):
        SSP/ASP wait until every rank is done and every update is applied, and every rank
        takes the same dense model; BSP is consistent between steps."""
        if not self.ex.synchronous:
            self.start_dense()
            self.ex.finish()
            self._dense_back()

    def global_logs(self) -> dict:
        """The logs over every rank's samples since the metrics were reset (a
        collective)."""
        return self.compute.logs(self.comm.allreduce(
            np.asarray(self.compute.state(), np.float32), op="metrics"))

    def start_dense(self, replace: bool = False) -> None:
        """SSP/ASP: give the exchange's slices the compute's dense parameters (once, or
        again with replace after a restore)."""
        if self.ex.synchronous or (self._dense_started and not replace):
            return
        self._dense_started = True
        if not self.compute.n_dense:
            return
        flat, state, updates = self.compute.dense_values()
        self.ex.set_dense(flat, state, updates * self.comm.size, replace=replace)

    def _dense_back(self) -> None:
        if not self.compute.n_dense:
            return
        flat = self.ex.dense()
        state, updates = self.ex.dense_state(self.compute.dense_slots)
        # the optimizer's count is of steps: each owner applied every worker's push
        self.compute.set_dense_values(flat, state, updates // max(1, self.comm.size))

    def set_step(self, step: int) -> None:
        """Continue from `step` (a restore, on every rank between steps); SSP/ASP: the
        dense weights the compute now holds become the slices'. A prefetched element
        is dropped (it was planned for the old step)."""
        self.drop_staged()
        self.ex.set_step(int(step))
        if self._dense_started:
            self.start_dense(replace=True)

    # -- seams ------------------------------------------------------------------------------

    def abandon(self) -> None:
        """Give up the step in flight, on every rank alike (the exchange's abandon): every
        table, optimizer slot, metric state and counter is as before the step. A
        prefetched element is dropped (its helper joined: its wait ends at the
        communicator's deadline at the latest). The elements train_next had read for
        them are held back: the next train_next on the same iterator (a retry, see
        kvcoll.elastic) trains on them first, so an abandoned step tried again on the
        same world skips no data (replan drops them when the world's size changes)."""
        inflight, self._inflight = self._inflight, None
        current, staged, self._current = self._current, self._staged, None
        self.drop_staged()
        iterator = current[0] if current is not None else \
            staged.iterator if staged is not None else None
        if iterator is not None:
            kept = [current[1]] if current is not None else []
            if staged is not None and staged.iterator is iterator and staged.element is not None:
                kept.append(staged.element)
            if self._held is not None and self._held[0] is iterator:
                kept += self._held[1]
            self._held = (iterator, kept) if kept else None
        if inflight is not None:
            self.ex.abandon(inflight)

    def replan(self, comm, owners=None) -> None:
        """Continue on communicator `comm` (a world that changed) and owner map `owners`
        (default: the even map of its size), between steps. The elements an abandoned
        step held back are dropped if the world's size changed: they were read for the
        old world, and a source of global batches splits them anew (kvcoll's data sources
        resume from `consumed`; a rank's own iterator goes on after them)."""
        self.abandon()
        if comm.size != self.comm.size:
            self._held = None
        self._free_stage_comm()
        self.ex.replan(comm, owners)
        if not self.ex.synchronous:
            self._dense_started = False

    def close(self) -> None:
        self.drop_staged()
        if self._helper is not None:
            self._helper.close()
        self._free_stage_comm()
        self.ex.close()

    # -- the agreed errors ------------------------------------------------------------------

    def _texts(self, own: BaseException | None, needed: bool, alone: bool = False) -> list:
        """Every rank's error as (class path, message) or None (a collective when
        `needed`, which every rank decides alike). alone: a step this rank decided by
        itself (SSP/ASP training): its own error only, no collective (the other ranks
        are not in it)."""
        if not needed:
            return [None] * self.comm.size
        mine = None if own is None else [_class_path(type(own)), str(own)]
        if alone:
            texts = [None] * self.comm.size
            texts[self.comm.rank] = mine
            return texts
        return self.comm.allgather_json(mine, "step:errors")

    def _raise_batch_error(self, agreement: Agreement, own, step: int, alone: bool = False):
        """A bad batch on some rank: every rank raises the same kvcoll error class, which
        names the ranks, the step and the first failing rank's message."""
        bad = agreement.failed
        texts = self._texts(own, True, alone)
        raise _agreed(texts, bad, f"rank(s) {bad} could not use their batch at step {step}",
                      own)

    def _raise_outcome_error(self, agreement: Agreement, own, batch, step: int,
                             alone: bool = False):
        codes = agreement.codes
        bad = agreement.outcome_failed
        failed = [r for r in bad if codes[r] == FAILED]
        own = own if own is not None else agreement.outcome_error  # e.g. the push refused
        texts = self._texts(own, bool(failed), alone)
        if failed:
            raise _agreed(texts, failed, f"rank(s) {failed} failed in step {step}", own)
        why = self.compute.explain(batch) if batch is not None else None
        reason = f" (this rank: {why})" if why else ""
        raise errors.NonFiniteError(
            f"step {step}: the loss or a gradient is NaN/Inf on rank(s) {bad}{reason}; no "
            "update was applied (check the inputs for NaN/Inf, or lower the learning rate)")


def _check_rows(pull) -> None:
    """Raise the error of rows that arrived unusable (a value that overflowed a 16-bit
    wire, kvcoll.exchange.wire), inside the compute's try: every rank learns of it."""
    check = getattr(pull, "check", None)
    if check is not None:
        check()


class _Staged:
    """The next element of a pipelined loop: read, prepared, its ids planned and sent and
    its vote exchanged (BspExchange.send_ids + receive_ids on the helper's
    communicator), and room made in the tables for the rows its fetch can create
    (BspExchange.reserve_for), by a helper thread while the step before it computes.

    A failure to read or prepare the element is its vote (every rank learns of it at the
    fetch, the next step raises it); anything else the helper raises (a communication
    deadline) is raised by join() on the main thread."""

    __slots__ = ("loop", "iterator", "step", "comm", "threaded", "element", "batch", "err",
                 "agreement", "pending", "pull", "exc", "done")

    def __init__(self, loop: Loop, iterator, step: int, comm, threaded: bool):
        self.loop, self.iterator, self.step, self.comm = loop, iterator, step, comm
        self.threaded = threaded
        self.element = self.batch = self.err = self.agreement = self.pending = None
        self.pull = None    # stale_rows: the rows fetched ahead (None: no step)
        self.exc = None
        self.done = None    # set by the helper thread when run() has returned

    def start(self, helper: "_Helper") -> None:
        self.done = helper.submit(self._body)

    def _body(self) -> None:
        try:
            self.run()
        except BaseException as exc:  # noqa: BLE001 - raised on the main thread by join()
            self.exc = exc

    def run(self) -> None:
        loop = self.loop
        self.element = loop._next(self.iterator)
        self.batch, self.err = loop._prepare(self.element)
        self.agreement = loop._vote(self.element, self.batch, self.err, loop.stop_asked)
        ex = loop.ex
        ids = loop.compute.ids(self.batch)
        if self.comm is None:    # the exchange's own communicator (and next step)
            self.pending = ex.send_ids(ids, self.agreement)
        else:
            self.pending = ex.send_ids(ids, self.agreement, step=self.step, comm=self.comm)
        receive = getattr(ex, "receive_ids", None)
        if loop.stale_rows:     # the rows too, before the step in flight is applied
            self.pull = ex.fetch(self.pending, ahead=True, comm=self.comm)
        elif receive is not None and self.threaded and receive(self.pending):
            reserve = getattr(ex, "reserve_for", None)
            if reserve is not None:     # room for the rows its fetch creates, made here
                reserve(self.pending)

    def join(self, drain: bool = False) -> None:
        """Wait for the helper. drain: the element is being dropped: complete its id
        exchange (when the helper sent it) and swallow its errors."""
        if self.done is not None:
            self.done.wait()
            self.done = None
        if drain:
            if self.pull is not None:   # fetched ahead: its exchanges are complete, and
                pull, self.pull = self.pull, None   # the rows it created go again
                self.loop.ex.abandon(pull)
                return
            receive = getattr(self.loop.ex, "receive_ids", None)
            if self.exc is None and self.pending is not None and receive is not None:
                try:
                    receive(self.pending)
                except Exception:  # noqa: BLE001 - the element is given up anyway
                    pass
            return
        if self.exc is not None:
            exc, self.exc = self.exc, None
            raise exc


class _Fetched:
    """A staged element's pull, fetched ahead (stale_rows); None: the step does not
    proceed."""

    __slots__ = ("pull",)

    def __init__(self, pull):
        self.pull = pull


class _Helper:
    """The thread a pipelined loop stages its next elements on, kept from step to step:
    starting a thread for each step made the step wait until the new thread ran (1.5% of
    a step's time at 2 ranks x 1 thread here). It runs one job at a time (a loop joins
    its staged element before it stages the next), with its kernels beside the dense
    compute (kvcoll.exchange.kernels.beside_compute); after IDLE seconds with nothing to
    do, or at close(), it ends, and the next submit starts another."""

    IDLE = 2.0

    def __init__(self):
        self._cv = threading.Condition()
        self._job = None
        self._thread = None
        self._closed = False

    def submit(self, fn) -> threading.Event:
        """Run fn() on the helper thread; the event is set when it has returned."""
        done = threading.Event()
        with self._cv:
            if self._job is not None:
                raise AssertionError("the helper's previous job was not taken yet")
            self._job = (fn, done)
            self._closed = False
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvcoll-prefetch",
                                                daemon=True)
                self._thread.start()
            else:
                self._cv.notify()
        return done

    def close(self) -> None:
        """End the thread once it has nothing to do (its job, if any, still runs)."""
        with self._cv:
            self._closed = True
            self._cv.notify()

    def _run(self) -> None:
        with beside_compute():   # its kernels run beside the step's dense compute
            while True:
                with self._cv:
                    if self._job is None and not self._closed:
                        self._cv.wait(self.IDLE)
                    if self._job is None:    # idle, or closed: a submit starts another
                        self._thread = None
                        return
                    (fn, done), self._job = self._job, None
                try:
                    fn()
                finally:
                    done.set()


def _class_path(cls) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _kvcoll_class(path: str):
    """The kvcoll error class named by `path`, if it is one (None otherwise)."""
    import importlib

    module, _, name = path.partition(":")
    if not module.split(".")[0] == "kvcoll":
        return None
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    return cls if isinstance(cls, type) and issubclass(cls, errors.KvcollError) else None


_ARGUMENT_ERRORS = ("ValueError", "TypeError", "KeyError", "IndexError",
                    "InvalidArgumentError")


def _agreed(texts: list, bad: list, what: str, own) -> errors.KvcollError:
    """The one error every rank raises: the first failing rank's kvcoll class (a bad
    argument of another kind becomes InvalidArgumentError, anything else CommError),
    naming `what` and that rank's message; on a failing rank chained to its own error."""
    first = next((r for r in bad if texts[r]), None)
    if first is None:
        return errors.CommError(f"{what} (see the error on those ranks)")
    path, message = texts[first]
    cls = _kvcoll_class(path)
    if cls is None:
        name = path.rpartition(":")[2]
        cls = errors.InvalidArgumentError if name in _ARGUMENT_ERRORS else errors.CommError
    text = f"{what}: rank {first}: {path.rpartition(':')[2]}: {message}"
    try:
        exc = cls(text)
    except Exception:  # noqa: BLE001 - a class whose constructor takes more
        exc = (errors.InvalidArgumentError if issubclass(cls, ValueError)
               else errors.CommError)(text)
    if own is not None:
        exc.__cause__ = own
    return exc
