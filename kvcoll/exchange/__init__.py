"""Step modes behind one interface: pull(ids) -> rows, push(grads).

bsp.py: blocking fused collectives, deterministic. ssp.py: a service thread per rank,
worker clocks and a staleness bound; asp.py: the same with no bound.
"""

from .asp import AspExchange
from .bsp import BspExchange, Pull, Pulled
from .ssp import SspExchange

__all__ = ["BspExchange", "SspExchange", "AspExchange", "Pull", "Pulled"]
