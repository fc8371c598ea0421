"""What differs between Keras versions, in one place: the adapter of the Keras kvcoll
runs on (chosen at import by _which.py, as tf.keras is chosen).

The rest of kvcoll/keras/ imports Keras only as `_compat.keras` and reaches past
Keras' public API only through the functions below: _keras3.py (Keras 3) and
_keras2.py (Keras 2: tf_keras, or TensorFlow <= 2.15's keras) each define, with the
same names and meanings, those that differ; _keras_both.py those the two share:

    sublayers, custom_step_methods, is_compiled, compile_token   the model
    compute_loss, update_loss_tracker                            the loss and its "loss" metric
    metric_variables, metrics_result, flatten_logs               metrics and logs
    callback_list                                                Keras' CallbackList
    build_optimizer, optimizer_slots, lr_is_schedule,            the optimizer
        learning_rate, set_learning_rate, learning_rate_variable,
        ADAGRAD_EPSILON_INSIDE
    symbolic_call                                                building a model's shapes
    steps_per_execution                                          steps per step-function call
    functional_class                                             what keras.Model(i, o) makes
    set_initial_counters                                         a resumed fit's epoch, step
    weight_key, optimizer_slot_lists                             names that cross versions
"""

from __future__ import annotations

from ._keras_both import *  # noqa: F401,F403 - what both majors share
from ._keras_both import __all__ as _shared
from ._which import KERAS_MAJOR, LEGACY_REQUESTED, keras

if KERAS_MAJOR >= 3:
    from ._keras3 import *  # noqa: F401,F403
    from ._keras3 import __all__ as _names
else:
    from ._keras2 import *  # noqa: F401,F403
    from ._keras2 import __all__ as _names

__all__ = ["keras", "KERAS_MAJOR", "LEGACY_REQUESTED", *_shared, *_names]
