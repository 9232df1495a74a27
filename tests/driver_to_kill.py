"""Run by test_faults in its own process group, which the test SIGKILLs mid-fit: a slow sync
fit that checkpoints into its MLflow run (MLFLOW_TRACKING_URI from the environment)."""

import os
import sys
from functools import partial

from faulty import FaultyMLP, dataset
from pyspark.sql import SparkSession

from sparkdl_avg import TrainConfig, fit


def main(config_json: str) -> None:
    import json

    os.environ["PYSPARK_PYTHON"] = sys.executable
    spark = (SparkSession.builder.master("local[2]")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.host", "127.0.0.1").getOrCreate())
    fit(dataset(spark), partial(FaultyMLP, delay_s=0.1), TrainConfig(**json.loads(config_json)))


if __name__ == "__main__":
    main(sys.argv[1])
