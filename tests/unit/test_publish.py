"""Publishing (kvcoll.publish) without TensorFlow: tables on 2 thread-ranks.

- a chain of 20 versions with evictions, deletes and re-created keys, replayed from
  the first base, equals the tables at every version (every row, bit for bit), and so
  does every base written along the way (a delta applied to a served base equals a
  full publish at the same step); incremental checkpoints saved in between neither
  hide a change from the publishes nor the reverse;
- a corrupt page, a truncated file and a delta that does not follow its parent are
  refused by name;
- a clear (a restore) starts a new chain with a base; retention keeps the newest bases,
  the deltas after them and what a fresh reader's lease needs.
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from kvcoll import KvTable, optimizers
from kvcoll.checkpoint import Checkpointer
from kvcoll.publish import (Lease, PublishError, Publisher, apply_version, list_versions,
                            load_base, load_version, read_latest, read_manifest, version_dir)
from kvcoll.routing import OwnerMap

sys.path.insert(0, str(Path(__file__).resolve().parent))
from threadcomm import run_ranks  # noqa: E402

DIMS = {"user": 4, "item": 3}


def make_tables():
    return {n: KvTable(d, name=n, seed=3, initializer=("uniform", -1, 1),
                       optimizer=optimizers.Adagrad(0.1)) for n, d in DIMS.items()}


def train_step(tables, comm, owners, step, rng):
    """One step of this rank's share: lookups (new keys), gradients, now and then
    evictions and deletes."""
    for name, t in tables.items():
        keys = rng.integers(-300, 300, 64)
        keys = keys[owners.owner_of(keys) == comm.rank]
        t.find_or_create(keys, step=step)
        t.apply_gradients(keys, rng.standard_normal((keys.size, t.dim)).astype(np.float32),
                          step=step)
        if step % 4 == 0:
            t.evict(min_last_step=max(0, step - 3))
        if step % 5 == 0 and keys.size:
            t.delete(keys[:3])


def union(snaps, name):
    keys = np.concatenate([s[name][0] for s in snaps])
    vals = np.concatenate([s[name][1] for s in snaps])
    order = np.argsort(keys)
    return keys[order], vals[order]


def snapshot(tables):
    out = {}
    for name, t in tables.items():
        e = t.export()
        out[name] = (e["keys"], e["values"])
    return out


def served(tables):
    return {n: (lambda e: (e["keys"][np.argsort(e["keys"])],
                           e["values"][np.argsort(e["keys"])]))(t.export())
            for n, t in tables.items()}


def test_chain_of_20_equals_the_tables(tmp_path):
    pub_dir, ck_dir = tmp_path / "pub", tmp_path / "ck"
    owners = OwnerMap.even(2)

    def rank(comm):
        rng = np.random.default_rng(10 + comm.rank)
        tables = make_tables()
        pub = Publisher(tables, comm, owners=owners, base_every=7, keep_bases=10)
        ckp = Checkpointer(tables, comm, owners=owners)
        states, infos = [], []
        for step in range(1, 21):
            train_step(tables, comm, owners, step, rng)
            if step % 3 == 0:  # incremental checkpoints in between: their own tracker
                ckp.save(ck_dir, step, incremental=step > 3)
            infos.append(pub.publish(pub_dir, step))
            states.append(snapshot(tables))
        for t in tables.values():
            t.close()
        return states, infos

    results = run_ranks(2, rank)
    infos = results[0][1]
    assert [i.version for i in infos] == list(range(1, 21))
    assert infos[0].kinds == ("base",)
    assert [i.kinds for i in infos[6:9]] == [("delta",), ("delta", "base"), ("delta",)]
    assert sum(i.removed for i in infos) > 0  # evictions and deletes were published
    got = list_versions(pub_dir)
    assert got["base"] == [1, 8, 15] and got["delta"] == list(range(2, 21))
    assert read_latest(pub_dir) == 20
    # replay: base 1, then every delta; compare with the tables at each version
    served_tables = make_tables()
    load_base(pub_dir, 1, served_tables)
    for v in range(1, 21):
        if v > 1:
            apply_version(served_tables, load_version(pub_dir, "delta", v, DIMS))
        now = served(served_tables)
        want = {n: union([r[0][v - 1] for r in results], n) for n in DIMS}
        for n in DIMS:
            np.testing.assert_array_equal(now[n][0], want[n][0], err_msg=f"{n} at {v}")
            np.testing.assert_array_equal(now[n][1], want[n][1], err_msg=f"{n} at {v}")
        if v in got["base"]:  # the full publish at the same version is the same
            alone = make_tables()
            load_base(pub_dir, v, alone)
            for n, (k, x) in served(alone).items():
                np.testing.assert_array_equal(k, now[n][0])
                np.testing.assert_array_equal(x, now[n][1])
    m = read_manifest(pub_dir, "delta", 20)
    assert m["parent"] == 19 and m["world_size"] == 2 and set(m["tables"]) == set(DIMS)
    assert m["dense"] is None and m["wall_time"] > 0


def test_refused_versions(tmp_path):
    d = tmp_path / "pub"

    def rank(comm):
        rng = np.random.default_rng(1)
        tables = make_tables()
        pub = Publisher(tables, comm, base_every=100)
        for step in range(1, 4):
            train_step(tables, comm, OwnerMap.even(1), step, rng)
            pub.publish(d, step)

    run_ranks(1, rank)
    load_version(d, "delta", 3, DIMS)  # fine as written
    m = read_manifest(d, "delta", 3)
    fname = m["tables"]["user"]["files"][0]
    path = os.path.join(m["_dir"], fname)
    data = bytearray(open(path, "rb").read())
    data[20] ^= 0xFF  # a byte of the first page
    open(path, "wb").write(bytes(data))
    with pytest.raises(PublishError, match="sha256.*refused"):
        load_version(d, "delta", 3, DIMS)
    open(path, "wb").write(bytes(data[:-5]))
    with pytest.raises(PublishError, match="bytes"):
        load_version(d, "delta", 3, DIMS)
    # a delta that does not name its parent
    mp = os.path.join(d, version_dir("delta", 2), "manifest.json")
    man = json.load(open(mp))
    man["parent"] = 0
    json.dump(man, open(mp, "w"))
    with pytest.raises(PublishError, match="parent"):
        read_manifest(d, "delta", 2)
    # another model's tables
    with pytest.raises(PublishError, match="another model"):
        load_version(d, "base", 1, {"user": 5, "item": 3})
    # a manifest that is too new, not a publish manifest, corrupt or gone
    for change, message in ((lambda m: {**m, "version": 99}, "version 99, newer.*upgrade "
                             "kvcoll to read it"),
                            (lambda m: {**m, "format": "kvcoll-checkpoint"},
                             "is not a kvcoll publish manifest")):
        json.dump(change(man), open(mp, "w"))
        with pytest.raises(PublishError, match=message):
            read_manifest(d, "delta", 2)
    open(mp, "w").write("{")
    with pytest.raises(PublishError, match="is corrupt"):
        read_manifest(d, "delta", 2)
    os.remove(mp)
    with pytest.raises(PublishError, match="is missing or incomplete .no manifest.json."):
        read_manifest(d, "delta", 2)


def test_clear_starts_a_new_chain_and_retention(tmp_path):
    d = tmp_path / "pub"

    def rank(comm):
        rng = np.random.default_rng(2)
        tables = make_tables()
        pub = Publisher(tables, comm, base_every=3, keep_bases=2, reader_ttl=60)
        kinds = []
        for step in range(1, 12):
            train_step(tables, comm, OwnerMap.even(1), step, rng)
            if step == 5:
                tables["user"].clear()  # what a restore does first
            if step == 9:
                Lease(d, "reader-a").hold(6)  # a server at version 6
            kinds.append(pub.publish(d, step).kinds)
        return kinds

    (kinds,) = run_ranks(1, rank)
    assert kinds[:6] == [("base",), ("delta",), ("delta",), ("delta", "base"), ("base",),
                         ("delta",)]
    got = list_versions(d)
    # bases at 1, 4, 5 (the clear), 8, 11: the newest two kept; the deltas after the
    # oldest kept one (8), and those the lease of a server at version 6 needs
    assert got["base"] == [8, 11]
    assert got["delta"] == [7, 8, 9, 10, 11]
    Lease(d, "reader-a").release()
    assert not os.listdir(os.path.join(d, "readers"))
