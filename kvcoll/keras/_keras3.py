"""The Keras 3 adapter (see _compat.py for what each function means).

What kvcoll needs from Keras 3 beyond its public API, where Keras 2 differs: the
model's sublayers, its loss tracker (Keras 3's compute_loss does not count the batch into
"loss"), what marks a compile, how evaluate orders its logs, variables' names (a path:
"hidden/kernel"). What both share is in _keras_both.py.
"""

from __future__ import annotations

from ._which import keras

__all__ = ["sublayers", "is_compiled", "compile_token", "compute_loss",
           "update_loss_tracker", "flatten_logs", "build_optimizer", "symbolic_call",
           "weight_key", "steps_per_execution", "functional_class", "set_initial_counters"]


def sublayers(model) -> list:
    """Every layer inside the model, nested ones included (not the model itself)."""
    return list(model._flatten_layers(include_self=False))


def is_compiled(model) -> bool:
    return bool(getattr(model, "compiled", False))


def compile_token(model):
    """An object that changes with every model.compile (its loss tracker)."""
    return getattr(model, "_loss_tracker", None)


def compute_loss(model, x, y, y_pred, sample_weight, training: bool):
    """The compiled loss plus model.losses (regularizers, add_loss)."""
    if model._compute_loss_has_training_arg:
        return model.compute_loss(x, y, y_pred, sample_weight, training=training)
    return model.compute_loss(x, y, y_pred, sample_weight)


def update_loss_tracker(model, loss, n) -> None:
    """Add one batch's mean loss with weight n (its samples) to the model's "loss"
    (Keras 3's compute_loss leaves that to train_step)."""
    tracker = getattr(model, "_loss_tracker", None)
    if tracker is not None:
        tracker.update_state(loss, sample_weight=n)


def flatten_logs(model, logs: dict) -> list:
    """Logs as the list evaluate() returns without return_dict (Keras' order)."""
    return model._flatten_metrics_in_order(logs)


def build_optimizer(opt, variables) -> None:
    """Create the optimizer's state for `variables` now (checkpoints see it), once."""
    if not opt.built:
        opt.build(variables)


def symbolic_call(layer, inputs) -> bool:
    """Whether a layer call only works out shapes: Keras 3 runs `call` on placeholders
    when it computes a subclassed model's output spec (fit's symbolic build); a
    functional model's layers it asks compute_output_spec."""
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope

    return in_symbolic_scope()


def steps_per_execution(model) -> int:
    """How many steps one call of the model's step function runs."""
    return int(model.steps_per_execution)


def weight_key(variable) -> str:
    """A variable's name as both Keras versions spell it: its layer's name and its own
    ("hidden/kernel"; Keras 3's path names every enclosing layer, Keras 2's only some)."""
    return "/".join(variable.path.split("/")[-2:])


def functional_class():
    """The class keras.Model(inputs, outputs) makes (a functional model's)."""
    from keras.src.models.functional import Functional

    return Functional


def set_initial_counters(model, epoch, step) -> None:
    """Where the next fit starts (None: as asked): Keras 3 reads the model's initial
    epoch after on_train_begin (as BackupAndRestore sets it); it has no initial step (a
    resumed epoch ends when its data does)."""
    model._initial_epoch = epoch
