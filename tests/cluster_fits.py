"""Run by test_gpu_assignment in its own process, as the driver of an application on the test
session's standalone cluster (two workers, one fake GPU each). Two fits: one that reports
which GPU each task got, and the same fit whose model kills its executor's JVM once
mid-training (a lost executor; the worker starts a new one). Then the fit with the executors'
CUDA faked to disagree with the discovery scripts. Writes the task reports, the
recovered failures, the rounds the second fit logged, how many training steps partition
`FAULT_PARTITION` ran in all (recomputed ones included), the schedule the fault fired in and
whether both fits ended with the same parameters; then the same kill in an elastic fit
(`min_workers=1`: its failures and each round's `workers`); what the fake-GPU fits did and
the executors alive before and after them, as JSON."""

import dataclasses
import json
import math
import os
import signal
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from mlflow.tracking import MlflowClient
from pyspark.sql import SparkSession

from sparkdl_avg import TrainConfig, fit
from sparkdl_avg.driver import session  # the live executors, after the app id

ROWS = 64
CONFIG = TrainConfig(num_workers=2, batch_size=8, epochs=3, averaging_frequency=2,
                     checkpoint_every=2, log_model=False, experiment_name="local-cluster")
# 32 rows per worker, 4 steps per epoch, 12 steps, 6 rounds; checkpoints after rounds 1, 3, 5
FAULT_PARTITION, AT_CALL = 1, 7  # step 6 of 0..11: round 3, after the checkpoint "round 2"
ELASTIC = dataclasses.replace(CONFIG, min_workers=1, epochs=8)
"""The elastic fit: 32 steps, 16 rounds, 0.2 s a step; after the kill, partition 0's next step
waits (up to 120 s) for the retried task to be built on the new executor, which then joins a
later round however slowly this machine starts an executor."""


class KillsItsExecutor(torch.nn.Linear):
    """Linear(4, 2) whose `AT_CALL`-th training forward on `FAULT_PARTITION` SIGKILLs the
    executor JVM running it, and then its own Python worker, once (a marker file in `folder`
    remembers). Each training forward on a partition adds a byte to `folder`/steps-<partition>:
    the steps that partition ran in all attempts."""

    def __init__(self, folder: str = "", delay_s: float = 0.0) -> None:
        super().__init__(4, 2)
        self.folder, self.calls, self.delay_s = folder, 0, delay_s
        from pyspark import TaskContext

        ctx = TaskContext.get()
        self.waits = bool(delay_s)  # the elastic fit's: partition 0 waits for the retry
        if self.waits and ctx is not None and ctx.partitionId() == FAULT_PARTITION \
                and os.path.exists(os.path.join(folder, "killed")):
            Path(folder, "retried").touch()  # a stage Spark reruns numbers attempts from 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        if self.folder and ctx is not None and self.training:
            time.sleep(self.delay_s)
            if self.waits and ctx.partitionId() != FAULT_PARTITION \
                    and os.path.exists(os.path.join(self.folder, "killed")):
                self.waits, deadline = False, time.monotonic() + 120
                while not os.path.exists(os.path.join(self.folder, "retried")) \
                        and time.monotonic() < deadline:
                    time.sleep(0.1)
            self.calls += 1
            partition = ctx.partitionId()
            with open(os.path.join(self.folder, f"steps-{partition}"), "ab") as f:
                f.write(b".")
            marker = os.path.join(self.folder, "killed")
            if self.calls == AT_CALL and partition == FAULT_PARTITION \
                    and not os.path.exists(marker):
                Path(marker).touch()
                os.kill(_executor_pid(), signal.SIGKILL)
                # A lost machine takes its Python workers with it. Left alive, this one would
                # train on for a moment (the daemon SIGHUPs it once it sees its JVM gone) and
                # could finish the fault's round, or all of them, before Spark reports the
                # executor lost: then no round would be recomputed.
                os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(x)


def _executor_pid() -> int:
    """Walk up from this Python worker to the executor's JVM."""
    pid = os.getpid()
    while pid > 1:
        if b"CoarseGrainedExecutorBackend" in Path(f"/proc/{pid}/cmdline").read_bytes():
            return pid
        pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    raise RuntimeError("no executor JVM above this process")


def fake_gpu_fits(df, fake_cuda: Path) -> dict:
    """The same fit with the executors' CUDA faked (`fake_cuda/sitecustomize.py`) to show
    GPUs that disagree with the discovery scripts' addresses "0" and "1": what each fit raised,
    and each device a task went on to set ("<pid> cuda:N")."""
    found = {}
    for name, visible in [("hidden", "1,2"), ("reordered", "1,0")]:
        fake_cuda.write_text(json.dumps({"visible": visible}))
        try:
            fit(df, KillsItsExecutor, CONFIG)
            error = None
        except Exception as exc:  # noqa: BLE001 - the test reads what it was
            error = f"{type(exc).__name__}: {exc}"
        finally:
            fake_cuda.unlink()
        chosen = Path(f"{fake_cuda}.set")
        found[name] = {"error": error, "set_device": chosen.read_text().split("\n")[:-1]
                       if chosen.exists() else []}
        chosen.unlink(missing_ok=True)
    return found


def main(out_path: str, master: str) -> None:
    folder = tempfile.mkdtemp()
    fake_cuda = Path(folder, "fake-cuda.json")  # absent: the executors' torch is untouched
    spark = (
        SparkSession.builder.master(master)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.executor.cores", "1")
        .config("spark.executor.memory", "1g")
        .config("spark.executor.resource.gpu.amount", "1")
        # no spark.task.resource.gpu.amount: the fit gives the training stage its GPUs
        # through a stage-level resource profile
        .config("spark.executorEnv.PYTHONPATH", os.pathsep.join(
            [str(Path(__file__).with_name("fake_cuda")), os.environ.get("PYTHONPATH", "")]))
        .config("spark.executorEnv.SPARKDL_AVG_FAKE_CUDA", str(fake_cuda))
        .getOrCreate()
    )
    try:
        rng = np.random.default_rng(0)
        df = spark.createDataFrame(pd.DataFrame({
            "features": list(rng.normal(size=(ROWS, 4))),
            "label": rng.integers(0, 2, ROWS)})).cache()
        plain = fit(df, KillsItsExecutor, CONFIG)
        recovered = fit(df, partial(KillsItsExecutor, folder), CONFIG)
        tags = MlflowClient().get_run(plain.run_id).data.tags
        fallbacks = {k: v for k, v in tags.items() if k.startswith("sparkdl_avg.cpu_fallback.")}
        before, after = plain.model.state_dict(), recovered.model.state_dict()
        same = all(torch.equal(before[k], after[k]) for k in before)
        steps = Path(folder, f"steps-{FAULT_PARTITION}")
        schedule = {"steps_per_epoch": math.ceil(ROWS / CONFIG.num_workers / CONFIG.batch_size),
                    "epochs": CONFIG.epochs, "averaging_frequency": CONFIG.averaging_frequency,
                    "checkpoint_every": CONFIG.checkpoint_every,
                    "fault_partition": FAULT_PARTITION, "at_call": AT_CALL}
        executors = {"before_fake_gpus": list(session.executors(spark)[1:])}
        fake = fake_gpu_fits(df, fake_cuda)
        time.sleep(2)  # an executor that dies as its task is killed is reported in ms
        executors["after_fake_gpus"] = list(session.executors(spark)[1:])
        elastic_folder = tempfile.mkdtemp()  # last: it takes an executor down
        elastic = fit(df, partial(KillsItsExecutor, elastic_folder, 0.2), ELASTIC)
        with open(out_path, "w") as f:
            json.dump({"workers": plain.workers, "cpu_fallbacks": fallbacks,
                       "failures": recovered.failures,
                       "killed": os.path.exists(os.path.join(folder, "killed")),
                       "rounds": [h["round"] for h in recovered.history],
                       "fault_partition_steps": steps.stat().st_size if steps.exists() else 0,
                       "schedule": schedule, "same_parameters": same,
                       "fake_gpus": fake,
                       "elastic": {"failures": elastic.failures,
                                   "killed": os.path.exists(os.path.join(elastic_folder,
                                                                         "killed")),
                                   "workers": [h.get("workers") for h in elastic.history]},
                       "executors": executors}, f)
    finally:
        spark.stop()


if __name__ == "__main__":
    if sys.argv[2] == "own":  # a cluster of its own, beside the test session's (`early`)
        from standalone_cluster import StandaloneCluster

        with StandaloneCluster(Path(sys.argv[1]).parent / "cluster", workers=2) as own:
            main(sys.argv[1], own.url)
    else:
        main(sys.argv[1], sys.argv[2])
