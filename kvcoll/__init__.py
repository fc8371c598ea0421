"""kvcoll: growable, sharded embedding tables for TensorFlow, trained over plain MPI.

The engine (tables, routing, exchange, the step loop, checkpoints) imports no
TensorFlow; `Model`, `distribute`, `Embedding`, `DistributedOptimizer`, `Trainer`,
`broadcast_variables`, `callbacks`, `save`, `restore` and `export` load it on first use.
"""

from . import data, errors, optimizers
from .config import ASP, BSP, Config, StepMode, ssp
from .errors import (CapacityError, CheckpointError, ClosedError, CommError, CommTimeoutError,
                     DimensionError, InvalidArgumentError, KvcollError, NonFiniteError,
                     TableFullError)
from .runtime import (allgather, allreduce, broadcast, init, is_initialized, local_rank,
                      local_size, preempted, rank, shutdown, size)
from .table import Initializer, KvTable, TableStats

__version__ = "0.1.0"

# Public names that load TensorFlow, and the module each comes from. (The export
# function lives in serving.py: a submodule named `export` would shadow it.)
_LAZY = {
    "Model": "keras", "distribute": "keras",
    "Embedding": "keras", "DistributedOptimizer": "keras", "Trainer": "keras",
    "broadcast_variables": "keras", "save": "keras.saving", "restore": "keras.saving",
    "export": "serving",
}
_LAZY_MODULES = {"callbacks": "kvcoll.keras.callbacks"}

__all__ = [
    "init", "shutdown", "rank", "size", "local_rank", "local_size", "is_initialized",
    "allreduce", "allgather", "broadcast", "preempted",
    "Config", "StepMode", "BSP", "ASP", "ssp",
    "KvTable", "Initializer", "TableStats",
    *_LAZY, "callbacks",
    "optimizers", "errors", "data",
    "KvcollError", "InvalidArgumentError", "DimensionError", "NonFiniteError",
    "CapacityError", "TableFullError", "ClosedError", "CommError", "CommTimeoutError",
    "CheckpointError",
]


def __dir__():
    return sorted(set(globals()) | set(__all__))


def __getattr__(name):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    if name in _LAZY_MODULES:
        return importlib.import_module(_LAZY_MODULES[name])
    raise AttributeError(f"module 'kvcoll' has no attribute {name!r}")
