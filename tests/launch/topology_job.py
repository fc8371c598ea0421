"""tests/launch/elastic_job.py (a TensorFlow-free BSP training job: kvcoll's step loop,
not pipelined), then one line per rank on the exchange's topology as kv.init planned it:
`TOPOLOGY {"rank", "mode", "shape", "why", "messages"}` (messages: the point-to-point
messages the rank sent per all-to-all operation on kvcoll's communicator).

For tests/launch/test_exchange_topology.py and bench/topology_bench.py; takes
elastic_job.py's flags, and the settings from KVCOLL_* (KVCOLL_EXCHANGE_TOPOLOGY).
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import elastic_job

from kvcoll import runtime


def main() -> int:
    code = elastic_job.main()
    c = runtime.comm()
    t = c.topology
    print("TOPOLOGY " + json.dumps({"rank": c.rank, "mode": t.mode,
                                    "shape": [t.hosts, t.per_host], "why": t.why,
                                    "messages": c.messages}), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
