"""Data for kvcoll's models: a synthetic CTR set, a Criteo reader, and sharding.

All readers return batches as dicts of numpy arrays — "categorical" int64 [n, F],
"numeric" float32 [n, D], "label" float32 [n] — and cut a global batch over ranks
with `even_split`, so a batch depends on the step and never on the world size.
Nothing here imports MPI or TensorFlow; the synthetic set's per-sample work runs in
kvcoll's C core (reached through kvcoll.data._synth_c).
"""

from ._reader import ReaderStats
from .criteo import CriteoFormatError, CriteoReader, criteo, criteo_id, parse_criteo_lines, read_criteo
from .shard import even_split, shard
from .synthetic import SyntheticCTR, auc

__all__ = [
    "CriteoFormatError",
    "CriteoReader",
    "ReaderStats",
    "SyntheticCTR",
    "auc",
    "criteo",
    "criteo_id",
    "even_split",
    "parse_criteo_lines",
    "read_criteo",
    "shard",
]
