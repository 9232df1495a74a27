"""Pure averaging arithmetic on flat parameter buffers (numpy in, numpy out, torch's threads
under the hood)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def weighted_average(
    buffers: Sequence[np.ndarray], weights: Sequence[float], out: np.ndarray
) -> None:
    """out = sum_i w_i * x_i / sum_i w_i, computed in the buffers' dtype with torch's threads."""
    if len(buffers) != len(weights) or not buffers:
        raise ValueError("need one weight per buffer and at least one buffer")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("weights must sum to a positive number")
    acc = torch.from_numpy(out)
    acc.copy_(torch.from_numpy(buffers[0])).mul_(weights[0] / total)
    for buf, weight in zip(buffers[1:], weights[1:], strict=True):
        acc.add_(torch.from_numpy(buf), alpha=weight / total)


def mean_distance(buffers: Sequence[np.ndarray], center: np.ndarray) -> float:
    """Mean L2 distance of the replicas from their average: how far they drifted in a round."""
    c = torch.from_numpy(center)
    return float(np.mean([torch.dist(torch.from_numpy(b), c).item() for b in buffers]))


def is_finite(buffer: np.ndarray) -> bool:
    return bool(torch.isfinite(torch.from_numpy(buffer)).all())


def non_finite_replicas(buffers: Sequence[np.ndarray]) -> list[int]:
    """Indices of the buffers that hold a NaN or an infinity."""
    return [i for i, b in enumerate(buffers) if not is_finite(b)]
