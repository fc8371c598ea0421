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
- variable names: "hidden/kernel:0" (Keras 3: a path "hidden/kernel").

Optimizers (Keras 2.11+'s, the only ones kv.DistributedOptimizer takes) keep their state
as Keras 3's do: _keras_both.py.
"""

from __future__ import annotations

from ._which import keras

__all__ = ["sublayers", "is_compiled", "compile_token", "compute_loss",
           "update_loss_tracker", "flatten_logs", "build_optimizer", "symbolic_call",
           "weight_key", "steps_per_execution", "functional_class", "set_initial_counters"]


def sublayers(model) -> list:
    """Every layer inside the model, nested ones included (not the model itself)."""
    return [m for m in model.submodules if isinstance(m, keras.layers.Layer)]


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


def flatten_logs(model, logs: dict):
    """Logs as Keras 2's evaluate returns them without return_dict: the metrics in
    metrics_names' order, then any others by name; one value alone is a scalar."""
    names = list(model.metrics_names)
    out = [logs[n] for n in names if n in logs]
    out += [logs[k] for k in sorted(logs) if k not in names]
    return out[0] if len(out) == 1 else out


def build_optimizer(opt, variables) -> None:
    """Create the optimizer's state for `variables` now (Keras 2's build is a no-op the
    second time)."""
    opt.build(variables)


def symbolic_call(layer, inputs) -> bool:
    """Whether this call only builds a functional model (its input is a KerasTensor):
    Keras 2 then runs `call` on placeholders to learn the output's shape."""
    return keras.backend.is_keras_tensor(inputs)


def weight_key(variable) -> str:
    """A variable's name as both Keras versions spell it ("hidden/kernel")."""
    return "/".join(variable.name.split(":")[0].split("/")[-2:])


def steps_per_execution(model) -> int:
    """How many steps one call of the model's step function runs (Keras 2 lowers it
    for an epoch's last, partial execution)."""
    return int(model._steps_per_execution.numpy())


def functional_class():
    """The class keras.Model(inputs, outputs) makes (a functional model's): tf_keras's,
    or TensorFlow <= 2.15's keras's."""
    try:
        from tf_keras.src.engine.functional import Functional
    except ImportError:
        from keras.src.engine.functional import Functional
    if not issubclass(Functional, keras.Model):
        from keras.src.engine.functional import Functional
    return Functional


class _Counters:
    """What Keras 2's fit asks, after on_train_begin, for its initial epoch and step (as
    BackupAndRestore's training state answers)."""

    def __init__(self, epoch, step):
        self.epoch, self.step = epoch, step

    def maybe_load_initial_counters_from_ckpt(self, steps_per_epoch, initial_epoch,
                                              mode=None):
        return max(initial_epoch, self.epoch), self.step


def set_initial_counters(model, epoch, step) -> None:
    """Where the next fit starts (None: as asked): its initial epoch and step."""
    model._training_state = None if epoch is None else _Counters(epoch, step or 0)
