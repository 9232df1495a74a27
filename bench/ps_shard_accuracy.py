"""Accuracy of unbounded async fits on one parameter server and on 2 shards: MNIST-1D 5k
(4,000 train / 1,000 test rows), MLP 40-256-10, 2 workers, Adam lr 1e-2, 6 epochs, a push
every 4 steps; fits alternate between the two, and the medians are compared (one unbounded
fit varies by 1-2 points from run to run, on one server too).

    python bench/ps_shard_accuracy.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _common import local_session, median, report  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    spark = local_session(2)
    logging.getLogger("sparkdl_avg").setLevel(logging.WARNING)
    from sparkdl_avg import TrainConfig, fit
    from sparkdl_avg.examples.mnist1d import generate, mlp

    train, test = (df.cache() for df in generate(spark, num_samples=5_000))
    accuracy: dict[int, list[float]] = {1: [], 2: []}
    for _ in range(args.repeats):
        for shards in accuracy:
            result = fit(train, mlp((256,)), TrainConfig(
                mode="async", ps_shards=shards, num_workers=2, epochs=6, batch_size=50,
                push_every=4, optimizer="adam", lr=1e-2, seed=0, eval_interval_s=5.0,
                log_model=False, experiment_name="bench-ps-shard-accuracy"), eval_df=test)
            accuracy[shards].append(result.history[-1]["eval_accuracy"])
            print(shards, "shard(s):", accuracy[shards][-1], flush=True)
    report("ps_shard_accuracy", {"eval_accuracy": accuracy,
                                 "median": {k: median(v) for k, v in accuracy.items()}})


if __name__ == "__main__":
    main()
