"""Run by test_elastic in its own process, as the driver of a `local[4,4]` application (four
slots, and Spark retries a failed task up to 4 times: what an elastic fit relies on). The
fits are named on the command line; each writes what it did as one JSON object a line, to the
output file: its parameters' digest of equality (the flat parameters themselves), history,
failures and, for a fit that fails, its error.

A fault is a Python worker's `os._exit(1)` (the task's process dies, as when the OOM killer
or a preemption takes it), once a fit: the first task to reach it leaves a marker file."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import torch
from pyspark.sql import SparkSession

import sparkdl_avg
from sparkdl_avg import TrainConfig, fit

N_FEATURES, N_CLASSES, ROWS = 6, 3, 1600
FAULT_PARTITION = 2
RETRY_WAIT_S = 40.0
"""Below round_timeout (60 s): a worker waiting for the retry is not taken for hung."""


class ExitsOnce(torch.nn.Module):
    """An MLP whose partition-`FAULT_PARTITION` task ends its own process (`os._exit`) once,
    at its `at_call`-th training forward (`phase="train"`) or evaluation forward ("eval"),
    while `marker` does not exist. Every training forward adds a byte to
    `folder`/steps-<partition>, across attempts. The retried task leaves `folder`/retried as
    it builds its model; until then (at most `RETRY_WAIT_S`), the other tasks' next training
    step waits for it, so that the retry joins before the fit ends however slowly this
    machine starts it (unless `stays_away`: it never comes)."""

    def __init__(self, folder: str = "", at_call: int = 0, phase: str = "train",
                 delay_s: float = 0.0, stays_away: bool = False) -> None:
        super().__init__()
        from pyspark import TaskContext

        ctx = TaskContext.get()
        if ctx is not None and ctx.partitionId() == FAULT_PARTITION \
                and ctx.attemptNumber() > 0:
            if stays_away:
                time.sleep(3600)  # its retry never comes back (until the job is cancelled)
            Path(folder, "retried").touch()
        self.stays_away, self.waited = stays_away, False
        torch.manual_seed(5)
        self.net = torch.nn.Sequential(torch.nn.Linear(N_FEATURES, 32), torch.nn.ReLU(),
                                       torch.nn.Linear(32, N_CLASSES))
        self.folder, self.at_call, self.phase = folder, at_call, phase
        self.delay_s = delay_s
        self.calls = {"train": 0, "eval": 0}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        if ctx is not None and self.folder:
            phase = "train" if self.training else "eval"
            self.calls[phase] += 1
            partition = ctx.partitionId()
            if phase == "train":
                time.sleep(self.delay_s)
                with open(os.path.join(self.folder, f"steps-{partition}"), "ab") as f:
                    f.write(b".")
            marker = Path(self.folder, "fired")
            if phase == "train" and marker.exists() and not self.waited \
                    and not self.stays_away and partition != FAULT_PARTITION:
                self.waited = True
                deadline = time.monotonic() + RETRY_WAIT_S
                while not Path(self.folder, "retried").exists() \
                        and time.monotonic() < deadline:
                    time.sleep(0.05)
            if self.at_call and phase == self.phase and partition == FAULT_PARTITION \
                    and self.calls[phase] == self.at_call and not marker.exists():
                marker.touch()
                os._exit(1)
        return self.net(x)


class ExitsAtCheckpoint(torch.optim.SGD):
    """SGD whose partition-`FAULT_PARTITION` copy ends its process the first time a
    checkpoint asks for its state (once a fit: `marker`)."""

    marker = ""

    def state_dict(self):
        from pyspark import TaskContext

        ctx = TaskContext.get()
        if ctx is not None and ctx.partitionId() == FAULT_PARTITION and self.marker \
                and not os.path.exists(self.marker):
            Path(self.marker).touch()
            os._exit(1)
        return super().state_dict()


def make_data(spark, seed: int = 0):
    rng = np.random.default_rng(seed)
    centers = rng.normal(scale=0.7, size=(N_CLASSES, N_FEATURES))
    y = rng.integers(0, N_CLASSES, ROWS)
    x = centers[y] + rng.normal(size=(ROWS, N_FEATURES))
    frame = pd.DataFrame({"features": [r.tolist() for r in x.astype(np.float32)], "label": y})
    train = spark.createDataFrame(frame.iloc[:1200])
    test = spark.createDataFrame(frame.iloc[1200:])
    return train, test


def config(**changes) -> TrainConfig:
    base = dict(num_workers=4, batch_size=10, epochs=2, averaging_frequency=3, lr=0.05,
                momentum=0.9, checkpoint_every=4, log_model=False, experiment_name="elastic",
                round_timeout=60.0, connect_timeout=120.0, seed=3)
    base.update(changes)
    return TrainConfig(**base)


def run(name: str, spark, train, test, folder: str) -> dict:
    """One named fit; what it did."""
    from functools import partial

    # 300 rows a worker, 30 steps an epoch, 60 steps, 20 rounds of 3; with a fault, 0.05 s a
    # step, so that the retry, once built, connects before the end
    slow = partial(ExitsOnce, folder, delay_s=0.05)
    model, cfg = slow, config(min_workers=2)
    if name == "barrier":
        model, cfg = partial(ExitsOnce, folder), config()
    elif name == "elastic":
        model = partial(ExitsOnce, folder)
    elif name == "elastic_train_fault":  # step 19 of 60: round 7
        model = partial(slow, at_call=19)
    elif name == "elastic_eval_fault":  # the first evaluation (after epoch 1, round 10)
        model = partial(slow, at_call=1, phase="eval")
    elif name == "elastic_checkpoint_fault":  # the first checkpoint (after round 4)
        ExitsAtCheckpoint.marker = os.path.join(folder, "fired")
        cfg = config(min_workers=2,
                     optimizer=partial(ExitsAtCheckpoint, lr=0.05, momentum=0.9))
    elif name == "elastic_last_round_fault":  # step 59 of 60: the last round
        model = partial(slow, at_call=59)
    elif name == "fewer_slots":  # 5 workers on 4 slots: the fifth task waits for a slot
        model, cfg = partial(ExitsOnce, folder), config(num_workers=5, min_workers=4)
    elif name in ("async", "async_train_fault"):  # a push every 3 steps; step 19: push 7
        model = partial(slow, at_call=19) if name == "async_train_fault" else slow
        cfg = TrainConfig(mode="async", num_workers=4, batch_size=10, epochs=2, push_every=3,
                          lr=0.05, momentum=0.9, log_model=False, experiment_name="elastic",
                          round_timeout=60.0, connect_timeout=120.0, seed=3)
    elif name == "below_min_workers":  # its retry never connects: 3 of min_workers=4
        model = partial(slow, at_call=19, stays_away=True)
        cfg = config(min_workers=4, round_timeout=8.0)
    else:
        raise ValueError(name)
    started = time.monotonic()
    out = {"name": name}
    try:
        result = fit(train, model, cfg, eval_df=test)
    except Exception as exc:  # noqa: BLE001 - the test reads it
        out.update(error=f"{type(exc).__name__}: {exc}", seconds=time.monotonic() - started)
        return out
    params = torch.cat([p.detach().flatten() for p in result.model.parameters()])
    out["workers"] = [{k: w[k] for k in ("partition", "train_rows", "warning")}
                      for w in result.workers]
    steps = {p: Path(folder, f"steps-{p}").stat().st_size
             for p in range(4) if Path(folder, f"steps-{p}").exists()}
    out.update(params=params.tolist(), history=result.history, failures=result.failures,
               steps=steps, seconds=time.monotonic() - started, run_id=result.run_id,
               fired=Path(folder, "fired").exists(),
               metrics=sorted(mlflow.get_run(result.run_id).data.metrics))
    return out


def main(out_path: str, names: list[str]) -> None:
    spark = (SparkSession.builder.master("local[4,4]").appName("sparkdl-avg-elastic")
             .config("spark.ui.enabled", "false")
             .config("spark.sql.shuffle.partitions", "4")
             .config("spark.driver.host", "127.0.0.1")
             .config(map=sparkdl_avg.SPARK_CONF).getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    train, test = make_data(spark)
    with open(out_path, "w") as out:
        for name in names:
            with tempfile.TemporaryDirectory() as folder:
                out.write(json.dumps(run(name, spark, train, test, folder), default=str)
                          + "\n")
                out.flush()
    spark.stop()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
