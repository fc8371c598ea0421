"""kvcoll.keras._horovod.yield_when_idle, without Horovod or MPI: it calls Open MPI's
switch once, with True; it leaves a user's OMPI_MCA_mpi_yield_when_idle alone; under
another MPI (no libopen-pal mapped) it does nothing. The switch's effect inside a
Horovod job is tested in tests/compat/test_horovod.py."""

import pytest

pytest.importorskip("tensorflow")

from kvcoll.keras import _horovod  # noqa: E402


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(_horovod, "_yielding", [])
    monkeypatch.delenv("OMPI_MCA_mpi_yield_when_idle", raising=False)
    return monkeypatch


class Switch:
    def __init__(self):
        self.calls = []

    def __call__(self, on):
        self.calls.append(on)


def test_switches_open_mpi_once(fresh):
    switch = Switch()
    fresh.setattr(_horovod, "_opal_function", lambda name: switch)
    assert _horovod.yield_when_idle() and _horovod.yield_when_idle()
    assert switch.calls == [True]


@pytest.mark.parametrize("setting", ["0", "1", ""])
def test_a_users_setting_is_theirs(fresh, setting):
    switch = Switch()
    fresh.setattr(_horovod, "_opal_function", lambda name: switch)
    fresh.setenv("OMPI_MCA_mpi_yield_when_idle", setting)
    assert not _horovod.yield_when_idle()
    assert switch.calls == []


def test_another_mpi_is_left_alone(fresh):
    fresh.setattr(_horovod, "_opal_function", lambda name: None)
    assert not _horovod.yield_when_idle()


def test_finds_nothing_where_no_open_mpi_is_mapped(fresh, tmp_path):
    maps = tmp_path / "maps"
    maps.write_text("7f0000000000-7f0000001000 r-xp 00000000 08:01 1 /usr/lib/libc.so.6\n")
    real_open = open
    fresh.setattr("builtins.open", lambda path, *a, **k: real_open(
        maps if path == "/proc/self/maps" else path, *a, **k))
    assert _horovod._opal_function("opal_progress_set_yield_when_idle") is None


def test_kv_init_refuses_beside_horovod_without_mpi_threads_asking_horovod_not_mpi(
        monkeypatch):
    """runtime._horovod_threads (kv.init, before its first collective) reads the thread
    level Horovod's MPI start got from Horovod: no MPI call, since another rank's exit
    shuts Horovod down everywhere and each rank's Horovod thread then finalizes MPI (an
    MPI call there aborted a rank still in kv.init). Horovod without MPI: nothing."""
    import sys
    import types

    from kvcoll import CommError, comm, runtime

    def no_mpi():
        raise AssertionError("an MPI call")

    def horovod(threads):
        def supported():
            if threads is None:
                raise ValueError("Horovod MPI is not enabled")
            return threads
        return types.SimpleNamespace(is_initialized=lambda: True, rank=lambda: 3,
                                     mpi_threads_supported=supported)

    monkeypatch.setattr(comm, "_mpi", no_mpi)
    monkeypatch.setitem(sys.modules, "horovod.tensorflow", horovod(False))
    with pytest.raises(CommError, match="rank 3: kvcoll next to Horovod.*MPI_THREAD_MULTIPLE"
                       ".*HOROVOD_MPI_THREADS_DISABLE must not be set"):
        runtime._horovod_threads()
    for threads in (True, None):
        monkeypatch.setitem(sys.modules, "horovod.tensorflow", horovod(threads))
        runtime._horovod_threads()
