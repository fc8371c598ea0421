"""Row-wise Adagrad's one accumulator per row in checkpoints: a chain (a full save, then
a delta) written on 2 ranks restores on 1 and 3 with every row and its accumulator bit
for bit, training goes on from the restored state exactly as from the original, and a
checkpoint of row-wise Adagrad refuses to restore into per-element Adagrad tables (or
back), naming both, with the tables left as they were. Ranks are threads
(tests/unit/threadcomm.py)."""

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kvcoll import optimizers as opt
from kvcoll.checkpoint import Checkpointer
from kvcoll.errors import CheckpointError
from kvcoll.routing import owner_of
from kvcoll.table import KvTable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from threadcomm import run_ranks  # noqa: E402

DIM = 6
KEYS = np.arange(-300, 300, 7, dtype=np.int64)


def tables(optimizer):
    return {"emb": KvTable(DIM, name="emb", optimizer=optimizer, seed=3,
                           initializer=("uniform", -0.1, 0.1))}


def mine(keys, comm):
    return keys[owner_of(keys, comm.size) == comm.rank] if comm.size > 1 else keys


def train(ts, comm, steps):
    """Every rank updates the keys it owns with gradients that depend on (key, step)."""
    for step in steps:
        keys = mine(KEYS[(KEYS // 7 + step) % 3 != 0], comm)
        g = np.sin(keys[:, None] * 0.37 + step + np.arange(DIM)).astype(np.float32)
        ts["emb"].find_or_create(keys)
        ts["emb"].apply_gradients(keys, g, step=step)


def state(ts):
    e = ts["emb"].export()
    order = np.argsort(e["keys"])
    return {k: e[k][order] for k in ("keys", "values", "slots")}


def merged(states):
    out = {k: np.concatenate([s[k] for s in states]) for k in states[0]}
    order = np.argsort(out["keys"])
    return {k: v[order] for k, v in out.items()}


def test_rowwise_accumulators_survive_a_chain_on_any_world(tmp_path):
    o = opt.RowWiseAdagrad(0.1, initial_accumulator_value=0.01)

    def write(comm):
        ts = tables(o)
        c = Checkpointer(ts, comm)
        train(ts, comm, range(1, 4))
        c.save(tmp_path, 3)
        train(ts, comm, range(4, 6))
        c.save(tmp_path, 5, incremental=True)
        out = state(ts)
        ts["emb"].close()
        return out

    want = merged(run_ranks(2, write))
    assert want["slots"].shape == (len(want["keys"]), 1)     # one float per row
    assert np.unique(want["slots"]).size > 1                 # and they differ by row

    for world in (1, 3):
        def read(comm):
            ts = tables(o)
            Checkpointer(ts, comm).restore(tmp_path)
            got = state(ts)
            train(ts, comm, range(6, 8))                     # training goes on
            out = got, state(ts)
            ts["emb"].close()
            return out

        out = run_ranks(world, read)
        got = merged([g for g, _ in out])
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=f"{world} ranks: {k}")
        # the same two steps on a table that never went through a checkpoint
        cont = merged([c for _, c in out])
        ref = tables(o)
        train(ref, SimpleNamespace(size=1, rank=0), range(1, 8))
        for k in cont:
            np.testing.assert_array_equal(cont[k], state(ref)[k], err_msg=f"{world}: {k}")
        ref["emb"].close()


@pytest.mark.parametrize("saved,restored", [
    (opt.RowWiseAdagrad(0.1), opt.Adagrad(0.1)),
    (opt.Adagrad(0.1), opt.RowWiseAdagrad(0.1)),
])
def test_rowwise_and_elementwise_adagrad_do_not_mix(tmp_path, saved, restored):
    def write(comm):
        ts = tables(saved)
        train(ts, comm, range(1, 3))
        Checkpointer(ts, comm).save(tmp_path, 2)
        ts["emb"].close()

    run_ranks(1, write)

    def read(comm):
        ts = tables(restored)
        train(ts, comm, range(1, 2))
        before = state(ts)
        with pytest.raises(CheckpointError) as info:
            Checkpointer(ts, comm).restore(tmp_path)
        after = state(ts)
        ts["emb"].close()
        for k in before:
            np.testing.assert_array_equal(after[k], before[k])
        return str(info.value)

    text = run_ranks(1, read)[0]
    assert "rowwise_adagrad" in text and "'adagrad'" in text, text
