"""kvcoll inside Horovod jobs (the TensorFlow 2.15 + Horovod 0.28.1 lane), launched by
horovodrun and by mpirun on 2 ranks: one MPI world in either init order, the thread
level checked, Horovod's broadcast on the dense variables only, and
examples/horovod_keras.py with Horovod's allreduce for the dense gradients losing
nothing against kvcoll's own (1e-5)."""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from compat_env import HERE, ROOT
from mpirun import run

pytest.importorskip("horovod.tensorflow", reason="the Horovod lane only (./dev compat tf215)")

BIN = Path(sys.executable).parent
TIMEOUT = 300


def horovodrun(world: int, argv: list, env_extra=None):
    """`horovodrun -np world python argv...` (Open MPI 5 takes only --double-dash binding
    flags, so they are given with --binding-args); (exit code, output)."""
    launcher = [BIN / "horovodrun", "--binding-args=--bind-to none --map-by slot"]
    env = {"PATH": f"{BIN}:{os.environ.get('PATH', '')}", **(env_extra or {})}
    return run(world, argv, TIMEOUT, f"horovodrun {argv}", env, launcher=launcher)


LAUNCHERS = {"horovodrun": horovodrun,
             "mpirun": lambda world, argv, env_extra=None: run(world, argv, TIMEOUT, str(argv),
                                                               env_extra)}


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
@pytest.mark.parametrize("case", ["kv-first", "hvd-first", "broadcast"])
def test_one_world_either_order(launcher, case):
    code, out = LAUNCHERS[launcher](2, [HERE / "hvd_worker.py", case])
    assert code == 0 and f"{case} ok" in out, out[-6000:]


@pytest.mark.parametrize("setting", ["0", "1"])
def test_a_users_yield_setting_is_kept(setting):
    """OMPI_MCA_mpi_yield_when_idle set by the user: kvcoll leaves Open MPI as it is."""
    launcher = [BIN / "mpirun", "--oversubscribe", "--bind-to", "none", "-x",
                "OMPI_MCA_mpi_yield_when_idle"]
    code, out = run(2, [HERE / "hvd_worker.py", "hvd-first"], TIMEOUT, "yield setting",
                    {"OMPI_MCA_mpi_yield_when_idle": setting}, launcher=launcher)
    assert code == 0 and "hvd-first ok" in out, out[-6000:]
    assert f"yielding {setting == '1'} (OMPI_MCA_mpi_yield_when_idle={setting})" in out, out[-3000:]


def test_mpi_without_threads_is_refused_with_the_fix():
    code, out = run(2, [HERE / "hvd_worker.py", "threads-disabled"], TIMEOUT, "threads-disabled",
                    {"HOROVOD_MPI_THREADS_DISABLE": "1"})
    assert code == 0 and "threads-disabled ok" in out, out[-6000:]


def test_example_losses_equal_kvcolls_own_allreduce(tmp_path):
    """examples/horovod_keras.py under horovodrun (Horovod's allreduce for the dense
    gradients) and under mpirun (the same, and with kvcoll's own allreduce)."""
    example = ROOT / "examples" / "horovod_keras.py"
    args = ["--epochs", "2", "--steps", "15", "--batch-size", "128"]
    runs = {"horovodrun": (horovodrun, "horovod"), "mpirun": (LAUNCHERS["mpirun"], "horovod"),
            "mpirun-kvcoll": (LAUNCHERS["mpirun"], "kvcoll")}
    got = {}
    for name, (launch, backend) in runs.items():
        path = tmp_path / f"{name}.json"
        code, out = launch(2, [example, *args, "--dense-backend", backend,
                               "--losses-out", path])
        assert code == 0 and "validation AUC" in out, out[-6000:]
        got[name] = json.loads(path.read_text())
    ref = got["mpirun-kvcoll"]
    assert len(ref["step_losses"]) == 30 and ref["dense_backend"] == "kvcoll"
    for name in ("horovodrun", "mpirun"):
        assert got[name]["dense_backend"] == "horovod"
        np.testing.assert_allclose(got[name]["step_losses"], ref["step_losses"], rtol=1e-5,
                                   err_msg=name)
        np.testing.assert_allclose(got[name]["history"]["loss"], ref["history"]["loss"],
                                   rtol=1e-5, err_msg=name)
        np.testing.assert_allclose(got[name]["val"]["auc"], ref["val"]["auc"], rtol=1e-5)
    assert ref["history"]["loss"][-1] < ref["history"]["loss"][0]   # it learns
