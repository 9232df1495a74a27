"""A float32 MNIST-1D fit with each sync transport: MNIST-1D 20k, MLP 40-1024-1024-10, 2
workers, Adam, 5 epochs, averaging every 8 steps, `--seeds` seeds, local[2]. Test accuracy
of each, and the largest difference between the two transports' final parameters.

    python bench/transport_accuracy.py [--seeds 0 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from _common import local_session, report  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    args = parser.parse_args()
    os.environ.setdefault("MLFLOW_TRACKING_URI", f"sqlite:///{tempfile.mkdtemp()}/mlflow.db")
    from sparkdl_avg import TrainConfig, fit
    from sparkdl_avg.examples import mnist1d

    spark = local_session(2)
    try:
        train_df, test_df = mnist1d.load(spark, 20_000)
        out = []
        for seed in args.seeds:
            models, row = {}, {"seed": seed}
            for transport in ("driver", "collective"):
                cfg = TrainConfig(num_workers=2, epochs=5, batch_size=50, optimizer="adam",
                                  lr=1e-3, seed=seed, log_model=False, transport=transport,
                                  experiment_name="bench-transport-accuracy")
                result = fit(train_df, mnist1d.mlp(), cfg, eval_df=test_df)
                models[transport] = result.model
                row[f"{transport}_accuracy"] = result.history[-1]["eval_accuracy"]
                row[f"{transport}_train_s"] = result.timings["train_s"]
            row["max_param_diff"] = max(
                (a - b).abs().max().item() for a, b in zip(
                    models["driver"].parameters(), models["collective"].parameters(),
                    strict=True))
            print(row, flush=True)
            out.append(row)
        report("transport_accuracy", {"fits": out})
    finally:
        spark.stop()


if __name__ == "__main__":
    main()
