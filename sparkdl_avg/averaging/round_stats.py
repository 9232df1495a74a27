"""What the driver learns of a round, whatever the transport: its numbers (`RoundStats`) and
each worker's phases as the driver saw them (the worker timeline picture)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True)
class RoundStats:
    samples: int
    train_loss: float
    compute_s: float
    round_s: float
    averaging_s: float
    divergence: float
    eval: dict | None = None
    """With an evaluation: the workers' sums merged (`_eval_sums.merge`)."""
    lr: float | None = None
    """The learning rate of the round's last optimizer step (worker 0's: all follow one
    schedule)."""
    states: dict[int, tuple[list, np.ndarray]] | None = None
    """At checkpoint rounds: each present worker's optimizer state (layout, bytes), by rank."""
    phases: list[dict[str, tuple[float, float]]] | None = None
    """Per worker: (start, end) perf_counter times of setup, compute, transfer, waiting,
    averaging and return+eval, as the driver sees them."""
    has_average: bool = True
    """Whether the coordinator's `average` holds this round's (the collective transport
    fetches it only when asked to)."""
    driver_bytes: int = 0
    """Bytes the driver sent and received in the round, over all workers."""
    wire_bytes: int = 0
    """Bytes of the parameter exchange that crossed the wire in the round, every worker
    and both directions summed (`wire_mb`)."""
    outer_norm: float | None = None
    """The outer optimizer's step in L2 norm (None: no outer step this round)."""
    workers: int = 0
    """How many replicas the round averaged (`workers`: fewer in an elastic fit that lost
    some)."""
    global_state: tuple[list, np.ndarray] | None = None
    """At checkpoint rounds of the collective transport with an outer optimizer or
    compression: worker 0's `GlobalStep` state (layout, bytes)."""


def sum_or_nan(values) -> float:
    """A sum of losses, NaN when a worker's was not finite (sent as None)."""
    values = list(values)
    return float("nan") if None in values else sum(values)


def phases(start: float, setup: list[float], compute: list[float], arrivals: list[float],
            averaged: float, end: float) -> list[dict[str, tuple[float, float]]]:
    """Each worker's round as the driver sees it (see `tracking.plots.PHASES`): setup, computing,
    transfer until its push arrived, waiting for the last push, the averaging, then sending
    the average (and evaluation when due) until the round ended. The worker's own durations
    are clamped into the driver's clock."""
    last = max(arrivals)
    out = []
    for s, c, arrived in zip(setup, compute, arrivals, strict=True):
        ready = min(start + max(s, 0.0), arrived)
        computed = min(ready + c, arrived)
        out.append({"setup": (start, ready), "compute": (ready, computed),
                    "transfer": (computed, arrived), "waiting": (arrived, last),
                    "averaging": (last, averaged), "return+eval": (averaged, end)})
    return out
