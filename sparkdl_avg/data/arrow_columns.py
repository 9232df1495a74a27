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
from sparkdl_avg.data.schema import IMAGE_FIELDS, FieldSpec


@dataclass(frozen=True, slots=True)
class Column:
    values: np.ndarray
    """`[rows, *shape]`, or for a ragged field `[total, *inner]`."""
    lengths: np.ndarray | None = None
    """A ragged field's rows' lengths (int64); None for a fixed shape."""


def as_numpy(array: pa.Array) -> np.ndarray:
    """`array`'s values in numpy. A number array without nulls (what training reads) is
    viewed where it lies, in its data buffer: pyarrow's `to_numpy` imports pandas on its
    first call, 0.35 s of every cold Python worker before its first step, and nothing else a
    task does needs pandas. Booleans (bit-packed), nulls and other types go to `to_numpy`."""
    t = array.type
    kind = "i" if pa.types.is_signed_integer(t) else "u" if pa.types.is_unsigned_integer(t) \
        else "f" if pa.types.is_floating(t) else None
    if kind is None or array.null_count:
        return array.to_numpy(zero_copy_only=False)
    dtype = np.dtype(f"{kind}{t.bit_width // 8}")  # Arrow's memory is in native order
    data = array.buffers()[1]
    if data is None or len(array) == 0:
        return np.empty(0, dtype)
    return np.frombuffer(data, dtype, count=len(array), offset=array.offset * dtype.itemsize)


def read_column(array: pa.Array, field: FieldSpec) -> Column:
    """The rows of `array` (one column of a batch) as `field` describes them. Raises DataError
    naming the column for a null (NaN in floats read for an integer field too), or for a
    row whose shape is not the field's."""
    if isinstance(array, pa.ChunkedArray):
        array = array.combine_chunks()
    if field.image and pa.types.is_struct(array.type):
        return _image_column(array, field)
    if field.encoded:
        return _binary_column(array, field)
    rows = len(array)
    lengths = None
    dims = field.inner if field.ragged else field.shape
    for level in range(len(field.shape)):
        if array.null_count:
            raise DataError(f"{field.described} holds nulls: cannot use them")
        counts = as_numpy(pc.list_value_length(array))
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
    values = as_numpy(array)
    if values.dtype != np.dtype(field.dtype):
        check_fits(values, field)
        values = values.astype(field.dtype)
    shape = (-1, *field.inner) if field.ragged else (rows, *field.shape)
    return Column(values.reshape(shape), lengths)


def _binary_column(array: pa.Array, field: FieldSpec) -> Column:
    """A binary column's rows as flat uint8 values and lengths, from its offsets and data
    buffers as they are: no copy per row. A string column (a text field's, as scoring gets
    it) has the same buffers: its UTF-8 bytes."""
    if not (pa.types.is_binary(array.type) or pa.types.is_large_binary(array.type)
            or (field.text and (pa.types.is_string(array.type)
                                or pa.types.is_large_string(array.type)))):
        raise DataError(f"{field.described} is {array.type}, not "
                        f"{'a string' if field.text else 'binary'}")
    if array.null_count:
        raise DataError(f"{field.described} holds nulls: cannot use them")
    _, offsets, data = array.buffers()
    width = np.int64 if pa.types.is_large_binary(array.type) or \
        pa.types.is_large_string(array.type) else np.int32
    offsets = np.frombuffer(offsets, width)[array.offset:array.offset + len(array) + 1]
    values = np.frombuffer(data, np.uint8) if data is not None else np.zeros(0, np.uint8)
    return Column(values[offsets[0]:offsets[-1]], np.diff(offsets).astype(np.int64))


def _image_column(array: pa.StructArray, field: FieldSpec) -> Column:
    """Spark's image struct as it comes (a `predict_udf` argument, a pyfunc's rows) packed as
    the fit carried it (`describe.pack_image`: a 16-byte big-endian header of its ints, then
    `data`), so scoring reads either form alike; the headers and the pixels are placed with
    two vectorised writes, not a loop over rows."""
    names = {array.type.field(i).name for i in range(array.type.num_fields)}
    missing = [n for n in ("data", *IMAGE_FIELDS) if n not in names]
    if missing:
        raise DataError(f"{field.described} is {array.type}: an image struct needs the "
                        f"fields {missing}")
    if array.null_count:
        raise DataError(f"{field.described} holds nulls: cannot use them")
    data = _binary_column(pc.struct_field(array, "data"), field)
    header = np.empty((len(array), len(IMAGE_FIELDS)), ">i4")
    for i, name in enumerate(IMAGE_FIELDS):
        ints = pc.struct_field(array, name)
        if ints.null_count or not pa.types.is_integer(ints.type):
            raise DataError(f"{field.described}: its {name!r} must be integers without "
                            f"nulls, got {ints.type} with {ints.null_count} nulls")
        ints = as_numpy(ints)
        if ints.size and (ints.min() < -2**31 or ints.max() >= 2**31):
            raise DataError(f"{field.described}: its {name!r} holds {ints.min()} to "
                            f"{ints.max()}, beyond the int32 Spark's image source has")
        header[:, i] = ints
    width = header.itemsize * header.shape[1]
    lengths = data.lengths + width
    values = np.empty(int(lengths.sum()), np.uint8)
    at = (starts_of(lengths)[:, None] + np.arange(width)).ravel()
    values[at] = header.view(np.uint8).ravel()
    pixels = np.ones(len(values), bool)
    pixels[at] = False
    values[pixels] = data.values
    return Column(values, lengths)


def check_fits(values: np.ndarray, field: FieldSpec) -> None:
    """Integers narrowed to the field's width (a pandas frame scored by the MLflow model holds
    int64, a DataFrame scored may hold bigint ids: `describe.carry` leaves them wide) must fit
    it: a wrapped id would be scored as another one. Floats for an integer or
    bool field must hold no NaN: pandas holds a null integer as NaN (Spark's pandas UDF on
    pyspark 4.0, a pyfunc's frame or arrays), which the cast would make INT64_MIN, an id
    nobody gave."""
    if field.kind in ("int", "bool") and values.dtype.kind == "f" and np.isnan(values).any():
        raise DataError(f"{field.described} holds nulls: cannot use them")
    if field.kind != "int" or values.dtype.kind not in "iu" or not values.size:
        return
    info = np.iinfo(np.dtype(field.dtype))
    low, high = values.min(), values.max()
    if low < info.min or high > info.max:
        raise DataError(f"{field.described} holds {low} to {high}, beyond the {field.dtype} "
                        f"the fit read it as ({info.min} to {info.max}): the model never saw "
                        "such a value; filter those rows out first")


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
