"""Run by test_gpu_assignment in its own process, as the driver of an application on the test
session's standalone cluster (two workers, one fake GPU each). Two fits: one that reports
which GPU each task got, and the same fit whose model kills its executor's JVM once
mid-training (a lost executor; the worker starts a new one). Writes the task reports, the
recovered failures and whether both fits ended with the same parameters as JSON."""

import json
import os
import signal
import sys
import tempfile
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from pyspark.sql import SparkSession

from sparkdl_avg import TrainConfig, fit

CONFIG = TrainConfig(num_workers=2, batch_size=8, epochs=3, averaging_frequency=2,
                     checkpoint_every=2, log_model=False, experiment_name="local-cluster")


class KillsItsExecutor(torch.nn.Linear):
    """Linear(4, 2) whose 7th training forward on partition 1 SIGKILLs the executor JVM
    running it, once (a marker file remembers)."""

    def __init__(self, marker: str = "") -> None:
        super().__init__(4, 2)
        self.marker, self.calls = marker, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        if self.marker and ctx is not None and self.training:
            self.calls += 1
            if self.calls == 7 and ctx.partitionId() == 1 and not os.path.exists(self.marker):
                Path(self.marker).touch()
                os.kill(_executor_pid(), signal.SIGKILL)
        return super().forward(x)


def _executor_pid() -> int:
    """Walk up from this Python worker to the executor's JVM."""
    pid = os.getpid()
    while pid > 1:
        if b"CoarseGrainedExecutorBackend" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    raise RuntimeError("no executor JVM above this process")


def main(out_path: str, master: str) -> None:
    folder = tempfile.mkdtemp()
    spark = (
        SparkSession.builder.master(master)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.executor.cores", "1")
        .config("spark.executor.memory", "1g")
        .config("spark.executor.resource.gpu.amount", "1")
        .config("spark.task.resource.gpu.amount", "1")
        .getOrCreate()
    )
    try:
        rng = np.random.default_rng(0)
        df = spark.createDataFrame(pd.DataFrame({"features": list(rng.normal(size=(64, 4))),
                                                 "label": rng.integers(0, 2, 64)})).cache()
        plain = fit(df, KillsItsExecutor, CONFIG)
        marker = os.path.join(folder, "killed")
        recovered = fit(df, partial(KillsItsExecutor, marker), CONFIG)
        before, after = plain.model.state_dict(), recovered.model.state_dict()
        same = all(torch.equal(before[k], after[k]) for k in before)
        with open(out_path, "w") as f:
            json.dump({"workers": plain.workers, "failures": recovered.failures,
                       "killed": os.path.exists(marker), "same_parameters": same}, f)
    finally:
        spark.stop()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
