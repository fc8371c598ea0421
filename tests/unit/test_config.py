"""Configuration: one source of truth, strict about unknown names and bad values."""

import pytest

from kvcoll import Config, InvalidArgumentError, StepMode, ssp


def test_defaults_env_flags_and_code_in_order():
    env = {"KVCOLL_STEP_MODE": "ssp", "KVCOLL_STALENESS": "3", "PATH": "/bin"}
    assert Config.resolve([], env) == Config(step_mode="ssp", staleness=3)
    cfg = Config.resolve(["--step-mode", "asp", "--other-flag", "x"], env)
    assert cfg.step_mode == "asp" and cfg.staleness == 3
    cfg = Config.resolve(["--step-mode", "asp"], env, step_mode="bsp")
    assert cfg.step_mode == "bsp" and cfg.mode == StepMode("bsp")
    assert Config.resolve([], {}).mode.name == "bsp"


def test_unknown_environment_variable_is_an_error():
    with pytest.raises(InvalidArgumentError, match="KVCOLL_STEPMODE is not a kvcoll setting"):
        Config.resolve([], {"KVCOLL_STEPMODE": "bsp"})


@pytest.mark.parametrize("env,match", [
    ({"KVCOLL_STEP_MODE": "sync"}, "step_mode 'sync' is unknown"),
    ({"KVCOLL_STALENESS": "two"}, "not a valid int for staleness"),
    ({"KVCOLL_STALENESS": "-1"}, "staleness must be an integer >= 0"),
    ({"KVCOLL_COMM_TIMEOUT": "0"}, "comm_timeout must be > 0"),
])
def test_bad_values_name_the_field(env, match):
    with pytest.raises(InvalidArgumentError, match=match):
        Config.resolve([], env)


def test_step_mode_presets():
    assert ssp(2) == StepMode("ssp", 2)
    with pytest.raises(InvalidArgumentError, match="bsp has staleness 0"):
        StepMode("bsp", 1)


def test_engine_imports_neither_tensorflow_nor_mpi():
    """`import kvcoll` loads the engine only: TensorFlow and MPI come on first use."""
    import subprocess
    import sys

    code = ("import sys, kvcoll; "
            "assert 'tensorflow' not in sys.modules, 'tensorflow'; "
            "assert 'mpi4py.MPI' not in sys.modules, 'mpi4py'; "
            "assert callable(kvcoll.Trainer) and 'tensorflow' in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
