"""Step modes behind one interface: pull(ids) -> rows, push(grads).

Only BSP exists so far; SSP and ASP arrive with their own modules.
"""

from .bsp import BspExchange, Pulled

__all__ = ["BspExchange", "Pulled"]
