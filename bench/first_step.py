"""Seconds from `fit()` called (Spark session already up) to the first training step, on the
MNIST-1D job's data and model. The first fit of a session also starts the executors' Python
workers and imports torch there; later fits reuse them. Both are reported.

    python bench/first_step.py [--fits 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from _common import local_session, median, report  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fits", type=int, default=5)
    args = parser.parse_args()
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{tempfile.mkdtemp()}/mlflow.db")
    from sparkdl_avg import TrainConfig, fit
    from sparkdl_avg.examples import mnist1d

    spark = local_session(2)
    try:
        train_df, test_df = mnist1d.load(spark, 20_000)
        train_df.count()  # the session is up and has run a job
        cfg = TrainConfig(num_workers=2, epochs=1, batch_size=50, optimizer="adam", lr=1e-3,
                          log_model=False)
        firsts = [fit(train_df, mnist1d.mlp(), cfg, eval_df=test_df).timings
                  for _ in range(args.fits)]
    finally:
        spark.stop()
    warm = [t["first_step_s"] for t in firsts[1:]]
    report("first_step", {
        "cold_first_fit_s": firsts[0]["first_step_s"],
        "warm_median_s": median(warm),
        "warm_s": warm,
        "validate_median_s": median([t["validate_s"] for t in firsts[1:]]),
    })


if __name__ == "__main__":
    main()
