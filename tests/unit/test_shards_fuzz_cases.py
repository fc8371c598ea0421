"""What the shard-file fuzzer (tests/fuzz/fuzz_shards.py) found, one test per input
class: each corrupt-but-rehashed file must raise CheckpointError naming the file
(never IndexError, struct.error, numpy's ValueError, a TokenError, or an error from
the table half-way through a restore). The first two replay minimized fuzzer inputs
through the harness; the others build the same corruption from a valid file."""

import ast
import base64
import hashlib
import io
import json
import sys
import time
import types
from pathlib import Path

import numpy as np
import pytest

import kvcoll.checkpoint as ck
from kvcoll import _shards, optimizers
from kvcoll.errors import CheckpointError
from kvcoll.routing import BUCKETS, OwnerMap
from kvcoll.table import KvTable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "fuzz"))
import fuzz_shards as fz  # noqa: E402

CKPT = "ckpt-0000000001"


@pytest.mark.parametrize("b64", [
    # read_shard: a trailer whose index offset lies past the end (struct.error)
    "AQAAAAAAAAABAAAAAAAAAAQAAAAYAQAAa3Zjb2xsLXNoYXJkLTIKACAAAAAAAP////8AAAAAAAA=",
    # admission file: a .npy header numpy's tokenizer cannot read (TokenError)
    "AwAAAQIAAf//////////AEEAAAAAAAAAk05VTVBZAQB2AHsnAAAgICAgICAgICAgICAgICAgICAgICAgI"
    "CAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICAgICA"
    "gICAgICAgICAgICAgCgoAEAAAAAAAICAgICAKCgAQAAAAAAA=",
])
def test_minimized_fuzzer_inputs(b64):
    fz.check(base64.b64decode(b64))


def _shard(tmp_path, t, n=6, edit=None):
    """A valid format-3 file of table t, its index edited by edit(index) and rehashed;
    returns (path, manifest info)."""
    rng = np.random.default_rng(0)
    (tmp_path / CKPT).mkdir()
    path = str(tmp_path / CKPT / "000-t.r0-of-1.kvs")
    rows = {"keys": np.arange(1, n + 1, dtype=np.int64),
            "values": rng.normal(size=(n, t.dim)).astype(np.float32),
            "slots": np.ones((n, t.slot_floats), np.float32),
            "last_step": np.ones(n, np.uint32), "counts": np.ones(n, np.uint32)}
    info = _shards.write_shard(path, rows, np.zeros(0, np.int64), BUCKETS)
    if edit is not None:
        data = bytearray(open(path, "rb").read())
        at = info["index"]["offset"]
        head = io.BytesIO(bytes(data[at:-_shards.TRAILER_BYTES]))
        index = np.lib.format.read_array(head).copy()
        edit(index, data)
        out = io.BytesIO()
        np.lib.format.write_array(out, index, allow_pickle=False)
        data[at:-_shards.TRAILER_BYTES] = out.getvalue()
        open(path, "wb").write(bytes(data))
        info["index"]["sha256"] = hashlib.sha256(bytes(data[at:])).hexdigest()
    return path, dict(info, table="t", rank=0, world=1)


@pytest.mark.parametrize("field,value", [("count", 2**64 - 1), ("count", 2**61),
                                         ("offset", 2**63 + 8), ("offset", 2**64 - 8)])
def test_index_entry_whose_arithmetic_wraps(tmp_path, field, value):
    """count * row bytes or offset + length wrapped int64 and passed the bounds check;
    the page read then failed with numpy's ValueError."""
    with KvTable(4) as t:
        def edit(index, data):
            index[field][0] = value
        path, info = _shard(tmp_path, t, edit=edit)
        if field == "count":  # the manifest agrees: only the bounds can catch it
            info["rows"] = value
        with pytest.raises(CheckpointError, match="index entry 0 .* not a valid page"):
            _shards.read_index(path, info, t.dim, t.slot_floats, BUCKETS)
        with pytest.raises(CheckpointError, match=path):
            _shards.read_shard(path)


def test_non_finite_rows_fail_verification_not_replay(tmp_path):
    """A NaN in a page passed pass 1 and failed in KvTable.import_ during replay, after
    every rank had agreed the checkpoint was sound (so restore cleared every table)."""
    with KvTable(4, name="t", optimizer=optimizers.Adagrad(0.1)) as t:
        def edit(index, data):  # a NaN in the first value; rehash the page
            e = index[0]
            n = int(e["count"])
            at = int(e["offset"]) + 16 * n
            data[at:at + 4] = np.array([np.nan], np.float32).tobytes()
            page = bytes(data[int(e["offset"]):int(e["offset"]) + n * _shards.row_bytes(
                t.dim, t.slot_floats)])
            e["sha256"] = np.frombuffer(hashlib.sha256(page).digest(), np.uint8)
        path, info = _shard(tmp_path, t, edit=edit)
        m = {"_name": CKPT, "version": 3, "world_size": 1, "buckets": BUCKETS,
             "owners": OwnerMap.even(1).to_json(),
             "tables": {"t": {"files": [Path(path).name]}}, "files": {Path(path).name: info}}
        with pytest.raises(CheckpointError, match=f"{path}: the rows .* non-finite values"):
            ck._Replay(str(tmp_path), [m], {"t": t},
                       types.SimpleNamespace(rank=0, size=1), ck.MIN_RESTORE_BUFFER, 0)


def test_manifest_whose_parent_chain_loops(tmp_path):
    """A delta naming itself (or a later checkpoint) as its parent read the same
    manifests 100000 times before it failed (a fuzzer timeout)."""
    for name, parent in (("ckpt-0000000002", "ckpt-0000000003"),
                         ("ckpt-0000000003", "ckpt-0000000002")):
        (tmp_path / name).mkdir()
        m = {"format": ck.FORMAT, "version": 2, "kind": "delta", "parent": parent,
             "step": 2, "world": 1, "tables": {}, "files": {}}
        (tmp_path / name / ck.MANIFEST).write_text(json.dumps(m))
    cp = ck.Checkpointer({}, types.SimpleNamespace(rank=0, size=1))
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match="ckpt-0000000002/manifest.json: its parent "
                       "'ckpt-0000000003' is already in the chain .* loops"):
        cp._load(str(tmp_path), "ckpt-0000000003", ck.MIN_RESTORE_BUFFER)
    assert time.perf_counter() - t0 < 1


def _v1(arrays):
    out = io.BytesIO()
    for a in arrays:
        np.lib.format.write_array(out, np.asarray(a), allow_pickle=False)
    return np.frombuffer(out.getvalue(), np.uint8)


def test_v1_non_finite_rows():
    buf = _v1([np.arange(2, dtype=np.int64), np.array([[1, np.inf]], np.float32).repeat(2, 0),
               np.zeros((2, 0), np.float32), np.zeros(2, np.uint32), np.zeros(2, np.uint32),
               np.zeros(0, np.int64)])
    with pytest.raises(CheckpointError, match="f.npy: its rows hold non-finite values"):
        _shards.check_records_v1(_shards.parse_records_v1(buf, "f.npy"), "f.npy", 2, 0)


@pytest.mark.parametrize("descr", ["'4i8'", "[('a', '<i8')]", "'<U0'", "'V8'"])
def test_v1_record_of_a_dtype_kvcoll_never_writes(descr):
    """A subarray dtype made numpy's view raise ValueError."""
    head = "{'descr': %s, 'fortran_order': False, 'shape': (2,), }" % descr
    head = head.ljust(118) + "\n"
    size = 2 * np.dtype(ast.literal_eval(descr)).itemsize  # exactly the record's bytes
    buf = np.frombuffer(b"\x93NUMPY\x01\x00" + len(head).to_bytes(2, "little") +
                        head.encode() + bytes(size), np.uint8)
    with pytest.raises(CheckpointError, match="f.npy: record 0 is malformed"):
        _shards.parse_records_v1(buf, "f.npy")


@pytest.mark.parametrize("shape", ["(0, %d)" % 2**70, "(%d, 0)" % 2**63, "(0, -1)"])
def test_v1_empty_record_of_an_impossible_shape(shape):
    """CI's fuzz run: no bytes, but a dimension numpy cannot hold made reshape raise
    ValueError (Maximum allowed dimension exceeded)."""
    head = "{'descr': '<i8', 'fortran_order': False, 'shape': %s, }" % shape
    head = head.ljust(118) + "\n"
    buf = np.frombuffer(b"\x93NUMPY\x01\x00" + len(head).to_bytes(2, "little") +
                        head.encode(), np.uint8)
    with pytest.raises(CheckpointError, match="f.npy: record 0 is malformed"):
        _shards.parse_records_v1(buf, "f.npy")


def _admission(tmp_path, t, arrays):
    d = tmp_path / CKPT
    d.mkdir()
    sha, nbytes = _shards.write_shard_v1(str(d / "t.adm"), arrays)
    m = {"_name": CKPT, "tables": {"t": {"admission": ["t.adm"]}},
         "files": {"t.adm": {"sha256": sha, "bytes": nbytes, "rank": 0, "world": 1}}}
    return ck._read_admission(str(tmp_path), m, {"t": t}, types.SimpleNamespace(rank=0,
                                                                                size=1))


@pytest.mark.parametrize("case", ["adds", "pending-into-bloom", "bloom-into-exact",
                                  "dtype", "zero-count"])
def test_admission_state_that_does_not_fit_the_table(tmp_path, case):
    """restore() imports the admission state after replaying the rows: a state the
    table refuses (InvalidArgumentError there) must be caught while verifying."""
    bloom = case in ("adds", "pending-into-bloom")
    kw = dict(admit="bloom", bloom_counters=256) if bloom else {}
    with KvTable(2, name="t", admit_min_count=2, **kw) as t:
        keys, counts = np.arange(3, dtype=np.int64), np.ones(3, np.uint32)
        filt, adds = np.zeros(0, np.uint8), 0
        if case == "adds":
            keys, counts, filt, adds = keys[:0], counts[:0], np.zeros(128, np.uint8), 2**40
        elif case == "bloom-into-exact":
            filt = np.zeros(128, np.uint8)
        elif case == "dtype":
            counts = counts.astype(np.float32)
        elif case == "zero-count":
            counts[1] = 0
        arrays = [keys, counts, np.ones(keys.size, np.uint32), filt, np.array([adds])]
        with pytest.raises(CheckpointError, match="t.adm"):
            _admission(tmp_path, t, arrays)


def test_admission_state_that_fits_imports(tmp_path):
    with KvTable(2, name="t", admit_min_count=2, admit="bloom", bloom_counters=256) as t:
        arrays = [np.zeros(0, np.int64), np.zeros(0, np.uint32), np.zeros(0, np.uint32),
                  np.full(128, 0x11, np.uint8), np.array([7])]
        state = _admission(tmp_path, t, arrays)["t"]
        t.import_admission(state, merge=state.pop("merge"))
        assert t.export_admission()["bloom_adds"] == 7
