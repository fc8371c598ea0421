"""kv.data.stream under MPI, at any world size: rank 0 lands files (written under a
temporary name, then renamed) while every rank reads the directory; the ranks stop
after K batches as a killed job would, and a second run resumed from every rank's
position (what a checkpoint holds) reads on. Together the two runs read every row of
every file exactly once: the count, the rows themselves, and a checksum of the labels."""

import gzip
import io
import os
import threading
import time

import numpy as np
import pytest

from kvcoll.data import for_rank, stream

B, K, FILES = 48, 6, 8
FAST = {"settle": 0.05, "idle_poll": 0.05}


def rows_of(k):
    """File k's rows: [lo, hi), sizes 0..~250 (file 3 empty)."""
    bounds = np.cumsum([0] + [(37 * k + 91) % 251 if k != 3 else 0 for k in range(FILES)])
    return int(bounds[k]), int(bounds[k + 1])


TOTAL = rows_of(FILES - 1)[1]


def criteo_text(lo, hi):
    rng = np.random.default_rng(lo)
    out = []
    for i in range(lo, hi):
        ints = [str(int(v)) for v in rng.integers(0, 100, 13)]
        cats = [format(i, "x")] + [format(int(v), "x") for v in rng.integers(0, 2**32, 25)]
        out.append("\t".join([str(int(i % 3 == 0)), *ints, *cats]) + "\n")
    return "".join(out).encode()


def parquet_bytes(lo, hi):
    import pyarrow as pa
    import pyarrow.parquet as pq

    end = max(hi, lo + 1)
    table = pa.table({"click": pa.array([int(i % 3 == 0) for i in range(lo, end)], pa.int8()),
                      "row": pa.array(np.arange(lo, end)),
                      "user": pa.array([f"u{i % 11}" for i in range(lo, end)])}
                     ).slice(0, hi - lo)
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=40)
    return buf.getvalue()


def land_all(root, fmt):
    for k in range(FILES):
        time.sleep(0.12)
        lo, hi = rows_of(k)
        part = os.path.join(root, f"hour={k // 3}")
        os.makedirs(part, exist_ok=True)
        if fmt == "parquet":
            name, data = f"part-{k}.parquet", parquet_bytes(lo, hi)
        elif fmt == "criteo-gz" and k % 2:
            name, data = f"part-{k}.tsv.gz", gzip.compress(criteo_text(lo, hi))
        else:
            name, data = f"part-{k}.tsv", criteo_text(lo, hi)
        tmp = os.path.join(part, f".{name}.inprogress")
        with open(tmp, "wb") as f:
            f.write(data)
        os.rename(tmp, os.path.join(part, name))


def ids(batch):
    cat = batch["categorical"]
    return cat["row"] if isinstance(cat, dict) else cat[:, 0] & ((1 << 33) - 1)


@pytest.mark.parametrize("split", ["part", "global"])
@pytest.mark.parametrize("fmt", ["criteo", "criteo-gz", "parquet"])
def test_every_row_once_across_a_restart(comm, shared_dir, fmt, split):
    if fmt == "parquet":
        pattern = os.path.join(shared_dir, "hour=*", "*.parquet")
        opts = {"label": "click", "categorical": ["row", "user"]}
    else:
        pattern, opts = os.path.join(shared_dir, "hour=*", "*"), {"format": "criteo"}
    writer = threading.Thread(target=land_all, args=(shared_dir, fmt))
    comm.barrier()
    if comm.rank == 0:
        writer.start()

    def make():   # (files land 0.12 s apart: 1.5 s without one ends the stream)
        return stream(pattern, B, split=split, idle_timeout=1.5, prefetch=2, **FAST, **opts)

    first = make()                          # run 1: K batches, then "killed"
    it = iter(first)
    run1 = [next(it) for _ in range(K)]
    time.sleep(0.2)                         # its thread reads ahead meanwhile
    position = first.position_at(K)
    it.close()
    positions = comm.allgather_json(position)          # what a checkpoint holds
    second = make()                         # run 2: resumed from the checkpoint
    second.resume(for_rank(positions, comm.rank, comm.size))
    run2 = list(second)
    if comm.rank == 0:
        writer.join()
    batches = run1 + run2
    mine = np.concatenate([ids(b) for b in batches]).astype(np.int64)
    labels = np.concatenate([b["label"] for b in batches])
    got, _ = comm.allgatherv(mine)
    np.testing.assert_array_equal(np.sort(got), np.arange(TOTAL))     # every row, once
    sums = comm.allreduce(np.array([mine.size, labels.sum(), (labels * mine).sum()], np.float64))
    want = np.arange(TOTAL)
    assert sums.tolist() == [TOTAL, float((want % 3 == 0).sum()),
                             float(want[want % 3 == 0].sum())]
    assert second.stats.idle_batches > 0              # it waited for files, then timed out
    assert all(b["label"].size <= B for b in batches)
