"""A directory tree that keeps receiving files, read as an unbounded stream of batches.

    >>> s = kv.data.stream("landing/dt=*/hour=*/*.parquet", 4096, label="click",
    ...                    categorical=["user", "item"], idle_timeout=None)
    >>> model.fit(s.dataset(), steps_per_epoch=1000, epochs=10**6)

Files. `pattern` is a glob (`**` recurses) of Parquet files or Criteo TSV files (plain or
.gz): `format` says which, or the pattern's suffix does. Data pipelines write a file
under a temporary name and rename it into place; names that are not the final ones are
ignored: any path part (below the pattern's fixed directory) that starts with "." or
"_" (dotfiles, `_temporary/`, `_SUCCESS`), and names ending in .tmp, ._COPYING_,
.inprogress. A file must be complete when it appears under a matching name. With
`require_success=True` a file is taken only once its directory (the partition) holds a
`_SUCCESS` marker.

Order, and how the ranks agree on it without talking. Every rank lists the tree itself;
kvcoll.data never calls MPI. The order is a function of the files alone, the same on
every rank: a file's arrival key is (its arrival time, its path below the root), where
the arrival time is the file's ctime (the time of its rename into place; rsync and
`cp -p` keep an old mtime, but not an old ctime), or, with `require_success`, the ctime
of its partition's `_SUCCESS` (so a partition's files follow each other, by name). A
listing taken at time T offers only the files that arrived before T - `settle`: a file
that arrived then was in place before the listing began, so every listing sees all of
them, and what each rank is offered is always a prefix of one global order. Ranks that
list at different moments see prefixes of different lengths, never different orders.
`settle` (1 s by default) must exceed the clock skew between the ranks and the file
server. A file that shows up with an arrival key below files already read (a clock
going back, a file touched or chmod-ed after it landed, a rename the file server
reported late) cannot be placed the same way on every rank: on_late="error" (default)
raises naming it; "skip" leaves it out, counted in `stats.late_files`.

Ranks. Each rank takes its share of each file as the readers do (kvcoll/data/_reader.py):
split="part" (default) — its byte range of a plain TSV file, its row groups of a Parquet
file (or its rows of each group when there are fewer groups than ranks); a .gz file
cannot be split, so it goes whole to one rank (chosen from a hash of its name, the same
on every rank), read in batches of the rank's part. split="global" — global batch t of
a file is its rows [t*B, (t+1)*B) and every rank gets its even_split part (every rank
scans every file; positions then do not depend on the world size). A batch never spans
two files, so a file's last batch may be short.

Waiting. When caught up, the stream lists the tree again every `idle_poll` seconds
and, while nothing new has arrived, yields an EMPTY batch (the same keys, zero rows)
at each of them: a training loop keeps its ranks in step on those (kvcoll's loop counts
an empty batch as idle and agrees on it). `idle_timeout` seconds without a new file end
the pass (StopIteration); None waits for ever. A new pass after one that ended goes on
from where it ended; a pass begun otherwise starts at the beginning of the tree, or
after a position given to `resume`. Empty files (Spark writes them) are skipped and
counted.

Position (kvcoll/data/position.py): {"last": [arrival ns, path], "at": ...}: every file
before `last` in the order is done, and `last` is done too (at None) or read up to `at`
(the file reader's own position in it, with the file's name and size fingerprint, so a
file that changed is refused). A resume lists the tree, passes over every file before
the position, and goes on there. Retention may delete finished files; the file under
way at the position must still be there.

Speed: the files are read by the Criteo and Parquet readers' own code (one reader per
file, no prefetch of its own: the stream reads ahead in one background thread); a
stream over finished files reads about as fast as the plain reader over the same files
(bench/data_bench.py measures the ratio).
"""

from __future__ import annotations

import glob
import os
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from ..errors import InvalidArgumentError
from . import _files
from ._reader import Reader, ReaderStats, seconds
from .criteo import NUM_CATEGORICAL, NUM_INTEGER, CriteoReader
from .parquet import ParquetFormatError, ParquetReader
from .position import PositionError

__all__ = ["FileStream", "StreamOrderError", "StreamStats", "stream"]

FORMATS = ("criteo", "parquet")
LATE_CHOICES = ("error", "skip")
_TEMP_SUFFIXES = (".tmp", "._COPYING_", ".inprogress")
_SUCCESS = "_SUCCESS"


class StreamOrderError(InvalidArgumentError):
    """A file arrived with an arrival key below files already read (see stream())."""


@dataclass
class StreamStats(ReaderStats):
    """One pass of a stream on this rank: ReaderStats, plus files read, empty batches
    yielded while idle, and late files left out (on_late="skip")."""
    files: int = 0
    idle_batches: int = 0
    late_files: list[str] = field(default_factory=list)


def _root(pattern: str) -> str:
    """The pattern's fixed leading directory: paths in positions are relative to it."""
    parts = pattern.split(os.sep)
    fixed = []
    for part in parts[:-1]:
        if glob.has_magic(part):
            break
        fixed.append(part)
    if not fixed:
        return "."
    return os.sep.join(fixed) or os.sep


def _format_of(pattern: str) -> str | None:
    name = pattern.lower()
    if name.endswith((".parquet", ".pq")):
        return "parquet"
    if name.endswith((".tsv", ".tsv.gz", ".txt", ".txt.gz", ".gz")):
        return "criteo"
    return None


class FileStream(Reader):
    """Batches of the files landing under a glob pattern, for one rank: see `stream`."""

    kind = "stream"
    finite = False

    def __init__(self, pattern, batch_size, rank, world, *, format, label, numeric,
                 categorical, multi_hot, null_id, split, require_success, idle_poll,
                 idle_timeout, settle, on_bad_line, on_late, prefetch, block_bytes,
                 parse_block_bytes):
        super().__init__(batch_size, rank, world, split, on_bad_line, prefetch,
                         drop_remainder=False)
        if not isinstance(pattern, (str, os.PathLike)):
            raise InvalidArgumentError(f"stream: pattern must be a path or glob pattern, got "
                                       f"{type(pattern).__name__}")
        pattern = os.fspath(pattern)
        if os.path.isdir(pattern):
            pattern = os.path.join(pattern, "**", "*")
        self.pattern = pattern
        self.root = _root(pattern)
        fmt = format if format is not None else _format_of(pattern)
        if fmt not in FORMATS:
            raise InvalidArgumentError(
                f"stream: format must be one of {FORMATS}" + (
                    f", got {format!r}" if format is not None else
                    f"; the pattern {pattern!r} does not say which (pass format=)"))
        self.format = fmt
        if on_late not in LATE_CHOICES:
            raise InvalidArgumentError(f"stream: on_late must be one of {LATE_CHOICES}, got "
                                       f"{on_late!r}")
        self.on_late = on_late
        self.require_success = bool(require_success)
        self.idle_poll = seconds(idle_poll, "stream", "idle_poll", positive=True)
        self.idle_timeout = None if idle_timeout is None else seconds(
            idle_timeout, "stream", "idle_timeout")
        self.settle = seconds(settle, "stream", "settle")
        self.block_bytes, self.parse_block_bytes = block_bytes, parse_block_bytes
        self.null_id = int(null_id)
        if fmt == "parquet":
            if not isinstance(label, str):
                raise InvalidArgumentError("stream: Parquet files need label= (the label "
                                           f"column's name), got {label!r}")
            self.label = label
            self.numeric = [numeric] if isinstance(numeric, str) else list(numeric)
            self.categorical = ([categorical] if isinstance(categorical, str)
                                else list(categorical))
            lists = [multi_hot] if isinstance(multi_hot, str) else list(multi_hot)
            unknown = [c for c in lists if c not in self.categorical]
            if unknown:
                raise InvalidArgumentError(f"stream: multi_hot names {unknown[0]!r}, which is "
                                           "not one of the categorical columns")
            self.multi_hot = {c: c in lists for c in self.categorical}
        else:
            if label is not None or numeric or categorical or multi_hot:
                raise InvalidArgumentError("stream: Criteo TSV files have fixed columns: "
                                           "leave out label, numeric, categorical, multi_hot")
        self._ended = None           # where the last pass that ran out ended

    def __repr__(self):
        return (f"FileStream({self.pattern!r}, {self.format}, batch_size={self.batch_size}, "
                f"rank={self.rank}, world={self.world}, split={self.split!r})")

    def _new_stats(self) -> StreamStats:
        return StreamStats()

    # -- model.fit ---------------------------------------------------------------------

    def features(self, batch: dict):
        """A batch as model inputs, as the format's reader gives them
        (CriteoReader.features, ParquetReader.features)."""
        if self.format == "criteo":
            return CriteoReader.features(self, batch)
        return ParquetReader.features(self, batch)

    def _signature(self, tf):
        if self.format == "criteo":
            return CriteoReader._signature(self, tf)
        return ParquetReader._signature(self, tf)

    def empty_batch(self) -> dict:
        """A batch of zero rows with this stream's keys (what it yields while idle)."""
        if self.format == "criteo":
            return {"categorical": np.zeros((0, NUM_CATEGORICAL), np.int64),
                    "numeric": np.zeros((0, NUM_INTEGER), np.float32),
                    "label": np.zeros(0, np.float32)}
        cats = {c: (np.zeros(0, np.int64), np.zeros(1, np.int64)) if self.multi_hot[c]
                else np.zeros(0, np.int64) for c in self.categorical}
        return {"categorical": cats, "numeric": np.zeros((0, len(self.numeric)), np.float32),
                "label": np.zeros(0, np.float32)}

    # -- positions ---------------------------------------------------------------------

    def _file_position(self, fields: dict) -> dict:
        last = fields["last"]
        return self._position(format=self.format, batch_size=self.batch_size,
                              last=None if last is None else list(last), at=fields["at"])

    def _start_position(self, fields) -> dict:
        return self._file_position(fields or {"last": None, "at": None})

    def _begin(self):
        if self._resume_fields is None and self._ended is not None:
            self._resume_fields = self._ended         # go on after a pass that ran out
        return super()._begin()

    def _accept(self, position: dict) -> dict:
        if position.get("format") != self.format:
            raise PositionError(f"stream: resume: the position is of a {position.get('format')} "
                                f"stream, this one reads {self.format}")
        last, at = position.get("last"), position.get("at")
        if last is not None and not (isinstance(last, (list, tuple)) and len(last) == 2
                                     and isinstance(last[0], int) and isinstance(last[1], str)):
            raise PositionError(f"stream: resume: bad 'last' {last!r} in the position (want "
                                "[arrival ns, path] or None)")
        if at is not None and (not isinstance(at, dict) or last is None):
            raise PositionError(f"stream: resume: bad 'at' {at!r} in the position")
        return {"last": None if last is None else (int(last[0]), str(last[1])), "at": at}

    # -- listing -----------------------------------------------------------------------

    def _ignored(self, rel: str) -> bool:
        parts = rel.split("/")
        return (any(p.startswith((".", "_")) for p in parts)
                or parts[-1].endswith(_TEMP_SUFFIXES))

    def _list(self) -> list[tuple[int, str, str]]:
        """The files that arrived before now - settle, as (arrival ns, path below the
        root, path), in arrival order."""
        cutoff = time.time_ns() - int(self.settle * 1e9)
        markers: dict[str, int | None] = {}
        out = []
        for path in glob.glob(self.pattern, recursive=True):
            rel = os.path.relpath(path, self.root).replace(os.sep, "/")
            if self._ignored(rel):
                continue
            try:
                st = os.stat(path)
            except OSError:
                continue                    # renamed or removed since the listing
            if not os.path.isfile(path):
                continue
            arrived = st.st_ctime_ns
            if self.require_success:
                d = os.path.dirname(path)
                if d not in markers:
                    try:
                        markers[d] = os.stat(os.path.join(d, _SUCCESS)).st_ctime_ns
                    except OSError:
                        markers[d] = None
                if markers[d] is None:
                    continue
                arrived = markers[d]
            if arrived < cutoff:
                out.append((arrived, rel, path))
        out.sort()
        return out

    def _late(self, arrived: int, rel: str, last, stats: StreamStats) -> None:
        msg = (f"stream: {rel} (under {self.root}) arrived with ctime {arrived} ns, before "
               f"{last[1]} (ctime {last[0]} ns), which was already read: its place in the "
               f"order is not the same on every rank. Raise settle (now {self.settle} s) "
               "above the clock skew between the ranks and the file server, and do not "
               "touch or chmod landed files; or pass on_late='skip' to leave such files out")
        if self.on_late == "error":
            raise StreamOrderError(msg)
        stats.late_files.append(rel)

    # -- one pass ----------------------------------------------------------------------

    def _batches(self, stats: StreamStats, start) -> Iterator[tuple[dict, dict]]:
        last = at = None
        if start is not None:
            last, at = start["last"], start["at"]
        seen: set[str] = set(start.get("_seen", ())) if start is not None else set()
        # after a resume, the first listing's files before the position were read before
        first_listing = start is not None and "_seen" not in start
        idle_since = time.monotonic()
        slept = False
        while True:
            todo = []
            for arrived, rel, path in self._list():
                if rel in seen:
                    continue
                key = (arrived, rel)
                if last is not None and (key < last or (key == last and at is None)):
                    seen.add(rel)
                    if not first_listing:    # (before the resume position: done already)
                        self._late(arrived, rel, last, stats)
                    continue
                todo.append((key, path))
            if first_listing and at is not None and all(k != last for k, _ in todo):
                raise PositionError(
                    f"stream: resume: the position is inside {last[1]} (under {self.root}, "
                    f"arrived {last[0]} ns), which is no longer there: a file under way at a "
                    "checkpoint must stay until the job has gone past it")
            first_listing = False
            for key, path in todo:
                inner = at if key == last else None
                last, at = key, None
                for batch, fields in self._read_file(path, key[1], inner, stats):
                    at = fields
                    yield batch, {"last": last, "at": at}
                at = None
                seen.add(key[1])
                stats.files += 1
                idle_since = time.monotonic()
            if todo:
                slept = False
                continue
            if slept:
                stats.idle_batches += 1
                yield self.empty_batch(), {"last": last, "at": at}
            if self.idle_timeout is not None:
                left = self.idle_timeout - (time.monotonic() - idle_since)
                if left <= 0:
                    self._ended = {"last": last, "at": at, "_seen": seen}
                    return
                time.sleep(min(self.idle_poll, left))
            else:
                time.sleep(self.idle_poll)
            slept = True

    def _read_file(self, path: str, rel: str, inner, stats) -> Iterator[tuple[dict, dict]]:
        """This rank's batches of one file (from `inner`, a position in it), each with
        the position in the file after it (the file's fingerprint added)."""
        reader = self._file_reader(path, rel)
        if reader is None:
            return
        start = None
        if inner is not None:
            fields = {k: v for k, v in inner.items() if k != "data"}
            full = reader._file_position(fields)
            full["data"] = inner.get("data")
            try:
                start = reader._accept(full)
            except PositionError as exc:
                raise PositionError(f"stream: resume inside {rel}: {exc}") from None
        for batch, fields in reader._batches(stats, start):
            yield batch, {**fields, "data": reader.data}

    def _file_reader(self, path: str, rel: str):
        if self.format == "criteo":
            if self.split == "part" and _files.is_gzip(path):
                if zlib.crc32(rel.encode()) % self.world != self.rank:
                    return None              # a whole .gz file: another rank's
                return CriteoReader([path], self.part_batch_size, 0, 1, False, "part",
                                    self.on_bad_line, 0, self.block_bytes,
                                    self.parse_block_bytes, 0, _skip_empty=True)
            return CriteoReader([path], self.batch_size, self.rank, self.world, False,
                                self.split, self.on_bad_line, 0, self.block_bytes,
                                self.parse_block_bytes, 0, _skip_empty=True)
        reader = ParquetReader([path], self.batch_size, self.rank, self.world, False,
                               self.split, self.on_bad_line, 0, self.label, self.numeric,
                               self.categorical, self.null_id, 0, _skip_empty=True)
        for c in self.categorical:
            if reader.multi_hot[c] != self.multi_hot[c]:
                raise ParquetFormatError(
                    f"stream: {path}: column {c!r} is {'' if reader.multi_hot[c] else 'not '}"
                    f"a list, but the stream was told it is {'' if self.multi_hot[c] else 'not '}"
                    f"one: name the list columns in multi_hot= (the model's inputs are fixed "
                    "before the files arrive)")
        return reader


def stream(pattern, batch_size: int, rank: int | None = None, world: int | None = None, *,
           format: str | None = None, label: str | None = None, numeric=(), categorical=(),
           multi_hot=(), null_id: int = -1, split: str = "part",
           require_success: bool = False, idle_poll: float = 1.0,
           idle_timeout: float | None = None, settle: float = 1.0,
           on_bad_line: str = "error", on_late: str = "error", prefetch: int = 2,
           block_bytes: int = 8 << 20, parse_block_bytes: int = 1 << 20) -> FileStream:
    """This rank's batches of the files landing under `pattern`, an unbounded source
    (see the module docstring): iterate it, or `.dataset()` / `.fit_batches()` for
    model.fit with steps_per_epoch.

    pattern: a glob (`landing/dt=*/hour=*/*.parquet`; `**` recurses) or a directory
        (every file under it).
    batch_size: the global batch B; rank, world: kvcoll's by default.
    format: "parquet" or "criteo" (TSV, plain or .gz); default from the pattern's suffix.
    label, numeric, categorical, null_id: Parquet columns, as read_parquet; multi_hot:
        the categorical columns that are lists (the model's inputs are fixed before any
        file arrives; a file that disagrees is refused).
    split: "part" (default: each rank reads its share of each file) or "global".
    require_success: take a directory's files only once it holds a _SUCCESS marker.
    idle_poll: seconds between listings when caught up, and between the empty batches
        yielded then. idle_timeout: seconds without a new file that end the pass (None:
        wait for ever). settle: how old a file's arrival must be before it is read (above
        the clock skew between ranks and the file server).
    on_bad_line: as the readers ("error" names file, line and column). on_late: "error"
        or "skip" for a file arriving out of order (module docstring).
    prefetch: batches read ahead by a background thread.
    """
    return FileStream(pattern, batch_size, rank, world, format=format, label=label,
                      numeric=numeric, categorical=categorical, multi_hot=multi_hot,
                      null_id=null_id, split=split, require_success=require_success,
                      idle_poll=idle_poll, idle_timeout=idle_timeout, settle=settle,
                      on_bad_line=on_bad_line, on_late=on_late, prefetch=prefetch,
                      block_bytes=block_bytes, parse_block_bytes=parse_block_bytes)
