#!/usr/bin/env python3
"""Atheris (libFuzzer) target for the checkpoint shard-file readers (kvcoll._shards and
how kvcoll.checkpoint's restore uses them).

An input is a 24-byte header and a payload. The header's first byte picks what the
payload is and which reader gets it; the rest says what the manifest records (dim and
row optimizer of the table, writer's and reader's world and rank, whether the reader's
owner map is the even one, bucket count, rows, removed keys, index bytes):

    0  a format-3 shard file, restored through checkpoint._Replay (pass 1 reads the
       index and verifies every page, pass 2 replays into a KvTable), by a reader whose
       owner map is even or not (the model's bucket count from the header)
    1  a shard file of any format, through read_shard (no manifest)
    2  a format-1 shard file, restored through checkpoint._V1Load
    3  a format-1 admission-state file, through checkpoint._read_admission, then
       KvTable.import_admission
    4  a manifest.json beside valid shard files, through Checkpointer._load and apply
    5  a format-2 shard file (version 2 checkpoints), restored through _Replay

Restore checks the sha256 of every file, index and page before it parses them; the
harness recomputes those hashes over the mutated bytes (what a buggy writer or a
deliberately altered file gives), so the parsers are what is fuzzed. The contract: a
reader either accepts the input, and then replay never fails (and, on one rank, the
table holds what read_shard reads), or it raises CheckpointError naming the file.
Another exception type, a hang or a huge allocation is a crash. For a manifest (4) the
exceptions restore() turns into a CheckpointError on every rank (OSError, ValueError,
KeyError, TypeError) are allowed too.

    python tests/fuzz/fuzz_shards.py -max_total_time=30 CORPUS_DIR   # fuzz
    python tests/fuzz/fuzz_shards.py --seeds DIR                      # write the seeds
    python tests/fuzz/fuzz_shards.py CRASH_FILE                       # replay one input

`./dev test` runs it for FUZZ_SECONDS from the corpus in tests/fuzz/corpus/shards.tar.gz;
`./dev fuzz-save` repacks that corpus, grown by the last run.
"""

from __future__ import annotations

import atexit
import glob
import hashlib
import json
import os
import shutil
import struct
import sys
import tempfile
import types

import numpy as np

try:
    import atheris
except ImportError:  # seeds and the unit tests' replays need no fuzzer
    atheris = None

if atheris is not None and __name__ == "__main__":
    with atheris.instrument_imports(include=["kvcoll"]):  # coverage of kvcoll only
        from kvcoll import _shards, checkpoint as ck, optimizers
else:
    from kvcoll import _shards, checkpoint as ck, optimizers
from kvcoll.errors import CheckpointError  # noqa: E402
from kvcoll.routing import BUCKETS, OwnerMap  # noqa: E402
from kvcoll.table import KvTable  # noqa: E402

V3_RESTORE, READ, V1_RESTORE, ADMISSION, MANIFEST, V2_RESTORE = range(6)
MODES = 6
FIXTURE_V2 = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "unit",
                          "data", "ckpt_v2", "ckpt-0000000002")
# mode, worlds (writer's in bits 0-1, reader's in bits 2-3, as 1 + value), ranks (writer's
# in bits 0-3, reader's in bits 4-7, mod the world), optimizer, dim, map (bit 0: the
# reader's owner map is not the even one), buckets (format 3: the model's, 0 or more
# than 65536 meaning 65536; format 2: the file's), rows, removed, index bytes
HEAD = struct.Struct("<BBBBHHIIII")
OPTIMIZERS = (optimizers.SGD(0.1), optimizers.Adagrad(0.1), optimizers.Adam(0.01))
CKPT = "ckpt-0000000001"
FNAME = "000-t.r0-of-1.kvs"
BLOOM_COUNTERS = 256


def _work_dir() -> str:
    """A work directory in tmpfs, named after this process. libFuzzer ends the process
    without atexit's handlers, so the directories of runs whose process is gone are
    removed here (they piled up in /dev/shm, one a run)."""
    where = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    for old in glob.glob(os.path.join(where, "kvcoll-fuzz-*")):
        pid = os.path.basename(old).split("-")[2]
        if not (pid.isdigit() and os.path.exists(f"/proc/{pid}")):
            shutil.rmtree(old, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"kvcoll-fuzz-{os.getpid()}-", dir=where)


_WORK = _work_dir()
atexit.register(shutil.rmtree, _WORK, True)   # (when the process ends through Python)
_TABLES: dict = {}


class Mismatch(AssertionError):
    """An accepted input that replays to something other than what read_shard reads."""


def _table(opt: int, dim: int, admit: int = 0) -> KvTable:
    key = (opt % len(OPTIMIZERS), dim, admit)
    if key not in _TABLES:
        kw = {}
        if admit:
            kw = dict(admit_min_count=2, admit="bloom" if admit == 2 else "exact",
                      bloom_counters=BLOOM_COUNTERS if admit == 2 else 0)
        _TABLES[key] = KvTable(dim, name="t", optimizer=OPTIMIZERS[key[0]], **kw)
    t = _TABLES[key]
    t.clear()
    return t


def _fresh_dir() -> str:
    d = os.path.join(_WORK, CKPT)
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    return d


def _worlds(head) -> tuple:
    """(writer's rank, writer's world, reader's rank, reader's world)."""
    ww, rw = 1 + (head[1] & 3), 1 + ((head[1] >> 2) & 3)
    return head[2] % 16 % ww, ww, (head[2] >> 4) % rw, rw


def _expect_named(exc: Exception, path: str) -> None:
    if not isinstance(exc, CheckpointError):
        raise exc
    if path not in str(exc):
        raise AssertionError(f"CheckpointError without the file's name: {exc}") from exc


def _model_buckets(head) -> int:
    return head[6] if 1 <= head[6] <= BUCKETS else BUCKETS


def _reader_map(head) -> OwnerMap:
    """The reader's owner map: the even one, or (map bit) one that is not."""
    _, _, _, rw = _worlds(head)
    b = _model_buckets(head)
    return OwnerMap.even(rw + 1, b).without([0]) if head[5] & 1 else OwnerMap.even(rw, b)


def _shard_info(data: bytes, head, version: int = 3) -> dict:
    _, _, _, _, _, _, buckets, rows, removed, index_bytes = head
    wr, ww = _worlds(head)[:2]
    offset = len(data) - index_bytes
    tail = data[offset:] if 0 <= offset <= len(data) else b""
    info = {"bytes": len(data), "rows": rows, "removed": removed,
            "table": "t", "rank": wr, "world": ww,
            "index": {"offset": offset, "bytes": index_bytes,
                      "sha256": hashlib.sha256(tail).hexdigest()}}
    if version == 2:
        info["buckets"] = buckets
    return info


def _manifest(files: dict, table: KvTable, version: int = 3, world: int = 1,
              buckets: int = BUCKETS, **extra) -> dict:
    m = {"format": ck.FORMAT, "version": version, "kind": "full", "step": 1,
         "world_size": world,
         "tables": {"t": dict(ck._table_spec(table), files=sorted(files))}, "files": files}
    if version >= 3:
        m["buckets"] = buckets
        m["owners"] = OwnerMap.even(world, buckets).to_json()
    m.update(extra)
    return m


def _restore_v2(data: bytes, head) -> None:
    _restore(data, head, 2)


def _restore_v3(data: bytes, head) -> None:
    _restore(data, head, 3)


def _restore(data: bytes, head, version: int) -> None:
    t = _table(head[3], 1 + head[4] % 16)
    _, ww, rr, rw = _worlds(head)
    d = _fresh_dir()
    path = os.path.join(d, FNAME)
    with open(path, "wb") as f:
        f.write(data)
    owners = _reader_map(head) if version >= 3 else OwnerMap.even(rw)
    m = dict(_manifest({FNAME: _shard_info(data, head, version)}, t, version, ww,
                       owners.buckets), _name=CKPT)
    comm = types.SimpleNamespace(rank=rr, size=rw)
    try:
        replay = ck._Replay(_WORK, [m], {"t": t}, comm, ck.MIN_RESTORE_BUFFER, 0, owners)
    except Exception as exc:  # noqa: BLE001 - the contract is on the type
        _expect_named(exc, path)
        return
    try:
        replay.apply()  # verified: must not fail
    finally:
        replay.close()
    if not any(p.paths for p in replay.plans):  # its writer owned none of our buckets
        if len(t):
            raise Mismatch(f"{len(t)} rows restored from no file")
    elif rw == 1:
        _same_as_read_shard(t, path)


def _same_as_read_shard(t: KvTable, path: str) -> None:
    """On one rank a small file is one group: every removal, then every row in file
    order, the last of a key winning; read_shard must accept what restore accepted."""
    want = _shards.read_shard(path)
    keys, last = np.unique(want["keys"][::-1], return_index=True)
    last = want["keys"].size - 1 - last
    got = t.export()
    order = np.argsort(got["keys"])
    if not np.array_equal(got["keys"][order], keys):
        raise Mismatch(f"restored keys {got['keys'][order]} != read_shard's {keys}")
    for k in ("values", "slots", "last_step", "counts"):
        if not np.array_equal(got[k][order], want[k][last]):
            raise Mismatch(f"restored {k} differ from read_shard's")


def _read(data: bytes, head) -> None:
    path = os.path.join(_fresh_dir(), FNAME)
    with open(path, "wb") as f:
        f.write(data)
    try:
        a = _shards.read_shard(path)
    except Exception as exc:  # noqa: BLE001
        _expect_named(exc, path)
        return
    n = a["keys"].size
    assert a["values"].shape[0] == a["slots"].shape[0] == a["last_step"].size == \
        a["counts"].size == n, {k: v.shape for k, v in a.items()}


def _restore_v1(data: bytes, head) -> None:
    t = _table(head[3], 1 + head[4] % 16)
    wr, ww, rr, rw = _worlds(head)
    d = _fresh_dir()
    fname = FNAME.replace(".kvs", ".npy")
    path = os.path.join(d, fname)
    with open(path, "wb") as f:
        f.write(data)
    info = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "table": "t",
            "rank": wr, "world": ww}
    m = dict(_manifest({fname: info}, t, version=1), _name=CKPT)
    comm = types.SimpleNamespace(rank=rr, size=rw)
    try:
        load = ck._V1Load(_WORK, [m], {"t": t}, comm, 0)
    except Exception as exc:  # noqa: BLE001
        _expect_named(exc, path)
        return
    load.apply()


def _admission(data: bytes, head) -> None:
    admit = 1 + (head[3] & 1)
    t = _table(0, 1 + head[4] % 16, admit)
    wr, ww, rr, rw = _worlds(head)
    d = _fresh_dir()
    fname = FNAME + ".adm"
    path = os.path.join(d, fname)
    with open(path, "wb") as f:
        f.write(data)
    info = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data), "table": "t",
            "rank": wr, "world": ww, "rows": 0, "admission": True}
    m = {"_name": CKPT, "version": 3, "world_size": ww, "buckets": BUCKETS,
         "owners": OwnerMap.even(ww).to_json(), "tables": {"t": {"admission": [fname]}},
         "files": {fname: info}}
    comm = types.SimpleNamespace(rank=rr, size=rw)
    try:
        states = ck._read_admission(_WORK, m, {"t": t}, comm)
    except Exception as exc:  # noqa: BLE001
        _expect_named(exc, path)
        return
    for name, state in states.items():  # what restore() does next: must not fail
        _TABLES[(0, t.dim, admit)].import_admission(state, merge=state.pop("merge"))


_SHARD_FILES: dict = {}


def _manifest_case(data: bytes, head) -> None:
    """data is the manifest of ckpt-0000000002 (a delta, or a full one); CKPT beside it
    is a valid full checkpoint of one format-2 file."""
    t = _table(head[3], 1 + head[4] % 16)
    _, _, rr, rw = _worlds(head)
    key = (head[3] % len(OPTIMIZERS), t.dim)
    d = _fresh_dir()
    if key not in _SHARD_FILES:
        data0, info = _valid_v3(t.dim, t.slot_floats, seed=1)
        _SHARD_FILES[key] = (data0, json.dumps(_manifest({FNAME: info}, t)).encode())
    data0, m0 = _SHARD_FILES[key]
    with open(os.path.join(d, FNAME), "wb") as f:
        f.write(data0)
    with open(os.path.join(d, ck.MANIFEST), "wb") as f:
        f.write(m0)
    d2 = os.path.join(_WORK, "ckpt-0000000002")
    shutil.rmtree(d2, ignore_errors=True)
    os.makedirs(d2)
    with open(os.path.join(d2, FNAME), "wb") as f:
        f.write(data0)
    with open(os.path.join(d2, ck.MANIFEST), "wb") as f:
        f.write(data)
    cp = ck.Checkpointer({"t": t}, types.SimpleNamespace(rank=rr, size=rw))
    try:
        loaded = cp._load(_WORK, "ckpt-0000000002", ck.MIN_RESTORE_BUFFER)
    except (CheckpointError, OSError, ValueError, KeyError, TypeError):
        return  # what restore() reports on every rank as a CheckpointError
    try:
        loaded.apply()
    finally:
        loaded.close()


CASES = {V3_RESTORE: _restore_v3, READ: _read, V1_RESTORE: _restore_v1,
         ADMISSION: _admission, MANIFEST: _manifest_case, V2_RESTORE: _restore_v2}


def check(data: bytes) -> None:
    """Run one input; raises (anything but a clean rejection) if it breaks the contract."""
    if len(data) < HEAD.size:
        return
    head = HEAD.unpack_from(data)
    CASES[head[0] % MODES](data[HEAD.size:], head)


# -- seeds ---------------------------------------------------------------------------------

def _rows(n: int, dim: int, sf: int, rng) -> dict:
    keys = rng.choice(np.concatenate([rng.integers(-2**63, 2**63 - 1, n, dtype=np.int64),
                                      np.arange(n, dtype=np.int64)]), n, replace=False)
    return {"keys": keys, "values": rng.normal(size=(n, dim)).astype(np.float32),
            "slots": rng.random((n, sf)).astype(np.float32),
            "last_step": rng.integers(0, 100, n).astype(np.uint32),
            "counts": rng.integers(0, 100, n).astype(np.uint32)}


def _valid_v3(dim: int, sf: int, seed: int, n: int = 8, removed: int = 3,
              buckets: int = BUCKETS):
    rng = np.random.default_rng(seed)
    path = os.path.join(_WORK, f"seed-{seed}.kvs")
    if os.path.exists(path):
        os.unlink(path)
    info = _shards.write_shard(path, _rows(n, dim, sf, rng),
                               rng.integers(-2**63, 2**63 - 1, removed, dtype=np.int64),
                               buckets)
    with open(path, "rb") as f:
        data = f.read()
    os.unlink(path)
    return data, dict(info, table="t", rank=0, world=1)


def seeds() -> dict:
    """{name: input}: valid files of a few dims, optimizers, bucket counts and maps, and
    the format-2 files of tests/unit/data/ckpt_v2."""
    out = {}
    for i, (opt, dim, buckets, n, rem) in enumerate(
            [(0, 4, 0, 6, 2), (1, 3, 6, 10, 3), (2, 2, 30, 12, 0), (0, 1, 0, 0, 4)]):
        t = _table(opt, dim)
        data, info = _valid_v3(dim, t.slot_floats, seed=i, n=n, removed=rem,
                               buckets=buckets or BUCKETS)
        # written on 1 rank; read on 1, on 2 (even), on 2 (a map that is not even)
        for mode, world, uneven in ((V3_RESTORE, 0, 0), (V3_RESTORE, 1 << 2, 0),
                                    (V3_RESTORE, 1 << 2, 1), (READ, 0, 0)):
            out[f"v3-{mode}-{world}-{uneven}-{i}"] = HEAD.pack(
                mode, world, 0, opt, dim - 1, uneven, buckets, info["rows"], info["removed"],
                info["index"]["bytes"]) + data
        rng = np.random.default_rng(i)
        r = _rows(n, dim, t.slot_floats, rng)
        path = os.path.join(_WORK, "seed.npy")
        for mode, arrays in (
                (V1_RESTORE, [r["keys"], r["values"], r["slots"], r["last_step"],
                              r["counts"], rng.integers(0, 9, rem, dtype=np.int64)]),
                (ADMISSION, [r["keys"][:0], r["counts"][:0], r["last_step"][:0],
                             np.full(BLOOM_COUNTERS // 2, 0x21, np.uint8),
                             np.array([n], np.int64)] if opt & 1 else
                 [r["keys"], r["counts"], r["last_step"], np.zeros(0, np.uint8),
                  np.array([0], np.int64)])):
            if os.path.exists(path):
                os.unlink(path)
            _shards.write_shard_v1(path, arrays)
            with open(path, "rb") as f:
                out[f"v1-{mode}-{i}"] = HEAD.pack(mode, 0, 0, opt, dim - 1, 0, 0, 0, 0, 0) + \
                    f.read()
        os.unlink(path)
    for i, (opt, dim) in enumerate([(0, 4), (1, 3)]):
        t = _table(opt, dim)
        data, info = _valid_v3(dim, t.slot_floats, seed=1)  # the file _manifest_case writes
        for kind in ("full", "delta"):
            extra = {"parent": CKPT} if kind == "delta" else {}
            m = _manifest({FNAME: info}, t, kind=kind, step=2, **extra)
            out[f"manifest-{kind}-{i}"] = HEAD.pack(MANIFEST, 0, 0, opt, dim - 1, 0, 0, 0, 0,
                                                    0) + json.dumps(m, indent=1).encode()
    with open(os.path.join(FIXTURE_V2, ck.MANIFEST)) as f:
        m2 = json.load(f)
    for fname, table in (("003-d.r0-of-2.kvs", "d"), ("003-d.r1-of-2.kvs", "d")):  # small
        info = m2["files"][fname]
        opt = {"adagrad": 1}[m2["tables"][table]["optimizer"]]
        dim = m2["tables"][table]["dim"]
        with open(os.path.join(FIXTURE_V2, fname), "rb") as f:
            data = f.read()
        for world in (1 | 1 << 2, 1 | 2 << 2):  # written on 2; read on 2 and 3
            out[f"v2-{fname}-{world}"] = HEAD.pack(
                V2_RESTORE, world, info["rank"], opt, dim - 1, 0, info["buckets"],
                info["rows"], info["removed"], info["index"]["bytes"]) + data
    return out


def _compare_numpy_here():
    """A fuzz target that runs check() with numpy comparisons done here, not by atheris.

    atheris' comparison hook keeps a reference to every result that is not a Python
    bool (measured: each `array == x` in an instrumented module leaked its result, 64
    KiB for an owner map, and a run ran out of memory within a minute). The
    instrumented code looks the hook up on the atheris module at every comparison, and
    atheris sets it again when fuzzing starts, so the target puts ours back before
    each input. op is COMPARE_OP's argument (already reversed when atheris swapped the
    operands)."""
    import operator

    from atheris.version_dependent import CMP_OP_SHIFT_AMOUNT

    ops = (operator.lt, operator.le, operator.eq, operator.ne, operator.gt, operator.ge)
    native = []

    def trace_cmp(a, b, op, counter, is_const):
        if isinstance(a, (np.ndarray, np.generic)) or isinstance(b, (np.ndarray, np.generic)):
            return ops[op >> CMP_OP_SHIFT_AMOUNT](a, b)
        return native[0](a, b, op, counter, is_const)

    def target(data: bytes) -> None:
        if atheris._trace_cmp is not trace_cmp:
            native[:] = [atheris._trace_cmp]
            atheris._trace_cmp = trace_cmp
        check(data)
    return target


def main(argv: list) -> None:
    if len(argv) == 3 and argv[1] == "--seeds":
        os.makedirs(argv[2], exist_ok=True)
        for name, data in seeds().items():
            with open(os.path.join(argv[2], name), "wb") as f:
                f.write(data)
        return
    atheris.Setup(argv, _compare_numpy_here())
    atheris.Fuzz()


if __name__ == "__main__":
    try:
        main(sys.argv)
    finally:
        shutil.rmtree(_WORK, ignore_errors=True)
