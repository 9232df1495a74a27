"""What scoring pays for checking ids wider than the fit's (issue 39): a model fitted on int
ids scores a DataFrame whose ids are bigint. `describe.carry` used to cast them to int in
Spark, which with `spark.sql.ansi.enabled` off wraps an id beyond int32 silently; it now leaves
them bigint, and the UDF's reader narrows them with a range check (`arrow_columns.check_fits`).
This scores the same cached DataFrame (`--rows` rows: a bigint id and 16 floats, 2
partitions, local[2]) both ways, alternating, `--samples` times each: as it is now, and with
the ids cast to int in Spark first (the old carry, unchecked); and times the check and the
narrowing alone on one Arrow batch's ids (10,000, Spark's default batch) in numpy.

    python bench/wide_ids.py [--rows 400000] [--samples 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import local_session, median, report  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=400_000)
    p.add_argument("--samples", type=int, default=3)
    args = p.parse_args()
    import numpy as np
    import torch
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    from sparkdl_avg import SPARK_CONF
    from sparkdl_avg._fit import FitResult
    from sparkdl_avg.data.arrow_columns import check_fits
    from sparkdl_avg.data.schema import DataSchema, FieldSpec

    class Net(torch.nn.Module):  # an id's embedding beside 16 floats -> 3 logits
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.ids, self.out = torch.nn.Embedding(1000, 8), torch.nn.Linear(24, 3)

        def forward(self, user, dense):
            return self.out(torch.cat([self.ids(user), dense], 1))

    fields = (FieldSpec("input", "user", "user", "_x0", "int32", (), "int"),
              FieldSpec("input", "dense", "dense", "_x1", "float32", (16,), "array<float>"))
    schema = DataSchema(inputs=fields, binding="positional", labels=(), label_list=False)
    result = FitResult(model=Net().eval(), run_id="", schema=schema, heads=("class",))

    spark = local_session(2, **SPARK_CONF)
    df = spark.range(args.rows, numPartitions=2).select(
        (F.col("id") % 1000).alias("user"),  # bigint
        F.transform(F.sequence(F.lit(1), F.lit(16)),
                    lambda i: (F.rand(7) * i).cast(T.FloatType())).alias("dense")).cache()
    df.count()
    narrowed = df.withColumn("user", F.col("user").cast(T.IntegerType()))

    def run(frame) -> float:
        t0 = time.perf_counter()
        result.transform(frame).agg(F.sum("prediction")).first()
        return time.perf_counter() - t0

    run(df), run(narrowed)  # warm: Python workers, torch imported
    seconds = {"bigint_checked_in_the_udf": [], "cast_to_int_in_spark": []}
    for _ in range(args.samples):
        seconds["bigint_checked_in_the_udf"].append(run(df))
        seconds["cast_to_int_in_spark"].append(run(narrowed))
    spark.stop()

    ids = np.random.default_rng(0).integers(0, 1000, 10_000)
    clock = []
    for _ in range(200):
        t0 = time.perf_counter()
        check_fits(ids, fields[0])
        ids.astype(np.int32)
        clock.append(time.perf_counter() - t0)
    checked, cast = (median(v) for v in seconds.values())
    report("wide_ids", {
        "rows": args.rows, "seconds": seconds,
        "rows_per_s": {k: args.rows / median(v) for k, v in seconds.items()},
        "checked_over_cast_time": checked / cast,
        "check_and_narrow_us_per_10000_ids": median(clock) * 1e6})


if __name__ == "__main__":
    main()
