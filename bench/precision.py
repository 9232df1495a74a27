"""bf16 autocast against float32 on MNIST-1D (the job's setup: 20,000 samples, MLP
40-1024-1024-10, 2 workers, Adam 1e-3, batch 50, 5 epochs, sync averaging every 8 steps),
over 3 seeds each, alternating the two so the machine's drift hits both alike. Reports each
fit's test accuracy and its training seconds (`train_s`: the tasks' training, without Spark's
start or MLflow), their means, and bf16's accuracy gap and time ratio.

    python bench/precision.py [--seeds 3] [--epochs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _common import local_session, report  # noqa: E402


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=5)
    args = p.parse_args(argv)
    from sparkdl_avg import TrainConfig, fit
    from sparkdl_avg.examples import mnist1d

    spark = local_session(2)
    train, test = mnist1d.load(spark, 20_000)
    train, test = train.cache(), test.cache()
    fits: dict[str, list[dict]] = {"float32": [], "bf16": []}
    try:
        for seed in range(args.seeds):
            for name, precision in (("float32", None), ("bf16", "bf16")):
                config = TrainConfig(num_workers=2, epochs=args.epochs, batch_size=50,
                                     optimizer="adam", lr=1e-3, averaging_frequency=8,
                                     eval_every=1000, seed=seed, precision=precision,
                                     log_model=False, experiment_name="bench-precision")
                result = fit(train, mnist1d.mlp(), config, eval_df=test)
                fits[name].append({"seed": seed,
                                   "accuracy": result.history[-1]["eval_accuracy"],
                                   "train_s": result.timings["train_s"]})
                print(name, fits[name][-1], flush=True)
    finally:
        spark.stop()
    mean = {name: {key: statistics.mean(f[key] for f in runs)
                   for key in ("accuracy", "train_s")} for name, runs in fits.items()}
    report("precision", {
        "fits": fits, "mean": mean,
        "bf16_accuracy_minus_float32_points":
            100 * (mean["bf16"]["accuracy"] - mean["float32"]["accuracy"]),
        "bf16_train_time_over_float32": mean["bf16"]["train_s"] / mean["float32"]["train_s"],
    })
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
