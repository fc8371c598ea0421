"""What differs between Keras versions, in one place (Keras 3 here).

Everything kvcoll needs from Keras beyond its public API goes through these few
functions: the model's sublayers, its loss tracker, where an optimizer keeps its
per-parameter state, and its learning rate.
"""

from __future__ import annotations

import keras
import numpy as np

__all__ = ["KERAS_MAJOR", "ADAGRAD_EPSILON_INSIDE", "sublayers", "update_loss_tracker",
           "metric_variables", "metrics_result", "optimizer_slots", "learning_rate",
           "set_learning_rate", "lr_is_schedule", "compute_loss", "callback_list", "flatten_logs",
           "custom_step_methods"]

KERAS_MAJOR = int(keras.__version__.split(".")[0])
# Keras 3's Adagrad divides by sqrt(accum + epsilon); TensorFlow's kernel (and Keras 2)
# by sqrt(accum) + epsilon.
ADAGRAD_EPSILON_INSIDE = KERAS_MAJOR >= 3


def sublayers(model) -> list:
    """Every layer inside the model, nested ones included (not the model itself)."""
    return list(model._flatten_layers(include_self=False))


def update_loss_tracker(model, loss, n) -> None:
    """Add one batch's mean loss with weight n (its samples) to the model's "loss"."""
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


def compute_loss(model, x, y, y_pred, sample_weight, training: bool):
    """The compiled loss plus model.losses (regularizers, add_loss)."""
    if model._compute_loss_has_training_arg:
        return model.compute_loss(x, y, y_pred, sample_weight, training=training)
    return model.compute_loss(x, y, y_pred, sample_weight)


def optimizer_slots(opt) -> list:
    """The optimizer's per-parameter state as lists of variables (in trainable-variable
    order), one list per slot of the matching C kernel's layout: Adam m, v; Adagrad
    accum; SGD none. Lets SSP/ASP start from, and leave behind, the Keras state that
    checkpoints save."""
    if isinstance(opt, keras.optimizers.Adam):
        return [opt._momentums, opt._velocities]
    if isinstance(opt, keras.optimizers.Adagrad):
        return [opt._accumulators]
    return []


def lr_is_schedule(opt) -> bool:
    return isinstance(opt._learning_rate, keras.optimizers.schedules.LearningRateSchedule) \
        or callable(opt._learning_rate) and not hasattr(opt._learning_rate, "assign")


def learning_rate(opt, step: int | None = None) -> float:
    """The optimizer's learning rate now (a schedule: at `step`, default its
    iterations)."""
    lr = opt._learning_rate
    if lr_is_schedule(opt):
        at = int(opt.iterations.numpy()) if step is None else int(step)
        return float(np.asarray(lr(at)))
    return float(np.asarray(lr.numpy() if hasattr(lr, "numpy") else lr))


def set_learning_rate(opt, value: float) -> None:
    opt.learning_rate = value


def compile_token(model):
    """An object that changes with every model.compile (its loss tracker)."""
    return getattr(model, "_loss_tracker", None)


def flatten_logs(model, logs: dict) -> list:
    """Logs as the list evaluate() returns without return_dict (Keras' order)."""
    return model._flatten_metrics_in_order(logs)


def callback_list(callbacks, *, model, verbose, epochs, steps, add_history=True):
    """Keras' container of callbacks, with History and the progress bar added."""
    return keras.callbacks.CallbackList(
        callbacks, add_history=add_history, add_progbar=verbose != 0, verbose=verbose,
        epochs=epochs, steps=steps, model=model)


def custom_step_methods(model) -> list:
    """Names of the step methods the model overrides (kvcoll runs its own steps)."""
    base = keras.Model
    return [n for n in ("train_step", "test_step", "predict_step")
            if getattr(type(model), n) is not getattr(base, n)]
