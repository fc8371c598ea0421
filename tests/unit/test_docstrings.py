"""The public API's docstrings (what the API reference of ./dev docs shows) say what a
name does, name its arguments and the errors it raises (issue 33: kv.export's said
"see _export")."""

import inspect
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

import kvcoll as kv  # noqa: E402
from kvcoll import retention  # noqa: E402

NAMES = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
         "allreduce", "allgather", "broadcast", "preempted", "Model", "distribute",
         "Embedding", "DistributedOptimizer", "Trainer", "broadcast_variables", "save",
         "restore", "export"]
CALLBACKS = ["Checkpoint", "Export", "Evict", "TableStats", "Throughput"]
RETENTION = ["plan", "prune", "hold", "Lease", "checkpoint_versions", "live_leases"]


def public():
    yield from ((f"kv.{n}", getattr(kv, n)) for n in NAMES)
    yield from ((f"kv.callbacks.{n}", getattr(kv.callbacks, n)) for n in CALLBACKS)
    yield from ((f"kvcoll.retention.{n}", getattr(retention, n)) for n in RETENTION)


def _params(obj) -> list:
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        return []
    return [p.name for p in sig.parameters.values()
            if p.name not in ("self", "cls") and p.kind not in (p.VAR_POSITIONAL,
                                                                 p.VAR_KEYWORD)]


@pytest.mark.parametrize("name,obj", list(public()), ids=[n for n, _ in public()])
def test_a_public_docstring_says_what_its_arguments_and_its_errors(name, obj):
    doc = inspect.getdoc(obj) or ""
    assert len(doc) >= 80, f"{name}: no docstring worth the name: {doc!r}"
    assert "see _" not in doc, f"{name}: points at a private function"
    assert "raise" in doc.lower(), f"{name}: does not say what it raises (or 'Raises nothing')"
    if name.startswith("kv.") and name[3:] in ("Model", "Embedding"):
        return  # Keras' own arguments, named in the text
    missing = [p for p in _params(obj) if p not in doc]
    assert not missing, f"{name}: its docstring does not name {missing}"
