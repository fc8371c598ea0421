"""Checkpoint format 3 across world sizes and owner maps, in one process (ranks are
threads: tests/unit/threadcomm.py; tests/launch/test_checkpoint_reshard.py does it
under mpirun).

- A checkpoint chain written on 3 ranks (a full save, then deltas with updates,
  removals and re-created keys) restores on 1, 2, 4 and 5 ranks, and on 2 ranks under
  maps that are not the even split: every row, slot and header bit for bit, each rank
  holding exactly the keys the map gives it. The manifests record the bucket count and
  the writer's map.
- On the map that wrote it, each rank reads its own files and nothing else; on another
  world a rank reads the pages that meet its buckets (its share and a few pages more);
  a restore through a buffer much smaller than the table replays group by group.
- A file's pages are sorted by bucket, hold only its writer's buckets, and a small
  delta is one page.
- A corrupt page is found by a rank that reads it and every rank raises, with no table
  changed; a file that changes between the verify and replay passes leaves every
  table empty and raises everywhere.
- Version 2 and 1 checkpoints (fixtures written by the code of those formats, and ones
  written by Checkpointer(version=1)) restore on any world size and map, admission
  state included; a delta never follows a parent of another format.
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
from kvcoll.routing import BUCKETS, OwnerMap, owner_of

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "mpi"))
from ckpt_tables import KEYS, close, dump, make_tables, merge, play, same  # noqa: E402
from threadcomm import run_ranks  # noqa: E402

FIXTURE = Path(__file__).resolve().parent / "data" / "ckpt_v1"
FIXTURE_V2 = Path(__file__).resolve().parent / "data" / "ckpt_v2"
FIXTURE_V3 = Path(__file__).resolve().parent / "data" / "ckpt_v3"
# maps of 2 ranks that are not the even split (the even map of 3 without its middle
# rank is the even map of 2: without its first one is not)
UNEVEN = {"3-without-0": lambda: OwnerMap.even(3).without([0]),
          "5-without-0-1-3": lambda: OwnerMap.even(5).without([0, 1, 3]),
          "random": lambda: OwnerMap(np.random.default_rng(9).integers(0, 2, BUCKETS), 2)}


def reference(steps, keys=KEYS, dims=(4, 3, 2)):
    tables = make_tables(dims)
    for step in range(1, steps + 1):
        play(tables, 1, 0, step, keys)
    out = dump(tables)
    close(tables)
    return out


def save_chain(d, world, *, version=4, steps=5, full_at=2, keys=KEYS, dims=(4, 3, 2),
               owners=None):
    """Train `steps` steps on `world` thread ranks, routed by `owners` (default: the
    even map); a full save at `full_at`, a delta at every later step. Returns the
    SaveInfos of rank 0."""
    def rank_main(comm):
        tables = make_tables(dims)
        c = Checkpointer(tables, comm, version=version, owners=owners)
        infos = []
        for step in range(1, steps + 1):
            if owners is None:
                play(tables, comm.size, comm.rank, step, keys)
            else:  # this rank's keys under the map: play on one rank, keep them
                play(tables, 1, 0, step, keys)
                for t in tables.values():
                    e = t.export()
                    t.delete(e["keys"][owners.owner_of(e["keys"]) != comm.rank])
            if step >= full_at:
                infos.append(c.save(d, step, incremental=step > full_at))
        close(tables)
        return infos
    return run_ranks(world, rank_main)[0]


def restore_on(d, world, *, checkpoint=None, buffer_bytes=None, dims=(4, 3, 2),
               owners=None, tables=make_tables, extra=None):
    """Restore into fresh tables on `world` thread ranks under `owners` (default: the
    even map): (RestoreInfo of every rank, the merged state), after checking each rank
    holds only keys it owns. extra(tables, comm): more of each rank's state to return."""
    def rank_main(comm):
        t = tables(dims)
        info = Checkpointer(t, comm, owners=owners).restore(d, checkpoint,
                                                            buffer_bytes=buffer_bytes)
        state = dump(t)
        for name, cols in state.items():
            assert (owner_of(cols["keys"], owners or comm.size) == comm.rank).all(), name
        more = extra(t, comm) if extra else None
        close(t)
        return info, state, more
    out = run_ranks(world, rank_main)
    infos, state = [i for i, _, _ in out], merge([s for _, s, _ in out])
    return (infos, state, [x for _, _, x in out]) if extra else (infos, state)


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """A chain written on 3 ranks: full at 2, deltas at 3, 4, 5."""
    d = tmp_path_factory.mktemp("chain")
    infos = save_chain(d, 3)
    assert [i.kind for i in infos] == ["full", "delta", "delta", "delta"]
    return d


def test_manifests_record_the_bucket_count_and_the_map(chain):
    for step in (2, 3, 4, 5):
        m = json.loads((chain / f"ckpt-{step:010d}" / "manifest.json").read_text())
        assert m["version"] == 4 and m["world_size"] == 3 and m["buckets"] == BUCKETS
        assert m["owners"] == {"buckets": BUCKETS, "world": 3,
                               "runs": [0, 21846, 1, 21845, 2, 21845]}
        assert OwnerMap.from_json(m["owners"]) == OwnerMap.even(3)
        assert all("buckets" not in f for f in m["files"].values())


@pytest.mark.parametrize("world", [1, 2, 4, 5])
def test_chain_written_on_3_ranks_restores_on_any(chain, world):
    infos, state = restore_on(chain, world)
    assert [i.chain for i in infos] == [tuple(f"ckpt-{s:010d}" for s in (2, 3, 4, 5))] * world
    same(state, reference(5))
    _, state = restore_on(chain, world, checkpoint="ckpt-0000000003")   # full + one delta
    same(state, reference(3))
    _, state = restore_on(chain, world, checkpoint="ckpt-0000000002")   # the full save alone
    same(state, reference(2))


@pytest.mark.parametrize("uneven", sorted(UNEVEN))
def test_restore_under_a_map_that_is_not_the_even_split(chain, uneven):
    """Every rank gets exactly the keys the map gives it (restore_on checks each rank's
    keys against the map; merged, they are every key)."""
    owners = UNEVEN[uneven]()
    assert owners != OwnerMap.even(2) and owners.world == 2
    _, state = restore_on(chain, 2, owners=owners)
    same(state, reference(5))


@pytest.mark.parametrize("writer", ["4-without-1", "random"])
def test_chain_written_under_a_map_that_is_not_even(tmp_path, writer):
    """The writer's map is recorded and its files hold its (scattered) buckets; the
    chain restores on the same map (each rank reads its own files only), on 1 and 2
    ranks and under another uneven map."""
    owners = OwnerMap.even(4).without([1]) if writer == "4-without-1" else \
        OwnerMap(np.random.default_rng(3).integers(0, 3, BUCKETS), 3)
    save_chain(tmp_path, 3, owners=owners)
    m = json.loads((tmp_path / "ckpt-0000000005" / "manifest.json").read_text())
    assert OwnerMap.from_json(m["owners"]) == owners
    want = reference(5)
    infos, state = restore_on(tmp_path, 3, owners=owners)
    same(state, want)
    for rank, info in enumerate(infos):
        own = sum(f.stat().st_size for c in info.chain
                  for f in (tmp_path / c).glob(f"*.r{rank}-of-3.kvs"))
        assert info.bytes == own
    for world, reader in ((1, None), (2, None), (2, UNEVEN["random"]())):
        _, state = restore_on(tmp_path, world, owners=reader)
        same(state, want)


def test_a_save_refuses_keys_its_map_gives_another_rank(tmp_path):
    """A Checkpointer whose map is not the one the tables were filled by fails the save
    on every rank, naming the table and the fix; the previous checkpoint stays."""
    def rank_main(comm):
        tables = make_tables()
        play(tables, comm.size, comm.rank, 1)  # filled by the even map
        Checkpointer(tables, comm).save(tmp_path, 1)
        other = Checkpointer(tables, comm, owners=UNEVEN["random"]())
        with pytest.raises(kv.CheckpointError, match=r"table 'a' on rank \d holds \d+ keys "
                           r"that the owner map gives other ranks .*the exchange's .owners"):
            other.save(tmp_path, 2)
        close(tables)
    run_ranks(2, rank_main)
    assert ck.latest(tmp_path) == "ckpt-0000000001"


def _index_and_page_bytes(ckdir: Path) -> tuple[int, int]:
    m = json.loads((ckdir / "manifest.json").read_text())
    shards = [f for f in m["files"].values() if "index" in f]
    index = sum(f["index"]["bytes"] for f in shards)
    return index, sum(f["bytes"] for f in shards) - index


@pytest.fixture(scope="module")
def big_chain(tmp_path_factory):
    """Tables of dim 16 (144-byte rows with Adagrad's slots) over 160,000 keys, written
    on 3 ranks: about 20,000 rows a file at the full save, a few pages each."""
    d = tmp_path_factory.mktemp("big")
    save_chain(d, 3, steps=4, keys=160_000, dims=(16, 16, 16))
    return d


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_a_rank_reads_its_buckets_pages(big_chain, world):
    """On the map that wrote it (3 ranks) every rank reads its own files, each page
    once over all ranks; on another world, the pages that meet its buckets: its share
    and, per file it shares with another rank, a page more."""
    ck2 = big_chain / "ckpt-0000000002"
    index, pages = _index_and_page_bytes(ck2)
    infos, state = restore_on(big_chain, world, checkpoint="ckpt-0000000002",
                              dims=(16, 16, 16))
    same(state, reference(2, keys=160_000, dims=(16, 16, 16)))
    total = sum(i.bytes for i in infos)
    if world in (1, 3):
        assert total == pages + index
        return
    files = 9  # 3 tables x 3 writers; a rank shares at most 2 files a table
    assert pages + index < total <= pages + index + world * 2 * 3 * (
        _shards.PAGE_BYTES + index / files)
    assert max(i.bytes for i in infos) < (pages + index) / world + 6 * _shards.PAGE_BYTES


def test_pages_are_sorted_by_bucket_and_a_small_delta_is_one_page(big_chain, tmp_path):
    m = json.loads((big_chain / "ckpt-0000000003" / "manifest.json").read_text())
    writers = OwnerMap.from_json(m["owners"])
    for fname, info in m["files"].items():
        rank = info["rank"]
        full = big_chain / "ckpt-0000000002" / fname
        for path in (full, big_chain / "ckpt-0000000003" / fname):
            pages = _pages(path)
            a = _shards.read_shard(str(path))
            for kind, keys in ((_shards.REMOVED, a["removed"]), (_shards.ROWS, a["keys"])):
                p = pages[pages["kind"] == kind]
                b = OwnerMap.even(3).bucket_of(keys)
                assert (np.diff(b) >= 0).all()                  # sorted by bucket
                assert (writers.array[b] == rank).all()         # only its writer's
                assert p["first"].tolist() == b[np.cumsum(p["count"]) - p["count"]].tolist()
                assert p["last"].tolist() == b[np.cumsum(p["count"]) - 1].tolist()
        assert _pages(full).size >= 2                   # 2-3 MB a file: several pages
    # a small delta of a large table: one page of rows and one of removed keys, whatever
    # the 65,536 buckets its keys fall in
    with kv.KvTable(8, name="t") as t:
        t.find_or_create(np.arange(200_000), step=1)
        c = Checkpointer({"t": t}, Comm.local())
        c.save(tmp_path, 1)
        t.apply_gradients(np.arange(0, 200_000, 997), np.ones((201, 8), np.float32), step=2)
        t.delete(np.arange(1, 200_000, 1999))
        info = c.save(tmp_path, 2, incremental=True)
    m = json.loads((tmp_path / info.name / "manifest.json").read_text())
    (f,) = [f for f in m["files"].values() if "pages" in f]
    assert info.kind == "delta" and (f["rows"], f["removed"], f["pages"]) == (201, 101, 2)


def test_small_buffer_replays_group_by_group(tmp_path, monkeypatch):
    """About 120,000 rows of dim 16 per table (43 MB over three tables) through a 4 MiB
    buffer (1 MiB reads): several groups and batches, still bit for bit, with removals
    across the chain (the deltas' pages span several groups of the full save's, and are
    cut by key at each group's edge), on the map that wrote it, on 3, 1 and 4 ranks,
    and on 2 under a map that is not the even split."""
    dims = (16, 16, 16)
    groups = []
    real = ck._batches

    def counting(order, spans, limit, cut=None):
        if cut is not None:
            groups.append(len(set(cut.tolist())))
        return real(order, spans, limit, cut)
    monkeypatch.setattr(ck, "_batches", counting)
    want = reference(5, keys=160_000, dims=dims)
    save_chain(tmp_path, 2, steps=5, keys=160_000, dims=dims)
    for world, owners in ((2, None), (3, None), (1, None), (4, None),
                          (2, UNEVEN["3-without-0"]())):
        groups.clear()
        _, state = restore_on(tmp_path, world, buffer_bytes=ck.MIN_RESTORE_BUFFER, dims=dims,
                              owners=owners)
        same(state, want)
        assert min(groups) >= 2, groups  # every table, every rank: several groups
    # without removals in the chain, one group: nothing lives longer than needed
    groups.clear()
    _, state = restore_on(tmp_path, 2, buffer_bytes=ck.MIN_RESTORE_BUFFER, dims=dims,
                          checkpoint="ckpt-0000000004")
    same(state, reference(4, keys=160_000, dims=dims))


def test_restore_buffer_is_checked():
    t = make_tables()
    with pytest.raises(kv.InvalidArgumentError, match=r"buffer_bytes must be an integer "
                                                       r">= 4194304 \(4 MiB"):
        Checkpointer(t, Comm.local()).restore("/nonexistent", buffer_bytes=1 << 20)
    with pytest.raises(kv.InvalidArgumentError, match="OwnerMap of the communicator's 1 "):
        Checkpointer(t, Comm.local(), owners=OwnerMap.even(2))
    with pytest.raises(kv.InvalidArgumentError, match="must be 4 or 1 .format 2 is read"):
        Checkpointer(t, Comm.local(), version=2)
    close(t)


def test_a_model_keeps_its_bucket_count(chain):
    """A restore under a map of another bucket count is refused, naming the fix."""
    def rank_main(comm):
        tables = make_tables()
        with pytest.raises(kv.CheckpointError, match=r"saved with 65536 buckets, this run "
                           r"routes keys by 4096; .*OwnerMap.even\(world, buckets=65536\)"):
            Checkpointer(tables, comm, owners=OwnerMap.even(1, 4096)).restore(chain)
        close(tables)
    run_ranks(1, rank_main)


def _pages(path: Path) -> np.ndarray:
    """The page index of a format-3 shard file (through its trailer)."""
    data = path.read_bytes()
    offset = int(np.frombuffer(data[-_shards.TRAILER_BYTES + 16:][:8], "<u8")[0])
    return _shards._parse_index(str(path), data[offset:], offset, None, None, None)


def test_corrupt_page_is_found_by_its_owner_and_every_rank_raises(chain, tmp_path):
    d = tmp_path / "c"
    shutil.copytree(chain, d)
    shard = next((d / "ckpt-0000000004").glob("000-a.r1-of-3.kvs"))
    page = _pages(shard)[0]
    data = bytearray(shard.read_bytes())
    data[int(page["offset"]) + 3] ^= 0xFF
    shard.write_bytes(bytes(data))
    # on 2 ranks, the ranks that own its buckets read it; the first of them reports
    owner = int(OwnerMap.even(2).array[page["first"]])

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


def test_file_changed_during_the_restore_clears_every_table(chain, tmp_path, monkeypatch):
    d = tmp_path / "c"
    shutil.copytree(chain, d)
    real = ck._Replay.apply

    def corrupt_then_apply(self):
        if self.rank == 0:  # between the passes, on one rank: a page changes
            shard = next((d / "ckpt-0000000002").glob("000-a.r0-of-3.kvs"))
            pages = _pages(shard)
            data = bytearray(shard.read_bytes())
            mine = OwnerMap.even(2).array == 0
            for p in pages[mine[pages["first"]]]:  # the pages of rank 0's buckets
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
    save_chain(tmp_path, 2, steps=3, keys=80_000, dims=dims)
    real = ck._Replay._apply_page
    calls = []

    def failing(self, plan, page, view, keys=None):
        calls.append(self.rank)
        if self.rank == 1 and calls.count(1) == 3:
            raise kv.CapacityError("table 'a': out of memory (simulated)")
        return real(self, plan, page, view, keys)
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


# -- versions 2 and 1 -----------------------------------------------------------------------

def _expected(npz: Path) -> dict:
    with np.load(npz) as z:
        want = {}
        for key in z.files:
            name, col = key.split("/")
            want.setdefault(name, {})[col] = z[key]
    return want


def _tables_v2(dims=None):
    """The tables of tests/unit/data/make_ckpt_v2.py: ckpt_tables' and d (admission)."""
    t = make_tables()
    t["d"] = kv.KvTable(2, name="d", seed=4, admit_min_count=2,
                        optimizer=kv.optimizers.Adagrad(0.1))
    return t


@pytest.mark.parametrize("world,owners", [(1, None), (2, None), (3, None),
                                          (2, "3-without-0")])
def test_v2_fixture_restores_on_any_world_size_and_map(world, owners):
    """tests/unit/data/ckpt_v2: written on 2 ranks by the format-2 code (its keys
    routed by (mix >> 40) mod 2, its files of 6 buckets each, tests/unit/data/
    make_ckpt_v2.py): a full save at step 2 and deltas at 3 (with removals) and 4, and
    table d's pending admission keys; the state at 4 is in ckpt_v2.expected.npz. Each
    rank gets the rows and pending keys it owns under the map."""
    m = json.loads((FIXTURE_V2 / "ckpt-0000000004" / "manifest.json").read_text())
    assert m["version"] == 2 and m["world_size"] == 2 and "owners" not in m
    assert {f["buckets"] for f in m["files"].values() if "buckets" in f} == {6}
    want = _expected(FIXTURE_V2.parent / "ckpt_v2.expected.npz")
    adm = want.pop("admission")
    owners = UNEVEN[owners]() if owners else None

    def pending(tables, comm):
        a = tables["d"].export_admission()
        assert (owner_of(a["keys"], owners or comm.size) == comm.rank).all()
        return a
    infos, state, parts = restore_on(FIXTURE_V2, world, owners=owners, tables=_tables_v2,
                                     extra=pending)
    assert infos[0].chain == ("ckpt-0000000002", "ckpt-0000000003", "ckpt-0000000004")
    same(state, want)
    keys = np.concatenate([p["keys"] for p in parts])
    order = np.argsort(keys)
    np.testing.assert_array_equal(keys[order], adm["keys"])
    for col in ("counts", "steps"):
        np.testing.assert_array_equal(np.concatenate([p[col] for p in parts])[order],
                                      adm[col])


def test_v2_restore_then_the_next_save_is_full_in_format_3(tmp_path):
    d = tmp_path / "c"
    shutil.copytree(FIXTURE_V2, d)

    def rank_main(comm):
        tables = _tables_v2()
        c = Checkpointer(tables, comm)
        c.restore(d)
        first = c.save(d, 5, incremental=True)
        second = c.save(d, 6, incremental=True)
        close(tables)
        return first.kind, second.kind
    assert run_ranks(3, rank_main)[0] == ("full", "delta")
    m = json.loads((d / "ckpt-0000000006" / "manifest.json").read_text())
    assert m["version"] == 4 and m["owners"]["world"] == 3
    want = _expected(FIXTURE_V2.parent / "ckpt_v2.expected.npz")
    want.pop("admission")
    _, state = restore_on(d, 2, tables=_tables_v2)
    same(state, want)


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
    for world, owners in ((1, None), (2, None), (3, None), (2, UNEVEN["random"]())):
        infos, state = restore_on(FIXTURE, world, owners=owners)
        assert infos[0].chain == ("ckpt-0000000002", "ckpt-0000000003", "ckpt-0000000004")
        same(state, want)


def test_version_1_writer_and_the_next_delta(tmp_path):
    """Checkpointer(version=1) writes format 1 (restored on any world size); a process
    that restored it saves its next incremental checkpoint in format 3 as a full one."""
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
    write(tmp_path / "now", ck.VERSION)
    got = _restore_growth(tmp_path / "now", 8 << 20)
    assert got["rows"] == n - n // 4 and got["chain"] == 2
    allowed = got["table"] + (8 << 20) + 5 * got["rows"]
    assert got["growth"] <= allowed, (got, allowed)
    write(tmp_path / "v1", 1)
    old = _restore_growth(tmp_path / "v1", 8 << 20)
    assert old["rows"] == got["rows"] and old["growth"] > allowed + (100 << 20), (old, got)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_v3_fixture_restores_on_any_world_size(world):
    """tests/unit/data/ckpt_v3: written on 2 ranks by the format-3 code (no data
    positions) under an uneven owner map (tests/unit/data/make_ckpt_v3.py): a full save
    at step 2 and deltas at 3 (with removals) and 4, table d with pending admission keys.
    Every rank gets its rows under the current map; RestoreInfo.progress is empty."""
    m = json.loads((FIXTURE_V3 / "ckpt-0000000004" / "manifest.json").read_text())
    assert m["version"] == 3 and "progress" not in m
    want = _expected(FIXTURE_V3.parent / "ckpt_v3.expected.npz")
    adm = want.pop("admission")
    infos, state, parts = restore_on(FIXTURE_V3, world, tables=_tables_v2,
                                     extra=lambda tables, comm: tables["d"].export_admission())
    assert infos[0].chain == ("ckpt-0000000002", "ckpt-0000000003", "ckpt-0000000004")
    assert infos[0].progress == ()
    same(state, want)
    keys = np.concatenate([p["keys"] for p in parts])
    np.testing.assert_array_equal(np.sort(keys), adm["keys"])


def test_progress_rides_the_manifest_per_rank(tmp_path):
    """Format 4: every rank's progress (JSON) is in the manifest, by rank, and comes
    back from restore on any world size."""
    d = tmp_path / "c"

    def save_main(comm):
        tables = make_tables()
        c = Checkpointer(tables, comm)
        c.save(d, 7, progress={"epoch": 1, "step": 3, "rank": comm.rank})
        close(tables)
    run_ranks(2, save_main)
    m = json.loads((d / "ckpt-0000000007" / "manifest.json").read_text())
    assert m["version"] == 4
    assert m["progress"] == [{"epoch": 1, "step": 3, "rank": r} for r in range(2)]

    def restore_main(comm):
        tables = make_tables()
        info = Checkpointer(tables, comm).restore(d)
        close(tables)
        return info.progress
    assert run_ranks(3, restore_main)[2] == tuple(m["progress"])


@pytest.mark.parametrize("shape", [(0,), (0, 16), (3, 0), (2, 3)])
def test_raw_bytes_of_any_array_empty_included(shape):
    # an export of a rank holding no rows wrote a (0, dim) array: memoryview.cast refused it
    a = np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape)
    assert bytes(_shards.raw_bytes(a)) == a.tobytes()
    assert bytes(_shards.raw_bytes(b"ab")) == b"ab"
