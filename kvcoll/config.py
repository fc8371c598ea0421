"""kvcoll's run configuration: one frozen dataclass, read once.

Every field can come from the code (`kvcoll.init(step_mode="ssp", staleness=4)`), from
an environment variable `KVCOLL_<FIELD>` (`KVCOLL_STEP_MODE=ssp`), or from a
command-line flag `--<field>` with dashes (`--step-mode ssp`), in that order of
precedence: code > flag > environment > default. An unknown `KVCOLL_*` variable or a
bad value is an error that names the field and what it accepts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from .errors import InvalidArgumentError

__all__ = ["Config", "StepMode", "BSP", "ASP", "ssp"]

STEP_MODES = ("bsp", "ssp", "asp")


@dataclasses.dataclass(frozen=True)
class StepMode:
    """How far a worker may run ahead of the slowest one.

    BSP: every step waits for all (staleness 0). SSP: at most `staleness` steps
    ahead. ASP: unbounded.
    """

    name: str
    staleness: int = 0

    def __post_init__(self):
        if self.name not in STEP_MODES:
            raise InvalidArgumentError(
                f"step mode {self.name!r} is unknown; use one of {', '.join(STEP_MODES)}")
        if not isinstance(self.staleness, int) or self.staleness < 0:
            raise InvalidArgumentError(
                f"staleness must be an integer >= 0, got {self.staleness!r}")
        if self.name == "bsp" and self.staleness != 0:
            raise InvalidArgumentError(
                f"bsp has staleness 0, got {self.staleness}; use --step-mode ssp for staleness")


BSP = StepMode("bsp")
ASP = StepMode("asp")


def ssp(staleness: int = 4) -> StepMode:
    """SSP with a staleness bound (staleness 0 behaves like BSP)."""
    return StepMode("ssp", staleness)


@dataclasses.dataclass(frozen=True)
class Config:
    """Run-wide settings.

    step_mode: "bsp", "ssp" or "asp".
    staleness: SSP's bound in steps (ignored by bsp and asp).
    comm_timeout: seconds any collective or peer answer may take before the run ends
        with an error naming the rank and the operation.
    """

    step_mode: str = "bsp"
    staleness: int = 4
    comm_timeout: float = 300.0

    def __post_init__(self):
        if self.step_mode not in STEP_MODES:
            raise InvalidArgumentError(
                f"step_mode {self.step_mode!r} is unknown; use one of {', '.join(STEP_MODES)}")
        if not isinstance(self.staleness, int) or self.staleness < 0:
            raise InvalidArgumentError(f"staleness must be an integer >= 0, got {self.staleness!r}")
        if not self.comm_timeout > 0:
            raise InvalidArgumentError(f"comm_timeout must be > 0 seconds, got {self.comm_timeout!r}")

    @property
    def mode(self) -> StepMode:
        return StepMode(self.step_mode, 0 if self.step_mode == "bsp" else self.staleness)

    @classmethod
    def resolve(cls, argv: list[str] | None = None, environ=None, **overrides) -> "Config":
        """Defaults, then KVCOLL_* variables, then --flags from argv, then overrides."""
        environ = os.environ if environ is None else environ
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict = {}
        for key, raw in environ.items():
            if not key.startswith("KVCOLL_"):
                continue
            name = key[len("KVCOLL_"):].lower()
            if name not in fields:
                raise InvalidArgumentError(
                    f"environment variable {key} is not a kvcoll setting; known: "
                    + ", ".join("KVCOLL_" + n.upper() for n in fields))
            values[name] = _parse(fields[name], raw, key)
        if argv:
            parser = argparse.ArgumentParser(add_help=False)
            for name in fields:
                parser.add_argument("--" + name.replace("_", "-"), dest=name, default=None)
            known, _ = parser.parse_known_args(argv)
            for name, raw in vars(known).items():
                if raw is not None:
                    values[name] = _parse(fields[name], raw, "--" + name.replace("_", "-"))
        values.update({k: v for k, v in overrides.items() if v is not None})
        unknown = set(values) - set(fields)
        if unknown:
            raise InvalidArgumentError(f"unknown kvcoll setting(s): {sorted(unknown)}")
        return cls(**values)


def _parse(field: dataclasses.Field, raw: str, source: str):
    kind = {"int": int, "float": float, "str": str}[
        field.type if isinstance(field.type, str) else field.type.__name__]
    try:
        return kind(raw)
    except ValueError:
        raise InvalidArgumentError(
            f"{source}={raw!r} is not a valid {kind.__name__} for {field.name}") from None
