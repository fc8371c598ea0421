"""Step modes behind one interface: pull(ids) -> rows, push(grads), finish().

Every step mode's exchange (BspExchange; SspExchange, which is ASP with staleness None)
offers the same calls, so kvcoll's training loop has one shape whatever the mode:

    pull = ex.pull(ids, header=..., proceed=..., dense=...)   # starts step ex.step + 1
    ... the model's forward and backward on pull.rows (and pull.dense) ...
    pushed = ex.push(pull, row_grads, dense_grad, extra, lr=...)
    total = pushed.reduced()      # BSP: [dense_grad, extra] summed over ranks; else this rank's
    pushed.commit()               # BSP: the owners apply the rows; SSP/ASP: already sent
    ...
    ex.finish()                   # SSP/ASP: wait until every rank is done (BSP: nothing left)
    ex.lookup(ids, ...)           # rows for evaluation, nothing created (a collective)

  step            the last step this rank started: the one counter of a run's progress
                  (SSP/ASP: the worker's clock); set_step(s) continues from s (restore)
  synchronous     True for BSP: every step is a collective and dense parameters are
                  every rank's own; False for SSP/ASP: dense parameters live in slices on
                  their owners and come with the pull (pull.dense)

bsp.py: blocking fused collectives, deterministic. ssp.py: a service thread per rank,
worker clocks and a staleness bound; asp.py: the same with no bound. kernels.py: the C
kernels of an exchange; dense.py: the row optimizers applied to dense slices.
"""

from ..config import StepMode
from .asp import AspExchange
from .bsp import BspExchange, Pull, Pulled
from .ssp import SspExchange

__all__ = ["BspExchange", "SspExchange", "AspExchange", "Pull", "Pulled", "make_exchange"]


def make_exchange(comm, tables: dict, mode: StepMode, dense_size: int = 0,
                  dense_optimizer=None):
    """The exchange of step mode `mode` over `tables` (SSP/ASP: with a dense vector of
    `dense_size` floats updated on its owners by `dense_optimizer`). SSP/ASP start a
    service thread and duplicate the communicator: a collective."""
    if mode.name == "bsp":
        return BspExchange(comm, tables)
    return SspExchange(comm, tables, None if mode.name == "asp" else mode.staleness,
                       dense_size=dense_size, dense_optimizer=dense_optimizer)
