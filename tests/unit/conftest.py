"""Every unit test starts with kvcoll.ids' run state as a new process has it: the string
hash not chosen yet and no string id hashed. (A run fixes its hash when it first hashes
a string id, and then refuses checkpoints of another hash; tests in one process must
not inherit that from the tests before them.)"""

import pytest


@pytest.fixture(autouse=True)
def _fresh_id_hash(monkeypatch):
    from kvcoll import ids

    monkeypatch.setattr(ids, "_run", {"name": None, "source": None, "used": False,
                                      "strings": set()})
    monkeypatch.delenv("KVCOLL_ID_HASH", raising=False)
