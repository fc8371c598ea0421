"""Process-wide state: the run's Config and kvcoll's communicator.

`init()` reads the configuration once (code > --flags > KVCOLL_* > defaults), brings
MPI up with thread support, duplicates COMM_WORLD and makes an uncaught exception on
any rank end the whole job.
"""

from __future__ import annotations

import sys

from .comm import Comm, install_abort_hook
from .config import Config
from .errors import KvcollError

__all__ = ["init", "shutdown", "rank", "size", "config", "comm", "is_initialized"]

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
    comm = Comm(timeout=cfg.comm_timeout)
    install_abort_hook(comm)
    _state.update(config=cfg, comm=comm)
    return cfg


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


def shutdown() -> None:
    """Wait for every rank, then free kvcoll's communicator. Safe to call twice."""
    if not _state:
        return
    c = _state["comm"]
    c.barrier("shutdown")
    c.free()
    _state.clear()
