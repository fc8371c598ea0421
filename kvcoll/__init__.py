"""kvcoll: growable, sharded embedding tables for TensorFlow, trained over plain MPI.

The engine (tables, routing, exchange) imports no TensorFlow; `Embedding`,
`DistributedOptimizer`, `Trainer` and `broadcast_variables` load it on first use.
"""

from . import data, errors, optimizers
from .config import ASP, BSP, Config, StepMode, ssp
from .errors import (CapacityError, ClosedError, CommError, CommTimeoutError, DimensionError,
                     InvalidArgumentError, KvcollError, NonFiniteError, TableFullError)
from .runtime import init, is_initialized, rank, shutdown, size
from .table import Initializer, KvTable, TableStats

__version__ = "0.1.0"

_KERAS_NAMES = ("Embedding", "DistributedOptimizer", "Trainer", "broadcast_variables")

__all__ = [
    "init", "shutdown", "rank", "size", "is_initialized",
    "Config", "StepMode", "BSP", "ASP", "ssp",
    "KvTable", "Initializer", "TableStats",
    *_KERAS_NAMES,
    "optimizers", "errors", "data",
    "KvcollError", "InvalidArgumentError", "DimensionError", "NonFiniteError",
    "CapacityError", "TableFullError", "ClosedError", "CommError", "CommTimeoutError",
]


def __getattr__(name):
    if name in _KERAS_NAMES:
        from . import keras as _keras

        return getattr(_keras, name)
    raise AttributeError(f"module 'kvcoll' has no attribute {name!r}")
