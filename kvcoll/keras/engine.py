"""The step engine: one step loop for model.fit / evaluate / predict and kv.Trainer, in
every step mode.

An Engine belongs to one Keras model (`engine_of(model)`). On first use (a collective)
it agrees with the other ranks on the batch layout, traces the model once to learn
which input feeds which kv.Embedding (functional and subclassed models alike, no
private graph attributes), creates one KvTable per table name, and brings up the step
mode's exchange (kvcoll.exchange). Then each training step is:

  1. this rank's batch is checked and its ids normalised (kvcoll.keras.batch);
  2. pull: the rows of every table's unique ids, in one fused exchange; in BSP the
     ranks agree on the way (who has data, whether every batch is valid, whether a
     callback asked to stop) with the pull's header, so a bad batch raises the same
     error on every rank before anything changes;
  3. the compiled step (one tf.function, traced once: unknown leading dimensions)
     runs the model forward and backward on the rows, computes the compiled loss plus
     model.losses (regularizers, add_loss) weighted by this rank's share of the global
     batch, and updates the model's metrics with the rank's own samples;
  4. push: row gradients go to their owners; the dense gradients, the loss, failure
     flags and every metric's state ride one fused allreduce (BSP), so the dense
     update and the logged metrics are exactly those of one process holding the whole
     global batch: metric states (AUC's confusion counts, a mean's total and count) are
     summed over ranks, never averaged;
  5. the Keras optimizer applies the summed dense gradients (BSP) and the logs are
     computed from the global metric state.

In SSP/ASP the dense parameters come with the pull and go back with the push to their
slice owners; per-step logs are this rank's and the epoch's are global (summed at
the sync point that ends every epoch). Inside a Horovod job the dense gradients of step
4 may ride Horovod's allreduce instead (dense_backend="horovod": kvcoll.keras._horovod).
"""

from __future__ import annotations

import json
import time
import weakref

import numpy as np
import tensorflow as tf

from .. import runtime
from .._buffers import aligned_empty
from ..config import BSP, StepMode
from ..errors import (CommError, InvalidArgumentError, KvcollError, NonFiniteError)
from ..exchange import make_exchange
from ..exchange.bsp import group_key
from ..exchange.kernels import gather_grad
from ..table import KvTable
from . import _compat, _horovod
from ._compat import keras
from .batch import (Batch, DataError, Feature, Layout, _kind, leaves_of, pad_positions,
                    signature, unpack)
from .embedding import Embedding, recording, rows_scope
from .optimizer import dense_backend_of, dense_kernel, sparse_of

__all__ = ["Engine", "engine_of", "StepResult"]

_ENGINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

# Failure codes a rank reports in a step's agreement.
_OK, _NAN, _FAILED = 0, 1, 2


def engine_of(model, *, create: bool = True, **settings) -> "Engine":
    """The engine of a Keras model (created with `settings` on first use)."""
    eng = _ENGINES.get(model)
    if eng is None and create:
        eng = Engine(model, **settings)
        _ENGINES[model] = eng
    elif eng is None:
        raise KvcollError("this model has not been run by kvcoll yet (fit, evaluate, "
                          "predict or kv.Trainer)")
    return eng


class StepResult:
    """What a step returns: the step's own loss (BSP: over the global batch; SSP/ASP:
    this rank's) and the logs callbacks see."""

    __slots__ = ("loss", "logs")

    def __init__(self, loss: float, logs: dict):
        self.loss, self.logs = loss, logs


def resolve_mode(step_mode, staleness) -> StepMode:
    """A step mode given as a StepMode or a name (default: the run's --step-mode)."""
    if isinstance(step_mode, StepMode):
        if staleness is not None and staleness != step_mode.staleness:
            raise InvalidArgumentError(
                f"step_mode {step_mode} already sets staleness; got staleness={staleness}")
        return step_mode
    if step_mode is None:
        if not runtime.is_initialized():
            return BSP
        cfg = runtime.config()
        step_mode = cfg.step_mode
        if staleness is None:
            staleness = cfg.staleness
    if step_mode == "bsp":
        return BSP
    if step_mode == "asp":
        return StepMode("asp", 0)
    if step_mode == "ssp":
        return StepMode("ssp", 4 if staleness is None else staleness)
    return StepMode(step_mode)  # raises InvalidArgumentError naming the choices


class Engine:
    """Runs a Keras model with kv.Embedding layers on kvcoll's tables: training,
    evaluation and prediction steps, in BSP, SSP or ASP.

    comm: kvcoll's communicator (default: the run's); step_mode, staleness: default the
    run's (--step-mode, --staleness); jit: compile the steps with tf.function.
    """

    def __init__(self, model, *, comm=None, step_mode=None, staleness=None, jit: bool = True):
        if not isinstance(model, keras.Model):
            raise InvalidArgumentError(
                f"kvcoll runs a {keras.__name__}.Model (Keras {keras.__version__}, the Keras "
                f"tf.keras names here), got {type(model).__module__}.{type(model).__name__}; "
                "build the model with tf.keras (with TF_USE_LEGACY_KERAS=1 that is tf_keras, "
                "Keras 2; otherwise the keras package)")
        custom = _compat.custom_step_methods(model)
        if custom:
            raise InvalidArgumentError(
                f"{type(model).__name__} overrides {', '.join(custom)}: kvcoll runs its own "
                "steps (the rows are pulled outside the compiled step); override "
                "compute_loss (or call/add_loss) instead")
        if comm is None:
            if not runtime.is_initialized():
                raise KvcollError("call kv.init() before training a model with kv.Embedding "
                                  "layers (it brings MPI up)")
            comm = runtime.comm()
        self.model = model
        self.comm = comm
        self.mode = resolve_mode(step_mode, staleness)
        self.jit = jit
        self.layout: Layout | None = None
        self.tables: dict[str, KvTable] | None = None
        self.ex = None
        self.local_steps = 0       # training steps with this rank's own data
        self.last_loss = 0.0       # the last training step's loss (BSP: global; else this rank's)
        self.last_samples = 0      # ... and this rank's samples in it
        # seconds per phase, summed over steps; "tables" is the part of "exchange" spent
        # in the tables' C calls; "wait" (SSP/ASP) the time at the staleness gate
        self.timings = {"exchange": 0.0, "tables": 0.0, "compute": 0.0, "allreduce": 0.0,
                        "apply": 0.0}
        if self.mode.name != "bsp":
            self.timings["wait"] = 0.0
        self._fns: dict = {}
        self._dense_vars = None
        self._n_dense = 0
        self._mvars = None         # the metrics' state variables, in a fixed order
        self._state = None         # this rank's own metric state (float32), as of its last step
        self._lr0 = None           # the dense optimizer's learning rate when training began
        self._dense_started = False
        self._pending_error = None  # predict: a failure to report at the next agreement
        self._compiled = None       # the model.compile the compiled steps were made for
        declared = _declared_inputs(model)
        self._declared = None if declared is None else declared[:2]

    def _call_structure(self):
        return None if self._declared is None or self._declared[0] == "dict" else self._declared

    # -- properties ------------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Steps started: in BSP the global step; in SSP/ASP this rank's clock."""
        return self.ex.step if self.ex is not None else getattr(self, "_restored_step", 0)

    @property
    def features(self) -> dict:
        return self.layout.features if self.layout is not None else {}

    @property
    def optimizer(self):
        return getattr(self.model, "optimizer", None)

    @property
    def synchronous(self) -> bool:
        return self.mode.name == "bsp"

    # -- set-up (a collective) -------------------------------------------------------------

    def begin(self, first, x_only: bool = False) -> tuple | None:
        """Agree with every rank on the layout of this loop's batches, given this rank's
        first data element (None if it has none; a DataError if reading it failed), and
        set the engine up on first use (a collective, with the startup deadline: ranks
        may wait for others still building their model). Returns the agreed (labels
        structure, sample weights structure); None when no rank has any data."""
        with self.comm.deadline("startup"):
            return self._begin(first, x_only)

    def _begin(self, first, x_only):
        err, mine = None, None
        if isinstance(first, DataError):
            err = first.exc
        elif first is not None:
            try:
                x, y, sw = unpack(first)
                x = self._canonical(x)
                mine = signature(x, None, None) if x_only else signature(x, y, sw)
            except Exception as exc:  # noqa: BLE001 - every rank must learn of it
                err = exc
        sigs = self.comm.allgather_json({"sig": mine, "error": None if err is None else
                                        f"{type(err).__name__}: {err}"}, "engine:layout")
        failed = [r for r, s in enumerate(sigs) if s["error"]]
        if failed:
            if err is not None:
                raise err
            raise InvalidArgumentError(f"rank(s) {failed} could not read their first batch: "
                                       f"{sigs[failed[0]]['error']}")
        sigs = [s["sig"] for s in sigs]
        given = [(r, s) for r, s in enumerate(sigs) if s is not None]
        if not given:
            return None
        r0, sig = given[0]
        for r, s in given[1:]:
            if s != sig:
                raise InvalidArgumentError(
                    f"ranks disagree on the data's layout: rank {r0} has {_brief(sig)}, rank {r} "
                    f"has {_brief(s)}; every rank must pass the same features, labels and "
                    "sample weights")
        if self.layout is None:
            self._setup(sig)
        else:
            kind, forms = json.loads(sig)["x"]
            if kind != self.layout.kind or sorted(forms) != sorted(self.layout.names):
                raise InvalidArgumentError(
                    f"features do not match the model's inputs: this data has {sorted(forms)}, "
                    f"the model was first run with {sorted(self.layout.names)}")
        d = json.loads(sig)
        return d["y"], d["sw"]

    def _canonical(self, x):
        """A functional model declared with a list of Inputs (or one) takes its data as a
        list (or one array) or as a dict keyed by the Inputs' names: kvcoll uses the dict."""
        declared = self._declared
        if declared is None or declared[0] == "dict" or isinstance(x, dict):
            return x
        names = declared[1]
        if declared[0] == "single" and not isinstance(x, (list, tuple)):
            return {names[0]: x}
        if isinstance(x, (list, tuple)) and len(x) == len(names):
            return dict(zip(names, x))
        return x

    def setup_from_model(self) -> None:
        """Set up without data, from a functional model's declared inputs (a collective):
        what kv.restore needs before the first fit."""
        struct = getattr(self.model, "input", None) if getattr(self.model, "inputs", None) \
            else None
        if struct is None:
            raise KvcollError(
                f"{type(self.model).__name__} declares no inputs (a subclassed model): run "
                "fit, evaluate or predict once before kv.save / kv.restore / kv.export, or "
                "restore inside fit with kv.callbacks.Checkpoint(dir, restore=True)")
        kind, leaves = leaves_of(struct)
        if kind != "dict":
            kind, leaves = "dict", {t.name: t for t in leaves.values()}
        forms = {}
        for name, t in leaves.items():
            dt = np.dtype(tf.as_dtype(t.dtype).as_numpy_dtype) if t.dtype != "string" \
                else np.dtype(object)
            forms[name] = ["array", _kind(dt), len(t.shape),
                           [None if d is None else int(d) for d in t.shape[1:]]]
        with self.comm.deadline("startup"):
            self._setup(json.dumps({"x": [kind, forms], "y": None, "sw": None},
                                   sort_keys=True))

    def _setup(self, sig: str) -> None:
        features = self._discover(sig)
        self.layout = Layout(sig, features, self._call_structure())
        layers = [l for l in _compat.sublayers(self.model) if isinstance(l, Embedding)]
        used = {f.table for f in features.values()}
        self.tables = _make_tables([l for l in layers if l.table in used],
                                   sparse_of(self.optimizer), self.comm.size)
        self._dense_vars = list(self.model.trainable_variables)
        self._n_dense = sum(int(np.prod(v.shape)) for v in self._dense_vars)
        opt = self.optimizer
        if opt is not None:  # its state exists (and checkpoints see it) from now
            _compat.build_optimizer(opt, self._dense_vars)
        self._check_dense_backend()
        kernel = None
        if not self.synchronous and self._n_dense and self.optimizer is not None:
            kernel = dense_kernel(self.optimizer)
        self.ex = make_exchange(self.comm, self.tables, self.mode, self._n_dense, kernel)
        if getattr(self, "_restored_step", 0):
            self.ex.set_step(self._restored_step)
        # every rank starts from rank 0's dense weights (Horovod's broadcast at start)
        broadcast_variables(self.model.variables, root_rank=0, comm=self.comm)

    def _discover(self, sig: str) -> dict:
        """Trace the model once on placeholders: which input feeds which kv.Embedding."""
        kind, forms = json.loads(sig)["x"]
        by_name = _functional_inputs(self.model, kind, sorted(forms))
        specs = {}
        for name, form in forms.items():
            specs[name] = _trace_spec(name, form, by_name.get(name))
        layout = Layout(sig, {}, self._call_structure(), check=False)
        calls, got = [], {}

        def trace(leaves):
            got.update(leaves)
            with recording(calls):
                self.model(layout.rebuild(leaves), training=False)

        try:
            tf.function(trace, autograph=False).get_concrete_function(specs)
        except InvalidArgumentError:
            raise
        except Exception as exc:  # noqa: BLE001 - Keras raises several kinds
            raise InvalidArgumentError(
                f"the model cannot be called on this data ({type(exc).__name__}: {exc}); "
                "check the feature names and shapes against the model's inputs") from None
        features = {}
        graph = next(iter(got.values())).graph
        # Keras may first run the model in a scratch graph of its own (to build it): only
        # the calls in the traced graph count
        calls = [c for c in calls if c[1].graph is graph]
        for layer, tensor, shape_op in calls:
            name = next((n for n, t in got.items() if _same(t, tensor)), None)
            if name is None:
                raise InvalidArgumentError(
                    f"kv.Embedding {layer.name!r} (table {layer.table!r}) must be called "
                    "directly on a model input of ids, not on the result of another "
                    "operation (a cast, a slice, a lookup): the ids are looked up before the "
                    "model runs")
            spec = Feature(name, layer.table, layer.combiner is not None, layer.padding_id)
            prev = features.get(name)
            if prev is not None and prev != spec:
                raise InvalidArgumentError(
                    f"input {name!r} feeds two kv.Embedding layers of different tables, "
                    f"combiners or padding ids ({prev.table!r}, {spec.table!r})")
            features[name] = spec
        if not features:
            raise InvalidArgumentError("the model has no kv.Embedding layer called on its inputs")
        own = {op for _, _, op in calls}
        for name in features:
            others = [op.type for op in got[name].consumers() if op.name not in own]
            if others:
                raise InvalidArgumentError(
                    f"input {name!r} feeds a kv.Embedding and other operations ({others[:3]}); "
                    "inside kvcoll an id input reaches only its embedding: give the other "
                    "layers an input of their own")
        self._input_dtypes = {n: specs[n].dtype for n in features}
        return {n: features[n] for n in sorted(features)}

    # -- one training step -------------------------------------------------------------------

    def train_step(self, data, *, targets=None, stop: bool = False) -> StepResult | None:
        """One training step on this rank's data element (x, y[, sample_weight]); None:
        this rank has no data (it keeps the others company in BSP). Returns None when
        no rank had data (or one asked to stop: `stop`); every rank must call it (BSP)."""
        if self.ex is None:
            raise KvcollError("train_step before begin(): the engine is not set up")
        if not self.synchronous:
            if data is None:
                return None
            return self._train_async(data, targets)
        batch, err = self._prepare(data, targets, self.layout)
        header = np.array([int(batch is not None), int(err is None), batch.n if batch else 0,
                           int(stop)], np.int64)
        t0 = time.perf_counter()
        ids = self._ids(batch)
        pulled = self.ex.pull(ids, header=header, proceed=lambda h: self._agree(h, err))
        if pulled is None:
            return None
        h = pulled.headers
        n_total = int(h[:, 2].sum())
        t1 = time.perf_counter()
        fail = None
        if batch is not None and batch.n:
            try:
                loss_w, dense_np, row_np, state = self._train_compute(
                    batch, pulled, targets, batch.n / n_total)
                code = _OK if _finite(loss_w, dense_np, row_np) else _NAN
            except Exception as exc:  # noqa: BLE001 - every rank must learn of it
                fail, code = exc, _FAILED
        else:
            code = _OK
        if code != _OK or not batch or not batch.n:
            loss_w, state = 0.0, self._local_state(targets)
            dense_np = np.zeros(self._n_dense, np.float32)
            row_np = {g: np.zeros_like(m) for g, m in pulled.rows.items()}
        t2 = time.perf_counter()
        flags = np.zeros(self.comm.size, np.float32)
        flags[self.comm.rank] = code
        extra = np.concatenate([np.array([loss_w], np.float32), flags, state])
        if self._dense_backend() == "horovod":  # the rows and [loss, flags, metrics]: kvcoll's
            pushed = self.ex.push(pulled, row_np, None, extra, lr=self._row_rates(pulled.step))
            t3 = time.perf_counter()
            total = np.concatenate([_horovod.allreduce_sum(dense_np), pushed.reduced()])
        else:
            pushed = self.ex.push(pulled, row_np, dense_np, extra, lr=self._row_rates(pulled.step))
            t3 = time.perf_counter()
            total = pushed.reduced()
        t4 = time.perf_counter()
        nd = self._n_dense
        flags = total[nd + 1:nd + 1 + self.comm.size]
        if flags.any():
            pushed.commit(apply=False)
            self._set_state(self._state_before)
            self._raise_agreed(flags, fail, pulled.step)
        pushed.commit()
        t5 = time.perf_counter()
        logs = self._apply(total[:nd], total[nd + 1 + self.comm.size:])
        t6 = time.perf_counter()
        if batch is not None and batch.n:
            self._state = state
            self.local_steps += 1
        self.last_loss, self.last_samples = float(total[nd]), batch.n if batch else 0
        tm = self.timings
        tm["exchange"] += (t1 - t0) + (t3 - t2) + (t5 - t4)
        tm["tables"] = self.ex.table_seconds
        tm["compute"] += t2 - t1
        tm["allreduce"] += t4 - t3
        tm["apply"] += t6 - t5
        return StepResult(float(total[nd]), logs)

    def _train_async(self, data, targets) -> StepResult:
        """One SSP/ASP step: rank-local, nothing is agreed with the others."""
        batch, err = self._prepare(data, targets, self.layout)
        if err is not None:
            raise err
        self._start_dense()
        ex = self.ex
        t0, w0 = time.perf_counter(), time.time()
        pulled = ex.pull(self._ids(batch), dense=bool(batch.n))
        t1 = time.perf_counter()
        waited = max(0.0, ex.trace[-1].t_start - w0) if ex.trace else 0.0
        if batch.n:
            if pulled.dense is not None:
                self._fn("assign")(tf.constant(pulled.dense, tf.float32))
            loss_w, dense_np, row_np, state = self._train_compute(
                batch, pulled, targets, 1.0 / self.comm.size)
            if not _finite(loss_w, dense_np, row_np):
                self._set_state(self._state_before)
                raise NonFiniteError(
                    f"rank {self.comm.rank}, step {pulled.step}: the loss or a gradient is "
                    "NaN/Inf; nothing was pushed (lower the learning rate or check the inputs)")
        else:
            loss_w, dense_np, state = 0.0, None, self._local_state(targets)
            row_np = {g: np.zeros_like(m) for g, m in pulled.rows.items()}
        t2 = time.perf_counter()
        dense_lr = None
        if self.optimizer is not None and self._n_dense:
            dense_lr = _compat.learning_rate(self.optimizer, pulled.step - 1)
        ex.push(pulled, row_np, dense_np, lr=self._row_rates(pulled.step), dense_lr=dense_lr)
        t3 = time.perf_counter()
        self._state = state
        self.local_steps += 1 if batch.n else 0
        self.last_loss, self.last_samples = loss_w * self.comm.size, batch.n
        logs = self._results(state)
        tm = self.timings
        tm["wait"] += waited
        tm["exchange"] += (t1 - t0 - waited) + (t3 - t2)
        tm["compute"] += t2 - t1
        return StepResult(loss_w * self.comm.size, logs)

    def _train_compute(self, batch: Batch, pulled, targets, weight: float):
        """The compiled step on one batch: (weighted loss, flat dense gradient, each dim
        group's rows gradient, the metrics' state after this batch), as numpy."""
        self._state_before = self._local_state(targets)
        inputs, rows = self._inputs(batch, pulled)
        fn = self._fn("train", targets)
        loss_w, dense, row_grads, state = fn(inputs, rows, *self._targets(batch, targets),
                                             tf.constant(weight, tf.float32))
        row_np = {g: gather_grad(v.numpy(), i.numpy(), pulled.rows[g].shape[0])
                  for g, (v, i) in row_grads.items()}
        return float(loss_w), dense.numpy(), row_np, state.numpy()

    def _apply(self, dense: np.ndarray, state: np.ndarray) -> dict:
        """Apply the summed dense gradients with the Keras optimizer; the logs from the
        global metric state."""
        if self._n_dense:
            out = self._fn("apply")(tf.constant(dense, tf.float32), tf.constant(state))
        else:
            out = self._fn("results")(tf.constant(state))
        return {k: float(v) for k, v in out.items()}

    def _results(self, state: np.ndarray) -> dict:
        return {k: float(v) for k, v in self._fn("results")(tf.constant(state)).items()}

    def _row_rates(self, step: int) -> dict | None:
        """Each table's learning rate at `step`: its schedule (if any), scaled by how far
        callbacks (LearningRateScheduler, ReduceLROnPlateau) have moved the dense
        optimizer's learning rate from where it started. None if nothing is scheduled."""
        ratio = 1.0
        opt = self.optimizer
        if opt is not None and getattr(opt, "_kvcoll_follow", True) and \
                not _compat.lr_is_schedule(opt):
            now = _compat.learning_rate(opt)
            if self._lr0 is None:
                self._lr0 = now
            ratio = now / self._lr0 if self._lr0 else 1.0
        rates = {}
        for name, t in self.tables.items():
            sched = getattr(t.optimizer, "is_scheduled", False)
            if not sched and ratio == 1.0:
                continue
            base = t.optimizer.learning_rate_at(step - 1) if sched else t.optimizer.learning_rate
            rates[name] = float(base) * ratio
        return rates or None

    # -- evaluation and prediction ---------------------------------------------------------

    def test_step(self, data, *, targets=None) -> dict | None:
        """One evaluation step (a collective, every mode): this rank's data element or
        None. Returns the logs over every rank's samples so far, None when no rank had
        data."""
        batch, err = self._prepare(data, targets, self.layout)
        header = np.array([int(batch is not None), int(err is None), batch.n if batch else 0, 0],
                          np.int64)
        pulled = self.ex.lookup(self._ids(batch), header=header,
                                proceed=lambda h: self._agree(h, err))
        if pulled is None:
            return None
        fail, code = None, _OK
        state = self._local_state(targets)
        if batch is not None and batch.n:
            try:
                inputs, rows = self._inputs(batch, pulled)
                state = self._fn("test", targets)(inputs, rows,
                                                  *self._targets(batch, targets)).numpy()
            except Exception as exc:  # noqa: BLE001 - every rank must learn of it
                fail, code = exc, _FAILED
        flags = np.zeros(self.comm.size, np.float32)
        flags[self.comm.rank] = code
        total = self.comm.allreduce(np.concatenate([flags, state]), op="evaluate")
        if total[:self.comm.size].any():
            self._raise_agreed(total[:self.comm.size], fail, self.step)
        self._state = state
        return self._results(total[self.comm.size:])

    def predict_step(self, data) -> tuple:
        """One prediction step (a collective): this rank's x, or None when it has no
        more. Returns (whether any rank had data, this rank's outputs as numpy or
        None)."""
        err = self._pending_error
        batch = None
        if err is None:
            batch, err = self._prepare(data, None, self.layout, x_only=True)
        header = np.array([int(batch is not None), int(err is None), batch.n if batch else 0, 0],
                          np.int64)
        pulled = self.ex.lookup(self._ids(batch if err is None else None), header=header,
                                proceed=lambda h: self._agree(h, err))
        self._pending_error = None
        if pulled is None:
            return False, None
        if batch is None:
            return True, None
        try:
            inputs, rows = self._inputs(batch, pulled)
            out = self._fn("predict")(inputs, rows)
            return True, tf.nest.map_structure(lambda t: t.numpy(), out)
        except Exception as exc:  # noqa: BLE001 - reported at the next agreement
            self._pending_error = exc
            return True, None

    # -- uneven data, sync points -------------------------------------------------------------

    def finish(self) -> None:
        """This rank's data has run out. BSP: keep joining the other ranks' steps with
        no samples until every rank is out. SSP/ASP: wait until every rank is done, then
        leave every update applied and the same dense model (and optimizer state) on
        every rank."""
        if self.synchronous:
            while self.train_step(None) is not None:
                pass
            return
        self._start_dense()
        self.ex.finish()
        self._dense_back()

    def sync(self) -> None:
        """A consistent snapshot on every rank (for saves, exports, evaluation): in
        SSP/ASP the same as finish() (training continues afterwards); BSP is always
        consistent between steps."""
        if not self.synchronous and self.ex is not None:
            self.finish()

    def global_logs(self, targets=None) -> dict:
        """The logs over every rank's samples since the metrics were reset (a
        collective): what an SSP/ASP epoch ends with."""
        state = self._local_state(targets)
        return self._results(self.comm.allreduce(state, op="metrics"))

    def reset_metrics(self) -> None:
        self.model.reset_metrics()
        self._state = None

    def set_step(self, step: int) -> None:
        """Continue from `step` (a restore); the dense weights the model now holds become
        the slices' (SSP/ASP)."""
        if self.ex is None:
            self._restored_step = int(step)
            return
        self.ex.set_step(int(step))
        if not self.synchronous and self._dense_started:
            self._dense_started = False
            self._start_dense(replace=True)

    def close(self) -> None:
        if self.ex is not None and hasattr(self.ex, "close"):
            self.ex.close()
        for t in (self.tables or {}).values():
            t.close()
        if _ENGINES.get(self.model) is self:
            del _ENGINES[self.model]

    # -- dense parameters of SSP/ASP ---------------------------------------------------------

    def _start_dense(self, replace: bool = False) -> None:
        if self._dense_started or not self._n_dense:
            self._dense_started = True
            return
        self._dense_started = True
        flat = _flat(self._dense_vars)
        opt = self.optimizer
        if opt is not None:
            _compat.build_optimizer(opt, self._dense_vars)
        slots = _compat.optimizer_slots(opt) if opt is not None else []
        state = np.stack([_flat(v) for v in slots]) if slots else None
        updates = int(opt.iterations.numpy()) if opt is not None else 0
        self.ex.start_dense(flat, state, updates, replace=replace)

    def _dense_back(self) -> None:
        """The slices' dense vector and optimizer state into the Keras model."""
        if not self._n_dense:
            return
        self._fn("assign")(tf.constant(self.ex.dense(), tf.float32))
        opt = self.optimizer
        slots = _compat.optimizer_slots(opt) if opt is not None else []
        state, updates = self.ex.dense_state(len(slots))
        for row, variables in zip(state, slots):
            _assign_flat(variables, row)
        if opt is not None:
            opt.iterations.assign(updates)

    # -- batches --------------------------------------------------------------------------

    def _prepare(self, data, targets, layout, x_only: bool = False):
        """(Batch or None, the error that made this rank's batch invalid or None)."""
        if data is None:
            return None, None
        if isinstance(data, DataError):
            return None, data.exc
        try:
            x, y, sw = unpack(data)
            x = self._canonical(x)
            if x_only:
                y = sw = None
            struct = (None, None) if x_only else (targets or (None, None))
            layout.y_struct, layout.sw_struct = struct
            return layout.batch(x, y, sw), None
        except Exception as exc:  # noqa: BLE001 - agreed with the other ranks first
            return None, exc

    def _ids(self, batch: Batch | None) -> dict:
        out = {}
        for t in self.tables:
            if batch is None:
                out[t] = np.zeros(0, np.int64)
                continue
            parts = [batch.ids[f][0] for f, spec in self.layout.features.items() if spec.table == t]
            out[t] = np.concatenate(parts) if len(parts) > 1 else parts[0]
        return out

    def _agree(self, headers: np.ndarray, err) -> bool:
        """The step's agreement from every rank's header [active, ok, samples, stop]:
        raise on every rank if any rank's batch was bad (this rank's own error if it
        was one of them); else whether the step goes on (some rank is active)."""
        bad = [r for r in range(self.comm.size) if not headers[r, 1]]
        if bad:
            self._raise_agreed(np.array([0 if headers[r, 1] else _FAILED
                                         for r in range(self.comm.size)]), err, self.step + 1)
        return bool(headers[:, 0].any()) and not bool(headers[:, 3].any())

    def _raise_agreed(self, flags, own, step: int):
        """Every rank raises the same error: the failing ranks' own, the others one that
        names the failing ranks and says what went wrong there."""
        msg = None if own is None else f"{type(own).__name__}: {own}"
        bad = [r for r in range(self.comm.size) if flags[r]]
        if own is not None or any(flags[r] == _FAILED for r in bad):
            texts = self.comm.allgather_json(msg, "engine:errors")
        else:
            texts = [None] * self.comm.size
        if own is not None:
            raise own
        if all(flags[r] == _NAN for r in bad):
            raise NonFiniteError(
                f"step {step}: the loss or a gradient is NaN/Inf on rank(s) {bad}; no update "
                "was applied (lower the learning rate or check the inputs)")
        first = next((texts[r] for r in bad if texts[r]), "see the error on those ranks")
        kind = first.split(":", 1)[0]
        cls = InvalidArgumentError if kind in ("InvalidArgumentError", "ValueError", "TypeError",
                                               "KeyError", "IndexError") else CommError
        raise cls(f"rank(s) {bad} rejected their batch at step {step}: {first}")

    def _local_state(self, targets=None) -> np.ndarray:
        """This rank's own metric state (zeros after a reset)."""
        if self._mvars is None:
            self._fn("train" if self.optimizer is not None and targets is not None else "test",
                     targets)
        if self._state is None:
            self._state = np.zeros(sum(int(np.prod(v.shape)) for v in self._mvars), np.float32)
        return self._state

    def _set_state(self, state) -> None:
        if state is not None and self._mvars:
            self._fn("set_state")(tf.constant(state))
            self._state = state

    def _inputs(self, batch: Batch, pulled):
        """The compiled step's inputs: (single-hot positions, one int64 vector feature
        after feature; {multi-hot feature: [batch, width] positions, -1 padded};
        {other input: values}) and the rows, one float32 matrix per dim."""
        n = batch.n
        single = self.layout.single
        ids = aligned_empty(len(single) * n, np.int64)
        multi, at = {}, dict.fromkeys(pulled.pos, 0)
        slot = {f: j for j, f in enumerate(single)}
        for f, spec in self.layout.features.items():
            t = spec.table
            flat, splits = batch.ids[f]
            pos = pulled.pos[t][at[t]:at[t] + flat.size]
            at[t] += flat.size
            if splits is None:
                j = slot[f]
                ids[j * n:(j + 1) * n] = pos
            else:
                multi[f] = tf.constant(pad_positions(pos, splits))
        dense = {k: tf.constant(v) for k, v in batch.dense.items()}
        rows = {g: _tensor(m) for g, m in pulled.rows.items()}
        return (_tensor(ids), multi, dense), rows

    def _targets(self, batch: Batch, targets) -> tuple:
        ys = tuple(tf.constant(a) for a in batch.y) if batch.y is not None else ()
        sws = tuple(tf.constant(a) for a in batch.sw) if batch.sw is not None else ()
        return ys, sws

    # -- the compiled functions ------------------------------------------------------------

    def _dense_backend(self) -> str:
        """Who sums this step's dense gradients: "kvcoll" or "horovod"."""
        opt = self.optimizer
        return dense_backend_of(opt) if opt is not None and self._n_dense else "kvcoll"

    def _check_dense_backend(self) -> None:
        """Inside a Horovod job (or with dense_backend="horovod"): one MPI world with
        thread support; Horovod's allreduce only for BSP's dense gradients."""
        backend = self._dense_backend()
        if backend == "horovod" and not self.synchronous:
            raise InvalidArgumentError(
                f"dense_backend='horovod' sums the dense gradients of BSP steps; in "
                f"{self.mode.name} the dense parameters live in slices on their owners: use "
                "--step-mode bsp, or kv.DistributedOptimizer(..., dense_backend='kvcoll')")
        _horovod.check(self.comm, backend, self.optimizer)

    def _fn(self, kind: str, targets=None):
        token = _compat.compile_token(self.model)
        if token is not self._compiled:  # compiled again: new loss, metrics, optimizer
            self._fns.clear()
            self._mvars, self._state, self._compiled, self._lr0 = None, None, token, None
            opt = self.optimizer
            if opt is not None:
                _compat.build_optimizer(opt, self._dense_vars)
            if self.ex is not None:
                self._check_dense_backend()
        key = (kind, json.dumps(targets))
        fn = self._fns.get(key)
        if fn is None:
            fn = self._build(kind, targets)
            self._fns[key] = fn
        return fn

    def _spec(self, targets):
        lay = self.layout
        ids = tf.TensorSpec([None], tf.int64)
        multi = {f: tf.TensorSpec([None, None], tf.int64) for f in lay.multi}
        dense = {}
        for name in lay.dense:
            form = lay.forms[name]
            dt = {"float": tf.float32, "bool": tf.bool}.get(form[1]) or tf.as_dtype(form[1])
            dense[name] = tf.TensorSpec([None] + form[3], dt)
        rows = {group_key(t.dim): tf.TensorSpec([None, t.dim], tf.float32)
                for t in self.tables.values()}
        y_spec, sw_spec = (), ()
        if targets is not None:
            ys, sws = targets

            def specs(struct):
                return tuple(tf.TensorSpec([None] + [None] * len(tail),
                                           tf.int64 if kind == "int" else tf.float32)
                             for kind, tail in struct[2])
            if ys is not None:
                y_spec = specs(ys)
            if sws is not None:
                sw_spec = specs(sws)
        return (ids, multi, dense), rows, y_spec, sw_spec

    def _build(self, kind: str, targets):
        model, lay = self.model, self.layout
        wrap = (lambda f, sig: tf.function(f, input_signature=sig, autograph=False)) \
            if self.jit else (lambda f, sig: f)
        if kind in ("assign", "set_state", "results", "apply"):
            return self._build_state_fn(kind, wrap)
        (ids_s, multi_s, dense_s), rows_s, y_s, sw_s = self._spec(targets)
        ys_struct, sws_struct = targets if targets is not None else (None, None)

        def model_call(ids, multi, dense, rows, training):
            leaves = dict(dense)
            for f, t in multi.items():
                leaves[f] = _as_input(t, self._input_dtypes[f])
            if lay.single:
                split = tf.unstack(tf.reshape(ids, [len(lay.single), -1]))
                for f, t in zip(lay.single, split):
                    leaves[f] = _as_input(t, self._input_dtypes[f])
            x = lay.rebuild(leaves)
            table_rows = {t: rows[group_key(tab.dim)] for t, tab in self.tables.items()}
            with rows_scope(table_rows):
                return x, model(x, training=training)

        def targets_of(y, sw):
            return (lay.rebuild_targets(list(y), ys_struct) if ys_struct else None,
                    lay.rebuild_targets(list(sw), sws_struct) if sws_struct else None)

        def batch_size(ids, multi, dense, y):
            for t in [*dense.values(), *multi.values(), *y]:
                return tf.cast(tf.shape(t)[0], tf.float32)
            return tf.cast(tf.shape(ids)[0] // max(1, len(lay.single)), tf.float32)

        if kind == "train":
            dense_vars = self._dense_vars

            def train(inputs, rows, y, sw, weight):
                ids, multi, dense = inputs
                with tf.GradientTape() as tape:
                    tape.watch(list(rows.values()))
                    x, y_pred = model_call(ids, multi, dense, rows, True)
                    yy, ss = targets_of(y, sw)
                    loss = _compat.compute_loss(model, x, yy, y_pred, ss, True)
                    weighted = loss * weight
                grads = tape.gradient(weighted, [*dense_vars, *rows.values()])
                flat = [tf.reshape(tf.convert_to_tensor(g), [-1]) if g is not None
                        else tf.zeros([int(np.prod(v.shape))], tf.float32)
                        for g, v in zip(grads, dense_vars)]
                dense_grad = tf.concat(flat, 0) if flat else tf.zeros([0], tf.float32)
                row_grads = {k: _gathered_grad(g, rows[k])
                             for k, g in zip(rows, grads[len(dense_vars):])}
                _compat.update_loss_tracker(model, loss, batch_size(ids, multi, dense, y))
                model.compute_metrics(x, yy, y_pred, ss)
                return weighted, dense_grad, row_grads, self._state_tensor()

            return self._traced(train, [(ids_s, multi_s, dense_s), rows_s, y_s, sw_s,
                                        tf.TensorSpec([], tf.float32)])
        if kind == "test":
            def test(inputs, rows, y, sw):
                ids, multi, dense = inputs
                x, y_pred = model_call(ids, multi, dense, rows, False)
                yy, ss = targets_of(y, sw)
                loss = _compat.compute_loss(model, x, yy, y_pred, ss, False)
                _compat.update_loss_tracker(model, loss, batch_size(ids, multi, dense, y))
                model.compute_metrics(x, yy, y_pred, ss)
                return self._state_tensor()

            return self._traced(test, [(ids_s, multi_s, dense_s), rows_s, y_s, sw_s])
        if kind == "predict":
            def predict(inputs, rows):
                ids, multi, dense = inputs
                return model_call(ids, multi, dense, rows, False)[1]
            return wrap(predict, [(ids_s, multi_s, dense_s), rows_s])
        raise AssertionError(kind)

    def _traced(self, fn, signature):
        """fn compiled with `signature` and traced now, on every rank, so the metrics'
        variables exist (and their state has the same size everywhere) before the first
        step; with jit=False the traced graph only serves that and fn runs eagerly."""
        traced = tf.function(fn, input_signature=signature, autograph=False)
        traced.get_concrete_function()
        self._mvars = _compat.metric_variables(self.model)
        return traced if self.jit else fn

    def _state_tensor(self):
        mvars = _compat.metric_variables(self.model)
        if not mvars:
            return tf.zeros([0], tf.float32)
        return tf.concat([tf.reshape(tf.cast(v, tf.float32), [-1]) for v in mvars], 0)

    def _build_state_fn(self, kind: str, wrap):
        model = self.model
        if self._mvars is None:
            self._mvars = _compat.metric_variables(model)
        mvars = self._mvars
        sizes = [int(np.prod(v.shape)) for v in mvars]

        def assign_state(state):
            for v, part in zip(mvars, tf.split(state, sizes) if mvars else []):
                v.assign(tf.cast(tf.reshape(part, v.shape), v.dtype))

        def results(state):
            mine = [tf.identity(v) for v in mvars]
            assign_state(state)
            out = {k: tf.identity(v) for k, v in _compat.metrics_result(model).items()}
            with tf.control_dependencies(list(out.values())):
                for v, m in zip(mvars, mine):
                    v.assign(m)
            return out

        if kind == "set_state":
            return wrap(assign_state, [tf.TensorSpec([None], tf.float32)])
        if kind == "results":
            return wrap(results, [tf.TensorSpec([None], tf.float32)])
        dense_vars = self._dense_vars
        dsizes = [int(np.prod(v.shape)) for v in dense_vars]
        if kind == "assign":
            def assign(flat):
                for p, v in zip(tf.split(flat, dsizes), dense_vars):
                    v.assign(tf.reshape(p, v.shape))
            return wrap(assign, [tf.TensorSpec([None], tf.float32)])
        opt = self.optimizer

        def apply(flat, state):
            parts = tf.split(flat, dsizes)
            opt.apply_gradients([(tf.reshape(p, v.shape), v) for p, v in zip(parts, dense_vars)])
            return results(state)
        return wrap(apply, [tf.TensorSpec([None], tf.float32), tf.TensorSpec([None], tf.float32)])


# -- helpers ---------------------------------------------------------------------------------

def broadcast_variables(variables, root_rank: int = 0, comm=None) -> None:
    """Give every rank rank root's values (one fused broadcast of a flat buffer)."""
    variables = list(variables)
    comm = comm if comm is not None else runtime.comm()
    if not variables or comm.size == 1:
        return
    sizes = [int(np.prod(v.shape)) for v in variables]
    flat = np.concatenate([np.asarray(v.numpy(), np.float64).ravel() for v in variables]) \
        if comm.rank == root_rank else np.zeros(sum(sizes), np.float64)
    flat = comm.bcast(flat, root=root_rank, op="broadcast_variables")
    at = 0
    for v, n in zip(variables, sizes):
        dt = v.dtype.as_numpy_dtype if hasattr(v.dtype, "as_numpy_dtype") else v.dtype
        v.assign(flat[at:at + n].reshape(v.shape).astype(dt))
        at += n


def _make_tables(layers, default_optimizer, world: int = 1) -> dict[str, KvTable]:
    """One KvTable per table name; a whole-table max_rows becomes this rank's share,
    ceil(max_rows / world) (the hash partition spreads keys evenly)."""
    specs = {}
    for layer in layers:
        spec = layer.table_spec(default_optimizer)
        prev = specs.setdefault(layer.table, spec)
        if prev != spec:
            raise InvalidArgumentError(
                f"table {layer.table!r} is declared twice with different settings "
                f"(dim, initializer, seed, optimizer, lifecycle): {prev} vs {spec}")
    tables = {}
    for name, (dim, init, seed, opt, life) in sorted(specs.items()):
        life = dict(life)
        if life["max_rows"] is not None:
            life["max_rows"] = -(-int(life["max_rows"]) // world)
        tables[name] = KvTable(dim, name=name, seed=seed, initializer=init, optimizer=opt, **life)
    return tables


def _declared_inputs(model) -> tuple | None:
    """(kind, leaf names, {name: Input}) of a functional model's declared inputs: dict
    keys, or the Inputs' names for a list or a single Input; None for other models."""
    if not getattr(model, "inputs", None):
        return None
    kind, leaves = leaves_of(model.input)
    if kind != "dict":
        leaves = {t.name: t for t in leaves.values()}
    return kind, list(leaves), leaves


def _functional_inputs(model, kind: str, names: list) -> dict:
    """Leaf name -> the functional model's Input (KerasTensor) it feeds, if known."""
    declared = _declared_inputs(model)
    if declared is None:
        return {}
    return {n: t for n, t in declared[2].items() if n in names}


def _trace_spec(name: str, form: list, declared) -> tf.TensorSpec:
    """A placeholder for discovery: ids-like leaves as the model declares them (or int64),
    other leaves as they come."""
    shape_form, kind, ndim, tail = form
    if shape_form == "sparse":
        raise InvalidArgumentError(
            f"input {name or 'x'!r}: a tf.SparseTensor is not taken; convert ids with "
            "tf.RaggedTensor.from_sparse (multi-hot) or pass a dense array")
    if declared is not None:
        dt = tf.as_dtype(declared.dtype)
        shape = [None] + [None if d is None else int(d) for d in declared.shape[1:]]
        if shape_form == "ragged" or kind == "string":
            if not (dt.is_integer or dt == tf.string):
                raise InvalidArgumentError(
                    f"input {name!r}: ragged or string ids need an int or string keras.Input, "
                    f"the model declares {dt.name}")
        return tf.TensorSpec(shape, dt)
    if shape_form == "ragged":
        return tf.TensorSpec([None, None], tf.int64)
    if kind == "string":
        return tf.TensorSpec([None] * max(1, ndim), tf.int64)
    dt = {"float": tf.float32, "bool": tf.bool}.get(kind) or tf.as_dtype(kind)
    return tf.TensorSpec([None] + [None if d is None else int(d) for d in tail], dt)


def _same(a, b) -> bool:
    """Whether two tensors of one graph are one (Keras may hand a layer a new Python
    wrapper of its input)."""
    return a is b or a.name == b.name


def _as_input(t, dtype):
    """Positions (int64) as the model input's declared dtype (Keras would convert)."""
    if dtype == tf.int64:
        return t
    if dtype == tf.string:
        return tf.strings.as_string(t)
    return tf.cast(t, dtype)


def _brief(sig: str) -> str:
    d = json.loads(sig)
    return f"inputs {sorted(d['x'][1])}, labels {d['y']}, sample weights {d['sw']}"


def _finite(loss, dense, rows) -> bool:
    return bool(np.isfinite(loss) and np.isfinite(dense).all()
                and all(np.isfinite(v).all() for v in rows.values()))


def _gathered_grad(g, rows):
    """A rows matrix's gradient as (values, int64 indices): one gradient row per
    position the model gathered (tf.gather's backward), for gather_grad to sum per row
    in C, which costs a fraction of TensorFlow's unsorted_segment_sum over narrow rows.
    A dense gradient (not from gathers) is every row once; none is no row."""
    if isinstance(g, tf.IndexedSlices):
        return g.values, tf.cast(g.indices, tf.int64)
    if g is None:
        return tf.zeros([0, rows.shape[1]], rows.dtype), tf.zeros([0], tf.int64)
    return g, tf.range(tf.shape(rows, out_type=tf.int64)[0])


def _tensor(arr: np.ndarray):
    """A tensor of an array kvcoll made for this step and will not write again: it
    shares the memory when TensorFlow can use it as is (64-byte aligned, contiguous),
    else it is a copy."""
    if arr.size and arr.flags.c_contiguous and arr.ctypes.data % 64 == 0:
        return tf.experimental.dlpack.from_dlpack(arr.__dlpack__())
    return tf.constant(arr)


def _flat(variables) -> np.ndarray:
    if not variables:
        return np.zeros(0, np.float32)
    return np.concatenate([np.asarray(v.numpy(), np.float32).reshape(-1) for v in variables])


def _assign_flat(variables, flat: np.ndarray) -> None:
    at = 0
    for v in variables:
        n = int(np.prod(v.shape))
        v.assign(flat[at:at + n].reshape(v.shape))
        at += n


