"""The step and round structure every worker follows in lockstep (pure; computed by the
driver's plan, followed by every task)."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Schedule:
    """The step and round structure every worker follows in lockstep."""

    steps_per_epoch: int
    epochs: int
    averaging_frequency: int

    @property
    def total_steps(self) -> int:
        return self.steps_per_epoch * self.epochs

    @property
    def num_rounds(self) -> int:
        return math.ceil(self.total_steps / self.averaging_frequency)

    def steps_in_round(self, round_index: int) -> int:
        start = round_index * self.averaging_frequency
        return min(self.averaging_frequency, self.total_steps - start)


def make_schedule(
    smallest_partition: int, batch_size: int, epochs: int, averaging_frequency: int
) -> Schedule:
    """Every worker runs as many steps per epoch as the smallest partition allows (a final
    partial batch included), so all replicas reach each averaging point together."""
    return Schedule(math.ceil(smallest_partition / batch_size), epochs, averaging_frequency)
