"""Pure averaging arithmetic on flat parameter buffers: numpy in, numpy out, on one thread.

Not torch: its OpenMP threads spin for milliseconds after each parallel operation. On a
driver that shares its machine with the executors (local mode, or a driver co-located with a
worker), that spinning took a core from the training tasks between rounds: 24 ms of CPU for
12 ms of work a round, against 2 ms for the same arithmetic here (MNIST-1D's MLP, 1.1M
parameters, two replicas). Work runs in chunks, so temporaries stay small and in cache."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

_CHUNK = 1 << 16
"""Elements per chunk: 256 KiB of float32, 512 KiB of float64."""


def _chunks(size: int):
    for start in range(0, size, _CHUNK):
        yield slice(start, min(start + _CHUNK, size))


def weighted_average(
    buffers: Sequence[np.ndarray], weights: Sequence[float], out: np.ndarray
) -> None:
    """out = sum_i w_i * x_i / sum_i w_i, computed in the buffers' dtype."""
    average_and_diverge(buffers, weights, out, diverge_numel=0)


def average_and_diverge(buffers: Sequence[np.ndarray], weights: Sequence[float],
                        out: np.ndarray, *, diverge_numel: int) -> tuple[bool, float]:
    """A round's arithmetic in one pass over memory: `weighted_average` into `out`, whether
    `out` is finite, and the replicas' mean L2 distance from it (how far they drifted in a
    round) over their first `diverge_numel` elements (the parameters, not the optimizer
    state that may follow), chunk by chunk in cache."""
    if len(buffers) != len(weights) or not buffers:
        raise ValueError("need one weight per buffer and at least one buffer")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("weights must sum to a positive number")
    factors = [out.dtype.type(w / total) for w in weights]
    scratch = np.empty(min(_CHUNK, out.size), out.dtype)
    finite, squares = True, [0.0] * len(buffers)
    with np.errstate(over="ignore", invalid="ignore"):  # non-finite values are our verdict
        for part in _chunks(out.size):
            finite = _average_chunk(buffers, factors, out[part], scratch, part, finite,
                                    diverge_numel, squares)
    return finite, float(np.mean([s ** 0.5 for s in squares]))


def _average_chunk(buffers, factors, acc, scratch, part, finite, diverge_numel, squares):
    """One chunk of `average_and_diverge`; returns whether the average is finite so far."""
    tmp = scratch[:part.stop - part.start]
    np.multiply(buffers[0][part], factors[0], out=acc)
    for buf, factor in zip(buffers[1:], factors[1:], strict=True):
        np.multiply(buf[part], factor, out=tmp)
        acc += tmp
    # a finite sum means every element is finite; an overflowing sum of finite values is
    # told apart by the element-wise check it then falls back to
    if finite and not (np.isfinite(acc.sum()) or np.isfinite(acc).all()):
        finite = False
    if part.start < diverge_numel:
        inside = slice(0, min(part.stop, diverge_numel) - part.start)
        diff = tmp[inside]
        for i, buf in enumerate(buffers):
            np.subtract(buf[part][inside], acc[inside], out=diff)
            # BLAS's dot: 14x faster than square-then-sum, and its SIMD accumulators keep
            # a chunk's float32 sum within 1e-7 of the exact one; chunks add up in float64
            squares[i] += float(np.dot(diff, diff))
    return finite


def is_finite(buffer: np.ndarray) -> bool:
    return all(np.isfinite(buffer[part]).all() for part in _chunks(buffer.size))


def non_finite_replicas(buffers: Sequence[np.ndarray]) -> list[int]:
    """Indices of the buffers that hold a NaN or an infinity."""
    return [i for i, b in enumerate(buffers) if not is_finite(b)]
