"""The compatibility suite (`./dev compat`): the Keras path, checkpoints, export and
Horovod, in the lane whose venv runs it (KVCOLL_TEST_LANE: main, tfkeras, tf215).

Multi-rank tests start mpirun (or horovodrun) from this venv with a timeout, through
tests/launch/mpirun.py."""

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "tests" / "launch"))

LANE = os.environ.get("KVCOLL_TEST_LANE", "main")
