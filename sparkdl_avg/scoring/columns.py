"""The inputs scoring reads, as the fit read them (the DataFrame's columns themselves come from
`data/describe.input_columns`, as the fit's): on the executors (or in an MLflow model), Arrow or
pandas columns read into numpy (`data/arrow_columns`) and checked for NaN and infinities; a
chunk of rows as the model's input tensors (`chunk`), ragged ones padded to the chunk's
longest row; and the schema of a model of one float vector (`vector_schema`).
"""

from __future__ import annotations

import numpy as np

from sparkdl_avg._errors import DataError
from sparkdl_avg.data.arrow_columns import Column, check_fits, pad, read_column
from sparkdl_avg.data.schema import DataSchema, FieldSpec


def vector_schema(column, width: int, float_dtype: str) -> DataSchema:
    """The schema of a model of one float vector (what a fit carried before typed inputs,
    and what a model saved then is read as): `column`, or numeric columns assembled."""
    column = column if isinstance(column, str) else tuple(column)
    name = column if isinstance(column, str) else "features"
    field = FieldSpec(role="input", name=name, column=column, wire="_x0", dtype=float_dtype,
                      shape=(width,), source="array<float>")
    return DataSchema(inputs=(field,), binding="single", labels=(), label_list=False,
                      float_dtype=float_dtype)


def with_column(schema: DataSchema, column) -> DataSchema:
    """A one-input schema reading its input from another column (`features_col=`)."""
    from dataclasses import replace

    from sparkdl_avg._errors import ConfigError

    if len(schema.inputs) != 1:
        raise ConfigError(f"features_col= replaces the column of a one-input model; this one "
                          f"reads {len(schema.inputs)} inputs: {schema.input_names}")
    if not isinstance(column, str) and not (isinstance(column, (list, tuple)) and column):
        raise DataError(f"features_col must be a column name or a non-empty list, got "
                        f"{column!r}")
    field = schema.inputs[0]
    name = column if isinstance(column, str) and schema.binding == "single" else field.name
    column = column if isinstance(column, str) else tuple(column)
    return replace(schema, inputs=(replace(field, column=column, name=name),))


def read_arrow(arrays, schema: DataSchema) -> list[Column]:
    """One Arrow array per input (then per ident, where `schema` keeps them) -> numpy
    columns, each checked (`checked`)."""
    fields = (*schema.inputs, *schema.idents)
    return [checked(read_column(a, f), f) for a, f in zip(arrays, fields, strict=True)]


def read_pandas(data, schema: DataSchema) -> list[Column]:
    """An MLflow model's input: a pandas DataFrame holding the input columns (a list or an
    array per cell), a dict of numpy arrays `[rows, *shape]` by input column (`FieldSpec.key`;
    a binary one's a list of bytes, an image struct's a list of dicts), or one numpy array for
    a one-input model."""
    import pandas as pd
    import pyarrow as pa

    if isinstance(data, pd.DataFrame):
        return [checked(read_column(pa.array(_cells(data, f)), f), f) for f in schema.inputs]
    if isinstance(data, np.ndarray):
        data = {schema.inputs[0].key: data} if len(schema.inputs) == 1 else {}
    if not isinstance(data, dict):
        raise DataError(f"the model scores a pandas DataFrame or numpy arrays, got "
                        f"{type(data).__name__}")
    out = []
    for f in schema.inputs:
        if f.key not in data:
            raise DataError(f"the input {f.key!r} is missing; given: {sorted(data)}")
        if f.encoded:  # bytes, or image structs as dicts: as a DataFrame's cells are read
            out.append(read_column(pa.array(_cells(pd.DataFrame({f.key: list(data[f.key])}),
                                                   f)), f))
            continue
        values = np.asarray(data[f.key])
        if f.ragged:  # rows of one length: a fixed block, read as ragged rows
            lengths = np.full(len(values), values.shape[1] if values.ndim > 1 else 0, np.int64)
            values = values.reshape(-1, *f.inner)
        else:
            lengths = None
            values = values.reshape(len(values), *f.shape)
        if values.dtype != np.dtype(f.dtype):
            check_fits(values, f)
        out.append(checked(Column(values.astype(f.dtype, copy=False), lengths), f))
    return out


def _cells(frame, field: FieldSpec) -> list:
    for key in (field.key, field.name):
        if key in frame.columns:
            series = frame[key]
            break
    else:
        raise DataError(f"the DataFrame has no column {field.key!r} ({field.described}); "
                        f"columns: {list(frame.columns)}")
    if field.image:  # a dict per cell, or a pyspark Row (a DataFrame's toPandas())
        return [c.asDict() if hasattr(c, "asDict") else c for c in series]
    return [c.tolist() if isinstance(c, np.ndarray) else c for c in series]


def checked(column: Column, field: FieldSpec) -> Column:
    """`column`, or a DataError naming the field's column when a float input holds NaN or
    an infinity: scored, they would give an answer (a classifier's argmax returns a class for
    NaN too); training's validation refuses them as well."""
    if field.kind != "float" or column.values.size == 0:
        return column
    values = column.values
    finite = np.isfinite(values.reshape(len(values), -1)).all(axis=1)
    if finite.all():
        return column
    if column.lengths is None:
        rows, bad = len(values), int((~finite).sum())
    else:
        rows = len(column.lengths)
        owner = np.repeat(np.arange(rows), column.lengths)
        bad = len(np.unique(owner[~finite]))
    raise DataError(f"{field.described} holds NaN or infinite values in {bad} of {rows} rows "
                    "of a batch: cannot score them; drop or impute those rows first")


def rows_of(columns: list[Column]) -> int:
    c = columns[0]
    return len(c.lengths) if c.lengths is not None else len(c.values)


def chunk(columns: list[Column], schema: DataSchema, start: int, stop: int, float_dtype,
          device):
    """Rows [start, stop) as the model's input tensors on `device` (ragged ones padded to the
    chunk's longest row), and the rows' lengths of each ragged input, by its index."""
    import torch

    inputs, lengths = [], {}
    for i, (column, field) in enumerate(zip(columns, schema.inputs, strict=True)):
        dtype = field.torch_dtype(float_dtype)
        if column.lengths is None:
            inputs.append(_tensor(column.values[start:stop], device, dtype))
            continue
        # from the host's lengths: no device sync a chunk, no starts of the whole column
        host = column.lengths[start:stop]
        begin, count = int(column.lengths[:start].sum()), int(host.sum())
        rows = torch.from_numpy(host).to(device)
        values = _tensor(column.values[begin:begin + count], device, dtype)
        inputs.append(pad(values, rows, field.pad_value,
                          longest=int(host.max()) if len(host) else 0))
        lengths[i] = rows
    return tuple(inputs), lengths


def row_lengths(columns: list[Column], schema: DataSchema, start: int, stop: int,
                device) -> dict:
    """The lengths of rows [start, stop) of each of `schema`'s ragged inputs, by its index,
    as tensors on `device`, read from `columns`: the raw columns of `fit(preprocess=)`, one
    per input in `schema`'s order. With a preprocess, `schema` is the model's
    (`feed.model_schema`): a ragged input there is one the preprocess passed through
    unchanged, so its raw column's lengths are the rows' lengths; what the preprocess
    returns has one padded shape a batch, whose rows' own lengths only it knew."""
    import torch

    return {i: torch.from_numpy(columns[i].lengths[start:stop]).to(device)
            for i, f in enumerate(schema.inputs) if f.ragged}


def raw_parts(columns: list[Column], start: int, stop: int) -> list:
    """Rows [start, stop) as they were read, for `fit(preprocess=)`: per input an array, or
    a ragged one's (values, lengths) (`disk_cache.Window.part`'s form)."""
    out = []
    for column in columns:
        if column.lengths is None:
            out.append(column.values[start:stop])
            continue
        host = column.lengths[start:stop]
        begin = int(column.lengths[:start].sum())
        out.append((column.values[begin:begin + int(host.sum())], host))
    return out


def _tensor(values: np.ndarray, device, dtype):
    import torch

    if not values.flags.writeable:  # zero-copy from Arrow: torch warns on read-only memory
        values = values.copy()
    out = torch.from_numpy(np.ascontiguousarray(values))
    if device.type == "cuda":
        out = out.pin_memory().to(device, non_blocking=True)
    return out.to(dtype)
