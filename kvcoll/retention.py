"""Retention: which versions in a directory may be deleted, and which must stay.

One rule, for checkpoints (`kv.save(..., max_to_keep=N)`,
`kv.callbacks.Checkpoint(..., max_to_keep=N)`, `python -m kvcoll.retention DIR --keep N`)
and for any other directory of versions that name the version they build on (published
model versions):

    keep   the newest `max_to_keep` complete versions,
           every version `pinned` (the one the directory's `latest` file names; the
           parent a running job's next delta will name),
           every version a live lease holds (a restoring job, a serving process, a
           training job whose next incremental save names it),
           and, recursively, everything a kept version needs (a delta's parent);
    delete every other complete version, newest first (a child before its parent, so a
           crash half way never leaves a kept version without its chain).

A version whose manifest cannot be read is never counted and never deleted (it may be
one a newer kvcoll wrote). Nothing but whole version directories is deleted.

Leases. A reader that must not lose a version while it reads it holds a lease: a small
file `DIR/.leases/<version>@<host>.<pid>.<token>.json` with its host, pid and expiry
(`hold(DIR, name)`, a context manager; `Lease.renew()` extends it). A lease is live
until it expires, it is released, or (on the host that checks) its process is gone.
A lease without expiry (`ttl=None`) lives as long as its process: on another host that
cannot be checked, so such a lease keeps its chain until the process releases it or a
pruner on its own host sees it gone. A pruner deletes a version in two steps: it
renames it to `.deleting-<name>-<hex>`, then looks at the leases again and renames it
back if one appeared meanwhile (a reader checks the version exists after taking its
lease, and retries when it does not), so a lease taken at any moment is respected.

The module is TF-free and imports nothing of kvcoll but the checkpoint manifest reader.

    plan(versions, max_to_keep, pinned=(), held=())  -> Plan(keep, delete, missing)
    checkpoint_versions(DIR)                         -> [Version], oldest first
    hold(DIR, name, ttl=3600.0)                      -> Lease (a context manager)
    live_leases(DIR)                                 -> {version: [lease record]}
    prune(DIR, max_to_keep, versions=None, pinned=(), dry_run=False) -> Plan
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import shutil
import socket
import time
from typing import Iterable, Sequence

from .errors import InvalidArgumentError

__all__ = ["Version", "Plan", "Lease", "plan", "checkpoint_versions", "hold",
           "live_leases", "prune", "LEASES", "LATEST"]

LEASES = ".leases"
LATEST = "latest"
_DELETING = ".deleting-"
_CKPT_RE = re.compile(r"^ckpt-(\d{10})(?:-(\d+))?$")


@dataclasses.dataclass(frozen=True)
class Version:
    """One version of a directory: its name (a subdirectory) and the version it needs
    to be read (a delta's parent; None for a full one)."""

    name: str
    parent: str | None = None


@dataclasses.dataclass(frozen=True)
class Plan:
    """What retention keeps and deletes (names; `delete` in the order it deletes,
    children first), and `missing`: versions a kept one needs that are not there (a
    chain already broken: reported, never "repaired")."""

    keep: tuple
    delete: tuple
    missing: tuple = ()


def _checked_keep(max_to_keep) -> int:
    if isinstance(max_to_keep, bool) or not isinstance(max_to_keep, int) or max_to_keep < 1:
        raise InvalidArgumentError(f"max_to_keep must be a positive integer (the newest "
                                   f"versions to keep) or None (keep all), got "
                                   f"{max_to_keep!r}")
    return max_to_keep


def plan(versions: Sequence[Version], max_to_keep: int, *, pinned: Iterable[str] = (),
         held: Iterable[str] = ()) -> Plan:
    """The retention rule (the module docstring) on `versions`, listed oldest first.
    pinned and held name versions that must stay with their chains (names that are not
    among `versions` are ignored, except that their absence is reported in `missing`).
    Raises InvalidArgumentError for a max_to_keep that is not a positive integer, and
    for two versions of one name."""
    max_to_keep = _checked_keep(max_to_keep)
    by_name = {}
    for v in versions:
        if v.name in by_name:
            raise InvalidArgumentError(f"retention: version {v.name!r} is listed twice")
        by_name[v.name] = v
    roots = [v.name for v in versions[-max_to_keep:]] + list(pinned) + list(held)
    keep, missing, todo = set(), set(), [(n, False) for n in roots]
    while todo:
        name, as_parent = todo.pop()
        v = by_name.get(name)
        if v is None:
            if as_parent:          # a root that is not there (a stale pin) is no loss
                missing.add(name)
            continue
        if name in keep:
            continue
        keep.add(name)
        if v.parent:
            todo.append((v.parent, True))
    order = [v.name for v in versions]
    return Plan(tuple(n for n in order if n in keep),
                tuple(n for n in reversed(order) if n not in keep), tuple(sorted(missing)))


def checkpoint_versions(directory) -> list:
    """The complete checkpoints of a kv.save directory (ckpt-* with a readable
    manifest), oldest first (by step, then the -k suffix of a second save at one step).
    Checkpoints whose manifest is missing or unreadable are left out (and so never
    deleted). directory: a kv.save directory (none there: an empty list). Raises
    OSError when the directory cannot be listed."""
    from .checkpoint import MANIFEST
    directory = os.fspath(directory)
    try:
        entries = os.listdir(directory)
    except FileNotFoundError:
        return []
    found = []
    for entry in entries:
        m = _CKPT_RE.match(entry)
        if not m:
            continue
        try:
            with open(os.path.join(directory, entry, MANIFEST), "rb") as f:
                manifest = json.loads(f.read())
            kind, parent = manifest["kind"], manifest.get("parent")
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if kind not in ("full", "delta") or (kind == "delta" and not parent):
            continue
        found.append(((int(m.group(1)), int(m.group(2) or 0)),
                      Version(entry, parent if kind == "delta" else None)))
    return [v for _, v in sorted(found, key=lambda kv: kv[0])]


# -- leases ----------------------------------------------------------------------------------

def _start_time(pid: int) -> str | None:
    """The process's start time (clock ticks since boot, /proc): with the pid, it tells
    a live process from a later one that reused its pid."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2:].split()[19].decode()


class Lease:
    """A reader's hold on one version of `directory` (see the module docstring).
    directory: the directory of versions; name: the version held; ttl: seconds until
    it expires unless renewed (None: as long as this process); holder: who holds it
    (written into the lease file for people). Use as a context manager, or call
    acquire() and release(). Raises InvalidArgumentError for a name that is not a
    version's (empty, with a slash, or hidden) or a ttl <= 0; acquire() raises OSError
    when the directory cannot take the lease file."""

    def __init__(self, directory, name: str, *, ttl: float | None = 3600.0,
                 holder: str = ""):
        if ttl is not None and not ttl > 0:
            raise InvalidArgumentError(f"lease ttl must be > 0 seconds or None, got {ttl!r}")
        if not name or "/" in name or name.startswith("."):
            raise InvalidArgumentError(f"lease: {name!r} is not a version name")
        self.directory = os.path.abspath(os.fspath(directory))
        self.name = name
        self.ttl = ttl
        self.holder = holder
        self.path = None

    def _record(self) -> dict:
        pid = os.getpid()
        return {"version": self.name, "host": socket.gethostname(), "pid": pid,
                "start": _start_time(pid), "holder": self.holder,
                "expires": None if self.ttl is None else time.time() + self.ttl}

    def _write(self, path: str) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self._record(), f)
        os.replace(tmp, path)

    def acquire(self) -> "Lease":
        """Write the lease file. Raises OSError when the directory cannot take it."""
        if self.path is None:
            d = os.path.join(self.directory, LEASES)
            path = os.path.join(d, f"{self.name}@{socket.gethostname()}.{os.getpid()}."
                                   f"{secrets.token_hex(4)}.json")
            for attempt in range(3):  # a release may remove the empty directory meanwhile
                os.makedirs(d, exist_ok=True)
                try:
                    self._write(path)
                    break
                except FileNotFoundError:
                    if attempt == 2:
                        raise
            self.path = path
        return self

    def renew(self, ttl: float | None = None) -> None:
        """Extend the lease by `ttl` (default: its own) from now."""
        if ttl is not None:
            self.ttl = ttl
        if self.path is not None:
            self._write(self.path)

    def release(self) -> None:
        if self.path is not None:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass
            try:  # the last lease leaves no directory behind
                os.rmdir(os.path.dirname(self.path))
            except OSError:
                pass
            self.path = None

    def __enter__(self) -> "Lease":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return f"Lease({self.directory!r}, {self.name!r}, ttl={self.ttl!r})"


def hold(directory, name: str, *, ttl: float | None = 3600.0, holder: str = "") -> Lease:
    """Take a lease on version `name` of `directory` (acquired; release it, or use it
    as a context manager). Check afterwards that the version is still there: a pruner
    that deleted it before the lease existed cannot have seen it. ttl: seconds until it
    expires unless renewed (None: as long as this process); holder: who holds it, for
    people reading the lease file. Raises InvalidArgumentError for a bad name or ttl,
    OSError when the directory cannot take the lease file."""
    return Lease(directory, name, ttl=ttl, holder=holder).acquire()


def _live(record: dict, now: float, host: str) -> bool:
    expires = record.get("expires")
    if expires is not None and not expires > now:
        return False
    if record.get("host") == host:
        pid = record.get("pid")
        start = _start_time(pid) if isinstance(pid, int) else None
        if start is None or (record.get("start") and record["start"] != start):
            return False
    return True


def live_leases(directory, *, remove_stale: bool = False) -> dict:
    """{version: [lease record, ...]} of the live leases of `directory`. A lease file
    that cannot be read counts as live for the version its name gives (its writer may
    be renewing it). remove_stale deletes the files of leases that are no longer live.
    Raises OSError when the lease directory cannot be listed (none: an empty dict)."""
    d = os.path.join(os.fspath(directory), LEASES)
    try:
        entries = os.listdir(d)
    except FileNotFoundError:
        return {}
    now, host, out = time.time(), socket.gethostname(), {}
    for entry in entries:
        if not entry.endswith(".json") or "@" not in entry:
            continue
        path = os.path.join(d, entry)
        try:
            with open(path) as f:
                record = json.load(f)
            name = record["version"]
        except (OSError, ValueError, KeyError, TypeError):
            out.setdefault(entry.split("@")[0], []).append({"file": entry})
            continue
        if _live(record, now, host):
            out.setdefault(name, []).append(dict(record, file=entry))
        elif remove_stale:
            try:
                os.remove(path)
            except FileNotFoundError:
                pass
    return out


# -- prune -----------------------------------------------------------------------------------

def _latest(directory: str, latest_file: str | None) -> list:
    if not latest_file:
        return []
    try:
        with open(os.path.join(directory, latest_file)) as f:
            name = f.read().strip()
    except (FileNotFoundError, NotADirectoryError):
        return []
    return [name] if name else []


def _needed(versions: Sequence[Version], roots: Iterable[str]) -> set:
    parents = {v.name: v.parent for v in versions}
    out, todo = set(), list(roots)
    while todo:
        n = todo.pop()
        if n in out:
            continue
        out.add(n)
        if parents.get(n):
            todo.append(parents[n])
    return out


def prune(directory, max_to_keep: int, *, versions: Sequence[Version] | None = None,
          pinned: Iterable[str] = (), latest_file: str | None = LATEST,
          dry_run: bool = False) -> Plan:
    """Apply the retention rule to `directory`: delete (unless dry_run) every version
    the rule does not keep, and return the Plan. versions: oldest first (default: the
    checkpoints, checkpoint_versions(directory)); pinned: versions to keep beyond the
    newest max_to_keep (the version `latest_file` names is always pinned); live leases
    are honoured, also those taken while it runs. Stale lease files and directories a
    crashed prune left half deleted are removed. Not a collective: one process prunes.
    Raises InvalidArgumentError for a bad max_to_keep, OSError when a deletion fails
    (the versions deleted before it stay deleted; the rest are intact)."""
    directory = os.path.abspath(os.fspath(directory))
    versions = checkpoint_versions(directory) if versions is None else list(versions)
    pinned = list(pinned) + _latest(directory, latest_file)
    held = live_leases(directory, remove_stale=not dry_run)
    p = plan(versions, max_to_keep, pinned=pinned, held=list(held))
    if dry_run:
        return p
    for entry in os.listdir(directory):  # a crash between rename and rmtree
        if entry.startswith(_DELETING):
            shutil.rmtree(os.path.join(directory, entry), ignore_errors=True)
    deleted = []
    for name in p.delete:
        src = os.path.join(directory, name)
        gone = os.path.join(directory, f"{_DELETING}{name}-{secrets.token_hex(4)}")
        try:
            os.rename(src, gone)
        except FileNotFoundError:
            continue
        # a lease taken since the plan, on this version or on one that needs it
        if name in _needed(versions, live_leases(directory)):
            os.rename(gone, src)
            continue
        shutil.rmtree(gone)
        deleted.append(name)
    kept = tuple(n for n in (v.name for v in versions) if n not in deleted)
    return Plan(kept, tuple(deleted), p.missing)


def _main(argv=None) -> int:
    import argparse
    ap = argparse.ArgumentParser(
        prog="python -m kvcoll.retention",
        description="Delete the old checkpoints of a kv.save directory: keep the newest "
                    "--keep, the one `latest` names, those a live lease holds, and every "
                    "full checkpoint and delta they need.")
    ap.add_argument("directory")
    ap.add_argument("--keep", type=int, required=True, metavar="N",
                    help="the newest checkpoints to keep (with their chains)")
    ap.add_argument("--dry-run", action="store_true", help="say what would go; delete nothing")
    args = ap.parse_args(argv)
    if not os.path.isdir(args.directory):
        ap.error(f"{args.directory} is not a directory")
    try:
        p = prune(args.directory, args.keep, dry_run=args.dry_run)
    except InvalidArgumentError as exc:
        ap.error(str(exc))
    verb = "would delete" if args.dry_run else "deleted"
    print(f"{args.directory}: kept {len(p.keep)} ({', '.join(p.keep) or '-'}); "
          f"{verb} {len(p.delete)} ({', '.join(p.delete) or '-'})")
    if p.missing:
        print(f"warning: kept checkpoints need {', '.join(p.missing)}, which are not there "
              "(their chains were broken before)")
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
