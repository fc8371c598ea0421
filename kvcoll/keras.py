"""Where TensorFlow comes in: the Embedding layer, DistributedOptimizer, Trainer.

TensorFlow never holds a table. Per step, the Trainer pulls the rows of the batch's
unique ids of every table (one fused exchange, outside any compiled code), feeds them
to a compiled dense step as ordinary inputs (a matrix sized by the batch, not the
vocabulary: TensorNet's "virtual sparse feature") together with each id feature's
position in that matrix, and gets back the loss, the dense gradients and the gradient
with respect to each rows matrix. Dense gradients are summed over ranks with one fused
allreduce and applied by the wrapped Keras optimizer; row gradients go back to their
owners, which apply the row optimizer in C.

    user = kv.Embedding("user", dim=16)                      # a sharded, growable table
    ids = keras.Input(shape=(), dtype="int64", name="user_id")
    model = keras.Model({"user_id": ids, ...}, head(user(ids), ...))
    opt = kv.DistributedOptimizer(keras.optimizers.Adam(1e-3),
                                  sparse=kv.optimizers.Adagrad(0.05))
    trainer = kv.Trainer(model, keras.losses.BinaryCrossentropy(from_logits=True), opt)
    kv.broadcast_variables(model.variables, root_rank=0)
    for features, labels in batches:
        loss = trainer.train_step(features, labels)
    trainer.finish()                    # uneven data: keep serving peers until all are done

Id features are model inputs that feed a kv.Embedding directly: 1-D int64/int32 arrays
(one id per sample) or, for multi-hot features, a tf.RaggedTensor, a (values,
row_splits) pair, or a 2-D array (fixed count per sample); the layer's combiner ("sum",
"mean", "sqrtn") reduces a sample's ids to one vector.

BSP on N ranks with per-rank batch B/N computes what one rank computes with batch B:
the loss is the mean over the global batch, every rank's gradient is of its share of
that sum, and dense and row gradients are summed over ranks (up to float order).
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

import keras
import numpy as np
import tensorflow as tf

from . import optimizers as row_optimizers
from . import runtime
from .config import BSP, StepMode
from .errors import CommError, InvalidArgumentError, NonFiniteError
from .exchange import BspExchange, SspExchange
from ._buffers import aligned_empty
from .exchange.bsp import group_key
from .exchange.kernels import gather_grad
from .ids import hash_strings
from .table import KvTable

__all__ = ["Embedding", "DistributedOptimizer", "Trainer", "broadcast_variables"]

_COMBINERS = (None, "sum", "mean", "sqrtn")
_context = threading.local()


@contextlib.contextmanager
def _rows_scope(rows: dict):
    prev = getattr(_context, "rows", None)
    _context.rows = rows
    try:
        yield
    finally:
        _context.rows = prev


class Embedding(keras.layers.Layer):
    """A Keras layer over a sharded, growable kvcoll table.

    table: the table's name; several layers (features) may share one table, with
        the same dim. dim: the row width. combiner: None for one id per sample
        (output [batch, dim]); "sum", "mean" or "sqrtn" for multi-hot features
        (output [batch, dim]). initializer, seed: how new rows start (see
        kvcoll.Initializer). optimizer: the table's row optimizer (default: the
        DistributedOptimizer's `sparse`).
        Feature lifecycle (see kvcoll.KvTable): admit_min_count (K >= 2: an id gets a
        row once seen in K steps; before, it reads zeros and its gradients are
        dropped), admit ("exact" or "bloom"), evict_after_steps (TTL in steps),
        max_rows (the whole table's row budget, summed over ranks: each rank keeps
        ceil(max_rows / world)), evict_policy ("lru" or "lfu"); Trainer.evict()
        enforces the last three.

    The layer is called on a keras.Input of ids. Inside kvcoll.Trainer it receives
    each id's position in the batch's rows matrix and gathers from it.
    """

    def __init__(self, table: str, dim: int, *, combiner: str | None = None,
                 initializer=("uniform", -0.05, 0.05), seed: int = 0, optimizer=None,
                 admit_min_count: int = 0, admit: str = "exact",
                 evict_after_steps: int | None = None, max_rows: int | None = None,
                 evict_policy: str = "lru", **kwargs):
        kwargs.setdefault("name", f"kv_embedding_{table}")
        super().__init__(**kwargs)
        if combiner not in _COMBINERS:
            raise InvalidArgumentError(
                f"Embedding {table!r}: combiner must be one of {_COMBINERS}, got {combiner!r}")
        if not isinstance(dim, int) or dim < 1:
            raise InvalidArgumentError(f"Embedding {table!r}: dim must be a positive int, got {dim!r}")
        self.table = table
        self.dim = dim
        self.combiner = combiner
        self.initializer = initializer
        self.seed = seed
        self.row_optimizer = optimizer
        self.lifecycle = dict(admit_min_count=admit_min_count, admit=admit,
                              evict_after_steps=evict_after_steps, max_rows=max_rows,
                              evict_policy=evict_policy)

    def compute_output_spec(self, ids):
        if self.combiner is None:
            shape = tuple(ids.shape) + (self.dim,)
        else:
            shape = (ids.shape[0], self.dim)
        return keras.KerasTensor(shape, dtype="float32")

    def call(self, index):
        rows = getattr(_context, "rows", None)
        if rows is None or self.table not in rows:
            raise InvalidArgumentError(
                f"kv.Embedding {self.name!r} (table {self.table!r}) has no rows: run the "
                "model through kvcoll.Trainer (train_step / predict), which pulls them")
        rows = rows[self.table]
        if self.combiner is None:
            return tf.gather(rows, index)
        # Multi-hot: index is [batch, width] with -1 padding.
        mask = tf.cast(index >= 0, rows.dtype)
        vecs = tf.gather(rows, tf.maximum(index, 0)) * mask[..., None]
        total = tf.reduce_sum(vecs, axis=1)
        if self.combiner == "sum":
            return total
        count = tf.maximum(tf.reduce_sum(mask, axis=1, keepdims=True), 1.0)
        return total / (count if self.combiner == "mean" else tf.sqrt(count))

    def get_config(self):
        cfg = super().get_config()
        cfg.update(table=self.table, dim=self.dim, combiner=self.combiner, seed=self.seed,
                   initializer=self.initializer, **self.lifecycle)
        return cfg


class DistributedOptimizer:
    """Horovod-style wrapper: dense gradients are summed over ranks (one fused
    allreduce of a flat buffer) before the wrapped Keras optimizer applies them;
    embedding gradients go to the rows' owners, where `sparse` (a kvcoll row
    optimizer, applied in C) updates them."""

    def __init__(self, optimizer: keras.optimizers.Optimizer, sparse=None):
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise InvalidArgumentError(
                f"DistributedOptimizer wraps a keras.optimizers.Optimizer, got {optimizer!r}")
        sparse = sparse if sparse is not None else row_optimizers.Adagrad(0.05)
        if not hasattr(sparse, "_c_fields"):
            raise InvalidArgumentError(
                f"sparse must be a kvcoll.optimizers row optimizer, got {sparse!r}")
        self.optimizer = optimizer
        self.sparse = sparse


def broadcast_variables(variables, root_rank: int = 0, comm=None) -> None:
    """Give every rank rank root's values (one fused broadcast of a flat buffer)."""
    variables = list(variables)
    if not variables:
        return
    comm = comm if comm is not None else runtime.comm()
    flat = np.concatenate([np.asarray(v.numpy(), np.float64).ravel() for v in variables]) \
        if comm.rank == root_rank else \
        np.zeros(sum(int(np.prod(v.shape)) for v in variables), np.float64)
    flat = comm.bcast(flat, root=root_rank, op="broadcast_variables")
    at = 0
    for v in variables:
        n = int(np.prod(v.shape))
        v.assign(flat[at:at + n].reshape(v.shape).astype(v.dtype.as_numpy_dtype
                                                           if hasattr(v.dtype, "as_numpy_dtype")
                                                           else v.dtype))
        at += n


@dataclasses.dataclass
class _Feature:
    name: str
    table: str
    multi_hot: bool


class Trainer:
    """Runs training and evaluation of a Keras model with kv.Embedding layers.

    loss: a keras Loss (its per-sample form is used) or a callable
    (labels, outputs) -> per-sample loss.
    step_mode: "bsp", "ssp", "asp" or a kv.StepMode (default: the run's --step-mode);
    staleness: SSP's bound (default: the run's --staleness).

    BSP: every step is a collective (see the module docstring). SSP and ASP
    (kvcoll.exchange.ssp): each rank steps on its own; rows and the dense parameters
    (one flat vector cut into a slice per rank) live on their owners, which apply every
    worker's gradients as they arrive, the dense ones with the C kernel matching the
    Keras optimizer (SGD without momentum, Adagrad, Adam; anything else is an
    InvalidArgumentError). Each worker's gradients are its share of a global step
    (summed over its samples, divided by its sample count times the world size), and
    train_step returns the worker's own mean loss. SSP keeps every worker within
    `staleness` steps of the slowest; ASP lets each run free. Constructing the Trainer
    is then a collective (it duplicates the communicator) and so is finish(): it
    waits until every rank is done and leaves the final model on every rank.
    predict(), kv.save() and table_stats() stay collectives: call them after
    finish(). The dense optimizer's state lives with the slice owners during training;
    they start from the Keras optimizer's (fresh or restored) and finish() writes it
    back, with the update count as its iterations, so checkpoints hold it.
    """

    def __init__(self, model: keras.Model, loss, optimizer: DistributedOptimizer, *,
                 jit: bool = True, comm=None, step_mode=None, staleness: int | None = None):
        if not isinstance(optimizer, DistributedOptimizer):
            raise InvalidArgumentError(
                "optimizer must be kv.DistributedOptimizer(keras_optimizer, sparse=...), "
                f"got {optimizer!r}")
        self.step_mode = _resolve_mode(step_mode, staleness)
        self.model = model
        self.opt = optimizer
        self.comm = comm if comm is not None else runtime.comm()
        self._per_sample_loss = loss.call if isinstance(loss, keras.losses.Loss) else loss
        self.features, layers = _discover(model)
        # single-hot features, in the order of their positions in the packed step input
        self._single = [f for f, spec in self.features.items() if not spec.multi_hot]
        self.tables = _make_tables(layers, optimizer.sparse, self.comm.size)
        self.exchange = BspExchange(self.comm, self.tables)
        self.step = 0
        self._jit = jit
        self._train_fn = None
        self._predict_fn = None
        self._apply_fn = None
        # seconds per phase, summed over steps; "tables" is the part of "exchange" spent
        # in the tables' C calls (BSP)
        self.timings = {"exchange": 0.0, "tables": 0.0, "compute": 0.0, "allreduce": 0.0,
                        "apply": 0.0}
        optimizer.optimizer.build(model.trainable_variables)
        self._n_dense = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
        # SSP / ASP: the asynchronous exchange and what it observed.
        self._async = None
        self._async_started = False
        self._assign_fn = None
        self.local_steps = 0              # train_step calls of this rank (with its own data)
        if self.step_mode.name != "bsp":
            dense_opt = _dense_row_optimizer(optimizer.optimizer)
            self._async = SspExchange(
                self.comm, self.tables,
                None if self.step_mode.name == "asp" else self.step_mode.staleness,
                dense_size=self._n_dense, dense_optimizer=dense_opt)
            self.timings["wait"] = 0.0

    @property
    def staleness_observed(self) -> int:
        """The most steps any data this rank read was behind: its clock minus the slowest
        clock the owners had seen when they served it (0 in BSP)."""
        return self._async.staleness_observed if self._async is not None else 0

    @property
    def max_lead(self) -> int:
        """The most steps this rank ran ahead of the slowest rank it knew of (0 in BSP)."""
        return self._async.max_lead if self._async is not None else 0

    # -- public -----------------------------------------------------------------------

    def train_step(self, features: dict, labels) -> float:
        """One step on this rank's slice of the global batch. BSP: returns the global
        mean loss; every rank must call it (or be inside finish()). SSP/ASP: returns
        this rank's mean loss; ranks step independently."""
        if self._async is not None:
            return self._step_async(self._prepare(features, labels))
        try:
            batch = self._prepare(features, labels)
            err = None
        except InvalidArgumentError as exc:
            batch, err = None, exc
        loss = self._step(batch, active=True, err=err)  # raises on every rank if any rank's batch is bad
        self.local_steps += 1
        return loss

    def finish(self) -> int:
        """Call when this rank's data has run out: keeps answering the other ranks'
        steps (with no samples of its own) until every rank has finished. Returns the
        number of steps it served. SSP/ASP: waits until every rank has finished
        (serving their pulls meanwhile), then leaves every update applied and the same
        final dense model on every rank; returns 0."""
        if self._async is not None:
            self._start_async()
            self.step = self._async.finish(self.step)
            if self._n_dense:
                self._set_dense(self._async.dense())
                slots = _dense_slot_variables(self.opt.optimizer)
                state, updates = self._async.dense_state(len(slots))
                for row, variables in zip(state, slots):
                    _assign_flat(variables, row)
                self.opt.optimizer.iterations.assign(updates)
            return 0
        served = 0
        while self._step(None, active=False) is not None:
            served += 1
        return served

    def predict(self, features: dict) -> np.ndarray:
        """Model outputs for this rank's samples; a collective (every rank calls it,
        possibly with zero samples). Unknown ids read zeros; tables are unchanged."""
        batch = self._prepare(features, None)
        ids = {t: self._table_ids(batch, t) for t in self.tables}
        pulled = self.exchange.pull(ids, self.step, create=False)
        if batch["n"] == 0:
            return np.zeros((0,) + tuple(self.model.outputs[0].shape[1:]), np.float32)
        inputs, rows = self._model_inputs(batch, pulled)
        if self._predict_fn is None:
            self._predict_fn = self._compile(self._predict_impl, inputs, rows, None)
        return self._predict_fn(inputs, rows).numpy()

    def table_stats(self) -> dict:
        """Per table: rows and bytes summed over all ranks (a collective)."""
        local = np.array([[len(t), t.stats().bytes] for t in self.tables.values()], np.int64)
        total = self.comm.allreduce(local.reshape(-1), op="table_stats").reshape(-1, 2)
        return {n: {"rows": int(r), "bytes": int(b)} for n, (r, b) in zip(self.tables, total)}

    def evict(self, step: int | None = None, tables=None) -> float:
        """Apply the eviction policy (kv.Embedding's evict_after_steps, max_rows,
        evict_policy) of every table, or of the named `tables`, to this rank's shards
        as of `step` (default: the current step). Local, not a collective. Returns the
        seconds it took: the pause it adds to training (stagger the tables over steps
        to keep it short)."""
        step = self.step if step is None else int(step)
        t0 = time.perf_counter()
        for name in (self.tables if tables is None else tables):
            self.tables[name].evict(step)
        return time.perf_counter() - t0

    def close(self) -> None:
        if self._async is not None:
            self._async.close()
        for t in self.tables.values():
            t.close()

    # -- one step -----------------------------------------------------------------------

    def _agree(self, headers: np.ndarray, step: int, err) -> bool:
        """The per-step agreement, from every rank's header [active, ok, samples] (sent
        with the pull's id counts): raise on every rank if any rank's batch was bad
        (this rank's own error if it was one of them); else whether any rank is
        active."""
        bad = [r for r in range(self.comm.size) if not headers[r, 1]]
        if bad:
            if err is not None:
                raise err
            raise InvalidArgumentError(
                f"rank(s) {bad} rejected their batch at step {step}; "
                "see the error on those ranks")
        return bool(headers[:, 0].any())

    def _step(self, batch, active: bool, err=None):
        """One BSP step; batch None: this rank has no samples (finished, or its batch
        was bad: err). Returns the global mean loss, or None when no rank was active
        (nothing happened)."""
        step = self.step + 1
        t0 = time.perf_counter()
        ids = {t: (self._table_ids(batch, t) if batch else np.zeros(0, np.int64))
               for t in self.tables}
        n_local = batch["n"] if batch else 0
        header = np.array([int(active), int(err is None), n_local], np.int64)
        pulled = self.exchange.pull(ids, step, header=header,
                                    proceed=lambda h: self._agree(h, step, err))
        if pulled is None:
            return None
        self.step = step
        n_total = float(pulled.headers[:, 2].sum())
        t1 = time.perf_counter()
        if n_local:
            loss_sum, dense_np, row_np, finite = self._compute(batch, pulled)
        else:
            loss_sum, finite = 0.0, True
            dense_np = np.zeros(self._n_dense, np.float32)
            row_np = {g: np.zeros_like(m) for g, m in pulled.rows.items()}
        t2 = time.perf_counter()
        # The row gradients leave at once; one fused allreduce of the dense gradients,
        # the loss sum and the non-finite flags runs meanwhile; the owners apply the
        # rows only once every rank is known to be finite.
        push = self.exchange.push_start(row_np)
        bad = np.zeros(self.comm.size, np.float32)
        bad[self.comm.rank] = 0.0 if finite else 1.0
        flat = np.concatenate([dense_np, np.array([loss_sum], np.float32), bad])
        if not finite:
            flat[:-self.comm.size] = 0.0
        t3 = time.perf_counter()
        total = self.comm.iallreduce(flat, op="allreduce:dense").wait()
        t4 = time.perf_counter()
        nd = total.size - 1 - self.comm.size
        flags = total[-self.comm.size:]
        if flags.any():
            push.finish(step, apply=False)
            ranks = [r for r in range(self.comm.size) if flags[r]]
            raise NonFiniteError(
                f"step {step}: the loss or a gradient is NaN/Inf on rank(s) {ranks}; "
                "no update was applied (lower the learning rate or check the inputs)")
        if n_total == 0:
            push.finish(step, apply=False)
            raise CommError(f"step {step}: no rank had samples")
        scale = np.float32(1.0 / n_total)
        push.finish(step, scale=scale)
        t5 = time.perf_counter()
        self._apply_dense(total[:nd] * scale)
        t6 = time.perf_counter()
        tm = self.timings
        tm["exchange"] += (t1 - t0) + (t3 - t2) + (t5 - t4)
        tm["tables"] = self.exchange.table_seconds
        tm["compute"] += t2 - t1
        tm["allreduce"] += t4 - t3
        tm["apply"] += t6 - t5
        return float(total[nd]) / n_total

    # -- one SSP/ASP step ---------------------------------------------------------------

    def _start_async(self) -> None:
        if not self._async_started:
            self._async_started = True
            if not self._n_dense:
                return
            flat = _flat(self.model.trainable_variables)
            # the Keras optimizer's state (fresh, or restored from a checkpoint)
            slots = _dense_slot_variables(self.opt.optimizer)
            state = np.stack([_flat(v) for v in slots]) if slots else None
            self._async.start_dense(flat, state, int(self.opt.optimizer.iterations.numpy()))

    def _step_async(self, batch) -> float:
        ex = self._async
        self._start_async()
        step = self.step + 1
        t0 = time.perf_counter()
        ex.wait_turn(step)
        t1 = time.perf_counter()
        n_local = batch["n"]
        ids = {t: (self._table_ids(batch, t) if n_local else np.zeros(0, np.int64))
               for t in self.tables}
        pulled, flat = ex.pull(ids, step, dense=bool(n_local))
        t2 = time.perf_counter()
        if n_local:
            if flat is not None:
                self._set_dense(flat)
            loss_sum, dense_np, group_np, finite = self._compute(batch, pulled)
            if not finite:
                raise NonFiniteError(
                    f"rank {self.comm.rank}, step {step}: the loss or a gradient is NaN/Inf; "
                    "nothing was pushed (lower the learning rate or check the inputs)")
            scale = np.float32(1.0 / (n_local * self.comm.size))
            row_np = {g: m * scale for g, m in group_np.items()}
            dense_np = dense_np * scale
        else:
            loss_sum, dense_np = 0.0, None
            row_np = {g: np.zeros_like(m) for g, m in pulled.rows.items()}
        t3 = time.perf_counter()
        ex.push(row_np, dense_np, step)
        t4 = time.perf_counter()
        self.step = step
        self.local_steps += 1
        tm = self.timings
        tm["wait"] += t1 - t0
        tm["exchange"] += (t2 - t1) + (t4 - t3)
        tm["compute"] += t3 - t2
        return loss_sum / n_local if n_local else 0.0

    def _compute(self, batch, pulled):
        """The compiled dense step on one batch: (loss sum, flat dense gradient, the
        gradient of each group's rows matrix (see _model_inputs), whether all of them are
        finite), as numpy."""
        inputs, rows = self._model_inputs(batch, pulled)
        labels = tf.convert_to_tensor(batch["labels"])
        if self._train_fn is None:
            self._train_fn = self._compile(self._train_impl, inputs, rows, labels)
        loss_sum, dense_flat, row_grads = self._train_fn(inputs, rows, labels)
        loss_sum = float(loss_sum)
        dense_np = dense_flat.numpy()
        group_np = {g: gather_grad(v.numpy(), i.numpy(), pulled.rows[g].shape[0])
                    for g, (v, i) in row_grads.items()}
        finite = bool(np.isfinite(loss_sum) and np.isfinite(dense_np).all()
                      and all(np.isfinite(v).all() for v in group_np.values()))
        return loss_sum, dense_np, group_np, finite

    def _set_dense(self, flat: np.ndarray) -> None:
        """Assign the flat dense vector to the model's trainable variables."""
        if self._assign_fn is None:
            dense_vars = self.model.trainable_variables
            sizes = [int(np.prod(v.shape)) for v in dense_vars]

            def assign(f):
                for p, v in zip(tf.split(f, sizes), dense_vars):
                    v.assign(tf.reshape(p, v.shape))
            self._assign_fn = tf.function(
                assign, input_signature=[tf.TensorSpec([None], tf.float32)]) if self._jit \
                else assign
        self._assign_fn(tf.constant(flat, tf.float32))

    def _apply_dense(self, flat: np.ndarray) -> None:
        """Apply the summed dense gradients (one flat vector) with the Keras optimizer."""
        if self._apply_fn is None:
            dense_vars = self.model.trainable_variables

            def apply(g):
                parts = tf.split(g, [int(np.prod(v.shape)) for v in dense_vars])
                self.opt.optimizer.apply_gradients(
                    (tf.reshape(p, v.shape), v) for p, v in zip(parts, dense_vars))
            self._apply_fn = tf.function(
                apply, input_signature=[tf.TensorSpec([None], tf.float32)]) if self._jit \
                else apply
        self._apply_fn(tf.constant(flat, tf.float32))

    # -- compiled parts ------------------------------------------------------------------

    def _train_impl(self, packed, rows, labels):
        with tf.GradientTape() as tape:
            tape.watch(list(rows.values()))
            inputs, table_rows = self._unpack(packed, rows)
            with _rows_scope(table_rows):
                out = self.model(inputs, training=True)
            if labels.shape.rank == out.shape.rank - 1:
                labels = tf.expand_dims(labels, -1)
            per_sample = self._per_sample_loss(labels, out)
            loss_sum = tf.reduce_sum(per_sample)
        dense_vars = self.model.trainable_variables
        grads = tape.gradient(loss_sum, [*dense_vars, *rows.values()])
        dense = tf.concat([tf.reshape(tf.convert_to_tensor(g), [-1]) if g is not None
                           else tf.zeros([int(np.prod(v.shape))], tf.float32)
                           for g, v in zip(grads, dense_vars)], axis=0)
        row_grads = {k: _gathered_grad(g, rows[k]) for k, g in zip(rows, grads[len(dense_vars):])}
        return loss_sum, dense, row_grads

    def _predict_impl(self, packed, rows):
        inputs, table_rows = self._unpack(packed, rows)
        with _rows_scope(table_rows):
            return self.model(inputs, training=False)

    def _unpack(self, packed, rows):
        """The model's inputs and each table's rows from the packed step inputs (see
        _model_inputs): one row matrix per dim, which every table of that dim shares,
        its features' positions already offset to that table's rows."""
        inputs = dict(packed["multi"])
        inputs.update(packed["dense"])
        if self._single:
            ids = tf.reshape(packed["ids"], [len(self._single), -1])
            inputs.update(zip(self._single, tf.unstack(ids)))
        return inputs, {t: rows[group_key(table.dim)] for t, table in self.tables.items()}

    def _compile(self, fn, inputs, rows, labels):
        if not self._jit:
            return fn
        spec = lambda v: tf.TensorSpec([None] * len(v.shape), v.dtype) if v.dtype.is_integer \
            else tf.TensorSpec([None] + list(v.shape[1:]), v.dtype)
        spec_in = tf.nest.map_structure(spec, inputs)
        spec_rows = {g: tf.TensorSpec([None, r.shape[1]], tf.float32) for g, r in rows.items()}
        sig = [spec_in, spec_rows]
        if labels is not None:
            sig.append(tf.TensorSpec([None] + list(labels.shape[1:]), labels.dtype))
        return tf.function(fn, input_signature=sig)

    # -- batch preparation (numpy, per feature) -------------------------------------------

    def _prepare(self, features: dict, labels) -> dict:
        """Check a batch and normalise every id feature to (flat ids, splits or None)."""
        if not isinstance(features, dict):
            raise InvalidArgumentError(f"features must be a dict of arrays, got {type(features)}")
        names = [i.name for i in self.model.inputs]
        unknown = sorted(set(features) - set(names))
        missing = sorted(set(names) - set(features))
        if unknown or missing:
            raise InvalidArgumentError(
                f"features do not match the model's inputs: unknown {unknown}, missing "
                f"{missing}; a feature must name a model input (kv.Embedding inputs name "
                f"their tables: {sorted({f.table for f in self.features.values()})})")
        batch = {"ids": {}, "dense": {}, "n": None}
        sizes = {}
        for name, value in features.items():
            if name in self.features:
                flat, splits = _ids_of(name, value, self.features[name].multi_hot)
                batch["ids"][name] = (flat, splits)
                sizes[name] = flat.size if splits is None else splits.size - 1
            else:
                arr = np.asarray(value)
                if arr.dtype.kind not in "fiub":
                    raise InvalidArgumentError(
                        f"feature {name!r}: numeric input must be a number array, got {arr.dtype}")
                batch["dense"][name] = arr
                sizes[name] = arr.shape[0] if arr.ndim else 1
        if labels is not None:
            lab = np.asarray(labels, np.float32)
            sizes["labels"] = lab.shape[0] if lab.ndim else 1
            batch["labels"] = lab
        if len(set(sizes.values())) > 1:
            raise InvalidArgumentError(
                f"features have different batch sizes: {sizes}; every feature (and the "
                "labels) needs one entry per sample")
        batch["n"] = next(iter(sizes.values())) if sizes else 0
        return batch

    def _table_ids(self, batch, table: str) -> np.ndarray:
        parts = [batch["ids"][f][0] for f, spec in self.features.items() if spec.table == table]
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def _model_inputs(self, batch, pulled):
        """The compiled step's inputs, packed into few tensors (each costs a conversion
        and a function argument): {"ids": the positions of every single-hot feature,
        one int64 vector, feature after feature; "multi": {feature: [batch, width]
        positions, -1 padded}; "dense": {input: values}}, and the rows: one float32
        matrix per dim (a pull's rows, see kvcoll.exchange.bsp.Pull). A position indexes
        its table's dim matrix."""
        n = batch["n"]
        ids = aligned_empty(len(self._single) * n, np.int64)
        multi, at = {}, dict.fromkeys(pulled.pos, 0)
        slot = {f: j for j, f in enumerate(self._single)}
        for f, spec in self.features.items():
            t = spec.table
            flat, splits = batch["ids"][f]
            pos = pulled.pos[t][at[t]:at[t] + flat.size]
            at[t] += flat.size
            if splits is None:
                j = slot[f]
                ids[j * n:(j + 1) * n] = pos
            else:
                multi[f] = tf.constant(_pad(pos, splits))
        dense = {name: tf.constant(arr.astype(np.float32) if arr.dtype.kind == "f" else arr)
                 for name, arr in batch["dense"].items()}
        rows = {g: _tensor(m) for g, m in pulled.rows.items()}
        return {"ids": _tensor(ids), "multi": multi, "dense": dense}, rows


def _gathered_grad(g, rows):
    """A rows matrix's gradient as (values, int64 indices): one gradient row per
    position the model gathered (tf.gather's backward), for kvcoll.table.gather_grad
    to sum per row in C, which costs a fraction of TensorFlow's unsorted_segment_sum
    over narrow rows. A dense gradient (not from gathers) is every row once; none is
    no row."""
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


def _resolve_mode(step_mode, staleness) -> StepMode:
    """The Trainer's step mode: given, or the run's configuration (BSP without init)."""
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


def _flat(variables) -> np.ndarray:
    return np.concatenate([np.asarray(v.numpy(), np.float32).reshape(-1) for v in variables])


def _assign_flat(variables, flat: np.ndarray) -> None:
    at = 0
    for v in variables:
        n = int(np.prod(v.shape))
        v.assign(flat[at:at + n].reshape(v.shape))
        at += n


def _dense_slot_variables(opt) -> list:
    """The Keras optimizer's per-parameter state, one list of variables (in trainable
    variable order) per slot of the matching C kernel's layout: Adam m, v; Adagrad
    accum; SGD none. Lets SSP/ASP start from, and leave behind, the Keras state that
    checkpoints save."""
    if type(opt) is keras.optimizers.Adam:
        return [opt._momentums, opt._velocities]
    if type(opt) is keras.optimizers.Adagrad:
        return [opt._accumulators]
    return []


def _dense_row_optimizer(opt):
    """The C kernel (a kvcoll row optimizer) that updates dense slices in SSP/ASP the
    way the Keras optimizer would, with its hyperparameters. Keras' Adagrad divides by
    sqrt(accum + epsilon), the C kernel (TensorFlow's) by sqrt(accum) + epsilon."""
    cfg = opt.get_config()
    name = type(opt).__name__
    lr = cfg.get("learning_rate")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)):
        raise InvalidArgumentError(
            f"{name}: ssp/asp apply dense gradients on their owners with a constant learning "
            f"rate; got {lr!r} (a schedule); use a float learning rate or --step-mode bsp")
    unsupported = [k for k in ("weight_decay", "clipnorm", "global_clipnorm", "clipvalue",
                               "loss_scale_factor", "gradient_accumulation_steps", "use_ema",
                               "amsgrad", "nesterov") if cfg.get(k)]
    if cfg.get("momentum"):
        unsupported.append("momentum")
    if unsupported:
        raise InvalidArgumentError(
            f"{name}: ssp/asp have no C kernel for {', '.join(unsupported)}; drop "
            f"{'it' if len(unsupported) == 1 else 'them'} or use --step-mode bsp")
    kind = type(opt)
    if kind is keras.optimizers.Adam:
        return row_optimizers.Adam(lr, beta_1=cfg["beta_1"], beta_2=cfg["beta_2"],
                                   epsilon=cfg["epsilon"])
    if kind is keras.optimizers.Adagrad:
        return row_optimizers.Adagrad(
            lr, initial_accumulator_value=cfg["initial_accumulator_value"], epsilon=cfg["epsilon"])
    if kind is keras.optimizers.SGD:
        return row_optimizers.SGD(lr)
    raise InvalidArgumentError(
        f"{name}: ssp/asp update dense parameters on their owners with kvcoll's C kernels, "
        "which exist for keras.optimizers.SGD (no momentum), Adagrad and Adam; use one of "
        "those or --step-mode bsp")


def _ids_of(name, value, multi_hot):
    """(flat int64 ids, row_splits or None) of one id feature."""
    splits = None
    if isinstance(value, tf.RaggedTensor):
        splits = value.row_splits.numpy().astype(np.int64)
        value = value.flat_values.numpy()
    elif isinstance(value, tuple) and len(value) == 2:
        value, splits = value
        splits = np.asarray(splits, np.int64)
    arr = np.asarray(value)
    if arr.dtype.kind in "USO":  # string ids: their XXH64 keys (kvcoll.table.hash_strings)
        try:
            arr = hash_strings(arr)
        except InvalidArgumentError as exc:
            raise InvalidArgumentError(f"feature {name!r}: {exc}") from None
    if arr.dtype not in (np.int64, np.int32):
        raise InvalidArgumentError(
            f"feature {name!r}: ids must be int64 or int32, got {arr.dtype} (string ids are "
            "accepted too: they are hashed with kvcoll.table.hash_strings)")
    if splits is None and arr.ndim == 2:
        if not multi_hot:
            raise InvalidArgumentError(
                f"feature {name!r}: 2-D ids need an Embedding with a combiner")
        splits = np.arange(arr.shape[0] + 1, dtype=np.int64) * arr.shape[1]
        arr = arr.reshape(-1)
    if arr.ndim != 1:
        raise InvalidArgumentError(f"feature {name!r}: ids must be 1-D, got shape {arr.shape}")
    if splits is not None:
        if not multi_hot:
            raise InvalidArgumentError(
                f"feature {name!r}: multi-hot ids need an Embedding with a combiner "
                "('sum', 'mean' or 'sqrtn')")
        if splits.ndim != 1 or splits.size < 1 or splits[0] != 0 or splits[-1] != arr.size \
                or (np.diff(splits) < 0).any():
            raise InvalidArgumentError(f"feature {name!r}: row_splits are not valid for "
                                       f"{arr.size} ids")
    elif multi_hot:
        splits = np.arange(arr.size + 1, dtype=np.int64)  # one id per sample
    return np.ascontiguousarray(arr, np.int64), splits


def _pad(pos: np.ndarray, splits: np.ndarray) -> np.ndarray:
    """Positions of a ragged feature as [batch, max_len] with -1 padding."""
    lengths = np.diff(splits)
    width = int(lengths.max()) if lengths.size else 0
    out = np.full((lengths.size, max(width, 1)), -1, np.int64)
    row = np.repeat(np.arange(lengths.size), lengths)
    col = np.arange(pos.size) - np.repeat(splits[:-1], lengths)
    out[row, col] = pos
    return out


def _discover(model: keras.Model):
    """Which model inputs feed which kv.Embedding (functional models)."""
    layers = [l for l in model._flatten_layers(include_self=False) if isinstance(l, Embedding)]
    if not layers:
        raise InvalidArgumentError("the model has no kv.Embedding layer")
    features = {}
    for layer in layers:
        for node in layer._inbound_nodes:
            for kt in node.input_tensors:
                op = kt._keras_history.operation
                if not isinstance(op, keras.layers.InputLayer):
                    raise InvalidArgumentError(
                        f"kv.Embedding {layer.name!r} must be called directly on a keras.Input "
                        f"of ids, not on the output of {op.name!r}")
                prev = features.get(op.name)
                if prev is not None and prev.table != layer.table:
                    raise InvalidArgumentError(
                        f"input {op.name!r} feeds two tables ({prev.table!r}, {layer.table!r})")
                features[op.name] = _Feature(op.name, layer.table, layer.combiner is not None)
    return features, layers


def _make_tables(layers, default_optimizer, world: int = 1) -> dict[str, KvTable]:
    """One KvTable per table name; a whole-table max_rows becomes this rank's share,
    ceil(max_rows / world) (the hash partition spreads keys evenly)."""
    specs = {}
    for layer in layers:
        spec = (layer.dim, layer.initializer, layer.seed,
                layer.row_optimizer or default_optimizer,
                tuple(sorted(layer.lifecycle.items())))
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
        tables[name] = KvTable(dim, name=name, seed=seed, initializer=init, optimizer=opt,
                               **life)
    return tables
