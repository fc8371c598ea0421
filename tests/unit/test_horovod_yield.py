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
