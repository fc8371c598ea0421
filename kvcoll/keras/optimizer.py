"""kv.DistributedOptimizer: a Keras optimizer (Horovod-style) that also names the row
optimizer of the embedding tables.

    opt = kv.DistributedOptimizer(keras.optimizers.Adam(1e-3),
                                  sparse=kv.optimizers.Adagrad(0.05))
    model.compile(optimizer=opt, loss=...)          # an ordinary Keras optimizer

The result is an instance of the wrapped optimizer's own class (a subclass made once
per class, as Horovod does), built from its config, so `isinstance(opt,
keras.optimizers.Adam)` holds, `model.compile` takes it, and a saved model records the
plain Keras class. kvcoll's step sums the dense gradients over ranks (one fused
allreduce) before this optimizer applies them, and sends the row gradients to their
owners, where `sparse` (a kvcoll.optimizers row optimizer, applied in C) updates them.

Inside a Horovod job, wrap Horovod's optimizer the same way,
`kv.DistributedOptimizer(hvd.DistributedOptimizer(opt), sparse=...)`: the dense gradients
then ride Horovod's allreduce (dense_backend="horovod", see kvcoll.keras._horovod); the
result stays an instance of Horovod's class, so Horovod's callbacks work on it.

In SSP and ASP the dense parameters live in slices on their owners, updated by the C
kernel that matches this optimizer (`dense_kernel`): SGD without momentum, Adagrad and
Adam, with their hyperparameters and learning rate (a schedule is evaluated at the
worker's step).
"""

from __future__ import annotations

from .. import optimizers as row_optimizers
from ..errors import InvalidArgumentError
from . import _compat, _horovod
from ._compat import keras

__all__ = ["DistributedOptimizer", "is_distributed", "sparse_of", "dense_backend_of",
           "dense_kernel", "DEFAULT_SPARSE"]

DEFAULT_SPARSE = row_optimizers.Adagrad(0.05)
_CLASSES: dict = {}


def DistributedOptimizer(optimizer, sparse=None, dense_backend=None):
    """The Keras optimizer `optimizer` (an instance, or a name such as "adam") as a
    kvcoll optimizer: dense gradients are summed over ranks before it applies them,
    and `sparse` (default Adagrad(0.05)) updates the embedding rows in C.

    dense_backend: who sums the dense gradients in a BSP step: "kvcoll" (one fused MPI
    allreduce with the step's loss and metrics) or "horovod" (Horovod's allreduce; needs
    hvd.init()). Default: "horovod" when `optimizer` is an hvd.DistributedOptimizer,
    else "kvcoll". The rows always go through kvcoll's all-to-all.

    Returns an optimizer of the wrapped optimizer's own class (isinstance holds; a saved
    model records the plain class). Raises InvalidArgumentError when `optimizer` is not
    a Keras optimizer (on Keras 2: not a keras.optimizers.legacy one), `sparse` is not
    a kv.optimizers row optimizer, or dense_backend is not "kvcoll" or "horovod"."""
    if dense_backend is None:
        dense_backend = getattr(optimizer, "_kvcoll_dense_backend", None) or (
            "horovod" if _horovod.is_horovod_optimizer(optimizer) else "kvcoll")
    if dense_backend not in _horovod.BACKENDS:
        raise InvalidArgumentError(
            f"dense_backend must be one of {_horovod.BACKENDS}, got {dense_backend!r}")
    if isinstance(optimizer, str):
        optimizer = keras.optimizers.get(optimizer)
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise InvalidArgumentError(
            f"DistributedOptimizer wraps a keras.optimizers.Optimizer, got {optimizer!r}"
            + (" (Keras 2: one of keras.optimizers, not keras.optimizers.legacy)"
               if _compat.KERAS_MAJOR < 3 else ""))
    sparse = sparse if sparse is not None else getattr(optimizer, "_kvcoll_sparse", DEFAULT_SPARSE)
    if not hasattr(sparse, "_c_fields"):
        raise InvalidArgumentError(
            f"sparse must be a kvcoll.optimizers row optimizer (e.g. kv.optimizers.Adagrad(0.05)),"
            f" got {sparse!r}")
    if _horovod.is_horovod_optimizer(optimizer):
        # Horovod's class is already one made from the Keras class, and its methods call
        # super(self.__class__, ...), so a subclass of it would recurse: a copy of it.
        out = type(optimizer).from_config(optimizer.get_config())
        out._kvcoll_distributed = True
    else:
        base = type(optimizer)
        if getattr(base, "_kvcoll_distributed", False):
            base = base.__mro__[1]
        cls = _CLASSES.get(base)
        if cls is None:
            # Same name and module as the Keras class: a saved model records the plain class.
            cls = type(base.__name__, (base,), {"__module__": base.__module__,
                                                "__qualname__": base.__qualname__,
                                                "_kvcoll_distributed": True})
            _CLASSES[base] = cls
        out = cls.from_config(optimizer.get_config())
    out._kvcoll_sparse = sparse
    out._kvcoll_dense_backend = dense_backend
    return out


def is_distributed(optimizer) -> bool:
    return bool(getattr(optimizer, "_kvcoll_distributed", False))


def dense_backend_of(optimizer) -> str:
    """Who sums a (distributed) optimizer's dense gradients: "kvcoll" or "horovod"."""
    return getattr(optimizer, "_kvcoll_dense_backend", "kvcoll")


def sparse_of(optimizer):
    """The row optimizer a (distributed) optimizer names for the tables."""
    return getattr(optimizer, "_kvcoll_sparse", DEFAULT_SPARSE)


def dense_kernel(opt, learning_rate: float | None = None):
    """The C kernel (a kvcoll row optimizer) that updates dense slices in SSP/ASP as
    the Keras optimizer `opt` would, with its hyperparameters (and `learning_rate`,
    default: its current one). Raises InvalidArgumentError for what has no kernel."""
    cfg = opt.get_config()
    name = type(opt).__name__
    unsupported = [k for k in ("weight_decay", "clipnorm", "global_clipnorm", "clipvalue",
                               "loss_scale_factor", "gradient_accumulation_steps", "use_ema",
                               "amsgrad", "nesterov", "momentum") if cfg.get(k)]
    if unsupported:
        raise InvalidArgumentError(
            f"{name}: ssp/asp have no C kernel for {', '.join(unsupported)}; drop "
            f"{'it' if len(unsupported) == 1 else 'them'} or use --step-mode bsp")
    lr = _compat.learning_rate(opt) if learning_rate is None else learning_rate
    base = type(opt).__mro__[1] if is_distributed(opt) else type(opt)
    if base is keras.optimizers.Adam:
        return row_optimizers.Adam(lr, beta_1=cfg["beta_1"], beta_2=cfg["beta_2"],
                                   epsilon=cfg["epsilon"])
    if base is keras.optimizers.Adagrad:
        return row_optimizers.Adagrad(
            lr, initial_accumulator_value=cfg["initial_accumulator_value"],
            epsilon=cfg["epsilon"], epsilon_inside_sqrt=_compat.ADAGRAD_EPSILON_INSIDE)
    if base is keras.optimizers.SGD:
        return row_optimizers.SGD(lr)
    raise InvalidArgumentError(
        f"{name}: ssp/asp update dense parameters on their owners with kvcoll's C kernels, "
        "which exist for keras.optimizers.SGD (no momentum), Adagrad and Adam; use one of "
        "those or --step-mode bsp")
