"""kvcoll.comm.MessageWaiter (csrc/kv_poll.h through Comm.waiter): the SSP/ASP service
thread's idle wait, in C with the GIL released, and kvcoll.exchange.doorbell. On a
one-rank communicator: no message means the whole budget and False; a message of its
tag means True at once (and stays there for the receive); one of another tag is not
seen; ring() ends a wait from another thread, once, also a pause of a minute; the GIL
is free meanwhile (another thread runs Python). A rank's doorbell is in shared memory,
rings a waiter that uses it, and leaves no file behind."""

import os
import threading
import time

import numpy as np
import pytest

from kvcoll.comm import Comm, MessageWaiter
from kvcoll.exchange.doorbell import Doorbells


@pytest.fixture(scope="module")
def comm():
    c = Comm.local()
    yield c
    c.free()


def test_the_waiter_is_found_for_this_mpi(comm):
    assert isinstance(comm.waiter(7), MessageWaiter)


def test_nothing_waits_the_budget(comm):
    w = comm.waiter(7)
    t0 = time.perf_counter()
    assert w.wait(0.05) is False
    assert 0.05 <= time.perf_counter() - t0 < 2.0


def test_a_message_of_its_tag_returns_at_once_and_stays_for_the_receive(comm):
    w = comm.waiter(7)
    h = comm.isend(np.arange(5, dtype=np.uint8), 0, 8)      # another tag: not seen
    assert w.wait(0.02) is False
    h2 = comm.isend(np.arange(3, dtype=np.uint8), 0, 7)
    t0 = time.perf_counter()
    assert w.wait(10.0) is True
    assert time.perf_counter() - t0 < 1.0
    assert w.wait(10.0) is True                              # a probe receives nothing
    src, tag, buf = comm.try_recv(-1, 7)
    assert (src, tag, buf.tolist()) == (0, 7, [0, 1, 2])
    assert comm.try_recv(-1, 8)[2].tolist() == [0, 1, 2, 3, 4]
    h.wait(), h2.wait()
    assert w.wait(0.01) is False


def test_ring_ends_a_wait_once_and_leaves_the_gil_free(comm):
    w = comm.waiter(7)
    w._first = w._most = int(60e9)      # pauses of a minute: only the ring ends them
    counted = []

    def other():
        n = 0
        t_end = time.perf_counter() + 0.2
        while time.perf_counter() < t_end:   # pure Python: needs the GIL
            n += 1
        counted.append(n)
        w.ring()

    th = threading.Thread(target=other)
    t0 = time.perf_counter()
    th.start()
    assert w.wait(30.0) is True
    took = time.perf_counter() - t0
    th.join()
    assert 0.2 <= took < 10.0
    assert counted and counted[0] > 1000
    t0 = time.perf_counter()
    assert w.wait(0.05) is False             # the ring was used up
    assert time.perf_counter() - t0 >= 0.05
    w.ring()
    assert w.wait(30.0) is True              # a ring before the wait: at once


def test_a_ranks_doorbell_is_shared_memory_and_leaves_no_file(comm):
    before = set(os.listdir("/dev/shm"))
    bells = Doorbells(comm)
    assert bells.own is not None and bells.reach == []
    assert set(os.listdir("/dev/shm")) == before      # its name is gone, the mapping stays
    w = comm.waiter(7, bell=bells.own, shared=True)
    w._first = w._most = int(60e9)
    threading.Timer(0.05, w.ring).start()
    t0 = time.perf_counter()
    assert w.wait(30.0) is True
    assert time.perf_counter() - t0 < 10.0
    bells.ring(0)                                      # its own: not among those it rings
    assert w.wait(0.01) is False
    bells.close()


def test_without_dev_shm_there_is_no_doorbell_and_waits_still_end(comm, monkeypatch):
    from kvcoll.exchange import doorbell

    monkeypatch.setattr(doorbell, "_DIR", "/nonexistent-kvcoll-dir")
    bells = Doorbells(comm)
    assert bells.own is None and bells.reach == []
    bells.ring(0)
    w = comm.waiter(7, bell=bells.own, shared=bells.own is not None)   # its own word
    threading.Timer(0.05, w.ring).start()
    assert w.wait(30.0) is True
    bells.close()
