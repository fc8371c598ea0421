"""A rank SIGKILLed at random moments: during training, mid-save, mid-export and
mid-restore, KVCOLL_TEST_KILL_TRIALS trials of each, in one shuffled sequence of
2-rank BSP jobs sharing one checkpoint directory (tests/launch/kill_driver.py, kvcoll's
public API only). Each trial restores what the trials before it left, trains, saves and
exports; one rank kills itself after a delay drawn uniformly from the length of the
phase under test (measured by running that phase once first). Every trial checks:

- no hang: the job has ended within 10 s of the kill, with a non-zero exit code;
- the restore found the last complete checkpoint: the step of the last save that
  returned, or of a save that was killed after it had completed (never a torn one);
- BSP continues on the loss curve of an uninterrupted run, bit for bit (same world size).

After each phase's worth of trials a 1-rank job restores the latest checkpoint and
trains on, on the same loss curve (to 1e-5: the sums run in another order). Every phase
must have had kills inside it, and at least half of all kills must have landed inside
their phase (else the test would not test them). The numbers (trials per phase, kills inside, seconds per trial) are printed.

Each trial is a new 2-rank job (mpirun through launch/kvcollrun, as a user's) whose ranks
are forks of a zygote that imported TensorFlow, Keras and kvcoll once
(tests/launch/zygote.py): a victim's SIGKILL reaches mpirun as the rank's own. A trial
took 2.9 s on the 2-core VM (15 of each phase: 198 s), against 8-10 s when each rank
imported TensorFlow itself (620 s). `./dev faults` (CI runs it) runs the 20 trials of
each phase that issue 18 asked for (KVCOLL_TEST_KILL_TRIALS=20, KVCOLL_TEST_KILL_SEED=18);
`./dev test` skips them.
"""

import os
import random
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from mpirun import ZYGOTE

ROOT = Path(__file__).resolve().parent.parent.parent
KVCOLLRUN = ROOT / "launch" / "kvcollrun"
DRIVER = ROOT / "tests" / "launch" / "kill_driver.py"
TRIALS = int(os.environ.get("KVCOLL_TEST_KILL_TRIALS", "5"))   # per phase
SEED = int(os.environ.get("KVCOLL_TEST_KILL_SEED", "2026"))     # the moments and victims
PHASES = ("train", "save", "export", "restore")
NO_HANG = 10.0      # seconds from the kill to the end of the job

pytestmark = [pytest.mark.slow, pytest.mark.faults]     # (./dev faults runs them)


def _env() -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2",
               KVCOLLRUN_KILL_AFTER="5")
    env.pop("KVCOLL_STEP_MODE", None)
    return env


def job(zygote, world: int, args: list, timeout: float = 240) -> tuple[int, str, float]:
    """(exit code, output, time.time() at the end) of the driver on `world` ranks."""
    proc = subprocess.Popen([str(KVCOLLRUN), "-np", str(world), sys.executable, "-S",
                             str(ZYGOTE), "rank", str(zygote), str(DRIVER), *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_env(), cwd=ROOT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, _ = proc.communicate()
        pytest.fail(f"kill_driver.py {args} hung past {timeout:.0f}s:\n{out[-6000:]}")
    return proc.returncode, out, time.time()


def losses(out: str) -> dict:
    return {int(s): float.fromhex(v) for s, v in re.findall(r"loss (\d+) (\S+)$", out, re.MULTILINE)}


def schedule(rng: random.Random) -> list:
    """TRIALS of each phase, shuffled; the first kills a save or an export, which come
    after a first save: the restores of the later trials have something to restore."""
    order = [p for p in PHASES for _ in range(TRIALS)]
    rng.shuffle(order)
    first = next(i for i, p in enumerate(order) if p in ("save", "export"))
    order.insert(0, order.pop(first))
    return order


def test_sigkill_at_random_moments(tmp_path, zygote):
    rng = random.Random(SEED)
    ck, ex = tmp_path / "ck", tmp_path / "ex"
    # a trial saves at most 5 steps past its restore and trains at most 14
    steps = TRIALS * len(PHASES) * 5 + 16
    code, out, _ = job(zygote, 2, ["--steps", steps])
    assert code == 0, out[-6000:]
    ref = losses(out)
    assert sorted(ref) == list(range(1, steps + 1)), out[-3000:]

    confirmed = 0             # step of the last save that returned (0: none yet)
    maybe = set()             # steps of later saves killed while they ran: complete or not
    inside, seconds = Counter(), []
    for i, phase in enumerate(schedule(rng)):
        victim = rng.randrange(2)
        t0 = time.time()
        code, out, t_end = job(zygote, 2, ["--dir", ck, "--export-dir", ex, "--phase", phase,
                                   "--victim", victim, "--seed", i, "--fresh-ok"])
        seconds.append(t_end - t0)
        where = f"trial {i} ({phase}, victim rank {victim})"
        armed = re.search(rf"armed {phase} (\S+) (\S+)$", out, re.MULTILINE)
        assert armed, f"{where}: the kill was never armed (exit {code}):\n{out[-6000:]}"
        t_kill = float(armed.group(2)) + float(armed.group(1))
        assert code != 0, f"{where}: exit 0 after a kill:\n{out[-4000:]}"
        assert t_end - t_kill <= NO_HANG, f"{where}: ended {t_end - t_kill:.1f}s after the kill"
        restored = int(re.search(r"restored (\d+)", out).group(1))
        assert restored in {confirmed} | maybe, (
            f"{where}: restored step {restored}; the last complete checkpoint is one of "
            f"{sorted({confirmed} | maybe)}")
        confirmed, maybe = restored, {s for s in maybe if s > restored}
        mine = losses(out)
        assert (mine or phase == "restore") and all(ref[s] == v for s, v in mine.items()), (
            f"{where}: losses off the uninterrupted curve: "
            f"{[(s, v, ref[s]) for s, v in mine.items() if ref[s] != v]}")
        saved = [int(s) for s in re.findall(r"saved (\d+) \w+$", out, re.MULTILINE)]
        confirmed = max([confirmed, *saved])
        if phase == "save" and "save done" not in out:
            maybe.add(max(mine))      # the armed save, at the last step trained
        inside[phase] += f"{phase} done" not in out
        if (i + 1) % TRIALS == 0:
            check_on_one_rank(zygote, ck, ref, confirmed, maybe)
    print(f"\nSIGKILL trials: {TRIALS} per phase, kills inside the phase {dict(inside)}, "
          f"{np.mean(seconds):.1f}s per trial (max {max(seconds):.1f}s), "
          f"{sum(seconds):.0f}s in all")
    # kills that land after their phase still test a kill, but not that phase's
    assert all(inside[p] for p in PHASES), dict(inside)
    assert sum(inside.values()) >= len(PHASES) * TRIALS // 2, dict(inside)


def check_on_one_rank(zygote, ck: Path, ref: dict, confirmed: int, maybe: set) -> None:
    """The latest checkpoint restores on 1 rank, and training goes on along the curve."""
    code, out, _ = job(zygote, 1, ["--dir", ck, "--phase", "check"])
    assert code == 0, out[-6000:]
    restored = int(re.search(r"restored (\d+)", out).group(1))
    assert restored in {confirmed} | maybe, (restored, confirmed, maybe)
    mine = losses(out)
    assert sorted(mine) == [restored + 1, restored + 2], out[-3000:]
    np.testing.assert_allclose([mine[s] for s in sorted(mine)],
                               [ref[s] for s in sorted(mine)], rtol=1e-5)
