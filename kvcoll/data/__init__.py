"""Data for kvcoll's models: a synthetic CTR set, Criteo TSV and Parquet readers, sharding.

All readers return batches as dicts of numpy arrays — "categorical" int64 [n, F] (a
dict of named id columns for Parquet), "numeric" float32 [n, D], "label" float32 [n] —
and cut a global batch over ranks with `even_split`, so by default a batch depends on
the step and never on the world size (the file readers also offer split="part": each
rank reads only its own part). The file readers parse with pyarrow and turn string and
hex ids into keys in C; `criteo_dataset()` and `parquet_dataset()` give tf.data.Datasets
for model.fit. Nothing here imports MPI, and TensorFlow only for those datasets.

`stream()` reads a directory that keeps receiving files, `kafka()` a Kafka topic (both
unbounded, with empty batches while idle). Every source implements one position
protocol (`kvcoll.data.position`): `position_at(consumed)` and `resume(position)`, so a
checkpoint can record the data position of its last committed step and a restart
continue exactly there.
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
from .kafka import KafkaFormatError, KafkaReadError, KafkaStream, kafka
from .parquet import ParquetFormatError, ParquetReader, parquet_dataset, read_parquet
from .position import PositionError, for_rank, source_of
from .shard import even_split, shard
from .stream import FileStream, StreamOrderError, stream
from .synthetic import SyntheticBatches, SyntheticCTR, auc

__all__ = [
    "CriteoFormatError",
    "CriteoReader",
    "FileStream",
    "KafkaFormatError",
    "KafkaReadError",
    "KafkaStream",
    "ParquetFormatError",
    "ParquetReader",
    "PositionError",
    "ReaderStats",
    "StreamOrderError",
    "SyntheticBatches",
    "SyntheticCTR",
    "auc",
    "criteo_dataset",
    "criteo_id",
    "even_split",
    "for_rank",
    "kafka",
    "parquet_dataset",
    "parse_criteo_lines",
    "read_criteo",
    "read_parquet",
    "shard",
    "source_of",
    "stream",
]
