"""kvcoll's run configuration: one frozen dataclass, read once.

Every field can come from the code (`kvcoll.init(step_mode="ssp", staleness=4)`), from
an environment variable `KVCOLL_<FIELD>` (`KVCOLL_STEP_MODE=ssp`), or from a
command-line flag `--<field>` with dashes (`--step-mode ssp` or `--step-mode=ssp`), in
that order of precedence: code > flag > environment > default. Flags are matched by
their whole name only (a user's own `--comm` or `--st` is left alone), and the user's
other flags are ignored. An unknown `KVCOLL_*` variable or a bad value is an error that
names the field and what it accepts; `KVCOLL_TEST_*` is reserved for kvcoll's test suite.
"""

from __future__ import annotations

import dataclasses
import os

from .errors import InvalidArgumentError

__all__ = ["Config", "StepMode", "BSP", "ASP", "ssp", "DEFAULT_STALENESS"]

STEP_MODES = ("bsp", "ssp", "asp")
ID_HASH_SETTINGS = ("auto", "farmhash64", "xxh64")
WIRE_DTYPES = ("fp32", "fp16", "bf16")
EXCHANGE_TOPOLOGIES = ("auto", "flat", "two-level")
PIPELINES = ("on", "off", "semi")   # "semi": rows one step stale (docs/performance.md)


DEFAULT_STALENESS = 4   # SSP's bound when none is given: the one place it is written


@dataclasses.dataclass(frozen=True)
class StepMode:
    """How far a worker may run ahead of the slowest one.

    BSP: every step waits for all (staleness 0). SSP: at most `staleness` steps
    ahead. ASP: unbounded (staleness None).
    """

    name: str
    staleness: int | None = 0

    def __post_init__(self):
        if self.name not in STEP_MODES:
            raise InvalidArgumentError(
                f"step mode {self.name!r} is unknown; use one of {', '.join(STEP_MODES)}")
        if self.name == "asp":
            if self.staleness not in (None, 0):
                raise InvalidArgumentError(
                    f"asp has no staleness bound, got staleness={self.staleness!r}; use "
                    "--step-mode ssp for a bound")
            object.__setattr__(self, "staleness", None)
            return
        if isinstance(self.staleness, bool) or not isinstance(self.staleness, int) \
                or self.staleness < 0:
            raise InvalidArgumentError(
                f"staleness must be an integer >= 0, got {self.staleness!r}")
        if self.name == "bsp" and self.staleness != 0:
            raise InvalidArgumentError(
                f"bsp has staleness 0, got {self.staleness}; use --step-mode ssp for staleness")

    @classmethod
    def of(cls, step_mode, staleness: int | None = None) -> "StepMode":
        """A step mode given as a StepMode or a name ("bsp", "ssp", "asp"); `staleness`
        is SSP's bound (default DEFAULT_STALENESS)."""
        if isinstance(step_mode, StepMode):
            if staleness is not None and staleness != step_mode.staleness:
                raise InvalidArgumentError(
                    f"step_mode {step_mode} already sets staleness; got staleness={staleness}")
            return step_mode
        if step_mode == "ssp":
            return cls("ssp", DEFAULT_STALENESS if staleness is None else staleness)
        return cls(step_mode)  # bsp, asp, or an error naming the choices


BSP = StepMode("bsp")
ASP = StepMode("asp")


def ssp(staleness: int = DEFAULT_STALENESS) -> StepMode:
    """SSP with a staleness bound (staleness 0 behaves like BSP)."""
    return StepMode("ssp", staleness)


@dataclasses.dataclass(frozen=True)
class Config:
    """Run-wide settings.

    step_mode: "bsp", "ssp" or "asp".
    staleness: SSP's bound in steps (ignored by bsp and asp).
    Timeouts by kind: how long a collective or a peer's answer may take before the run
    ends with an error naming the rank, the operation and the step.
    comm_timeout: seconds, for a training step's exchanges (and evaluation's).
    io_timeout: seconds, for the collectives of a checkpoint save or restore and of an
        export (their ranks wait while others write or read files).
    startup_timeout: seconds, for bringing kvcoll up (communicators, the first batch's
        agreement, tracing the model).
    id_hash: how string ids become keys (kvcoll.ids): "farmhash64" (FarmHash
        Fingerprint64, what tf.fingerprint computes, so exports hash raw strings in the
        graph), "xxh64" (what models used before, and checkpoints without an "id_hash"
        field), or "auto" (default): farmhash64 for a new model, and a restored
        checkpoint's own hash when it is restored before any string id is hashed. A
        checkpoint whose hash differs from a fixed one (set here, or already used) is
        refused.
    threads: threads of the rank's C table work per step (dedup and routing, lookups and
        inserts, gradient sums, the row optimizer, the gather gradient), split by table
        and by key range with the same results as one thread (KVCOLL_THREADS, --threads).
        0 (default): the work a step waits for (its lookups, gradient sums and row
        updates, while TensorFlow's threads are idle) uses this rank's share of its
        host's cores (its CPU affinity / the ranks on the host); the work that runs
        beside TensorFlow's compute (the pipeline's helper thread, the SSP/ASP service
        thread) the cores TensorFlow leaves free: that share less its intra-op threads
        (all of the share unless set lower), at least 1. See kvcoll.exchange.kernels.
    pipeline: "on", "off" or "semi": BSP steps pipelined (the next batch read, prepared,
        routed and its ids exchanged by a helper thread while a step computes; the results
        are the unpipelined loop's). "semi" (TorchRec's semi-synchronous pipeline): the
        helper also looks the next batch's rows up, before this step's update is applied,
        so a row read by two steps in a row misses the first one's update (rows one step
        stale; the results differ from the unpipelined loop's). See docs/performance.md.
    xla: "on" or "off": compile the dense step with XLA (jit_compile), the rows padded
        to a few bucket sizes so it does not recompile. See docs/performance.md.
    wire_dtype: "fp32" (default), "fp16" or "bf16": the width of the rows and row
        gradients the exchange sends (kvcoll.exchange.wire). 16 bits halve those bytes;
        tables, gradient sums and optimizers stay float32. See docs/wire-dtype.md.
    exchange_topology: "auto" (default), "flat" or "two-level": how the all-to-alls go.
        Two-level (inside each host, then across hosts between ranks of the same local
        rank: (L-1) + (H-1) messages a phase instead of P-1, the same results) is what
        "auto" chooses when the world spans several hosts of the same number of ranks,
        more than one, and has at least kvcoll._topology.AUTO_TWO_LEVEL_MIN_RANKS ranks.
        See docs/exchange-topology.md and docs/scaling.md.
    huge_pages: "on" (default) or "off": whether the tables' arenas and indexes (blocks
        of 1 MiB or more) are advised MADV_HUGEPAGE, so transparent huge pages back them
        (a random row read then costs no 4 KiB TLB miss). "off" leaves them to the
        system (huge pages only where transparent_hugepage is "always"): for VMs whose
        host backs guest memory lazily, where a huge page's first touch cost several
        times the 4 KiB pages' and the rows a step creates waited for it (1 GiB took
        0.1-2.0 s to fault in with the advice, 0.3-0.9 s without, on the 2-core test
        VMs). Applies to what tables allocate after kv.init. See docs/performance.md.
    elastic_min_np: 0 (default): a lost rank ends the job. N >= 1: the run is elastic
        (kvcoll.elastic; the elastic launcher, `kvcollrun --elastic --min-np N`, sets it):
        the survivors of a lost rank continue in memory while at least N ranks are left.
    """

    step_mode: str = "bsp"
    staleness: int = DEFAULT_STALENESS
    comm_timeout: float = 120.0
    io_timeout: float = 1800.0
    startup_timeout: float = 600.0
    id_hash: str = "auto"
    threads: int = 0
    pipeline: str = "on"
    xla: str = "off"
    wire_dtype: str = "fp32"
    exchange_topology: str = "auto"
    huge_pages: str = "on"
    elastic_min_np: int = 0

    def __post_init__(self):
        if self.step_mode not in STEP_MODES:
            raise InvalidArgumentError(
                f"step_mode {self.step_mode!r} is unknown; use one of {', '.join(STEP_MODES)}")
        if not isinstance(self.staleness, int) or self.staleness < 0:
            raise InvalidArgumentError(f"staleness must be an integer >= 0, got {self.staleness!r}")
        if self.id_hash not in ID_HASH_SETTINGS:
            raise InvalidArgumentError(
                f"id_hash {self.id_hash!r} is unknown; use one of {', '.join(ID_HASH_SETTINGS)}")
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) \
                or self.threads < 0:
            raise InvalidArgumentError(
                f"threads must be an integer >= 0 (0: the cores TensorFlow leaves free), "
                f"got {self.threads!r}")
        if self.pipeline not in PIPELINES:
            raise InvalidArgumentError(
                f"pipeline must be one of {', '.join(map(repr, PIPELINES))}, got "
                f"{self.pipeline!r} (kv.init(pipeline=...), --pipeline, KVCOLL_PIPELINE)")
        if self.xla not in ("on", "off"):
            raise InvalidArgumentError(f"xla must be 'on' or 'off', got {self.xla!r}")
        if self.wire_dtype not in WIRE_DTYPES:
            raise InvalidArgumentError(
                f"wire_dtype {self.wire_dtype!r} is unknown; use one of "
                f"{', '.join(WIRE_DTYPES)} (kv.init(wire_dtype=...), --wire-dtype, "
                "KVCOLL_WIRE_DTYPE)")
        if self.exchange_topology not in EXCHANGE_TOPOLOGIES:
            raise InvalidArgumentError(
                f"exchange_topology {self.exchange_topology!r} is unknown; use one of "
                f"{', '.join(EXCHANGE_TOPOLOGIES)} (kv.init(exchange_topology=...), "
                "--exchange-topology, KVCOLL_EXCHANGE_TOPOLOGY)")
        if self.huge_pages not in ("on", "off"):
            raise InvalidArgumentError(
                f"huge_pages must be 'on' or 'off', got {self.huge_pages!r} "
                "(kv.init(huge_pages=...), --huge-pages, KVCOLL_HUGE_PAGES)")
        if isinstance(self.elastic_min_np, bool) or not isinstance(self.elastic_min_np, int) \
                or self.elastic_min_np < 0:
            raise InvalidArgumentError(
                f"elastic_min_np must be an integer >= 0, got {self.elastic_min_np!r}")
        for name in ("comm_timeout", "io_timeout", "startup_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise InvalidArgumentError(f"{name} must be > 0 seconds, got {value!r}")

    @property
    def timeouts(self) -> dict:
        """Seconds by kind: "step", "io", "startup"."""
        return {"step": float(self.comm_timeout), "io": float(self.io_timeout),
                "startup": float(self.startup_timeout)}

    @property
    def mode(self) -> StepMode:
        return StepMode.of(self.step_mode, self.staleness if self.step_mode == "ssp" else None)

    @classmethod
    def resolve(cls, argv: list[str] | None = None, environ=None, **overrides) -> "Config":
        """Defaults, then KVCOLL_* variables, then --flags from argv, then overrides."""
        environ = os.environ if environ is None else environ
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict = {}
        for key, raw in environ.items():
            if not key.startswith("KVCOLL_") or key.startswith("KVCOLL_TEST_"):
                continue
            name = key[len("KVCOLL_"):].lower()
            if name not in fields:
                raise InvalidArgumentError(
                    f"environment variable {key} is not a kvcoll setting; known: "
                    + ", ".join("KVCOLL_" + n.upper() for n in fields))
            values[name] = _parse(fields[name], raw, key)
        for name, (flag, raw) in _flags(argv or [], fields).items():
            values[name] = _parse(fields[name], raw, flag)
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - set(fields)
        if unknown:
            raise InvalidArgumentError(f"unknown kvcoll setting(s): {sorted(unknown)}")
        return cls(**values)


def _flags(argv: list, fields) -> dict:
    """{field: (flag, raw value)} of kvcoll's flags in argv: `--step-mode ssp` or
    `--step-mode=ssp`, whole names only; the last one wins; everything else is the
    user's and is left alone."""
    names = {"--" + n.replace("_", "-"): n for n in fields}
    out = {}
    i = 0
    while i < len(argv):
        arg = str(argv[i])
        flag, eq, value = arg.partition("=")
        if flag in names:
            if not eq:
                if i + 1 >= len(argv) or str(argv[i + 1]).startswith("--"):
                    raise InvalidArgumentError(f"{flag} needs a value, e.g. {flag} 4")
                value = str(argv[i + 1])
                i += 1
            out[names[flag]] = (flag, value)
        i += 1
    return out


def _parse(field: dataclasses.Field, raw: str, source: str):
    kind = {"int": int, "float": float, "str": str}[
        field.type if isinstance(field.type, str) else field.type.__name__]
    try:
        return kind(raw)
    except ValueError:
        raise InvalidArgumentError(
            f"{source}={raw!r} is not a valid {kind.__name__} for {field.name}") from None
