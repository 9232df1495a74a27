"""Real async fits: Downpour vs DC-ASGD vs adaptive DC-ASGD when the workers fetch far less
often than they push, the regime where DC-ASGD's reference point matters (docs/guide/sync-async.md,
"DC-ASGD's reference point").

MNIST-1D (5,000 samples: 4,000 train, 1,000 test), an MLP 40-256-10, 4 workers on local[4],
plain SGD, a push every step and a fetch every 32 steps, for each learning rate and seed all
three rules (in rotating order, so no rule always runs first); the final parameters
evaluated on the test rows. A fit the server refuses (an update with NaN or Inf) is recorded
as refused, not averaged in. Accuracy, not time, is the measurement: run it niced.

    nice -n 5 python bench/async_rules.py [--epochs 20] [--seeds 0,1,2] [--lrs 1.0,2.0]
        [--name async_rules] [--note "what differs from the commit"]
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(__file__))
from _common import local_session, report  # noqa: E402

from sparkdl_avg.ps.rules import ALGORITHMS  # noqa: E402

WORKERS = 4


def one_fit(train, test, algorithm: str, lr: float, seed: int, epochs: int) -> dict:
    from sparkdl_avg import TrainConfig, TrainingError, fit
    from sparkdl_avg.examples import mnist1d

    config = TrainConfig(mode="async", algorithm=algorithm, num_workers=WORKERS,
                         epochs=epochs, batch_size=50, optimizer="sgd", lr=lr, seed=seed,
                         push_every=1, fetch_every=32, eval_interval_s=60.0,
                         max_failures=0, log_model=False, experiment_name="bench-async-rules")
    try:
        result = fit(train, mnist1d.mlp((256,)), config, eval_df=test)
    except TrainingError as exc:
        return {"refused": str(exc)[:300]}
    final = result.history[-1]
    return {"test_accuracy": final["eval_accuracy"], "test_loss": final["eval_loss"],
            "staleness_mean": final["staleness_mean"], "staleness_max": final["staleness_max"],
            "updates_applied": final["updates_applied"],
            "train_s": round(result.timings["train_s"], 1)}


def summary(runs: list[dict]) -> dict:
    """Per learning rate and rule: the mean over the fits that finished, and how many the
    server refused."""
    out = {}
    for key in sorted({(r["lr"], r["algorithm"]) for r in runs}):
        done = [r for r in runs if (r["lr"], r["algorithm"]) == key and "refused" not in r]
        out[f"lr={key[0]:g} {key[1]}"] = {
            "fits": len(done),
            "refused": sum(1 for r in runs if (r["lr"], r["algorithm"]) == key) - len(done),
            "test_accuracy_mean": statistics.mean(r["test_accuracy"] for r in done)
            if done else None,
            "test_accuracies": [r["test_accuracy"] for r in done],
            "staleness_mean": statistics.mean(r["staleness_mean"] for r in done)
            if done else None}
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--lrs", default="1.0,2.0")
    parser.add_argument("--name", default="async_rules", help="bench/results/NAME-<UTC>.json")
    parser.add_argument("--note", help="what the code run differs in from the commit")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from sparkdl_avg import SPARK_CONF
    from sparkdl_avg.examples import mnist1d

    spark = local_session(WORKERS, **SPARK_CONF)
    train, test = mnist1d.load(spark, 5_000)
    train, test = train.cache(), test.cache()
    runs = []
    for lr in (float(v) for v in args.lrs.split(",")):
        for i, seed in enumerate(int(v) for v in args.seeds.split(",")):
            order = ALGORITHMS[i % 3:] + ALGORITHMS[:i % 3]
            for algorithm in order:
                run = {"lr": lr, "seed": seed, "algorithm": algorithm,
                       **one_fit(train, test, algorithm, lr, seed, args.epochs)}
                logging.warning("%s", run)
                runs.append(run)
    spark.stop()
    report(args.name, {"note": args.note, "workers": WORKERS, "samples": 5_000, "hidden": [256],
                           "batch_size": 50, "push_every": 1, "fetch_every": 32,
                           "optimizer": "sgd", "epochs": args.epochs,
                           "summary": summary(runs), "runs": runs})


if __name__ == "__main__":
    main()
