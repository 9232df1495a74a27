"""Arrow columns to numpy and tensors, one call per column of a batch, never a loop over rows.

A fixed-shape field's rows become one array `[rows, *shape]`; a ragged field's become its flat
values `[total, *inner]` and the rows' lengths. `pad` lays ragged rows into a
`[rows, longest, *inner]` tensor, the rest filled with the field's pad value.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from sparkdl_avg._errors import DataError
from sparkdl_avg.data.schema import FieldSpec


@dataclass(frozen=True, slots=True)
class Column:
    values: np.ndarray
    """`[rows, *shape]`, or for a ragged field `[total, *inner]`."""
    lengths: np.ndarray | None = None
    """A ragged field's rows' lengths (int64); None for a fixed shape."""


def read_column(array: pa.Array, field: FieldSpec) -> Column:
    """The rows of `array` (one column of a batch) as `field` describes them. Raises DataError
    naming the column for a null, or for a row whose shape is not the field's."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if field.encoded:
        return _binary_column(array, field)
    rows = len(array)
    lengths = None
    dims = field.inner if field.ragged else field.shape
    for level in range(len(field.shape)):
        if array.null_count:
            raise DataError(f"{field.described} holds nulls: cannot use them")
        counts = pc.list_value_length(array).to_numpy(zero_copy_only=False)
        if level == 0 and field.ragged:
            lengths = counts.astype(np.int64, copy=False)
        else:
            want = dims[level - 1] if field.ragged else dims[level]
            if len(counts) and (counts.min() != want or counts.max() != want):
                raise DataError(
                    f"{field.described}: rows have {int(counts.min())} to {int(counts.max())} "
                    f"values at depth {level + 1}, but the fit saw {want} (row shape "
                    f"{_shape_text(field.shape)})")
        array = array.flatten()
    if array.null_count:
        raise DataError(f"{field.described} holds nulls: cannot use them")
    values = array.to_numpy(zero_copy_only=False)
    if values.dtype != np.dtype(field.dtype):
        check_fits(values, field)
        values = values.astype(field.dtype)
    shape = (-1, *field.inner) if field.ragged else (rows, *field.shape)
    return Column(values.reshape(shape), lengths)


def _binary_column(array: pa.Array, field: FieldSpec) -> Column:
    """A binary column's rows as flat uint8 values and lengths, from its offsets and data
    buffers as they are: no copy per row."""
    if not pa.types.is_binary(array.type) and not pa.types.is_large_binary(array.type):
        raise DataError(f"{field.described} is {array.type}, not binary")
    if array.null_count:
        raise DataError(f"{field.described} holds nulls: cannot use them")
    _, offsets, data = array.buffers()
    width = np.int64 if pa.types.is_large_binary(array.type) else np.int32
    offsets = np.frombuffer(offsets, width)[array.offset:array.offset + len(array) + 1]
    values = np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8)
    return Column(values[offsets[0]:offsets[-1]], np.diff(offsets).astype(np.int64))


def check_fits(values: np.ndarray, field: FieldSpec) -> None:
    """Integers narrowed to the field's width (a pandas frame scored by the MLflow model holds
    int64) must fit it: a wrapped id would be scored as another one."""
    if field.kind != "int" or values.dtype.kind not in "iu" or not values.size:
        return
    info = np.iinfo(np.dtype(field.dtype))
    low, high = values.min(), values.max()
    if low < info.min or high > info.max:
        raise DataError(f"{field.described} holds {low} to {high}, beyond the {field.dtype} "
                        "the fit read it as")


def _shape_text(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join("*" if d == -1 else str(d) for d in shape) + "]"


def pad(values, lengths, pad_value, longest: int | None = None):
    """Ragged rows (torch tensors: flat `values` `[total, *inner]`, `lengths` `[rows]`) as
    `[rows, longest, *inner]`, padded with `pad_value`; `longest` defaults to the longest
    row."""
    import torch

    rows = int(lengths.shape[0])
    if longest is None:
        longest = int(lengths.max()) if rows else 0
    out = torch.full((rows, longest, *values.shape[1:]), pad_value, dtype=values.dtype,
                     device=values.device)
    keep = torch.arange(longest, device=values.device)[None, :] < lengths[:, None]
    # not out[keep] = values: boolean indexing on the CPU is about 100 times slower (3 ms
    # for 64 rows of 128 ids), and on CUDA it waits for the device
    return out.masked_scatter_(keep.view(*keep.shape, *(1,) * (values.dim() - 1)), values)


def starts_of(lengths: np.ndarray) -> np.ndarray:
    """Where each row's values start in the flat values."""
    starts = np.zeros(len(lengths), np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return starts
