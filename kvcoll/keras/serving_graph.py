"""The dense part of a model as `kvcoll serve` runs it: a SavedModel that takes each
table's looked-up rows and the id inputs' positions in them (what a training step's
compute takes), plus the model's other inputs, and returns the model's output. The
server looks rows up in its own C tables; TensorFlow never holds a table.

`ServingDense(engine)` is what kvcoll.publish.Publisher takes as its `dense`:

    write_graph(path)   the SavedModel: signature "serving_default" with arguments
                        rows_<i> float32 [rows, dim] per table (i: the table's position in
                        signature()["tables"]), pos_<j> int64 per id input ([batch], or
                        [batch, width] padded with -1 for a multi-hot one) and x_<k> per
                        other input (its Keras dtype and shape); it returns
                        {"prediction": output} (several outputs: their names, or
                        output_<i>). The model's variables are the module's `dense` list.
    weights()           the values of those variables, in that order (the published
                        dense weights: the server assigns them to its copy)
    signature()         JSON: the inputs as a client names them (the names kv.export's
                        serving signature uses), which table each id input reads,
                        multi-hot or not, its padding id, whether training saw it as
                        strings; the graph's argument of each; the outputs; the id hash.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from .. import ids as _ids
from .compute import as_input
from .embedding import rows_scope

__all__ = ["ServingDense", "input_arg_name"]


def input_arg_name(name: str) -> str:
    """What a client calls model input `name` (kv.export's signature argument names: a
    list position or the single input becomes input_<i> / input)."""
    if not name:
        return "input"
    return f"input_{name}" if name.isdigit() else name


def _dtype_of(form) -> tf.DType:
    return {"float": tf.float32, "bool": tf.bool}.get(form[1]) or tf.as_dtype(form[1])


class ServingDense:
    """A set-up engine's dense part for publishing (see the module docstring)."""

    def __init__(self, eng):
        self.eng = eng
        self._output_names = None  # known once write_graph traced the model

    def variables(self) -> list:
        return list(self.eng.model.variables)

    def weights(self) -> list:
        return [np.asarray(v.numpy()) for v in self.variables()]

    def _outputs(self, out) -> dict:
        if isinstance(out, dict):
            return {str(k): v for k, v in out.items()}
        if isinstance(out, (list, tuple)):
            return {f"output_{i}": v for i, v in enumerate(out)}
        return {"prediction": out}

    def signature(self) -> dict:
        eng, lay = self.eng, self.eng.layout
        tables = list(eng.tables)
        strings = _ids.string_features()
        inputs, j, k = [], 0, 0
        for name in lay.names:
            feat = lay.features.get(name)
            entry = {"name": name, "arg": input_arg_name(name)}
            if feat is not None:
                entry.update(kind="ids", table=feat.table, table_index=tables.index(feat.table),
                             multi_hot=bool(feat.multi_hot), padding_id=feat.padding_id,
                             string=lay.forms[name][1] == "string" or name in strings,
                             graph_arg=f"pos_{j}")
                j += 1
            else:
                form = lay.forms[name]
                entry.update(kind="numeric", dtype=_dtype_of(form).name,
                             shape=[None] + list(form[3]), graph_arg=f"x_{k}")
                k += 1
            inputs.append(entry)
        return {"inputs": inputs,
                "tables": [{"name": t, "dim": eng.tables[t].dim, "graph_arg": f"rows_{i}"}
                           for i, t in enumerate(tables)],
                "outputs": self._output_names,
                "id_hash": _ids.id_hash()}

    def write_graph(self, path: str) -> None:
        eng, lay, model = self.eng, self.eng.layout, self.eng.model
        sig = self.signature()
        module = tf.Module()
        module.dense = self.variables()
        spec = {}
        for t in sig["tables"]:
            spec[t["graph_arg"]] = tf.TensorSpec([None, t["dim"]], tf.float32,
                                                 name=t["graph_arg"])
        for e in sig["inputs"]:
            if e["kind"] == "ids":
                shape = [None, None] if e["multi_hot"] else [None]
                spec[e["graph_arg"]] = tf.TensorSpec(shape, tf.int64, name=e["graph_arg"])
            else:
                spec[e["graph_arg"]] = tf.TensorSpec(e["shape"], tf.as_dtype(e["dtype"]),
                                                     name=e["graph_arg"])
        by_name = {e["name"]: e for e in sig["inputs"]}
        rows_arg = {t["name"]: t["graph_arg"] for t in sig["tables"]}

        def serve(**feeds):
            leaves = {}
            for name in lay.names:
                e = by_name[name]
                if e["kind"] == "ids":
                    leaves[name] = as_input(feeds[e["graph_arg"]], eng.input_dtypes[name])
                else:
                    leaves[name] = feeds[e["graph_arg"]]
            rows = {t: feeds[a] for t, a in rows_arg.items()}
            with rows_scope(rows):
                out = model(lay.rebuild(leaves), training=False)
            return self._outputs(out)

        fn = tf.function(serve, autograph=False)
        module.serve = fn
        concrete = fn.get_concrete_function(**spec)
        self._output_names = sorted(concrete.structured_outputs)
        tf.saved_model.save(module, path, signatures={"serving_default": concrete})
