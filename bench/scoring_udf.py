"""What pyspark 4.0's scoring costs against 4.1+'s: the same model scoring the same cached
DataFrame (`--rows` rows of a 64-float array column, 2 partitions, local[2]) through the
Arrow UDF (`arrow_udf`, 4.1+) and through the pandas UDF fallback `_spark_compat` uses on 4.0,
forced here on the newest line, alternating, `--samples` times each; rows per second from the
medians, and whether the two wrote the same values.

    python bench/scoring_udf.py [--rows 200000] [--samples 3]
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
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--samples", type=int, default=3)
    args = p.parse_args()
    import pyspark
    import torch
    from pyspark.sql import functions as F

    from sparkdl_avg import SPARK_CONF, _spark_compat
    from sparkdl_avg.scoring.columns import vector_schema
    from sparkdl_avg.scoring.udf import make_predict_udf

    spark = local_session(2, **SPARK_CONF)
    df = spark.range(args.rows, numPartitions=2).select(
        "id", F.transform(F.sequence(F.lit(1), F.lit(64)),
                          lambda i: (F.rand(7) * i).cast("float")).alias("features")).cache()
    df.count()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(),
                                torch.nn.Linear(128, 10))
    chosen = _spark_compat.scoring_udf_kind

    def run(kind: str):
        _spark_compat.scoring_udf_kind = lambda: kind
        try:
            udf = make_predict_udf(model, schema=vector_schema("features", 64, "float32"),
                                   heads=("class",), output=("prediction", "probability"))
        finally:
            _spark_compat.scoring_udf_kind = chosen
        out = df.select("id", udf("features").alias("p"))
        t0 = time.perf_counter()
        total = out.select(F.sum("p.prediction"), F.sum(F.aggregate(
            "p.probability", F.lit(0.0), lambda a, x: a + x))).first()
        return time.perf_counter() - t0, tuple(total)

    run("arrow"), run("pandas")  # warm: Python workers, torch imported
    times = {"arrow": [], "pandas": []}
    sums = {}
    for _ in range(args.samples):
        for kind in times:
            seconds, sums[kind] = run(kind)
            times[kind].append(seconds)
    spark.stop()
    rate = {k: args.rows / median(v) for k, v in times.items()}
    report("scoring_udf", {
        "pyspark": pyspark.__version__, "rows": args.rows, "features": 64,
        "seconds": times, "rows_per_s": rate,
        "pandas_over_arrow_time": median(times["pandas"]) / median(times["arrow"]),
        "same_sums": sums["arrow"] == sums["pandas"]})


if __name__ == "__main__":
    main()
