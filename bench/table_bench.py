"""Lookup and insert throughput, and memory per row, of kvcoll's table and three baselines.

    python -m bench table            # 1M and 10M resident keys, dims 16 and 64 (~10 min)
    python -m bench table --quick    # 100k resident keys: a smoke test, under a minute

Contenders, all on one core and fed the same keys: kvcoll's KvTable;
tf.lookup.experimental.DenseHashTable and MutableHashTable (TensorFlow intra/inter-op
threads = 1); a Python dict of row indices into a numpy array.

- Resident keys: distinct random int64 (uniform over int64, minus the two keys
  DenseHashTable reserves).
- insert: fill an empty table with the resident keys in batches of 65,536 (growth
  included). kvcoll: find_or_create; TF: insert(keys, values); dict: a per-key Python
  loop that assigns row indices, then one numpy write of the rows into an array that
  doubles when full. Best of 3 fills up to 1M keys, of 2 above (1 if memory is short).
- find: batches of 65,536 keys drawn from the resident keys, uniform or Zipf(1.1)
  (rank-frequency by inverse CDF, ranks mapped to keys by a random permutation).
  Every contender reads the same batches; best of at least 3 passes.
- bytes per row beyond the row's floats: kvcoll from KvTable.stats(); the others from
  the growth of the process's RSS over the fill (an estimate), minus keys * dim * 4.
- TF tables are timed both eagerly and through a tf.function with an input signature;
  the faster is reported and named in the record's `mode`. Their key and value batches
  are converted to tensors before the clock starts, which favours TF slightly.
- The machine's random 64-byte gather rate (bench/_gather.c) is measured in the same
  run; kvcoll's find rate is reported as a fraction of half of it, since a lookup
  reads two dependent random lines (index slot, then row).

Every (contender, resident keys, dim) runs in its own child process (see common.py),
so RSS deltas are clean and a configuration that overruns its time or memory is
recorded as skipped, with the reason, instead of stopping the run.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import os
import shutil
import sys
import tempfile
import time

import numpy as np

from . import common

IMPLS = ("kvcoll", "dense", "mutable", "dict")
LABELS = {"kvcoll": "kvcoll", "dense": "DenseHashTable", "mutable": "MutableHashTable",
          "dict": "dict + numpy"}
DISTS = ("uniform", "zipf")
EMPTY_KEY = -(2**63)        # DenseHashTable's empty_key and deleted_key: never a
DELETED_KEY = -(2**63) + 1  # resident key
KEY_LO, KEY_HI = -(2**63) + 2, 2**63 - 1


@dataclasses.dataclass(frozen=True)
class Settings:
    """One run of the table benchmark."""

    sizes: tuple = (1_000_000, 10_000_000)  # resident keys
    dims: tuple = (16, 64)
    impls: tuple = IMPLS
    batch: int = 65536
    find_batches: int = 16          # batches per find pass (same batches for everyone)
    insert_reps_upto: int = 1_000_000  # best of 3 fills up to this many keys, else of 2
    zipf_s: float = 1.1
    seed: int = 0
    gather_bytes: int = 2 << 30
    gathers: int = 50_000_000
    gather_reps: int = 3
    timeout: float = 480.0          # seconds per (contender, size, dim) child
    min_seconds: float = 0.5        # a find measurement repeats passes for this long
    quiet_wait: float = 10.0        # before each child, wait this long at most for
                                    # other processes to leave the CPUs idle
    cpu: int = -1                   # -1: the last CPU we may use
    quick: bool = False

    @classmethod
    def full(cls, **kw) -> Settings:
        return cls(**kw)

    @classmethod
    def smoke(cls, **kw) -> Settings:
        base = {"sizes": (100_000,), "find_batches": 4, "gather_bytes": 512 << 20,
                "gathers": 10_000_000, "gather_reps": 2, "timeout": 120.0,
                "min_seconds": 0.1, "quiet_wait": 0.0, "quick": True}
        base.update(kw)
        return cls(**base)


# -- contenders (used in the child processes) ----------------------------------------------

class _Kvcoll:
    insert_modes = ("find_or_create",)
    find_modes = ("find",)

    def __init__(self, dim: int, n: int):
        import kvcoll

        self.kv, self.dim = kvcoll, dim

    def keys_in(self, a):
        return a

    def values_in(self, n):
        return np.full((n, self.dim), 0.5, np.float32)

    def create(self):
        return self.kv.KvTable(self.dim, name="bench")

    def inserter(self, t, mode):
        return lambda k, v: t.find_or_create(k)

    def finder(self, t, mode):
        return t.find

    def size(self, t):
        return len(t)

    def all_found(self, t, keys):
        return bool(t.find(keys, return_found=True)[1].all())

    def close(self, t):
        t.close()

    def overhead(self, t, rss_delta, n):
        s = t.stats()
        extra = {"bytes_per_row_rss": rss_delta / n - 4 * self.dim,
                 "load_factor": s.load_factor, "index_slots": s.index_slots,
                 "row_bytes": s.row_bytes, "table_bytes": s.bytes}
        return s.bytes_per_row_overhead, "KvTable.stats()", extra


class _TF:
    insert_modes = find_modes = ("eager", "tf.function")

    def __init__(self, dim: int, n: int, kind: str, batch: int):
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
        self.tf, self.dim, self.kind, self.batch = tf, dim, kind, batch

    def keys_in(self, a):
        return self.tf.constant(a)

    def values_in(self, n):
        return self.tf.constant(np.full((n, self.dim), 0.5, np.float32))

    def create(self):
        tf = self.tf
        default = tf.zeros([self.dim], tf.float32)
        if self.kind == "dense":
            return tf.lookup.experimental.DenseHashTable(
                tf.int64, tf.float32, default_value=default,
                empty_key=EMPTY_KEY, deleted_key=DELETED_KEY)
        return tf.lookup.experimental.MutableHashTable(tf.int64, tf.float32, default)

    def inserter(self, t, mode):
        if mode == "eager":
            return t.insert
        tf = self.tf

        def insert(keys, values):
            t.insert(keys, values)  # returns an Operation, which tf.function cannot
        return tf.function(insert, input_signature=[
            tf.TensorSpec([None], tf.int64), tf.TensorSpec([None, self.dim], tf.float32)])

    def finder(self, t, mode):
        if mode == "eager":
            return t.lookup
        tf = self.tf
        return tf.function(t.lookup, input_signature=[tf.TensorSpec([None], tf.int64)])

    def size(self, t):
        return int(t.size())

    def all_found(self, t, keys):
        # every resident key was inserted with 0.5s; absent keys read the default, 0
        return bool((t.lookup(keys).numpy() == 0.5).all())

    def close(self, t):
        pass  # the table goes when its last reference does

    def overhead(self, t, rss_delta, n):
        extra = {}
        if self.kind == "dense":
            # the bucket arrays alone: a floor under the RSS estimate, which also counts
            # what the allocator keeps after each growth step. export() copies them, so
            # where that does not fit, TensorFlow's growth rule gives the count.
            if common.mem_available() > 2 * rss_delta + (1 << 30):
                keys, _ = t.export()
                buckets, source = int(keys.shape[0]), "export()"
                del keys, _
            else:
                buckets, source = _dense_buckets(n, self.batch), "growth rule"
            extra = {"buckets": buckets, "buckets_from": source,
                     "bytes_per_row_arrays": buckets * (8 + 4 * self.dim) / n - 4 * self.dim}
        return rss_delta / n - 4 * self.dim, "RSS delta (estimate)", extra


def _dense_buckets(n: int, batch: int, buckets: int = 1 << 17, max_load: float = 0.8) -> int:
    """DenseHashTable's bucket count after inserting n fresh keys in batches: before a
    batch, it doubles until entries + batch <= max_load * buckets (lookup_table_op.cc)."""
    for done in range(0, n, batch):
        pending = min(done + batch, n)
        while pending > buckets * max_load:
            buckets <<= 1
    return buckets


class _DictTable:
    def __init__(self, dim: int, capacity: int):
        self.index: dict[int, int] = {}
        self.rows = np.empty((capacity, dim), np.float32)


class _Dict:
    insert_modes = ("per-key loop",)
    find_modes = ("per-key loop",)

    def __init__(self, dim: int, n: int):
        self.dim = dim

    def keys_in(self, a):
        return a

    def values_in(self, n):
        return np.full((n, self.dim), 0.5, np.float32)

    def create(self):
        return _DictTable(self.dim, 1024)

    def inserter(self, t, mode):
        def insert(keys, values):
            index = t.index
            get = index.get
            nxt = len(index)
            ids = []
            append = ids.append
            for k in keys.tolist():
                j = get(k)
                if j is None:
                    j = index[k] = nxt
                    nxt += 1
                append(j)
            if nxt > len(t.rows):
                grown = np.empty((max(nxt, 2 * len(t.rows)), self.dim), np.float32)
                grown[:len(t.rows)] = t.rows
                t.rows = grown
            t.rows[np.array(ids, np.int64)] = values
        return insert

    def finder(self, t, mode):
        def find(keys):
            idx = np.fromiter(map(t.index.__getitem__, keys.tolist()), np.int64, len(keys))
            return t.rows.take(idx, axis=0)
        return find

    def size(self, t):
        return len(t.index)

    def all_found(self, t, keys):
        return all(k in t.index for k in keys.tolist())

    def close(self, t):
        t.index, t.rows = {}, None

    def overhead(self, t, rss_delta, n):
        return rss_delta / n - 4 * self.dim, "RSS delta (estimate)", {}


def _contender(name: str, dim: int, n: int, batch: int):
    if name == "kvcoll":
        return _Kvcoll(dim, n)
    if name in ("dense", "mutable"):
        return _TF(dim, n, name, batch)
    if name == "dict":
        return _Dict(dim, n)
    raise ValueError(f"contender {name!r} is unknown; use one of {IMPLS}")


# -- the child: one contender, one size, one dim -------------------------------------------

def table_child(spec: dict) -> None:
    """Measure one (contender, resident keys, dim): insert, then find per stream."""
    common.pin_to_cpu(spec["cpu"])
    name, n, dim, bsz = spec["impl"], spec["n"], spec["dim"], spec["batch"]
    c = _contender(name, dim, n, bsz)
    base = {"impl": name, "resident_keys": n, "dim": dim, "batch": bsz, "threads": 1,
            "cpu": spec["cpu"]}
    resident = np.load(os.path.join(spec["data"], f"resident_{n}.npy"))
    spans = [(i, min(i + bsz, n)) for i in range(0, n, bsz)]
    full_values = c.values_in(bsz)
    pairs = [(c.keys_in(resident[a:b]), full_values if b - a == bsz else full_values[:b - a])
             for a, b in spans]
    empty = (c.keys_in(np.empty(0, np.int64)), c.values_in(0))

    # insert: choose the faster mode on a few batches, then time whole fills
    probe = {}
    for mode in c.insert_modes:
        t = c.create()
        ins = c.inserter(t, mode)
        ins(*empty)  # traces a tf.function; a no-op otherwise
        few = pairs[:4]
        t0 = time.perf_counter()
        for k, v in few:
            ins(k, v)
        probe[mode] = sum(int(k.shape[0]) for k, _ in few) / (time.perf_counter() - t0)
        c.close(t)
        del t, ins
        gc.collect()
    mode = max(probe, key=probe.get)
    reps = 3 if n <= spec["insert_reps_upto"] else 2
    times, mem, t, grew = [], None, None, 0
    for _ in range(reps):
        if times and common.mem_available() < 1.5 * grew:
            break  # another fill might not fit: keep the table we have for the finds
        if t is not None:
            c.close(t)
            t = None
        gc.collect()
        rss0 = common.rss_bytes()
        t = c.create()
        ins = c.inserter(t, mode)
        ins(*empty)
        t0 = time.perf_counter()
        for k, v in pairs:
            ins(k, v)
        times.append(time.perf_counter() - t0)
        del ins
        if c.size(t) != n:
            raise RuntimeError(f"{name}: {c.size(t)} keys after inserting {n} distinct keys")
        if mem is None:
            grew = common.rss_bytes() - rss0
            mem = c.overhead(t, grew, n)
    bytes_per_row, method, extra = mem
    rec = dict(base, bytes_per_row=bytes_per_row, bytes_per_row_method=method, **extra)
    common.emit(dict(rec, op="insert", dist="uniform", mode=mode, modes_tried=probe,
                     keys_per_sec=n / min(times),
                     keys_per_sec_median=n / sorted(times)[len(times) // 2],
                     keys_timed=n, passes=len(times), seconds=min(times),
                     fill_seconds=times))
    del pairs

    # find: every mode, full passes over the same batches; report the faster
    for dist in DISTS:
        stream = np.load(os.path.join(spec["data"], f"find_{dist}_{n}.npy"))
        batches = [c.keys_in(stream[i:i + bsz]) for i in range(0, stream.size, bsz)]
        if not c.all_found(t, batches[0]):
            raise RuntimeError(f"{name}: a resident key was not found")
        best = None
        tried = {}
        for fmode in c.find_modes:
            fn = c.finder(t, fmode)
            fn(batches[0])  # warm up (and trace)

            def one_pass(fn=fn, batches=batches):
                for b in batches:
                    fn(b)
            ts = sorted(common.timed_passes(one_pass, min_seconds=spec["min_seconds"]))
            tried[fmode] = stream.size / ts[0]
            if best is None or ts[0] < best[1][0]:
                best = (fmode, ts)
            del fn, one_pass
        fmode, ts = best
        common.emit(dict(rec, op="find", dist=dist, mode=fmode, modes_tried=tried,
                         keys_per_sec=stream.size / ts[0],
                         keys_per_sec_median=stream.size / ts[len(ts) // 2],
                         keys_timed=int(stream.size), passes=len(ts), seconds=ts[0],
                         stream_distinct=int(np.unique(stream).size)))
    c.close(t)


# -- the parent: data, children, results ---------------------------------------------------

def _log(msg: str) -> None:
    print(f"[bench table] {msg}", file=sys.stderr, flush=True)


def _distinct_keys(rng, n: int) -> np.ndarray:
    keys = rng.integers(KEY_LO, KEY_HI, size=n, dtype=np.int64)
    while True:
        _, first = np.unique(keys, return_index=True)
        if first.size == n:
            return keys
        keys = np.concatenate([keys[np.sort(first)],
                               rng.integers(KEY_LO, KEY_HI, size=n - first.size, dtype=np.int64)])


def _make_data(s: Settings, out: str) -> None:
    """Resident keys and the two find streams for each size, saved for the children."""
    m = s.find_batches * s.batch
    for n in s.sizes:
        rng = np.random.default_rng([s.seed, n])
        resident = _distinct_keys(rng, n)
        np.save(os.path.join(out, f"resident_{n}.npy"), resident)
        np.save(os.path.join(out, f"find_uniform_{n}.npy"), resident[rng.integers(0, n, m)])
        cdf = np.cumsum(np.arange(1, n + 1, dtype=np.float64) ** -s.zipf_s)
        cdf /= cdf[-1]
        ranks = np.minimum(np.searchsorted(cdf, rng.random(m), side="right"), n - 1)
        perm = rng.permutation(n)
        np.save(os.path.join(out, f"find_zipf_{n}.npy"), resident[perm[ranks]])


def _peak_bytes(impl: str, n: int, dim: int, s: Settings) -> int:
    """A generous estimate of a child's peak memory, to skip what cannot fit."""
    row = 4 * dim
    data = n * 8 * 3 + 2 * s.find_batches * s.batch * 8 * 2
    if impl == "kvcoll":
        table = n * (16 + row) * 1.1 + n / 0.56 * 4 * 2.5
    elif impl == "dense":
        buckets = 2 ** math.ceil(math.log2(n / 0.8))
        table = buckets * 1.5 * (8 + row)
    elif impl == "mutable":
        table = n * (row + 160) * 1.5
    else:
        table = n * (2 * row + 200)
    return int(table + data + (600 << 20))


def _skipped(impl, n, dim, op, dist, reason) -> dict:
    return {"impl": impl, "op": op, "resident_keys": n, "dim": dim, "dist": dist,
            "keys_per_sec": None, "bytes_per_row": None, "skipped": reason}


def measure(s: Settings) -> list[dict]:
    """Run every configuration of s; return the records (with machine and ratios)."""
    cpu = s.cpu if s.cpu >= 0 else common.default_cpu()
    machine = common.machine_info()
    machine["measured_on_cpu"] = cpu
    gathers = [_gather(s, cpu)]
    records = []
    data = tempfile.mkdtemp(prefix="kvbench-table-")
    try:
        _log(f"making keys for {s.sizes} resident keys")
        _make_data(s, data)
        for n in s.sizes:
            for dim in s.dims:
                for impl in s.impls:
                    records += _run_one(s, impl, n, dim, cpu, data)
    finally:
        shutil.rmtree(data, ignore_errors=True)
    gathers.append(_gather(s, cpu))

    # the roofline is what the machine can do: the better of the two measurements
    machine["gather_buffer_bytes"] = s.gather_bytes
    for key, pages in (("gather_64b_per_sec", "4k"), ("gather_64b_per_sec_hugepages", "huge")):
        seen = [g[pages]["per_sec"] for g in gathers if pages in g]
        machine[key] = max(seen) if seen else None
        machine[key + "_each"] = seen
    errors = [g["error"] for g in gathers if "error" in g]
    if errors:
        machine["gather_error"] = "; ".join(errors)
    busy = [r["others_busy_cores"] for r in records if "others_busy_cores" in r]
    machine["others_busy_cores_max"] = max(busy) if busy else None

    for r in records:
        r["machine"] = machine
        r["command"] = _command(s)
    _add_ratios(records, machine)
    return records


def _gather(s: Settings, cpu: int) -> dict:
    _log(f"random 64-byte gathers over {s.gather_bytes >> 20} MiB on CPU {cpu}")
    common.wait_until_quiet(s.quiet_wait)
    g = common.measure_gather(buffer_bytes=s.gather_bytes, gathers=s.gathers,
                              reps=s.gather_reps, cpu=cpu)
    _log("gathers/s: " + ", ".join(f"{g[p]['per_sec'] / 1e6:.1f} M ({p} pages)"
                                   for p in ("4k", "huge") if p in g)
         + (f"; {g['error']}" if "error" in g else ""))
    return g


def _run_one(s: Settings, impl: str, n: int, dim: int, cpu: int, data: str) -> list[dict]:
    wanted = [("insert", "uniform")] + [("find", d) for d in DISTS]
    need, avail = _peak_bytes(impl, n, dim, s), common.mem_available()
    if need > 0.9 * avail:
        reason = (f"needs about {need / 2**30:.1f} GiB, {avail / 2**30:.1f} GiB available")
        _log(f"{impl} n={n} dim={dim}: skipped, {reason}")
        return [_skipped(impl, n, dim, op, d, reason) for op, d in wanted]
    spec = {"impl": impl, "n": n, "dim": dim, "batch": s.batch, "cpu": cpu, "data": data,
            "insert_reps_upto": s.insert_reps_upto, "min_seconds": s.min_seconds}
    busy = common.wait_until_quiet(s.quiet_wait)
    t0 = time.perf_counter()
    got, error = common.run_child("bench.table_bench:table_child", spec, s.timeout)
    for r in got:
        r["others_busy_cores"] = round(busy, 2)
    for r in got:
        _log(f"{impl:8} n={n:>9,} dim={dim:3} {r['op']:6} {r['dist']:7} "
             f"{r['keys_per_sec'] / 1e6:8.2f} M keys/s  ({r['mode']})  "
             f"{r['bytes_per_row']:.1f} B/row overhead")
    _log(f"{impl} n={n} dim={dim}: {time.perf_counter() - t0:.0f} s"
         + (f", {error}" if error else ""))
    done = {(r["op"], r["dist"]) for r in got}
    return got + [_skipped(impl, n, dim, op, d, error or "no result")
                  for op, d in wanted if (op, d) not in done]


def _command(s: Settings) -> str:
    return "./dev bench table" + (" --quick" if s.quick else "")


def _add_ratios(records: list[dict], machine: dict) -> None:
    dense = {(r["op"], r["resident_keys"], r["dim"], r["dist"]): r["keys_per_sec"]
             for r in records if r["impl"] == "dense" and r.get("keys_per_sec")}
    half = (machine.get("gather_64b_per_sec") or 0) / 2
    half_huge = (machine.get("gather_64b_per_sec_hugepages") or 0) / 2
    for r in records:
        if not r.get("keys_per_sec"):
            continue
        d = dense.get((r["op"], r["resident_keys"], r["dim"], r["dist"]))
        r["vs_dense"] = r["keys_per_sec"] / d if d else None
        if r["impl"] == "kvcoll" and r["op"] == "find":
            if half:
                r["fraction_of_half_gather"] = r["keys_per_sec"] / half
            if half_huge:  # kvcoll asks for huge pages for its index and rows
                r["fraction_of_half_gather_hugepages"] = r["keys_per_sec"] / half_huge


# -- the report ----------------------------------------------------------------------------

def _fmt_n(n: int) -> str:
    return f"{n // 1_000_000}M" if n % 1_000_000 == 0 else f"{n // 1000}k"


def _mkeys(r) -> str:
    if r is None or not r.get("keys_per_sec"):
        return "skipped"
    return f"{r['keys_per_sec'] / 1e6:.2f}" + ("*" if r.get("mode") == "tf.function" else "")


def _targets(records: list[dict]) -> tuple[list[tuple[str, str, str]], str]:
    """(target, measured, verdict) rows, and a note on the size they were checked at."""
    kv = [r for r in records if r["impl"] == "kvcoll" and r.get("keys_per_sec")]
    if not kv:
        return [], "kvcoll produced no results"
    n = max(r["resident_keys"] for r in kv)
    note = "" if n >= 10_000_000 else \
        f" (checked at {_fmt_n(n)} resident keys: not the target size)"
    find = next((r for r in kv if r["op"] == "find" and r["resident_keys"] == n
                 and r["dim"] == 16 and r["dist"] == "uniform"), None)
    rows = []

    def verdict(ok):
        return "met" if ok else "**missed**"
    if find:
        rate = find["keys_per_sec"] / 1e6
        rows.append((f"find, dim 16, {_fmt_n(n)} resident, uniform: >= 20 M keys/s",
                     f"{rate:.1f} M keys/s", verdict(rate >= 20)))
        vs = find.get("vs_dense")
        rows.append(("... and >= 5x DenseHashTable in the same run",
                     f"{vs:.1f}x" if vs else "n/a", verdict(vs is not None and vs >= 5)))
        fr, frh = find.get("fraction_of_half_gather"), find.get("fraction_of_half_gather_hugepages")
        if fr or frh:
            rows.append(("... as a fraction of half the gather rate, 4 KiB (huge) pages",
                         f"{fr or 0:.2f} ({frh or 0:.2f})", "reported"))
    ins = [r.get("vs_dense") for r in kv if r["op"] == "insert"]
    if ins and all(v is not None for v in ins):
        rows.append(("insert >= 5x DenseHashTable (every size and dim)",
                     f"{min(ins):.1f}x to {max(ins):.1f}x", verdict(min(ins) >= 5)))
    over = [r["bytes_per_row"] for r in kv if r["op"] == "insert"]
    rows.append(("<= 24 bytes of overhead per row (every size and dim)",
                 f"{min(over):.1f} to {max(over):.1f} B", verdict(max(over) <= 24)))
    return rows, note


def markdown(records: list[dict]) -> str:
    m = records[0]["machine"]
    by = {(r["impl"], r["op"], r["resident_keys"], r["dim"], r["dist"]): r for r in records}
    impls = [i for i in IMPLS if any(r["impl"] == i for r in records)]
    sizes = sorted({r["resident_keys"] for r in records})
    dims = sorted({r["dim"] for r in records})
    g4, gh = m.get("gather_64b_per_sec"), m.get("gather_64b_per_sec_hugepages")
    out = [
        "### Table benchmark",
        "",
        (f"`{records[0]['command']}` (`python -m bench table`), {m['date']}. One core: "
         f"every measurement pinned to CPU {m['measured_on_cpu']}, TensorFlow intra/inter-op "
         "threads = 1."),
        (f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory_gib']} GiB, Linux {m['kernel']} "
         f"(THP {m['transparent_hugepages']}); Python {m['python']}, numpy {m['numpy']}, "
         f"TensorFlow {m['tensorflow']}."),
        "Random 64-byte gathers on that core: "
        + (f"**{g4 / 1e6:.1f} M/s** over {m['gather_buffer_bytes'] >> 20} MiB with 4 KiB pages"
           if g4 else "not measured")
        + (f" ({gh / 1e6:.1f} M/s with transparent huge pages)." if gh else ".")
        + " A lookup reads two dependent random lines (index slot, then row), so half the "
        "gather rate is its roofline; kvcoll backs its index and rows with huge pages, "
        "so the huge-page ratio is the like-for-like one.",
        _load_line(m),
        "",
        ("Million keys per second, batches of 65,536 keys. find: best of at least 3 "
         "passes over the same batches; insert: filling an empty table, best of 3 fills "
         "up to 1M keys and of 2 above:"),
        "",
        "| op | resident keys | dim | keys | " + " | ".join(LABELS[i] for i in impls)
        + " | kvcoll / Dense | kvcoll / (gather / 2), 4 KiB (huge) pages |",
        "|---|---:|---:|---|" + "---:|" * (len(impls) + 2),
    ]
    for op in ("find", "insert"):
        for n in sizes:
            for dim in dims:
                for dist in (DISTS if op == "find" else ("uniform",)):
                    cells = [_mkeys(by.get((i, op, n, dim, dist))) for i in impls]
                    kv = by.get(("kvcoll", op, n, dim, dist)) or {}
                    vs = kv.get("vs_dense")
                    fr = kv.get("fraction_of_half_gather")
                    frh = kv.get("fraction_of_half_gather_hugepages")
                    label = {"uniform": "uniform", "zipf": "Zipf(1.1)"}[dist] \
                        if op == "find" else "fresh"
                    vs = f"{vs:.1f}x" if vs else "-"
                    fr = (f"{fr:.2f}" if fr else "-") + (f" ({frh:.2f})" if frh else "")
                    out.append(f"| {op} | {_fmt_n(n)} | {dim} | {label} | "
                               + " | ".join(cells) + f" | {vs} | {fr} |")
    floor = (" DenseHashTable's bucket arrays alone, in parentheses, are a floor under its "
             "estimate, which also counts what the allocator keeps after each growth step."
             if "dense" in impls else "")
    out += ["", ("Bytes per row beyond the row's own floats (kvcoll: KvTable.stats(); "
                 "others: RSS growth over the fill minus keys x dim x 4, an estimate)."
                 + floor), "",
            "| resident keys | dim | " + " | ".join(LABELS[i] for i in impls) + " |",
            "|---:|---:|" + "---:|" * len(impls)]
    for n in sizes:
        for dim in dims:
            cells = []
            for i in impls:
                r = by.get((i, "insert", n, dim, "uniform"))
                if not r or r.get("bytes_per_row") is None:
                    cells.append("skipped")
                elif r.get("bytes_per_row_arrays") is not None:
                    cells.append(f"{r['bytes_per_row']:.1f} ({r['bytes_per_row_arrays']:.1f})")
                else:
                    cells.append(f"{r['bytes_per_row']:.1f}")
            out.append(f"| {_fmt_n(n)} | {dim} | " + " | ".join(cells) + " |")
    rows, note = _targets(records)
    if rows:
        out += ["", f"Targets{note}:", "", "| target | measured | |", "|---|---:|---|"]
        out += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    skipped = [r for r in records if r.get("skipped")]
    out += ["", "Notes:", "",
            ("- TF tables are timed eagerly and through a tf.function with an input "
             "signature; the faster is shown, marked * where that was the tf.function. "
             "Their batches are converted to tensors before timing."),
            ("- insert: kvcoll find_or_create (returns the rows); TF insert(keys, values); "
             "dict: a per-key Python loop assigning row indices, then one numpy write of the "
             "rows into an array that doubles when full. Fills include every growth step."),
            ("- Each fill's time is in the JSON (fill_seconds, in order). On this VM the "
             "first fill of fresh memory can be up to 2x slower than the next (likely the "
             "kernel and hypervisor backing untouched pages on first use)"
             + _first_fill_note(records) + "."),
            ("- Resident keys are distinct random int64; find streams draw from them "
             "(uniform, or Zipf(1.1) over a random rank order). Everyone reads the same "
             "batches.")]
    for (impl, n, dim, reason), group in _group_skipped(skipped).items():
        what = ", ".join(f"{op} {dist}" if op == "find" else op for op, dist in group)
        out.append(f"- skipped: {LABELS[impl]}, {_fmt_n(n)} resident, dim {dim} "
                   f"({what}): {reason}")
    return "\n".join(out) + "\n"


def _first_fill_note(records: list[dict]) -> str:
    """kvcoll / Dense on the first fill alone, at the largest size."""
    ins = {r["impl"]: r for r in records if r["op"] == "insert" and r.get("fill_seconds")}
    sizes = sorted({r["resident_keys"] for r in ins.values()})
    parts = []
    for n in sizes[-1:]:
        for dim in sorted({r["dim"] for r in records}):
            kv = next((r for r in records if r["impl"] == "kvcoll" and r["op"] == "insert"
                       and r["resident_keys"] == n and r["dim"] == dim
                       and r.get("fill_seconds")), None)
            de = next((r for r in records if r["impl"] == "dense" and r["op"] == "insert"
                       and r["resident_keys"] == n and r["dim"] == dim
                       and r.get("fill_seconds")), None)
            if kv and de:
                parts.append(f"dim {dim}: {de['fill_seconds'][0] / kv['fill_seconds'][0]:.1f}x")
    return (f"; kvcoll / Dense on first fills alone at {_fmt_n(sizes[-1])}: "
            + ", ".join(parts)) if parts else ""


def _load_line(m: dict) -> str:
    busy = m.get("others_busy_cores_max")
    if busy is None:
        return ""
    if busy < 0.3:
        return f"Other processes used at most {busy:.2f} CPUs before each measurement."
    return (f"**Other processes kept up to {busy:.1f} CPUs busy** during the run: the "
            "numbers are lower bounds (see others_busy_cores in the JSON).")


def _group_skipped(skipped: list[dict]) -> dict:
    groups: dict = {}
    for r in skipped:
        key = (r["impl"], r["resident_keys"], r["dim"], r["skipped"])
        groups.setdefault(key, []).append((r["op"], r["dist"]))
    return groups


# -- command line --------------------------------------------------------------------------

def add_arguments(p) -> None:
    """The table benchmark's flags (each overrides the preset chosen by --quick)."""
    def ints(text):
        return tuple(int(float(x)) for x in text.split(","))
    p.add_argument("--sizes", type=ints, help="resident keys, comma-separated (1e6,1e7)")
    p.add_argument("--dims", type=ints, help="embedding dims, comma-separated (16,64)")
    p.add_argument("--impls", type=lambda t: tuple(t.split(",")),
                   help=f"contenders, comma-separated, from {','.join(IMPLS)}")
    p.add_argument("--find-batches", type=int, help="batches of 65,536 keys per find pass")
    p.add_argument("--gather-mib", type=int, help="buffer of the gather measurement, MiB")
    p.add_argument("--timeout", type=float, help="seconds per contender, size and dim")
    p.add_argument("--cpu", type=int, help="the CPU to pin measurements to (default: last)")
    p.add_argument("--quiet-wait", type=float,
                   help="seconds to wait at most, before each measurement, for other "
                        "processes to leave the CPUs idle (default 10; --quick 0)")


def settings_from(args) -> Settings:
    kw = {}
    for field in ("sizes", "dims", "impls", "find_batches", "timeout", "cpu", "quiet_wait"):
        if getattr(args, field, None) is not None:
            kw[field] = getattr(args, field)
    if getattr(args, "gather_mib", None) is not None:
        kw["gather_bytes"] = args.gather_mib << 20
    for i in kw.get("impls", ()):
        if i not in IMPLS:
            raise SystemExit(f"--impls: {i!r} is unknown; use some of {','.join(IMPLS)}")
    return Settings.smoke(**kw) if args.quick else Settings.full(**kw)


def run(args) -> None:
    """Measure, print the markdown table, write <out>/table.json and table.md."""
    s = settings_from(args)
    out_dir = args.out or (tempfile.mkdtemp(prefix="kvbench-quick-") if s.quick
                           else common.RESULTS)
    t0 = time.perf_counter()
    records = measure(s)
    md = markdown(records)
    jpath, mpath = common.write_results(out_dir, "table", records, md)
    print(md)
    _log(f"{time.perf_counter() - t0:.0f} s; wrote {jpath} and {mpath}")
