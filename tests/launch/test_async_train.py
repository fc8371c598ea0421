"""examples/train.py in SSP and ASP, end to end under mpirun with a timeout.

- convergence: after the same samples (150 steps of 4096 on 2 ranks), SSP (S=4) and ASP
  reach an eval_auc within 0.01 of BSP's, and --metrics-out reports the staleness
  observed (<= S for SSP) and every rank's own steps/s;
- uneven data (rank r has 3 + 2 r steps) with a straggler: the rank that runs out first
  waits in finish() and nobody hangs, in either mode; SSP's lead stays <= S.
"""

import json
import os

import pytest

from mpirun import run
from test_train import TRAIN, UNEVEN

TIMEOUT = float(os.environ.get("KVCOLL_TEST_TRAIN_TIMEOUT", "400"))
SAMPLES = ["--steps", "150", "--eval-samples", "30000", "--log-every", "50"]


def train(args, out_json, script=None, timeout=TIMEOUT):
    argv = ["-c", script] if script else [TRAIN]
    code, out = run(2, [*argv, "--no-progress", *args, "--metrics-out", out_json], timeout,
                    "train.py")
    assert code == 0, f"exit {code}:\n{out[-8000:]}"
    return json.loads(out_json.read_text()), out


@pytest.fixture(scope="module")
def bsp_auc(tmp_path_factory):
    m, _ = train(SAMPLES, tmp_path_factory.mktemp("bsp") / "m.json")
    assert m["step_mode"] == "bsp" and m["max_staleness_observed"] == 0
    return m["eval_auc"]


@pytest.mark.parametrize("mode", [["--step-mode", "ssp", "--staleness", "4"],
                                  ["--step-mode", "asp"]], ids=["ssp4", "asp"])
def test_async_converges_like_bsp(tmp_path, bsp_auc, mode):
    m, out = train([*SAMPLES, *mode], tmp_path / "m.json")
    assert m["step_mode"] == mode[1]
    assert m["staleness"] == (4 if mode[1] == "ssp" else None)
    assert m["steps"] == 150 and m["local_steps"] == [150, 150]
    assert m["local_samples"] == [150 * 2048] * 2     # counts, not a rate (speed: bench/)
    if mode[1] == "ssp":
        assert m["max_staleness_observed"] <= 4 and m["max_clock_lead"] <= 4
    assert abs(m["eval_auc"] - bsp_auc) <= 0.01, (
        m["eval_auc"], bsp_auc, "staleness", m["max_staleness_observed"], "lead",
        m["max_clock_lead"], "steps/s", m["steps_per_sec"], out[-2000:])
    assert out.count("eval AUC") == 1 and "step    50  loss" in out, out[-3000:]


@pytest.mark.parametrize("mode", [["--step-mode", "ssp", "--staleness", "1"],
                                  ["--step-mode", "asp"]], ids=["ssp1", "asp"])
def test_async_uneven_data_with_a_straggler(tmp_path, mode):
    m, out = train(["--batch-size", "512", "--eval-samples", "2000", "--log-every", "2",
                    "--slow-rank", "1", "--slow-ms", "50", *mode], tmp_path / "m.json",
                   script=UNEVEN, timeout=200)
    assert m["local_steps"] == [3, 5] and m["steps"] == 5      # rank 0 ran out first
    assert m["local_samples"] == [3 * 256, 5 * 256]
    assert [s for s, _ in m["loss_curve"]] == [1, 2, 3]       # rank 0's own steps
    assert 0.0 <= m["eval_auc"] <= 1.0
    if mode[1] == "ssp":
        assert m["max_clock_lead"] <= 1 and m["max_staleness_observed"] <= 1
