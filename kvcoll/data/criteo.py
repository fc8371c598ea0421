"""Criteo's click-log TSV format, read with pyarrow, each rank reading its own part.

Each line is 40 tab-separated columns: the label (0 or 1), 13 integer features and 26
categorical features written as hexadecimal strings (32-bit hashes, e.g. "68fd1e64").
Any feature may be empty (missing); the label may not. This is the format of the
Criteo Kaggle display-advertising set (train.txt) and of the Criteo 1TB logs (day_*,
plain or .gz).

Output, as from `kvcoll.data.SyntheticCTR`: a dict of numpy arrays
- "categorical" int64 [n, 26]: the hex value v of field f becomes the id
  f * 2^33 + v (`criteo_id`), so fields never share an id; a missing value becomes
  f * 2^33 + 2^32, one reserved "missing" id per field. (Column-major: each field's
  ids are contiguous, as the per-field tables want them.)
- "numeric" float32 [n, 13]: sign(x) * log1p(|x|) of each integer x (log1p for the
  usual non-negative counts; the few negative values, e.g. in I2, map symmetrically);
  a missing value is 0.
- "label" float32 [n].

How: pyarrow's CSV reader (multi-threaded C++, here one thread per rank) splits the
lines and converts the label and the integers; the 26 hex columns come out as Arrow
binary arrays and become ids in one C call per parsed block for all 26 columns
(kv_hex_ids32, over the arrays' offsets and bytes). A block pyarrow refuses (a bad
line) is parsed again by the vectorised numpy reference (`parse_criteo_lines`), which names the file, the
line and the column, or drops the bad lines with on_bad_line="skip". How ranks split
the data (split="global" or "part") and the rest of the reader's behaviour are
described in kvcoll/data/_reader.py and in `read_criteo`.

    >>> for batch in read_criteo("day_0.gz", batch_size=4096, rank=r, world=n):
    ...     train_step(batch)
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np

from .._c import check, ffi, lib, ptr
from ..errors import InvalidArgumentError
from . import _files
from ._reader import Reader, ReaderStats
from .position import PositionError, fingerprint
from .shard import even_split

__all__ = ["MISSING", "NUM_CATEGORICAL", "NUM_INTEGER", "CriteoFormatError", "CriteoReader",
           "criteo_dataset", "criteo_id", "parse_criteo_lines", "read_criteo"]

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


def _scan(lines: list[bytes]) -> tuple[dict, np.ndarray, tuple[int, str] | None]:
    """Parse lines of Criteo TSV (bytes, with or without their line ends) with numpy.

    Returns (the batch of the good lines, their indices, (index, message) of the first
    bad line or None). Vectorised over the bytes of all lines (no Python object per
    value); one Python step per line strips line ends and counts columns.
    """
    n = len(lines)
    lines = [ln.rstrip(b"\r\n") for ln in lines]
    columns = np.fromiter((ln.count(b"\t") + 1 for ln in lines), np.int64, n)
    broken = np.fromiter((b"\n" in ln for ln in lines), bool, n)
    shape_ok = (columns == NUM_COLUMNS) & ~broken
    idx = np.flatnonzero(shape_ok)
    m = idx.size
    label = np.zeros(m, np.float32)
    numeric = np.zeros((m, NUM_INTEGER), np.float32)
    value = np.zeros((m, NUM_CATEGORICAL), np.int64)
    lab_ok = np.ones(m, bool)
    int_bad = np.zeros((m, NUM_INTEGER), bool)
    hex_bad = np.zeros((m, NUM_CATEGORICAL), bool)
    if m:
        arr = np.frombuffer(b"\n".join([lines[i] for i in idx]) + b"\n", np.uint8)
        seps = np.flatnonzero((arr == _TAB) | (arr == _NEWLINE))   # 40 per line
        if arr.size < 2**31:
            seps = seps.astype(np.int32)     # halves the memory traffic of the gathers
        ends = seps.reshape(m, NUM_COLUMNS)
        starts = np.empty_like(seps)
        starts[0] = 0
        starts[1:] = seps[:-1] + 1
        starts = starts.reshape(m, NUM_COLUMNS)
        lab = arr[starts[:, 0]]
        lab_ok = ((ends[:, 0] - starts[:, 0]) == 1) & ((lab == _ZERO) | (lab == _ONE))
        label = (lab == _ONE).astype(np.float32)
        ic = slice(1, 1 + NUM_INTEGER)
        x = _parse_ints(arr, starts[:, ic], ends[:, ic], int_bad).astype(np.float64)
        numeric = (np.sign(x) * np.log1p(np.abs(x))).astype(np.float32)
        cc = slice(1 + NUM_INTEGER, NUM_COLUMNS)
        value = _parse_hex(arr, starts[:, cc], ends[:, cc], hex_bad)
        value[ends[:, cc] == starts[:, cc]] = MISSING
        value |= _FIELD_BASE
    row_bad = ~lab_ok | int_bad.any(axis=1) | hex_bad.any(axis=1)
    ok = ~row_bad
    batch = {"categorical": value[ok], "numeric": numeric[ok], "label": label[ok]}
    bad_all = ~shape_ok
    bad_all[idx[row_bad]] = True
    first = None
    if bad_all.any():
        i = int(np.argmax(bad_all))
        if broken[i]:
            msg = "a line break inside a line"
        elif not shape_ok[i]:
            msg = (f"expected {NUM_COLUMNS} tab-separated columns (label, {NUM_INTEGER} "
                   f"integers, {NUM_CATEGORICAL} categorical), got {int(columns[i])}")
        else:
            j = int(np.searchsorted(idx, i))
            if not lab_ok[j]:
                msg = f"column 1: the label must be 0 or 1, got {_token(arr, starts, ends, j, 0)}"
            elif int_bad[j].any():
                c = int(np.argmax(int_bad[j]))
                msg = (f"column {2 + c}: {_token(arr, starts, ends, j, 1 + c)} is not an "
                       f"integer of at most {_MAX_DIGITS} digits")
            else:
                c = int(np.argmax(hex_bad[j]))
                msg = (f"column {2 + NUM_INTEGER + c}: "
                       f"{_token(arr, starts, ends, j, 1 + NUM_INTEGER + c)} is not a hex "
                       "string of at most 8 digits (32 bits)")
        first = (i, msg)
    return batch, idx[ok], first


def parse_criteo_lines(lines: list[bytes], where=None) -> dict:
    """Parse lines of Criteo TSV (bytes, with or without their line ends) into a batch.

    The numpy reference the readers fall back to for a block pyarrow refuses:
    vectorised over the bytes of the whole batch, no Python object per value. Raises
    CriteoFormatError naming the first bad line (`where(i)` names line i; default
    "line i+1") and its column.
    """
    where = where or (lambda i: f"line {i + 1}")
    batch, _, first = _scan(list(lines))
    if first is not None:
        _fail(where, *first)
    return batch


# -- pyarrow ---------------------------------------------------------------------------

_COLUMN_NAMES = (["label"] + [f"I{j + 1}" for j in range(NUM_INTEGER)]
                 + [f"C{j + 1}" for j in range(NUM_CATEGORICAL)])
_ARROW = None


def _arrow():
    """pyarrow and the CSV options, loaded on first use."""
    global _ARROW
    if _ARROW is None:
        import pyarrow as pa
        import pyarrow.csv as pcsv

        types = {"label": pa.int8()}
        types.update({f"I{j + 1}": pa.int64() for j in range(NUM_INTEGER)})
        types.update({f"C{j + 1}": pa.binary() for j in range(NUM_CATEGORICAL)})
        parse = pcsv.ParseOptions(delimiter="\t", quote_char=False, escape_char=False,
                                  double_quote=False, newlines_in_values=False,
                                  ignore_empty_lines=False)
        convert = pcsv.ConvertOptions(column_types=types, null_values=[""],
                                      strings_can_be_null=False,
                                      quoted_strings_can_be_null=False, check_utf8=False)
        _ARROW = (pa, pcsv, parse, convert)
    return _ARROW


def _hex_ids(table, out: np.ndarray) -> bool:
    """The 26 categorical columns of a parsed table (pyarrow binary arrays) as ids into
    out [26, n]: one C call per record batch for all columns, over the arrays' own
    offsets and bytes. False if any value is not a hex id."""
    n = out.shape[1]
    scratch = np.zeros(3, np.int64)
    data = np.zeros(NUM_CATEGORICAL, np.uint64)
    offsets = np.zeros(NUM_CATEGORICAL, np.uint64)
    base = ffi.cast("int64_t *", ffi.from_buffer(out))
    at = 0
    for batch in table.to_batches():
        m = batch.num_rows
        for f, arr in enumerate(batch.columns[1 + NUM_INTEGER:]):
            bufs = arr.buffers()
            offsets[f] = bufs[1].address + 4 * arr.offset
            data[f] = bufs[2].address if bufs[2] is not None else 0
        check(lib.kv_hex_ids32(NUM_CATEGORICAL, m, ptr("uint8_t **", data),
                               ptr("int32_t **", offsets), ptr("int64_t *", _FIELD_BASE),
                               MISSING, base + at, n, ffi.NULL, ptr("int64_t *", scratch),
                               ptr("int64_t *", scratch[1:])), "criteo: hex ids")
        if scratch[0]:
            return False
        at += m
    return True


def _parse_arrow(data, n: int, block_size: int):
    """(categorical [26, n], numeric [13, n], label [n]) of n whole lines, or None if
    pyarrow refuses them or any value is bad (the caller then takes the reference path,
    which says where)."""
    pa, pcsv, parse, convert = _arrow()
    read = pcsv.ReadOptions(column_names=_COLUMN_NAMES, use_threads=False,
                            block_size=block_size)
    try:
        table = pcsv.read_csv(pa.py_buffer(data), read_options=read, parse_options=parse,
                              convert_options=convert)
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        return None
    if table.num_rows != n:               # a lone \r ended a line: let the reference say
        return None
    lab = table.column(0)
    if lab.null_count:
        return None
    label = lab.to_numpy()
    if ((label != 0) & (label != 1)).any():
        return None
    x = np.empty((NUM_INTEGER, n), np.float64)
    for j in range(NUM_INTEGER):
        col = table.column(1 + j)
        x[j] = (col.fill_null(0) if col.null_count else col).to_numpy()
    if (np.abs(x) >= 1e18).any():       # the reference's limit: at most 18 digits
        return None
    numeric = (np.sign(x) * np.log1p(np.abs(x))).astype(np.float32)
    categorical = np.empty((NUM_CATEGORICAL, n), np.int64)
    if not _hex_ids(table, categorical):
        return None
    return categorical, numeric, label.astype(np.float32)


# -- the reader --------------------------------------------------------------------------

class CriteoReader(Reader):
    """Batches of Criteo TSV files for one rank: see `read_criteo`."""

    kind = "criteo"

    def __init__(self, paths, batch_size, rank, world, drop_remainder, split, on_bad_line,
                 prefetch, block_bytes, parse_block_bytes, start_step, *, _skip_empty=False):
        super().__init__(batch_size, rank, world, split, on_bad_line, prefetch,
                         drop_remainder, start_step)
        self.paths = _files.expand(paths, "criteo")
        self.block_bytes = _positive(block_bytes, "block_bytes")
        self.parse_block_bytes = _positive(parse_block_bytes, "parse_block_bytes")
        self.sizes = [os.path.getsize(p) for p in self.paths]
        self.data = fingerprint(self.paths, self.sizes)
        self._skip_empty = _skip_empty      # a stream's empty files are normal, not errors
        empty = [p for p, s in zip(self.paths, self.sizes) if s == 0]
        self.empty_files = len(empty)
        if empty and on_bad_line == "error" and not _skip_empty:
            raise CriteoFormatError(
                f"criteo: {empty[0]} is empty (no lines); leave it out, or pass "
                "on_bad_line='skip' to skip empty files and bad lines")
        self.pieces = None       # split="part": this rank's (path, start, end)
        self.note = ""
        gz = any(_files.is_gzip(p) for p in self.paths)
        if split == "part":
            if not gz:
                self.pieces = _files.byte_ranges(self.paths, self.sizes, self.rank, self.world)
            elif len(self.paths) >= self.world:
                lo, hi = even_split(len(self.paths), self.rank, self.world)
                self.pieces = [(p, 0, None) for p in self.paths[lo:hi]]
            else:
                self.note = (f"{len(self.paths)} file(s) with .gz among them for {self.world} "
                             "ranks: a .gz file cannot be split, so every rank decompresses "
                             "every file and parses its even_split part of each global batch "
                             "(as split='global')")

    def __repr__(self):
        return (f"CriteoReader({len(self.paths)} file(s), batch_size={self.batch_size}, "
                f"rank={self.rank}, world={self.world}, split={self.split!r})")

    def features(self, batch: dict) -> tuple[dict, np.ndarray]:
        """A batch as model inputs: {"C1".."C26": int64 [n], "numeric": float32 [n, 13]}
        and the label (each field's ids a contiguous column, no copy)."""
        cat = batch["categorical"]
        out = {f"C{f + 1}": cat[:, f] for f in range(NUM_CATEGORICAL)}
        out["numeric"] = batch["numeric"]
        return out, batch["label"]

    def _signature(self, tf):
        spec = {f"C{f + 1}": tf.TensorSpec([None], tf.int64) for f in range(NUM_CATEGORICAL)}
        spec["numeric"] = tf.TensorSpec([None, NUM_INTEGER], tf.float32)
        return spec, tf.TensorSpec([None], tf.float32)

    # -- positions ---------------------------------------------------------------------

    def _position_split(self) -> str:
        return "global" if self.pieces is None else "part"

    def _start_position(self, fields) -> dict:
        """Where a pass from `fields` (None: the usual beginning) starts."""
        if self.pieces is None:
            if fields is None:
                fields = {"rows": self.start_step * self.batch_size}
            return self._file_position(fields)
        if fields is None:
            first = self.pieces[0][1] if self.pieces else 0
            fields = {"piece": 0, "offset": first}
            if self.start_step:
                fields["skip"] = self.start_step * self.part_batch_size
        return self._file_position(fields)

    def _accept(self, position: dict) -> dict:
        self._check_data(position, self.data)
        if self.pieces is None:
            if position.get("end"):
                return {"rows": self._need(position, "rows"), "end": True}
            return {"rows": self._global_start(position) * self.batch_size}
        piece, offset = self._need(position, "piece"), self._need(position, "offset")
        skip = position.get("skip", 0)
        if not 0 <= piece <= len(self.pieces) or offset < 0 or not isinstance(skip, int) \
                or skip < 0:
            raise PositionError(f"criteo: resume: the position {position!r} is not one of this "
                                f"rank's {len(self.pieces)} piece(s) of the files")
        return {"piece": piece, "offset": offset, **({"skip": skip} if skip else {})}

    # -- one pass ----------------------------------------------------------------------

    def _batches(self, stats: ReaderStats, start) -> Iterator[tuple[dict, dict]]:
        stats.empty_files += self.empty_files     # plain files of 0 bytes, seen at start
        if self.pieces is None:
            if start is not None and start.get("end"):
                return iter(())
            first = self.start_step if start is None else start["rows"] // self.batch_size
            return self._global(stats, first)
        return self._part(stats, start)

    def _empty_file(self, path: str, stats: ReaderStats) -> None:
        if self.on_bad_line == "error" and not self._skip_empty:
            raise CriteoFormatError(f"criteo: {path} is empty (no lines); leave it out, or pass "
                                    "on_bad_line='skip'")
        stats.empty_files += 1

    def _parse(self, data, n: int, where, stats: ReaderStats):
        """(categorical [26, k], numeric [13, k], label [k], keep) of n lines: keep is
        None when all k == n lines are good, else the mask of the lines kept."""
        fast = _parse_arrow(data, n, self.parse_block_bytes)
        if fast is not None:
            return (*fast, None)
        lines = bytes(data).split(b"\n")[:n]
        batch, good, first = _scan(lines)
        if first is not None:
            i, msg = first
            if self.on_bad_line == "error":
                raise CriteoFormatError(f"criteo: {where(i)}: {msg}")
            stats.skip(n - good.size, f"{where(i)}: {msg}")
        keep = np.zeros(n, bool)
        keep[good] = True
        return batch["categorical"].T, batch["numeric"].T, batch["label"], keep

    def _global(self, stats: ReaderStats, first: int) -> Iterator[tuple[dict, dict]]:
        """split='global' from step `first` on: every rank scans every line end, parses
        its slices. The whole batches inside a block are sliced in place; only a batch
        that spans two blocks (or files) is copied together. Position: the global rows
        of the steps done."""
        b = self.batch_size
        pend: list[memoryview] = []           # the lines of the batch under way
        pend_segs: list[tuple[int, str, int]] = []   # (its line, path, that line's number)
        pend_lines = step = 0
        for path in self.paths:
            got = False
            file_line = 1
            for block in _files.text_blocks(path, block_bytes=self.block_bytes, what="criteo"):
                got = True
                data = block.data
                nl = np.flatnonzero(np.frombuffer(data, np.uint8) == _NEWLINE)
                n, at, start = nl.size, 0, 0
                if pend_lines:                # complete the batch under way
                    need = b - pend_lines
                    if n < need:
                        pend.append(data)
                        pend_segs.append((pend_lines, path, file_line))
                        pend_lines += n
                        file_line += n
                        continue
                    start = int(nl[need - 1]) + 1
                    head = memoryview(b"".join([*pend, data[:start]]))
                    head_nl = np.flatnonzero(np.frombuffer(head, np.uint8) == _NEWLINE)
                    for batch in self._slices(head, head_nl,
                                              [*pend_segs, (pend_lines, path, file_line)],
                                              [b], stats, skip=int(step < first)):
                        yield batch, {"rows": (step + 1) * b}
                    step += 1
                    at = need
                    pend, pend_segs, pend_lines = [], [], 0
                k = (n - at) // b
                if k:
                    end = int(nl[at + k * b - 1]) + 1
                    skip = min(k, max(0, first - step))
                    for j, batch in enumerate(self._slices(
                            data[start:end], nl[at:at + k * b] - start,
                            [(0, path, file_line + at)], [b] * k, stats, skip)):
                        yield batch, {"rows": (step + skip + j + 1) * b}
                    step += k
                    start = end
                if n - at - k * b:
                    pend = [data[start:]]
                    pend_segs = [(0, path, file_line + at + k * b)]
                    pend_lines = n - at - k * b
                file_line += n
            if not got and _files.is_gzip(path):
                self._empty_file(path, stats)
        if pend_lines and not self.drop_remainder and step >= first:
            tail = memoryview(b"".join(pend))
            nl = np.flatnonzero(np.frombuffer(tail, np.uint8) == _NEWLINE)
            for batch in self._slices(tail, nl, pend_segs, [pend_lines], stats):
                yield batch, {"rows": step * b + pend_lines, "end": True}

    def _slices(self, buf, nl, segs, sizes, stats, skip: int = 0) -> Iterator[dict]:
        """This rank's even_split slice of each global batch (of the given sizes) that
        starts at line 0 of buf, parsed in one go; the first `skip` batches are passed
        over (before the pass's first step), unparsed."""
        first = sum(sizes[:skip])
        sizes = sizes[skip:]
        if not sizes:
            return
        starts = np.empty(nl.size + 1, np.int64)
        starts[0] = 0
        starts[1:] = nl + 1
        ranges, counts, first_lines = [], [], []
        at = first
        for size in sizes:
            lo, hi = even_split(size, self.rank, self.world)
            a, z = int(starts[at + lo]), int(starts[at + hi])
            if ranges and ranges[-1][1] == a:
                ranges[-1][1] = z                  # adjacent: one slice, no copy
            elif z > a:
                ranges.append([a, z])
            counts.append(hi - lo)
            first_lines.append(at + lo)
            at += size
        n = sum(counts)
        row_starts = np.cumsum([0] + counts[:-1])

        def where(i):
            j = int(np.searchsorted(row_starts, i, side="right")) - 1
            line = first_lines[j] + i - int(row_starts[j])
            s = max(k for k, seg in enumerate(segs) if seg[0] <= line)
            return f"{segs[s][1]} line {segs[s][2] + line - segs[s][0]}"

        if n:
            data = buf[ranges[0][0]:ranges[0][1]] if len(ranges) == 1 else \
                b"".join([buf[a:z] for a, z in ranges])
            cat, num, lab, keep = self._parse(data, n, where, stats)
            if keep is not None:
                step = np.repeat(np.arange(len(sizes)), counts)
                counts = np.bincount(step[keep], minlength=len(sizes)).tolist()
        else:
            cat = np.zeros((NUM_CATEGORICAL, 0), np.int64)
            num = np.zeros((NUM_INTEGER, 0), np.float32)
            lab = np.zeros(0, np.float32)
        at = 0
        for c in counts:
            yield _batch(cat, num, lab, at, at + c, stats)
            at += c

    def _part(self, stats: ReaderStats, start) -> Iterator[tuple[dict, dict]]:
        """split='part': this rank's byte ranges or files, in batches of its share, from
        `start` ({"piece", "offset", "skip"}: the piece, the byte where its reading
        resumes, and lines to pass over from there; None: the beginning, passing over
        start_step batches). Position: the piece and byte offset after a batch's last
        line (an offset in the decompressed stream for .gz)."""
        size = self.part_batch_size
        acc: list[tuple] = []
        held = 0
        if start is None:
            first, offset, to_skip = 0, None, self.start_step * size
        else:
            first, offset, to_skip = start["piece"], start["offset"], start.get("skip", 0)
        for pi in range(first, len(self.pieces)):
            path, lo, end = self.pieces[pi]
            if pi == first and offset is not None:
                lo = max(lo, offset)
            got = False
            for block in _files.text_blocks(path, lo, end, self.block_bytes, "criteo"):
                got = True
                nl = np.flatnonzero(np.frombuffer(block.data, np.uint8) == _NEWLINE)
                n = nl.size
                if to_skip >= n:
                    to_skip -= n
                    continue
                if to_skip:
                    cut = int(nl[to_skip - 1]) + 1
                    block = _files.Block(block.data[cut:], block.path, block.offset + cut)
                    nl = nl[to_skip:] - cut
                    n -= to_skip
                    to_skip = 0

                def where(i, block=block):  # the line number costs a scan: errors only
                    return f"{block.path} line {_files.line_number(block.path, block.offset) + i}"

                cat, num, lab, keep = self._parse(block.data, n, where, stats)
                ends = block.offset + nl + 1           # the byte after each line
                if keep is not None:
                    ends = ends[keep]
                acc.append((cat, num, lab, ends, pi))
                held += lab.size
                while held >= size:
                    acc, held, out, last = _take(acc, held, size)
                    yield _batch(*out, 0, size, stats), last
            if not got and lo == 0 and _files.is_gzip(path):
                self._empty_file(path, stats)
        if held and not self.drop_remainder:
            acc, held, out, last = _take(acc, held, held)
            yield _batch(*out, 0, out[2].size, stats), last


def _take(acc, held, size):
    """The first `size` rows of the accumulated parsed blocks, what remains, and the
    position after the last row taken ({"piece", "offset"})."""
    parts, got, rest = [], 0, []
    last = None
    for entry in acc:
        cat, num, lab, ends, piece = entry
        if got == size:
            rest.append(entry)
            continue
        t = min(size - got, lab.size)
        parts.append((cat[:, :t], num[:, :t], lab[:t]))
        if t:
            last = {"piece": piece, "offset": int(ends[t - 1])}
        if t < lab.size:
            rest.append((cat[:, t:], num[:, t:], lab[t:], ends[t:], piece))
        got += t
    out = tuple(p[0] if len(parts) == 1 else np.concatenate(p, axis=-1)
                for p in zip(*parts))
    return rest, held - size, out, last


def _batch(cat, num, lab, a, z, stats: ReaderStats) -> dict:
    stats.rows += z - a
    stats.batches += 1
    return {"categorical": np.ascontiguousarray(cat[:, a:z]).T,
            "numeric": np.ascontiguousarray(num[:, a:z]).T,
            "label": lab[a:z]}


def _positive(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise InvalidArgumentError(f"criteo: {name} must be an int >= 1, got {value!r}")
    return int(value)


def read_criteo(paths, batch_size: int, rank: int | None = None, world: int | None = None,
                drop_remainder: bool = False, *, split: str = "global",
                on_bad_line: str = "error", prefetch: int = 2, block_bytes: int = 8 << 20,
                parse_block_bytes: int = 1 << 20, start_step: int = 0) -> CriteoReader:
    """This rank's batches of Criteo TSV files: an iterable of batch dicts (one pass per
    iteration), also `.fit_batches()` and `.dataset()` for model.fit.

    paths: a file, a glob pattern, or a list of them, read in order as one stream (a
        global batch may span two files); names ending in .gz are read through gzip.
        Every path is checked on every rank when the reader is made.
    batch_size: the global batch B.
    rank, world: this rank and the world size (default: kvcoll's after kvcoll.init(),
        else 0 and 1).
    split: "global" (default) — the global batch of step t is lines [t*B, (t+1)*B) and
        rank r gets its even_split part: every rank scans every line end (a numpy scan
        of the bytes, not parsing) and parses only its own lines; every rank yields
        the same number of batches (a part of the short last batch may be empty).
        "part" — rank r reads only its part: its 1/world of the plain files' bytes, cut
        at line ends, or, with .gz files (which cannot be split), its even_split share
        of the files, in batches of even_split(B, r, world) lines. With fewer files
        than ranks and a .gz among them, "part" reads as "global" (`note` says so).
    drop_remainder: split="global": skip the last global batch if it is short;
        split="part": skip this rank's last short batch.
    on_bad_line: "error" raises CriteoFormatError naming file, line and column (empty
        files too); "skip" drops bad lines and empty files, counted in `stats`.
    prefetch: batches prepared ahead by a background thread (0: none).
    block_bytes: bytes read at a time; parse_block_bytes: pyarrow's parsing block.
    start_step: begin every pass at this step (a held-out head): earlier batches are
        passed over without being parsed (in "part", this rank's first start_step
        batches). To resume in the middle of a pass once, use the reader's
        `resume(position)` with a `position_at(k)` (kvcoll.data.position).
    """
    return CriteoReader(paths, batch_size, rank, world, drop_remainder, split, on_bad_line,
                        prefetch, block_bytes, parse_block_bytes, start_step)


def criteo_dataset(paths, batch_size: int, rank: int | None = None,
                   world: int | None = None, **options):
    """A tf.data.Dataset of this rank's (features, label) batches of Criteo TSV files,
    for model.fit: features {"C1".."C26": int64 [n], "numeric": float32 [n, 13]}, label
    float32 [n]. Each iteration (epoch) is a new pass. Options as `read_criteo`."""
    return read_criteo(paths, batch_size, rank, world, **options).dataset()
