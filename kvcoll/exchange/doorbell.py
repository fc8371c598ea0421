"""Doorbells: one word per rank in shared memory, which the ranks on its machine ring.

An SSP/ASP owner's service thread idles in C between requests (kvcoll.comm.MessageWaiter:
a probe, then pauses up to a millisecond). A worker that sends it a request rings its
doorbell as well, which ends the pause at once (a futex wake): its pull is answered in
microseconds instead of up to a millisecond later, and an idle service thread can pause
longer, costing less CPU. A rank on another machine cannot ring; its requests are found
by the owner's next probe, as before.

Each rank makes a 64-byte file in /dev/shm named by a token rank 0 draws, and maps it;
after a barrier every rank maps the files of the ranks on its machine (the same boot id)
that it can open, and after a second barrier removes its own name (the mappings stay).
Where /dev/shm is missing or not shared (another container), a rank just rings fewer
doorbells: nothing depends on a ring but how soon a request is seen.
"""

from __future__ import annotations

import mmap
import os
import secrets

from .._c import ffi, lib

__all__ = ["Doorbells"]

_DIR = "/dev/shm"
_SIZE = 64


def _map(path: str, create: bool):
    fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
    try:
        if create:   # its page allocated now (a full /dev/shm fails here, not as a
            os.posix_fallocate(fd, 0, _SIZE)   # SIGBUS at the first ring)
        return mmap.mmap(fd, _SIZE)
    finally:
        os.close(fd)


class Doorbells:
    """The doorbells of `comm`'s ranks that this rank can reach (a collective: every
    rank makes them at the same point). own: this rank's doorbell (a cffi `int32_t *`
    in shared memory; None if it could not be made); ring(r) rings rank r's, if
    reachable."""

    def __init__(self, comm):
        self._maps: dict = {}
        self._bells: dict = {}
        self.own = None
        token = comm.bcast_bytes(secrets.token_hex(8).encode() if comm.rank == 0 else None,
                                 op="doorbells:token").decode()
        path = os.path.join(_DIR, f"kvcoll-bell-{token}-{{}}")
        try:
            self._keep(comm.rank, _map(path.format(comm.rank), create=True))
            self.own = self._bells.pop(comm.rank)
        except OSError:
            pass
        comm.barrier("doorbells:made")
        peers = comm.peers
        boot = peers[comm.rank].get("boot")
        for r, peer in enumerate(peers):
            if r != comm.rank and boot and peer.get("boot") == boot:
                try:
                    self._keep(r, _map(path.format(r), create=False))
                except OSError:
                    pass
        comm.barrier("doorbells:opened")
        if self.own is not None:
            os.unlink(path.format(comm.rank))

    @property
    def reach(self) -> list[int]:
        """The ranks this rank can ring."""
        return sorted(self._bells)

    def _keep(self, rank: int, m: mmap.mmap) -> None:
        self._maps[rank] = m
        self._bells[rank] = ffi.cast("int32_t *", ffi.from_buffer(m))

    def ring(self, rank: int) -> None:
        """Ring rank `rank`'s doorbell (nothing if this rank cannot reach it)."""
        bell = self._bells.get(rank)
        if bell is not None:
            lib.kv_poll_ring(bell, 1)

    def close(self) -> None:
        """Unmap every doorbell (own included: its waiter must be done with it)."""
        self._bells.clear()
        self.own = None
        for m in self._maps.values():
            m.close()
        self._maps.clear()
