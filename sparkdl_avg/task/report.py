"""The row each training task returns to the driver, defined once: the Spark schema
`mapInArrow` needs and the Arrow schema the task writes are both derived from `FIELDS`."""

from __future__ import annotations

import operator

FIELDS = (
    ("partition", "int"), ("host", "string"), ("pid", "long"), ("device", "string"),
    ("gpu", "string"), ("warning", "string"), ("train_rows", "long"), ("eval_rows", "long"),
    ("load_s", "double"), ("version", "string"), ("library", "string"),
    ("cache", "string"), ("start_rss_mb", "double"), ("peak_rss_mb", "double"),
    ("spilled_mb", "double"), ("load_mb_s", "double"), ("read_mb_s", "double"),
    ("batch_wait_s", "double"), ("pad_fraction", "double"), ("pad_positions", "long"),
    ("ragged_positions", "long"),
)
"""What the task ran on and where its library came from (a --py-files zip, an environment);
its data cache ("memory" or "disk"), resident memory when it started and at its peak (None
off Linux), bytes spilled, and the throughput of loading the partition and of reading
minibatches from the cache (as the model gets them; with `fit(preprocess=)`, the raw rows
it gets), and the seconds the training thread waited for its minibatches; its ragged
inputs' positions trained on, those of them that were padding, and their share (None
without ragged inputs)."""


def struct_type(fields=FIELDS):
    """The Spark schema of (name, kind) pairs, kind one of int, long, double, string,
    binary, as a type object: a DDL string would go through Spark's SQL parser, whose first
    use costs a cold session's driver about 0.35 s."""
    from pyspark.sql import types as T

    types = {"int": T.IntegerType(), "long": T.LongType(), "double": T.DoubleType(),
             "string": T.StringType(), "binary": T.BinaryType()}
    return T.StructType([T.StructField(name, types[kind]) for name, kind in fields])


def record_batch(values: dict, fields=FIELDS):
    """One Arrow row of `values` (keyed by the fields' names) under the derived schema.
    Built from buffers, not with `pa.array`: pyarrow's conversion of Python values imports
    pandas on its first call (0.35 s of a cold Python worker, on the probe job before every
    cold fit's first step), and no task needs pandas otherwise."""
    import pyarrow as pa

    types = [_arrow_type(kind) for _, kind in fields]
    schema = pa.schema([(name, t) for (name, _), t in zip(fields, types, strict=True)])
    return pa.RecordBatch.from_arrays(
        [_one_value(kind, t, values[name]) for (name, kind), t in zip(fields, types, strict=True)],
        schema=schema)


def _arrow_type(kind: str):
    import pyarrow as pa

    return {"int": pa.int32(), "long": pa.int64(), "double": pa.float64(),
            "string": pa.string(), "binary": pa.binary()}[kind]


_NUMPY = {"int": "int32", "long": "int64", "double": "float64"}


def _one_value(kind: str, arrow_type, value):
    """A one-element Arrow array of `kind` (its Arrow type `arrow_type`) holding `value`
    (None: a null)."""
    import numpy as np
    import pyarrow as pa

    if value is None:
        return pa.nulls(1, arrow_type)
    if kind in _NUMPY:  # an integer field takes integers only, as `pa.array` would
        if isinstance(value, (bool, np.bool_)) and kind != "double":
            raise TypeError(f"an integer field got {value!r}")
        number = float(value) if kind == "double" else operator.index(value)
        return pa.Array.from_buffers(arrow_type, 1,
                                     [None, pa.py_buffer(np.array([number], _NUMPY[kind]))])
    if kind == "string" or isinstance(value, str):
        if not isinstance(value, str):
            raise TypeError(f"a string field got {type(value).__name__}")
        value = value.encode()
    data = memoryview(value).cast("B")  # bytes, bytearray or a slice's view, not copied
    offsets = np.array([0, data.nbytes], np.int32)
    return pa.Array.from_buffers(arrow_type, 1,
                                 [None, pa.py_buffer(offsets), pa.py_buffer(data)])
