"""The dense part of a checkpoint in names every Keras version reads: the model's
weights and its optimizer's state, so a checkpoint written on Keras 3 restores on
Keras 2 and back.

tf.train.Checkpoint(model=..., optimizer=...) names variables by the path of Python
attributes that lead to them, which differs between Keras 3 and Keras 2 (and between
their optimizers). DenseState names them itself, the same on both:

    model/<layer>/<weight>             every weight of model.weights ("model/hidden/kernel")
    optimizer/iterations               the optimizer's step count
    optimizer/learning_rate            its learning rate (unless it is a schedule)
    optimizer/<slot>/<layer>/<weight>  per-parameter state: Adam m, v (vhat), Adagrad
                                       accumulator, SGD momentum
    optimizer/keras<N>/<i>             other optimizers' state, in their own order: it
                                       restores on the same Keras major only

and writes them with tf.train.Checkpoint under those names. Its interface is the one
kvcoll.checkpoint.Checkpointer takes for its `dense` part: write(dir) -> file names,
check(dir) (raises CheckpointError naming what differs and why), read(dir).

Weights are matched by layer and weight name: give layers the same names in both
versions (functional models built by the same code get the same automatic names).
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
    out = {}
    keys = [_compat.weight_key(v) for v in model.weights]
    repeated = {k for k in keys if keys.count(k) > 1}
    for v, k in zip(model.weights, keys):
        # two weights of one name (layers named alike): their full names, this Keras only
        name = f"model/keras{_compat.KERAS_MAJOR}/{_full(v)}" if k in repeated else f"model/{k}"
        out[name] = v
    if optimizer is None:
        return out
    trainable = list(model.trainable_variables)
    _compat.build_optimizer(optimizer, trainable)
    out["optimizer/iterations"] = optimizer.iterations
    lr = _compat.learning_rate_variable(optimizer)
    if lr is not None and hasattr(lr, "assign"):
        out["optimizer/learning_rate"] = lr
    named = {id(v) for v in out.values()}
    for slot, variables in _compat.optimizer_slot_lists(optimizer).items():
        for var, state in zip(trainable, variables):
            out[f"optimizer/{slot}/{_compat.weight_key(var)}"] = state
            named.add(id(state))
    others = [v for v in optimizer.variables if id(v) not in named]
    for i, v in enumerate(others):
        out[f"optimizer/keras{_compat.KERAS_MAJOR}/{i}"] = v
    return out


def _full(v) -> str:
    return getattr(v, "path", None) or v.name.split(":")[0]


class DenseState:
    """A model's dense part (weights, optimizer state) for kvcoll checkpoints, under
    names both Keras versions read (rank 0 writes, every rank reads)."""

    def __init__(self, model, optimizer=None):
        self.model, self.optimizer = model, optimizer

    def _checkpoint(self) -> tf.train.Checkpoint:
        return tf.train.Checkpoint(**{PREFIX: dense_variables(self.model, self.optimizer)})

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
        saved = {_readable(n): tuple(shape) for n, shape in listed
                 if n.startswith(PREFIX + "/")}
        mine = {n: tuple(v.shape) for n, v in
                dense_variables(self.model, self.optimizer).items()}
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
            why = ("the model's weights are matched by layer and weight name: build the same "
                   "model, with the same layer names, as the one that wrote it")
        else:
            why = "build the same model and optimizer as the ones that wrote it"
        raise CheckpointError(
            f"{directory}: the dense model or optimizer differs from the checkpoint's (only "
            f"in the checkpoint: {only_saved[:4]}, only in the model: {only_mine[:4]}, other "
            f"shapes: {reshaped[:4]}): {why}")

    def read(self, directory: str) -> None:
        self._checkpoint().read(os.path.join(directory, PREFIX)).assert_existing_objects_matched()


def _readable(key: str) -> str:
    """A checkpoint key ("dense/model.Shidden.Skernel/.ATTRIBUTES/VARIABLE_VALUE") as the
    name DenseState gave it ("model/hidden/kernel"): tf.train.Checkpoint writes "/" in a
    name as ".S" and "." as ".."."""
    local = key.split("/")[1]
    return local.replace("..", "\0").replace(".S", "/").replace("\0", ".")
