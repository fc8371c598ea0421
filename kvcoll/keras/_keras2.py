"""The Keras 2 adapter: tf_keras (TF_USE_LEGACY_KERAS=1), or TensorFlow <= 2.15's keras
(see _compat.py for what each function means).

Where Keras 2 differs from Keras 3 for kvcoll:
- the loss: Keras 2's compute_loss updates the "loss" metric itself (the compiled loss
  container's Mean, weighted by the batch's samples, regularizers included), so
  update_loss_tracker adds nothing (or "loss" would count every batch twice);
- layers: Keras 2 builds a functional model by running each layer's `call` on
  placeholders (Keras 3 asks compute_output_spec), so kv.Embedding must know when a
  call only builds the model (symbolic_call); sublayers come from tf.Module's public
  `submodules`;
- compile: `model.compiled_loss` (public) is made anew by every compile;
- evaluate's list order: Keras 2's rule, from the public `metrics_names`;
- optimizers (Keras 2.11+'s, the only ones kv.DistributedOptimizer takes): the same
  per-parameter state as Keras 3 (Adam _momentums/_velocities, Adagrad _accumulators,
  SGD momentums, Adagrad's epsilon inside the square root) and the same
  `_learning_rate` holding a constant's variable or a schedule;
- variable names: "hidden/kernel:0" (Keras 3: a path "hidden/kernel").
"""

from __future__ import annotations

import numpy as np

from ._which import keras

__all__ = ["ADAGRAD_EPSILON_INSIDE", "sublayers", "custom_step_methods", "is_compiled",
           "compile_token", "compute_loss", "update_loss_tracker", "metric_variables",
           "metrics_result", "flatten_logs", "callback_list", "build_optimizer",
           "optimizer_slots", "optimizer_slot_lists", "lr_is_schedule", "learning_rate",
           "set_learning_rate", "learning_rate_variable", "symbolic_call", "weight_key"]

# Keras 2.11+'s Adagrad divides by sqrt(accum + epsilon), as Keras 3's does.
ADAGRAD_EPSILON_INSIDE = True


def sublayers(model) -> list:
    """Every layer inside the model, nested ones included (not the model itself)."""
    return [m for m in model.submodules if isinstance(m, keras.layers.Layer)]


def custom_step_methods(model) -> list:
    base = keras.Model
    return [n for n in ("train_step", "test_step", "predict_step")
            if getattr(type(model), n) is not getattr(base, n)]


def is_compiled(model) -> bool:
    return getattr(model, "compiled_loss", None) is not None


def compile_token(model):
    """An object that changes with every model.compile (its compiled loss)."""
    return getattr(model, "compiled_loss", None)


def compute_loss(model, x, y, y_pred, sample_weight, training: bool):
    """The compiled loss plus model.losses (regularizers, add_loss); updates "loss"."""
    return model.compute_loss(x, y, y_pred, sample_weight)


def update_loss_tracker(model, loss, n) -> None:
    """Nothing: Keras 2's compute_loss has already added the batch to "loss"."""


def metric_variables(model) -> list:
    out = []
    for m in model.metrics:
        out.extend(m.variables)
    return out


def metrics_result(model) -> dict:
    return model.get_metrics_result()


def flatten_logs(model, logs: dict):
    """Logs as Keras 2's evaluate returns them without return_dict: the metrics in
    metrics_names' order, then any others by name; one value alone is a scalar."""
    names = list(model.metrics_names)
    out = [logs[n] for n in names if n in logs]
    out += [logs[k] for k in sorted(logs) if k not in names]
    return out[0] if len(out) == 1 else out


def callback_list(callbacks, *, model, verbose, epochs, steps, add_history=True):
    return keras.callbacks.CallbackList(
        callbacks, add_history=add_history, add_progbar=verbose != 0, model=model,
        verbose=verbose, epochs=epochs, steps=steps)


def build_optimizer(opt, variables) -> None:
    """Create the optimizer's state for `variables` now (Keras 2's build is a no-op the
    second time)."""
    opt.build(variables)


def optimizer_slot_lists(opt) -> dict:
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
    named = optimizer_slot_lists(opt)
    return [named[k] for k in ("m", "v", "accumulator") if k in named]


def _lr(opt):
    return opt._learning_rate


def lr_is_schedule(opt) -> bool:
    lr = _lr(opt)
    return isinstance(lr, keras.optimizers.schedules.LearningRateSchedule) \
        or callable(lr) and not hasattr(lr, "assign")


def learning_rate(opt, step: int | None = None) -> float:
    lr = _lr(opt)
    if lr_is_schedule(opt):
        at = int(opt.iterations.numpy()) if step is None else int(step)
        return float(np.asarray(lr(at)))
    return float(np.asarray(lr.numpy() if hasattr(lr, "numpy") else lr))


def set_learning_rate(opt, value: float) -> None:
    opt.learning_rate = value


def learning_rate_variable(opt):
    return None if lr_is_schedule(opt) else _lr(opt)


def symbolic_call(layer, inputs) -> bool:
    """Whether this call only builds a functional model (its input is a KerasTensor):
    Keras 2 then runs `call` on placeholders to learn the output's shape."""
    return keras.backend.is_keras_tensor(inputs)


def weight_key(variable) -> str:
    """A variable's name as both Keras versions spell it ("hidden/kernel")."""
    return "/".join(variable.name.split(":")[0].split("/")[-2:])
