"""Parquet files as CTR batches, read with pyarrow, row groups assigned to ranks.

The user names the columns: `label` (a number or bool), `numeric` (numbers, stacked
into one float32 matrix; nulls become 0) and `categorical` (ids: integer columns as
they are, string or binary columns hashed to int64 keys with the run's id hash
(kvcoll.ids.id_hash: farmhash64 for new models) in one C call per column over Arrow's
offsets and bytes, dictionary-encoded ones through their dictionary; list columns are
multi-hot and come out as (values, row_splits)). A null id becomes `null_id` (default
-1, one reserved key). String columns are noted (kvcoll.ids.note_string_features), so
kv.export's signature takes them as raw strings and hashes them in the graph.

Batches: {"categorical": {name: int64 [n] or (values int64, row_splits int64 [n+1])},
"numeric": float32 [n, len(numeric)], "label": float32 [n]}; `features(batch)` gives
model.fit's ({name: ids, ..., "numeric": matrix}, label).

How ranks split the data (kvcoll/data/_reader.py): split="global" keeps the global
batch of step t = rows [t*B, (t+1)*B) of the files in order (row counts come from the
files' metadata, so every rank knows every batch's bounds without reading), each rank
decoding the row groups its rows are in; split="part" gives each rank its even_split
share of the row groups (of the rows of each row group when there are fewer groups
than ranks), in batches of even_split(B, rank, world) rows.

Errors name the file, the row group and the column: a missing column or one of the
wrong type when the reader is made (on every rank), a null label or an unreadable row
group while reading; on_bad_line="skip" drops such rows (or row groups) and counts them.

    >>> r = read_parquet("clicks/*.parquet", 4096, label="click", numeric=["price"],
    ...                  categorical=["user", "item", "history"])
    >>> model.fit(r.dataset(), epochs=2)
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from ..errors import InvalidArgumentError
from ..ids import arrow_keys, note_string_features
from . import _files
from ._reader import Reader, ReaderStats
from .position import PositionError, fingerprint
from .shard import even_split

__all__ = ["ParquetFormatError", "ParquetReader", "parquet_dataset", "read_parquet"]


class ParquetFormatError(InvalidArgumentError):
    """A Parquet file does not hold what the reader was told to read."""


def _pa():
    import pyarrow as pa
    import pyarrow.parquet as pq

    return pa, pq


def _kind(pa, t) -> str:
    """'int', 'string', 'float', 'bool', 'list' (of int or string ids) or '' (other)."""
    if pa.types.is_dictionary(t):
        return _kind(pa, t.value_type)
    if pa.types.is_integer(t):
        return "int"
    if pa.types.is_floating(t):
        return "float"
    if pa.types.is_boolean(t):
        return "bool"
    if (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t)
            or pa.types.is_large_binary(t) or t in (pa.string_view(), pa.binary_view())):
        return "string"
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return "list" if _kind(pa, t.value_type) in ("int", "string") else ""
    return ""


class ParquetReader(Reader):
    """Batches of Parquet files for one rank: see `read_parquet`."""

    kind = "parquet"

    def __init__(self, paths, batch_size, rank, world, drop_remainder, split, on_bad_line,
                 prefetch, label, numeric, categorical, null_id, start_step, *,
                 _skip_empty=False):
        super().__init__(batch_size, rank, world, split, on_bad_line, prefetch,
                         drop_remainder, start_step)
        pa, pq = _pa()
        if not isinstance(label, str):
            raise InvalidArgumentError(f"parquet: label must be a column name, got {label!r}")
        self.label = label
        self.numeric = [numeric] if isinstance(numeric, str) else list(numeric)
        self.categorical = [categorical] if isinstance(categorical, str) else list(categorical)
        names = [label, *self.numeric, *self.categorical]
        if len(set(names)) != len(names) or not all(isinstance(c, str) for c in names):
            raise InvalidArgumentError(
                f"parquet: label, numeric and categorical must be distinct column names, got "
                f"label={label!r}, numeric={self.numeric!r}, categorical={self.categorical!r}")
        if "numeric" in self.categorical and self.numeric:
            raise InvalidArgumentError("parquet: a categorical column named 'numeric' would "
                                       "clash with the numeric features' input name")
        self.columns = names
        self.null_id = int(null_id)
        self.paths = _files.expand(paths, "parquet")
        self.groups: list[tuple[int, int, int]] = []    # (file, row group, rows)
        self.multi_hot = {}
        self._string = {}
        self._strings_of = {}    # column -> whether its ids are strings (flat or lists)
        self.empty_files = 0
        sizes = []
        for fi, path in enumerate(self.paths):
            try:
                meta = pq.ParquetFile(path).metadata
                schema = pq.read_schema(path)
            except (pa.ArrowException, OSError) as exc:
                raise ParquetFormatError(f"parquet: cannot read {path}: {exc}") from None
            self._check_schema(pa, path, schema)
            rows = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
            sizes.append(sum(rows))
            if sum(rows) == 0:
                if on_bad_line == "error" and not _skip_empty:
                    raise ParquetFormatError(
                        f"parquet: {path} is empty (no rows); leave it out, or pass "
                        "on_bad_line='skip' to skip empty files and bad rows")
                self.empty_files += 1
            self.groups += [(fi, g, n) for g, n in enumerate(rows) if n]
        self.rows = sum(n for _, _, n in self.groups)
        self.data = fingerprint(self.paths, sizes)      # names and row counts
        # string id columns come back dictionary-encoded, as Parquet usually stores them:
        # each distinct id is hashed once per row group, rows take their key by index
        self._dictionary = [c for c in self.categorical if not self.multi_hot[c]
                            and self._string[c]]
        note_string_features(c for c in self.categorical if self._strings_of[c])

    def _check_schema(self, pa, path, schema) -> None:
        want = {self.label: ("int", "float", "bool"), **{c: ("int", "float", "bool")
                                                          for c in self.numeric},
                **{c: ("int", "string", "list") for c in self.categorical}}
        for name, kinds in want.items():
            idx = schema.get_field_index(name)
            if idx < 0:
                raise ParquetFormatError(
                    f"parquet: {path} has no column {name!r}; its columns: "
                    f"{', '.join(schema.names)}")
            t = schema.field(idx).type
            kind = _kind(pa, t)
            if kind not in kinds:
                role = ("the label" if name == self.label else
                        "a numeric column" if name in self.numeric else "a categorical column")
                need = ("a number or bool" if role != "a categorical column" else
                        "integer or string ids, or a list of them (multi-hot)")
                raise ParquetFormatError(f"parquet: {path}: column {name!r} has type {t}; "
                                         f"{role} must be {need}")
            if name in self.categorical:
                self._string[name] = kind == "string"
                self._strings_of[name] = kind == "string" or (
                    kind == "list" and _kind(pa, t.value_type) == "string")
                multi = kind == "list"
                if self.multi_hot.setdefault(name, multi) != multi:
                    raise ParquetFormatError(
                        f"parquet: {path}: column {name!r} is {'' if multi else 'not '}a list "
                        f"here but {'not ' if multi else ''}one in {self.paths[0]}")

    def __repr__(self):
        return (f"ParquetReader({len(self.paths)} file(s), {self.rows} rows, "
                f"batch_size={self.batch_size}, rank={self.rank}, world={self.world}, "
                f"split={self.split!r})")

    # -- model.fit ---------------------------------------------------------------------

    def features(self, batch: dict) -> tuple[dict, np.ndarray]:
        """A batch as model inputs: {name: ids or (values, row_splits), ...,
        "numeric": float32 [n, D] (when numeric columns were named)} and the label."""
        out = dict(batch["categorical"])
        if self.numeric:
            out["numeric"] = batch["numeric"]
        return out, batch["label"]

    def _signature(self, tf):
        spec = {c: (tf.RaggedTensorSpec([None, None], tf.int64, 1, tf.int64)
                    if self.multi_hot[c] else tf.TensorSpec([None], tf.int64))
                for c in self.categorical}
        if self.numeric:
            spec["numeric"] = tf.TensorSpec([None, len(self.numeric)], tf.float32)
        return spec, tf.TensorSpec([None], tf.float32)

    # -- one pass ----------------------------------------------------------------------

    # -- positions ---------------------------------------------------------------------

    def _start_position(self, fields) -> dict:
        """Where a pass from `fields` (None: the usual beginning) starts: global rows
        (split='global') or rows of this rank's plan passed (split='part')."""
        if fields is None:
            b = self.batch_size if self.split == "global" else self.part_batch_size
            fields = {"rows": min(self.start_step * b, self.rows if self.split == "global"
                                  else self._plan_rows())}
        return self._file_position(fields)

    def _accept(self, position: dict) -> dict:
        self._check_data(position, self.data)
        rows = self._need(position, "rows")
        if self.split == "global":
            if rows >= self.rows:
                return {"rows": self.rows, "end": True}     # the end: a full pass follows
            return {"rows": self._global_start(position) * self.batch_size}
        if not 0 <= rows <= self._plan_rows():
            raise PositionError(f"parquet: resume: the position is at row {rows} of this rank's "
                                f"part, which has {self._plan_rows()} rows")
        return {"rows": rows}

    def _mine(self) -> list[tuple[int, int]]:
        """split='part': the [lo, hi) ranges of global rows this rank reads, in order."""
        starts = np.cumsum([0] + [n for _, _, n in self.groups])
        if len(self.groups) >= self.world:
            glo, ghi = even_split(len(self.groups), self.rank, self.world)
            return [(int(starts[g]), int(starts[g + 1])) for g in range(glo, ghi)]
        out = []
        for g in range(len(self.groups)):
            lo, hi = even_split(self.groups[g][2], self.rank, self.world)
            out.append((int(starts[g]) + lo, int(starts[g]) + hi))
        return out

    def _plan_rows(self) -> int:
        return sum(hi - lo for lo, hi in self._mine())

    # -- one pass ----------------------------------------------------------------------

    def _plan(self, first: int) -> tuple[list[tuple[int, list[tuple[int, int, int]]]], list[int]]:
        """[(group index, [(lo, hi, t)]): the row ranges of each row group this rank
        reads], and the rows per step. split='global': from step `first`, t the step
        (counted from `first`); split='part': from row `first` of this rank's part, t the
        place of the range's first row in the part."""
        b = self.batch_size
        starts = np.cumsum([0] + [n for _, _, n in self.groups])
        if self.split == "global":
            steps = self.rows // b if self.drop_remainder else -(-self.rows // b)
            mine, counts = [], []
            for t in range(first, steps):
                size = min(b, self.rows - t * b)
                lo, hi = even_split(size, self.rank, self.world)
                mine.append((t * b + lo, t * b + hi, t - first))
                counts.append(hi - lo)
        else:
            mine, counts, at, skip = [], [], 0, first
            for lo, hi in self._mine():
                take = min(skip, hi - lo)
                skip -= take
                if lo + take < hi:
                    mine.append((lo + take, hi, at + take))
                at += hi - lo
        plan = []
        ends = np.array([m[1] for m in mine], np.int64)
        for g in range(len(self.groups)):
            s, e = int(starts[g]), int(starts[g + 1])
            k = int(np.searchsorted(ends, s, side="right"))
            ranges = []
            while k < len(mine) and mine[k][0] < e:
                lo, hi, t = mine[k]
                if min(hi, e) > max(lo, s):
                    place = t if self.split == "global" else t + max(lo, s) - lo
                    ranges.append((max(lo, s) - s, min(hi, e) - s, place))
                k += 1
            if ranges:
                plan.append((g, ranges))
        return plan, counts

    def _read_group(self, g: int, ranges, stats: ReaderStats):
        """(categorical {name: ids}, numeric [k, D], label [k], steps [k]) of this rank's
        rows of row group g, bad rows dropped (skip) or raised (error)."""
        pa, pq = _pa()
        fi, rg, _ = self.groups[g]
        path = self.paths[fi]
        try:
            table = pq.ParquetFile(path, read_dictionary=self._dictionary).read_row_group(
                rg, columns=self.columns, use_threads=False)    # one thread per rank
        except (pa.ArrowException, OSError) as exc:
            if self.on_bad_line == "error":
                raise ParquetFormatError(f"parquet: {path} row group {rg}: cannot read it: "
                                         f"{exc}") from None
            stats.skip(sum(hi - lo for lo, hi, _ in ranges), f"{path} row group {rg}: {exc}")
            return None
        rows = None
        if all(a[1] == z[0] for a, z in zip(ranges, ranges[1:])):     # one run of rows
            lo, hi = ranges[0][0], ranges[-1][1]
            if (lo, hi) != (0, table.num_rows):
                table = table.slice(lo, hi - lo)
                rows = np.arange(lo, hi)
        else:
            rows = np.concatenate([np.arange(lo, hi) for lo, hi, _ in ranges])
            table = table.take(pa.array(rows))
        if self.split == "global":     # each row's step, or its place in this rank's part
            steps = np.concatenate([np.full(hi - lo, t, np.int64) for lo, hi, t in ranges])
        else:
            steps = np.concatenate([np.arange(t, t + hi - lo, dtype=np.int64)
                                    for lo, hi, t in ranges])
        lab = table.column(self.label)
        if lab.null_count:
            valid = lab.is_valid().to_numpy(zero_copy_only=False)
            first = int(np.argmin(valid))
            row = first if rows is None else int(rows[first])
            msg = f"{path} row group {rg} row {row}: column {self.label!r} (the label) is null"
            if self.on_bad_line == "error":
                raise ParquetFormatError(f"parquet: {msg}")
            stats.skip(int((~valid).sum()), msg)
            table = table.filter(pa.array(valid))
            steps = steps[valid]
        label = _floats(pa, table.column(self.label))
        numeric = (np.stack([_floats(pa, table.column(c)) for c in self.numeric], axis=1)
                   if self.numeric else np.zeros((table.num_rows, 0), np.float32))
        cats = {c: _ids(pa, table.column(c), self.null_id, self.multi_hot[c])
                for c in self.categorical}
        return cats, numeric, label, steps

    def _batches(self, stats: ReaderStats, start) -> Iterator[tuple[dict, dict]]:
        stats.empty_files += self.empty_files
        if start is not None and start.get("end"):
            return iter(())
        if self.split == "global":
            first = self.start_step if start is None else start["rows"] // self.batch_size
            plan, counts = self._plan(first)
            return self._global(plan, first, len(counts), stats)
        first = self.start_step * self.part_batch_size if start is None else start["rows"]
        plan, _ = self._plan(first)
        return self._part(plan, stats)

    def _global(self, plan, first: int, nsteps: int, stats: ReaderStats
                ) -> Iterator[tuple[dict, dict]]:
        acc, step = [], 0
        b = self.batch_size

        def position(step):
            return {"rows": min((first + step + 1) * b, self.rows)}

        for g, ranges in plan:
            got = self._read_group(g, ranges, stats)
            if got is not None:
                acc.append(got)
            last = ranges[-1][2]        # rows of steps before `last` are all read now
            while step < last:
                acc, out = _cut(acc, step)
                yield self._batch(out, stats), position(step)
                step += 1
        while step < nsteps:
            acc, out = _cut(acc, step)
            yield self._batch(out, stats), position(step)
            step += 1

    def _part(self, plan, stats: ReaderStats) -> Iterator[tuple[dict, dict]]:
        """This rank's rows in batches of its share; position: rows of its part passed
        (the place after the batch's last row: rows dropped after it are dropped again
        on a resume)."""
        size = self.part_batch_size
        acc, held = [], 0
        for g, ranges in plan:
            got = self._read_group(g, ranges, stats)
            if got is None:
                continue
            acc.append(got)
            held += got[2].size
            while held >= size:
                acc, out = _first(acc, size)
                held -= size
                yield self._batch(out, stats), _after(out)
        if held and not self.drop_remainder:
            acc, out = _first(acc, held)
            yield self._batch(out, stats), _after(out)

    def _batch(self, parts, stats: ReaderStats) -> dict:
        cats = {}
        for c in self.categorical:
            vals = [p[0][c] for p in parts]
            cats[c] = _concat_ragged(vals) if self.multi_hot[c] else (
                np.concatenate(vals) if vals else np.zeros(0, np.int64))
        d = len(self.numeric)
        numeric = (np.concatenate([p[1] for p in parts]) if parts
                   else np.zeros((0, d), np.float32))
        label = np.concatenate([p[2] for p in parts]) if parts else np.zeros(0, np.float32)
        stats.rows += label.size
        stats.batches += 1
        return {"categorical": cats, "numeric": numeric, "label": label}


def _after(parts) -> dict:
    """split='part': the position after the last row of a batch's parts."""
    place = next(int(p[3][-1]) for p in reversed(parts) if p[3].size)
    return {"rows": place + 1}


def _floats(pa, column) -> np.ndarray:
    if column.null_count:
        column = column.fill_null(0)
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    return column.to_numpy().astype(np.float32, copy=False)


def _flat_ids(pa, arr, null_id: int) -> np.ndarray:
    """int64 keys of a flat id array (Array or ChunkedArray): integers as they are,
    strings hashed in C; nulls become null_id."""
    t = arr.type
    if pa.types.is_dictionary(t) and _kind(pa, t.value_type) != "string":
        arr = arr.cast(t.value_type)
        t = arr.type
    if _kind(pa, t) == "int":
        if pa.types.is_unsigned_integer(t) and t.bit_width == 64:
            arr = arr.cast(pa.int64(), safe=False)  # opaque 64-bit ids: the same bits
        out = (arr.fill_null(null_id) if arr.null_count else arr).to_numpy()
        return np.ascontiguousarray(out, dtype=np.int64)
    keys, valid = arrow_keys(arr)
    if valid is not None:
        keys[~valid] = null_id
    return keys


def _ids(pa, column, null_id: int, multi_hot: bool):
    if not multi_hot:
        return _flat_ids(pa, column, null_id)
    chunks = column.chunks
    values, splits, at = [], [np.zeros(1, np.int64)], 0
    for chunk in chunks:
        offs = chunk.offsets.to_numpy().astype(np.int64)   # nulls: empty lists
        values.append(_flat_ids(pa, chunk.values.slice(int(offs[0]), int(offs[-1] - offs[0])),
                                null_id))
        splits.append(offs[1:] - offs[0] + at)
        at += int(offs[-1] - offs[0])
    vals = np.concatenate(values) if values else np.zeros(0, np.int64)
    return vals, np.concatenate(splits)


def _concat_ragged(parts):
    if not parts:
        return np.zeros(0, np.int64), np.zeros(1, np.int64)
    values, splits, at = [], [np.zeros(1, np.int64)], 0
    for v, s in parts:
        values.append(v)
        splits.append(s[1:] + at)
        at += v.size
    return np.concatenate(values), np.concatenate(splits)


def _slice_part(part, a: int, z: int):
    cats, numeric, label, steps = part
    out = {}
    for c, v in cats.items():
        if isinstance(v, tuple):
            vals, splits = v
            out[c] = (vals[splits[a]:splits[z]], splits[a:z + 1] - splits[a])
        else:
            out[c] = v[a:z]
    return out, numeric[a:z], label[a:z], steps[a:z]


def _first(acc, size):
    """The first `size` rows of the accumulated row groups, and what remains."""
    out, rest, got = [], [], 0
    for part in acc:
        n = part[2].size
        if got >= size:
            rest.append(part)
            continue
        t = min(size - got, n)
        out.append(_slice_part(part, 0, t) if t < n else part)
        if t < n:
            rest.append(_slice_part(part, t, n))
        got += t
    return rest, out


def _cut(acc, step: int):
    """The accumulated rows of `step` (a prefix: rows come in step order), the rest."""
    out, rest = [], []
    for part in acc:
        steps = part[3]
        k = int(np.searchsorted(steps, step, side="right"))
        if k:
            out.append(_slice_part(part, 0, k) if k < steps.size else part)
        if k < steps.size:
            rest.append(_slice_part(part, k, steps.size) if k else part)
    return rest, out


def read_parquet(paths, batch_size: int, rank: int | None = None, world: int | None = None,
                 drop_remainder: bool = False, *, label: str, numeric=(), categorical=(),
                 split: str = "global", on_bad_line: str = "error", prefetch: int = 2,
                 null_id: int = -1, start_step: int = 0) -> ParquetReader:
    """This rank's batches of Parquet files: an iterable of batch dicts (one pass per
    iteration), also `.fit_batches()` and `.dataset()` for model.fit.

    paths: a file, a glob pattern, or a list of them, read in order.
    label, numeric, categorical: column names (module docstring). Every file's schema
        is checked on every rank when the reader is made.
    rank, world, split, drop_remainder, on_bad_line, prefetch, start_step: as
        `read_criteo`; split="part" assigns row groups to ranks. Positions
        (`position_at`, `resume`): global rows for split="global", rows of this rank's
        part for split="part".
    null_id: the key of a null id.
    """
    return ParquetReader(paths, batch_size, rank, world, drop_remainder, split, on_bad_line,
                         prefetch, label, numeric, categorical, null_id, start_step)


def parquet_dataset(paths, batch_size: int, rank: int | None = None,
                    world: int | None = None, **options):
    """A tf.data.Dataset of this rank's (features, label) batches of Parquet files, for
    model.fit (features as `ParquetReader.features`). Options as `read_parquet`."""
    return read_parquet(paths, batch_size, rank, world, **options).dataset()
