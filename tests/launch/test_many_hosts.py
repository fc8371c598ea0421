"""kvcoll on three "hosts" of this machine (tests/launch/netns.py: network namespaces,
each with its own host name, joined by veth links to a bridge; Open MPI over TCP only,
ranks started in their hosts through Open MPI's remote-launch agent setting), launched
by launch/kvcollrun with a hostfile:

- the ranks know their hosts: kv.local_rank()/local_size() group them by host name, and
  kvcollrun added no single-host flag (no --oversubscribe);
- BSP through the Keras Trainer equals one process step by step (tests/mpi/test_keras_bsp.py's
  equivalence test across the hosts);
- a checkpoint written on three hosts restores on two, bit for bit, and training
  continues on the uninterrupted loss curve (tests/mpi/ckpt_driver.py);
- SSP and ASP (tests/mpi/test_ssp.py across the hosts: no update lost, SSP's bound exact,
  ASP not held back, save past the staleness, restore and continue).

Skipped, with the reason, where the machine cannot make namespaces (not root, no
CAP_NET_ADMIN); the hosts are removed after the module, also when a test fails.
"""

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

from netns import PYTHON, ROOT, Hosts

MPI_DIR = ROOT / "tests" / "mpi"
TIMEOUT = float(os.environ.get("KVCOLL_TEST_MPI_TIMEOUT", "240"))


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    h = Hosts.create(3, tmp_path_factory.mktemp("hosts"), slots=[2, 1, 1])
    yield h
    h.close()


RANKS_KNOW_THEIR_HOSTS = """
import json, os, socket, numpy as np, kvcoll as kv
kv.init(argv=[])
total = kv.allreduce(np.array([kv.rank()]), op="sum")
print("RANK " + json.dumps(dict(rank=kv.rank(), host=socket.gethostname(),
      local=[kv.local_rank(), kv.local_size()], net=os.readlink("/proc/self/ns/net"),
      total=int(total[0]))), flush=True)
kv.shutdown()
"""


def test_ranks_know_their_hosts(hosts):
    code, out = hosts.run(["-np", 4, PYTHON, "-c", RANKS_KNOW_THEIR_HOSTS], TIMEOUT,
                          "local ranks", env_extra={"KVCOLLRUN_SHOW": "1"})
    assert code == 0, out[-4000:]
    ranks = {r["rank"]: r for r in (json.loads(m) for m in re.findall(r"RANK (\{.*\})", out))}
    assert sorted(ranks) == [0, 1, 2, 3], out[-3000:]
    # slots 2, 1, 1: ranks 0 and 1 share the first host
    assert [ranks[r]["host"] for r in range(4)] == ["kvhost1", "kvhost1", "kvhost2", "kvhost3"]
    assert [ranks[r]["local"] for r in range(4)] == [[0, 2], [1, 2], [0, 1], [0, 1]]
    assert len({ranks[r]["net"] for r in range(4)}) == 3           # three network namespaces
    assert all(ranks[r]["total"] == 6 for r in range(4))            # 0 + 1 + 2 + 3
    shown = next(line for line in out.splitlines() if "kvcollrun: running" in line)
    assert "--oversubscribe" not in shown and "--bind-to none" in shown, shown


def one_per_host(hosts) -> Path:
    return hosts.hostfile_for(range(3), slots=[1, 1, 1])


# The tests of tests/mpi/ run across the hosts (the others run on one host in
# test_mpi.py): BSP's step-by-step equivalence, and SSP/ASP's staleness bounds, updates
# and save/restore.
ACROSS_HOSTS = {
    "test_keras_bsp.py": "test_bsp_equals_one_rank_step_by_step",
    "test_ssp.py": "test_no_update_is_lost or test_ssp_bound_is_exact or "
                   "test_asp_nobody_waits or test_save_past_the_staleness",
}


@pytest.mark.parametrize("module", sorted(ACROSS_HOSTS))
def test_mpi_module_across_hosts(hosts, module):
    code, out = hosts.run(["-np", 3, PYTHON, "-m", "pytest", "-q", "-x", "-p",
                           "no:cacheprovider", MPI_DIR / module, "-k", ACROSS_HOSTS[module]],
                          TIMEOUT, module, hostfile=one_per_host(hosts))
    assert code == 0, f"{module} failed across 3 hosts (exit {code}):\n{out[-8000:]}"
    assert " passed" in out, out[-4000:]


def test_checkpoint_on_three_hosts_restores_on_two(hosts, tmp_path):
    driver = MPI_DIR / "ckpt_driver.py"
    code, out = hosts.run(
        ["-np", 3, PYTHON, driver, "train", "--steps", 9, "--dir", tmp_path / "ck",
         "--full-at", 4, "--incremental-at", "5,6", "--dump-at", 6, "--dump",
         tmp_path / "s6.npz", "--losses", tmp_path / "losses.json"], TIMEOUT,
        "ckpt_driver.py train", hostfile=one_per_host(hosts))
    assert code == 0, out[-8000:]
    code, out = hosts.run(
        ["-np", 2, PYTHON, driver, "resume", "--steps", 9, "--dir", tmp_path / "ck",
         "--dump", tmp_path / "r6.npz", "--losses", tmp_path / "resumed.json"], TIMEOUT,
        "ckpt_driver.py resume", hostfile=hosts.hostfile_for([1, 2], slots=[1, 1]))
    assert code == 0, out[-8000:]
    assert "at step 6 on 2 rank(s)" in out, out[-3000:]
    with np.load(tmp_path / "s6.npz") as a, np.load(tmp_path / "r6.npz") as b:
        assert sorted(a) == sorted(b)
        for k in a:
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    base = json.loads((tmp_path / "losses.json").read_text())
    cont = json.loads((tmp_path / "resumed.json").read_text())
    assert sorted(cont, key=int) == ["7", "8", "9"]
    np.testing.assert_allclose([cont[k] for k in ("7", "8", "9")],
                               [base[k] for k in ("7", "8", "9")], rtol=1e-5)
