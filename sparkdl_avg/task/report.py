"""The row each training task returns to the driver, defined once: the DDL string Spark needs
for `mapInArrow` and the Arrow schema the task writes are both derived from `FIELDS`."""

from __future__ import annotations

FIELDS = (
    ("partition", "int"), ("host", "string"), ("pid", "long"), ("device", "string"),
    ("gpu", "string"), ("warning", "string"), ("train_rows", "long"), ("eval_rows", "long"),
    ("load_s", "double"), ("version", "string"), ("library", "string"),
    ("cache", "string"), ("start_rss_mb", "double"), ("peak_rss_mb", "double"),
    ("spilled_mb", "double"), ("load_mb_s", "double"), ("read_mb_s", "double"),
)
"""What the task ran on and where its library came from (a --py-files zip, an environment);
its data cache ("memory" or "disk"), resident memory when it started and at its peak (None
off Linux), bytes spilled, and the throughput of loading the partition and of assembling
minibatches from the cache."""

DDL = ", ".join(f"{name} {kind}" for name, kind in FIELDS)


def record_batch(values: dict):
    """One Arrow row of `values` (keyed by FIELDS' names) under the derived schema."""
    import pyarrow as pa

    arrow = {"int": pa.int32(), "long": pa.int64(), "double": pa.float64(),
             "string": pa.string()}
    schema = pa.schema([(name, arrow[kind]) for name, kind in FIELDS])
    return pa.RecordBatch.from_pydict({name: [values[name]] for name, _ in FIELDS},
                                      schema=schema)
