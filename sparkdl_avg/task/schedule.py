"""The step and round structure every worker follows in lockstep (pure; computed by the
driver's plan, followed by every task).

A step is an optimizer step. With `accumulation` > 1 it takes that many consecutive
micro-batches of the epoch's order (an epoch's last group may be short); the data's position
is counted in micro-batches, the rounds and the learning-rate schedule in steps. With an
averaging warm-up (post-local SGD), the first `warmup_steps` rounds are one step each."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Schedule:
    """The step and round structure every worker follows in lockstep."""

    micro_batches_per_epoch: int
    epochs: int
    averaging_frequency: int
    accumulation: int = 1
    warmup_steps: int = 0
    """Steps averaged one at a time before rounds of `averaging_frequency` steps begin."""
    epoch_rows: int = 0
    batch_size: int = 0
    """A worker's rows an epoch (positions: the largest partition's) and a micro-batch's."""

    @property
    def warmup_rounds(self) -> int:
        """Rounds of one step at the start: the warm-up's, within the fit's steps."""
        return min(self.warmup_steps, self.total_steps)

    @property
    def steps_per_epoch(self) -> int:
        """Optimizer steps per epoch."""
        return math.ceil(self.micro_batches_per_epoch / self.accumulation)

    @property
    def total_steps(self) -> int:
        """Optimizer steps of the whole fit."""
        return self.steps_per_epoch * self.epochs

    @property
    def total_micro_batches(self) -> int:
        return self.micro_batches_per_epoch * self.epochs

    @property
    def num_rounds(self) -> int:
        warm = self.warmup_rounds
        return warm + math.ceil((self.total_steps - warm) / self.averaging_frequency)

    def round_start(self, round_index: int) -> int:
        """The optimizer steps taken before round `round_index` begins."""
        warm = self.warmup_rounds
        if round_index <= warm:
            return round_index
        return min(warm + (round_index - warm) * self.averaging_frequency, self.total_steps)

    def evaluates_after(self, round_index: int, every: int | None) -> bool:
        """Whether round `round_index` ends with an evaluation (besides the last): every
        `every` rounds, or (None) the rounds in which an epoch ends."""
        if every is not None:
            return (round_index + 1) % every == 0
        start = self.round_start(round_index)
        end = start + self.steps_in_round(round_index)
        return end // self.steps_per_epoch > start // self.steps_per_epoch

    def steps_in_round(self, round_index: int) -> int:
        return self.round_start(round_index + 1) - self.round_start(round_index)

    def rows_in_rounds(self, first: int, end: int) -> int:
        """The row positions one worker trains on in rounds `first`..`end`-1 (an epoch's
        last batch may be short): what an elastic fit's absent worker skips."""
        def rows_before(round_index: int) -> int:
            position = self.first_micro_batch(self.round_start(round_index))
            epoch, batch = divmod(position, self.micro_batches_per_epoch)
            return epoch * self.epoch_rows + min(batch * self.batch_size, self.epoch_rows)
        return rows_before(end) - rows_before(first)

    def first_micro_batch(self, step: int) -> int:
        """Where the data stands when optimizer step `step` begins."""
        epoch, group = divmod(step, self.steps_per_epoch)
        return epoch * self.micro_batches_per_epoch + group * self.accumulation

    def micro_batches(self, step: int) -> int:
        """How many micro-batches optimizer step `step` takes."""
        group = step % self.steps_per_epoch
        return min(self.accumulation,
                   self.micro_batches_per_epoch - group * self.accumulation)


def make_schedule(epoch_rows: int, batch_size: int, epochs: int,
                  averaging_frequency: int, accumulation: int = 1,
                  warmup_steps: int = 0) -> Schedule:
    """Every worker runs the micro-batches of an epoch of `epoch_rows` positions (the largest
    partition's rows, `data.order.epoch_length`; a final partial batch included), so all
    replicas reach each averaging point together and every row is in every epoch."""
    return Schedule(math.ceil(epoch_rows / batch_size), epochs, averaging_frequency,
                    accumulation, warmup_steps, epoch_rows, batch_size)
