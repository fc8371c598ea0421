"""A reader of Criteo's click-log TSV format, sharded over ranks.

Each line is 40 tab-separated columns: the label (0 or 1), 13 integer features and 26
categorical features written as hexadecimal strings (32-bit hashes, e.g. "68fd1e64").
Any feature may be empty (missing); the label may not. This is the format of the
Criteo Kaggle display-advertising set (train.txt) and of the Criteo 1TB logs (day_*,
plain or .gz).

Output, as from `kvcoll.data.SyntheticCTR`: a dict of numpy arrays
- "categorical" int64 [n, 26]: the hex value v of field f becomes the id
  f * 2^33 + v (`criteo_id`), so fields never share an id; a missing value becomes
  f * 2^33 + 2^32, one reserved "missing" id per field.
- "numeric" float32 [n, 13]: sign(x) * log1p(|x|) of each integer x (log1p for the
  usual non-negative counts; the few negative values, e.g. in I2, map symmetrically);
  a missing value is 0.
- "label" float32 [n].

Sharding: `read_criteo` cuts the file(s) into global batches of `batch_size` lines and
yields rank r's `even_split` part of each. Every rank reads every line but parses only
its own part; each rank checks every line's column count, so a malformed line stops
all ranks at the same batch with the same error (file and line number). Value errors
(a bad hex string, say) are found only by the rank that parses the line; kvcoll's
abort hook then ends the job.

Parsing is vectorised over the bytes of a batch (no Python object per value): about
300k lines/s on one core, so with many ranks the shared scan of every line (about 900k
lines/s) is what bounds a rank.

    >>> for batch in read_criteo("train.txt", batch_size=4096, rank=r, world=n):
    ...     train_step(batch)
"""

from __future__ import annotations

import bisect
import gzip
import os
from collections.abc import Iterator

import numpy as np

from ..errors import InvalidArgumentError
from .shard import _check_rank, even_split

__all__ = ["MISSING", "NUM_CATEGORICAL", "NUM_INTEGER", "CriteoFormatError", "criteo_id",
           "parse_criteo_lines", "read_criteo"]

NUM_INTEGER = 13
NUM_CATEGORICAL = 26
NUM_COLUMNS = 1 + NUM_INTEGER + NUM_CATEGORICAL
MISSING = 1 << 32          # the value part of a missing categorical's id
_FIELD_SHIFT = 33
_FIELD_BASE = np.arange(NUM_CATEGORICAL, dtype=np.int64) << _FIELD_SHIFT

_MAX_DIGITS = 18          # integer features: at most 18 digits, so they fit in int64
_TAB, _NEWLINE, _ZERO, _ONE, _MINUS, _PLUS = b"\t\n01-+"
_HEX = np.full(256, 255, np.uint8)            # ASCII -> nibble, 255 = not a hex digit
_DEC = np.full(256, 255, np.uint8)            # ASCII -> decimal digit, 255 = not one
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _i
_DEC[48:58] = np.arange(10)


class CriteoFormatError(InvalidArgumentError):
    """A line of a Criteo file does not have the expected format."""


def criteo_id(field: int, value: int | None) -> int:
    """The int64 id of hex value `value` (an int in [0, 2^32), or None for missing)
    in categorical field `field` (0-based: C1 is field 0)."""
    if not 0 <= field < NUM_CATEGORICAL:
        raise InvalidArgumentError(f"field must be in [0, {NUM_CATEGORICAL}), got {field}")
    if value is None:
        value = MISSING
    elif not 0 <= value < MISSING:
        raise InvalidArgumentError(f"value must be in [0, 2^32), got {value}")
    return (field << _FIELD_SHIFT) | value


class _Where:
    """Maps a line's index in a batch back to (file, line number), for error messages."""

    def __init__(self):
        self.starts: list[int] = []
        self.origins: list[tuple[str, int]] = []

    def add(self, index: int, source: str, lineno: int):
        self.starts.append(index)
        self.origins.append((source, lineno))

    def __call__(self, index: int) -> str:
        k = bisect.bisect_right(self.starts, index) - 1
        source, lineno = self.origins[k]
        return f"{source} line {lineno + index - self.starts[k]}"


def _fail(where, index: int, what: str):
    raise CriteoFormatError(f"criteo: {where(index)}: {what}")


def _parse_ints(arr, starts, ends, bad) -> np.ndarray:
    """Decimal integers (optional sign, at most 18 digits; empty = 0) of the tokens
    [starts, ends) of `arr`, int64. Sets `bad` where a token is not such an integer.

    Digit k from the right of every token is read at once, for k = 0, 1, ...: a
    token's positions left of its start read some other byte, masked out (the only
    negative positions belong to the first token and wrap to the buffer's end)."""
    first = arr[starts]                      # the separator itself if the token is empty
    signed = (first == _MINUS) | (first == _PLUS)
    digits_start = starts + signed
    ndigits = ends - digits_start
    bad |= (ndigits > _MAX_DIGITS) | (signed & (ndigits <= 0))
    value = np.zeros(starts.shape, np.int64)
    scale = 1
    for k in range(int(min(ndigits.max(initial=0), _MAX_DIGITS))):
        pos = ends - (k + 1)
        d = _DEC[arr[pos]]
        d *= pos >= digits_start
        bad |= d == 255
        value += d.astype(np.int64) * scale
        scale *= 10
    return np.where(first == _MINUS, -value, value)


def _parse_hex(arr, starts, ends, bad) -> np.ndarray:
    """Hex strings of at most 8 digits of the tokens [starts, ends) of `arr`, int64 in
    [0, 2^32). Sets `bad` where a token is not such a string. (As `_parse_ints`.)"""
    bad |= (ends - starts) > 8
    value = np.zeros(starts.shape, np.uint32)
    for k in range(8):
        pos = ends - (8 - k)
        d = _HEX[arr[pos]]
        d *= pos >= starts
        bad |= d == 255
        value <<= np.uint32(4)
        value |= d
    return value.astype(np.int64)


def _token(arr, starts, ends, i, c) -> str:
    return repr(arr[starts[i, c]:ends[i, c]].tobytes().decode(errors="replace"))


def parse_criteo_lines(lines: list[bytes], where=None) -> dict:
    """Parse lines of Criteo TSV (bytes, with or without their line ends) into a batch.

    Vectorised over the bytes of the whole batch: no Python object per value.
    `where(i)` names line i in error messages (default: "line i+1").
    """
    where = where or (lambda i: f"line {i + 1}")
    n = len(lines)
    lines = [ln.rstrip(b"\r\n") for ln in lines]
    for i, ln in enumerate(lines):
        columns = ln.count(b"\t") + 1
        if columns != NUM_COLUMNS:
            _fail(where, i, f"expected {NUM_COLUMNS} tab-separated columns (label, "
                  f"{NUM_INTEGER} integers, {NUM_CATEGORICAL} categorical), got {columns}")
        if b"\n" in ln:
            _fail(where, i, "a line break inside a line")
    if n == 0:
        return {"categorical": np.zeros((0, NUM_CATEGORICAL), np.int64),
                "numeric": np.zeros((0, NUM_INTEGER), np.float32),
                "label": np.zeros(0, np.float32)}
    arr = np.frombuffer(b"\n".join(lines) + b"\n", np.uint8)
    seps = np.flatnonzero((arr == _TAB) | (arr == _NEWLINE))   # 40 per line, checked above
    if arr.size < 2**31:
        seps = seps.astype(np.int32)         # halves the memory traffic of the gathers
    ends = seps.reshape(n, NUM_COLUMNS)
    starts = np.empty_like(seps)
    starts[0] = 0
    starts[1:] = seps[:-1] + 1
    starts = starts.reshape(n, NUM_COLUMNS)

    lab_ok = (ends[:, 0] - starts[:, 0]) == 1
    lab = arr[starts[:, 0]]
    lab_ok &= (lab == _ZERO) | (lab == _ONE)
    if not lab_ok.all():
        i = int(np.argmin(lab_ok))
        tok = _token(arr, starts, ends, i, 0)
        _fail(where, i, f"column 1: the label must be 0 or 1, got {tok}")
    label = (lab == _ONE).astype(np.float32)

    ic = slice(1, 1 + NUM_INTEGER)
    bad = np.zeros((n, NUM_INTEGER), bool)
    x = _parse_ints(arr, starts[:, ic], ends[:, ic], bad)
    if bad.any():
        i, c = map(int, np.argwhere(bad)[0])
        _fail(where, i, f"column {2 + c}: {_token(arr, starts, ends, i, 1 + c)} is not an "
              f"integer of at most {_MAX_DIGITS} digits")
    x = x.astype(np.float64)
    numeric = (np.sign(x) * np.log1p(np.abs(x))).astype(np.float32)

    cc = slice(1 + NUM_INTEGER, NUM_COLUMNS)
    bad = np.zeros((n, NUM_CATEGORICAL), bool)
    value = _parse_hex(arr, starts[:, cc], ends[:, cc], bad)
    if bad.any():
        i, c = map(int, np.argwhere(bad)[0])
        tok = _token(arr, starts, ends, i, 1 + NUM_INTEGER + c)
        _fail(where, i, f"column {2 + NUM_INTEGER + c}: {tok} is not a hex string of at most "
              "8 digits (32 bits)")
    value[ends[:, cc] == starts[:, cc]] = MISSING
    value |= _FIELD_BASE
    return {"categorical": value, "numeric": numeric, "label": label}


def _open(path: str):
    if str(path).endswith(".gz"):
        return gzip.open(path, "rb")
    return open(path, "rb")


def read_criteo(paths, batch_size: int, rank: int = 0, world: int = 1,
                drop_remainder: bool = False) -> Iterator[dict]:
    """Yield this rank's slice of each global batch of `batch_size` lines.

    paths: one file or a list of files (read in order, as one stream: a global batch
        may span two files); names ending in .gz are read through gzip.
    drop_remainder: skip the last global batch if it is short. Otherwise it is split
        like the others, and a rank whose share is empty gets an empty batch, so every
        rank yields the same number of batches (a synchronous loop stays in step).
    """
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    paths = [os.fspath(p) for p in paths]
    if not paths:
        raise InvalidArgumentError("read_criteo needs at least one file")
    batch_size = int(batch_size)
    if batch_size < 1:
        raise InvalidArgumentError(f"batch_size must be >= 1, got {batch_size}")
    rank, world = _check_rank(rank, world)
    for p in paths:
        if not os.path.isfile(p):
            raise InvalidArgumentError(f"criteo: no such file: {p}")
    return _read(paths, batch_size, rank, world, drop_remainder)


def _read(paths: list[str], batch_size: int, rank: int, world: int,
          drop_remainder: bool) -> Iterator[dict]:
    tabs = NUM_COLUMNS - 1
    lines: list[bytes] = []
    where = _Where()
    for path in paths:
        with _open(path) as f:
            where.add(len(lines), path, 1)
            for lineno, line in enumerate(f, 1):
                if line.count(b"\t") != tabs:      # checked on every rank: all stop here
                    name = f"{path} line {lineno}"
                    parse_criteo_lines([line], lambda _, name=name: name)
                lines.append(line)
                if len(lines) == batch_size:
                    yield _slice(lines, rank, world, where)
                    lines, where = [], _Where()
                    where.add(0, path, lineno + 1)
    if lines and not drop_remainder:
        yield _slice(lines, rank, world, where)


def _slice(lines: list[bytes], rank: int, world: int, where: _Where) -> dict:
    lo, hi = even_split(len(lines), rank, world)
    return parse_criteo_lines(lines[lo:hi], lambda i: where(lo + i))

