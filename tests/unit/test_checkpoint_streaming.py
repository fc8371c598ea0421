"""Checkpoint format 2 across world sizes, in one process (ranks are threads:
tests/unit/threadcomm.py; tests/launch/test_checkpoint_reshard.py does it under mpirun).

- A checkpoint chain written on 3 ranks (a full save, then deltas with updates,
  removals and re-created keys) restores on 1, 2, 4 and 5 ranks, with the default
  bucket count and with one that 4 and 5 do not divide: every row, slot and header
  bit for bit, each rank holding exactly the keys it owns.
- Each page is read by one rank when the world size divides the bucket count; a
  restore through a buffer much smaller than the table replays group by group.
- A corrupt page is found by the rank that owns it and every rank raises, with no table
  changed; a file that changes between the verify and replay passes leaves every
  table empty and raises everywhere.
- Version 1 checkpoints (a fixture written by the format-1 code, and ones written by
  Checkpointer(version=1)) restore on any world size; a delta never follows a parent
  of another format.
- A restore adds at most its buffer to the memory of the tables it fills (RSS, in a
  fresh process), where the format-1 reader holds the whole checkpoint.
"""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import kvcoll as kv
import kvcoll.checkpoint as ck
from kvcoll import _shards
from kvcoll.checkpoint import Checkpointer
from kvcoll.comm import Comm
from kvcoll.routing import owner_of

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "mpi"))
from ckpt_tables import KEYS, close, dump, make_tables, merge, play, same  # noqa: E402
from threadcomm import run_ranks  # noqa: E402

FIXTURE = Path(__file__).resolve().parent / "data" / "ckpt_v1"


def reference(steps, keys=KEYS, dims=(4, 3, 2)):
    tables = make_tables(dims)
    for step in range(1, steps + 1):
        play(tables, 1, 0, step, keys)
    out = dump(tables)
    close(tables)
    return out


def save_chain(d, world, *, buckets=None, version=2, steps=5, full_at=2, keys=KEYS,
               dims=(4, 3, 2)):
    """Train `steps` steps on `world` thread ranks; a full save at `full_at`, a delta at
    every later step. Returns the SaveInfos of rank 0."""
    def rank_main(comm):
        tables = make_tables(dims)
        c = Checkpointer(tables, comm, buckets=buckets, version=version)
        infos = []
        for step in range(1, steps + 1):
            play(tables, comm.size, comm.rank, step, keys)
            if step >= full_at:
                infos.append(c.save(d, step, incremental=step > full_at))
        close(tables)
        return infos
    return run_ranks(world, rank_main)[0]


def restore_on(d, world, *, checkpoint=None, buffer_bytes=None, dims=(4, 3, 2)):
    """Restore into fresh tables on `world` thread ranks: (RestoreInfo of every rank,
    the merged state), after checking each rank holds only keys it owns."""
    def rank_main(comm):
        tables = make_tables(dims)
        info = Checkpointer(tables, comm).restore(d, checkpoint, buffer_bytes=buffer_bytes)
        state = dump(tables)
        for name, cols in state.items():
            assert (owner_of(cols["keys"], comm.size) == comm.rank).all(), name
        close(tables)
        return info, state
    out = run_ranks(world, rank_main)
    return [i for i, _ in out], merge([s for _, s in out])


@pytest.fixture(scope="module")
def chains(tmp_path_factory):
    """Chains written on 3 ranks: full at 2, deltas at 3, 4, 5; with 11520 buckets, with
    6, and with the bucket counts chosen by table size (here 1: small tables)."""
    d = tmp_path_factory.mktemp("chains")
    out = {}
    for buckets in (11520, 6, None):
        infos = save_chain(d / f"b{buckets}", 3, buckets=buckets)
        assert [i.kind for i in infos] == ["full", "delta", "delta", "delta"]
        out[buckets] = d / f"b{buckets}"
    return out


@pytest.mark.parametrize("buckets", [11520, 6, None])
@pytest.mark.parametrize("world", [1, 2, 4, 5])
def test_chain_written_on_3_ranks_restores_on_any(chains, buckets, world):
    d = chains[buckets]
    m = json.loads((d / "ckpt-0000000005" / "manifest.json").read_text())
    assert m["version"] == 2 and m["world_size"] == 3
    assert {f["buckets"] for f in m["files"].values()} == {buckets or 1}
    infos, state = restore_on(d, world)
    assert [i.chain for i in infos] == [tuple(f"ckpt-{s:010d}" for s in (2, 3, 4, 5))] * world
    same(state, reference(5))
    _, state = restore_on(d, world, checkpoint="ckpt-0000000003")   # full + one delta
    same(state, reference(3))
    _, state = restore_on(d, world, checkpoint="ckpt-0000000002")   # the full save alone
    same(state, reference(2))


def _index_and_page_bytes(ckdir: Path) -> tuple[int, int]:
    m = json.loads((ckdir / "manifest.json").read_text())
    index = sum(f["index"]["bytes"] for f in m["files"].values())
    return index, sum(f["bytes"] for f in m["files"].values()) - index


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_each_page_is_read_by_one_rank(chains, world):
    """World sizes dividing the bucket count read each page once over all ranks, and
    the index of only the files that can hold their keys (every file when gcd(3, M) is
    1; its own file when M = 3)."""
    d = chains[11520]
    infos, _ = restore_on(d, world, checkpoint="ckpt-0000000002")
    index, pages = _index_and_page_bytes(d / "ckpt-0000000002")
    indexes_read = index if world == 3 else world * index
    assert sum(i.bytes for i in infos) == pages + indexes_read
    # the rows are spread over the pages of 11520 buckets: no rank reads much more
    # than its share
    assert max(i.bytes for i in infos) < pages / world * 1.3 + index


def test_buckets_not_divided_by_the_world_size_are_filtered_by_key(chains):
    """6 buckets on 4 ranks: a bucket's keys belong to 2 ranks (gcd 2), each reads it
    and keeps its own keys; on 5 ranks (gcd 1) every rank reads every page."""
    d = chains[6]
    index, pages = _index_and_page_bytes(d / "ckpt-0000000002")
    infos, _ = restore_on(d, 4, checkpoint="ckpt-0000000002")
    assert sum(i.bytes for i in infos) == 2 * pages + 4 * index
    infos, _ = restore_on(d, 5, checkpoint="ckpt-0000000002")
    assert sum(i.bytes for i in infos) == 5 * (pages + index)


def test_small_buffer_replays_group_by_group(tmp_path, monkeypatch):
    """About 120,000 rows of dim 16 per table (43 MB over three tables) through a 4 MiB
    buffer (1 MiB reads): several groups and batches, still bit for bit, with removals
    across the chain; with 6 buckets (several pages per bucket, buckets larger than a
    read), with 11520, and with the bucket counts chosen by size (each file its own:
    the full save's and the deltas' differ, replay groups go by their gcd)."""
    dims = (16, 16, 16)
    groups = []
    real = ck._batches

    def counting(order, spans, limit, cut=None):
        if cut is not None:
            groups.append(len(set(cut.tolist())))
        return real(order, spans, limit, cut)
    monkeypatch.setattr(ck, "_batches", counting)
    want = reference(4, keys=160_000, dims=dims)
    for buckets in (6, 11520, None):
        d = tmp_path / f"b{buckets}"
        save_chain(d, 2, steps=4, keys=160_000, dims=dims, buckets=buckets)
        for step, least in ((2, 30), (4, 6)):  # chosen: the full save's, the delta's
            files = json.loads((d / f"ckpt-{step:010d}" / "manifest.json").read_text())["files"]
            got = {f["buckets"] for f in files.values()}
            assert got == {buckets} if buckets else min(got) >= least, (step, got)
        for world in (3, 1) if buckets else (3, 1, 4):  # 4: filtered by key, mixed counts
            groups.clear()
            _, state = restore_on(d, world, buffer_bytes=ck.MIN_RESTORE_BUFFER, dims=dims)
            same(state, want)
            assert min(groups) >= 2, groups  # every table, every rank: several groups


def test_restore_buffer_is_checked():
    t = make_tables()
    with pytest.raises(kv.InvalidArgumentError, match=r"buffer_bytes must be an integer "
                                                       r">= 4194304 \(4 MiB"):
        Checkpointer(t, Comm.local()).restore("/nonexistent", buffer_bytes=1 << 20)
    with pytest.raises(kv.InvalidArgumentError, match="buckets must be None or an integer in"):
        Checkpointer(t, Comm.local(), buckets=1 << 17)
    close(t)


def _pages(path: Path) -> np.ndarray:
    """The page index of a format-2 shard file (through its trailer)."""
    data = path.read_bytes()
    offset = int(np.frombuffer(data[-_shards.TRAILER_BYTES + 16:][:8], "<u8")[0])
    return _shards._parse_index(str(path), data[offset:], offset, None, None,
                                _shards.MAX_BUCKETS)


def test_corrupt_page_is_found_by_its_owner_and_every_rank_raises(chains, tmp_path):
    d = tmp_path / "c"
    shutil.copytree(chains[11520], d)
    shard = next((d / "ckpt-0000000004").glob("000-a.r1-of-3.kvs"))
    page = _pages(shard)[0]
    data = bytearray(shard.read_bytes())
    data[int(page["offset"]) + 3] ^= 0xFF
    shard.write_bytes(bytes(data))
    owner = int(page["bucket"]) % 2  # on 2 ranks, only the owner of its bucket reads it

    def rank_main(comm):
        tables = make_tables()
        play(tables, comm.size, comm.rank, 9)
        before = dump(tables)
        with pytest.raises(kv.CheckpointError) as exc:
            Checkpointer(tables, comm).restore(d)
        same(dump(tables), before)
        close(tables)
        return str(exc.value)
    msgs = run_ranks(2, rank_main)
    assert msgs[0] == msgs[1]
    assert msgs[0].startswith(f"rank {owner}: checkpoint file ") and \
        "000-a.r1-of-3.kvs: the page at byte 0 fails its sha256 check" in msgs[0], msgs[0]
    assert msgs[0].endswith("restore an earlier checkpoint; nothing was restored")


def test_file_changed_during_the_restore_clears_every_table(chains, tmp_path, monkeypatch):
    d = tmp_path / "c"
    shutil.copytree(chains[11520], d)
    real = ck._Replay.apply

    def corrupt_then_apply(self):
        if self.rank == 0:  # between the passes, on one rank: a page changes
            shard = next((d / "ckpt-0000000002").glob("000-a.r0-of-3.kvs"))
            pages = _pages(shard)
            data = bytearray(shard.read_bytes())
            for p in pages[pages["bucket"] % 2 == 0]:  # a page of each of rank 0's buckets
                data[int(p["offset"]) + 3] ^= 0xFF
            shard.write_bytes(bytes(data))
        return real(self)
    monkeypatch.setattr(ck._Replay, "apply", corrupt_then_apply)
    monkeypatch.setattr(ck._Replay, "_verify", _verify_without_keeping(ck._Replay._verify))

    def rank_main(comm):
        tables = make_tables()
        play(tables, comm.size, comm.rank, 9)
        with pytest.raises(kv.CheckpointError, match=r"rank 0: checkpoint file .*fails its "
                           r"sha256 check .*\(it changed during the restore\); this "
                           r"happened while replaying the checkpoint, after every rank had "
                           r"verified it: every table was cleared"):
            Checkpointer(tables, comm).restore(d)
        assert all(len(t) == 0 for t in tables.values())
        close(tables)
    run_ranks(2, rank_main)


def test_error_while_replaying_clears_every_table_and_the_next_restore_works(
        tmp_path, monkeypatch):
    """An error in the middle of the replay (here a simulated out-of-memory in a table
    import, while the next batch is being read ahead): every rank raises with the
    cause, every table is empty, and a restore afterwards succeeds."""
    dims = (16, 16, 16)
    save_chain(tmp_path, 2, steps=3, keys=80_000, dims=dims, buckets=6)
    real = ck._Replay._apply_page
    calls = []

    def failing(self, plan, page, view):
        calls.append(self.rank)
        if self.rank == 1 and calls.count(1) == 3:
            raise kv.CapacityError("table 'a': out of memory (simulated)")
        return real(self, plan, page, view)
    monkeypatch.setattr(ck._Replay, "_apply_page", failing)

    def rank_main(comm):
        tables = make_tables(dims)
        c = Checkpointer(tables, comm)
        with pytest.raises(kv.CheckpointError, match=r"^rank 1: CapacityError: table 'a': "
                           r"out of memory \(simulated\); this happened while replaying"):
            c.restore(tmp_path, buffer_bytes=ck.MIN_RESTORE_BUFFER)
        assert all(len(t) == 0 for t in tables.values())
        comm.barrier()
        if comm.rank == 0:
            monkeypatch.setattr(ck._Replay, "_apply_page", real)
        comm.barrier()
        c.restore(tmp_path, buffer_bytes=ck.MIN_RESTORE_BUFFER)
        state = dump(tables)
        close(tables)
        return state
    same(merge(run_ranks(2, rank_main)), reference(3, keys=80_000, dims=dims))


def _verify_without_keeping(verify):
    """_Replay._verify as if the pages did not fit the buffer (pass 2 reads again)."""
    def run(self):
        limit = self.limit
        self.limit = 0
        try:
            verify(self)
        finally:
            self.limit = limit
    return run


# -- version 1 ------------------------------------------------------------------------------

def test_v1_fixture_restores_on_any_world_size():
    """tests/unit/data/ckpt_v1: written on 2 ranks by the format-1 code (kvcoll before
    format 2, tests/unit/data/make_ckpt_v1.py): a full save at step 2 and deltas at 3
    (with removals) and 4; the tables' state at 4 is in ckpt_v1.expected.npz."""
    m = json.loads((FIXTURE / "ckpt-0000000004" / "manifest.json").read_text())
    assert m["version"] == 1 and m["world_size"] == 2 and "buckets" not in m
    with np.load(FIXTURE.parent / "ckpt_v1.expected.npz") as z:
        want = {}
        for key in z.files:
            name, col = key.split("/")
            want.setdefault(name, {})[col] = z[key]
    for world in (1, 2, 3):
        infos, state = restore_on(FIXTURE, world)
        assert infos[0].chain == ("ckpt-0000000002", "ckpt-0000000003", "ckpt-0000000004")
        same(state, want)


def test_version_1_writer_and_the_next_delta(tmp_path):
    """Checkpointer(version=1) writes format 1 (restored on any world size); a process
    that restored it saves its next incremental checkpoint in format 2 as a full one."""
    save_chain(tmp_path, 3, version=1, steps=4)
    m = json.loads((tmp_path / "ckpt-0000000004" / "manifest.json").read_text())
    assert m["version"] == 1 and m["kind"] == "delta"
    for world in (1, 2):
        _, state = restore_on(tmp_path, world)
        same(state, reference(4))

    def rank_main(comm):
        tables = make_tables()
        c = Checkpointer(tables, comm)
        c.restore(tmp_path)
        play(tables, comm.size, comm.rank, 5)
        info = c.save(tmp_path, 5, incremental=True)
        play(tables, comm.size, comm.rank, 6)
        nxt = c.save(tmp_path, 6, incremental=True)
        close(tables)
        return info.kind, nxt.kind
    assert run_ranks(2, rank_main)[0] == ("full", "delta")
    _, state = restore_on(tmp_path, 3)
    same(state, reference(6))


# -- memory ---------------------------------------------------------------------------------

MEMORY = textwrap.dedent("""
    import json, sys
    import numpy as np
    import kvcoll as kv
    from kvcoll.checkpoint import Checkpointer
    from kvcoll.comm import Comm

    def hwm():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmHWM"))

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    def table():
        return kv.KvTable(16, name="t", optimizer=kv.optimizers.Adagrad(0.1))

    warm = table()  # run the code once on a small table first
    warm.find_or_create(np.arange(1000), step=1)
    Checkpointer({"t": warm}, Comm.local()).save(sys.argv[3], 1)
    Checkpointer({"t": warm}, Comm.local()).restore(sys.argv[3])
    warm.close()
    t = table()
    c = Checkpointer({"t": t}, Comm.local())
    base = rss()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")                                    # VmHWM := VmRSS
    info = c.restore(sys.argv[1], buffer_bytes=int(sys.argv[2]))
    print(json.dumps({"growth": hwm() - base, "table": t.stats().bytes, "rows": len(t),
                      "chain": len(info.chain)}))
""")


def _restore_growth(d, buffer_bytes: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", MEMORY, str(d), str(buffer_bytes),
                           str(d) + "-warm"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_restore_adds_at_most_its_buffer_to_the_tables(tmp_path):
    """A 1.2M-row table (dim 16, Adagrad: about 175 MB) saved on 2 ranks, then a delta
    that removes a quarter of it and changes another: restoring the chain on one rank
    through an 8 MiB buffer grows the peak RSS by at most the final table plus the
    buffer (the C index, rebuilt while it grows, is allowed its old copy: under 5 bytes
    a row). The same chain in format 1 holds every row in memory first: far above."""
    n = 1_200_000

    def write(d, version):
        def rank_main(comm):
            t = kv.KvTable(16, name="t", optimizer=kv.optimizers.Adagrad(0.1))
            c = Checkpointer({"t": t}, comm, version=version)
            keys = np.arange(n, dtype=np.int64)
            mine = keys[owner_of(keys, comm.size) == comm.rank]
            for s in range(0, mine.size, 1 << 18):
                t.apply_gradients(mine[s:s + (1 << 18)], np.ones((min(1 << 18, mine.size - s),
                                  16), np.float32), step=1, create_missing=True)
            c.save(d, 1)
            gone = mine[mine % 4 == 0]
            t.delete(gone)
            hot = mine[mine % 4 == 1]
            t.apply_gradients(hot, np.ones((hot.size, 16), np.float32), step=2)
            c.save(d, 2, incremental=True)
            t.close()
        run_ranks(2, rank_main)
    write(tmp_path / "v2", 2)
    got = _restore_growth(tmp_path / "v2", 8 << 20)
    assert got["rows"] == n - n // 4 and got["chain"] == 2
    allowed = got["table"] + (8 << 20) + 5 * got["rows"]
    assert got["growth"] <= allowed, (got, allowed)
    write(tmp_path / "v1", 1)
    old = _restore_growth(tmp_path / "v1", 8 << 20)
    assert old["rows"] == got["rows"] and old["growth"] > allowed + (100 << 20), (old, got)


def test_bucket_count_grows_with_the_table():
    """At least 128 KiB a bucket on average over all the files, a removed key counted
    as a row, up to 11520 buckets: a page is large enough that its per-page costs do
    not matter; each count of the ladder divides the larger ones."""
    def choose(rows, removed=0, files=1):
        return _shards.choose_buckets(rows, removed, 16, 16, files)  # 144-byte rows
    assert choose(100) == 1
    assert choose(200_000) == 180                              # 28.8 MB
    assert choose(5_000_000, files=2) == 5760                  # 1.44 GB
    assert choose(10**9) == 11520
    assert choose(50_000, 50_000, files=2) == choose(200_000)  # removals count as rows
    ns = np.geomspace(1, 10**9, 60).astype(int)
    sizes = [choose(n) for n in ns]
    assert sizes == sorted(sizes)
    assert all(b == 1 or n * 144 >= b * _shards.BUCKET_BYTES for b, n in zip(sizes, ns))
    ladder = _shards.BUCKET_LADDER
    assert all(big % small == 0 for big, small in zip(ladder, ladder[1:]))
