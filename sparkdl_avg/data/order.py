"""Pure data order: how rows map to workers, and which rows each step of an epoch uses.

Rows are numbered 0..N-1 in the DataFrame's order. Row g goes to worker `g % num_workers`, so
partitions differ in size by at most one row, and worker w's j-th row is global row
`j * num_workers + w`. With `shuffle=False` and averaging after every step, the workers' batches
at step t together are exactly rows [t*B*n, (t+1)*B*n): large-batch SGD over the DataFrame in
order, which is what the correctness tests compare against.

Every worker's epoch has as many positions as the largest partition has rows (`epoch_length`),
so every worker takes the same steps and no row is ever left out: a partition one row short
fills its last position by repeating a row it has already visited that epoch, as torch's
`DistributedSampler` pads (`EpochOrder.windows_of`).

A shuffled epoch is cut so that it can be read from disk without holding the partition: the
partition's rows are cut into chunks of contiguous rows (about `CHUNK_BYTES` each), the chunks
are visited in a seeded random order, and each window of consecutive chunks in that order
(about `shuffle_buffer_mb`) is permuted as a whole. A partition that fits in one window is
simply permuted. Both data caches follow this one order, so the cache never changes the
trajectory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

CHUNK_BYTES = 1 << 18
"""Rows read from a disk cache in one contiguous read (256 KiB)."""


def partition_sizes(total_rows: int, num_workers: int) -> list[int]:
    """Rows each worker gets under `g % num_workers` assignment."""
    base, extra = divmod(total_rows, num_workers)
    return [base + (1 if w < extra else 0) for w in range(num_workers)]


def epoch_length(sizes: list[int]) -> int:
    """Positions in every worker's epoch: the largest partition's rows."""
    return max(sizes)


def padded_rows(sizes: list[int]) -> int:
    """Rows repeated per epoch, over all workers, to fill every epoch to `epoch_length`."""
    return len(sizes) * epoch_length(sizes) - sum(sizes)


@dataclass(frozen=True, slots=True)
class Cut:
    """How an epoch is cut: rows per chunk, and chunks per shuffle window."""

    chunk_rows: int
    window_chunks: int

    @property
    def window_rows(self) -> int:
        return self.chunk_rows * self.window_chunks


def make_cut(row_bytes: int, shuffle_buffer_mb: int) -> Cut:
    """Chunks of about CHUNK_BYTES; windows of about `shuffle_buffer_mb` (at least a chunk)."""
    chunk_rows = max(1, CHUNK_BYTES // row_bytes)
    return Cut(chunk_rows, max(1, (shuffle_buffer_mb << 20) // (chunk_rows * row_bytes)))


class EpochOrder:
    """The order in which a worker visits its `num_rows` rows in one epoch (seeded,
    reproducible), window by window: `window(k)` says which rows window k holds, in the order a
    reader lays them out (whole chunks, each contiguous), and in which order they are visited."""

    def __init__(self, num_rows: int, *, epoch: int, worker: int, seed: int, shuffle: bool,
                 cut: Cut) -> None:
        self.num_rows, self.cut, self.shuffle = num_rows, cut, shuffle
        self._key = [seed, worker, epoch]
        num_chunks = -(-num_rows // cut.chunk_rows)
        self.single = num_rows <= cut.window_rows
        chunks = np.arange(num_chunks, dtype=np.int64)
        if shuffle and not self.single:
            chunks = np.random.default_rng(self._key).permutation(num_chunks)
        self._chunks = chunks
        lengths = np.minimum(cut.chunk_rows, num_rows - chunks * cut.chunk_rows)
        ends = np.cumsum(lengths)
        self.num_windows = -(-num_chunks // cut.window_chunks)
        last = np.minimum(np.arange(1, self.num_windows + 1) * cut.window_chunks, num_chunks)
        self.window_ends = ends[last - 1] if num_chunks else np.zeros(0, np.int64)
        """Epoch position just past each window."""

    def window_start(self, k: int) -> int:
        return int(self.window_ends[k - 1]) if k else 0

    def ranges(self, k: int) -> list[tuple[int, int]]:
        """Window k's rows as contiguous (start, stop) row ranges, in layout order."""
        size = self.cut.chunk_rows
        chunks = self._chunks[k * self.cut.window_chunks:(k + 1) * self.cut.window_chunks]
        return [(int(c) * size, min(int(c + 1) * size, self.num_rows)) for c in chunks]

    def visit(self, k: int) -> np.ndarray:
        """Window k's visiting order, as positions in its layout."""
        length = int(self.window_ends[k]) - self.window_start(k)
        if not self.shuffle:
            return np.arange(length, dtype=np.int64)
        key = self._key if self.single else self._key + [k + 1]
        return np.random.default_rng(key).permutation(length)

    def rows(self, k: int) -> np.ndarray:
        """Window k's rows in visiting order."""
        layout = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in self.ranges(k)])
        return layout[self.visit(k)]

    def windows_of(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """The windows epoch positions [start, stop) fall in: (window, from, to) with from/to
        positions inside the window. Positions past the partition's rows (the padding of an
        epoch longer than the partition) repeat the last window's first positions: the
        epoch's first rows when the partition is one window, and a window the disk cache has
        just read either way, so padding costs no read."""
        out = []
        k = int(np.searchsorted(self.window_ends, start, side="right"))
        while start < min(stop, self.num_rows) and k < self.num_windows:
            base, end = self.window_start(k), int(self.window_ends[k])
            upto = min(stop, end)
            out.append((k, start - base, upto - base))
            start, k = upto, k + 1
        if stop > self.num_rows and self.num_windows:
            last = self.num_windows - 1
            size = int(self.window_ends[last]) - self.window_start(last)
            position, end = max(start, self.num_rows) - self.num_rows, stop - self.num_rows
            while position < end:  # more than one window's worth only in theory
                a = position % size
                b = min(size, a + end - position)
                out.append((last, a, b))
                position += b - a
        return out


def batch_positions(step_in_epoch: int, batch_size: int, length: int) -> tuple[int, int]:
    """Epoch positions [start, stop) that form minibatch `step_in_epoch` of an epoch of
    `length` positions (`epoch_length`)."""
    start = min(step_in_epoch * batch_size, length)
    return start, min(start + batch_size, length)
