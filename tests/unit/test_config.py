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
    ({"KVCOLL_ID_HASH": "md5"}, "id_hash 'md5' is unknown; use one of auto, farmhash64, xxh64"),
    ({"KVCOLL_PIPELINE": "yes"}, "pipeline must be one of 'on', 'off', 'semi', got 'yes'"),
    ({"KVCOLL_XLA": "semi"}, "xla must be 'on' or 'off', got 'semi'"),
    ({"KVCOLL_HUGE_PAGES": "maybe"}, "huge_pages must be 'on' or 'off', got 'maybe'"),
])
def test_bad_values_name_the_field(env, match):
    with pytest.raises(InvalidArgumentError, match=match):
        Config.resolve([], env)


def test_id_hash_setting_from_code_flag_or_environment():
    assert Config().id_hash == "auto"
    assert Config.resolve(["--id-hash", "xxh64"], {}).id_hash == "xxh64"
    assert Config.resolve([], {"KVCOLL_ID_HASH": "farmhash64"}).id_hash == "farmhash64"
    assert Config.resolve(["--id-hash=xxh64"], {}, id_hash="farmhash64").id_hash == "farmhash64"


def test_pipeline_setting_on_off_or_semi():
    assert Config().pipeline == "on"
    assert Config.resolve(["--pipeline", "semi"], {}).pipeline == "semi"
    assert Config.resolve([], {"KVCOLL_PIPELINE": "off"}).pipeline == "off"


def test_huge_pages_setting_reaches_the_tables_allocator(monkeypatch):
    """kv.init(huge_pages="off") turns kv_alloc_huge's MADV_HUGEPAGE advice off for the
    blocks tables map from then on ("on", the default, back on); what the advice does
    is csrc/tests/test_table.c's test_huge_advice."""
    from kvcoll import CommError, runtime
    from kvcoll._c import lib

    assert Config().huge_pages == "on"
    assert Config.resolve(["--huge-pages", "off"], {}).huge_pages == "off"
    assert Config.resolve([], {"KVCOLL_HUGE_PAGES": "off"}).huge_pages == "off"

    def failing(**_):      # init stops at the communicator, after applying the setting
        raise CommError("no MPI in this test")

    monkeypatch.setattr(runtime, "Comm", failing)
    monkeypatch.setattr(runtime, "_state", {})
    try:
        for setting, advised in (("off", 0), ("on", 1)):
            with pytest.raises(CommError, match="no MPI"):
                runtime.init(argv=[], huge_pages=setting)
            assert lib.kv_huge_advice() == advised
    finally:
        lib.kv_set_huge_advice(1)


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


def test_flags_match_whole_names_only_and_never_exit():
    """A user's own flags are left alone: no abbreviation (`--comm`, `--st`), no exit."""
    cfg = Config.resolve(["--comm", "5", "--st", "--staleness-of-data", "9", "--step-mode=ssp",
                          "--staleness", "2"], {})
    assert cfg == Config(step_mode="ssp", staleness=2)
    assert Config.resolve(["--comm-timeout=7.5"], {}).comm_timeout == 7.5
    with pytest.raises(InvalidArgumentError, match="--staleness needs a value"):
        Config.resolve(["--staleness"], {})
    with pytest.raises(InvalidArgumentError, match="--step-mode needs a value"):
        Config.resolve(["--step-mode", "--other"], {})


def test_test_suite_variables_are_not_settings():
    env = {"KVCOLL_TEST_MPI_TIMEOUT": "30", "KVCOLL_TEST_TRAIN_TIMEOUT": "9"}
    assert Config.resolve([], env) == Config()


def test_timeouts_by_kind():
    cfg = Config.resolve([], {"KVCOLL_IO_TIMEOUT": "900"}, startup_timeout=60.0)
    assert cfg.timeouts == {"step": 120.0, "io": 900.0, "startup": 60.0}
    with pytest.raises(InvalidArgumentError, match="io_timeout must be > 0"):
        Config(io_timeout=0)


def test_comm_deadlines_by_kind_and_the_thread_level_check():
    from kvcoll import CommError
    from kvcoll.comm import Comm, _mpi

    c = Comm.local()
    c.timeouts.update(io=50.0)
    assert c.timeout == c.timeouts["step"]
    with c.deadline("io"):
        assert c.timeout == 50.0
    assert c.timeout == c.timeouts["step"]
    c.require_threads("a test")                        # kvcoll brought MPI up with MULTIPLE
    c.thread_level = _mpi().THREAD_SERIALIZED
    with pytest.raises(CommError, match="MPI_THREAD_MULTIPLE.*MPI_THREAD_SERIALIZED"):
        c.require_threads("SSP/ASP")
    c.free()


@pytest.mark.parametrize("elastic", [True, False])
def test_an_elastic_start_that_fails_on_a_peer_tells_the_launcher(monkeypatch, capsys, elastic):
    """kv.init under kvcollrun --elastic: when its first collective fails on a peer lost
    or missing, the launcher is told (it starts the job again); otherwise nothing."""
    from kvcoll import CommError, runtime

    def failing(**_):
        raise CommError("rank 2/3: dup (a new communicator: every rank must create it) "
                        "failed: MPI_ERR_INTERN")

    monkeypatch.setattr(runtime, "Comm", failing)
    monkeypatch.setattr(runtime, "skip_finalize", lambda: None)
    monkeypatch.setattr(runtime, "_state", {})
    if elastic:
        monkeypatch.setenv("KVCOLL_ELASTIC_MIN_NP", "2")
    with pytest.raises(CommError, match="MPI_ERR_INTERN"):
        runtime.init(argv=[])
    err = capsys.readouterr().err
    assert ('kvcoll-elastic {"error": "rank 2/3: dup (a new communicator: every rank must '
            'create it) failed: MPI_ERR_INTERN", "event": "start_failed"}' in err) == elastic
