"""`ServerSettings`: how a parameter server applies updates and how long it waits.

One object from the fit to the server: a sidecar passes it as command-line arguments
(`to_argv`), and the command line builds its options from these fields (`add_arguments`,
`from_args`), so nothing is lost or renamed on the way. The server reports its settings on
INIT, and refuses a fit whose algorithm, lr or staleness bound differ (`differences`).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from sparkdl_avg._errors import ConfigError
from sparkdl_avg.ps.rules import ALGORITHMS, RULES

COMPARED = ("algorithm", "lr", "staleness_bound")
"""What a fit and the server it uses must agree on (the rest is the server's own business)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerSettings:
    algorithm: str = field(default="downpour", metadata={
        "help": "the update rule", "choices": ALGORITHMS})
    lr: float = field(default=0.01, metadata={
        "help": "the workers' learning rate (DC-ASGD turns updates into gradients with it)"})
    dc_lambda: float | None = field(default=None, metadata={
        "help": "DC-ASGD's lambda, or lambda0 of the adaptive rule (default: the rule's)"})
    update_scale: float = field(default=1.0, metadata={
        "help": "each push counts this much (a fit's own server: 1/num_workers)"})
    staleness_bound: int | None = field(default=None, metadata={
        "help": "no worker more than this many pushes ahead of the slowest (0: lockstep)"})
    timeout: float = field(default=600.0, metadata={
        "help": "seconds to wait for a worker's next message (whole), or for slower workers"})
    max_message_mb: int = field(default=4096, metadata={
        "help": "the largest INIT (initial parameters) accepted, in MiB"})
    max_connections: int = field(default=256, metadata={
        "help": "authenticated connections served at once (workers, reconnects, the driver)"})
    checkpoint_every: int = field(default=0, metadata={
        "help": "save the state every this many applied updates (0: at INIT only)"})

    def __post_init__(self) -> None:
        check_rule(self.algorithm, self.dc_lambda)
        _positive("lr", self.lr)
        _positive("update_scale", self.update_scale)
        _positive("timeout", self.timeout)
        if self.dc_lambda is not None:
            _positive("dc_lambda", self.dc_lambda, zero=True)
        for name in ("staleness_bound", "max_message_mb", "max_connections",
                     "checkpoint_every"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < (1 if name.startswith("max") else 0)):
                raise ConfigError(f"{name} must be a non-negative integer, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def to_argv(self) -> list[str]:
        """The command-line arguments that `from_args` turns back into these settings."""
        argv = []
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                argv += [_option(f.name), repr(value) if isinstance(value, float) else str(value)]
        return argv

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(cls):
            kind = float if "float" in str(f.type) else int if "int" in str(f.type) else str
            parser.add_argument(_option(f.name), dest=f.name, type=kind, default=f.default,
                                choices=f.metadata.get("choices"), help=f.metadata["help"])

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServerSettings:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    def differences(self, expected: dict[str, Any]) -> list[str]:
        """What a fit expects (`COMPARED` keys) and this server does otherwise, each named
        with both values."""
        return [f"{key}: the fit has {expected[key]!r}, the server {getattr(self, key)!r}"
                for key in COMPARED if key in expected and expected[key] != getattr(self, key)]


def check_rule(algorithm: str, dc_lambda: float | None) -> None:
    """The rule exists, and reads dc_lambda if one is given (for TrainConfig too)."""
    if algorithm not in RULES:
        raise ConfigError(f"algorithm={algorithm!r} is not supported; use one of "
                          f"{ALGORITHMS}")
    if dc_lambda is not None and "dc_lambda" not in RULES[algorithm].PARAMETERS:
        raise ConfigError(f"dc_lambda applies to the DC-ASGD rules, not to "
                          f"algorithm={algorithm!r}")


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def _positive(name: str, value: object, zero: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        raise ConfigError(f"{name} must be a {'non-negative' if zero else 'positive'} "
                          f"number, got {value!r}")
