"""The serving process's heap and Python's cycle collector.

A full collection (generation 2) walks every object the collector tracks, and a process
that has loaded TensorFlow and a SavedModel holds some 300,000 of them: one took 130-180
ms on this project's machines, with the GIL held, so no request was answered meanwhile.
Under an open loop of 500 requests a second that is some 80 requests late by up to the
whole pause, enough to make a window's p99 15 times its quiet value (bench/online_bench.py,
the open-loop windows). Requests allocate objects that die young; what the process loads
at start lives as long as it does. So once everything is loaded, `settle()` collects and
moves what is left out of the collector's reach (`gc.freeze`): a full collection then
walks only what was allocated since. `Pauses` records how long the full collections that
still run take, for /metrics and the model's status.
"""

from __future__ import annotations

import gc
import time

__all__ = ["settle", "Pauses"]


def settle() -> int:
    """Collect, then freeze what survives; returns the number of objects frozen. Server.start
    calls it once the model, its serving graphs and the servers are loaded (a
    process-wide setting: for kvcoll serve's process, not a library call)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class Pauses:
    """The full collections (generation 2) since start: how many, the longest and the
    total, in seconds; `observe` is called with each one's duration (a Prometheus
    histogram's observe, say)."""

    def __init__(self, observe=None):
        self.count = 0
        self.longest = 0.0
        self.total = 0.0
        self.observe = observe
        self._start = None
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._start = time.perf_counter()
            return
        if self._start is None:
            return
        took, self._start = time.perf_counter() - self._start, None
        self.count += 1
        self.total += took
        self.longest = max(self.longest, took)
        if self.observe is not None:
            self.observe(took)

    def close(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)
