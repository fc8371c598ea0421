"""A Kafka topic as an unbounded stream of batches, through confluent-kafka (librdkafka).

    >>> s = kv.data.kafka("clicks", "broker1:9092,broker2:9092", "ctr-training", 4096,
    ...                   format="json", label="click", categorical=["user", "item"])
    >>> model.fit(s.dataset(), steps_per_epoch=1000, epochs=10**6)

Partitions. Rank r reads the partitions p with p mod world = r, through `assign()`:
the consumer never joins a group rebalance, so no partition moves under a running step.
A rank with no partition (fewer partitions than ranks) only idles. Partitions are read
at the start of a pass; one added later is read from the next pass (a restart) on.

Offsets. Nothing is committed automatically (enable.auto.commit and
enable.auto.offset.store are off). The position of a rank is the next offset of each
of its partitions (kvcoll/data/position.py, split "partitions"); a checkpoint stores it
and a resume seeks there, so a restart continues exactly where the restored model was.
A position's offsets are concrete, never "earliest": the first pass resolves `start`
("earliest", "latest", or the group's "committed" offsets) against the partitions'
watermarks. A partition missing from a resume position (new since) starts at its
earliest offset. Every rank's positions merge (`for_rank`) for any world size. An
offset retention has already deleted raises KafkaReadError naming the partition
(auto.offset.reset is "error": skipping would break exactly-once). The group is used
only to report lag to the usual Kafka tools: `commit_offsets(position)` commits a
position's offsets (after a checkpoint).

Messages. format="criteo": each message is one Criteo TSV line (a trailing newline is
allowed), parsed by the Criteo reader's pyarrow path with ids in C. format="json": each
message is one JSON object whose keys are the columns named by label, numeric and
categorical, as read_parquet (numbers, bools, int or string ids, lists of ids for the
`multi_hot` columns; a missing id is null_id), parsed a batch at a time by pyarrow's
JSON reader. Or decode=fn: fn(values: list[bytes]) -> a batch dict, called once per
batch (and with an empty list for the idle batches' shape). A bad message raises
KafkaFormatError naming topic, partition and offset (on_bad_line="skip" drops it,
counted in `stats`).

Batches. batch_size is the global batch B, as for the file readers: each rank's batches
hold up to even_split(B, rank, world) messages of its partitions. When fewer arrive
within `idle_poll` seconds the batch goes out short (fresh data is not held back); when
none arrive, an EMPTY batch (the same keys, zero rows) goes out every `idle_poll`
seconds, so a training loop keeps its ranks in step; `idle_timeout` seconds without a
message end the pass (None: wait for ever).

Tested against librdkafka's mock cluster (`test.mock.num.brokers`), which the test
driver creates in its own process and whose broker address it hands to the ranks: no
Kafka broker can be installed on the test machines. So the protocol (assign, consume,
seek to an offset, watermarks, commit and committed offsets of a group, an offset out
of range) is exercised against librdkafka's own broker model, not a real Kafka.
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidArgumentError, KvcollError
from ._prefetch import Prefetch
from ._reader import Reader, ReaderStats, seconds
from .criteo import NUM_CATEGORICAL, NUM_INTEGER, CriteoReader, _parse_arrow, _scan
from .parquet import _floats, _ids, _kind
from .position import PositionError

__all__ = ["KafkaFormatError", "KafkaReadError", "KafkaStats", "KafkaStream", "kafka"]

FORMATS = ("criteo", "json")
STARTS = ("earliest", "latest", "committed")
_FIXED = {"enable.auto.commit": False, "enable.auto.offset.store": False,
          "auto.offset.reset": "error"}


class KafkaFormatError(InvalidArgumentError):
    """A Kafka message does not hold what the reader was told to read."""


class KafkaReadError(RuntimeError, KvcollError):
    """The Kafka client reported an error (unreachable brokers, an offset gone, ...)."""


@dataclass
class KafkaStats(ReaderStats):
    """One pass of a Kafka reader on this rank: ReaderStats (rows, batches, skipped bad
    messages), plus messages read and empty batches yielded while idle."""
    messages: int = 0
    idle_batches: int = 0


def _ck():
    try:
        import confluent_kafka
    except ImportError:
        raise InvalidArgumentError("kvcoll.data.kafka needs confluent-kafka: pip install "
                                   "confluent-kafka (requirements.txt pins it)") from None
    return confluent_kafka


class KafkaStream(Reader):
    """Batches of a Kafka topic's partitions for one rank: see `kafka`."""

    kind = "kafka"
    finite = False

    def __init__(self, topic, bootstrap, group, batch_size, rank, world, *, format, decode,
                 label, numeric, categorical, multi_hot, null_id, start, idle_poll,
                 idle_timeout, on_bad_line, prefetch, config, timeout):
        super().__init__(batch_size, rank, world, "part", on_bad_line, prefetch,
                         drop_remainder=False)
        ck = _ck()
        for name, value in (("topic", topic), ("bootstrap", bootstrap), ("group", group)):
            if not isinstance(value, str) or not value:
                raise InvalidArgumentError(f"kafka: {name} must be a non-empty string, got "
                                           f"{value!r}")
        self.topic, self.bootstrap, self.group = topic, bootstrap, group
        if start not in STARTS:
            raise InvalidArgumentError(f"kafka: start must be one of {STARTS}, got {start!r}")
        self.start = start
        self.idle_poll = seconds(idle_poll, "kafka", "idle_poll", positive=True)
        self.idle_timeout = None if idle_timeout is None else seconds(
            idle_timeout, "kafka", "idle_timeout")
        self.timeout = seconds(timeout, "kafka", "timeout", positive=True)
        self.null_id = int(null_id)
        config = dict(config or {})
        for key, value in _FIXED.items():
            if key in config and config[key] != value:
                raise InvalidArgumentError(
                    f"kafka: config {key}={config[key]!r} is not allowed: kvcoll keeps the "
                    f"offsets in its checkpoints ({key} must be {value!r})")
        self.conf = {**config, "bootstrap.servers": bootstrap, "group.id": group, **_FIXED}
        if decode is not None:
            if not callable(decode):
                raise InvalidArgumentError(f"kafka: decode must be callable, got {decode!r}")
            if format is not None or label is not None or numeric or categorical:
                raise InvalidArgumentError("kafka: with decode=, leave out format, label, "
                                           "numeric and categorical (decode makes the batch)")
            self.format = "decode"
        else:
            fmt = "criteo" if format is None else format
            if fmt not in FORMATS:
                raise InvalidArgumentError(f"kafka: format must be one of {FORMATS} (or give "
                                           f"decode=), got {format!r}")
            self.format = fmt
        self.decode = decode
        if self.format == "json":
            if not isinstance(label, str):
                raise InvalidArgumentError("kafka: format='json' needs label= (the label's "
                                           f"key), got {label!r}")
            self.label = label
            self.numeric = [numeric] if isinstance(numeric, str) else list(numeric)
            self.categorical = ([categorical] if isinstance(categorical, str)
                                else list(categorical))
            names = [label, *self.numeric, *self.categorical]
            if len(set(names)) != len(names):
                raise InvalidArgumentError(f"kafka: label, numeric and categorical must be "
                                           f"distinct keys, got {names}")
            lists = [multi_hot] if isinstance(multi_hot, str) else list(multi_hot)
            unknown = [c for c in lists if c not in self.categorical]
            if unknown:
                raise InvalidArgumentError(f"kafka: multi_hot names {unknown[0]!r}, which is "
                                           "not one of the categorical keys")
            self.multi_hot = {c: c in lists for c in self.categorical}
        elif self.format == "criteo" and (label is not None or numeric or categorical
                                          or multi_hot):
            raise InvalidArgumentError("kafka: Criteo TSV messages have fixed columns: leave "
                                       "out label, numeric, categorical, multi_hot")
        self.partitions = self._partitions(ck)      # checked now, on every rank
        self.mine = [p for p in self.partitions if p % self.world == self.rank]

    def __repr__(self):
        return (f"KafkaStream({self.topic!r} at {self.bootstrap}, {self.format}, "
                f"batch_size={self.batch_size}, rank={self.rank}, world={self.world}, "
                f"partitions {self.mine})")

    def _position_split(self) -> str:
        return "partitions"

    def _new_stats(self) -> KafkaStats:
        return KafkaStats()

    def _partitions(self, ck) -> list[int]:
        consumer = ck.Consumer({**self.conf, "log_level": 0})
        try:
            md = consumer.list_topics(self.topic, timeout=self.timeout)
        except ck.KafkaException as exc:
            raise KafkaReadError(f"kafka: cannot reach {self.bootstrap} within {self.timeout} s "
                                 f"to read topic {self.topic!r}'s partitions: "
                                 f"{exc.args[0].str()}") from None
        finally:
            consumer.close()
        t = md.topics.get(self.topic)
        if t is None or t.error is not None or not t.partitions:
            why = t.error.str() if t is not None and t.error is not None else "no partitions"
            raise InvalidArgumentError(f"kafka: topic {self.topic!r} at {self.bootstrap}: {why}; "
                                       "check the topic's name and that it exists")
        return sorted(t.partitions)

    # -- model.fit ---------------------------------------------------------------------

    def features(self, batch: dict):
        """A batch as model inputs: as CriteoReader.features (criteo), ParquetReader's
        (json), or, with decode=, {name: ids} of a dict of categorical columns or
        {"C1".."CF"} of a matrix, plus "numeric" when it has columns."""
        cat = batch["categorical"]
        out = dict(cat) if isinstance(cat, dict) else {
            f"C{f + 1}": np.ascontiguousarray(cat[:, f]) for f in range(cat.shape[1])}
        numeric = batch.get("numeric")
        if numeric is not None and numeric.shape[-1]:
            out["numeric"] = numeric
        return out, batch["label"]

    def _signature(self, tf):
        if self.format == "criteo":
            return CriteoReader._signature(self, tf)
        feats, _ = self.features(self.empty_batch())

        def spec(v):
            if isinstance(v, tuple):
                return tf.RaggedTensorSpec([None, None], tf.as_dtype(v[0].dtype), 1,
                                           tf.as_dtype(v[1].dtype))
            return tf.TensorSpec([None, *np.asarray(v).shape[1:]], tf.as_dtype(v.dtype))

        return {k: spec(v) for k, v in feats.items()}, tf.TensorSpec([None], tf.float32)

    def empty_batch(self) -> dict:
        """A batch of zero rows with this reader's keys (what it yields while idle)."""
        if self.format == "criteo":
            return {"categorical": np.zeros((0, NUM_CATEGORICAL), np.int64),
                    "numeric": np.zeros((0, NUM_INTEGER), np.float32),
                    "label": np.zeros(0, np.float32)}
        if self.format == "decode":
            return self.decode([])
        cats = {c: (np.zeros(0, np.int64), np.zeros(1, np.int64)) if self.multi_hot[c]
                else np.zeros(0, np.int64) for c in self.categorical}
        return {"categorical": cats, "numeric": np.zeros((0, len(self.numeric)), np.float32),
                "label": np.zeros(0, np.float32)}

    # -- positions ---------------------------------------------------------------------

    def _file_position(self, fields: dict) -> dict:
        return self._position(topic=self.topic, partitions=fields["partitions"])

    def _start_position(self, fields) -> dict:
        if fields is None:            # before a pass resolves them: per `start`
            return self._file_position({"partitions": {}})
        return self._file_position({"partitions": {str(p): o for p, o in fields.items()}})

    def _accept(self, position: dict) -> dict:
        if position.get("topic") != self.topic:
            raise PositionError(f"kafka: resume: the position is of topic "
                                f"{position.get('topic')!r}, this reader reads {self.topic!r}")
        parts = position.get("partitions")
        if not isinstance(parts, dict):
            raise PositionError(f"kafka: resume: bad partitions {parts!r} in the position")
        out = {}
        for p, off in parts.items():
            try:
                p_int = int(p)
            except (TypeError, ValueError):
                p_int = -1
            if p_int < 0 or isinstance(off, bool) or not isinstance(off, int) or off < 0:
                raise PositionError(f"kafka: resume: bad offset {p!r}: {off!r} in the position "
                                    "(want partition: next offset >= 0)")
            if p_int % self.world == self.rank:
                out[p_int] = off
        if not parts:
            return None         # taken before any pass resolved offsets: as `start` says
        return out

    # -- one pass ----------------------------------------------------------------------

    def __iter__(self):
        """A new pass: assign this rank's partitions at the resume position (or per
        `start`), then read them in a background thread."""
        self.stats = self._new_stats()
        fields, log = self._begin()
        consumer, offsets = self._open(fields)
        log.restart(self._start_position(offsets))
        return Prefetch(self._logged(consumer, offsets, log, self.stats), self.prefetch,
                        name="kvcoll-kafka-reader")

    def _open(self, fields):
        """A consumer assigned this rank's partitions, and their next offsets (concrete)."""
        ck = _ck()
        consumer = ck.Consumer(self.conf)
        try:
            offsets = {}
            committed = {}
            if fields is None and self.start == "committed" and self.mine:
                got = consumer.committed([ck.TopicPartition(self.topic, p) for p in self.mine],
                                         timeout=self.timeout)
                committed = {tp.partition: tp.offset for tp in got if tp.offset >= 0}
            for p in self.mine:
                low, high = consumer.get_watermark_offsets(ck.TopicPartition(self.topic, p),
                                                           timeout=self.timeout)
                if fields is not None:
                    offsets[p] = fields.get(p, low)       # new since the position: earliest
                elif self.start == "latest":
                    offsets[p] = high
                else:
                    offsets[p] = committed.get(p, low)
            consumer.assign([ck.TopicPartition(self.topic, p, o) for p, o in offsets.items()])
        except ck.KafkaException as exc:
            consumer.close()
            raise KafkaReadError(f"kafka: topic {self.topic!r} at {self.bootstrap}, partitions "
                                 f"{self.mine} (rank {self.rank}): {exc.args[0].str()}") from None
        except BaseException:
            consumer.close()
            raise
        return consumer, offsets

    def _logged(self, consumer, offsets, log, stats: KafkaStats) -> Iterator[dict]:
        try:
            for batch, fields in self._pass(consumer, offsets, stats):
                log.record(self._start_position(fields))
                yield batch
        finally:
            consumer.close()

    def _pass(self, consumer, offsets, stats: KafkaStats) -> Iterator[tuple[dict, dict]]:
        size = self.part_batch_size
        offsets = dict(offsets)
        pending: list = []
        last_message = time.monotonic()
        while True:
            want = size - len(pending)
            try:
                got = consumer.consume(num_messages=want, timeout=self.idle_poll)
            except Exception as exc:  # noqa: BLE001 (the client's errors, named)
                raise KafkaReadError(f"kafka: consuming {self.topic!r} (rank {self.rank}): "
                                     f"{exc}") from None
            for m in got:
                err = m.error()
                if err is not None:
                    if err.code() == _ck().KafkaError._PARTITION_EOF:
                        continue
                    raise KafkaReadError(
                        f"kafka: topic {self.topic!r} partition {m.partition()} (offset "
                        f"{offsets.get(m.partition())}): {err.str()}"
                        + (": the offset is no longer in the topic (retention deleted it); "
                           "resume from a newer checkpoint"
                           if err.code() == _ck().KafkaError._AUTO_OFFSET_RESET else ""))
                pending.append(m)
            if pending and (len(pending) >= size or len(got) < want):
                last_message = time.monotonic()
                stats.messages += len(pending)
                batch = self._decode(pending, stats)
                for m in pending:
                    offsets[m.partition()] = m.offset() + 1
                pending = []
                stats.rows += batch["label"].size
                stats.batches += 1
                yield batch, dict(offsets)
                # the time this batch waited to be taken (a full prefetch queue, a slow
                # step) is not the topic's silence: the idle clock starts again now
                last_message = time.monotonic()
                continue
            if not got and not pending:
                if self.idle_timeout is not None \
                        and time.monotonic() - last_message >= self.idle_timeout:
                    return
                stats.idle_batches += 1
                yield self.empty_batch(), dict(offsets)

    # -- messages to batches -----------------------------------------------------------

    def _where(self, messages):
        def where(i):
            m = messages[i]
            return f"topic {self.topic!r} partition {m.partition()} offset {m.offset()}"
        return where

    def _decode(self, messages, stats: KafkaStats) -> dict:
        values = [m.value() or b"" for m in messages]
        if self.format == "decode":
            return self.decode(values)
        if self.format == "criteo":
            return self._criteo(values, self._where(messages), stats)
        return self._json(values, self._where(messages), stats)

    def _criteo(self, values, where, stats) -> dict:
        lines = [v[:-1] if v.endswith(b"\n") else v for v in values]
        n = len(lines)
        fast = _parse_arrow(b"\n".join(lines) + b"\n", n, 1 << 20)
        if fast is not None:
            cat, num, lab = fast
            return {"categorical": np.ascontiguousarray(cat.T), "numeric":
                    np.ascontiguousarray(num.T), "label": lab}
        batch, good, first = _scan(lines)
        if first is not None:
            i, msg = first
            if msg == "a line break inside a line":
                msg = "a message holds more than one line (send one Criteo line per message)"
            if self.on_bad_line == "error":
                raise KafkaFormatError(f"kafka: {where(i)}: {msg}")
            stats.skip(n - good.size, f"{where(i)}: {msg}")
        return batch

    def _json(self, values, where, stats) -> dict:
        import pyarrow as pa
        import pyarrow.json as pajson

        lines = [v.strip() for v in values]
        bad = next((i for i, v in enumerate(lines) if b"\n" in v or not v.startswith(b"{")),
                   None)
        table = None
        if bad is None:
            try:
                table = pajson.read_json(
                    io.BytesIO(b"\n".join(lines) + b"\n"),
                    read_options=pajson.ReadOptions(use_threads=False),
                    parse_options=pajson.ParseOptions(newlines_in_values=False))
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                table = None
        if table is None or table.num_rows != len(lines):
            return self._json_each(lines, where, stats)
        return self._json_table(pa, table, where, stats, np.arange(len(lines)))

    def _json_each(self, lines, where, stats) -> dict:
        """The slow path: find the bad messages one by one (error or skip), then parse
        the good ones together."""
        import pyarrow as pa

        rows = []
        keep = []
        for i, v in enumerate(lines):
            try:
                obj = json.loads(v)
                ok = isinstance(obj, dict)
                why = "not a JSON object"
            except ValueError as exc:
                ok, why = False, f"not JSON ({exc})"
            if not ok:
                if self.on_bad_line == "error":
                    raise KafkaFormatError(f"kafka: {where(i)}: the message is {why}")
                stats.skip(1, f"{where(i)}: the message is {why}")
                continue
            rows.append(obj)
            keep.append(i)
        if not rows:
            return self.empty_batch()
        return self._json_table(pa, pa.Table.from_pylist(rows), where, stats, np.array(keep))

    def _json_table(self, pa, table, where, stats, index) -> dict:
        """Batch of a table of JSON rows; index[i]: the message of row i (for errors)."""
        n = table.num_rows
        for name in [self.label, *self.numeric, *self.categorical]:
            if name not in table.column_names:
                raise KafkaFormatError(f"kafka: {where(int(index[0]))} (and the rest of its "
                                       f"batch) has no key {name!r}; keys seen: "
                                       f"{', '.join(table.column_names)}")
        lab = table.column(self.label)
        if lab.null_count:
            valid = lab.is_valid().to_numpy(zero_copy_only=False)
            first = int(np.argmin(valid))
            msg = f"{where(int(index[first]))}: {self.label!r} (the label) is null or missing"
            if self.on_bad_line == "error":
                raise KafkaFormatError(f"kafka: {msg}")
            stats.skip(int((~valid).sum()), msg)
            table = table.filter(pa.array(valid))
            index = index[valid]
            n = table.num_rows
        for name in [self.label, *self.numeric]:
            t = table.column(name).type
            if _kind(pa, t) not in ("int", "float", "bool") and not pa.types.is_null(t):
                raise KafkaFormatError(f"kafka: {where(int(index[0]))}...: {name!r} has JSON "
                                       f"type {t}; it must be a number or bool")
        label = _floats(pa, table.column(self.label))
        numeric = (np.stack([_floats(pa, table.column(c).cast(pa.float64())
                                     if pa.types.is_null(table.column(c).type)
                                     else table.column(c)) for c in self.numeric], axis=1)
                   if self.numeric else np.zeros((n, 0), np.float32))
        cats = {}
        for c in self.categorical:
            col = table.column(c)
            t = col.type
            multi = self.multi_hot[c]
            if pa.types.is_null(t):
                cats[c] = ((np.zeros(0, np.int64), np.zeros(n + 1, np.int64)) if multi
                           else np.full(n, self.null_id, np.int64))
                continue
            kind = _kind(pa, t)
            if (kind == "list") != multi or kind not in ("int", "string", "list"):
                need = ("a list of int or string ids (it is in multi_hot)" if multi else
                        "an int or string id (name list keys in multi_hot)")
                raise KafkaFormatError(f"kafka: {where(int(index[0]))}...: {c!r} has JSON type "
                                       f"{t}; it must be {need}")
            cats[c] = _ids(pa, col, self.null_id, multi)
        return {"categorical": cats, "numeric": numeric, "label": label}

    # -- lag reporting -----------------------------------------------------------------

    def commit_offsets(self, position: dict) -> None:
        """Commit a position's offsets (this rank's, from position_at or a checkpoint) to
        the group, so the usual Kafka tools report the job's lag. Reading never depends
        on them (unless start="committed" and no position is resumed)."""
        ck = _ck()
        self._check_header(position)
        offsets = self._accept(position)
        if not offsets:
            return
        consumer = ck.Consumer(self.conf)
        try:
            consumer.commit(offsets=[ck.TopicPartition(self.topic, p, o)
                                     for p, o in sorted(offsets.items())], asynchronous=False)
        except ck.KafkaException as exc:
            raise KafkaReadError(f"kafka: committing offsets {offsets} of {self.topic!r} for "
                                 f"group {self.group!r}: {exc.args[0].str()}") from None
        finally:
            consumer.close()


def kafka(topic: str, bootstrap: str, group: str, batch_size: int, rank: int | None = None,
          world: int | None = None, *, format: str | None = None, decode=None,
          label: str | None = None, numeric=(), categorical=(), multi_hot=(),
          null_id: int = -1, start: str = "earliest", idle_poll: float = 1.0,
          idle_timeout: float | None = None, on_bad_line: str = "error", prefetch: int = 2,
          config: dict | None = None, timeout: float = 30.0) -> KafkaStream:
    """This rank's batches of a Kafka topic (see the module docstring): iterate it, or
    `.dataset()` / `.fit_batches()` for model.fit with steps_per_epoch.

    topic, bootstrap ("host:port,..."), group (for lag reports only).
    batch_size: the global batch B (each rank's batches: its even_split share).
    rank, world: kvcoll's by default.
    format: "criteo" (default: a TSV line per message) or "json" (an object per message,
        keys label, numeric, categorical, multi_hot, null_id as read_parquet); or
        decode=fn(values: list[bytes]) -> batch dict.
    start: where a pass without a resume position begins: "earliest", "latest" or
        "committed" (the group's offsets, else earliest).
    idle_poll, idle_timeout: as kvcoll.data.stream.
    on_bad_line: "error" (KafkaFormatError naming partition and offset) or "skip".
    config: more librdkafka settings (security, ...); timeout: seconds for metadata,
        watermark and commit requests.
    """
    return KafkaStream(topic, bootstrap, group, batch_size, rank, world, format=format,
                       decode=decode, label=label, numeric=numeric, categorical=categorical,
                       multi_hot=multi_hot, null_id=null_id, start=start, idle_poll=idle_poll,
                       idle_timeout=idle_timeout, on_bad_line=on_bad_line, prefetch=prefetch,
                       config=config, timeout=timeout)
