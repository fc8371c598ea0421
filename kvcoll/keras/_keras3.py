"""The Keras 3 adapter (see _compat.py for what each function means).

Everything kvcoll needs from Keras 3 beyond its public API: the model's sublayers, its
loss tracker, where an optimizer keeps its per-parameter state and its learning rate,
and how evaluate orders its logs.
"""

from __future__ import annotations

import numpy as np

from ._which import keras

__all__ = ["ADAGRAD_EPSILON_INSIDE", "sublayers", "custom_step_methods", "is_compiled",
           "compile_token", "compute_loss", "update_loss_tracker", "metric_variables",
           "metrics_result", "flatten_logs", "callback_list", "build_optimizer",
           "optimizer_slots", "optimizer_slot_lists", "lr_is_schedule", "learning_rate",
           "set_learning_rate", "learning_rate_variable", "symbolic_call", "weight_key"]

# Keras 3's Adagrad divides by sqrt(accum + epsilon); TensorFlow's kernel by
# sqrt(accum) + epsilon.
ADAGRAD_EPSILON_INSIDE = True


def sublayers(model) -> list:
    """Every layer inside the model, nested ones included (not the model itself)."""
    return list(model._flatten_layers(include_self=False))


def custom_step_methods(model) -> list:
    """Names of the step methods the model overrides (kvcoll runs its own steps)."""
    base = keras.Model
    return [n for n in ("train_step", "test_step", "predict_step")
            if getattr(type(model), n) is not getattr(base, n)]


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


def metric_variables(model) -> list:
    """The state variables of every metric the model reports (loss tracker, compiled
    metrics, per-output losses, metrics of layers), in a fixed order."""
    out = []
    for m in model.metrics:
        out.extend(m.variables)
    return out


def metrics_result(model) -> dict:
    """The model's metric values, as its own fit would log them."""
    return model.get_metrics_result()


def flatten_logs(model, logs: dict) -> list:
    """Logs as the list evaluate() returns without return_dict (Keras' order)."""
    return model._flatten_metrics_in_order(logs)


def callback_list(callbacks, *, model, verbose, epochs, steps, add_history=True):
    """Keras' container of callbacks, with History and the progress bar added."""
    return keras.callbacks.CallbackList(
        callbacks, add_history=add_history, add_progbar=verbose != 0, verbose=verbose,
        epochs=epochs, steps=steps, model=model)


def build_optimizer(opt, variables) -> None:
    """Create the optimizer's state for `variables` now (checkpoints see it), once."""
    if not opt.built:
        opt.build(variables)


def optimizer_slot_lists(opt) -> dict:
    """The optimizer's per-parameter state by kind ("m", "v", "vhat", "accumulator",
    "momentum"), each a list in trainable-variable order; {} for optimizers kvcoll
    does not name (their state is saved as they list it, for this Keras only)."""
    out = {}
    if isinstance(opt, keras.optimizers.Adam):
        out = {"m": opt._momentums, "v": opt._velocities}
        if getattr(opt, "amsgrad", False):
            out["vhat"] = opt._velocity_hats
    elif isinstance(opt, keras.optimizers.Adagrad):
        out = {"accumulator": opt._accumulators}
    elif isinstance(opt, keras.optimizers.SGD):
        out = {"momentum": opt.momentums} if opt.momentum else {}
    return {k: list(v) for k, v in out.items()}


def optimizer_slots(opt) -> list:
    """The per-parameter state in the matching C kernel's layout (SSP/ASP's dense
    slices): Adam [m, v]; Adagrad [accum]; SGD (no momentum) none."""
    named = optimizer_slot_lists(opt)
    return [named[k] for k in ("m", "v", "accumulator") if k in named]


def _lr(opt):
    return opt._learning_rate


def lr_is_schedule(opt) -> bool:
    lr = _lr(opt)
    return isinstance(lr, keras.optimizers.schedules.LearningRateSchedule) \
        or callable(lr) and not hasattr(lr, "assign")


def learning_rate(opt, step: int | None = None) -> float:
    """The optimizer's learning rate now (a schedule: at `step`, default its
    iterations)."""
    lr = _lr(opt)
    if lr_is_schedule(opt):
        at = int(opt.iterations.numpy()) if step is None else int(step)
        return float(np.asarray(lr(at)))
    return float(np.asarray(lr.numpy() if hasattr(lr, "numpy") else lr))


def set_learning_rate(opt, value: float) -> None:
    opt.learning_rate = value


def learning_rate_variable(opt):
    """The variable holding a constant learning rate (None for a schedule)."""
    return None if lr_is_schedule(opt) else _lr(opt)


def symbolic_call(layer, inputs) -> bool:
    """Whether a layer call builds a functional model. Keras 3 never runs `call` for
    that (it asks compute_output_spec), so: never."""
    return False


def weight_key(variable) -> str:
    """A variable's name as both Keras versions spell it: its layer's name and its own
    ("hidden/kernel"; Keras 3's path names every enclosing layer, Keras 2's only some)."""
    return "/".join(variable.path.split("/")[-2:])

