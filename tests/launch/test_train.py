"""examples/train.py end to end, under mpirun with a timeout.

- convergence: the README's run (DeepFM, synthetic data, 2 ranks, default flags except
  --eval-samples, see CONVERGENCE_ARGS) reaches eval_auc >= 0.5 + 0.8 * (planted_auc - 0.5)
  on held-out samples, and --metrics-out holds every documented field;
- --model wdl runs a few steps on 1 rank, writes its metrics and TensorBoard events;
- (--step-mode ssp and asp: tests/launch/test_async_train.py);
- Criteo TSV files (--data): a small file trains with the demo's defaults (a fraction
  held out, its size printed); a file smaller than one batch of hold-out ends with an
  error that says so and how to fix it;
- uneven data: a rank whose data ends first joins the others' steps with no samples, and
  the periodic evaluation, a collective, goes on.
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from mpirun import run

ROOT = Path(__file__).resolve().parent.parent.parent
TRAIN = ROOT / "examples" / "train.py"
TIMEOUT = float(os.environ.get("KVCOLL_TEST_TRAIN_TIMEOUT", "400"))

# The README's command is `./dev demo` = `mpirun -np 2 python examples/train.py` with the
# defaults; here only the final evaluation is smaller (50k instead of 100k samples, which
# still puts the AUC's standard error below 0.003).
CONVERGENCE_ARGS = ["--eval-samples", "50000"]

REQUIRED = ("world_size", "step_mode", "staleness", "steps", "global_batch_size",
            "local_steps", "local_samples", "samples_per_sec", "final_loss", "eval_auc",
            "loss_curve", "tables")


def run_train(world: int, args, timeout: float = TIMEOUT, script=None):
    script = ["-c", script] if script else [TRAIN]
    return run(world, [*script, "--no-progress", *args], timeout, "train.py")


def check_metrics(m: dict, world: int, synthetic: bool = True):
    missing = [k for k in REQUIRED + (("planted_auc",) if synthetic else ()) if k not in m]
    assert not missing, f"metrics lack {missing}: {sorted(m)}"
    assert m["world_size"] == world
    assert m["step_mode"] == "bsp" and m["staleness"] == 0
    # every step trained the whole global batch, split over the ranks as evenly as can be
    # (counts, not a rate: speed is bench/'s, not a test's)
    batch, steps = m["global_batch_size"], m["steps"]
    assert m["local_steps"] == [steps] * world, m["local_steps"]
    assert sum(m["local_samples"]) == steps * batch, m["local_samples"]
    assert all(n in (steps * (batch // world), steps * (batch // world + 1))
               for n in m["local_samples"]), m["local_samples"]
    assert len(m["loss_curve"]) == m["steps"]
    assert [s for s, _ in m["loss_curve"]] == list(range(1, m["steps"] + 1))
    assert sorted(m["tables"]) == sorted(f"C{i}" for i in range(1, 27))
    for name, t in m["tables"].items():
        assert t["rows"] > 0 and t["bytes"] > 0, (name, t)


def test_convergence_two_ranks(tmp_path):
    out_json = tmp_path / "metrics.json"
    code, out = run_train(2, [*CONVERGENCE_ARGS, "--metrics-out", out_json])
    assert code == 0, f"exit {code}:\n{out[-8000:]}"
    m = json.loads(out_json.read_text())
    check_metrics(m, world=2)
    target = 0.5 + 0.8 * (m["planted_auc"] - 0.5)
    assert 0.75 <= m["planted_auc"] <= 0.85, m["planted_auc"]
    assert m["eval_auc"] >= target, (
        f"eval_auc {m['eval_auc']:.4f} < target {target:.4f} "
        f"(planted {m['planted_auc']:.4f})\n{out[-3000:]}")
    first = sum(l for _, l in m["loss_curve"][:10]) / 10
    assert m["final_loss"] < first
    # rank 0 alone prints the summary and the periodic lines (--log-every 100)
    assert out.count("eval AUC") == 1, out[-3000:]
    assert out.count("step   100  loss") == 1, out[-3000:]


@pytest.fixture(scope="module")
def wdl_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("wdl")
    code, out = run_train(1, ["--model", "wdl", "--steps", "6", "--batch-size", "1024",
                              "--eval-samples", "4000", "--log-every", "3",
                              "--metrics-out", d / "m.json", "--logdir", d / "tb"])
    return d, code, out


def test_wdl_one_rank(wdl_run):
    d, code, out = wdl_run
    assert code == 0, f"exit {code}:\n{out[-8000:]}"
    m = json.loads((d / "m.json").read_text())
    check_metrics(m, world=1)
    assert m["model"] == "wdl" and m["steps"] == 6 and m["global_batch_size"] == 1024
    assert 0.0 <= m["eval_auc"] <= 1.0
    assert "step     3" in out, out[-3000:]          # the plain log line, --log-every 3


def test_logdir_events(wdl_run):
    d, code, out = wdl_run
    assert code == 0, f"exit {code}:\n{out[-8000:]}"
    events = list((d / "tb").glob("events.out.tfevents.*"))
    assert events, f"no events file in {d / 'tb'}: {list((d / 'tb').iterdir())}"
    blob = b"".join(p.read_bytes() for p in events)
    for tag in (b"loss", b"eval_auc", b"samples_per_sec", b"table_rows"):
        assert tag in blob, f"no {tag!r} scalar in the events file"


# train.py with rank r's synthetic data cut to 3 + 2 r steps.
UNEVEN = f"""
import sys
sys.path.insert(0, {str(TRAIN.parent)!r})
import train
init = train.Synthetic.__init__
def uneven(self, args, rank, world):
    init(self, args, rank, world)
    self.steps = 3 + 2 * rank
train.Synthetic.__init__ = uneven
sys.exit(train.main())
"""


def test_uneven_data(tmp_path):
    out_json = tmp_path / "m.json"
    code, out = run_train(2, ["--batch-size", "512", "--eval-samples", "2000", "--log-every", "2",
                              "--metrics-out", out_json], timeout=200, script=UNEVEN)
    assert code == 0, f"exit {code}:\n{out[-8000:]}"
    m = json.loads(out_json.read_text())
    assert m["steps"] == 5 and m["served_steps"] == 2          # rank 0 ran 3, served 2
    assert m["local_steps"] == [3, 5] and m["local_samples"] == [3 * 256, 5 * 256]
    assert [s for s, _ in m["loss_curve"]] == [1, 2, 3]         # rank 0's own steps
    # every rank joins every global step, so the periodic evaluation (a collective) goes
    # on after rank 0's data ran out
    assert "step     2  loss" in out and "step     4  loss" in out, out[-3000:]


def test_kvcollrun_launches_ranks():
    """launch/kvcollrun wraps mpirun (root, oversubscribe, tagged output, job timeout);
    kv.init gives TensorFlow (not imported yet) each rank's share of the host's cores."""
    import subprocess

    env = dict(os.environ, KVCOLLRUN_TIMEOUT="120", PYTHONPATH=str(ROOT))
    for name in ("KVCOLL_STEP_MODE", "TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS"):
        env.pop(name, None)
    proc = subprocess.run(
        [str(ROOT / "launch" / "kvcollrun"), "-np", "3", sys.executable, "-c",
         "import os, kvcoll; kvcoll.init(); print('size', kvcoll.size(), 'rank', kvcoll.rank(), "
         "'tf', os.environ['TF_NUM_INTRAOP_THREADS'], os.environ['TF_NUM_INTEROP_THREADS']); "
         "kvcoll.shutdown()"], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    share = max(1, len(os.sched_getaffinity(0)) // 3)
    for r in range(3):
        assert f"size 3 rank {r} tf {share} 1" in proc.stdout, proc.stdout
    assert "[1," in proc.stdout  # --tag-output prefixes each line with its rank


def criteo_file(path: Path, lines: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for _ in range(lines):
            nums = [str(v) for v in rng.integers(0, 50, 13)]
            cats = [f"{v:08x}" for v in rng.integers(0, 2**32, 26) % 997]
            f.write("\t".join([str(int(rng.integers(0, 2))), *nums, *cats]) + "\n")
    return path


def test_a_small_criteo_file_trains_with_the_demos_defaults(tmp_path):
    """20,000 lines and the demo's defaults (global batch 4096, --eval-samples 100,000):
    a tenth of the lines is held out, in one whole batch, and the size is printed."""
    data = criteo_file(tmp_path / "day.tsv", 20_000)
    out_json = tmp_path / "m.json"
    code, out = run_train(2, ["--data", data, "--metrics-out", out_json], timeout=300)
    assert code == 0, f"exit {code}:\n{out[-8000:]}"
    assert ("holding out the first 4,096 lines of --data for evaluation "
            "(--holdout-fraction 0.1 of 20,000 lines); training on the rest") in out, out[-3000:]
    m = json.loads(out_json.read_text())
    assert m["steps"] == 4 and m["eval_samples"] == 4096   # 15,904 lines: 3 whole + 1 short


def test_criteo_file_smaller_than_the_holdout(tmp_path):
    data = criteo_file(tmp_path / "day.tsv", 50)
    code, out = run_train(2, ["--data", data, "--batch-size", "64"], timeout=200)
    assert code == 1, f"exit {code}:\n{out[-8000:]}"
    assert ("error: no training data: the --data files hold 50 lines and the evaluation "
            "hold-out takes the first 64 (at least one whole global batch of --batch-size "
            "64)") in out, out[-3000:]
    assert "pass a smaller --batch-size, or --eval-data PATH" in out
    data = criteo_file(tmp_path / "day.tsv", 300)
    out_json = tmp_path / "m.json"
    code, out = run_train(2, ["--data", data, "--batch-size", "64", "--eval-samples", "64",
                              "--metrics-out", out_json], timeout=200)
    assert code == 0, f"exit {code}:\n{out[-8000:]}"
    assert ("holding out the first 64 lines of --data for evaluation (--holdout-fraction 0.1 "
            "of 300 lines)") in out
    m = json.loads(out_json.read_text())
    assert m["steps"] == 4 and m["global_batch_size"] == 64   # 236 lines: 3 whole + 1 short
