"""Goodput under routine losses: an elastic sync fit (`min_workers`) against today's restart
from checkpoints, on the same chaos schedule, with the same fit without losses as the rate
both are measured against.

Four workers on local[4,4] (Spark retries a failed task up to 4 times a partition), a
20-40-40-3 MLP on Gaussian blobs. Each training step also sleeps `--step-ms`: it stands for
a larger model's compute, so the steps' time, not this 2-core machine's contention, sets
the pace (the sleep releases the cores). The chaos thread SIGKILLs a random training task's
Python worker (a preempted process) every `--kill-every` seconds of training, starting one
interval in.

- goodput: the worker-steps that reach the final model over the worker-steps the fit
  without losses makes in the same wall time (its rate, times this fit's training time). For
  the elastic fit the useful steps are each round's averaged workers times its steps (an
  absent worker's steps are lost); for the restart, every worker's steps of the fit (the
  rounds recomputed after a restart are the waste, as are the relaunches).
- the time a lost worker is away (elastic): from the kill to the round it trains in again,
  split into the retry's cold start (the kill to the retried task's model being built: Spark's
  relaunch, the Python worker, the partition's load) and the wait for the round boundary.
- final accuracy of each fit, against the fit without losses.

    python bench/elastic.py [--minutes 3] [--kill-every 60] [--step-ms 100]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from _common import local_session, median, report  # noqa: E402

WORKERS, BATCH, K, FEATURES, CLASSES = 4, 32, 8, 20, 3


class SlowMLP:
    """Builds the MLP; its training forward sleeps `step_s`; each build (a task's start)
    leaves `folder`/<partition>-<pid>-<time> so the chaos thread can find live tasks."""

    def __init__(self, folder: str, step_s: float) -> None:
        self.folder, self.step_s = folder, step_s

    def __call__(self):
        import torch
        from pyspark import TaskContext

        step_s = self.step_s

        class Net(torch.nn.Module):
            def __init__(self) -> None:
                super().__init__()
                torch.manual_seed(0)
                self.net = torch.nn.Sequential(
                    torch.nn.Linear(FEATURES, 40), torch.nn.ReLU(), torch.nn.Linear(40, 40),
                    torch.nn.ReLU(), torch.nn.Linear(40, CLASSES))

            def forward(self, x):
                if self.training and TaskContext.get() is not None:
                    time.sleep(step_s)
                return self.net(x)

        ctx = TaskContext.get()
        if ctx is not None:
            Path(self.folder, f"{ctx.partitionId()}-{os.getpid()}-{time.time():.3f}").touch()
        return Net()


def make_data(spark, rows_per_worker: int):
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(0)
    centers = rng.normal(scale=0.45, size=(CLASSES, FEATURES))
    n = rows_per_worker * WORKERS + 2000
    y = rng.integers(0, CLASSES, n)
    x = (centers[y] + rng.normal(size=(n, FEATURES))).astype(np.float32)
    frame = pd.DataFrame({"features": list(x), "label": y})
    return (spark.createDataFrame(frame.iloc[:-2000]).cache(),
            spark.createDataFrame(frame.iloc[-2000:]).cache())


def chaos(folder: str, every_s: float, stop: threading.Event, kills: list) -> None:
    """Every `every_s`, SIGKILL one live training task's Python worker at random."""
    rng = random.Random(1)
    while not stop.wait(every_s):
        live = []
        for name in os.listdir(folder):
            partition, pid, _ = name.split("-")
            try:
                os.kill(int(pid), 0)
                live.append((int(partition), int(pid)))
            except ProcessLookupError:
                continue
        if live:
            partition, pid = rng.choice(sorted(set(live)))
            os.kill(pid, signal.SIGKILL)
            kills.append({"t": time.time(), "partition": partition})


def one_fit(spark, train, test, config, step_s: float, kill_every: float | None) -> dict:
    import tempfile

    from sparkdl_avg import fit
    from sparkdl_avg.task.schedule import make_schedule

    folder = tempfile.mkdtemp()
    stop, kills = threading.Event(), []
    killer = None
    started = time.time()
    if kill_every:
        killer = threading.Thread(target=chaos, args=(folder, kill_every, stop, kills),
                                  daemon=True)
        killer.start()
    try:
        result = fit(train, SlowMLP(folder, step_s), config, eval_df=test)
    finally:
        stop.set()
    rows = result.workers[0]["train_rows"]
    schedule = make_schedule(rows, BATCH, config.epochs, K)
    steps = [schedule.steps_in_round(r) for r in range(schedule.num_rounds)]
    rounds = [h for h in result.history if h["round"] > 0]
    useful = sum(h["workers"] * steps[h["round"] - 1] for h in rounds)
    builds = sorted((float(name.split("-")[2]) - started, int(name.split("-")[0]))
                    for name in os.listdir(folder))
    # each elastic return against its kill: the retry's cold start (the kill to the retried
    # task's model built: relaunch, Python worker, partition load) and its time away
    returns, used = [], set()
    for failure in result.failures:
        kill = next((k for k in kills if k["partition"] == failure["partition"]
                     and id(k) not in used), None)
        if failure.get("round_back") is None or kill is None:
            continue
        used.add(id(kill))
        t_kill = kill["t"] - started
        built = next((t for t, p in builds if p == failure["partition"] and t > t_kill), None)
        returns.append({"partition": failure["partition"],
                        "cold_start_s": None if built is None else built - t_kill,
                        "seconds_away": failure["seconds_away"]})
    return {"train_s": result.timings["train_s"], "accuracy": rounds[-1]["eval_accuracy"],
            "useful_worker_steps": useful, "all_worker_steps": WORKERS * sum(steps),
            "kills": len(kills), "restarts": sum(1 for f in result.failures
                                                 if f.get("restart_at") is not None),
            "failures": result.failures, "kill_times": [k["t"] - started for k in kills],
            "returns": returns,
            "median_round_s": median([h["time_round_s"] for h in rounds])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0,
                        help="the training time of the fit without losses")
    parser.add_argument("--kill-every", type=float, default=60.0)
    parser.add_argument("--step-ms", type=float, default=100.0)
    args = parser.parse_args()
    os.environ.setdefault("MLFLOW_TRACKING_URI", "sqlite:////tmp/sparkdl-avg-bench-elastic.db")
    import sparkdl_avg
    from sparkdl_avg import TrainConfig

    spark = local_session("4,4", **sparkdl_avg.SPARK_CONF)
    step_s = args.step_ms / 1000
    epochs = 4
    steps = int(args.minutes * 60 / step_s)
    rows_per_worker = steps // epochs * BATCH
    train, test = make_data(spark, rows_per_worker)
    base = dict(num_workers=WORKERS, batch_size=BATCH, epochs=epochs, averaging_frequency=K,
                optimizer="adam", lr=3e-3, log_model=False, experiment_name="bench-elastic",
                round_timeout=120.0, max_failures=100, seed=0)
    fits = {
        "no_losses": one_fit(spark, train, test, TrainConfig(min_workers=1, **base), step_s,
                             None),
        "elastic": one_fit(spark, train, test, TrainConfig(min_workers=1, **base), step_s,
                           args.kill_every),
        "restart": one_fit(spark, train, test, TrainConfig(**base), step_s, args.kill_every),
    }
    clean = fits["no_losses"]
    rate = clean["all_worker_steps"] / clean["train_s"]
    for f in fits.values():
        f["goodput"] = f["useful_worker_steps"] / (rate * f["train_s"])
        f["accuracy_vs_no_losses_points"] = 100 * (f["accuracy"] - clean["accuracy"])
    elastic = fits["elastic"]
    round_s = clean["median_round_s"]
    back_in_time = [r["seconds_away"] <= r["cold_start_s"] + round_s
                    for r in elastic["returns"] if r["cold_start_s"] is not None]
    spark.stop()
    report("elastic", {
        "settings": {**vars(args), "workers": WORKERS, "batch_size": BATCH,
                     "averaging_frequency": K, "epochs": epochs,
                     "rows_per_worker": rows_per_worker, "master": "local[4,4]"},
        "fits": fits,
        "goodput": {name: round(f["goodput"], 4) for name, f in fits.items()},
        "seconds_away_median": median([r["seconds_away"] for r in elastic["returns"]])
        if elastic["returns"] else None,
        "cold_start_median_s": median([r["cold_start_s"] for r in elastic["returns"]
                                       if r["cold_start_s"] is not None])
        if elastic["returns"] else None,
        "targets": {"back_within_cold_start_plus_one_round": all(back_in_time)
                    if back_in_time else None,
                    "goodput_elastic_at_least_0_9": fits["elastic"]["goodput"] >= 0.9,
                    "accuracy_within_1_point": abs(
                        fits["elastic"]["accuracy_vs_no_losses_points"]) <= 1.0},
    })


if __name__ == "__main__":
    main()
