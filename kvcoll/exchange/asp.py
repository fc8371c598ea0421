"""ASP: SSP with no staleness bound (one implementation, see ssp.py).

No worker ever waits for another worker's progress; a pull waits only for its owners'
answers.
"""

from __future__ import annotations

from ..comm import Comm
from ..table import KvTable
from .ssp import SspExchange

__all__ = ["AspExchange"]


def AspExchange(comm: Comm, tables: dict[str, KvTable], dense_size: int = 0,
                dense_optimizer=None, **kwargs) -> SspExchange:
    """An SspExchange with staleness None."""
    return SspExchange(comm, tables, None, dense_size, dense_optimizer, **kwargs)
