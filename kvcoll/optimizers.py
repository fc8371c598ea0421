"""Row optimizers: how the C tables update the rows a batch touched.

Each class is a frozen, validated description; the update itself runs in C
(csrc/kv_optim.c, where every rule and slot layout is written out next to its code).
Updates are lazy: a row absent from a batch keeps its value and its optimizer state,
and a row present several times in a batch is updated once with the sum of its
gradients.

    >>> from kvcoll.optimizers import Adagrad
    >>> Adagrad(0.05)
    Adagrad(learning_rate=0.05, initial_accumulator_value=0.1, epsilon=1e-07, epsilon_inside_sqrt=False)

SGD, Adagrad, Adam and Ftrl compute what TensorFlow's kernels compute
(ResourceSparseApplyAdagradV2, ResourceApplyAdam on the batch's rows,
ResourceSparseApplyFtrlV2) and take Keras' parameter names and defaults; Keras 3's
own variants are options: `Adagrad(epsilon_inside_sqrt=True)` (Keras 3 divides by
sqrt(accum + epsilon)) and `Ftrl(beta=...)`. GroupAdam and
GroupAdagrad are TFPlus's sparse-group-lasso optimizers (Yue et al., "Adaptive
Optimizers with Sparse Group Lasso for Neural Networks in CTR Prediction", ECML PKDD
2021) with TFPlus's parameter names and defaults: a row whose group norm falls under
the l21 threshold becomes exactly zero. RowWiseAdagrad is FBGEMM's
EXACT_ROWWISE_ADAGRAD, TorchRec's optimizer for its fused tables: one accumulator per
row instead of one per float.

Every optimizer's `learning_rate` is a positive float or a schedule: a callable of the
integer step returning a float, such as a `keras.optimizers.schedules.
LearningRateSchedule` (its tensor is converted with float()). `learning_rate_at(step)`
evaluates it; the training loop passes the value to each table per step
(`KvTable.set_learning_rate`), counting steps as Keras' `optimizer.iterations` does (0
for the first update). A table starts with `learning_rate_at(0)`.

    >>> Adagrad(lambda step: 0.1 * 0.5 ** (step // 1000)).learning_rate_at(2500)
    0.025
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import struct
from typing import Callable, Union

from .errors import InvalidArgumentError

# A learning rate: a float, or a schedule (a callable of the integer step).
LearningRate = Union[float, Callable[[int], float]]

__all__ = ["SGD", "Adagrad", "Adam", "Ftrl", "GroupAdagrad", "GroupAdam", "RowWiseAdagrad"]


def _as_f32(x: float) -> float:
    """x rounded to float32, as the C side will store it (inf when out of range)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _real(value, what: str) -> float:
    """value as a float that is finite in float32; `what` names it in the error."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"{what} must be a number, got {value!r}")
    x = float(value)
    if not math.isfinite(_as_f32(x)):
        raise InvalidArgumentError(f"{what} must be a finite float32, got {value!r}")
    return x


def _number(opt, field: str) -> float:
    return _real(getattr(opt, field), f"{type(opt).__name__}: {field}")


def _checked_learning_rate(value, what: str,
                           fix: str = "pass a positive learning rate such as 0.01"
                           ) -> float:
    """value as a learning rate: a number, finite and > 0 once rounded to float32 (what
    the C side stores). Also KvTable.set_learning_rate's check."""
    x = _real(value, what)
    if not _as_f32(x) > 0:
        raise InvalidArgumentError(f"{what} must be > 0 (as float32), got {x!r}; {fix}")
    return x


def _is_schedule(value) -> bool:
    return callable(value) and not isinstance(value, numbers.Real)


class _RowOptimizer:
    """What every row optimizer shares: its learning rate, a float or a schedule."""

    def _check_learning_rate(self) -> None:
        lr = self.learning_rate
        if _is_schedule(lr):
            self.learning_rate_at(0)  # a schedule that fails at once fails here
        elif isinstance(lr, bool) or not isinstance(lr, numbers.Real):
            raise InvalidArgumentError(
                f"{type(self).__name__}: learning_rate must be a positive float or a "
                f"schedule (a callable of the integer step returning a float), got {lr!r}")
        else:
            _checked_learning_rate(lr, f"{type(self).__name__}: learning_rate")

    @property
    def is_scheduled(self) -> bool:
        """True if learning_rate is a schedule (a callable of the step)."""
        return _is_schedule(self.learning_rate)

    def learning_rate_at(self, step: int) -> float:
        """The learning rate for `step` (>= 0, counted as Keras' optimizer.iterations):
        the float itself, or float(schedule(step)), checked positive and finite."""
        name = type(self).__name__
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise InvalidArgumentError(
                f"{name}: step must be an integer >= 0, got {step!r}")
        lr = self.learning_rate
        if not _is_schedule(lr):
            return float(lr)
        value = lr(int(step))
        what = f"{name}: learning_rate at step {int(step)} (from the schedule {lr!r})"
        try:
            x = float(value)
        except (TypeError, ValueError):
            raise InvalidArgumentError(
                f"{what} must be a number, got {value!r}; the schedule must return a "
                "float or a scalar tensor") from None
        return _checked_learning_rate(
            x, what, "the schedule must return finite values > 0 at every step")


def _non_negative(opt, field: str) -> None:
    x = _number(opt, field)
    if not x >= 0:
        raise InvalidArgumentError(
            f"{type(opt).__name__}: {field} must be >= 0, got {x!r}; "
            "use 0.0 to switch it off")


def _decay(opt, field: str) -> None:
    x = _number(opt, field)
    if not (x >= 0 and _as_f32(x) < 1):
        raise InvalidArgumentError(
            f"{type(opt).__name__}: {field} must be in [0, 1) (as float32), got {x!r}; "
            "typical values are 0.9 for the first moment and 0.999 for the second")


def _non_positive(opt, field: str) -> None:
    x = _number(opt, field)
    if not x <= 0:
        raise InvalidArgumentError(
            f"{type(opt).__name__}: {field} must be <= 0, got {x!r}; "
            "-0.5 gives the usual 1/sqrt(accumulator) step size")


def _flag(opt, field: str) -> None:
    value = getattr(opt, field)
    if not isinstance(value, bool):
        raise InvalidArgumentError(
            f"{type(opt).__name__}: {field} must be True or False, got {value!r}")


def _fields(kind: str, flags: tuple = (), **kw) -> dict:
    """kv_optim_t's fields by their C names; the ones a kind does not use are 0.
    flags: names of KV_OPTF_* bits (table.py maps them: "eps_inside_sqrt", "wd_l2",
    "wd_decoupled")."""
    out = {"kind": kind, "per_row_step": 0, "flags": tuple(flags), "lr": 0.0, "beta1": 0.0,
           "beta2": 0.0, "epsilon": 0.0, "initial_accumulator": 0.0, "lr_power": 0.0,
           "l1": 0.0, "l2": 0.0, "l21": 0.0, "l2_shrinkage": 0.0, "beta": 0.0,
           "weight_decay": 0.0}
    out.update({k: (int(v) if k == "per_row_step" else float(v)) for k, v in kw.items()})
    return out


@dataclasses.dataclass(frozen=True)
class SGD(_RowOptimizer):
    """Plain gradient descent: w -= learning_rate * g. No state.

    learning_rate: step size, > 0, or a schedule of the step (see the module).
    """

    learning_rate: LearningRate

    def __post_init__(self):
        self._check_learning_rate()

    def _c_fields(self) -> dict:
        return _fields("sgd", lr=self.learning_rate_at(0))

    def _slot_layout(self, dim: int) -> list:
        return []


@dataclasses.dataclass(frozen=True)
class Adagrad(_RowOptimizer):
    """Adagrad: accum += g^2, then one of two published rules for epsilon:
      epsilon_inside_sqrt=False (the default): TF's ResourceSparseApplyAdagradV2, which
        Keras 2 and tf.compat.v1 run: w -= learning_rate * g / (sqrt(accum) + epsilon)
      epsilon_inside_sqrt=True: Keras 3's Adagrad:
        w -= learning_rate * g / sqrt(accum + epsilon)
    They differ where accum is small (near accum = 0, TF's step is 1 / sqrt(epsilon)
    times Keras 3's); the default keeps existing runs and checkpoints as they were.

    learning_rate: step size, > 0, or a schedule of the step (see the module).
    initial_accumulator_value: accum of a new row, >= 0 (0 with epsilon 0 divides by
        zero on a zero gradient).
    epsilon: added to sqrt(accum) (or to accum, see above), >= 0.
    epsilon_inside_sqrt: which of the two rules; True for Keras 3's.
    Slots per row: accum[dim].
    """

    learning_rate: LearningRate
    initial_accumulator_value: float = 0.1
    epsilon: float = 1e-7
    epsilon_inside_sqrt: bool = False

    def __post_init__(self):
        self._check_learning_rate()
        _non_negative(self, "initial_accumulator_value")
        _non_negative(self, "epsilon")
        _flag(self, "epsilon_inside_sqrt")

    def _c_fields(self) -> dict:
        return _fields("adagrad", lr=self.learning_rate_at(0), epsilon=self.epsilon,
                       initial_accumulator=self.initial_accumulator_value,
                       flags=("eps_inside_sqrt",) if self.epsilon_inside_sqrt else ())

    def _slot_layout(self, dim: int) -> list:
        return [("accum", dim)]


@dataclasses.dataclass(frozen=True)
class Adam(_RowOptimizer):
    """Adam as TF's ResourceApplyAdam (Keras' Adam), applied lazily to the batch's rows:
    m = beta_1 m + (1 - beta_1) g; v = beta_2 v + (1 - beta_2) g^2;
    w -= lr_t m / (sqrt(v) + epsilon), lr_t = lr sqrt(1 - beta_2^t) / (1 - beta_1^t).

    learning_rate: step size, > 0, or a schedule of the step (see the module).
    beta_1, beta_2: decay of the first and second moments, in [0, 1).
    epsilon: added to sqrt(v), >= 0.
    per_row_step: False: t is the global training step passed to apply_gradients (what
        TF does). True: t is the row's own update count, so the bias correction of a
        rarely seen row starts afresh instead of assuming it was updated every step.
    Slots per row: m[dim], v[dim], step (the row's update count, uint32 bits).
    """

    learning_rate: LearningRate
    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7
    per_row_step: bool = False

    def __post_init__(self):
        self._check_learning_rate()
        _decay(self, "beta_1")
        _decay(self, "beta_2")
        _non_negative(self, "epsilon")
        _flag(self, "per_row_step")

    def _c_fields(self) -> dict:
        return _fields("adam", lr=self.learning_rate_at(0), beta1=self.beta_1,
                       beta2=self.beta_2, epsilon=self.epsilon,
                       per_row_step=self.per_row_step)

    def _slot_layout(self, dim: int) -> list:
        return [("m", dim), ("v", dim), ("step", 1)]


@dataclasses.dataclass(frozen=True)
class Ftrl(_RowOptimizer):
    """FTRL-proximal as TF's ResourceSparseApplyFtrlV2, with Keras' `beta` (Keras 3's
    Ftrl): w = (clip(linear, -l1, l1) - linear) / (accum^-p / lr + 2 l2'),
    l2' = l2 + beta / (2 lr); the rest of the rule is in csrc/kv_optim.c.

    learning_rate: step size, > 0, or a schedule of the step (see the module).
    learning_rate_power: <= 0; -0.5 is the usual 1/sqrt(accum) schedule (computed with
        sqrt exactly as TF does), 0 a constant rate.
    initial_accumulator_value: accum of a new row, >= 0.
    l1_regularization_strength, l2_regularization_strength: >= 0.
    l2_shrinkage_regularization_strength: >= 0; adds 2 * strength * w to the gradient
        that enters `linear` (not the one squared into `accum`), as TF does.
    beta: >= 0, Keras' beta (default 0.0, TF's rule): adds beta / (2 * lr) to the l2
        strength, computed in C with the learning rate of each step, so it follows a
        schedule as Keras' does.
    Slots per row: accum[dim], linear[dim].
    """

    learning_rate: LearningRate
    learning_rate_power: float = -0.5
    initial_accumulator_value: float = 0.1
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    l2_shrinkage_regularization_strength: float = 0.0
    beta: float = 0.0

    def __post_init__(self):
        self._check_learning_rate()
        _non_positive(self, "learning_rate_power")
        _non_negative(self, "initial_accumulator_value")
        _non_negative(self, "l1_regularization_strength")
        _non_negative(self, "l2_regularization_strength")
        _non_negative(self, "l2_shrinkage_regularization_strength")
        _non_negative(self, "beta")

    def _c_fields(self) -> dict:
        return _fields("ftrl", lr=self.learning_rate_at(0),
                       lr_power=self.learning_rate_power,
                       initial_accumulator=self.initial_accumulator_value,
                       l1=self.l1_regularization_strength,
                       l2=self.l2_regularization_strength,
                       l2_shrinkage=self.l2_shrinkage_regularization_strength,
                       beta=self.beta)

    def _slot_layout(self, dim: int) -> list:
        return [("accum", dim), ("linear", dim)]


@dataclasses.dataclass(frozen=True)
class GroupAdam(_RowOptimizer):
    """TFPlus's Group Adam (GroupAdamOptimizer, kernel version 4): Adam in FTRL form
    with l1, l2 and group-lasso (l21) regularization of each row.

    A row whose l1-shrunk `linear` has norm <= l21 * learning_rate * sqrt(dim) is set
    to exact zeros; with l1 = l2 = l21 = 0 this is Adam. The exact rule is in
    csrc/kv_optim.c.

    learning_rate: step size, > 0, or a schedule of the step (also scales l1, l2 and
        l21, as TFPlus does).
    initial_accumulator_value: v of a new row, >= 0 (TFPlus's version-4 kernel keeps
        its v at 0, the default).
    beta1, beta2: decay of the first and second moments, in [0, 1).
    epsilon: added to sqrt(v), >= 0.
    l1_regularization_strength, l2_regularization_strength,
    l21_regularization_strength: >= 0.
    per_row_step: as Adam's; False (TFPlus's behaviour) uses the global step.
    Slots per row: m[dim], v[dim], linear[dim], step (uint32 bits).
    """

    learning_rate: LearningRate
    initial_accumulator_value: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    epsilon: float = 1e-8
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    l21_regularization_strength: float = 0.0
    per_row_step: bool = False

    def __post_init__(self):
        self._check_learning_rate()
        _non_negative(self, "initial_accumulator_value")
        _decay(self, "beta1")
        _decay(self, "beta2")
        _non_negative(self, "epsilon")
        _non_negative(self, "l1_regularization_strength")
        _non_negative(self, "l2_regularization_strength")
        _non_negative(self, "l21_regularization_strength")
        _flag(self, "per_row_step")

    def _c_fields(self) -> dict:
        return _fields("group_adam", lr=self.learning_rate_at(0), beta1=self.beta1,
                       beta2=self.beta2, epsilon=self.epsilon,
                       initial_accumulator=self.initial_accumulator_value,
                       l1=self.l1_regularization_strength,
                       l2=self.l2_regularization_strength,
                       l21=self.l21_regularization_strength,
                       per_row_step=self.per_row_step)

    def _slot_layout(self, dim: int) -> list:
        return [("m", dim), ("v", dim), ("linear", dim), ("step", 1)]


@dataclasses.dataclass(frozen=True)
class GroupAdagrad(_RowOptimizer):
    """TFPlus's Group Adagrad (SparseGroupFtrlOptimizer): FTRL-proximal with l1, l2,
    l2-shrinkage and group-lasso (l21) regularization of each row.

    A row whose l1-shrunk `linear` has norm <= l21 * sqrt(dim) is set to exact zeros;
    with l21 = 0 and no shrinkage this is Ftrl. The exact rule is in csrc/kv_optim.c.

    learning_rate: step size, > 0, or a schedule of the step (see the module).
    learning_rate_power: <= 0, -0.5 usual.
    initial_accumulator_value: accum of a new row, >= 0.
    l1_regularization_strength, l2_regularization_strength,
    l21_regularization_strength: >= 0.
    l2_shrinkage_regularization_strength: >= 0; unlike Ftrl, TFPlus squares the shrunk
        gradient into accum as well.
    Slots per row: accum[dim], linear[dim].
    """

    learning_rate: LearningRate
    learning_rate_power: float = -0.5
    initial_accumulator_value: float = 0.1
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    l21_regularization_strength: float = 0.0
    l2_shrinkage_regularization_strength: float = 0.0

    def __post_init__(self):
        self._check_learning_rate()
        _non_positive(self, "learning_rate_power")
        _non_negative(self, "initial_accumulator_value")
        _non_negative(self, "l1_regularization_strength")
        _non_negative(self, "l2_regularization_strength")
        _non_negative(self, "l21_regularization_strength")
        _non_negative(self, "l2_shrinkage_regularization_strength")

    def _c_fields(self) -> dict:
        return _fields("group_adagrad", lr=self.learning_rate_at(0),
                       lr_power=self.learning_rate_power,
                       initial_accumulator=self.initial_accumulator_value,
                       l1=self.l1_regularization_strength,
                       l2=self.l2_regularization_strength,
                       l21=self.l21_regularization_strength,
                       l2_shrinkage=self.l2_shrinkage_regularization_strength)

    def _slot_layout(self, dim: int) -> list:
        return [("accum", dim), ("linear", dim)]


# FBGEMM's weight_decay_mode values that row-wise Adagrad takes, and their KV_OPTF_ bit.
_WEIGHT_DECAY_MODES = {"none": (), "l2": ("wd_l2",), "decoupled": ("wd_decoupled",)}


@dataclasses.dataclass(frozen=True)
class RowWiseAdagrad(_RowOptimizer):
    """Row-wise Adagrad: FBGEMM's EXACT_ROWWISE_ADAGRAD, the kernel TorchRec's
    RowWiseAdagrad runs for its fused tables. One accumulator per row instead of one
    per float, so a row's optimizer state is 4 bytes instead of 4 * dim, and an update
    reads and writes dim - 1 fewer floats. Per row, with wd = weight_decay:

        g'     = g + wd * w  ("l2"),  g  ("none", "decoupled")
        accum += mean(g'^2)                  (the mean over the row's dim floats)
        m      = learning_rate / (sqrt(accum) + epsilon)
        w      = c * w - m * g,   c = 1 - m * wd ("l2"), 1 - learning_rate * wd
                                  ("decoupled"), 1 ("none")

    computed in float32 in FBGEMM's CPU kernel's order (csrc/kv_optim.c). Every float
    of a row moves with the one step size m. With dim 1 it is Adagrad.

    learning_rate: step size, > 0, or a schedule of the step (see the module).
    initial_accumulator_value: accum of a new row, >= 0 (FBGEMM starts at 0.0).
    epsilon: added to sqrt(accum), >= 0 (FBGEMM's default 1e-8; TorchRec passes its
        own `eps` when given).
    weight_decay: >= 0; 0.0 (the default, TorchRec's) applies none.
    weight_decay_mode: "none" (the default), "l2" (FBGEMM's L2: the decay joins the
        gradient, in the accumulator too) or "decoupled" (FBGEMM's DECOUPLE: w shrinks
        by learning_rate * weight_decay). A weight_decay > 0 needs "l2" or "decoupled".
    Slots per row: accum (1 float).
    """

    learning_rate: LearningRate
    initial_accumulator_value: float = 0.0
    epsilon: float = 1e-8
    weight_decay: float = 0.0
    weight_decay_mode: str = "none"

    def __post_init__(self):
        self._check_learning_rate()
        _non_negative(self, "initial_accumulator_value")
        _non_negative(self, "epsilon")
        _non_negative(self, "weight_decay")
        if self.weight_decay_mode not in _WEIGHT_DECAY_MODES:
            raise InvalidArgumentError(
                f"RowWiseAdagrad: weight_decay_mode must be one of "
                f"{sorted(_WEIGHT_DECAY_MODES)}, got {self.weight_decay_mode!r}")
        if self.weight_decay_mode == "none" and self.weight_decay != 0:
            raise InvalidArgumentError(
                f"RowWiseAdagrad: weight_decay={self.weight_decay!r} with "
                "weight_decay_mode='none' would be ignored (as FBGEMM ignores it); pass "
                "weight_decay_mode='l2' or 'decoupled', or weight_decay=0.0")

    def _c_fields(self) -> dict:
        return _fields("rowwise_adagrad", lr=self.learning_rate_at(0), epsilon=self.epsilon,
                       initial_accumulator=self.initial_accumulator_value,
                       weight_decay=self.weight_decay,
                       flags=_WEIGHT_DECAY_MODES[self.weight_decay_mode])

    def _slot_layout(self, dim: int) -> list:
        return [("accum", 1)]
