"""Which Keras kvcoll runs on: the one TensorFlow's `tf.keras` names.

TensorFlow 2.16+ makes `tf.keras` Keras 3 (the `keras` package) unless
TF_USE_LEGACY_KERAS is "1", "true" or "True", when it is Keras 2 (the `tf_keras`
package); TensorFlow 2.15 and older ship Keras 2 as `keras` itself. kvcoll follows the
same rule, so a user's `tf.keras` model and kvcoll's layers are of one Keras:

    TF_USE_LEGACY_KERAS set   -> tf_keras (or `keras` if that is Keras 2: TF <= 2.15)
    otherwise                 -> keras (Keras 3, or Keras 2 on TF <= 2.15), else tf_keras

This module only chooses; the differences live in _keras3.py and _keras2.py, and
_compat.py hands the rest of kvcoll/keras/ the chosen one's functions.
"""

from __future__ import annotations

import os

__all__ = ["keras", "KERAS_MAJOR", "LEGACY_REQUESTED"]

LEGACY_REQUESTED = os.environ.get("TF_USE_LEGACY_KERAS", "") in ("1", "true", "True")


def _major(module) -> int:
    return int(str(module.__version__).split(".")[0])


def _select():
    plain = err = None
    try:
        import keras as plain
    except ImportError as exc:
        err = exc
    if LEGACY_REQUESTED and (plain is None or _major(plain) >= 3):
        try:
            import tf_keras
        except ImportError:
            raise ImportError(
                "TF_USE_LEGACY_KERAS is set, which makes tf.keras Keras 2 (the tf_keras "
                "package), but tf_keras is not installed: `pip install tf-keras` at your "
                "TensorFlow's version (tf-keras==2.21.0 for TensorFlow 2.21), or unset "
                "TF_USE_LEGACY_KERAS to use Keras 3") from None
        return tf_keras
    if plain is not None:
        return plain
    try:
        import tf_keras
    except ImportError:
        raise ImportError(
            f"kvcoll needs Keras: `pip install keras` (Keras 3) or `pip install tf-keras` "
            f"(Keras 2 with TF_USE_LEGACY_KERAS=1) ({err})") from None
    return tf_keras


keras = _select()
KERAS_MAJOR = _major(keras)
