"""One model's kvcoll state: its tables, its compiled compute and its step loop.

An Engine belongs to one Keras model (`engine_of(model)`). On first use (`begin`, a
collective) it agrees with the other ranks on the layout of the batches
(kvcoll.keras.trace), learns which input feeds which kv.Embedding, creates one KvTable
per table name, builds the compiled compute (kvcoll.keras.compute) and brings up the
step mode's exchange (kvcoll.exchange) and the step loop (kvcoll.step). Everything
that runs steps (the Keras step functions of kvcoll.keras.model, kv.Trainer) and
everything that reads the state (checkpoints, export, callbacks) goes through it.
"""

from __future__ import annotations

import warnings
import weakref

import numpy as np

from .. import runtime
from ..config import BSP, StepMode
from ..errors import InvalidArgumentError, KvcollError
from ..exchange import make_exchange
from ..exchange.wire import wire_of
from ..step import Loop
from . import _compat, _horovod
from ._compat import keras
from .batch import Layout
from .compute import KerasCompute
from .embedding import Embedding
from .optimizer import (DEFAULT_SPARSE, dense_backend_of, dense_kernel, is_distributed,
                        sparse_of)
from .trace import (Declared, agree_layout, check_same_inputs, discover, make_tables,
                    model_signature)

__all__ = ["Engine", "engine_of", "find_engine", "replace_engine", "broadcast_variables"]

_ENGINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


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


def find_engine(model) -> "Engine | None":
    """The model's engine, None if it has none yet."""
    return _ENGINES.get(model)


def replace_engine(model, engine: "Engine") -> None:
    """Make `engine` the model's (kv.Trainer builds its own), closing the old one."""
    old = _ENGINES.get(model)
    if old is not None and old is not engine:
        old.close()
    _ENGINES[model] = engine


def _step_mode(step_mode, staleness) -> StepMode:
    """The step mode given, else the run's (--step-mode, --staleness)."""
    if step_mode is None:
        if not runtime.is_initialized():
            return BSP if staleness is None else StepMode.of("ssp", staleness)
        mode = runtime.config().mode
        return mode if staleness is None or mode.name != "ssp" else StepMode.of("ssp", staleness)
    return StepMode.of(step_mode, staleness)


def _run_config():
    """The run's settings (kvcoll.config), the defaults before kv.init."""
    from ..config import Config

    return runtime.config() if runtime.is_initialized() else Config()


def _pipeline(value) -> tuple[bool, bool]:
    """(pipelined, rows fetched ahead) from a prefetch= argument (True/"on", False/"off",
    "semi"), else the run's --pipeline."""
    if value is None:
        value = _run_config().pipeline
    if isinstance(value, str):
        from ..config import PIPELINES

        if value not in PIPELINES:
            raise InvalidArgumentError(f"prefetch {value!r} is unknown; use True/'on', "
                                       "False/'off' or 'semi' (rows one step stale)")
        return value != "off", value == "semi"
    return bool(value), False


def _xla(value) -> bool:
    """The xla= argument given, else the run's --xla."""
    return bool(value) if value is not None else _run_config().xla == "on"


class Engine:
    """Runs a Keras model with kv.Embedding layers on kvcoll's tables, in BSP, SSP or
    ASP.

    comm: kvcoll's communicator (default: the run's); step_mode, staleness: default the
    run's (--step-mode, --staleness); jit: compile the steps with tf.function; xla: with
    XLA (default: the run's --xla); prefetch: BSP, pipelined steps, the next batch
    prepared and its ids exchanged while a step computes, True/"on", False/"off", or
    "semi": its rows fetched too, one step stale (default: the run's --pipeline);
    wire_dtype: the rows' and row gradients' width on the wire, "fp32",
    "fp16" or "bf16" (default: the run's --wire-dtype).
    """

    def __init__(self, model, *, comm=None, step_mode=None, staleness=None, jit: bool = True,
                 xla: bool | None = None, prefetch: bool | str | None = None,
                 wire_dtype: str | None = None):
        if not isinstance(model, keras.Model):
            raise InvalidArgumentError(
                f"kvcoll runs a {keras.__name__}.Model (Keras {keras.__version__}, the Keras "
                f"tf.keras names here), got {type(model).__module__}.{type(model).__name__}; "
                "build the model with tf.keras (with TF_USE_LEGACY_KERAS=1 that is tf_keras, "
                "Keras 2; otherwise the keras package)")
        if comm is None:
            if not runtime.is_initialized():
                raise KvcollError("call kv.init() before training a model with kv.Embedding "
                                  "layers (it brings MPI up)")
            comm = runtime.comm()
        self.model = model
        self.comm = comm
        self.mode = _step_mode(step_mode, staleness)
        self.jit, self.xla = jit, _xla(xla)
        self.prefetch, self.stale_rows = _pipeline(prefetch)
        self.wire_dtype = wire_of(wire_dtype).name   # checked now, not at the first step
        self.declared = Declared(model)
        self.layout: Layout | None = None
        self.tables: dict | None = None
        self.compute: KerasCompute | None = None
        self.loop: Loop | None = None
        self.input_dtypes: dict = {}
        self._restored_step = 0
        self._after_setup: list = []
        self.elastic = None         # kvcoll.elastic.Session of an elastic BSP run
        self.fit_callbacks: list = []   # fit's callbacks (their on_world_change)
        self.checkpoint_dir = None  # kv.callbacks.Checkpoint's: saves below --min-np

    # -- what it knows ----------------------------------------------------------------------

    @property
    def step(self) -> int:
        """Steps started: in BSP the global step; in SSP/ASP this rank's clock."""
        return self.loop.step if self.loop is not None else self._restored_step

    @property
    def features(self) -> dict:
        return self.layout.features if self.layout is not None else {}

    @property
    def optimizer(self):
        return getattr(self.model, "optimizer", None)

    @property
    def synchronous(self) -> bool:
        return self.mode.name == "bsp"

    @property
    def timings(self) -> dict:
        return self.loop.timings if self.loop is not None else {}

    @property
    def local_steps(self) -> int:
        return self.loop.local_steps if self.loop is not None else 0

    @property
    def last_loss(self) -> float:
        """The last training step's loss (BSP: global; SSP/ASP: this rank's)."""
        return self.loop.last_loss if self.loop is not None else 0.0

    @property
    def last_samples(self) -> int:
        """This rank's samples in the last training step."""
        return self.loop.last_samples if self.loop is not None else 0

    # -- set-up (a collective) ------------------------------------------------------------

    def begin(self, first, error=None, x_only: bool = False) -> tuple | None:
        """Agree with every rank on the layout of this loop's batches, given this rank's
        first data element (None if it has none; `error` if reading it failed), and set
        the engine up on first use (a collective, with the startup deadline). Returns the
        agreed (labels structure, sample weights structure); None when no rank has data."""
        sig = agree_layout(self.comm, self.declared, first, error, x_only)
        if sig is None:
            return None
        with self.comm.deadline("startup"):
            if self.layout is None:
                self._setup(sig)
            else:
                check_same_inputs(self.layout, sig)
        targets = Layout.targets_of(sig)
        if not x_only:
            self.compute.targets = targets
        return targets

    def setup_from_model(self) -> None:
        """Set up without data, from a functional model's declared inputs (a collective):
        what kv.restore needs before the first fit."""
        if self.layout is not None:
            return
        sig = model_signature(self.model, self.declared)
        with self.comm.deadline("startup"):
            self._setup(sig)

    def _setup(self, sig: str) -> None:
        features, self.input_dtypes = discover(self.model, sig, self.declared)
        self.layout = Layout(sig, features, self.declared.call_structure())
        layers = [l for l in _compat.sublayers(self.model) if isinstance(l, Embedding)]
        used = {f.table for f in features.values()}
        layers = [l for l in layers if l.table in used]
        self.tables = make_tables(layers, sparse_of(self.optimizer), self.comm.size)
        self._say_default_rows(layers)
        self.compute = KerasCompute(self.model, self.tables, self.layout, self.input_dtypes,
                                    self.declared.canonical, synchronous=self.synchronous,
                                    jit=self.jit, xla=self.xla)
        self.check_dense_backend()
        kernel = None
        if not self.synchronous and self.compute.n_dense and self.optimizer is not None:
            kernel = dense_kernel(self.optimizer)
        ex = make_exchange(self.comm, self.tables, self.mode, self.compute.n_dense, kernel,
                           wire_dtype=self.wire_dtype)
        reduce = _horovod.allreduce_sum if self.dense_backend() == "horovod" else None
        self.loop = Loop(ex, self.compute, prefetch=self.prefetch, dense_allreduce=reduce,
                         stale_rows=self.stale_rows)
        if getattr(self.comm, "elastic", False) and self.synchronous and reduce is None:
            # a lost rank: the survivors continue in memory
            from ..elastic import Session
            self.elastic = Session(self.loop, on_comm=self._comm_changed,
                                   callbacks=lambda: self.fit_callbacks,
                                   directory=lambda: self.checkpoint_dir)
        if self._restored_step:
            self.loop.set_step(self._restored_step)
        # every rank starts from rank 0's dense weights (Horovod's broadcast at start)
        broadcast_variables(self.model.variables, root_rank=0, comm=self.comm)
        todo, self._after_setup = self._after_setup, []
        for fn in todo:
            fn()

    def _comm_changed(self, comm, owners) -> None:
        """kvcoll.elastic: the survivors of a lost rank go on on `comm`."""
        self.comm = comm

    def _say_default_rows(self, layers) -> None:
        """One rule for a plain Keras optimizer (fit and kv.Trainer alike): the rows of
        tables without their own row optimizer get DEFAULT_SPARSE, and rank 0 says so."""
        opt = self.optimizer
        if opt is None or is_distributed(opt) or self.comm.rank != 0:
            return
        plain = sorted({l.table for l in layers if l.row_optimizer is None})
        if plain:
            warnings.warn(
                f"kvcoll: the rows of table(s) {plain} use the default row optimizer "
                f"{DEFAULT_SPARSE!r}, since {type(opt).__name__} is a plain Keras optimizer; "
                "choose it with kv.DistributedOptimizer(optimizer, sparse=...) or "
                "kv.Embedding(..., optimizer=...)", stacklevel=4)

    def after_setup(self, fn) -> None:
        """Run fn once the engine is set up (now if it is): what needs the tables of a
        model that sets up at its first step (a restore at the start of fit)."""
        if self.tables is not None:
            fn()
        else:
            self._after_setup.append(fn)

    def dense_backend(self) -> str:
        """Who sums a BSP step's dense gradients: "kvcoll" or "horovod"."""
        opt = self.optimizer
        n_dense = self.compute.n_dense if self.compute is not None else 0
        return dense_backend_of(opt) if opt is not None and n_dense else "kvcoll"

    def check_dense_backend(self) -> None:
        """Inside a Horovod job (or with dense_backend="horovod"): one MPI world with
        thread support; Horovod's allreduce only for BSP's dense gradients."""
        backend = self.dense_backend()
        if backend == "horovod" and not self.synchronous:
            raise InvalidArgumentError(
                f"dense_backend='horovod' sums the dense gradients of BSP steps; in "
                f"{self.mode.name} the dense parameters live in slices on their owners: use "
                "--step-mode bsp, or kv.DistributedOptimizer(..., dense_backend='kvcoll')")
        _horovod.check(self.comm, backend, self.optimizer)

    def recompiled(self) -> None:
        """After a model.compile: new loss, metrics, optimizer (a new dense backend)."""
        if self.compute is not None:
            self.compute.check_compiled()
            self.check_dense_backend()
            reduce = _horovod.allreduce_sum if self.dense_backend() == "horovod" else None
            self.loop.dense_allreduce = reduce

    # -- consistency, restore, the end -----------------------------------------------------

    def sync(self) -> None:
        """A consistent snapshot on every rank (for saves, exports, evaluation): in
        SSP/ASP every update applied everywhere; BSP is always consistent between steps."""
        if self.loop is not None:
            self.loop.sync()

    def set_step(self, step: int) -> None:
        """Continue from `step` (a restore); the dense weights the model now holds become
        the slices' (SSP/ASP)."""
        if self.loop is None:
            self._restored_step = int(step)
            return
        self.loop.set_step(int(step))

    def reset_metrics(self) -> None:
        """This rank's metric state from zeros (after model.reset_metrics())."""
        if self.compute is not None:
            self.compute.reset_state()

    def close(self) -> None:
        if self.loop is not None:
            self.loop.close()
        for t in (self.tables or {}).values():
            t.close()
        if _ENGINES.get(self.model) is self:
            del _ENGINES[self.model]


def broadcast_variables(variables, root_rank: int = 0, comm=None) -> None:
    """Give every rank rank root's values of `variables` (TensorFlow or Keras
    variables, the same list on every rank), in one fused broadcast of a flat buffer.
    A collective. root_rank: whose values win; comm: kvcoll's communicator (default
    the run's). Raises KvcollError before kv.init() without a comm, CommTimeoutError
    when a rank does not take part in time."""
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
