"""What C1 costs a heavy Spark job of the session's own: `sparkdl_avg.local_session`'s JVM
compiles with the JIT's first tier only (`jit="c1"`, its default), which makes a cold fit's
first jobs cheaper; a long CPU-bound query then runs C1's code instead of C2's. Each sample is
a fresh process: `local_session(2, jit=...)`, no class archive (the same on both sides), then
the same query `--runs` times (a 300-million-row range: two derived columns, a group-by into
1,000 keys, a join, a count); the first run is cold, the later ones warm. The kinds alternate,
in an order that rotates from sample to sample.

    python bench/c1_heavy_job.py [--samples 3] [--runs 4] [--rows 300000000]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import in_fresh_process, median, report  # noqa: E402

KINDS = ("c1", "full")


def one_session(jit: str, runs: int, rows: int) -> list[float]:
    """This process: a fresh `local_session(2, jit=jit)`; each run's wall time."""
    from pyspark.sql import functions as F

    from sparkdl_avg import local_session

    spark = local_session(2, jit=jit, class_archive=False)
    try:
        spark.sparkContext.setLogLevel("ERROR")
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            df = (spark.range(rows).withColumn("k", F.col("id") % 1000)
                  .withColumn("v", F.sqrt("id")))
            keys = spark.range(1000).withColumnRenamed("id", "k")
            df.groupBy("k").agg(F.sum("v"), F.max("id")).join(keys, "k").count()
            times.append(time.perf_counter() - t0)
        return times
    finally:
        spark.stop()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=3, help="fresh processes of each kind")
    parser.add_argument("--runs", type=int, default=4, help="the query's runs in each process")
    parser.add_argument("--rows", type=int, default=300_000_000)
    parser.add_argument("--one-session", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one_session:
        print(json.dumps(one_session(args.one_session, args.runs, args.rows)))
        return
    env = {**os.environ, "SPARKDL_AVG_JVM_ARCHIVES": "off"}
    samples: dict[str, list] = {kind: [] for kind in KINDS}
    for i in range(args.samples):
        for kind in KINDS[i % 2:] + KINDS[:i % 2]:
            samples[kind].append(in_fresh_process(
                __file__, "--one-session", kind, "--runs", str(args.runs), "--rows",
                str(args.rows), env=env))
    results: dict = {"rows": args.rows}
    for kind, runs in samples.items():
        results[kind] = {"cold_median_s": round(median([r[0] for r in runs]), 2),
                         "warm_median_s": round(median([t for r in runs for t in r[1:]]), 2),
                         "runs": runs}
    results["warm_ratio_c1_over_full"] = round(
        results["c1"]["warm_median_s"] / results["full"]["warm_median_s"], 2)
    results["cold_ratio_c1_over_full"] = round(
        results["c1"]["cold_median_s"] / results["full"]["cold_median_s"], 2)
    report("c1_heavy_job", results)


if __name__ == "__main__":
    main()
