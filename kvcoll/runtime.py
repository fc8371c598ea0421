"""Process-wide state: the run's Config and kvcoll's communicator.

`init()` reads the configuration once (code > --flags > KVCOLL_* > defaults), brings
MPI up with thread support, duplicates COMM_WORLD and makes an uncaught exception on
any rank end the whole job.
"""

from __future__ import annotations

import atexit
import sys
import threading

import numpy as np

from . import ids
from .comm import Comm, announce, install_abort_hook, skip_finalize
from .config import Config
from .errors import InvalidArgumentError, KvcollError

__all__ = ["init", "shutdown", "rank", "size", "local_rank", "local_size", "config", "comm",
           "is_initialized", "allreduce", "allgather", "broadcast", "preempted"]

_state: dict = {}


def init(argv: list[str] | None = None, **settings) -> Config:
    """Start kvcoll: MPI up, private communicator, configuration resolved.

    argv defaults to sys.argv[1:] (so `--step-mode ssp --staleness 2` work);
    keyword settings (step_mode=..., staleness=..., comm_timeout=...) win over flags
    and KVCOLL_* variables. Calling init twice returns the first Config.
    """
    if _state:
        return _state["config"]
    cfg = Config.resolve(sys.argv[1:] if argv is None else argv, **settings)
    ids.configure(cfg.id_hash)
    if cfg.elastic_min_np:  # (kvcoll.elastic) MPI_Finalize may hang after a lost peer
        skip_finalize()
    comm = Comm(timeout=cfg.comm_timeout, timeouts=cfg.timeouts,
                elastic=cfg.elastic_min_np > 0)
    _state.update(config=cfg)
    replace_comm(comm)
    atexit.register(_at_exit)
    if cfg.elastic_min_np:  # the launcher learns which ranks started and which ended
        announce({"event": "start", "rank": comm.rank})
        _stop_on_sigusr2()
    return cfg


def _stop_on_sigusr2() -> None:
    """Elastic runs: kvcollrun asks a job to stop after a step and save (to grow it, as a
    preemption does) with SIGUSR2; outside model.fit (which stops every rank after the
    same step) it is noted (preempted()), never fatal."""
    import signal

    try:
        signal.signal(signal.SIGUSR2, lambda *_: note_preempted())
    except ValueError:  # not the main thread: the default stays
        pass


def replace_comm(comm: Comm) -> None:
    """Make `comm` kvcoll's communicator (kv.init; kvcoll.elastic after a lost rank):
    kv.rank(), kv.size() and local_rank() answer for it, and an uncaught exception
    aborts it."""
    install_abort_hook(comm)
    hosts = comm.hosts  # learnt with the communicator (every rank's pid and host)
    mine = [r for r, h in enumerate(hosts) if h == hosts[comm.rank]]
    _state.update(comm=comm, local=(mine.index(comm.rank), len(mine)))


def _at_exit() -> None:
    """Stop SSP/ASP service threads before MPI_Finalize (which mpi4py runs at exit,
    after this: atexit runs in reverse order of registration). An elastic run tells its
    launcher that this rank ended normally."""
    from .exchange.ssp import close_all

    close_all()
    if _state and _state["config"].elastic_min_np:
        announce({"event": "exit", "rank": _state["comm"].rank, "preempted": preempted()})


def is_initialized() -> bool:
    return bool(_state)


def _need(name: str):
    if not _state:
        raise KvcollError(f"kvcoll.{name}() needs kvcoll.init() first")
    return _state


def config() -> Config:
    return _need("config")["config"]


def comm() -> Comm:
    return _need("comm")["comm"]


def rank() -> int:
    """This process's rank in kvcoll's communicator."""
    return _need("rank")["comm"].rank


def size() -> int:
    """Number of ranks."""
    return _need("size")["comm"].size


_preempted = threading.Event()


def preempted() -> bool:
    """Whether this process got SIGTERM while model.fit ran (fit then stops every rank
    after the same step and exits 0; a loop of your own may check this)."""
    return _preempted.is_set()


def note_preempted() -> None:
    _preempted.set()


def local_rank() -> int:
    """This process's index among the ranks on its host (0 .. local_size() - 1)."""
    return _need("local_rank")["local"][0]


def local_size() -> int:
    """How many ranks run on this process's host."""
    return _need("local_size")["local"][1]


def _as_numpy(value):
    """(numpy array of value, a function turning a numpy result back into value's kind)."""
    if hasattr(value, "numpy") and hasattr(value, "dtype") and hasattr(value, "shape"):
        import tensorflow as tf  # only reached with a TensorFlow value

        return np.asarray(value.numpy()), lambda a: tf.convert_to_tensor(a, dtype=value.dtype)
    if isinstance(value, np.ndarray):
        return value, lambda a: a
    arr = np.asarray(value)
    if arr.dtype.kind not in "biuf":
        raise InvalidArgumentError(
            f"collectives take numbers (numpy arrays, TensorFlow tensors or scalars), got "
            f"{type(value).__name__} of {arr.dtype}")
    return arr, (lambda a: a.item()) if arr.ndim == 0 else (lambda a: a)


def allreduce(value, op: str = "mean"):
    """value combined over every rank ("mean" as Horovod's default, "sum", "max",
    "min"); numpy arrays, TensorFlow tensors or Python numbers, returned as given. A
    collective: every rank calls it with the same shape.

        rank 0: allreduce(np.array([1., 2.]))   rank 1: allreduce(np.array([3., 4.]))
        -> both: array([2., 3.])
    """
    if op not in ("mean", "sum", "max", "min"):
        raise InvalidArgumentError(f"allreduce: op must be 'mean', 'sum', 'max' or 'min', got {op!r}")
    c = _need("allreduce")["comm"]
    arr, back = _as_numpy(value)
    if arr.dtype.kind == "b":
        arr = arr.astype(np.int64)
    out = c.allreduce(np.ascontiguousarray(arr), op="kv.allreduce",
                      mpi_op="sum" if op == "mean" else op)
    if op == "mean":
        out = out / c.size if out.dtype.kind == "f" else out.astype(np.float64) / c.size
    return back(out)


def allgather(value):
    """Every rank's value concatenated along the first axis, in rank order (the other
    axes must agree; first dimensions may differ). A collective.

        rank 0: allgather(np.array([1]))   rank 1: allgather(np.array([2, 3]))
        -> both: array([1, 2, 3])
    """
    c = _need("allgather")["comm"]
    arr, back = _as_numpy(value)
    if arr.ndim == 0:
        arr = arr.reshape(1)
    out, _ = c.allgatherv(np.ascontiguousarray(arr), op="kv.allgather")
    return back(out) if not isinstance(value, (int, float, bool, np.number)) else out


def broadcast(value, root_rank: int = 0):
    """Rank root_rank's value on every rank (every rank passes a value of the same shape
    and dtype). A collective."""
    c = _need("broadcast")["comm"]
    if not 0 <= int(root_rank) < c.size:
        raise InvalidArgumentError(f"broadcast: root_rank must be in [0, {c.size}), got {root_rank}")
    arr, back = _as_numpy(value)
    return back(c.bcast(np.ascontiguousarray(arr), root=int(root_rank), op="kv.broadcast"))


def shutdown() -> None:
    """Wait for every rank, then free kvcoll's communicator. Safe to call twice."""
    if not _state:
        return
    c = _state["comm"]
    c.barrier("shutdown")
    c.free()
    _state.clear()
