"""A training task's partition: Arrow batches (as `prepare` laid them out) into the data cache,
once per task, each row straight to its place in the worker's local order.

The cache is chosen before the first batch arrives (`cache_kind`): in memory when the
partition's tensors fit `cache_budget_mb`, else spilled to local disk as it arrives, so the
task never holds more than one Arrow batch beyond the cache itself.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from sparkdl_avg._errors import DataError
from sparkdl_avg.data.arrow_columns import as_numpy, read_column
from sparkdl_avg.data.cache import MIB, MemoryColumns, MemoryWriter
from sparkdl_avg.data.columns import EVAL, INDEX, SPLIT, TRAIN
from sparkdl_avg.data.disk_cache import DiskColumns, DiskWriter
from sparkdl_avg.data.ragged import rows_of
from sparkdl_avg.data.schema import DataSchema


@dataclass(frozen=True, slots=True)
class Shape:
    """What a task knows of its partition before reading it."""

    rank: int
    num_workers: int
    train_rows: int
    eval_rows: int
    schema: DataSchema
    ragged_values: dict = field(default_factory=dict)
    """Per ragged field's wire: the mean values a row (outer length x inner size) over the
    whole dataset, which sizes its cache before its rows arrive."""

    @property
    def mean_row_bytes(self) -> float:
        """A row's bytes as carried, a ragged field's by its mean."""
        return float(self.schema.row_bytes(self.ragged_values))

    @property
    def row_bytes(self) -> int:
        return max(1, math.ceil(self.mean_row_bytes))

    @property
    def bytes(self) -> int:
        """The partition's bytes in the cache (estimated by the means for ragged fields)."""
        return math.ceil((self.train_rows + self.eval_rows) * self.mean_row_bytes)


def cache_kind(data_cache: str, shape: Shape, budget_mb: int) -> str:
    """"memory" or "disk": "auto" keeps the partition in memory when it fits the budget."""
    if data_cache != "auto":
        return data_cache
    return "memory" if shape.bytes <= budget_mb * MIB else "disk"


@dataclass(slots=True)
class Partition:
    train: MemoryColumns | DiskColumns
    """As `cache` says."""
    eval: MemoryColumns | DiskColumns
    cache: str
    load_s: float
    spilled_bytes: int

    @property
    def rows(self) -> tuple[int, int]:
        """(training rows, evaluation rows)."""
        return self.train.rows, self.eval.rows

    def close(self) -> None:
        self.train.close()
        self.eval.close()


def load_partition(batches: Iterator, shape: Shape, *, cache: str, spill=None, device,
                   dtype=None, progress=None) -> Partition:
    """Read every batch (columns `[*shape.schema.wires, INDEX, SPLIT]`) into the cache
    ("disk" needs `spill`, a `SpillDir`), telling `progress(rows, done=False)` as it goes.
    Minibatches come out in the model's dtypes: float fields in `dtype` (the model's torch
    dtype; None: as carried), which the memory cache holds them in. Raises DataError when
    the rows are not exactly the ones validation numbered for this worker."""
    started = time.perf_counter()
    sizes = {TRAIN: shape.train_rows, EVAL: shape.eval_rows}
    writers, finished = {}, []
    try:  # every file opened is closed on the way out of a failure
        for split, name in ((TRAIN, "train"), (EVAL, "eval")):
            writers[split] = DiskWriter(spill, name, shape.schema, sizes[split],
                                        shape.ragged_values) if cache == "disk" else \
                MemoryWriter(shape.schema, sizes[split], shape.ragged_values)
        seen = {split: _Seen(sizes[split]) for split in (TRAIN, EVAL)}
        for batch in batches:
            _place(batch, shape, writers, seen)
            if progress is not None:
                progress(seen[TRAIN].count + seen[EVAL].count)
        for split in (TRAIN, EVAL):
            seen[split].check_complete(shape, split)
        for split in (TRAIN, EVAL):
            finished.append(writers[split].finish(device, dtype))
    except BaseException:
        for columns in finished:
            columns.close()
        for writer in writers.values():
            writer.close()
        raise
    train, evaluation = finished  # on the device already: the memory cache synchronised
    if progress is not None:
        progress(seen[TRAIN].count + seen[EVAL].count, done=True)
    spilled = sum(w.bytes for w in writers.values()) if cache == "disk" else 0
    return Partition(train, evaluation, cache, time.perf_counter() - started, spilled)


def _place(batch, shape: Shape, writers: dict, seen: dict) -> None:
    if batch.num_rows == 0:
        return
    columns = [read_column(batch.column(f.wire), f) for f in shape.schema.carried]
    row, split = as_numpy(batch.column(INDEX)), as_numpy(batch.column(SPLIT))
    for part in (TRAIN, EVAL):
        mine = split == part
        if mine.all():  # the common case: no copies of the batch's rows
            keep, offset = None, row - shape.rank
        elif mine.any():
            keep = np.flatnonzero(mine)
            offset = row[keep] - shape.rank
        else:
            continue
        place, order = offset // shape.num_workers, None
        if not (np.diff(place) == 1).all():  # usually rows come in order, in runs
            order = np.argsort(place, kind="stable")
            place = place[order]
        if ((offset % shape.num_workers) != 0).any() or place[0] < 0 or \
                place[-1] >= seen[part].rows:
            raise _changed(shape, f"rows numbered for another worker or beyond "
                                  f"{seen[part].rows} {_NAMES[part]} rows")
        seen[part].add(place, shape)
        writers[part].write(place, [_rows(c, f, keep, order)
                                    for c, f in zip(columns, shape.schema.carried,
                                                    strict=True)])


def _rows(column, field, keep, order):
    """A column's rows of one split (`keep`, None: all), in place order (`order`)."""
    if field.ragged:
        return rows_of(column, keep, order)
    pick = keep if order is None else order if keep is None else keep[order]
    return column.values if pick is None else column.values[pick]


_NAMES = {TRAIN: "training", EVAL: "evaluation"}


class _Seen:
    """Which places have been written (one bit per row), to catch a row arriving twice."""

    def __init__(self, rows: int) -> None:
        self.rows, self.count = rows, 0
        self._bits = np.zeros((rows + 7) // 8, np.uint8)

    def add(self, place: np.ndarray, shape: Shape) -> None:
        byte, bit = place >> 3, (1 << (place & 7)).astype(np.uint8)
        if (self._bits[byte] & bit).any() or (place[1:] == place[:-1]).any():
            raise _changed(shape, "a row arrived twice")
        np.bitwise_or.at(self._bits, byte, bit)
        self.count += place.size

    def check_complete(self, shape: Shape, split: int) -> None:
        if self.count != self.rows:
            raise _changed(shape, f"received {self.count} {_NAMES[split]} rows, validation "
                                  f"counted {self.rows}")


def _changed(shape: Shape, what: str) -> DataError:
    return DataError(
        f"partition {shape.rank}: {what}: the DataFrame changed between validation and "
        "training (a nondeterministic source or a table being written?). Cache it or write it "
        "to storage before fit().")
