"""bf16 autocast against float32 on MNIST-1D (the job's setup: 20,000 samples, MLP
40-1024-1024-10, 2 workers, Adam 1e-3, batch 50, 5 epochs, sync averaging every 8 steps),
over 4 seeds each, alternating the two so the machine's drift hits both alike. The order
alternates too: float32 first for even seeds, bf16 first for odd ones (so an even number of
seeds puts each first equally often), and a one-epoch fit in each precision runs before,
uncounted, so that neither takes the session's cold first fit (Spark starting its Python
workers, torch's first optimizer step). Reports each fit's test accuracy, its training seconds
(`train_s`: the tasks' training, without Spark's start or MLflow) and its position, their
means, and bf16's accuracy gap and time ratio.

    python bench/precision.py [--seeds 4] [--epochs 5]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _common import local_session, report  # noqa: E402


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--epochs", type=int, default=5)
    args = p.parse_args(argv)
    from sparkdl_avg import TrainConfig, fit
    from sparkdl_avg.examples import mnist1d

    spark = local_session(2)
    train, test = mnist1d.load(spark, 20_000)
    train, test = train.cache(), test.cache()
    fits: dict[str, list[dict]] = {"float32": [], "bf16": []}

    def one_fit(seed: int, precision: str | None, epochs: int):
        config = TrainConfig(num_workers=2, epochs=epochs, batch_size=50,
                             optimizer="adam", lr=1e-3, averaging_frequency=8,
                             eval_every=1000, seed=seed, precision=precision,
                             log_model=False, experiment_name="bench-precision")
        return fit(train, mnist1d.mlp(), config, eval_df=test)

    try:
        for precision in (None, "bf16"):  # the warm-up, not counted
            one_fit(0, precision, 1)
        for seed in range(args.seeds):
            kinds = (("float32", None), ("bf16", "bf16"))
            for position, (name, precision) in enumerate(kinds[::1 if seed % 2 == 0 else -1]):
                result = one_fit(seed, precision, args.epochs)
                fits[name].append({"seed": seed, "position": position,
                                   "accuracy": result.history[-1]["eval_accuracy"],
                                   "train_s": result.timings["train_s"]})
                logging.info("%s %s", name, fits[name][-1])
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
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    sys.exit(main(sys.argv[1:]))
