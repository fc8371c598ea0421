"""Step modes behind one interface: `Exchange`, implemented in full by BSP, SSP and ASP.

kvcoll's step loop (kvcoll.step) has one shape whatever the mode:

    agreement = Agreement(samples, done=..., error=..., stop=...)   # this rank's vote
    pull = ex.pull(ids, agreement, dense=...)     # starts step ex.step + 1, or None when the
                                                  # agreement says the step does not happen
    ... the model's forward and backward on pull.rows (and pull.dense) ...
    agreement.report(code)                        # this rank's compute outcome
    pushed = ex.push(pull, row_grads, dense_grad, extra, agreement, lr=...)
    dense_sum, extra_sum = pushed.reduced()       # BSP: summed over ranks; SSP/ASP: (None, own)
    if agreement.outcome_failed: ex.abandon(pushed)   # every table as before the step
    else: pushed.commit()                         # BSP: the owners apply the rows
    ...
    ex.finish()                                   # this rank is out of data (SSP/ASP: wait
                                                  # for every rank; BSP: nothing in flight)
    ex.lookup(ids, agreement)                     # rows for evaluation, nothing created
    ex.close()

The agreement (exchange/agreement.py) is a small object the exchange carries and the
loop reads: BSP settles it with every rank's vote (in the pull's counts exchange and
the push's allreduce), SSP/ASP with this rank's alone. The exchange never calls back
into the loop.

bsp.py: blocking fused collectives, deterministic. ssp.py: a service thread per rank,
worker clocks and a staleness bound; asp.py: the same with no bound. kernels.py: the C
kernels of an exchange; dense.py: the row optimizers applied to dense slices; wire.py:
the width rows and row gradients cross the wire at (fp32, fp16 or bf16).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from ..config import StepMode
from .agreement import FAILED, NONFINITE, OK, Agreement
from .asp import AspExchange
from .bsp import BspExchange, Pull, Pulled
from .ssp import SspExchange

__all__ = ["Exchange", "Agreement", "OK", "NONFINITE", "FAILED", "BspExchange",
           "SspExchange", "AspExchange", "Pull", "Pulled", "make_exchange"]


@runtime_checkable
class Exchange(Protocol):
    """What every step mode's exchange does (BspExchange, SspExchange; ASP is SSP with no
    staleness bound).

    owners: the kvcoll.routing.OwnerMap that says which rank owns each key's bucket.
    synchronous: True for BSP (every step is a collective; dense parameters are every
        rank's own); False for SSP/ASP (dense parameters live in slices on their owners
        and come with the pull as Pull.dense).
    step: the last step this rank started: the one counter of a run's progress (SSP/ASP:
        the worker's clock).
    comm: the communicator it runs on.
    wire, wire_bytes (BSP, SSP, ASP): the kvcoll.exchange.wire.Wire its rows and row
        gradients travel at, and the bytes this rank has sent the others, by payload.
    """

    synchronous: bool
    step: int

    def pull(self, ids: dict, agreement: Agreement, *, dense: bool = False) -> Pull | None:
        """Start step step + 1: the rows of every table's ids (created if new), or None
        when the agreement says the step does not happen (nothing changed)."""

    def lookup(self, ids: dict, agreement: Agreement) -> Pull | None:
        """Rows for evaluation: nothing is created or changed (a collective)."""

    def push(self, pull: Pull, grads: dict, dense_grad: np.ndarray | None = None,
             extra: np.ndarray | None = None, agreement: Agreement | None = None,
             lr: dict | None = None, dense_lr: float | None = None):
        """Send the step's gradients (rows to their owners; dense: BSP sums it, SSP/ASP
        sends it to the slice owners). Returns a handle with reduced() -> (dense sum or
        None, extra) and commit()."""

    def abandon(self, step) -> None:
        """Give up the step in flight (its Pull, or its push handle, before commit):
        every table, optimizer slot and counter as before the step."""

    def finish(self) -> int:
        """This rank's data has run out. SSP/ASP: wait until every rank is done (every
        update applied everywhere); returns the step every rank continues from."""

    def set_step(self, step: int) -> None:
        """Continue from `step` (a restore, on every rank between steps)."""

    def set_dense(self, flat, state=None, updates: int = 0, replace: bool = False) -> None:
        """SSP/ASP: the dense vector (and its optimizer state) the slices start from."""

    def dense(self) -> np.ndarray | None:
        """SSP/ASP: the whole dense vector, gathered (a collective, after finish());
        BSP: None (every rank holds it)."""

    def replan(self, comm, owners=None) -> None:
        """Continue on another communicator (a new world) and owner map (a
        kvcoll.routing.OwnerMap; default the even map of its size), between steps."""

    def close(self) -> None:
        """Release threads and communicators (after finish(), or when giving up)."""


def make_exchange(comm, tables: dict, mode: StepMode, dense_size: int = 0,
                  dense_optimizer=None, owners=None, wire_dtype=None) -> Exchange:
    """The exchange of step mode `mode` over `tables` (SSP/ASP: with a dense vector of
    `dense_size` floats updated on its owners by `dense_optimizer`), routing keys by the
    owner map `owners` (default: the even map of comm's size), sending rows and row
    gradients as `wire_dtype` ("fp32", "fp16", "bf16"; default: the run's setting).
    SSP/ASP start a service thread and duplicate the communicator: a collective."""
    if mode.name == "bsp":
        return BspExchange(comm, tables, owners=owners, wire_dtype=wire_dtype)
    return SspExchange(comm, tables, mode.staleness, dense_size=dense_size,
                       dense_optimizer=dense_optimizer, owners=owners, wire_dtype=wire_dtype)
