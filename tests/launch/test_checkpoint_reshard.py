"""Checkpoints across world sizes and crashes, as separate mpirun jobs in sequence.

- A 3-rank job trains 10 BSP steps, saving a full checkpoint at step 4 and deltas at
  5, 6 and 7 (and, into another directory, a full checkpoint at step 7); it dumps the
  whole state at step 7 and records its loss curve.
- Jobs on 1, 2, 3 and 4 ranks restore the full checkpoint of step 7 and the chain
  full(4) + 3 deltas (format 3: each rank reads the pages of its buckets only): every
  row, slot, row header, dense and optimizer variable and the step equal the dump bit
  for bit; training on continues along the uninterrupted loss curve (exactly on 3
  ranks, to 1e-5 on 1, 2 and 4: the sums run in another order).
- A 2-rank job saves at step 2 and is killed (SIGKILL on rank 1, after its first file)
  in the middle of the save at step 4: `latest` still names step 2, which restores.
"""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from mpirun import run

ROOT = Path(__file__).resolve().parent.parent.parent
DRIVER = ROOT / "tests" / "mpi" / "ckpt_driver.py"
TIMEOUT = float(os.environ.get("KVCOLL_TEST_MPI_TIMEOUT", "240"))


def run_driver(zygote, world: int, args, timeout: float = TIMEOUT):
    """The driver on `world` ranks, each a fork of the zygote (conftest.py)."""
    return run(world, [DRIVER, *args], timeout, "ckpt_driver.py", zygote=zygote)


def load(path) -> dict:
    with np.load(path) as z:
        return dict(z)


def assert_same_state(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, zygote):
    d = tmp_path_factory.mktemp("ckpt")
    code, out = run_driver(zygote, 3, ["train", "--steps", 10, "--dir", d / "chain",
                                       "--full-at", 4, "--incremental-at", "5,6,7",
                                       "--full-dir", d / "full", "--full-dir-at", 7,
                                       "--dump-at", 7, "--dump", d / "s7.npz",
                                       "--losses", d / "losses.json"])
    assert code == 0, out[-8000:]
    return d


def test_chain_layout(trained):
    chain = trained / "chain"
    assert (chain / "latest").read_text() == "ckpt-0000000007\n"
    kinds = [json.loads((chain / f"ckpt-{s:010d}" / "manifest.json").read_text())
             for s in (4, 5, 6, 7)]
    assert [m["kind"] for m in kinds] == ["full", "delta", "delta", "delta"]
    assert [m["parent"] for m in kinds] == [None, "ckpt-0000000004", "ckpt-0000000005",
                                            "ckpt-0000000006"]
    assert all(m["world_size"] == 3 and m["version"] == 4 for m in kinds)
    assert all(m["owners"] == {"buckets": 65536, "world": 3,
                               "runs": [0, 21846, 1, 21845, 2, 21845]} for m in kinds)
    # a delta holds fewer rows than the full checkpoint it follows
    rows = [sum(t["rows"] for t in m["tables"].values()) for m in kinds]
    assert all(r < rows[0] for r in rows[1:]), rows


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_restore_on_any_world_size(trained, world, zygote):
    d = trained
    code, out = run_driver(zygote, world, ["resume", "--steps", 10, "--dir", d / "chain",
                                           "--dump", d / f"r{world}.npz", "--losses",
                                           d / f"l{world}.json", "--also-dir", d / "full",
                                           "--also-dump", d / f"f{world}.npz"])
    assert code == 0, out[-8000:]
    assert "chain ['ckpt-0000000004', 'ckpt-0000000005', 'ckpt-0000000006', " \
           "'ckpt-0000000007']) at step 7" in out, out[-3000:]
    expected = load(d / "s7.npz")
    assert int(expected["step"]) == 7
    assert_same_state(load(d / f"f{world}.npz"), expected)   # the full save of step 7
    assert_same_state(load(d / f"r{world}.npz"), expected)   # full(4) + 3 deltas
    base = json.loads((d / "losses.json").read_text())
    cont = json.loads((d / f"l{world}.json").read_text())
    assert sorted(cont, key=int) == ["8", "9", "10"]
    got = [cont[k] for k in ("8", "9", "10")]
    want = [base[k] for k in ("8", "9", "10")]
    if world == 3:
        assert got == want
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5)


def test_killed_save_leaves_previous_checkpoint(tmp_path, zygote):
    d = tmp_path
    code, out = run_driver(zygote, 2, ["train", "--steps", 4, "--dir", d / "ck",
                                       "--full-at", 2, "--dump-at", 2, "--dump", d / "s2.npz",
                                       "--kill-rank", 1, "--kill-at", 4,
                                       "--kill-after-files", 1])
    assert code != 0, out[-4000:]
    ck = d / "ck"
    assert (ck / "latest").read_text() == "ckpt-0000000002\n"
    left = sorted(p.name for p in ck.iterdir())
    assert any(".tmp-" in n for n in left), left          # the abandoned save
    assert "ckpt-0000000004" not in left, left
    code, out = run_driver(zygote, 2, ["resume", "--steps", 2, "--dir", ck,
                                       "--dump", d / "r.npz"])
    assert code == 0, out[-8000:]
    assert_same_state(load(d / "r.npz"), load(d / "s2.npz"))
    # the next save removes the abandoned directory
    code, out = run_driver(zygote, 1, ["resume", "--steps", 3, "--dir", ck,
                                       "--dump", d / "r3.npz", "--full-at", 3])
    assert code == 0, out[-8000:]
    left = sorted(p.name for p in ck.iterdir())
    assert not any(".tmp-" in n for n in left) and "ckpt-0000000003" in left, left


TRAIN = ROOT / "examples" / "train.py"


def test_train_py_checkpoint_restore_export(tmp_path, zygote):
    """examples/train.py --checkpoint-dir/-every, --incremental-every, --restore on another
    world size, --export-dir."""
    small = ["--no-progress", "--batch-size", "256", "--eval-samples", "1000", "--hidden", "16",
             "--vocab", "10000"]
    ck, ex = tmp_path / "ck", tmp_path / "ex"
    code, out = run(2, [TRAIN, *small, "--steps", "5", "--checkpoint-dir", ck,
                        "--checkpoint-every", "2", "--incremental-every", "1"], TIMEOUT,
                    "train.py", zygote=zygote)
    assert code == 0, out[-8000:]
    assert "step     1  saved full" in out          # no parent yet: full
    assert "step     3  saved delta" in out and "step     4  saved full" in out
    assert "saved delta checkpoint ckpt-0000000005" in out
    assert (ck / "latest").read_text() == "ckpt-0000000005\n"
    code, out = run(1, [TRAIN, *small, "--steps", "7", "--checkpoint-dir", ck, "--restore",
                        "--export-dir", ex, "--metrics-out", tmp_path / "m.json"],
                    TIMEOUT, "train.py", zygote=zygote)
    assert code == 0, out[-8000:]
    assert "restored ckpt-0000000005 (step 5; a full checkpoint and 1 incremental" in out, \
        out[-3000:]
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["restored_from_step"] == 5 and m["steps"] == 7
    assert [s for s, _ in m["loss_curve"]] == [6, 7]
    assert (ck / "latest").read_text() == "ckpt-0000000007\n"
    assert (ex / "saved_model" / "saved_model.pb").exists()
    index = json.loads((ex / "embeddings" / "index.json").read_text())
    assert sorted(index["tables"]) == sorted(f"C{i}" for i in range(1, 27))
    assert sum(t["rows"] for t in index["tables"].values()) == m["table_rows"]
