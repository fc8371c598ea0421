"""The dense part of a checkpoint in names every Keras version reads: the model's
weights and its optimizer's state, so a checkpoint written on Keras 3 restores on
Keras 2 and back.

tf.train.Checkpoint(model=..., optimizer=...) names variables by the path of Python
attributes that lead to them, which differs between Keras 3 and Keras 2 (and between
their optimizers). DenseState names them itself, the same on both:

    model/trainable/<i>          the i-th of model.trainable_weights ("model/trainable/0003")
    model/non_trainable/<i>      the i-th of model.non_trainable_weights
    optimizer/iterations         the optimizer's step count
    optimizer/learning_rate      its learning rate (unless it is a schedule)
    optimizer/<slot>/<i>         per-parameter state of the i-th trainable weight: Adam m,
                                 v (vhat), Adagrad accumulator, SGD momentum
    optimizer/keras<N>/<i>       other optimizers' state, in their own order: it restores
                                 on the same Keras major only

and writes them with tf.train.Checkpoint under those names. Its interface is the one
kvcoll.checkpoint.Checkpointer takes for its `dense` part: write(dir) -> file names,
check(dir) (raises CheckpointError naming what differs and why), read(dir), and
snapshot() / rollback(values) to undo a read when a restore fails later.

Checkpoints written before these names (tf.train.Checkpoint(model=..., optimizer=...),
keyed by Python attribute paths) are read the old way, on the Keras that wrote them.

Weights are matched by position, as tf.train.Checkpoint matches a model's layers: both
Keras versions list a model's trainable (and non-trainable) weights layer by layer in
the order the model uses its layers, so the same model code gives the same order, and
layer names (which Keras numbers per process: "dense_3" in a second model) do not
matter. Shapes are checked; an error names the weights that differ.
"""

from __future__ import annotations

import os

import tensorflow as tf

from ..errors import CheckpointError
from . import _compat

__all__ = ["DenseState", "dense_variables", "PREFIX"]

PREFIX = "dense"


def dense_variables(model, optimizer=None) -> dict:
    """{name: variable} of the model's weights and the optimizer's state (see the
    module docstring for the names). The optimizer is built for the model's trainable
    variables if it was not yet."""
    trainable = list(model.trainable_weights)
    out = {f"model/trainable/{i:04d}": v for i, v in enumerate(trainable)}
    out.update({f"model/non_trainable/{i:04d}": v
                for i, v in enumerate(model.non_trainable_weights)})
    if optimizer is None:
        return out
    _compat.build_optimizer(optimizer, trainable)
    out["optimizer/iterations"] = optimizer.iterations
    lr = _compat.learning_rate_variable(optimizer)
    if lr is not None and hasattr(lr, "assign"):
        out["optimizer/learning_rate"] = lr
    named = {id(v) for v in out.values()}
    for slot, variables in _compat.optimizer_slot_lists(optimizer).items():
        for i, state in enumerate(variables):
            out[f"optimizer/{slot}/{i:04d}"] = state
            named.add(id(state))
    others = [v for v in optimizer.variables if id(v) not in named]
    for i, v in enumerate(others):
        out[f"optimizer/keras{_compat.KERAS_MAJOR}/{i}"] = v
    return out


def _described(names, variables: dict) -> list[str]:
    """Names as the error shows them: with the weight's own name where the model has it."""
    return [f"{n} ({_compat.weight_key(variables[n])})" if n in variables else n
            for n in names]


class DenseState:
    """A model's dense part (weights, optimizer state) for kvcoll checkpoints, under
    names both Keras versions read (rank 0 writes, every rank reads)."""

    def __init__(self, model, optimizer=None):
        self.model, self.optimizer = model, optimizer

    def _checkpoint(self) -> tf.train.Checkpoint:
        return tf.train.Checkpoint(**{PREFIX: dense_variables(self.model, self.optimizer)})

    def _legacy(self) -> tf.train.Checkpoint:
        """The layout kvcoll wrote before DenseState's names."""
        if self.optimizer is None:
            return tf.train.Checkpoint(model=self.model)
        return tf.train.Checkpoint(model=self.model, optimizer=self.optimizer)

    @staticmethod
    def _is_legacy(listed) -> bool:
        return not any(n.startswith(PREFIX + "/") for n, _ in listed)

    def write(self, directory: str) -> list[str]:
        self._checkpoint().write(os.path.join(directory, PREFIX))
        return sorted(f for f in os.listdir(directory) if f.startswith(PREFIX + "."))

    def check(self, directory: str) -> None:
        """Raise CheckpointError unless the saved names and shapes are this model's and
        optimizer's, saying which part differs and why."""
        try:
            listed = tf.train.list_variables(os.path.join(directory, PREFIX))
        except Exception as exc:  # noqa: BLE001 - TF raises several kinds
            raise CheckpointError(f"{directory}: the dense checkpoint cannot be read "
                                  f"({type(exc).__name__}: {exc})") from None
        if self._is_legacy(listed):
            return self._check_legacy(directory, listed)
        saved = {_readable(n): tuple(shape) for n, shape in listed
                 if n.startswith(PREFIX + "/")}
        variables = dense_variables(self.model, self.optimizer)
        mine = {n: tuple(v.shape) for n, v in variables.items()}
        if saved == mine:
            return
        only_saved, only_mine = sorted(set(saved) - set(mine)), sorted(set(mine) - set(saved))
        reshaped = sorted(n for n in set(saved) & set(mine) if saved[n] != mine[n])
        differ = only_saved + only_mine
        versions = {n.split("/")[1] for n in differ if n.split("/")[1].startswith("keras")}
        if versions and any(n.startswith("optimizer/") for n in differ):
            why = (f"the optimizer's state ({type(self.optimizer).__name__}) is kept in Keras' "
                   f"own order ({' vs '.join(sorted(versions))}), which crosses Keras versions "
                   "only for Adam, Adagrad and SGD; restore on the Keras major that wrote it, "
                   "or train with one of those")
        elif any(n.startswith("model/") for n in differ + reshaped):
            why = ("the model's weights are matched by their order in the model's trainable "
                   "and non-trainable weights, and their shapes: build the same model, with "
                   "the same layers trainable, as the one that wrote it")
        else:
            why = "build the same model and optimizer as the ones that wrote it"
        raise CheckpointError(
            f"{directory}: the dense model or optimizer differs from the checkpoint's (only "
            f"in the checkpoint: {only_saved[:4]}, only in the model: "
            f"{_described(only_mine[:4], variables)}, other shapes: "
            f"{_described(reshaped[:4], variables)}): {why}")

    def _check_legacy(self, directory: str, listed) -> None:
        import tempfile

        def names(entries):
            return {n: tuple(s) for n, s in entries
                    if not n.startswith("_CHECKPOINTABLE_OBJECT_GRAPH")}

        with tempfile.TemporaryDirectory() as tmp:
            mine = names(tf.train.list_variables(self._legacy().write(os.path.join(tmp, "p"))))
        saved = names(listed)
        if saved != mine:
            raise CheckpointError(
                f"{directory}: the dense model or optimizer differs from the checkpoint's, "
                f"written before kvcoll named dense variables itself (only in the checkpoint: "
                f"{sorted(set(saved) - set(mine))[:3]}, only in the model: "
                f"{sorted(set(mine) - set(saved))[:3]}): restore it on the Keras version that "
                "wrote it, with the same model and optimizer, and save again")

    def read(self, directory: str) -> None:
        prefix = os.path.join(directory, PREFIX)
        legacy = self._is_legacy(tf.train.list_variables(prefix))
        (self._legacy() if legacy else self._checkpoint()).read(
            prefix).assert_existing_objects_matched()

    def _variables(self) -> list:
        return list(dense_variables(self.model, self.optimizer).values())

    def snapshot(self) -> list:
        """The values of every dense and optimizer variable (to roll a restore back)."""
        return [v.numpy() for v in self._variables()]

    def rollback(self, values: list) -> None:
        for v, x in zip(self._variables(), values):
            v.assign(x)


def _readable(key: str) -> str:
    """A checkpoint key ("dense/model.Shidden.Skernel/.ATTRIBUTES/VARIABLE_VALUE") as the
    name DenseState gave it ("model/hidden/kernel"): tf.train.Checkpoint writes "/" in a
    name as ".S" and "." as ".."."""
    local = key.split("/")[1]
    return local.replace("..", "\0").replace(".S", "/").replace("\0", ".")
