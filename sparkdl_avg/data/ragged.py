"""Ragged columns (the outer length varies by row) without a loop over rows.

Either cache holds a ragged column as its flat values `[total, *inner]` and, per row, where its
values start and how many there are. The values are appended as rows arrive (in no fixed
order); the starts and lengths are fixed-width, so they go to each row's place like any other
column. Reading rows back is then an index computed once per batch (`value_index`), and on
disk one read per run of rows whose values lie one after another in the file (`runs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparkdl_avg.data.arrow_columns import Column, starts_of


@dataclass(frozen=True, slots=True)
class RaggedRows:
    """Rows of a ragged column: `values` flat, each row's `starts` in them and `lengths`."""

    values: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray


def value_index(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Positions in the flat values of the rows (starts, lengths), one row after another."""
    total = int(lengths.sum())
    if not total:
        return np.zeros(0, np.int64)
    # each value's position is its place in the output plus its row's shift
    return np.repeat(starts - starts_of(lengths), lengths) + np.arange(total, dtype=np.int64)


def rows_of(column: Column, keep: np.ndarray | None, order: np.ndarray | None) -> RaggedRows:
    """A batch's ragged column (as `arrow_columns.read_column` gives it) cut to the rows
    `keep` (None: all; their values are copied, so a cache never stores another split's), with
    starts and lengths then permuted by `order` (None: as they are). The values stay in
    arrival order: only where each row's values lie is put in order."""
    values, lengths = column.values, column.lengths
    if keep is not None:
        values = values[value_index(starts_of(lengths)[keep], lengths[keep])]
        lengths = lengths[keep]
    starts = starts_of(lengths)
    if order is not None:
        starts, lengths = starts[order], lengths[order]
    return RaggedRows(values, starts, lengths)


def runs(starts: np.ndarray, lengths: np.ndarray):
    """The reads that fetch rows (starts, lengths) into one buffer, row after row: runs of
    non-empty rows whose values follow one another in the values store. Returns (where each
    run starts in the store, its values, where it goes in the buffer)."""
    local = starts_of(lengths)
    full = np.flatnonzero(lengths)
    starts, lengths, local = starts[full], lengths[full], local[full]
    if not full.size:
        empty = np.zeros(0, np.int64)
        return empty, empty, empty
    first = np.r_[0, np.flatnonzero(starts[1:] != starts[:-1] + lengths[:-1]) + 1]
    return starts[first], np.add.reduceat(lengths, first), local[first]


def pad_counts(lengths: np.ndarray, longest: int) -> tuple[int, int]:
    """(pad positions, all positions) of rows of `lengths` padded to `longest`."""
    positions = int(lengths.size) * longest
    return positions - int(lengths.sum()), positions


def longest(lengths: np.ndarray) -> int:
    return int(lengths.max()) if lengths.size else 0
