"""What the file readers share: the two ways of splitting data over ranks, bad-line
handling, reading ahead, and the three ways to consume a reader.

split="global" keeps the synthetic set's contract: the global batch of step t is
rows [t*B, (t+1)*B) of the data (the files concatenated in order) whatever the world
size, and rank r gets its `even_split` part of it; every rank yields the same number
of batches (a rank's part of a short last batch may be empty), so a synchronous loop
stays in step. Rank r's rows of every batch are spread over the whole data, so each
rank has to look at all of it: it reads every byte to find the line ends (a vectorised
scan, no parsing) and parses only its own lines, or, for Parquet, decodes every row
group it has rows in (with B/world well below a row group's size: all of them).

split="part" reads only a rank's own part: its byte range of the text files (cut at
line ends), its .gz files, or its Parquet row groups, in batches of
even_split(B, rank, world) rows (about B/world). Nothing is read twice, so reading
scales with the ranks; the global batch of a step now depends on the world size, and
ranks may run out at different steps (model.fit and kv.Trainer keep going until every
rank is done). Use it when the data is large next to what a rank trains per second.

Bad lines: on_bad_line="error" (default) raises a format error naming the file, the
line (or row group) and the column; "skip" drops the line, counts it in `stats`
and goes on. In split="global" a skipped line shortens the batch it was in, on the
rank that owned it, so batches still do not depend on the world size.

A reader is an iterable of batch dicts (each pass over it is one epoch), with
`fit_batches()` (an iterator of (features, label) for model.fit or a hand-written
loop) and `dataset()` (a tf.data.Dataset of the same). Batches are prepared by a
background thread, `prefetch` batches ahead; an error there is raised on the
consuming thread, with its message naming file and line.

Positions (kvcoll/data/position.py): `position_at(consumed)` and `resume(position)`.
A subclass's pass yields (batch, fields) pairs, fields being the kind's part of the
position after that batch; the base logs them. split="global" positions count global
rows ({"rows": t*B} after step t), so they resume on any world size (and any batch
size dividing the rows); split="part" positions locate this rank's part.

Errors on one rank: a parse error is found only by the rank that parses the line. In
model.fit, a reader that raises on one rank makes every rank raise the same error,
before any update (the step's agreement). In a hand-written loop it is raised on that
rank only; left uncaught, kvcoll's abort hook (installed by kvcoll.init) ends the whole
job rather than leave the other ranks waiting in a collective.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from ..errors import InvalidArgumentError
from ._prefetch import Prefetch
from .position import Positioned, PositionError
from .shard import _check_rank, even_split

__all__ = ["BAD_LINE_CHOICES", "SPLIT_CHOICES", "Reader", "ReaderStats", "rank_world"]

SPLIT_CHOICES = ("global", "part")
BAD_LINE_CHOICES = ("error", "skip")
_KEEP_MESSAGES = 10


def seconds(value, what: str, name: str, positive: bool = False) -> float:
    """A duration setting `name` of reader `what` as a float: >= 0 seconds (> 0 with
    positive), finite; else an error naming it."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = float("nan")
    if isinstance(value, bool) or not v >= 0 or (positive and v == 0) or v == float("inf"):
        raise InvalidArgumentError(f"{what}: {name} must be a number of seconds "
                                   f"{'> 0' if positive else '>= 0'}, got {value!r}")
    return v


def rank_world(rank, world) -> tuple[int, int]:
    """rank and world as given; None for both means kvcoll's own after kvcoll.init(),
    else a single process (0, 1)."""
    if rank is None and world is None:
        from .. import runtime  # here, so kvcoll.data never loads MPI by itself

        if runtime.is_initialized():
            return runtime.rank(), runtime.size()
        return 0, 1
    if rank is None or world is None:
        raise InvalidArgumentError("give both rank and world, or neither (kvcoll's after "
                                   "kvcoll.init(), else a single process)")
    return _check_rank(rank, world)


@dataclass
class ReaderStats:
    """One pass of a reader on this rank: rows and batches yielded, bad lines (or rows)
    skipped with the first few messages, empty files skipped."""
    rows: int = 0
    batches: int = 0
    skipped: int = 0
    empty_files: int = 0
    skipped_examples: list[str] = field(default_factory=list)

    def skip(self, count: int, message: str | None) -> None:
        self.skipped += count
        if message and len(self.skipped_examples) < _KEEP_MESSAGES:
            self.skipped_examples.append(message)


class Reader(Positioned):
    """Base of the file readers: argument checks, passes, prefetching, positions, fit and
    tf.data.

    Subclasses implement `_batches(stats, start)` (a generator of (batch dict, position
    fields) for one pass, from `start`: fields `_accept` returned, or None for the
    usual beginning), `_accept(position)`, `_start_position(fields)`, `features(batch)`
    and `_signature(tf)`.
    """

    finite = True          # a pass ends: a resume at the end runs a full pass instead

    kind = "reader"

    def __init__(self, batch_size, rank, world, split, on_bad_line, prefetch, drop_remainder,
                 start_step=0):
        if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) \
                or batch_size < 1:
            raise InvalidArgumentError(f"{self.kind}: batch_size must be an int >= 1, got "
                                       f"{batch_size!r}")
        self.batch_size = int(batch_size)
        self.rank, self.world = rank_world(rank, world)
        if split not in SPLIT_CHOICES:
            raise InvalidArgumentError(f"{self.kind}: split must be one of {SPLIT_CHOICES}, "
                                       f"got {split!r}")
        if on_bad_line not in BAD_LINE_CHOICES:
            raise InvalidArgumentError(f"{self.kind}: on_bad_line must be one of "
                                       f"{BAD_LINE_CHOICES}, got {on_bad_line!r}")
        if split == "part" and self.batch_size < self.world:
            raise InvalidArgumentError(
                f"{self.kind}: split='part' gives each rank batch_size / world rows; "
                f"batch_size {self.batch_size} < world {self.world} leaves a rank none")
        if isinstance(prefetch, bool) or not isinstance(prefetch, (int, np.integer)) \
                or prefetch < 0:
            raise InvalidArgumentError(f"{self.kind}: prefetch must be an int >= 0, got "
                                       f"{prefetch!r}")
        if isinstance(start_step, bool) or not isinstance(start_step, (int, np.integer)) \
                or start_step < 0:
            raise InvalidArgumentError(f"{self.kind}: start_step must be an int >= 0, got "
                                       f"{start_step!r}")
        self.start_step = int(start_step)
        self.split, self.on_bad_line = split, on_bad_line
        self.prefetch, self.drop_remainder = int(prefetch), bool(drop_remainder)
        self.stats = ReaderStats()
        self._default: Prefetch | None = None
        self._lock = threading.Lock()
        self._init_positions()

    @property
    def part_batch_size(self) -> int:
        """Rows of this rank's batches in split='part' (its even_split share of B)."""
        lo, hi = even_split(self.batch_size, self.rank, self.world)
        return hi - lo

    # -- passes ------------------------------------------------------------------------

    def _batches(self, stats: ReaderStats, start) -> Iterator[tuple[dict, dict]]:
        raise NotImplementedError

    def __iter__(self) -> Iterator[dict]:
        """A new pass over the data (an epoch), read ahead in a background thread; it
        starts after the position given to `resume`, if any (that pass only)."""
        self.stats = self._new_stats()
        start, log = self._begin()
        return Prefetch(self._logged(start, log, self.stats), self.prefetch,
                        name=f"kvcoll-{self.kind}-reader")

    def _new_stats(self) -> ReaderStats:
        return ReaderStats()

    def _logged(self, start, log, stats: ReaderStats) -> Iterator[dict]:
        """The pass's batches, each one's position logged as it is produced. A resumed
        pass with nothing left (the position was the end of the data: its epoch was
        over) becomes a full pass."""
        produced = False
        for batch, fields in self._batches(stats, start):
            log.record(self._file_position(fields))
            produced = True
            yield batch
        if start is not None and not produced and self.finite:
            log.restart(self._start_position(None))
            for batch, fields in self._batches(stats, None):
                log.record(self._file_position(fields))
                yield batch

    def _file_position(self, fields: dict) -> dict:
        """A position of this reader: the header, the files' fingerprint, the batch size
        and the kind's fields."""
        return self._position(data=self.data, batch_size=self.batch_size, **fields)

    def _global_start(self, position: dict) -> int:
        """split='global': the step a position's global row count resumes at."""
        rows = self._need(position, "rows")
        if rows < 0 or rows % self.batch_size:
            raise PositionError(
                f"{self.kind}: resume: the position is at global row {rows}, not a whole number "
                f"of batches of {self.batch_size}: resume with the batch size it was taken with "
                f"({position.get('batch_size', 'see the position')})")
        return rows // self.batch_size

    def __next__(self) -> dict:
        with self._lock:
            if self._default is None:
                self._default = iter(self)
        return next(self._default)

    def close(self) -> None:
        """Stop the pass `next()` started (passes from `iter()` stop when dropped)."""
        if self._default is not None:
            self._default.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- model.fit ---------------------------------------------------------------------

    def features(self, batch: dict) -> tuple[dict, np.ndarray]:
        raise NotImplementedError

    def fit_batches(self) -> Iterator[tuple[dict, np.ndarray]]:
        """One pass as (features, label) pairs: what model.fit or a step loop takes (an
        iterator that `kvcoll.data.position.source_of` traces back to this reader)."""
        return FitBatches(self, self.features)

    def _signature(self, tf):
        raise NotImplementedError

    def dataset(self):
        """A tf.data.Dataset of (features, label), one pass per iteration (epoch)."""
        import tensorflow as tf

        def gen():
            for feats, label in self.fit_batches():
                yield {k: _ragged(tf, v) for k, v in feats.items()}, label

        return source_dataset(self, gen, self._signature(tf))


class FitBatches:
    """One pass of a source as (features, label) pairs, 1:1 with its batches; carries
    its source (`_kvcoll_source`) so the training loop can find its positions."""

    def __init__(self, source, features):
        self._kvcoll_source = source
        self._features = features
        self._it = iter(source)

    def __iter__(self):
        return self

    def __next__(self):
        return self._features(next(self._it))

    def restart(self) -> None:
        """Continue from where the source stands now (after a resume or a replan of its
        position): the pass under way, and what it read ahead, is dropped."""
        self.close()
        self._it = iter(self._kvcoll_source)

    def close(self) -> None:
        close = getattr(getattr(self, "_it", None), "close", None)
        if close is not None:
            close()

    def __del__(self):
        self.close()


def source_dataset(source, gen, signature):
    """tf.data.Dataset.from_generator(gen) that carries `source` (`_kvcoll_source`), for
    `kvcoll.data.position.source_of`."""
    import tensorflow as tf

    ds = tf.data.Dataset.from_generator(gen, output_signature=signature)
    ds._kvcoll_source = source
    return ds


def _ragged(tf, value):
    if isinstance(value, tuple):        # multi-hot ids as (values, row_splits)
        return tf.RaggedTensor.from_row_splits(value[0], value[1], validate=False)
    return value
