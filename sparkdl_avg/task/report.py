"""The row each training task returns to the driver, defined once: the Spark schema
`mapInArrow` needs and the Arrow schema the task writes are both derived from `FIELDS`."""

from __future__ import annotations

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
    """One Arrow row of `values` (keyed by the fields' names) under the derived schema."""
    import pyarrow as pa

    arrow = {"int": pa.int32(), "long": pa.int64(), "double": pa.float64(),
             "string": pa.string(), "binary": pa.binary()}
    schema = pa.schema([(name, arrow[kind]) for name, kind in fields])
    return pa.RecordBatch.from_pydict({name: [values[name]] for name, _ in fields},
                                      schema=schema)
