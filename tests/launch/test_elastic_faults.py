"""The elastic fault trials at full strength (`./dev faults`; skipped otherwise, unless
KVCOLL_TEST_FAULTS=1):

- no false alarm: multi-rank test modules of tests/mpi/ (Keras BSP training, fit,
  checkpoints: tracing, computing, writing and reading files) pass on 3 ranks under
  `kvcollrun --elastic` with ULFM's heartbeat detector on, and no rank is declared lost;
- KVCOLL_TEST_ELASTIC_TRIALS (default 6) trials on three network-namespace hosts: rank 2
  killed or stopped at a random moment of a random step (seeded by
  KVCOLL_TEST_ELASTIC_SEED), each checked as tests/launch/test_elastic.py's
  test_a_lost_rank_continues_in_memory checks one: the survivors finish, their rows
  equal an uninterrupted run's bit for bit, the lost buckets the chain's, the losses
  after it a fresh 2-rank run's.
"""

import os
import random
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mpirun import run as mpirun  # noqa: E402
from test_elastic import cleanup, hosts, lose_a_rank  # noqa: E402,F401 - fixtures

ROOT = Path(__file__).resolve().parent.parent.parent
TRIALS = int(os.environ.get("KVCOLL_TEST_ELASTIC_TRIALS", "6"))
SEED = int(os.environ.get("KVCOLL_TEST_ELASTIC_SEED", "30"))

pytestmark = [pytest.mark.slow, pytest.mark.faults]   # (./dev faults runs them)

# What the whole output says of a rank that failed, revoked or was suspected (the
# assertion shows only its end, where the last rank to fail wrote): ULFM's detector
# ("fd_event_cb": a missed heartbeat), the runtime ("ompi: Process ... failed"), a crash
# (Open MPI's signal handler), a rank's own error, the collective schedule that failed
# (and, when a rank fails a test, the other ranks' stacks: tests/mpi/conftest.py)
SUSPECT = ("fd_event_cb", "ompi: Process", "Signal:", "Failing at address", "Error:",
           "NBC_Progress", "revoked", "unanimous", "kvcoll: rank", "hread 0x")


def suspect(line: str) -> bool:
    return any(m in line for m in SUSPECT) or \
        ('File "' in line and ("/kvcoll/" in line or "/tests/mpi/" in line))


# (test_keras_bsp's step-by-step test counts a step's collectives: an elastic step has
# one more, its agreement)
@pytest.mark.parametrize("module,only", [("test_keras_bsp.py", "not step_by_step"),
                                         ("test_fit.py", ""), ("test_checkpoint.py", ""),
                                         ("test_ssp.py", "")])
def test_no_false_alarm_in_the_multi_rank_tests(module, only):
    code, out = mpirun(3, ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           *(["-k", only] if only else []), ROOT / "tests" / "mpi" / module],
                       600, f"{module} (elastic)",
                       # (ULFM says why it suspected a rank: a missed heartbeat, or the
                       # runtime's report; at the end of a run the ranks leave without
                       # MPI_Finalize, which it reports too)
                       env_extra={"OMPI_MCA_mpi_ft_verbose": "1"},
                       launcher=[ROOT / "launch" / "kvcollrun", "--elastic", "--min-np", 3])
    why = [x for x in out.splitlines() if suspect(x)]
    said = ("what the ranks said of a failure:\n" + "\n".join(why[:150])
            + f"\n-- the output's end:\n{out[-6000:]}")
    assert code == 0 and " passed" in out, said
    assert not re.search(r'kvcoll-elastic \{"event": "(lost|fenced)', out), said


def test_the_agreement_is_right_with_one_thread_in_mpi():
    """What kvcoll.elastic relies on (Session._vote quiesces the prefetch helper first):
    ULFM's agreement with no other thread of a rank in MPI meanwhile gives the AND of
    the votes. Beside a thread running collectives it did not in Open MPI 5.0.11 (see
    agree_job.py): that count is printed, not asserted."""
    counts = {}
    for mode in ("serial", "thread"):
        for _ in range(3):  # (Open MPI's start-up with ULFM crashes now and then: again)
            code, out = mpirun(3, [Path(__file__).parent / "agree_job.py", mode, 5000], 300,
                               f"agreements ({mode})", launcher=[
                                   ROOT / "launch" / "kvcollrun", "--elastic", "--min-np", 3])
            wrong = [int(w) for w in
                     re.findall(r"rank \d+: (\d+) of 5000 agreements wrong", out)]
            if "agreements wrong" in out:
                break
        assert code == 0 and len(wrong) == 3, out[-3000:]
        counts[mode] = max(wrong)
    print(f"\nwrong agreements of 5000: {counts}")
    assert counts["serial"] == 0, counts


@pytest.mark.parametrize("trial", range(TRIALS))
def test_a_rank_lost_at_a_random_moment(hosts, tmp_path, cleanup, trial):  # noqa: F811
    rng = random.Random(SEED * 1000 + trial)
    fault = rng.choice(["kill", "kill", "stop"])
    at, delay = rng.randrange(12, 45), rng.uniform(0.0, 0.06)
    print(f"\ntrial {trial}: {fault} rank 2 {delay:.3f}s after step {at}")
    lose_a_rank(hosts, tmp_path, cleanup, fault, delay, at=at)
