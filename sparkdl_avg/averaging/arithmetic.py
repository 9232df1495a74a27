"""Pure averaging arithmetic on flat parameter buffers: numpy in, numpy out.

Not torch: its OpenMP threads spin for milliseconds after each parallel operation. On a
driver that shares its machine with the executors (local mode, or a driver co-located with a
worker), that spinning took a core from the training tasks between rounds: 24 ms of CPU for
12 ms of work a round, against 2 ms for the same arithmetic here (MNIST-1D's MLP, 1.1M
parameters, two replicas). Work runs in chunks, so temporaries stay small and in cache; a
large buffer's chunks are split into contiguous spans on the caller's threads (numpy
releases the GIL), each element computed exactly as on one thread."""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import Executor

import numpy as np

_CHUNK = 1 << 16
"""Elements per chunk: 256 KiB of float32, 512 KiB of float64."""
_MIN_SPAN_CHUNKS = 8
"""Fewer chunks a thread than this (2M float32 elements in all for 2 threads) stay on one
thread: handing out the work would cost more than it saves."""


def _chunks(start: int, stop: int):
    for first in range(start, stop, _CHUNK):
        yield slice(first, min(first + _CHUNK, stop))


def weighted_average(
    buffers: Sequence[np.ndarray], weights: Sequence[float], out: np.ndarray
) -> None:
    """out = sum_i w_i * x_i / sum_i w_i, computed in the buffers' dtype."""
    average_and_diverge(buffers, weights, out, diverge_numel=0)


def average_and_diverge(buffers: Sequence[np.ndarray], weights: Sequence[float],
                        out: np.ndarray, *, diverge_numel: int, pool: Executor | None = None,
                        threads: int = 1) -> tuple[bool, float]:
    """A round's arithmetic in one pass over memory: `weighted_average` into `out`, whether
    `out` is finite, and the replicas' mean L2 distance from it (how far they drifted in a
    round) over their first `diverge_numel` elements (the parameters, not the optimizer
    state that may follow), chunk by chunk in cache. `pool`: up to `threads` spans of
    chunks run there at once; the results are those of one thread, bit for bit."""
    if len(buffers) != len(weights) or not buffers:
        raise ValueError("need one weight per buffer and at least one buffer")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("weights must sum to a positive number")
    factors = [out.dtype.type(w / total) for w in weights]
    chunks = -(-out.size // _CHUNK)
    spans = max(1, min(threads, chunks // _MIN_SPAN_CHUNKS)) if pool is not None else 1
    bounds = [(chunks * k // spans) * _CHUNK for k in range(spans + 1)]
    dots: list[list[float]] = [[] for _ in range(chunks)]
    """Per chunk, each replica's squared distance (added up in chunk order below, as one
    thread would)."""

    def span(k: int) -> bool:
        return _average_span(buffers, factors, out, bounds[k], min(bounds[k + 1], out.size),
                             diverge_numel, dots)

    with np.errstate(over="ignore", invalid="ignore"):  # non-finite values are our verdict
        finite = all([span(0)] if spans == 1 else list(pool.map(span, range(spans))))
    squares = [0.0] * len(buffers)
    for chunk in dots:
        for i, square in enumerate(chunk):
            squares[i] += square
    return finite, float(np.mean([s ** 0.5 for s in squares]))


def _average_span(buffers, factors, out, start, stop, diverge_numel, dots) -> bool:
    """`average_and_diverge` over elements [start, stop), chunk by chunk; whether the
    average is finite there."""
    scratch = np.empty(min(_CHUNK, max(stop - start, 0)), out.dtype)
    finite = True
    for part in _chunks(start, stop):
        finite &= average_chunk(buffers, factors, out[part], scratch, part, diverge_numel,
                                 dots[part.start // _CHUNK])
    return finite


def average_chunk(buffers, factors, acc, scratch, part, diverge_numel, dots) -> bool:
    """One chunk (`part` of each of `buffers`): the average into `acc`, each replica's squared
    distance from it appended to `dots` over the elements before `diverge_numel`; whether the
    chunk's average is finite. `scratch` holds at least the chunk."""
    tmp = scratch[:part.stop - part.start]
    np.multiply(buffers[0][part], factors[0], out=acc)
    for buf, factor in zip(buffers[1:], factors[1:], strict=True):
        np.multiply(buf[part], factor, out=tmp)
        acc += tmp
    inside = max(0, min(part.stop, diverge_numel) - part.start)
    if inside:
        diff = tmp[:inside]
        for buf in buffers:
            np.subtract(buf[part.start:part.start + inside], acc[:inside], out=diff)
            # BLAS's dot: 14x faster than square-then-sum, and its SIMD accumulators keep
            # a chunk's float32 sum within 1e-7 of the exact one; chunks add up in float64
            dots.append(float(np.dot(diff, diff)))
    # The finiteness verdict costs no pass of its own where the distances are taken: x - a
    # is NaN or infinite wherever the average a is, whatever x, so finite distances mean a
    # finite average there; a distance that overflowed (finite values over 1.8e19 apart)
    # falls back to the element-wise check. Past them, a finite sum means every element is
    # finite, and an overflowing sum of finite values is told apart the same way.
    if not all(map(math.isfinite, dots)) and not np.isfinite(acc[:inside]).all():
        return False
    rest = acc[inside:]
    return not rest.size or bool(np.isfinite(rest.sum()) or np.isfinite(rest).all())


def is_finite(buffer: np.ndarray) -> bool:
    return all(np.isfinite(buffer[part]).all() for part in _chunks(0, buffer.size))


def non_finite_replicas(buffers: Sequence[np.ndarray]) -> list[int]:
    """Indices of the buffers that hold a NaN or an infinity."""
    return [i for i, b in enumerate(buffers) if not is_finite(b)]
