"""Where a data source is: the one reader-position mechanism of kvcoll's data.

A job that checkpoints must record how much data its committed steps consumed, and a
restart must continue exactly there: every sample once, none twice, none skipped. The
same mechanism serves a mid-epoch resume of a file reader, a stream of landing files,
a Kafka topic, and (later) a re-planned reader on another world size.

The protocol. Every kvcoll data source (CriteoReader, ParquetReader, SyntheticCTR's
`batches()`, `stream()`, `kafka()`) is an iterable of batch dicts, each `iter()` one
pass (an epoch), and has:

- `source.position_at(consumed) -> dict`: this rank's position after the first
  `consumed` batches of the current pass (the pass begun last: counted since it began,
  so since the last `resume` when the pass is a resumed one). The training loop counts
  the batches it took and committed; the source may have produced more (its prefetch
  thread, tf.data's prefetch), so it keeps a log of the positions after each of the
  last `position_log` batches it produced (1024 by default: a position is a small dict).
  `consumed` 0 is the pass's start, always known. A `consumed` older than the log
  keeps, or beyond what was produced, raises PositionError naming both.
- `source.resume(position)`: the next pass starts right after `position` (only that
  pass: later ones start from the beginning for finite data, so the first pass after a
  mid-epoch resume is short). A position at the very end of finite data resumes as a
  full new pass (the epoch it ended is over).
- `source.dataset()`: a tf.data.Dataset that the loop can trace back to its source with
  `source_of(dataset)` (next).

Finding the source. `source_of(x)` returns the source behind x: the source itself, an
iterator from its `fit_batches()`, or a tf.data.Dataset made by its `dataset()` (which
carries a reference to it, `_kvcoll_source`), through any number of 1:1 transforms
(map, prefetch, options, ...). A transform that changes which batch is the k-th (batch,
unbatch, filter, skip, take, shuffle, repeat, cache, interleave, ...) makes the count of
batches the loop took mean something else: `source_of` then raises PositionError naming
it. It returns None for data that is not a kvcoll source.

A position is a small JSON-able dict:

    {"kind": "criteo", "version": 1, "world": 2, "rank": 0, "split": "global",
     "data": "3f2a...", "rows": 40960}

kind and version name its format (a newer version than this kvcoll knows is refused);
world, rank and split say what it was taken for; "data" fingerprints the files (their
names and sizes) where a reader has a fixed set of them; the rest is the kind's own.
The splits:
- "global": the global batch of step t does not depend on the world size, so every
  rank's position is the same and any of them resumes any world size;
- "part": each rank reads its own part, which depends on the world size: such a
  position resumes only the same rank of the same world size (re-planning a part on
  another world is the elastic issue's; `for_rank` is where it will go);
- "partitions" (Kafka): each rank owns partitions p with p mod world = rank, and a
  position holds the next offset of each; every rank's positions together cover every
  partition, so `for_rank` merges them for any world size.

The loop stores every rank's position in a checkpoint and, on restart, hands each rank
`for_rank(positions, rank, world)` to `resume`.
"""

from __future__ import annotations

import collections
import hashlib
import os
import threading

from ..errors import InvalidArgumentError

__all__ = ["POSITION_LOG", "SPLITS", "VERSION", "PositionError", "PositionLog",
           "Positioned", "fingerprint", "for_rank", "source_of"]

VERSION = 1
POSITION_LOG = 1024
SPLITS = ("global", "part", "partitions")
_HEADER = ("kind", "version", "world", "rank", "split")


class PositionError(InvalidArgumentError):
    """A data position that cannot be taken or resumed from (the message says why)."""


def fingerprint(paths, sizes) -> str:
    """A short digest of file names (not directories: data may move) and sizes, so a
    position is not resumed on other files."""
    h = hashlib.sha1()
    for path, size in zip(paths, sizes):
        h.update(os.path.basename(os.fspath(path)).encode() + b"\0" + str(int(size)).encode()
                 + b"\n")
    return h.hexdigest()[:16]


def _header(position, what: str) -> None:
    if not isinstance(position, dict):
        raise PositionError(f"{what}: a position is a dict (from position_at), got "
                            f"{type(position).__name__}")
    missing = [k for k in _HEADER if k not in position]
    if missing:
        raise PositionError(f"{what}: the position {position!r} lacks {', '.join(missing)}: "
                            "pass a dict that position_at returned")
    v = position["version"]
    if not isinstance(v, int) or v < 1:
        raise PositionError(f"{what}: bad position version {v!r}")
    if v > VERSION:
        raise PositionError(f"{what}: the position has version {v}, newer than this kvcoll's "
                            f"{VERSION}: resume with the kvcoll that wrote it, or newer")
    if position["split"] not in SPLITS:
        raise PositionError(f"{what}: the position's split {position['split']!r} is not one "
                            f"of {SPLITS}")


def for_rank(positions, rank: int, world: int) -> dict:
    """The position rank `rank` of a `world`-rank job resumes from, given the positions
    of every rank of the job that saved them (a list in that job's rank order).

    Same world size: that rank's own. Another world size: split "global" needs every
    rank at the same position (the loop commits steps in step, so they are) and returns
    it; "partitions" merges every rank's partition offsets; "part" raises PositionError
    (a rank's part depends on the world size: re-planning it is the elastic issue's)."""
    positions = list(positions)
    if not positions:
        raise PositionError("for_rank: no positions (a checkpoint holds one per rank)")
    for p in positions:
        _header(p, "for_rank")
    first = positions[0]
    old = len(positions)
    for r, p in enumerate(positions):
        if p["kind"] != first["kind"] or p["split"] != first["split"]:
            raise PositionError(f"for_rank: rank {r}'s position is a {p['kind']} {p['split']} "
                                f"one, rank 0's a {first['kind']} {first['split']} one")
        if p["world"] != old or p["rank"] != r:
            raise PositionError(f"for_rank: position {r} of {old} says it is rank {p['rank']} "
                                f"of {p['world']}: pass every rank's position, in rank order")
    if not 0 <= rank < world:
        raise PositionError(f"for_rank: need 0 <= rank < world, got rank {rank}, world {world}")
    if world == old:
        return dict(positions[rank])
    split = first["split"]
    if split == "global":
        body = [{k: v for k, v in p.items() if k != "rank"} for p in positions]
        differ = [r for r, b in enumerate(body) if b != body[0]]
        if differ:
            raise PositionError(
                f"for_rank: ranks 0 and {differ[0]} were at different positions ({positions[0]!r} "
                f"and {positions[differ[0]]!r}): a global position resumes another world size "
                f"only when every rank was at the same one (a checkpoint at a step every rank "
                f"committed); resume on {old} ranks")
        return dict(first, world=world, rank=rank)
    if split == "partitions":
        merged: dict = {}
        for r, p in enumerate(positions):
            for part, offset in p["partitions"].items():
                if part in merged:
                    raise PositionError(f"for_rank: partition {part} is in the positions of two "
                                        f"ranks (the second is rank {r})")
                merged[part] = offset
        return dict(first, world=world, rank=rank, partitions=merged)
    raise PositionError(
        f"for_rank: a {first['kind']} position with split='part' was taken on {old} ranks "
        f"and cannot resume on {world}: each rank read a part of the data that depends on the "
        f"world size. Resume on {old} ranks, or read with split='global' (whose positions "
        "resume on any world size)")


class PositionLog:
    """The positions after each batch of one pass, the last `keep` of them, and the
    pass's start. Written by the reading thread, read by the training loop's."""

    def __init__(self, start: dict, keep: int = POSITION_LOG, what: str = "reader"):
        self._start = start
        self._keep = int(keep)
        self._entries: collections.deque = collections.deque(maxlen=self._keep)
        self._produced = 0
        self._lock = threading.Lock()
        self._what = what

    @property
    def produced(self) -> int:
        return self._produced

    def record(self, position: dict) -> None:
        with self._lock:
            self._entries.append(position)
            self._produced += 1

    def restart(self, start: dict) -> None:
        """The pass now starts at `start` (an exhausted resume turned into a full pass);
        only valid before any batch was recorded."""
        with self._lock:
            assert self._produced == 0
            self._start = start

    def at(self, consumed) -> dict:
        if isinstance(consumed, bool) or not isinstance(consumed, int) \
                and not hasattr(consumed, "__index__"):
            raise PositionError(f"{self._what}: position_at needs an int count of batches, got "
                                f"{consumed!r}")
        consumed = int(consumed)
        with self._lock:
            if consumed < 0:
                raise PositionError(f"{self._what}: position_at({consumed}): a count of batches "
                                    "is >= 0")
            if consumed == 0:
                return dict(self._start)
            if consumed > self._produced:
                raise PositionError(
                    f"{self._what}: position_at({consumed}): this pass has produced only "
                    f"{self._produced} batches; count the batches taken since the pass began "
                    "(or since the last resume)")
            oldest = self._produced - len(self._entries) + 1
            if consumed < oldest:
                raise PositionError(
                    f"{self._what}: position_at({consumed}): the log keeps the positions after "
                    f"batches {oldest}..{self._produced} of this pass only (position_log="
                    f"{self._keep}); ask for the position of a committed step right after it "
                    "is committed, or raise the source's position_log")
            return dict(self._entries[consumed - oldest])


class Positioned:
    """The position protocol's shared half, for sources that keep (kind, rank, world,
    split): `position_at`, `resume` and the per-pass log. A source calls `_begin(...)`
    when a pass begins, `log.record(...)` for each batch it produces, and implements
    `_accept(position) -> fields` (its own checks of a position to resume from) and
    `_start_position(fields)` (the position a pass starting at `fields` begins at;
    fields None: where a pass without resume begins)."""

    kind = "source"
    position_log = POSITION_LOG

    def _init_positions(self) -> None:
        self._resume_fields = None
        self._log: PositionLog | None = None

    def _position(self, **fields) -> dict:
        return {"kind": self.kind, "version": VERSION, "world": self.world, "rank": self.rank,
                "split": self._position_split(), **fields}

    def _position_split(self) -> str:
        return self.split

    def _begin(self) -> tuple[dict | None, PositionLog]:
        """A new pass: (the fields to start from, or None) and its log."""
        fields, self._resume_fields = self._resume_fields, None
        self._log = PositionLog(self._start_position(fields), self.position_log, self.kind)
        return fields, self._log

    def position_at(self, consumed: int) -> dict:
        """This rank's position after the first `consumed` batches of the current pass
        (kvcoll.data.position)."""
        if self._log is None:
            if consumed != 0:
                raise PositionError(f"{self.kind}: position_at({consumed}): no pass has begun; "
                                    "only position_at(0), where the next pass starts, is known")
            return self._start_position(self._resume_fields)
        return self._log.at(consumed)

    def resume(self, position: dict) -> None:
        """Start the next pass right after `position` (from this source's position_at, or
        `kvcoll.data.position.for_rank`); later passes start as usual."""
        self._resume_fields = self._accept(self._check_header(position))

    def _check_header(self, position) -> dict:
        what = f"{self.kind}: resume"
        _header(position, what)
        if position["kind"] != self.kind:
            raise PositionError(f"{what}: the position is a {position['kind']!r} one, this is a "
                                f"{self.kind!r} source")
        split = self._position_split()
        if position["split"] != split:
            raise PositionError(f"{what}: the position was taken with split={position['split']!r}, "
                                f"this source reads split={split!r}")
        if position["world"] != self.world:
            if split == "global":
                return position
            if split == "part":
                raise PositionError(
                    f"{what}: the position was taken on {position['world']} ranks with "
                    f"split='part' and this job has {self.world}: each rank's part depends on "
                    f"the world size. Resume on {position['world']} ranks, or read with "
                    "split='global'")
            raise PositionError(
                f"{what}: the position is rank {position['rank']}'s of {position['world']} ranks "
                f"and this job has {self.world}: merge every rank's positions with "
                "kvcoll.data.position.for_rank(positions, rank, world)")
        if split != "global" and position["rank"] != self.rank:
            raise PositionError(f"{what}: the position is rank {position['rank']}'s, this is rank "
                                f"{self.rank}: give each rank its own (for_rank does)")
        return position

    def _need(self, position: dict, key: str, kinds=int):
        if key not in position or isinstance(position[key], bool) \
                or not isinstance(position[key], kinds):
            raise PositionError(f"{self.kind}: resume: the position lacks a valid {key!r} "
                                f"(got {position.get(key)!r}): pass a dict that position_at "
                                "returned")
        return position[key]

    def _check_data(self, position: dict, data: str) -> None:
        if position.get("data") != data:
            raise PositionError(f"{self.kind}: resume: the position was taken on other files "
                                f"(fingerprint {position.get('data')!r}, these files' "
                                f"{data!r}): resume with the files, in the order, it was read "
                                "from")

    def _accept(self, position: dict):
        raise NotImplementedError

    def _start_position(self, fields) -> dict:
        raise NotImplementedError


# -- finding the source behind what the loop was given ------------------------------------

_ONE_TO_ONE = ("MapDataset", "ParallelMapDataset", "PrefetchDataset", "OptionsDataset",
               "ModelDataset", "MaxIntraOpParallelismDataset", "PrivateThreadPoolDataset",
               "AssertCardinalityDataset", "ThreadingDataset", "DatasetV1Adapter")


def _is_source(x) -> bool:
    return callable(getattr(x, "position_at", None)) and callable(getattr(x, "resume", None))


def source_of(x):
    """The kvcoll source behind x (a source, its fit_batches() iterator, or its dataset()
    through 1:1 tf.data transforms), or None when x is not from a kvcoll source. Raises
    PositionError when a transform between the source and x changes which batch is the
    k-th (then a count of batches taken does not locate the source)."""
    if _is_source(x):
        return x
    src = getattr(x, "_kvcoll_source", None)
    if src is not None:
        return src
    inputs = getattr(x, "_inputs", None)
    if not callable(inputs):
        return None
    path = []
    cur = x
    while True:
        src = getattr(cur, "_kvcoll_source", None)
        if src is not None:
            bad = [type(d).__name__ for d in path
                   if not type(d).__name__.lstrip("_").endswith(_ONE_TO_ONE)]
            if bad:
                raise PositionError(
                    f"the dataset passes through {bad[0]} between the kvcoll {src.kind} source "
                    "and the loop: a checkpoint's data position counts the batches the loop "
                    "took, which that transform changes. Apply only 1:1 transforms (map, "
                    "prefetch, with_options) to a kvcoll dataset, or build the batches in the "
                    "source")
            return src
        try:
            ins = list(cur._inputs())
        except Exception:  # noqa: BLE001 (a dataset that cannot list its inputs)
            return None
        if len(ins) != 1:
            found = [s for s in (source_of(i) for i in ins) if s is not None] if ins else []
            if found:
                raise PositionError(
                    f"the dataset combines {len(ins)} datasets ({type(cur).__name__}) after the "
                    f"kvcoll {found[0].kind} source: a data position needs one source per loop")
            return None
        path.append(cur)
        cur = ins[0]
