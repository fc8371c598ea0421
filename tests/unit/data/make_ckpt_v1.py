"""Writes tests/unit/data/ckpt_v1 with the format-1 checkpoint code as it was committed
before format 2 (git commit d5b9670, kvcoll/checkpoint.py), on 2 ranks (threads):
the tables of tests/mpi/ckpt_tables.py, a full save at step 2 and deltas
at 3 (with removals) and 4; and ckpt_v1.expected.npz, every table's state at step 4
(merged over the ranks, sorted by key). Run from the repository root:

    .venv/bin/python tests/unit/data/make_ckpt_v1.py

(kept to show where the fixture came from; the fixture itself is what the test reads).
"""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent.parent / "mpi"))

import numpy as np  # noqa: E402
from ckpt_tables import dump, make_tables, merge, play  # noqa: E402
from threadcomm import run_ranks  # noqa: E402

source = subprocess.run(["git", "show", "d5b9670:kvcoll/checkpoint.py"], check=True,
                        capture_output=True, text=True, cwd=HERE).stdout
spec = importlib.util.spec_from_loader("kvcoll._checkpoint_format1", loader=None)
old = importlib.util.module_from_spec(spec)
old.__package__ = "kvcoll"
sys.modules[spec.name] = old
exec(compile(source, "checkpoint.py@d5b9670", "exec"), old.__dict__)  # noqa: S102
assert old.VERSION == 1

out = HERE / "ckpt_v1"
shutil.rmtree(out, ignore_errors=True)


def rank_main(comm):
    tables = make_tables()
    c = old.Checkpointer(tables, comm)
    for step in range(1, 5):
        play(tables, comm.size, comm.rank, step)
        if step >= 2:
            c.save(out, step, incremental=step > 2)
    state = dump(tables)
    for t in tables.values():
        t.close()
    return state


state = merge(run_ranks(2, rank_main))
np.savez(HERE / "ckpt_v1.expected.npz",
         **{f"{name}/{k}": v for name, cols in state.items() for k, v in cols.items()})
print("wrote", out)
