"""Run by test_gpu_assignment in its own process: a local-cluster whose executor owns two fake
GPUs (a discovery script), and a 2-worker fit. Prints the task reports as JSON."""

import json
import os
import sys
import tempfile

import numpy as np
import pandas as pd
import torch
from pyspark.sql import SparkSession

from sparkdl_avg import TrainConfig, fit


def model() -> torch.nn.Module:
    return torch.nn.Linear(4, 2)


def main(out_path: str) -> None:
    folder = tempfile.mkdtemp()
    script = os.path.join(folder, "gpus.sh")
    with open(script, "w") as f:
        f.write('#!/bin/sh\necho \'{"name": "gpu", "addresses": ["0", "1"]}\'\n')
    os.chmod(script, 0o755)
    spark = (
        SparkSession.builder.master("local-cluster[1,2,1024]")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.worker.resource.gpu.amount", "2")
        .config("spark.worker.resource.gpu.discoveryScript", script)
        .config("spark.executor.resource.gpu.amount", "2")
        .config("spark.task.resource.gpu.amount", "1")
        .getOrCreate()
    )
    try:
        rng = np.random.default_rng(0)
        df = spark.createDataFrame(pd.DataFrame({"features": list(rng.normal(size=(64, 4))),
                                                 "label": rng.integers(0, 2, 64)}))
        result = fit(df, model, TrainConfig(num_workers=2, batch_size=8, log_model=False))
        with open(out_path, "w") as f:
            json.dump(result.workers, f)
    finally:
        spark.stop()


if __name__ == "__main__":
    main(sys.argv[1])
