"""kv.Embedding: the Keras layer over a sharded, growable kvcoll table.

TensorFlow never holds a table. Inside kvcoll's compiled step the layer receives, in
place of its ids, each id's position in the batch's rows matrix (the rows the
exchange pulled for this batch: a matrix sized by the batch, not the vocabulary) and
gathers from it; the matrix reaches the layer through `rows_scope`. Outside that
scope the layer has no rows: calling the model directly raises, and `model.predict`
(a collective) is the way to run it.

While kvcoll discovers which model input feeds which table, the layer runs under
`recording`: it notes the tensor it was called on and returns zeros of its output
shape, so the rest of the model traces.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import tensorflow as tf

from ..errors import InvalidArgumentError
from . import _compat
from ._compat import keras

__all__ = ["Embedding", "rows_scope", "recording", "COMBINERS"]

COMBINERS = (None, "sum", "mean", "sqrtn")
_context = threading.local()


@contextlib.contextmanager
def _scoped(name: str, value):
    prev = getattr(_context, name, None)
    setattr(_context, name, value)
    try:
        yield
    finally:
        setattr(_context, name, prev)


def rows_scope(rows: dict):
    """Run the model with `rows` (table name -> rows matrix) as the tables' rows."""
    return _scoped("rows", rows)


def recording(calls: list):
    """Trace the model with every kv.Embedding appending (layer, its input, the name of
    the one op it made of it) to calls."""
    return _scoped("calls", calls)


class Embedding(keras.layers.Layer):
    """A Keras layer over a sharded, growable kvcoll table.

    table: the table's name; several layers (features) may share one table, with
        the same settings. dim: the row width. combiner: None for one id per sample
        (output [batch, dim]); "sum", "mean" or "sqrtn" for multi-hot features
        (output [batch, dim]). initializer, seed: how new rows start (see
        kvcoll.Initializer). optimizer: the table's row optimizer (default: the
        DistributedOptimizer's `sparse`). padding_id: with a combiner, an id that pads
        the rows of a 2-D (or ragged) input and is not an id (e.g. -1 or 0): dropped
        before the lookup, so it neither reads nor trains a row (default None: every
        value is an id).
        Feature lifecycle (see kvcoll.KvTable): admit_min_count (K >= 2: an id gets a
        row once seen in K steps; before, it reads zeros and its gradients are
        dropped), admit ("exact" or "bloom"), evict_after_steps (TTL in steps),
        max_rows (the whole table's row budget, summed over ranks: each rank keeps
        ceil(max_rows / world)), evict_policy ("lru" or "lfu"); kv.callbacks.Evict
        (or Trainer.evict()) enforces the last three.

    Call it on a model input of ids: 1-D (one id per sample) or, with a combiner, 2-D
    or ragged (several per sample). Ids may be int64, int32 or strings (hashed). The
    model that holds it trains with fit once built as kv.Model (or passed through
    kv.distribute), or through kv.Trainer.

    Raises InvalidArgumentError for a bad setting (dim < 1, an unknown combiner,
    initializer, admit or evict_policy), when called on something other than a model
    input of ids, when two layers share a table with different settings, and at the
    first step of a plain keras.Model (which did not opt in: the message names the fix).
    """

    def __init__(self, table: str, dim: int, *, combiner: str | None = None,
                 initializer=("uniform", -0.05, 0.05), seed: int = 0, optimizer=None,
                 admit_min_count: int = 0, admit: str = "exact",
                 evict_after_steps: int | None = None, max_rows: int | None = None,
                 evict_policy: str = "lru", padding_id: int | None = None, **kwargs):
        super().__init__(**kwargs)  # the default name is Keras' own: two layers may share a table
        if not isinstance(table, str) or not table:
            raise InvalidArgumentError(f"Embedding: table must be a non-empty name, got {table!r}")
        if combiner not in COMBINERS:
            raise InvalidArgumentError(
                f"Embedding {table!r}: combiner must be one of {COMBINERS}, got {combiner!r}")
        if isinstance(dim, bool) or not isinstance(dim, int) or dim < 1:
            raise InvalidArgumentError(f"Embedding {table!r}: dim must be a positive int, got {dim!r}")
        if padding_id is not None and (combiner is None or isinstance(padding_id, bool)
                                       or not isinstance(padding_id, int)):
            raise InvalidArgumentError(
                f"Embedding {table!r}: padding_id pads multi-hot rows: it needs a combiner "
                f"('sum', 'mean' or 'sqrtn') and an int, got combiner={combiner!r}, "
                f"padding_id={padding_id!r}")
        self.padding_id = padding_id
        self.table = table
        self.dim = dim
        self.combiner = combiner
        self.initializer = initializer
        self.seed = seed
        self.row_optimizer = optimizer
        self.lifecycle = dict(admit_min_count=admit_min_count, admit=admit,
                              evict_after_steps=evict_after_steps, max_rows=max_rows,
                              evict_policy=evict_policy)

    def compute_output_shape(self, ids_shape):
        ids_shape = tuple(ids_shape)
        return (ids_shape[:1] if self.combiner is not None else ids_shape) + (self.dim,)

    def compute_output_spec(self, ids):  # Keras 3: the output of a functional model's call
        return keras.KerasTensor(self.compute_output_shape(ids.shape), dtype="float32")

    def __call__(self, *args, **kwargs):
        if args and _compat.symbolic_call(self, args[0]):  # Keras 2 builds a functional model
            with _scoped("building", True):
                return super().__call__(*args, **kwargs)
        return super().__call__(*args, **kwargs)

    @tf.autograph.experimental.do_not_convert  # its errors keep their class (Keras 2)
    def call(self, index, training=None):
        calls = getattr(_context, "calls", None)
        building = getattr(_context, "building", False)
        if calls is not None or building:  # touch the input only through its shape
            shape = tf.shape(index)  # (a string input too: discovery must see the input)
            if calls is not None:  # discovery: note the input
                calls.append((self, index, shape.op.name))
            lead = shape[:1] if self.combiner is not None else shape
            return tf.zeros(tf.concat([lead, [self.dim]], 0), tf.float32)
        if index.dtype == tf.string:  # positions given to an Input declared as strings
            index = tf.strings.to_number(index, out_type=tf.int64)
        rows = getattr(_context, "rows", None)
        if rows is None or self.table not in rows:
            raise InvalidArgumentError(
                f"kv.Embedding {self.name!r} (table {self.table!r}) has no rows here: the "
                "model runs outside kvcoll's steps, which pull the rows. Build the model as "
                "kv.Model(inputs, outputs) (or subclass kv.Model), or opt it in once with "
                "`model = kv.distribute(model)`; then use model.fit / evaluate / predict (or "
                "kv.Trainer)")
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

    def table_spec(self, default_optimizer) -> tuple:
        """What the table behind this layer is made of; layers sharing a table must
        agree on it."""
        return (self.dim, self.initializer, self.seed, self.row_optimizer or default_optimizer,
                tuple(sorted(self.lifecycle.items())))

    def get_config(self):
        cfg = super().get_config()
        cfg.update(table=self.table, dim=self.dim, combiner=self.combiner, seed=self.seed,
                   initializer=self.initializer, padding_id=self.padding_id,
                   optimizer=_optimizer_config(self.row_optimizer, self.table),
                   **self.lifecycle)
        return cfg

    @classmethod
    def from_config(cls, config):
        config = dict(config)
        config["optimizer"] = _optimizer_from_config(config.get("optimizer"))
        if isinstance(config.get("initializer"), list):
            config["initializer"] = tuple(config["initializer"])
        return cls(**config)


Embedding = keras.saving.register_keras_serializable(package="kvcoll",
                                                     name="Embedding")(Embedding)


def _optimizer_config(opt, table: str) -> dict | None:
    """A row optimizer as a config a saved model keeps (None: the DistributedOptimizer's
    `sparse` applies). A learning-rate schedule must be a Keras LearningRateSchedule."""
    if opt is None:
        return None
    config = {f.name: getattr(opt, f.name) for f in dataclasses.fields(opt)}
    lr = config.get("learning_rate")
    if callable(lr):
        if not isinstance(lr, keras.optimizers.schedules.LearningRateSchedule):
            raise InvalidArgumentError(
                f"Embedding {table!r}: its row optimizer's learning rate is a plain callable "
                f"({lr!r}), which a saved model cannot keep; use a "
                "keras.optimizers.schedules.LearningRateSchedule")
        config["learning_rate"] = {"schedule": keras.optimizers.schedules.serialize(lr)}
    return {"class_name": type(opt).__name__, "config": config}


def _optimizer_from_config(config):
    if config is None or hasattr(config, "_c_fields"):
        return config
    from .. import optimizers

    cls = getattr(optimizers, config.get("class_name", ""), None)
    if cls is None or not hasattr(cls, "_c_fields"):
        raise InvalidArgumentError(f"Embedding: unknown row optimizer in the config: {config!r}")
    kwargs = dict(config["config"])
    lr = kwargs.get("learning_rate")
    if isinstance(lr, dict) and "schedule" in lr:
        kwargs["learning_rate"] = keras.optimizers.schedules.deserialize(lr["schedule"])
    return cls(**kwargs)
