"""What a sync task needs from an averaging transport, whatever moves the bytes.

The task's loop (`task.sync_loop`) talks only to this interface. The "driver" transport
(`driver_channel` here, `coordinator` on the driver) sends every replica to the driver and
takes the average back; the "collective" one (`collective`, with `collective_coordinator` on
the driver) all-reduces among the tasks and tells the driver only the round's numbers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from sparkdl_avg.net import messages as msg

if TYPE_CHECKING:
    from sparkdl_avg.averaging.flat_buffer import WireBuffer


@dataclass(frozen=True, slots=True)
class StartPoint:
    round: int
    """The first round to run (after a restart: the round after the checkpoint)."""
    state: tuple[list, memoryview | None] | None
    """After a restart: this worker's optimizer state (layout, bytes) to restore."""
    wait_next: bool = False
    """`RoundReply.wait_next`, for the first round."""
    evaluate: bool = False
    """Evaluate the start parameters before the first step (round 0) and send the sums."""
    global_state: tuple[list, memoryview | None] | None = None
    """The collective transport's restart: the outer optimizer's state (and the update's
    residual), for `averaging.global_step.GlobalStep.restore`."""


@dataclass(frozen=True, slots=True)
class RoundReport:
    """What a worker says of its round, whatever the transport."""

    round: int
    samples: int
    loss_sum: float | None
    """None: not finite."""
    compute_s: float
    setup_s: float
    lr: float | None


@dataclass(frozen=True, slots=True)
class RoundReply:
    """What the driver wants after this round's average."""

    evaluate: bool
    checkpoint: bool
    stop: bool = False
    """Early stopping: this average is the last; the worker sends DONE."""
    wait_next: bool = False
    """overlap_averaging: the next round's average is waited for (it evaluates or
    checkpoints)."""


class Transport(ABC):
    """One task's side of averaging. `close()` is safe on every path."""

    @abstractmethod
    def open(self, hello: msg.WorkerHello) -> None:
        """Join the fit (authenticated)."""

    @abstractmethod
    def configure(self, config, trainable: list[tuple[int, ...]], warmup_rounds: int,
                  wire_nbytes: int = 0) -> None:
        """Before `open`: the fit's averaging settings (`outer_optimizer`,
        `delta_compression`, `shared_memory`), the shapes of the replica's trainable
        parameters (the first tensors of its flat buffer), the warm-up's rounds and the
        flat buffer's bytes on the wire."""

    def host_buffer(self, dtype: np.dtype, numel: int) -> np.ndarray | None:
        """After `open`: memory the replica's flat buffer may live in, so that a push
        sends it where it is (a shared-memory region); None: its own."""
        return None

    def state(self) -> list[tuple[int, dict]]:
        """What this transport keeps for a checkpoint besides the optimizer (the residual
        of compressed deltas), as `task.worker_state.pack_entries` entries."""
        return []

    @abstractmethod
    def receive_start(self, params: np.ndarray) -> StartPoint:
        """Wait for every worker; the parameters to start from go into `params`."""

    @abstractmethod
    def exchange(self, report: RoundReport, flat: WireBuffer) -> RoundReply:
        """Average this replica's `flat` buffer (parameters, then averaged optimizer state)
        with the others': the average ends up in the replica's tensors."""

    @abstractmethod
    def send_state(self, layout: list, payload: np.ndarray) -> None:
        """This worker's optimizer state, for the driver's checkpoint."""

    @abstractmethod
    def send_eval(self, result: msg.Eval, payload: np.ndarray | None = None) -> None:
        """An evaluation's sums, and its metrics' score tables as payload."""

    @abstractmethod
    def done(self, layout: list, payload: np.ndarray) -> None:
        """The last round is done; this worker's integer buffers (layout, bytes)."""

    @abstractmethod
    def fail(self, message: str, final: bool) -> None:
        """Tell the driver why this worker stops (best effort)."""

    @abstractmethod
    def close(self) -> None: ...
