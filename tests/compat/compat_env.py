"""Where the compatibility suite is, and which lane runs it (KVCOLL_TEST_LANE: main,
tfkeras, tf215; set by ./dev compat). Importing it makes tests/launch/mpirun.py
importable too."""

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
LANE = os.environ.get("KVCOLL_TEST_LANE", "main")

if str(ROOT / "tests" / "launch") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests" / "launch"))
