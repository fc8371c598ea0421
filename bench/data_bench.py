"""Data readers: rows per second per core of each reader, against the reader they replace.

    python -m bench data            # 400k lines (about 105 MB of TSV): a couple of minutes
    python -m bench data --quick    # a smoke test

The data is kvcoll.data.SyntheticCTR's training stream written out in Criteo's TSV
format (`write_criteo`: label, 13 integers with 10% missing, 26 categorical values as
8-digit hex), plain and .gz, and as Parquet (the same columns; the categorical values
as strings, so the reader hashes them). Every measurement runs in a child process
pinned to one CPU, with prefetch=0 (the reading thread is the measured one), each file
read once before timing (the page cache holds it), best and median of several passes:

- criteo: read_criteo, split="global" on one rank (every line parsed), plain and .gz;
- criteo-current: the reader it replaces (`legacy_read_criteo`, a copy of the previous
  kvcoll.data.read_criteo: a Python loop over lines, numpy parsing), plain and .gz;
- criteo, 2 ranks: one rank's view of a 2-rank run: split="global" (scan every line
  end, parse half the lines) and split="part" (read half the bytes);
- parquet: read_parquet of the same rows (13 numeric, 26 string id columns), with
  either string hash (id_hash farmhash64, the default, and xxh64), in alternating pairs;
- hash_strings of 1M string ids in each layout (numpy 'U', object, pyarrow) with
  farmhash64 and with xxh64, and against the previous implementation
  (`legacy_hash_strings`: one Python encode per id, then C XXH64); and the C hash alone
  over Arrow offsets (the readers' path) for ids of 8, 16, 32, 64 and 200 bytes, both
  hashes interleaved rep by rep.
- stream: kvcoll.data.stream over the same finished file (TSV, then Parquet; no wait
  at the end: idle_timeout 0, settle 0), alternating with the plain reader, so its
  ratio to the reader is measured in the same run;

New and current readers are measured in alternating pairs on a machine that other
work may share; the ratios within a pair are the figures to read.
Writes bench/results/data.json and data.md.
"""

from __future__ import annotations

import gzip
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

from . import common

_HEX = np.frombuffer(b"0123456789abcdef", np.uint8)


def add_arguments(p) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-lines", type=int, default=400_000, help="lines in the test files")
    g.add_argument("--data-pairs", type=int, default=3,
                   help="alternating new / current passes per measurement")
    g.add_argument("--data-parts", default="criteo,parquet,hash",
                   help="which measurements, comma-separated: criteo (the TSV readers), "
                        "parquet (read_parquet, farmhash64 vs xxh64), hash (hash_strings "
                        "and the C hashes, farmhash64 vs xxh64)")


# -- the test data -----------------------------------------------------------------------

def criteo_columns(gen, lo: int, hi: int, stream: str = "train"):
    """pyarrow columns of Criteo TSV for samples [lo, hi) of `gen` (a SyntheticCTR):
    label, I1..I13 (round(expm1(numeric)), 10% missing), C1..C26 (8-digit hex of each
    id's place in its field)."""
    import pyarrow as pa

    b = gen.samples(lo, hi, stream)
    n = hi - lo
    cols, names = [pa.array(b["label"].astype(np.int8))], ["label"]
    x = np.rint(np.expm1(b["numeric"].astype(np.float64))).astype(np.int64)
    gi = np.arange(lo, hi, dtype=np.int64)
    for j in range(x.shape[1]):
        missing = (gi * 7 + j * 3) % 10 == 0
        cols.append(pa.array(x[:, j], mask=missing))
        names.append(f"I{j + 1}")
    local = (b["categorical"] - gen.offsets).astype(np.uint64)
    for f in range(local.shape[1]):
        digits = np.empty((n, 8), np.uint8)
        for k in range(8):
            digits[:, 7 - k] = _HEX[(local[:, f] >> np.uint64(4 * k)) & np.uint64(15)]
        cols.append(pa.array(digits.view("S8").reshape(-1), pa.binary()))
        names.append(f"C{f + 1}")
    return pa.table(cols, names=names)


def write_criteo(path: str, lines: int, seed: int = 0, stream: str = "train") -> int:
    """Write samples [0, lines) of SyntheticCTR(seed)'s training (or "eval") stream as a
    Criteo TSV file (gzipped if path ends in .gz); returns its size in bytes. Line t*B+i
    is sample t*B+i: global batch t of the file is the synthetic set's batch t."""
    import pyarrow.csv as pcsv

    from kvcoll.data import SyntheticCTR

    gen = SyntheticCTR(seed=seed)
    opts = pcsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none")
    tmp = path + ".plain" if path.endswith(".gz") else path
    with pcsv.CSVWriter(tmp, criteo_columns(gen, 0, 1, stream).schema,
                        write_options=opts) as w:
        for lo in range(0, lines, 100_000):
            w.write_table(criteo_columns(gen, lo, min(lines, lo + 100_000), stream))
    if path.endswith(".gz"):
        with open(tmp, "rb") as src, gzip.open(path, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst, 8 << 20)
        os.remove(tmp)
    return os.path.getsize(path)


def write_parquet(path: str, lines: int, seed: int = 0) -> int:
    """The same rows as write_criteo, as Parquet: label, I1..I13 (int64, nulls), C1..C26
    (hex strings), row groups of 100k rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kvcoll.data import SyntheticCTR

    gen = SyntheticCTR(seed=seed)
    writer = None
    for lo in range(0, lines, 100_000):
        t = criteo_columns(gen, lo, min(lines, lo + 100_000))
        t = pa.table([c if not n.startswith("C") else c.cast(pa.string())
                      for c, n in zip(t.columns, t.column_names)], names=t.column_names)
        if writer is None:
            writer = pq.ParquetWriter(path, t.schema)
        writer.write_table(t, row_group_size=100_000)
    writer.close()
    return os.path.getsize(path)


# -- the readers being replaced (copies of the previous kvcoll code) ---------------------

def legacy_read_criteo(paths, batch_size: int, rank: int = 0, world: int = 1):
    """The previous kvcoll.data.read_criteo: every rank reads every line in Python
    (checking its tab count), then parses its even_split part with numpy."""
    from kvcoll.data import even_split, parse_criteo_lines

    lines = []
    for path in paths:
        with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as f:
            for line in f:
                if line.count(b"\t") != 39:
                    raise ValueError(f"{path}: bad line")
                lines.append(line)
                if len(lines) == batch_size:
                    lo, hi = even_split(len(lines), rank, world)
                    yield parse_criteo_lines(lines[lo:hi])
                    lines = []
    if lines:
        lo, hi = even_split(len(lines), rank, world)
        yield parse_criteo_lines(lines[lo:hi])


def legacy_hash_strings(values) -> np.ndarray:
    """The previous kvcoll.ids.hash_strings for 'U' and object arrays: one Python
    encode per id, then one kv_hash_strings call over the joined bytes."""
    from kvcoll._c import lib, ptr

    flat = np.asarray(values).reshape(-1)
    parts = [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in flat.tolist()]
    lens = np.fromiter((len(p) for p in parts), np.int64, len(parts))
    starts = np.zeros(len(parts), np.int64)
    np.cumsum(lens[:-1], out=starts[1:])
    raw = np.frombuffer(b"".join(parts) or b"\0", np.uint8)
    out = np.empty(len(parts), np.int64)
    lib.kv_hash_strings(ptr("uint8_t *", raw), ptr("int64_t *", starts),
                        ptr("int64_t *", lens), len(parts), 0, ptr("int64_t *", out))
    return out


# -- children ----------------------------------------------------------------------------

def _rows(batches) -> int:
    return sum(int(b["label"].size) for b in batches)


def reader_child(spec: dict) -> None:
    """Child: passes of one reader over one file on one CPU; emits rows/s."""
    common.pin_to_cpu(spec["cpu"])
    from kvcoll.data import read_criteo, read_parquet, stream

    path, kind = spec["path"], spec["reader"]
    rank, world = spec.get("rank", 0), spec.get("world", 1)
    cats = [f"C{f + 1}" for f in range(26)]
    numeric = [f"I{j + 1}" for j in range(13)]
    if spec.get("id_hash"):
        from kvcoll import ids

        ids.configure(spec["id_hash"])

    def one() -> int:
        if kind == "stream":
            cols = ({"format": "criteo"} if not path.endswith(".parquet") else
                    {"label": "label", "numeric": numeric, "categorical": cats})
            return _rows(stream(path, 4096, rank, world, split=spec.get("split", "part"),
                                idle_timeout=0, settle=0, prefetch=0, **cols))
        if kind == "criteo":
            return _rows(read_criteo(path, 4096, rank, world, split=spec.get("split", "global"),
                                     prefetch=0))
        if kind == "criteo-current":
            return _rows(legacy_read_criteo([path], 4096, rank, world))
        return _rows(read_parquet(path, 4096, rank, world, label="label",
                                  numeric=numeric, categorical=cats,
                                  split=spec.get("split", "global"), prefetch=0))

    rows = one()                                        # warm: page cache, imports
    times = common.timed_passes(one, min_reps=spec["reps"], max_reps=spec["reps"],
                                min_seconds=0)
    common.emit({"rows": rows, "seconds": times, "rows_per_sec": rows / min(times),
                 "rows_per_sec_median": rows / statistics.median(times)})


def hash_child(spec: dict) -> None:
    """Child: hash_strings vs legacy_hash_strings on 1M ids in each layout."""
    common.pin_to_cpu(spec["cpu"])
    import pyarrow as pa

    from kvcoll.ids import hash_strings

    n = spec["n"]
    ids = np.char.add("id_", np.arange(n).astype("U12"))
    layouts = {"numpy U": ids, "object": ids.astype(object), "pyarrow string": pa.array(ids)}
    for name, values in layouts.items():
        want = legacy_hash_strings(values if name != "pyarrow string" else ids)
        if not np.array_equal(hash_strings(values, "xxh64"), want):
            raise AssertionError(f"hash_strings differs from the previous keys on {name}")
        # the previous code took a pyarrow array only as numpy objects
        current = values.to_numpy(zero_copy_only=False) if name == "pyarrow string" else values
        impls = (("farmhash64", lambda v=values: hash_strings(v, "farmhash64")),
                 ("xxh64", lambda v=values: hash_strings(v, "xxh64")),
                 ("current", lambda v=current: legacy_hash_strings(v)))
        best = _interleaved(impls, spec["reps"])
        for impl, t in best.items():
            common.emit({"layout": name, "impl": impl, "ids": n, "ids_per_sec": n / t})
    # the C hash alone over Arrow offsets (what the readers call), by id length
    from kvcoll._c import lib, ptr

    for width in (8, 16, 32, 64, 200):
        count = min(n, (64 << 20) // width)
        raw = np.random.default_rng(width).integers(0, 256, count * width, dtype=np.uint8)
        offsets = np.arange(count + 1, dtype=np.int64) * width
        out = np.empty(count, np.int64)

        def c_hash(code, raw=raw, offsets=offsets, count=count, out=out):
            lib.kv_hash_offsets64(ptr("uint8_t *", raw), ptr("int64_t *", offsets), count,
                                  code, ptr("int64_t *", out))

        best = _interleaved((("farmhash64", lambda: c_hash(lib.KV_ID_FARMHASH64)),
                             ("xxh64", lambda: c_hash(lib.KV_ID_XXH64))), spec["reps"] * 3)
        for impl, t in best.items():
            common.emit({"layout": f"C, Arrow offsets, {width}-byte ids", "impl": impl,
                         "ids": count, "ids_per_sec": count / t})


def _interleaved(impls, reps: int) -> dict:
    """Best seconds of each (name, fn) over `reps` rounds, the impls taking turns within
    each round (after one warm-up call each), so a busy moment hits them alike."""
    for _, fn in impls:
        fn()
    best = {name: float("inf") for name, _ in impls}
    for _ in range(reps):
        for name, fn in impls:
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


# -- the run -----------------------------------------------------------------------------

def run(args) -> None:
    lines = 20_000 if args.quick else args.data_lines
    pairs = 1 if args.quick else args.data_pairs
    reps = 2 if args.quick else 3
    out_dir = args.out or (tempfile.mkdtemp() if args.quick else common.RESULTS)
    cpu = common.default_cpu()
    tmp = tempfile.mkdtemp(prefix="kvbench-data-", dir=common.ROOT)
    records = []
    try:
        files = {"tsv": os.path.join(tmp, "day.tsv"), "tsv.gz": os.path.join(tmp, "day.tsv.gz"),
                 "parquet": os.path.join(tmp, "day.parquet")}
        print(f"[data] writing {lines:,} lines as TSV, .gz and Parquet", flush=True)
        sizes = {"tsv": write_criteo(files["tsv"], lines),
                 "tsv.gz": write_criteo(files["tsv.gz"], lines),
                 "parquet": write_parquet(files["parquet"], lines)}
        parts = set(args.data_parts.split(","))
        unknown = parts - {"criteo", "parquet", "hash"}
        if unknown:
            raise SystemExit(f"--data-parts: unknown {sorted(unknown)}; use criteo, parquet, hash")
        plan = []
        for fmt in ("tsv", "tsv.gz") if "criteo" in parts else ():
            for pair in range(pairs):
                plan += [(fmt, "criteo", {}, pair), (fmt, "criteo-current", {}, pair)]
        for pair in range(pairs):
            if "criteo" in parts:
                plan += [("tsv", "criteo", {"rank": 0, "world": 2, "split": "global"}, pair),
                         ("tsv", "criteo", {"rank": 0, "world": 2, "split": "part"}, pair)]
            if "parquet" in parts:   # the two hashes in alternating order
                hashes = ("farmhash64", "xxh64") if pair % 2 == 0 else ("xxh64", "farmhash64")
                plan += [("parquet", "parquet", {"id_hash": h}, pair) for h in hashes]
        for pair in range(pairs) if "criteo" in parts or "parquet" in parts else ():
            # stream and plain reader over the same file, paired
            plan += [("tsv", "stream", {"split": "global", "vs": "criteo"}, pair),
                     ("tsv", "criteo", {"split": "global", "vs": "stream"}, pair),
                     ("parquet", "stream", {"split": "global", "vs": "parquet"}, pair),
                     ("parquet", "parquet", {"split": "global", "vs": "stream"}, pair)]
        for fmt, reader, extra, pair in plan:
            busy = common.wait_until_quiet(0 if args.quick else 120)   # the machine is shared
            print(f"[data] {reader} {fmt} {extra or ''} pair {pair + 1}", flush=True)
            got, err = common.run_child("bench.data_bench:reader_child",
                                        {"path": files[fmt], "reader": reader, "cpu": cpu,
                                         "reps": reps,
                                         **{k: v for k, v in extra.items() if k != "vs"}},
                                        timeout=1800)
            rec = {"bench": "reader", "format": fmt, "reader": reader, "pair": pair,
                   "file_bytes": sizes[fmt], "lines": lines, "busy_before": busy, **extra}
            records.append(dict(rec, **got[0]) if got else dict(rec, error=err))
        if "hash" in parts:
            print("[data] hash_strings", flush=True)
            got, err = common.run_child("bench.data_bench:hash_child",
                                        {"n": 100_000 if args.quick else 1_000_000, "cpu": cpu,
                                         "reps": reps}, timeout=1800)
            records += [dict(r, bench="hash") for r in got]
            if err:
                records.append({"bench": "hash", "error": err})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    common.publish(out_dir, "data", records, lambda m: markdown(records, m))


def _median(records, **match) -> float | None:
    vals = [r["rows_per_sec"] for r in records if r.get("bench") == "reader"
            and "rows_per_sec" in r and all(r.get(k) == v for k, v in match.items())]
    return statistics.median(vals) if vals else None


def summary(records) -> dict:
    out = {}
    for fmt in ("tsv", "tsv.gz"):
        new = [r for r in records if r.get("reader") == "criteo" and r.get("format") == fmt
               and "world" not in r and "vs" not in r and "rows_per_sec" in r]
        cur = {r["pair"]: r for r in records if r.get("reader") == "criteo-current"
               and r.get("format") == fmt and "rows_per_sec" in r}
        ratios = [r["rows_per_sec"] / cur[r["pair"]]["rows_per_sec"] for r in new
                  if r["pair"] in cur]
        out[fmt] = {"new": _median(new), "current": _median(list(cur.values())),
                    "pair_ratios": ratios,
                    "ratio": statistics.median(ratios) if ratios else None}
    for fmt in ("tsv", "parquet"):
        plain = {r["pair"]: r for r in records if r.get("vs") == "stream"
                 and r.get("format") == fmt and "rows_per_sec" in r}
        streamed = [r for r in records if r.get("reader") == "stream" and r.get("format") == fmt
                    and "rows_per_sec" in r]
        ratios = [r["rows_per_sec"] / plain[r["pair"]]["rows_per_sec"] for r in streamed
                  if r["pair"] in plain]
        out[f"stream-{fmt}"] = {"stream": _median(streamed), "reader":
                                _median(list(plain.values())), "pair_ratios": ratios,
                                "ratio": statistics.median(ratios) if ratios else None}
    return out


def _fmt(v) -> str:
    return "-" if v is None else f"{v:,.0f}"


def markdown(records, machine) -> str:
    s = summary(records)
    lines_n = next((r["lines"] for r in records if "lines" in r), 0)
    size = {r["format"]: r["file_bytes"] for r in records if "file_bytes" in r}
    lines = [
        "# Data readers",
        "",
        f"`./dev bench data` — {lines_n:,} lines of SyntheticCTR written as Criteo TSV "
        f"({size.get('tsv', 0) / 1e6:.0f} MB; .gz {size.get('tsv.gz', 0) / 1e6:.0f} MB; Parquet "
        f"{size.get('parquet', 0) / 1e6:.0f} MB), one pinned core per reader, prefetch off, "
        f"files in the page cache; best of 3 passes, median over the pairs; other processes "
        f"used up to {max(r.get('busy_before', 0) for r in records):.2f} CPUs before a "
        f"measurement. "
        f"{machine['cpu']}, {machine['cores']} cores, pyarrow "
        f"{common._version('pyarrow')}, {machine.get('date', '')}.",
        "",
        "| reader | file | rows/s per core (kvcoll) | rows/s per core (current) | kvcoll / current "
        "(pairs) |",
        "|---|---|---:|---:|---|",
    ]
    for fmt in ("tsv", "tsv.gz"):
        d = s[fmt]
        pairs = ", ".join(f"{p:.1f}x" for p in d["pair_ratios"])
        ratio = "-" if d["ratio"] is None else f"{d['ratio']:.1f}x"
        lines.append(f"| read_criteo, 1 rank | {fmt} | {_fmt(d['new'])} | {_fmt(d['current'])} "
                     f"| {ratio} ({pairs}) |")
    for split in ("global", "part"):
        v = _median(records, reader="criteo", format="tsv", world=2, split=split)
        lines.append(f"| read_criteo, rank 0 of 2, split={split!r} | tsv | {_fmt(v)} | | |")
    farm = {r["pair"]: r["rows_per_sec"] for r in records if r.get("reader") == "parquet"
            and r.get("id_hash") == "farmhash64" and "rows_per_sec" in r}
    xxh = {r["pair"]: r["rows_per_sec"] for r in records if r.get("reader") == "parquet"
           and r.get("id_hash") == "xxh64" and "rows_per_sec" in r}
    ratios = [farm[p] / xxh[p] for p in farm if p in xxh]
    ratio = f"{statistics.median(ratios):.2f}x" if ratios else "-"
    lines.append(f"| read_parquet (26 string id columns hashed), farmhash64 vs xxh64 | parquet "
                 f"| {_fmt(_median(records, reader='parquet', id_hash='farmhash64'))} "
                 f"| {_fmt(_median(records, reader='parquet', id_hash='xxh64'))} (xxh64) "
                 f"| {ratio} ({', '.join(f'{r:.2f}x' for r in ratios)}) |")
    lines += ["", ("kvcoll.data.stream over the same finished file against the plain reader, "
                   "paired in the same run (1 rank):"), "",
              ("| file | stream rows/s per core | reader rows/s per core | stream / reader "
               "(pairs) |"), "|---|---:|---:|---|"]
    for fmt in ("tsv", "parquet"):
        d = s[f"stream-{fmt}"]
        pairs = ", ".join(f"{p:.2f}x" for p in d["pair_ratios"])
        ratio = "-" if d["ratio"] is None else f"{d['ratio']:.2f}x"
        lines.append(f"| {fmt} | {_fmt(d['stream'])} | {_fmt(d['reader'])} | {ratio} "
                     f"({pairs}) |")
    lines += ["", ("String ids to keys, ids/s on one core (1M ids of 8-10 characters; the C "
                   "rows: random bytes of one length, the hash alone over Arrow offsets):"), "",
              ("| layout | farmhash64 | xxh64 | farmhash64 / xxh64 | previous (a Python encode "
               "per id, xxh64) | farmhash64 / previous |"),
              "|---|---:|---:|---:|---:|---:|"]
    hashes = [r for r in records if r.get("bench") == "hash" and "layout" in r]
    for layout in dict.fromkeys(r["layout"] for r in hashes):
        got = {r["impl"]: r["ids_per_sec"] for r in hashes if r["layout"] == layout}
        f, x, c = got.get("farmhash64"), got.get("xxh64"), got.get("current")
        lines.append(f"| {layout} | {_fmt(f)} | {_fmt(x)} | "
                     + (f"{f / x:.2f}x" if f and x else "-") + f" | {_fmt(c)} | "
                     + (f"{f / c:.1f}x |" if f and c else "|"))
    errors = [r for r in records if "error" in r]
    lines += ["", "- rows/s of a 2-rank run are rank 0's own rows (half the file) over its time: "
              "split='global' still scans every line end; split='part' reads only its half",
              "- the Parquet file holds the same rows, its 26 id columns as strings (hashed "
              "in C, one call per column); TSV hex ids are parsed in C (kv_hex_ids32)"]
    lines += [f"- skipped: {r.get('reader', r.get('bench'))} {r.get('format', '')}: {r['error']}"
              for r in errors]
    return "\n".join(lines) + "\n"
