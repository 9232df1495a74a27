"""The validation job's scan: its check for null, NaN and infinite features as Spark's
compiled `array_contains` (what `data/validate.bad_values` uses) against a lambda through
`exists` (what it used before), which Spark interprets element by element.

`prepare` (the validation job, and building the partitioned frame) on a Parquet file of
`--rows` rows of 40 float features and an int label, in a fresh local[2] session with
`SPARK_CONF` per process, processes alternating between the two kinds; in each, one cold call
and `--repeats` warm ones. Medians.

    python bench/validation_scan.py [--rows 2000000] [--sessions 2] [--repeats 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import in_fresh_process, local_session, median, report  # noqa: E402


def lambda_check(source, element):
    """The check as it was: a lambda through `exists`."""
    from pyspark.sql import functions as F

    return F.col(source.wire).isNull() | F.exists(
        F.col(source.wire), lambda x: x.isNull() | F.isnan(x) | (F.abs(x) == float("inf")))


def one_session(kind: str, path: str, repeats: int) -> list[float]:
    from sparkdl_avg import SPARK_CONF
    from sparkdl_avg.data import prepare, validate

    if kind == "lambda":
        validate.bad_values = lambda_check
    spark = local_session(2, **SPARK_CONF)
    try:
        df = spark.read.parquet(path)
        df.count()
        times = []
        for _ in range(1 + repeats):
            started = time.perf_counter()
            prepare.prepare(df, None, features_col="features", label_col="label",
                            num_workers=2, double_precision=False)
            times.append(time.perf_counter() - started)
        return times
    finally:
        spark.stop()


def write_data(rows: int, folder: str) -> str:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    features = rng.random((rows, 40), dtype=np.float32)
    column = pa.FixedSizeListArray.from_arrays(pa.array(features.ravel()), 40)
    path = os.path.join(folder, "data.parquet")
    pq.write_table(pa.table({"features": column.cast(pa.list_(pa.float32())),
                             "label": pa.array(rng.integers(0, 10, rows))}),
                   path, row_group_size=200_000)
    return path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--sessions", type=int, default=2, help="processes of each kind")
    parser.add_argument("--repeats", type=int, default=4, help="warm calls a process")
    parser.add_argument("--kind", choices=["array_contains", "lambda"], help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.kind:
        print(json.dumps(one_session(args.kind, args.path, args.repeats)))
        return
    with tempfile.TemporaryDirectory() as folder:
        path = write_data(args.rows, folder)
        runs: dict[str, list] = {"array_contains": [], "lambda": []}
        for _ in range(args.sessions):
            for kind in runs:
                runs[kind].append(in_fresh_process(__file__, "--kind", kind, "--path", path,
                                                   "--repeats", str(args.repeats)))
    summary = {kind: {"cold_median_s": median([s[0] for s in sessions]),
                      "warm_median_s": median([t for s in sessions for t in s[1:]])}
               for kind, sessions in runs.items()}
    report("validation_scan", {"rows": args.rows, "summary": summary,
                               "warm_ratio": summary["array_contains"]["warm_median_s"]
                               / summary["lambda"]["warm_median_s"], "runs": runs})


if __name__ == "__main__":
    main()
