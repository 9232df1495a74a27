"""Models that fail on purpose, from the user's side: the fault tests' ammunition.

A fault fires once: the first task to reach it leaves a marker file, so the restarted task
trains normally. With `steps_dir`, every training forward of a partition adds a byte to
`steps_dir`/steps-<partition>: the steps it ran in all attempts, so that a test sees the steps
a recovery ran twice (`assert_sync_recovery`). Shared by test_faults and the driver process
that test_faults kills."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

N_FEATURES, N_CLASSES = 5, 3


class FaultyMLP(torch.nn.Module):
    """An MLP with dropout whose forward, on one partition at its `at_call`-th training call,
    raises, kills its own process, or hangs: once per `marker` file, or every time without
    one. `delay_s` slows every step down; `steps_dir` counts them (`steps_run`)."""

    def __init__(self, fault: str | None = None, marker: str = "", partition: int = 1,
                 at_call: int = 9, delay_s: float = 0.0, n_features: int = N_FEATURES,
                 steps_dir: str = "") -> None:
        super().__init__()
        torch.manual_seed(7)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(n_features, 24), torch.nn.ReLU(), torch.nn.Dropout(0.2),
            torch.nn.Linear(24, N_CLASSES))
        self.fault, self.marker, self.partition = fault, marker, partition
        self.at_call, self.delay_s, self.calls = at_call, delay_s, 0
        self.steps_dir = steps_dir

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from pyspark import TaskContext

        ctx = TaskContext.get()  # None on the driver
        if ctx is not None and self.training:
            self.calls += 1
            if self.steps_dir:  # before the fault: a step cut short counts
                with open(os.path.join(self.steps_dir, f"steps-{ctx.partitionId()}"), "ab") as f:
                    f.write(b".")
            if self.delay_s:
                time.sleep(self.delay_s)
            if self.fault and self.calls == self.at_call \
                    and ctx.partitionId() == self.partition \
                    and (not self.marker or _first(self.marker)):
                if self.fault == "raise":
                    raise ValueError("injected failure in forward")
                if self.fault == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if self.fault == "hang":
                    time.sleep(3600)
        return self.net(x)


def steps_run(steps_dir, partition: int) -> int:
    """The training steps (forward calls) `partition` ran in all attempts of a fit."""
    path = Path(steps_dir, f"steps-{partition}")
    return path.stat().st_size if path.exists() else 0


def assert_sync_recovery(result, steps_dir, *, at_call: int, steps_per_round: int,
                         total_steps: int, partition: int = 1) -> None:
    """A sync fit recovered from one fault on `partition` at its `at_call`-th step, and not
    vacuously: the fault fired in a round before the last, the fit took up again at a round
    (its last checkpoint) at or before the fault's, and the partition ran the steps from there
    to the fault twice: `at_call` steps (the last cut short), then every step from the
    restart point to the end. Each round is logged once. Steps count forward calls
    (micro-batches under grad_accumulation)."""
    num_rounds = -(-total_steps // steps_per_round)
    [failure] = result.failures
    restart = int(failure["restart_at"].removeprefix("round "))
    fault_round = (at_call - 1) // steps_per_round
    assert restart <= fault_round < num_rounds - 1, (restart, fault_round, num_rounds)
    redone = at_call - restart * steps_per_round  # > 0, as restart <= fault_round
    assert steps_run(steps_dir, partition) == total_steps + redone
    rounds = [h["round"] for h in result.history]  # round 0: the evaluation before training
    assert rounds == list(range(0 if rounds[0] == 0 else 1, num_rounds + 1))


def _first(marker: str) -> bool:
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL))
        return True
    except FileExistsError:
        return False


def diverges() -> torch.nn.Module:
    """Its outputs (and so its gradients and updates) are NaN from the first step."""
    return _NaNOutputs()


class _NaNOutputs(FaultyMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * float("nan")


def latest_run(client, experiment: str):
    return client.search_runs([client.get_experiment_by_name(experiment).experiment_id],
                              order_by=["attributes.start_time DESC"], max_results=1)[0]


def always_fails() -> torch.nn.Module:
    return FaultyMLP(fault="raise", at_call=1)


def dataset(spark, rows: int = 600, seed: int = 3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, N_FEATURES)).astype(np.float32)
    y = ((x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.3).astype(np.int64))
    return spark.createDataFrame(pd.DataFrame({"features": [r.tolist() for r in x],
                                               "label": y}))


def same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def halving_every_3_steps(optimizer):
    """A user's schedule (`lr_schedule=`): torch's StepLR, picklable by reference."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


def server_pid(checkpoint: str) -> int | None:
    """The pid of the `ps serve` process whose command line names `checkpoint`."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in cmdline and checkpoint.encode() in cmdline:
            return int(entry)
    return None


def server_stats(client, run_id: str) -> dict:
    """An async fit's parameter-server report, as its MLflow run keeps it."""
    import json

    return json.loads(Path(client.download_artifacts(run_id, "server_stats.json")).read_text())


def kill_server_after_a_checkpoint(checkpoint: Path, timeout: float = 120.0,
                                   steps_dir: str = "", push_every: int = 0) -> None:
    """On a thread of its own: SIGKILL the `ps serve` that writes `checkpoint` once it has
    saved one beyond its first (INIT's). With `steps_dir` (the workers' `FaultyMLP` step
    counts) and `push_every`, only once a worker has begun the step after its next push past
    that checkpoint: that push was applied and acknowledged, and is lost with the server
    (make checkpoints rare enough that the next one cannot come first). The thread then holds
    `killed_s` (`time.monotonic()`), `killed_at` (the updates applied that checkpoint holds),
    `checkpoint_progress` (each worker's steps in it) and, with `steps_dir`, `steps_at_kill`
    (each of those workers' steps begun by then)."""
    import threading

    from sparkdl_avg.ps import state_file

    deadline = time.monotonic() + timeout
    first = None
    while time.monotonic() < deadline:
        if checkpoint.exists():
            mtime = checkpoint.stat().st_mtime_ns
            if first is None:
                first = mtime
            elif mtime != first:
                _, meta = state_file.load(str(checkpoint))
                if steps_dir:
                    _wait_for_a_push_past(meta["progress"], steps_dir, push_every, deadline)
                pid = server_pid(str(checkpoint))
                if pid is not None:
                    steps = {w: steps_run(steps_dir, int(w)) for w in meta["progress"]} \
                        if steps_dir else None
                    os.kill(pid, signal.SIGKILL)
                    thread = threading.current_thread()
                    thread.killed_s = time.monotonic()
                    thread.killed_at, thread.steps_at_kill = meta["applied"], steps
                    thread.checkpoint_progress = meta["progress"]
                    return
        time.sleep(0.02)


def _wait_for_a_push_past(progress: dict, steps_dir: str, push_every: int,
                          deadline: float) -> None:
    """Until some worker has begun the step after its next push beyond `progress` (its steps
    a checkpoint holds): pushes are synchronous, so that push has been applied."""
    while time.monotonic() < deadline:
        if any(steps_run(steps_dir, int(w)) > steps + push_every
               for w, steps in progress.items()):
            return
        time.sleep(0.005)
    raise AssertionError(f"no worker pushed past {progress} in time")
