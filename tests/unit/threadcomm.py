"""A world of ranks as threads of one process, for the collectives that checkpoints and
export use (allgather_json, bcast_bytes, barrier): `run_ranks(world, fn)` calls
fn(comm) on `world` threads, each with its own rank, and returns their results.

Not MPI: it lets a unit test save on 3 ranks and restore on 1, 2, 4 or 5 in seconds
(tests/launch/ covers the same under mpirun with the Keras model). The C tables
release the GIL, so the ranks do run at once. A rank that raises breaks the barrier,
so the others fail at their next collective instead of waiting; the first error is
re-raised in the caller.
"""

from __future__ import annotations

import threading


class _Hub:
    def __init__(self, world: int, timeout: float):
        self.world = world
        self.slots = [None] * world
        self.barrier = threading.Barrier(world, timeout=timeout)

    def exchange(self, rank: int, obj) -> list:
        self.slots[rank] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()  # everyone has read before anyone writes again
        return out


class ThreadComm:
    """Rank `rank` of a thread world: the subset of kvcoll.comm.Comm that
    kvcoll.checkpoint and kvcoll.serving call."""

    def __init__(self, hub: _Hub, rank: int):
        self._hub, self.rank, self.size = hub, rank, hub.world

    def allgather_json(self, obj, op: str = "allgather_json") -> list:
        return self._hub.exchange(self.rank, obj)

    def bcast_bytes(self, data, root: int = 0, op: str = "bcast_bytes") -> bytes:
        return self._hub.exchange(self.rank, data)[root]

    def barrier(self, op: str = "barrier") -> None:
        self._hub.exchange(self.rank, None)


def run_ranks(world: int, fn, timeout: float = 120.0) -> list:
    """fn(comm) on `world` threads (comm.rank = 0 .. world - 1); their results in rank
    order. Re-raises the first exception any rank raised."""
    hub = _Hub(world, timeout)
    results, errors = [None] * world, [None] * world

    def body(rank):
        try:
            results[rank] = fn(ThreadComm(hub, rank))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            errors[rank] = exc
            hub.barrier.abort()

    threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}") for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and
                  not isinstance(e, threading.BrokenBarrierError)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results
