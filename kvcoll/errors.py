"""kvcoll's exceptions.

Every class derives from KvcollError and from the builtin a caller would expect, so
`except MemoryError` and `except kvcoll.KvcollError` both work (as pynacl does).
"""

__all__ = [
    "KvcollError",
    "InvalidArgumentError",
    "DimensionError",
    "NonFiniteError",
    "CapacityError",
    "TableFullError",
    "ClosedError",
    "CommTimeoutError",
    "CommError",
    "PeerLostError",
    "CheckpointError",
]


class KvcollError(Exception):
    """Base class of every kvcoll error."""

    # TensorFlow's autograph re-raises an error from traced code as its own class only if
    # the class's constructor is Exception's (else it becomes a StagingError): each class
    # whose first base is a builtin says so, so `except kv.InvalidArgumentError` catches it.
    __init__ = Exception.__init__


class InvalidArgumentError(ValueError, KvcollError):
    """An argument has the wrong type, dtype, shape or value."""

    __init__ = Exception.__init__


class DimensionError(InvalidArgumentError):
    """Rows or gradients whose width is not the table's dim."""


class NonFiniteError(FloatingPointError, KvcollError):
    """A value or gradient is NaN or Inf; nothing was changed."""

    __init__ = Exception.__init__


class CapacityError(MemoryError, KvcollError):
    """An allocation failed; the table is unchanged."""

    __init__ = Exception.__init__


class TableFullError(CapacityError):
    """A shard reached its row limit."""


class ClosedError(ValueError, KvcollError):
    """The table (or the communicator) was closed."""

    __init__ = Exception.__init__


class CommError(RuntimeError, KvcollError):
    """A collective failed or the ranks disagreed."""

    __init__ = Exception.__init__


class PeerLostError(CommError):
    """An elastic run lost a peer (dead, stopped or cut off) during a collective; the
    survivors recover from it (kvcoll.elastic). `ranks`: the lost ranks this rank knows
    of (of the communicator it waited on; may be empty when another rank saw the loss
    first and revoked the communicator)."""

    def __init__(self, message: str, ranks=(), op: str = "", since: float | None = None):
        super().__init__(message)
        self.ranks, self.op, self.since = list(ranks), op, since


class CommTimeoutError(TimeoutError, KvcollError):
    """A collective or a peer did not answer in time."""

    __init__ = Exception.__init__


class CheckpointError(ValueError, KvcollError):
    """A checkpoint is missing, corrupt, newer than this kvcoll, or does not match the
    model; raised on every rank before anything was changed."""

    __init__ = Exception.__init__
