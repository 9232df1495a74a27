"""Round time and the driver's bytes per round against the number of workers, for both sync
transports: "driver" (every replica to the driver and the average back) and "collective"
(gloo all-reduce among the tasks). A 4M-parameter float32 model (16 MB), one step of one row
per round (so the round is almost all averaging), no checkpoints or evaluation, on
`local-cluster[W,1,1024]`: W executor JVMs of one core each, all on this machine's 2 cores.
The medians skip each fit's first 3 rounds. Then a model on paper for 64 workers and a
100 MB model, from the per-byte costs measured here, at 10 Gb/s and at NVLink speed.

    python bench/transport_scaling.py [--workers 2 4 8] [--rounds 30]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from _common import median, report  # noqa: E402

FEATURES = 2000
PARAMS = FEATURES * FEATURES + FEATURES  # 4,002,000


def model_fn():
    import torch

    return torch.nn.Linear(FEATURES, FEATURES)


def session(workers: int):
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spark = (SparkSession.builder.master(f"local-cluster[{workers},1,1024]")
             .config("spark.ui.enabled", "false")
             .config("spark.ui.showConsoleProgress", "false")
             .config("spark.driver.host", "127.0.0.1")
             .config("spark.executorEnv.PYTHONPATH", here)
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    deadline = time.monotonic() + 180  # W executor JVMs start one after another
    while len(spark.sparkContext.statusTracker().getExecutorInfos()) < workers + 1:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{workers} executors did not register in 180 s")
        time.sleep(1)
    return spark


def rounds(spark, workers: int, count: int, transport: str) -> dict:
    import numpy as np
    import pandas as pd

    from sparkdl_avg import TrainConfig, fit

    rows = workers * count
    df = spark.createDataFrame(pd.DataFrame({
        "features": list(np.zeros((rows, FEATURES), np.float32)), "label": [0] * rows}))
    cfg = TrainConfig(num_workers=workers, epochs=1, batch_size=1, averaging_frequency=1,
                      lr=1e-3, shuffle=False, log_model=False, checkpoint_every=0,
                      transport=transport, experiment_name="bench-transport")
    result = fit(df, model_fn, cfg)
    steady = result.history[3:-1]  # the last round fetches the final average
    return {"round_s": median([h["time_round_s"] for h in steady]),
            "driver_mb": median([h["driver_mb"] for h in steady]),
            "averaging_s": median([h["time_averaging_s"] for h in steady])}


def on_paper(measured: dict) -> dict:
    """64 workers, a 100 MB model, from this machine's measured per-byte averaging cost (the
    driver's `time_averaging_s` over the bytes it averaged, at the most workers measured) and
    an assumed link speed. Driver transport: the driver's link carries 2 x 64 x 100 MB a
    round (a host's NIC: NVLink does not reach it) and it averages 64 replicas. Collective
    (ring all-reduce): each worker's link carries 2 x 63/64 x 100 MB, and each worker adds
    63/64 x 100 MB, whatever the number of workers."""
    model, workers = 100e6, 64
    largest = max(measured["driver"], key=int)
    per_byte_avg = measured["driver"][largest]["averaging_s"] / (int(largest) * PARAMS * 4)
    nic = 10e9 / 8
    out = {"per_byte_averaging_ns": per_byte_avg * 1e9}
    for link, bytes_per_s in (("10 Gb/s", nic), ("NVLink 450 GB/s", 450e9)):
        share = (workers - 1) / workers * model
        out[link] = {
            "driver_transport_s": 2 * workers * model / nic + per_byte_avg * workers * model,
            "collective_s": 2 * share / bytes_per_s + per_byte_avg * share}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{tempfile.mkdtemp()}/mlflow.db")
    measured: dict[str, dict[str, dict]] = {"driver": {}, "collective": {}}
    for workers in args.workers:
        spark = session(workers)
        try:
            rounds(spark, workers, 5, "driver")  # warms the executors' Python workers
            for transport in ("driver", "collective"):
                measured[transport][str(workers)] = rounds(spark, workers, args.rounds,
                                                           transport)
                print(workers, transport, measured[transport][str(workers)], flush=True)
        finally:
            spark.stop()
    report("transport_scaling", {"params": PARAMS, "measured": measured,
                                 "64_workers_100MB": on_paper(measured)})


if __name__ == "__main__":
    main()
