"""kvcoll: growable, sharded embedding tables for TensorFlow, trained over plain MPI."""

from . import errors, optimizers
from .config import ASP, BSP, Config, StepMode, ssp
from .errors import (CapacityError, ClosedError, CommError, CommTimeoutError, DimensionError,
                     InvalidArgumentError, KvcollError, NonFiniteError, TableFullError)
from .runtime import init, is_initialized, rank, shutdown, size
from .table import Initializer, KvTable, TableStats

__version__ = "0.1.0"

__all__ = [
    "init", "shutdown", "rank", "size", "is_initialized",
    "Config", "StepMode", "BSP", "ASP", "ssp",
    "KvTable", "Initializer", "TableStats",
    "optimizers", "errors",
    "KvcollError", "InvalidArgumentError", "DimensionError", "NonFiniteError",
    "CapacityError", "TableFullError", "ClosedError", "CommError", "CommTimeoutError",
]
