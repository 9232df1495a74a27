"""What a round makes of the replicas, computed the same way wherever it runs: on the driver
with the "driver" transport, on every task with the "collective" one (each task computes it
from the same inputs, so all end with the same bits).

Without compression the replicas' plain average arrives (the driver's weighted average, or
the all-reduce) and `after_average` steps it with the outer optimizer, if any. With
compression every worker sent its delta from the global parameters G (quantized, with error
feedback); `from_deltas` averages the dequantized deltas into the pseudo-gradient, takes the
outer step (or, plainly, the pseudo-gradient is the update), quantizes the update with error
feedback of its own, and applies the dequantized update to G, exactly as every worker
applies it (`compression.apply_update`)."""

from __future__ import annotations

import numpy as np
import torch

from sparkdl_avg.averaging.arithmetic import average_chunk
from sparkdl_avg.averaging.compression import (
    RESIDUAL,
    ErrorFeedback,
    apply_update,
    decode_range,
)
from sparkdl_avg.averaging.outer import OuterOptimizer

_CHUNK = 1 << 16


def build_outer(config, model: torch.nn.Module, dtype: torch.dtype) -> OuterOptimizer | None:
    """The outer optimizer over `model`'s trainable parameters (zeros until `reset`), None
    for "average"; a ConfigError, before any Spark job, for a callable that does not return
    an optimizer or a compression the model's wire cannot carry."""
    from sparkdl_avg._errors import ConfigError
    from sparkdl_avg.averaging.flat_buffer import trainable_parameters
    from sparkdl_avg.averaging.outer import outer_factory, shapes_of

    if config.delta_compression != "none" and dtype == torch.float64:
        raise ConfigError(f"delta_compression={config.delta_compression!r} with a float64 "
                          "model: its parameters travel in float64 so that averaging stays "
                          "exact, which compressing them would undo; train in float32, or "
                          "use delta_compression='none'")
    make = outer_factory(config.outer_optimizer, config.outer_lr, config.outer_momentum)
    if make is None:
        return None
    shapes = shapes_of(trainable_parameters(model))
    return OuterOptimizer(make, shapes, np.zeros(0))


class GlobalStep:
    def __init__(self, *, numel: int, dtype: np.dtype, outer: OuterOptimizer | None,
                 compression: str, warmup_rounds: int) -> None:
        """`numel`: what is averaged (trainable parameters, then floating buffers); the outer
        optimizer covers its first `outer.numel`. `warmup_rounds`: rounds before the outer
        optimizer starts (the replicas take the plain average)."""
        self.numel, self.dtype = numel, np.dtype(dtype)
        self.outer, self.compression = outer, compression
        self.warmup_rounds = warmup_rounds
        self.compressed = compression != "none"
        self.ef = ErrorFeedback(compression, numel, self.dtype) if self.compressed else None
        self.payload = np.empty(self.ef.nbytes if self.ef else 0, np.uint8)
        """The last round's compressed update, as sent."""
        self._update = np.empty(numel if self.compressed else 0, self.dtype)
        self._new = np.empty(outer.numel if self.compressed and outer else 0, self.dtype)

    @property
    def has_state(self) -> bool:
        """Whether checkpoints keep anything of it (`state`)."""
        return self.outer is not None or self.ef is not None

    def outer_active(self, round_index: int) -> bool:
        return self.outer is not None and round_index >= self.warmup_rounds

    def after_average(self, round_index: int, average: np.ndarray | torch.Tensor) -> float | None:
        """The plain average in `average` becomes the new global parameters (in place);
        the outer step's norm, None without one."""
        if self.outer is None:
            return None
        if not self.outer_active(round_index):
            self.outer.reset(average)  # the warm-up's average is where the outer steps begin
            return None
        return self.outer.step(average)

    def from_deltas(self, round_index: int, payloads: list[np.ndarray], weights: list[float],
                    global_: np.ndarray) -> tuple[list[float], float | None, bool]:
        """The workers' compressed deltas (by rank) weighted by `weights`; `global_` (G, the
        wire dtype) takes the round's update and `payload` holds it compressed. Returns each
        replica's L2 distance from the average, the outer step's norm (None without one),
        and whether every delta was finite."""
        total = float(sum(weights))
        factors = [self.dtype.type(w / total) for w in weights]
        delta = self._update  # the pseudo-gradient: G - average
        squares = [0.0] * len(payloads)
        finite = True
        decoded = np.empty((len(payloads), min(_CHUNK, self.numel)), self.dtype)
        scratch = np.empty(min(_CHUNK, self.numel), self.dtype)
        with np.errstate(over="ignore", invalid="ignore"):
            for start in range(0, self.numel, _CHUNK):  # the deltas decoded a chunk at a time
                size = min(_CHUNK, self.numel - start)
                for i, payload in enumerate(payloads):
                    decode_range(payload, self.compression, self.numel, start, decoded[i, :size])
                dots: list[float] = []
                finite &= average_chunk(decoded, factors, delta[start:start + size], scratch,
                                        slice(0, size), size, dots)
                for i, square in enumerate(dots):
                    squares[i] += square
        distances = [s ** 0.5 for s in squares]
        if not finite:
            return distances, None, False
        norm = None
        if self.outer_active(round_index):
            # the outer step writes the new G into `new`, then the update is G - new (the
            # floating buffers after the trainable parameters keep the plain average's)
            n = self.outer.numel
            norm = self.outer.step_on(delta, self._new)
            np.subtract(global_[:n], self._new, out=delta[:n])
        self.ef.encode(delta, self.payload)
        apply_update(global_, self.payload, self.compression)
        if self.outer is not None:
            self.outer.reset(global_)  # G as applied: the quantized update, not the exact
        return distances, norm, True

    # --- checkpoints: the outer optimizer's state and the update's residual ---------------

    def state(self) -> list[tuple[int, dict]]:
        """(index, {key: tensor or number}) entries for `worker_state.pack_entries`."""
        entries = sorted(self.outer.state_dict()["state"].items()) if self.outer else []
        if self.ef is not None:
            entries.append((RESIDUAL, {"residual": torch.from_numpy(self.ef.residual)}))
        return entries

    def restore(self, entries: dict[int, dict], global_: np.ndarray) -> None:
        """The state `state` gave (unpacked), and G (the checkpoint's parameters)."""
        residual = entries.pop(RESIDUAL, None)
        if self.ef is not None:
            self.ef.residual[:] = residual["residual"].numpy() if residual else 0
        if self.outer is not None:
            self.outer.reset(global_)
            current = self.outer.state_dict()
            self.outer.load_state_dict({"state": entries,
                                        "param_groups": current["param_groups"]})
