"""What Keras 3 and Keras 2 (2.11+) share of what kvcoll needs beyond their public API,
reached the same way in both: metrics' state, the callback container, and where an
optimizer keeps its per-parameter state and its learning rate (Adam _momentums /
_velocities, Adagrad _accumulators, SGD momentums, `_learning_rate` holding a constant's
variable or a schedule). See _compat.py for what each function means; what differs is in
_keras3.py and _keras2.py.
"""

from __future__ import annotations

import numpy as np

from ._which import keras

__all__ = ["ADAGRAD_EPSILON_INSIDE", "custom_step_methods", "metric_variables",
           "metrics_result", "callback_list", "optimizer_slot_lists", "optimizer_slots",
           "lr_is_schedule", "learning_rate", "set_learning_rate", "learning_rate_variable"]

# Keras 3's Adagrad, and Keras 2.11+'s, divide by sqrt(accum + epsilon); TensorFlow's
# kernel (and Keras 2's legacy optimizers, which kvcoll does not take) by
# sqrt(accum) + epsilon.
ADAGRAD_EPSILON_INSIDE = True


def custom_step_methods(model) -> list:
    """Names of the step methods the model overrides (kvcoll runs its own steps)."""
    base = keras.Model
    return [n for n in ("train_step", "test_step", "predict_step")
            if getattr(type(model), n) is not getattr(base, n)]


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


def callback_list(callbacks, *, model, verbose, epochs, steps, add_history=True):
    """Keras' container of callbacks, with History and the progress bar added."""
    return keras.callbacks.CallbackList(
        callbacks, add_history=add_history, add_progbar=verbose != 0, verbose=verbose,
        epochs=epochs, steps=steps, model=model)


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
