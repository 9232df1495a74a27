"""What a type string costs a cold session against a type object: the fit's first job schema
and cast given as DDL strings (Spark's SQL parser, on its first use) or as
`pyspark.sql.types` objects (their JSON), in a fresh local[2] session that has read MNIST-1D
and counted it, as a session has before its first fit. `--samples` fresh processes of each
kind, alternating; the medians of the first use and of ten more casts.

    python bench/type_strings.py [--samples 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import in_fresh_process, local_session, median, report  # noqa: E402


def one_session(objects: bool) -> dict:
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    from sparkdl_avg import SPARK_CONF
    from sparkdl_avg.examples import mnist1d
    from sparkdl_avg.task import probe
    from sparkdl_avg.task.report import struct_type

    spark = local_session(2, **SPARK_CONF)
    try:
        train_df, _ = mnist1d.load(spark, 20_000)
        train_df.count()
        schema = struct_type(probe.FIELDS) if objects else \
            ", ".join(f"{name} {kind}" for name, kind in probe.FIELDS)
        t0 = time.perf_counter()
        spark.range(2).mapInArrow(lambda batches: batches, schema)
        F.lit(1).cast(T.ByteType() if objects else "byte")
        first = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(10):
            F.col("id").cast(T.LongType() if objects else "long")
        return {"first_s": first, "ten_casts_s": time.perf_counter() - t0}
    finally:
        spark.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=3)
    parser.add_argument("--kind", choices=["strings", "objects"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.kind:
        print(json.dumps(one_session(args.kind == "objects")))
        return
    runs: dict[str, list] = {"strings": [], "objects": []}
    for _ in range(args.samples):
        for kind in runs:
            runs[kind].append(in_fresh_process(__file__, "--kind", kind))
    report("type_strings", {
        kind: {"first_median_s": median([r["first_s"] for r in samples]),
               "ten_casts_median_s": median([r["ten_casts_s"] for r in samples]),
               "samples": samples}
        for kind, samples in runs.items()})


if __name__ == "__main__":
    main()
