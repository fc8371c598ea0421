"""A checkpoint written in the main lane (TensorFlow 2.21, Keras 3) restores in this
lane and back: tables bit for bit, the dense model and Adam's state through
kvcoll.keras.dense_state; an optimizer whose state has no cross-version names
(RMSprop) gets a CheckpointError saying so. Each side runs in its own lane's Python
(tests/compat/cross_ckpt.py)."""

import os
import subprocess
import sys

import pytest

from compat_env import HERE, LANE, ROOT

MAIN = os.environ.get("KVCOLL_TEST_MAIN_PYTHON")
pytestmark = pytest.mark.skipif(LANE == "main" or not MAIN,
                                reason="crosses from another lane to the main one")


def side(python, mode, directory, optimizer):
    env = dict(os.environ, PYTHONPATH=str(ROOT), TF_CPP_MIN_LOG_LEVEL="2",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    if python == MAIN:  # the main lane: Keras 3, whatever this lane asks for
        env.pop("TF_USE_LEGACY_KERAS", None)
    proc = subprocess.run([python, str(HERE / "cross_ckpt.py"), mode, str(directory), optimizer],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("direction", ["main->lane", "lane->main"])
def test_adam_checkpoint_crosses(tmp_path, direction):
    writer, reader = (MAIN, sys.executable) if direction == "main->lane" else (sys.executable, MAIN)
    code, out = side(writer, "write", tmp_path, "adam")
    assert code == 0, out[-4000:]
    code, out = side(reader, "read", tmp_path, "adam")
    assert code == 0 and "restored by" in out, out[-4000:]


def test_what_cannot_cross_says_why(tmp_path):
    code, out = side(sys.executable, "write", tmp_path, "rmsprop")
    assert code == 0, out[-4000:]
    code, out = side(MAIN, "read", tmp_path, "rmsprop")
    assert code == 3, out[-4000:]
    assert "crosses Keras versions only for Adam, Adagrad and SGD" in out, out[-4000:]
    assert "RMSprop" in out and "keras3" in out, out[-4000:]
