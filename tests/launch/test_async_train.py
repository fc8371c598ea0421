"""examples/train.py in SSP and ASP, end to end under mpirun with a timeout.

- convergence: after the same samples (300 steps of 4096 on 2 ranks), SSP (S=4) and ASP
  reach an eval_auc within 0.01 of BSP's, and --metrics-out reports the staleness
  observed (<= S for SSP) and every rank's own steps and samples;
- uneven data (rank r has 3 + 2 r steps) with a straggler: the rank that runs out first
  waits in finish() and nobody hangs, in either mode; SSP's lead stays <= S.
"""

import json
import os

import pytest

from mpirun import run
from test_train import TRAIN, UNEVEN

TIMEOUT = float(os.environ.get("KVCOLL_TEST_TRAIN_TIMEOUT", "400"))
# Why 300 steps (it was 150, and ssp4 failed once by 0.0113). Everything is seeded (data,
# planted model, weights) and BSP is deterministic (the same AUC, to the last bit, run
# after run); what varies in SSP/ASP is the schedule: which of the other rank's updates a
# pull sees depends on how fast each rank runs, i.e. on the machine's load. Measured on
# the shared 2-core VM, eval AUC of SSP minus BSP's (30,000 held-out samples):
#   150 steps, 20 runs:            mean +0.0010, sd 0.0014, from -0.0037 to +0.0026;
#   150 steps, one rank slowed by 150 ms a step (the other always at the bound), 4 runs:
#                                  +0.0039 to +0.0046;
#   300 steps, 8 runs:             mean -0.0005, sd 0.0006, from -0.0019 to +0.0001;
#   300 steps, one rank slowed as above, 2 runs (either rank): +0.0008, +0.0009.
# Early steps, when gradients are large, are where stale reads move the model most; by 300
# steps the model is near its plateau and the schedule's mark on it is 2-3x smaller, so
# the same bound (0.01) stands several spreads away from what a schedule does.
SAMPLES = ["--steps", "300", "--eval-samples", "30000", "--log-every", "50"]


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
    assert m["steps"] == 300 and m["local_steps"] == [300, 300]
    assert m["local_samples"] == [300 * 2048] * 2     # counts, not a rate (speed: bench/)
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
