"""Pure data order: how rows map to workers, and which rows each step of an epoch uses.

Rows are numbered 0..N-1 in the DataFrame's order. Row g goes to worker `g % num_workers`, so
partitions differ in size by at most one row, and worker w's j-th row is global row
`j * num_workers + w`. With `shuffle=False` and averaging after every step, the workers' batches
at step t together are exactly rows [t*B*n, (t+1)*B*n): large-batch SGD over the DataFrame in
order, which is what the correctness tests compare against.
"""

from __future__ import annotations

import numpy as np


def partition_sizes(total_rows: int, num_workers: int) -> list[int]:
    """Rows each worker gets under `g % num_workers` assignment."""
    base, extra = divmod(total_rows, num_workers)
    return [base + (1 if w < extra else 0) for w in range(num_workers)]


def epoch_order(num_rows: int, *, epoch: int, worker: int, seed: int, shuffle: bool) -> np.ndarray:
    """The order in which a worker visits its local rows in one epoch (seeded, reproducible)."""
    if not shuffle:
        return np.arange(num_rows, dtype=np.int64)
    return np.random.default_rng([seed, worker, epoch]).permutation(num_rows)


def batch_slice(step_in_epoch: int, batch_size: int, num_rows: int) -> slice:
    """Positions in the epoch order that form minibatch `step_in_epoch`."""
    start = step_in_epoch * batch_size
    return slice(start, min(start + batch_size, num_rows))
