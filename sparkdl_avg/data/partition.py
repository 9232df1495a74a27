"""A training task's partition: Arrow batches (as `prepare` laid them out) to tensors on the
task's device, once per task."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from sparkdl_avg.data.columns import TRAIN


@dataclass(frozen=True, slots=True)
class Partition:
    x_train: object
    y_train: object
    x_eval: object
    y_eval: object

    @property
    def rows(self) -> tuple[int, int]:
        """(training rows, evaluation rows)."""
        return int(self.x_train.shape[0]), int(self.x_eval.shape[0])


def load_partition(batches: Iterator, *, num_features: int, double_precision: bool,
                   long_labels: bool, device) -> Partition:
    """Rows sorted by their global number (Spark's shuffle delivers them in no fixed order),
    so the data order is deterministic; features in the model's precision class."""
    import torch

    feats, labels, rows, splits = [], [], [], []
    for batch in batches:
        values = batch.column(0).flatten().to_numpy(zero_copy_only=False)
        feats.append(values.reshape(-1, num_features))
        labels.append(batch.column(1).to_numpy(zero_copy_only=False))
        rows.append(batch.column(2).to_numpy(zero_copy_only=False))
        splits.append(batch.column(3).to_numpy(zero_copy_only=False))
    float_dtype = np.float64 if double_precision else np.float32
    if not feats:
        empty = torch.empty(0, num_features)
        return Partition(empty, torch.empty(0), empty, torch.empty(0))
    x, y = np.concatenate(feats), np.concatenate(labels)
    row, split = np.concatenate(rows), np.concatenate(splits)
    order = np.lexsort((row, split))
    n_train = int(np.count_nonzero(split == TRAIN))
    x = x[order].astype(float_dtype, copy=False)
    y = y[order].astype(np.int64 if long_labels else float_dtype, copy=False)

    def to_device(a: np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(a))
        if device.type == "cuda":
            return t.pin_memory().to(device, non_blocking=True)
        return t

    out = Partition(to_device(x[:n_train]), to_device(y[:n_train]), to_device(x[n_train:]),
                    to_device(y[n_train:]))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out
