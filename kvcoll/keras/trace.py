"""What a model's data looks like, and which of its inputs feed which table.

Before a model's first step every rank must agree on the layout of its batches (the
same features, labels and sample weights everywhere), and kvcoll must learn which
model input feeds which kv.Embedding: the ids are looked up before the model runs, so
a kv.Embedding must be called directly on a model input. `agree_layout` is the
collective that does the first; `discover` traces the model once on placeholders to do
the second (functional and subclassed models alike, no private graph attributes);
`make_tables` creates one KvTable per table name from the layers.
"""

from __future__ import annotations

import json

import numpy as np
import tensorflow as tf

from ..errors import InvalidArgumentError, KvcollError
from ..table import KvTable
from .batch import Feature, Layout, _kind, leaves_of, signature, unpack
from .embedding import recording

__all__ = ["Declared", "agree_layout", "discover", "model_signature", "make_tables"]


class Declared:
    """A functional model's declared inputs: the structure (a dict's keys, a list's or a
    single Input's names) and each name's Input; `kind` None for other models."""

    def __init__(self, model):
        self.kind, self.names, self.inputs = None, [], {}
        if getattr(model, "inputs", None):
            kind, leaves = leaves_of(model.input)
            if kind != "dict":
                leaves = {t.name: t for t in leaves.values()}
            self.kind, self.names, self.inputs = kind, list(leaves), leaves

    def call_structure(self):
        """(kind, names) of the structure the model is called with, when the data's is
        not it (a model declared with a list of Inputs takes a dict keyed by names)."""
        return None if self.kind in (None, "dict") else (self.kind, self.names)

    def canonical(self, x):
        """A functional model declared with a list of Inputs (or one) takes its data as a
        list (or one array) or as a dict keyed by the Inputs' names: kvcoll uses the
        dict."""
        if self.kind in (None, "dict") or isinstance(x, dict):
            return x
        if self.kind == "single" and not isinstance(x, (list, tuple)):
            return {self.names[0]: x}
        if isinstance(x, (list, tuple)) and len(x) == len(self.names):
            return dict(zip(self.names, x))
        return x


def agree_layout(comm, declared: Declared, first, error, x_only: bool = False) -> str | None:
    """Every rank's batch layout, agreed (a collective, with the startup deadline: ranks
    may wait for others still building their model). first: this rank's first data
    element (None if it has none); error: the exception reading it raised, if any.
    Returns the signature every rank with data shares; None when no rank has data.
    Raises the same error on every rank when one could not read its data or the ranks'
    layouts differ."""
    mine = None
    if error is None and first is not None:
        try:
            x, y, sw = unpack(first)
            x = declared.canonical(x)
            mine = signature(x, None, None) if x_only else signature(x, y, sw)
        except Exception as exc:  # noqa: BLE001 - every rank must learn of it
            error = exc
    with comm.deadline("startup"):
        sigs = comm.allgather_json({"sig": mine, "error": None if error is None else
                                    f"{type(error).__name__}: {error}"}, "engine:layout")
    failed = [r for r, s in enumerate(sigs) if s["error"]]
    if failed:
        if error is not None:
            raise error
        raise InvalidArgumentError(f"rank(s) {failed} could not read their first batch: "
                                   f"{sigs[failed[0]]['error']}")
    given = [(r, s["sig"]) for r, s in enumerate(sigs) if s["sig"] is not None]
    if not given:
        return None
    r0, sig = given[0]
    for r, s in given[1:]:
        if s != sig:
            raise InvalidArgumentError(
                f"ranks disagree on the data's layout: rank {r0} has {_brief(sig)}, rank {r} "
                f"has {_brief(s)}; every rank must pass the same features, labels and "
                "sample weights")
    return sig


def model_signature(model, declared: Declared) -> str:
    """The layout signature a functional model's declared inputs imply (no data needed:
    what kv.restore needs before the first fit)."""
    if declared.kind is None:
        raise KvcollError(
            f"{type(model).__name__} declares no inputs (a subclassed model): run "
            "fit, evaluate or predict once before kv.save / kv.restore / kv.export, or "
            "restore inside fit with kv.callbacks.Checkpoint(dir, restore=True)")
    forms = {}
    for name, t in declared.inputs.items():
        dt = np.dtype(tf.as_dtype(t.dtype).as_numpy_dtype) if t.dtype != "string" \
            else np.dtype(object)
        forms[name] = ["array", _kind(dt), len(t.shape),
                       [None if d is None else int(d) for d in t.shape[1:]]]
    return json.dumps({"x": ["dict", forms], "y": None, "sw": None}, sort_keys=True)


def check_same_inputs(layout: Layout, sig: str) -> None:
    """A later data set (validation, prediction) must have the model's first inputs."""
    kind, forms = json.loads(sig)["x"]
    if kind != layout.kind or sorted(forms) != sorted(layout.names):
        raise InvalidArgumentError(
            f"features do not match the model's inputs: this data has {sorted(forms)}, "
            f"the model was first run with {sorted(layout.names)}")


def discover(model, sig: str, declared: Declared) -> tuple[dict, dict]:
    """Trace the model once on placeholders: which input feeds which kv.Embedding.
    Returns ({feature name: Feature}, {feature name: the input's declared dtype})."""
    kind, forms = json.loads(sig)["x"]
    specs = {name: _trace_spec(name, form, declared.inputs.get(name))
             for name, form in forms.items()}
    layout = Layout(sig, {}, declared.call_structure(), check=False)
    calls, got = [], {}

    def trace(leaves):
        got.update(leaves)
        with recording(calls):
            model(layout.rebuild(leaves), training=False)

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
    dtypes = {n: specs[n].dtype for n in features}
    return {n: features[n] for n in sorted(features)}, dtypes


def make_tables(layers, default_optimizer, world: int = 1) -> dict[str, KvTable]:
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


def _brief(sig: str) -> str:
    d = json.loads(sig)
    return f"inputs {sorted(d['x'][1])}, labels {d['y']}, sample weights {d['sw']}"
