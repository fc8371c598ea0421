"""Data for kvcoll's models: a synthetic CTR set, Criteo TSV and Parquet readers, sharding.

All readers return batches as dicts of numpy arrays — "categorical" int64 [n, F] (a
dict of named id columns for Parquet), "numeric" float32 [n, D], "label" float32 [n] —
and cut a global batch over ranks with `even_split`, so by default a batch depends on
the step and never on the world size (the file readers also offer split="part": each
rank reads only its own part). The file readers parse with pyarrow and turn string and
hex ids into keys in C; `criteo_dataset()` and `parquet_dataset()` give tf.data.Datasets
for model.fit. Nothing here imports MPI, and TensorFlow only for those datasets.
"""

from ._reader import ReaderStats
from .criteo import (
    CriteoFormatError,
    CriteoReader,
    criteo_dataset,
    criteo_id,
    parse_criteo_lines,
    read_criteo,
)
from .parquet import ParquetFormatError, ParquetReader, parquet_dataset, read_parquet
from .shard import even_split, shard
from .synthetic import SyntheticCTR, auc

__all__ = [
    "CriteoFormatError",
    "CriteoReader",
    "ParquetFormatError",
    "ParquetReader",
    "ReaderStats",
    "SyntheticCTR",
    "auc",
    "criteo_dataset",
    "criteo_id",
    "even_split",
    "parquet_dataset",
    "parse_criteo_lines",
    "read_criteo",
    "read_parquet",
    "shard",
]
