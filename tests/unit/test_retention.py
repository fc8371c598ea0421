"""kvcoll.retention: the one rule for what may be deleted (checkpoints, published
versions), leases, and prune on a directory. TF-free; kv.save / Checkpoint(max_to_keep)
end to end: tests/unit/test_callbacks.py."""

import json
import os
import subprocess
import sys

import pytest

from kvcoll import retention
from kvcoll.errors import InvalidArgumentError
from kvcoll.retention import Version, plan


def chain(*spec):
    """Versions from "F" (full) and "D" (delta of the one before), named v0, v1, ..."""
    out = []
    for i, kind in enumerate(spec):
        out.append(Version(f"v{i}", None if kind == "F" else f"v{i - 1}"))
    return out


def test_plan_keeps_the_newest_and_every_version_they_need():
    vs = chain("F", "D", "D", "F", "D", "D", "D")
    p = plan(vs, 2)
    assert p.keep == ("v3", "v4", "v5", "v6")        # v5, v6 need v4 and v3
    assert p.delete == ("v2", "v1", "v0")            # children before parents
    assert plan(vs, 5).keep == tuple(f"v{i}" for i in range(7))   # v2 needs v1, v0
    assert plan(vs, 1, pinned=["v1"]).delete == ("v2",)
    assert plan(vs, 1, held=["v0"]).delete == ("v2", "v1")
    assert plan(vs, 100).delete == ()


def test_plan_reports_a_chain_broken_before_and_ignores_stale_pins():
    vs = [Version("a", None), Version("c", "b"), Version("d", "c")]
    p = plan(vs, 1, pinned=["gone"])
    assert p.keep == ("c", "d") and p.delete == ("a",) and p.missing == ("b",)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "3"])
def test_max_to_keep_must_be_a_positive_integer(bad):
    with pytest.raises(InvalidArgumentError, match="max_to_keep must be a positive integer"):
        plan(chain("F"), bad)


def test_a_version_listed_twice_is_an_error():
    with pytest.raises(InvalidArgumentError, match="listed twice"):
        plan([Version("a"), Version("a")], 1)


# -- on a directory ---------------------------------------------------------------------------

def make(directory, spec, latest=True):
    """ckpt-* directories with manifests: spec like "FDDFD" (steps 100, 200, ...)."""
    os.makedirs(directory, exist_ok=True)
    names, prev = [], None
    for i, kind in enumerate(spec):
        name = f"ckpt-{(i + 1) * 100:010d}"
        os.mkdir(os.path.join(directory, name))
        m = {"format": "kvcoll-checkpoint", "version": 3,
             "kind": "full" if kind == "F" else "delta",
             "parent": None if kind == "F" else prev, "step": (i + 1) * 100}
        with open(os.path.join(directory, name, "manifest.json"), "w") as f:
            json.dump(m, f)
        with open(os.path.join(directory, name, "000-t.r0-of-1.kvs"), "wb") as f:
            f.write(b"x" * 1000)
        names.append(name)
        prev = name
    if latest:
        with open(os.path.join(directory, "latest"), "w") as f:
            f.write(names[-1] + "\n")
    return names


def present(directory):
    return sorted(e for e in os.listdir(directory) if e.startswith("ckpt-"))


def test_checkpoint_versions_reads_the_manifests_in_step_order(tmp_path):
    names = make(tmp_path, "FDD")
    os.mkdir(tmp_path / "ckpt-0000000200-1")   # a second save at step 200 ...
    (tmp_path / "ckpt-0000000200-1" / "manifest.json").write_text(
        json.dumps({"kind": "delta", "parent": names[1]}))
    os.mkdir(tmp_path / "ckpt-0000000050")     # ... and one without a manifest
    os.mkdir(tmp_path / "ckpt-0000000400.tmp-abc")
    vs = retention.checkpoint_versions(tmp_path)
    assert [v.name for v in vs] == [names[0], names[1], "ckpt-0000000200-1", names[2]]
    assert vs[0].parent is None and vs[2].parent == names[1]


def test_prune_deletes_whole_old_chains_and_keeps_what_it_cannot_read(tmp_path):
    names = make(tmp_path, "FDDFDD")
    os.mkdir(tmp_path / "ckpt-0000000050")     # no manifest: never counted nor deleted
    p = retention.prune(tmp_path, 1)
    assert p.delete == tuple(reversed(names[:3]))
    assert present(tmp_path) == ["ckpt-0000000050"] + names[3:]
    assert not [e for e in os.listdir(tmp_path) if e.startswith(".deleting-")]
    assert retention.prune(tmp_path, 1).delete == ()


def test_prune_keeps_the_version_latest_names(tmp_path):
    names = make(tmp_path, "FFF")
    (tmp_path / "latest").write_text(names[0] + "\n")  # say, a save whose commit failed
    retention.prune(tmp_path, 1)
    assert present(tmp_path) == [names[0], names[2]]


def test_a_live_lease_keeps_its_version_and_chain_and_a_released_one_does_not(tmp_path):
    names = make(tmp_path, "FDDF")
    with retention.hold(tmp_path, names[1], holder="a server"):
        assert list(retention.live_leases(tmp_path)) == [names[1]]
        retention.prune(tmp_path, 1)
        assert present(tmp_path) == [names[0], names[1], names[3]]
    assert retention.live_leases(tmp_path) == {}
    retention.prune(tmp_path, 1)
    assert present(tmp_path) == [names[3]]


def test_expired_leases_and_leases_of_dead_processes_are_stale(tmp_path):
    names = make(tmp_path, "FFF")
    expired = retention.Lease(tmp_path, names[0], ttl=0.01).acquire()
    dead = subprocess.run(
        [sys.executable, "-c", "import sys; from kvcoll import retention; "
         "print(retention.hold(sys.argv[1], sys.argv[2], ttl=None).path)",
         str(tmp_path), names[1]], capture_output=True, text=True, check=True)
    assert os.path.exists(dead.stdout.strip())      # its process exited without releasing
    import time
    time.sleep(0.05)
    assert retention.live_leases(tmp_path) == {}
    retention.prune(tmp_path, 1)
    assert present(tmp_path) == [names[2]]
    assert os.listdir(tmp_path / retention.LEASES) == []   # stale files removed
    expired.release()


def test_a_lease_taken_while_prune_runs_is_respected(tmp_path, monkeypatch):
    """The reader's lease appears after prune planned: the version is renamed back."""
    names = make(tmp_path, "FDF")
    real = retention.live_leases
    calls = []

    def late(directory, **kw):
        calls.append(1)
        if len(calls) == 2:   # first look: no lease; then a reader leases the delta
            retention.hold(tmp_path, names[1])
        return real(directory, **kw)

    monkeypatch.setattr(retention, "live_leases", late)
    p = retention.prune(tmp_path, 1)
    assert names[1] not in p.delete and names[0] not in p.delete
    assert present(tmp_path) == names


def test_a_lease_needs_a_version_name(tmp_path):
    with pytest.raises(InvalidArgumentError, match="not a version name"):
        retention.hold(tmp_path, "../x")
    with pytest.raises(InvalidArgumentError, match="ttl"):
        retention.Lease(tmp_path, "v", ttl=0)


def test_the_command_line(tmp_path):
    names = make(tmp_path, "FDFD")
    run = [sys.executable, "-m", "kvcoll.retention", str(tmp_path), "--keep", "1"]
    out = subprocess.run(run + ["--dry-run"], capture_output=True, text=True, check=True)
    assert f"would delete 2 ({names[1]}, {names[0]})" in out.stdout
    assert present(tmp_path) == names
    out = subprocess.run(run, capture_output=True, text=True, check=True)
    assert "deleted 2" in out.stdout and present(tmp_path) == names[2:]
    bad = subprocess.run(run[:-1] + ["0"], capture_output=True, text=True)
    assert bad.returncode == 2 and "max_to_keep must be a positive integer" in bad.stderr
