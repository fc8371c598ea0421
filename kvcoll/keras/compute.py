"""The model's side of a kvcoll step: what kvcoll.step.Loop calls (its `Compute`).

`KerasCompute` holds a Keras model's compiled functions and its metrics' state:

  prepare      a data element checked and normalised into a Batch (kvcoll.keras.batch)
  train        forward and backward on the batch's pulled rows: one tf.function traced
               once (unknown leading dimensions): the compiled loss plus model.losses,
               weighted by this rank's share of the global batch; the metrics updated
               with this rank's samples, from the state it is given
  apply        the summed dense gradient applied by the Keras optimizer, and the logs of
               the (global) metric state, which the metric variables then hold, so what
               Keras reads from the model at an epoch's end is over every rank
  evaluate, predict, logs, rates (each table's learning rate at a step), dense values
  (SSP/ASP's slices), explain (which input made a loss NaN)

Metric states are float32 vectors in a fixed order (every metric's variables): they ride
the step's allreduce, summed over ranks, never averaged, so AUC's confusion counts and
a mean's total and count are those of all the data.

With xla=True the train, test and predict functions are compiled by XLA
(jit_compile). XLA compiles once per input shape, and a batch's unique ids change
every step: each rows matrix is padded to a size compiled already when one holds it
with at most half of it padding, else to a new bucket size (`bucket`: 4 sizes an
octave, at most 25% more rows); the padding rows are zeros no position reads. Each
multi-hot feature's width is padded to a power of two (-1 padded, as the layer masks),
so a run compiles a few times and then never again. A last, shorter batch compiles
once more.
"""

from __future__ import annotations

import json

import numpy as np
import tensorflow as tf

from .._buffers import aligned_empty
from ..exchange.bsp import group_key
from ..exchange.kernels import gather_grad
from ..step import Grads
from . import _compat
from .batch import Batch, Layout, pad_positions, unpack
from .embedding import rows_scope

__all__ = ["KerasCompute", "as_input"]


class KerasCompute:
    """The compiled compute of `model` over `tables` (name -> KvTable) for batches of
    `layout`; jit: compile with tf.function (False: eager, for debugging); xla: XLA."""

    def __init__(self, model, tables: dict, layout: Layout, input_dtypes: dict,
                 canonical, *, synchronous: bool, jit: bool = True, xla: bool = False):
        self.model = model
        self.tables = tables
        self.layout = layout
        self.input_dtypes = input_dtypes
        self.canonical = canonical
        self.synchronous = synchronous
        self.jit, self.xla = jit, xla
        self.targets = (None, None)   # the (labels, sample weights) structures of the data
        self.dense_vars = list(model.trainable_variables)
        self.n_dense = sum(int(np.prod(v.shape)) for v in self.dense_vars)
        self._fns: dict = {}
        self._padded: dict = {}     # XLA: per rows group, the sizes its matrix was padded to
        self._mvars = None
        self._state = None
        self._compiled = None
        self._lr0 = None
        self.check_compiled()

    @property
    def optimizer(self):
        return getattr(self.model, "optimizer", None)

    @property
    def dense_slots(self) -> int:
        opt = self.optimizer
        return len(_compat.optimizer_slots(opt)) if opt is not None else 0

    def check_compiled(self) -> None:
        """Start over if the model was compiled again (a new loss, metrics, optimizer)."""
        token = _compat.compile_token(self.model)
        if token is not self._compiled:
            self._fns.clear()
            self._padded.clear()
            self._mvars, self._state, self._compiled, self._lr0 = None, None, token, None
            opt = self.optimizer
            if opt is not None:
                _compat.build_optimizer(opt, self.dense_vars)

    # -- batches ------------------------------------------------------------------------------

    def prepare(self, element, x_only: bool = False) -> Batch:
        x, y, sw = unpack(element)
        x = self.canonical(x)
        if x_only:
            y = sw = None
        struct = (None, None) if x_only else self.targets
        self.layout.y_struct, self.layout.sw_struct = struct
        return self.layout.batch(x, y, sw)

    def ids(self, batch: Batch | None) -> dict:
        out = {}
        for t in self.tables:
            if batch is None:
                out[t] = np.zeros(0, np.int64)
                continue
            parts = [batch.ids[f][0] for f, spec in self.layout.features.items()
                     if spec.table == t]
            out[t] = np.concatenate(parts) if len(parts) > 1 else parts[0]
        return out

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
                pad = pad_positions(pos, splits)
                if self.xla:       # one compiled shape per power-of-two width
                    pad = _pad_columns(pad, _pow2(pad.shape[1]))
                multi[f] = tf.constant(pad)
        dense = {k: tf.constant(v) for k, v in batch.dense.items()}
        if self.xla:
            rows = {g: _tensor(_pad_rows(m, self._rows_size(g, m.shape[0])))
                    for g, m in pulled.rows.items()}
        else:
            rows = {g: _tensor(m) for g, m in pulled.rows.items()}
        return (_tensor(ids), multi, dense), rows

    def _rows_size(self, group: str, n: int) -> int:
        """The rows a matrix of n rows of `group` is padded to under XLA: the smallest size
        this compute padded it to before that holds n rows and is at most twice n (its
        shape compiled already), else bucket(n). A size compiled once keeps serving: a
        rank compiles again only when its rows outgrow every size it has, or shrink
        below half of them. (Each rank compiles at its own steps, and every compile
        stalls the other ranks at the step's collectives: on 2 ranks the two ranks
        compiled the same size at steps 49 and 104, 1.4 s each, when every step
        took its own bucket.)"""
        sizes = self._padded.setdefault(group, [])
        fits = [s for s in sizes if n <= s <= 2 * n]
        if fits:
            return min(fits)
        size = bucket(n)
        sizes.append(size)
        return size

    @staticmethod
    def _targets(batch: Batch) -> tuple:
        ys = tuple(tf.constant(a) for a in batch.y) if batch.y is not None else ()
        sws = tuple(tf.constant(a) for a in batch.sw) if batch.sw is not None else ()
        return ys, sws

    # -- metric state -------------------------------------------------------------------------

    def state(self) -> np.ndarray:
        """This rank's own metric state (zeros after a reset)."""
        if self._mvars is None:
            training = self.optimizer is not None and self.targets[0] is not None
            self._fn("train" if training else "test")
        if self._state is None:
            self._state = np.zeros(sum(int(np.prod(v.shape)) for v in self._mvars), np.float32)
        return self._state

    def set_state(self, state: np.ndarray) -> None:
        self._state = np.asarray(state, np.float32)

    def reset_state(self) -> None:
        """After model.reset_metrics(): this rank's state starts from zeros."""
        self._state = None

    def logs(self, state: np.ndarray) -> dict:
        return _floats(self._fn("results")(tf.constant(np.asarray(state, np.float32))))

    # -- steps ----------------------------------------------------------------------------------

    def train(self, batch: Batch, pulled, weight: float) -> Grads:
        inputs, rows = self._inputs(batch, pulled)
        fn = self._fn("train")
        loss_w, dense, row_grads, state = fn(inputs, rows, *self._targets(batch),
                                             tf.constant(weight, tf.float32),
                                             tf.constant(self.state()))
        row_np = {g: _row_grad(_view(v), _view(i), pulled.rows[g].shape[0])
                  for g, (v, i) in row_grads.items()}
        loss_w, dense = float(loss_w), dense.numpy()
        finite = bool(np.isfinite(loss_w) and np.isfinite(dense).all()
                      and all(np.isfinite(v).all() for v in row_np.values()))
        return Grads(loss_w, dense if self.n_dense else None, row_np, state.numpy(), finite)

    def zero_grads(self, pulled) -> Grads:
        return Grads(0.0, np.zeros(self.n_dense, np.float32) if self.n_dense else None,
                     {g: np.zeros_like(m) for g, m in pulled.rows.items()}, self.state())

    def apply(self, dense_sum: np.ndarray | None, state: np.ndarray, step: int) -> dict:
        """The summed dense gradient applied by the Keras optimizer (None: nothing to apply,
        SSP/ASP's owners did); the logs of `state`, which the metric variables keep."""
        st = tf.constant(np.asarray(state, np.float32))
        if dense_sum is not None and self.n_dense:
            return _floats(self._fn("apply")(tf.constant(dense_sum, tf.float32), st))
        return _floats(self._fn("results")(st))

    def evaluate(self, batch: Batch, pulled) -> np.ndarray:
        inputs, rows = self._inputs(batch, pulled)
        return self._fn("test")(inputs, rows, *self._targets(batch),
                                tf.constant(self.state())).numpy()

    def predict(self, batch: Batch, pulled):
        inputs, rows = self._inputs(batch, pulled)
        out = self._fn("predict")(inputs, rows)
        return tf.nest.map_structure(lambda t: t.numpy(), out)

    def rates(self, step: int) -> tuple[dict | None, float | None]:
        """Each table's learning rate at `step`: its schedule (if any), scaled by how far
        callbacks (LearningRateScheduler, ReduceLROnPlateau) have moved the dense
        optimizer's learning rate from where it started (None if nothing is scheduled);
        and (SSP/ASP) the dense optimizer's rate at `step`."""
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
        dense_lr = None
        if not self.synchronous and opt is not None and self.n_dense:
            dense_lr = _compat.learning_rate(opt, step - 1)
        return rates or None, dense_lr

    def explain(self, batch: Batch) -> str | None:
        """Which input of the batch is NaN/Inf (the first: labels, sample weights, then
        numeric features), and the row; None when every input is finite."""
        named = [(f"label{'' if len(batch.y or ()) < 2 else f' {i}'}", a)
                 for i, a in enumerate(batch.y or ())]
        named += [(f"sample weight{'' if len(batch.sw or ()) < 2 else f' {i}'}", a)
                  for i, a in enumerate(batch.sw or ())]
        named += [(f"feature {k!r}", v) for k, v in sorted(batch.dense.items())]
        for what, arr in named:
            arr = np.asarray(arr)
            if arr.dtype.kind != "f":
                continue
            bad = ~np.isfinite(arr.reshape(arr.shape[0], -1) if arr.ndim else arr.reshape(1, 1))
            rows = np.flatnonzero(bad.any(axis=1))
            if rows.size:
                return (f"{what} is not finite in {rows.size} row(s) of this rank's batch, "
                        f"the first row {int(rows[0])}")
        return None

    # -- dense parameters of SSP/ASP ----------------------------------------------------------

    def dense_values(self):
        flat = _flat(self.dense_vars)
        opt = self.optimizer
        if opt is None:
            return flat, None, 0
        _compat.build_optimizer(opt, self.dense_vars)
        slots = _compat.optimizer_slots(opt)
        state = np.stack([_flat(v) for v in slots]) if slots else None
        return flat, state, int(opt.iterations.numpy())

    def set_dense_values(self, flat, state=None, updates=None) -> None:
        self._fn("assign")(tf.constant(np.asarray(flat, np.float32)))
        opt = self.optimizer
        if opt is None:
            return
        if state is not None:
            for row, variables in zip(state, _compat.optimizer_slots(opt)):
                _assign_flat(variables, row)
        if updates is not None:
            opt.iterations.assign(int(updates))

    # -- the compiled functions -------------------------------------------------------------

    def tracing_count(self, kind: str) -> int:
        """How many times the compiled `kind` function ("train", "test", "predict") was
        traced (0: never built or not compiled); a step that retraces is a slow step."""
        return sum(f.experimental_get_tracing_count() for k, f in self._fns.items()
                   if k[0] == kind and hasattr(f, "experimental_get_tracing_count"))

    def _fn(self, kind: str):
        self.check_compiled()
        key = (kind, json.dumps(self.targets) if kind in ("train", "test") else None)
        fn = self._fns.get(key)
        if fn is None:
            fn = self._build(kind)
            self._fns[key] = fn
        return fn

    def _spec(self):
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
        ys, sws = self.targets

        def specs(struct):
            return tuple(tf.TensorSpec([None] + [None] * len(tail),
                                       tf.int64 if kind == "int" else tf.float32)
                         for kind, tail in struct[2])
        y_spec = specs(ys) if ys is not None else ()
        sw_spec = specs(sws) if sws is not None else ()
        return (ids, multi, dense), rows, y_spec, sw_spec

    def _build(self, kind: str):
        model, lay = self.model, self.layout
        if kind in ("assign", "results", "apply"):
            return self._build_state_fn(kind)
        (ids_s, multi_s, dense_s), rows_s, y_s, sw_s = self._spec()
        ys_struct, sws_struct = self.targets
        state_s = tf.TensorSpec([None], tf.float32)

        def inputs_of(ids, multi, dense):
            leaves = dict(dense)
            for f, t in multi.items():
                leaves[f] = as_input(t, self.input_dtypes[f])
            if lay.single:
                split = tf.unstack(tf.reshape(ids, [len(lay.single), -1]))
                for f, t in zip(lay.single, split):
                    leaves[f] = as_input(t, self.input_dtypes[f])
            return lay.rebuild(leaves)

        def scope(rows):
            return rows_scope({t: rows[group_key(tab.dim)] for t, tab in self.tables.items()})

        def model_call(ids, multi, dense, rows, training):
            x = inputs_of(ids, multi, dense)
            with scope(rows):
                return x, model(x, training=training)

        custom = set(_compat.custom_step_methods(model))

        def targets_of(y, sw):
            return (lay.rebuild_targets(list(y), ys_struct) if ys_struct else None,
                    lay.rebuild_targets(list(sw), sws_struct) if sws_struct else None)

        def batch_size(ids, multi, dense, y):
            for t in [*dense.values(), *multi.values(), *y]:
                return tf.cast(tf.shape(t)[0], tf.float32)
            return tf.cast(tf.shape(ids)[0] // max(1, len(lay.single)), tf.float32)

        if kind == "train":
            dense_vars = self.dense_vars

            def train(inputs, rows, y, sw, weight, state):
                ids, multi, dense = inputs
                self._assign_state(state)
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
                                        tf.TensorSpec([], tf.float32), state_s])
        if kind == "test":
            def test(inputs, rows, y, sw, state):
                ids, multi, dense = inputs
                self._assign_state(state)
                yy, ss = targets_of(y, sw)
                if "test_step" in custom:   # the user's own, with the rows in place
                    data = (inputs_of(ids, multi, dense),) + tuple(
                        v for v in (yy, ss) if v is not None)
                    with scope(rows):
                        model.test_step(data)
                    return self._state_tensor()
                x, y_pred = model_call(ids, multi, dense, rows, False)
                loss = _compat.compute_loss(model, x, yy, y_pred, ss, False)
                _compat.update_loss_tracker(model, loss, batch_size(ids, multi, dense, y))
                model.compute_metrics(x, yy, y_pred, ss)
                return self._state_tensor()

            return self._traced(test, [(ids_s, multi_s, dense_s), rows_s, y_s, sw_s, state_s])
        if kind == "predict":
            def predict(inputs, rows):
                ids, multi, dense = inputs
                if "predict_step" in custom:   # the user's own, with the rows in place
                    with scope(rows):
                        return model.predict_step((inputs_of(ids, multi, dense),))
                return model_call(ids, multi, dense, rows, False)[1]
            return self._wrap(predict, [(ids_s, multi_s, dense_s), rows_s])
        raise AssertionError(kind)

    def _wrap(self, fn, signature):
        if not self.jit:
            return fn
        return tf.function(fn, input_signature=signature, autograph=False,
                           jit_compile=self.xla or None)

    def _traced(self, fn, signature):
        """fn compiled with `signature` and traced now, on every rank, so the metrics'
        variables exist (and their state has the same size everywhere) before the first
        step; with jit=False the traced graph only serves that and fn runs eagerly."""
        before = _compat.metric_variables(self.model)
        self._mvars = before
        traced = tf.function(fn, input_signature=signature, autograph=False,
                             jit_compile=self.xla or None)
        traced.get_concrete_function()
        self._mvars = _compat.metric_variables(self.model)
        if not self.jit:
            return fn
        if [id(v) for v in self._mvars] != [id(v) for v in before]:
            # the trace created metric variables, which it could not assign: trace again
            return self._wrap(fn, signature)
        return traced

    def _state_tensor(self):
        mvars = _compat.metric_variables(self.model)
        if not mvars:
            return tf.zeros([0], tf.float32)
        return tf.concat([tf.reshape(tf.cast(v, tf.float32), [-1]) for v in mvars], 0)

    def _assign_state(self, state):
        """The metric variables take `state` (skipped while they do not exist yet: the
        first trace creates them)."""
        mvars = self._mvars
        if not mvars:
            return
        sizes = [int(np.prod(v.shape)) for v in mvars]
        for v, part in zip(mvars, tf.split(state, sizes)):
            v.assign(tf.cast(tf.reshape(part, v.shape), v.dtype))

    def _build_state_fn(self, kind: str):
        model = self.model
        if self._mvars is None:
            self._mvars = _compat.metric_variables(model)

        def results(state):
            self._assign_state(state)
            return {k: tf.identity(v) for k, v in _compat.metrics_result(model).items()}

        sig_state = tf.TensorSpec([None], tf.float32)
        if kind == "results":
            return self._wrap_plain(results, [sig_state])
        dense_vars = self.dense_vars
        dsizes = [int(np.prod(v.shape)) for v in dense_vars]
        if kind == "assign":
            def assign(flat):
                for p, v in zip(tf.split(flat, dsizes), dense_vars):
                    v.assign(tf.reshape(p, v.shape))
            return self._wrap_plain(assign, [tf.TensorSpec([None], tf.float32)])
        opt = self.optimizer

        def apply(flat, state):
            parts = tf.split(flat, dsizes)
            opt.apply_gradients([(tf.reshape(p, v.shape), v) for p, v in zip(parts, dense_vars)])
            return results(state)
        return self._wrap_plain(apply, [tf.TensorSpec([None], tf.float32), sig_state])

    def _wrap_plain(self, fn, signature):
        return tf.function(fn, input_signature=signature, autograph=False) if self.jit else fn


# -- helpers ---------------------------------------------------------------------------------

def as_input(t, dtype):
    """Positions (int64) as the model input's declared dtype (Keras would convert)."""
    if dtype == tf.int64:
        return t
    if dtype == tf.string:
        return tf.strings.as_string(t)
    return tf.cast(t, dtype)


def _floats(out: dict) -> dict:
    return {k: float(v) for k, v in out.items()}


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


def bucket(n: int) -> int:
    """A new padded size for a matrix of n rows under XLA (when no size compiled already
    serves: KerasCompute._rows_size): the next of 4, 5, 6 or 7 times a power of two (at
    least 16): four sizes an octave, at most 25% of padding."""
    if n <= 16:
        return 16
    k = max(0, (n - 1).bit_length() - 3)
    step = 1 << k
    return -(-n // step) * step


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _pad_rows(m: np.ndarray, rows: int) -> np.ndarray:
    """m (n, dim) in a 64-byte aligned (rows, dim) matrix, zeros below (no copy when n
    is rows)."""
    if m.shape[0] == rows:
        return m
    out = aligned_empty(rows * m.shape[1], np.float32).reshape(rows, m.shape[1])
    out[:m.shape[0]] = m
    out[m.shape[0]:] = 0.0
    return out


def _pad_columns(pos: np.ndarray, width: int) -> np.ndarray:
    if pos.shape[1] == width:
        return pos
    out = np.full((pos.shape[0], width), -1, np.int64)
    out[:, :pos.shape[1]] = pos
    return out


def _row_grad(values: np.ndarray, indices: np.ndarray, n_rows: int) -> np.ndarray:
    """gather_grad of a rows matrix's gradient; a dense gradient of a padded matrix (every
    row once, XLA's padding included) is cut to the matrix's own rows."""
    if indices.size > n_rows and indices.size == values.shape[0] and \
            indices[-1] == indices.size - 1:
        values, indices = values[:n_rows], indices[:n_rows]
    return gather_grad(values, indices, n_rows)


def _view(t) -> np.ndarray:
    """A read-only array over a tensor's memory (CPU): what a step reads once and does
    not keep; Tensor.numpy() copies (7 MB of row gradients a step at DeepFM's batch of
    4096)."""
    return np.asarray(memoryview(t))


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
