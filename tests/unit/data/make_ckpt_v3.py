"""Writes tests/unit/data/ckpt_v3 with the format-3 checkpoint code, on 2 ranks
(threads): the tables of tests/mpi/ckpt_tables.py and a table "d" with exact admission
(pending keys in the admission state files), a full save at step 2 and deltas at 3
(with removals) and 4, under an owner map that is not the even split (the even map of
3 ranks without rank 0); and ckpt_v3.expected.npz, every table's rows at step 4 and
table d's pending admission keys (merged over the ranks, sorted by key).

Format 3 has no data positions (format 4 adds them): this script runs on a checkout of
the last commit that wrote format 3 (567c4fb), with that checkout's own build:

    git worktree add /tmp/kvcoll-v3 567c4fb && (cd /tmp/kvcoll-v3 && ./dev build)
    cd /tmp/kvcoll-v3 && .venv/bin/python /path/to/tests/unit/data/make_ckpt_v3.py

It writes next to itself (kept to show where the fixture came from; the fixture itself
is what the test reads).
"""

import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent.parent / "mpi"))

import numpy as np  # noqa: E402

import kvcoll as kv  # noqa: E402
from kvcoll.checkpoint import VERSION, Checkpointer  # noqa: E402
from kvcoll.routing import OwnerMap  # noqa: E402
from ckpt_tables import dump, make_tables, merge, play  # noqa: E402
from threadcomm import run_ranks  # noqa: E402

assert VERSION == 3, f"run this on a kvcoll that writes format 3, not {VERSION}"

out = HERE / "ckpt_v3"
OWNERS = OwnerMap.even(3).without([0])
shutil.rmtree(out, ignore_errors=True)


def tables_v3():
    t = make_tables()
    t["d"] = kv.KvTable(2, name="d", seed=4, admit_min_count=2,
                        optimizer=kv.optimizers.Adagrad(0.1))
    return t


def play_d(t, world, rank, step):
    """Table d: every key seen at a step counts a sighting; the second creates its row."""
    g = np.random.default_rng([7, step])
    ids = np.unique(g.integers(0, 2000, 600))
    mine = ids[OWNERS.owner_of(ids) == rank]
    t.find_or_create(mine, step=step)
    grads = g.normal(size=(mine.size, t.dim)).astype(np.float32)
    t.apply_gradients(mine, grads, step=step)


def rank_main(comm):
    tables = tables_v3()
    c = Checkpointer(tables, comm, owners=OWNERS)
    for step in range(1, 5):
        play({k: v for k, v in tables.items() if k != "d"}, OWNERS, comm.rank, step)
        play_d(tables["d"], comm.size, comm.rank, step)
        if step >= 2:
            c.save(out, step, incremental=step > 2)
    state = dump(tables)
    adm = tables["d"].export_admission()
    for t in tables.values():
        t.close()
    return state, adm


got = run_ranks(2, rank_main)
state = merge([s for s, _ in got])
keys = np.concatenate([a["keys"] for _, a in got])
counts = np.concatenate([a["counts"] for _, a in got])
steps = np.concatenate([a["steps"] for _, a in got])
order = np.argsort(keys)
arrays = {f"{name}/{k}": v for name, cols in state.items() for k, v in cols.items()}
arrays.update({"admission/keys": keys[order], "admission/counts": counts[order],
               "admission/steps": steps[order]})
np.savez(HERE / "ckpt_v3.expected.npz", **arrays)
print("wrote", out, {k: v.shape for k, v in arrays.items() if k.endswith("keys")})
