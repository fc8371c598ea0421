"""SSP: an owner refuses a peer's push whose update would make a row NaN/Inf, and the
job ends with an error naming the table, the key, the pushing rank and its step
(#29 defect 12). Owners apply SSP pushes as they arrive, so the ranks cannot agree to
give that step up as BSP's do: the run must end, loudly, rather than go on with (or
without) the update. A whole 2-rank job under mpirun with a timeout: it must fail,
never hang.
"""

import os
import re

from mpirun import run

TIMEOUT = float(os.environ.get("KVCOLL_TEST_MPI_TIMEOUT", "240"))

JOB = r"""
import numpy as np
import kvcoll as kv
from kvcoll import runtime
from kvcoll.exchange import SspExchange
from kvcoll.routing import owner_of

kv.init(argv=[], comm_timeout=60.0)
comm = runtime.comm()
rank = comm.rank
tables = {"a": kv.KvTable(4, name="a", optimizer=kv.optimizers.Adagrad(0.1)),
          "b": kv.KvTable(3, name="b", optimizer=kv.optimizers.Adagrad(0.1))}
ex = SspExchange(comm, tables, 2)
keys = np.arange(1000, 1040, dtype=np.int64)
mine0 = keys[owner_of(keys, 2) == 0]           # keys rank 0 owns
bad = int(mine0[0])
for step in (1, 2, 3):
    pull = ex.pull({"a": keys[:5], "b": keys})
    g = {n: np.full((p.uniq.size, p.rows.shape[1]), 0.01, np.float32) for n, p in pull.items()}
    if rank == 1 and step == 2:
        g["b"][list(pull["b"].uniq).index(bad), 0] = 1e30
    ex.push(pull, g)
    print(f"rank {rank} pushed step {step}", flush=True)
ex.finish()
print(f"rank {rank} finished", flush=True)
"""


def test_an_owner_refuses_a_peer_push_and_the_job_ends_naming_it():
    code, out = run(2, ["-c", JOB], TIMEOUT, "nonfinite ssp job")
    assert code != 0, out[-4000:]
    m = re.search(r"rank 0 refused the push of rank 1's step 2: table 'b': key (\d+): step 2: "
                  r"the update would make its row or its Adagrad slots NaN/Inf", out)
    assert m, out[-6000:]
    assert "nothing was applied" in out and "the run ends here" in out, out[-6000:]
    assert "rank 0 finished" not in out and "rank 1 finished" not in out, out[-4000:]
