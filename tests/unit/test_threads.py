"""Threaded C table work (#32 item 3): the same bits with one thread or many.

The exchange kernels split a step's table work (plan, serve, gradient sums, the row
optimizer, the commit, the gather gradient) over a pool of C threads by table and by
key range. Here, in one process:
- a one-rank BSP exchange over several steps (three tables of two dims, Adam and
  Adagrad rows, exact admission on one table, new and old ids, batches big enough that
  every kernel runs threaded) gives byte-identical pulled rows and tables (values,
  slots, headers, stats) with 1, 2 and 4 threads; so does gather_grad;
- the setting: KVCOLL_THREADS / kv.init(threads=...) / --threads, 0 meaning two pools:
  the kernels a step waits for on the rank's cores (core_share: the CPU affinity over
  the ranks on the host), those beside TensorFlow's compute (beside_compute: the
  pipeline's helper, the SSP/ASP service thread) on the cores TensorFlow leaves free
  (default_threads: less its intra-op threads); a setting sizes both; bad values named.
The multi-rank equivalence (several sources per owner) is tests/mpi/test_threads.py.
"""

import os
import types

import numpy as np
import pytest

import kvcoll as kv
from kvcoll import Config, InvalidArgumentError
from kvcoll.comm import Comm
from kvcoll.exchange import BspExchange, kernels
from kvcoll.exchange.kernels import gather_grad, set_threads


@pytest.fixture(autouse=True)
def _back_to_the_setting():
    yield
    set_threads(None)


def make_tables():
    return {
        "a": kv.KvTable(8, name="a", seed=1, initializer=("normal", 0.0, 0.1),
                        optimizer=kv.optimizers.Adagrad(0.2)),
        "b": kv.KvTable(8, name="b", seed=1, initializer=("uniform", -0.1, 0.1),
                        optimizer=kv.optimizers.Adam(0.01), admit_min_count=2),
        "c": kv.KvTable(3, name="c", seed=1, initializer=("normal", 0.0, 0.1),
                        optimizer=kv.optimizers.Ftrl(0.1)),
    }


def run(threads, steps=4, n=12_000, track=False):
    """Train `steps` BSP steps on one rank with `threads` C threads; every pulled row
    matrix, every table's export and stats after (track: with publishing's change
    tracking on, whose take after the last step is in the stats' place)."""
    assert set_threads(threads) == threads == kernels.threads()
    tables = make_tables()
    for t in tables.values():
        if track:
            t.track_changes()
    ex = BspExchange(Comm.local(), tables)
    pulled = []
    for step in range(steps):
        g = np.random.default_rng([7, step])
        ids = {"a": g.integers(0, 30_000, n), "b": g.zipf(1.3, n) % 5000,
               "c": g.integers(-1000, 1000, n // 2)}
        pull = ex.pull(ids)
        pulled.append({k: v.copy() for k, v in pull.rows.items()})
        grads = {k: (np.sin(np.arange(v.size, dtype=np.float32) * (step + 1)) * 0.01)
                 .astype(np.float32).reshape(v.shape) for k, v in pull.rows.items()}
        ex.push(pull, grads).commit()
    out = {n: (t.export(), t.take_changes() if track else t.stats())
           for n, t in tables.items()}
    for t in tables.values():
        t.close()
    return pulled, out


def test_threaded_commits_track_every_changed_row_for_publishing():
    """The change marks are set on one thread after the pool's commit (the list they
    append to is not thread-safe): 1 and 4 threads list the same rows and values."""
    _, one = run(1, steps=2, track=True)
    _, four = run(4, steps=2, track=True)
    for name, (export, changes) in one.items():
        other = four[name][1]
        assert changes is not None and other is not None, name
        order, order4 = np.argsort(changes["keys"]), np.argsort(other["keys"])
        assert np.array_equal(changes["keys"][order], other["keys"][order4]), name
        assert changes["values"][order].tobytes() == other["values"][order4].tobytes()
        assert set(changes["keys"].tolist()) == set(export["keys"].tolist()), name


def test_a_bsp_run_is_the_same_bits_with_any_number_of_threads():
    one_pulled, one_tables = run(1)
    for threads in (2, 4):
        pulled, tables = run(threads)
        for a, b in zip(pulled, one_pulled):
            assert a.keys() == b.keys()
            for k in a:
                assert a[k].tobytes() == b[k].tobytes(), (threads, k)
        for name, (export, stats) in tables.items():
            ref, ref_stats = one_tables[name]
            assert stats == ref_stats, (threads, name)
            for col in ref:
                assert export[col].tobytes() == ref[col].tobytes(), (threads, name, col)


def test_gather_grad_is_the_same_bits_with_any_number_of_threads():
    g = np.random.default_rng(3)
    vals = g.normal(size=(50_000, 16)).astype(np.float32)
    idx = g.integers(0, 7000, 50_000)
    set_threads(1)
    one = gather_grad(vals, idx, 7000)
    want = np.zeros((7000, 16), np.float32)
    for i, r in enumerate(idx):  # the order of i, as the docstring says
        want[r] += vals[i]
    assert one.tobytes() == want.tobytes()
    for threads in (2, 3, 8):
        set_threads(threads)
        assert gather_grad(vals, idx, 7000).tobytes() == one.tobytes()


def test_the_threads_setting():
    assert Config().threads == 0
    assert Config.resolve([], {"KVCOLL_THREADS": "2"}).threads == 2
    assert Config.resolve(["--threads", "3"], {}).threads == 3
    with pytest.raises(InvalidArgumentError, match="threads must be an integer >= 0"):
        Config.resolve([], {"KVCOLL_THREADS": "-1"})
    with pytest.raises(InvalidArgumentError, match="not a valid int for threads"):
        Config.resolve([], {"KVCOLL_THREADS": "two"})
    for bad in (0, 257, 2.5):
        with pytest.raises(InvalidArgumentError, match=r"set_threads: the C threads per rank "
                                                       r"must be an integer in \[1, 256\]"):
            set_threads(bad)
    assert set_threads(None) == kernels.threads() >= 1


def test_default_threads_are_the_cores_tensorflow_leaves_free(monkeypatch):
    import sys

    from kvcoll import runtime

    def tf_with(intra):
        threading = types.SimpleNamespace(get_intra_op_parallelism_threads=lambda: intra)
        return types.SimpleNamespace(config=types.SimpleNamespace(threading=threading))

    with monkeypatch.context() as m:  # undone before the pool goes back to the setting
        m.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
        m.setattr(runtime, "is_initialized", lambda: True)
        m.setattr(runtime, "local_size", lambda: 2)   # 2 ranks: 4 cores each
        m.delitem(sys.modules, "tensorflow", raising=False)
        assert kernels.default_threads() == 4                   # no TensorFlow: all 4
        m.setitem(sys.modules, "tensorflow", tf_with(0))
        assert kernels.default_threads() == 1                   # TensorFlow's default: all
        m.setitem(sys.modules, "tensorflow", tf_with(1))
        assert kernels.default_threads() == 3
        m.setitem(sys.modules, "tensorflow", tf_with(16))
        assert kernels.default_threads() == 1
        m.setattr(runtime, "local_size", lambda: 16)  # fewer cores than ranks
        assert kernels.default_threads() == 1


def test_ranks_on_one_host_give_tensorflow_their_share_of_its_cores(monkeypatch):
    """kv.init (runtime.share_cores_with_tensorflow): with 2 ranks on an 8-core host,
    TensorFlow gets 4 intra-op threads and 1 inter-op, through the environment before
    TensorFlow is imported, through tf.config.threading after; a choice of the
    program's stays, a TensorFlow already running keeps its pools, a rank alone on its
    host keeps TensorFlow's defaults."""
    import sys

    from kvcoll import runtime

    names = ("TF_NUM_INTRAOP_THREADS", "TF_NUM_INTEROP_THREADS")

    def tf_with(intra=0, inter=0, running=False):
        got = {"intra": intra, "inter": inter}

        def setter(which):
            def set_(n):
                if running:
                    raise RuntimeError(f"{which} parallelism cannot be modified after "
                                       "initialization.")
                got[which] = n
            return set_

        threading = types.SimpleNamespace(
            get_intra_op_parallelism_threads=lambda: got["intra"],
            get_inter_op_parallelism_threads=lambda: got["inter"],
            set_intra_op_parallelism_threads=setter("intra"),
            set_inter_op_parallelism_threads=setter("inter"))
        return types.SimpleNamespace(config=types.SimpleNamespace(threading=threading)), got

    with monkeypatch.context() as m:
        m.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
        m.setattr(runtime, "is_initialized", lambda: True)
        m.setattr(runtime, "local_size", lambda: 2)
        for name in names:
            m.delenv(name, raising=False)
        m.delitem(sys.modules, "tensorflow", raising=False)
        assert runtime.share_cores_with_tensorflow() == "4 intra-op, 1 inter-op (environment)"
        assert [os.environ[n] for n in names] == ["4", "1"]
        assert runtime.share_cores_with_tensorflow() == \
            "chosen: TF_NUM_INTRAOP_THREADS, TF_NUM_INTEROP_THREADS"
        for name in names:
            m.delenv(name)
        tf, got = tf_with()
        m.setitem(sys.modules, "tensorflow", tf)
        assert runtime.share_cores_with_tensorflow() == "4 intra-op, 1 inter-op"
        assert got == {"intra": 4, "inter": 1} and not any(n in os.environ for n in names)
        tf, got = tf_with(intra=3)
        m.setitem(sys.modules, "tensorflow", tf)
        assert runtime.share_cores_with_tensorflow() == "chosen" and got["intra"] == 3
        tf, got = tf_with(running=True)
        m.setitem(sys.modules, "tensorflow", tf)
        assert runtime.share_cores_with_tensorflow() == "TensorFlow already running"
        m.setattr(runtime, "local_size", lambda: 1)
        m.delitem(sys.modules, "tensorflow")
        assert runtime.share_cores_with_tensorflow() == "alone on its host"
        assert not any(n in os.environ for n in names)


def test_kernels_a_step_waits_for_use_the_ranks_cores_those_beside_the_compute_the_rest(
        monkeypatch):
    import threading

    from kvcoll import runtime

    def in_thread(fn):
        out = []
        t = threading.Thread(target=lambda: out.append(fn()))
        t.start()
        t.join()
        return out[0]

    threading_ns = types.SimpleNamespace(get_intra_op_parallelism_threads=lambda: 1)
    with monkeypatch.context() as m:  # undone before the pools go back to the setting
        m.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
        m.setattr(runtime, "is_initialized", lambda: True)
        m.setattr(runtime, "local_size", lambda: 2)   # 2 ranks: 4 cores each
        m.setitem(__import__("sys").modules, "tensorflow",
                  types.SimpleNamespace(config=types.SimpleNamespace(threading=threading_ns)))
        m.setattr(kernels, "_setting", lambda: 0)
        assert kernels.core_share() == 4 and kernels.default_threads() == 3
        assert set_threads(None) == kernels.threads() == 4
        with kernels.beside_compute():
            assert kernels.threads() == 3
            assert in_thread(kernels.threads) == 4    # per thread
            with kernels.beside_compute():
                assert kernels.threads() == 3
            assert kernels.threads() == 3
        assert kernels.threads() == 4
        assert kernels.pool() != kernels.ffi.NULL
        m.setattr(kernels, "_setting", lambda: 2)     # a setting sizes both: one pool
        assert set_threads(None) == 2
        waited = kernels.pool()
        with kernels.beside_compute():
            assert kernels.threads() == 2 and kernels.pool() == waited
        assert set_threads(1) == 1 and kernels.pool() == kernels.ffi.NULL
        with kernels.beside_compute():
            assert kernels.pool() == kernels.ffi.NULL
