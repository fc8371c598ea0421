"""Smoke test of `./dev bench peers`' adapters: each framework trains 2 steps on a tiny batch.

Every adapter (bench/peers/*_worker.py) is launched as the benchmark launches it
(bench/peers_bench.py `run_one`: mpirun, torchrun, the peer's own venv) on data written
by the benchmark's own writer, and must leave one record per rank with rows, a time, a
finite loss and one finite prediction per held-out sample. TFRA and TorchRec need
their venvs (.venv-peers/<peer>, built by `./dev bench peers --peers-setup-only`): where
one is missing or stale, its cases are skipped and say so (CI has neither).
"""

import numpy as np
import pytest

from bench import peers_bench

pytestmark = pytest.mark.slow

EVAL = 256
STEPS = 2


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("peers") / "data"
    peers_bench.write_data(str(path), steps=STEPS + 1, batch=64, eval_samples=EVAL)
    return path


@pytest.mark.parametrize("impl,world", [
    ("kvcoll", 1), ("kvcoll", 2), ("tfra", 1), ("tfra", 2), ("torchrec", 1), ("torchrec", 2),
    ("torchrec-exact", 1)])
def test_adapter_trains_two_steps(impl, world, data, tmp_path):
    peer = impl.split("-")[0]
    if peer != "kvcoll" and not peers_bench.venv_ready(peer):
        pytest.skip(f"no up-to-date {peer} venv at .venv-peers/{peer}: "
                    "`./dev bench peers --peers-setup-only` builds it")
    flags = ["--data", str(data), "--steps", str(STEPS), "--warmup", "1", "--eval-batch", "100"]
    if peer == "torchrec":
        flags += ["--table-rows", "1000"]
    records, _, error = peers_bench.run_one(impl, world, 2 // world, flags,
                                            str(tmp_path / "out"), timeout=300)
    assert error is None, error
    assert sorted(r["rank"] for r in records) == list(range(world))
    for r in records:
        assert r["framework"] == peer and r["world"] == world and r["steps"] == STEPS
        assert r["seconds"] > 0 and r["rows"] > 0 and r["peak_rss_bytes"] > 0
        assert np.isfinite(r["train_loss"]), r
        assert r["config"], r
    preds = np.concatenate([r["preds"] for r in sorted(records, key=lambda r: r["rank"])])
    assert preds.shape == (EVAL,) and np.isfinite(preds).all()
    if impl == "torchrec":
        assert sum(r["rows"] for r in records) == 26 * 1000          # fixed tables
        assert 0 < records[0]["rows_touched"] <= records[0]["distinct_ids"]
