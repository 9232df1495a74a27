"""Faults injected from the user's side (a forward that raises, a worker killed by a signal,
a hang) while a sync fit runs: the fit recovers from its last checkpoint and ends with the
very parameters of a run without the fault; beyond max_failures it fails naming the task."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from functools import partial

import pytest
from faulty import (
    FaultyMLP,
    always_fails,
    assert_sync_recovery,
    dataset,
    latest_run,
    same_parameters,
)

from sparkdl_avg import ClusterError, ConfigError, DataError, TrainConfig, TrainingError, fit

pytestmark = pytest.mark.spark

BASE = dict(num_workers=2, epochs=2, batch_size=15, averaging_frequency=2, optimizer="adam",
            experiment_name="faults",
            lr=0.01, seed=5, checkpoint_every=3, log_model=False)
STEPS = 2 * 20  # 300 rows per worker, 15 a batch, 2 epochs: 20 rounds of 2 steps


@pytest.fixture(scope="module")
def data(spark):
    return dataset(spark).cache()


@pytest.fixture(scope="module")
def reference(data):
    """The same fit without any fault."""
    return fit(data, FaultyMLP, TrainConfig(**BASE))


@pytest.mark.parametrize("fault", ["raise", "kill", "hang"])
def test_fit_recovers_from_a_task_fault_bit_identically(fault, data, reference, tmp_path,
                                                         mlflow_client):
    model_fn = partial(FaultyMLP, fault=fault, marker=str(tmp_path / "fired"),
                       steps_dir=str(tmp_path))
    config = TrainConfig(**BASE, round_timeout=3.0 if fault == "hang" else 600.0)
    result = fit(data, model_fn, config)
    assert (tmp_path / "fired").exists()  # the fault did fire
    assert len(result.failures) == 1
    failure = result.failures[0]
    assert failure["partition"] == 1
    assert failure["executor"] == "driver" and failure["host"]  # local mode: one executor
    expected = {"raise": "ValueError: injected failure in forward",
                "kill": "Python worker exited unexpectedly",
                "hang": "sent no whole message in 3s (round_timeout)"}[fault]
    assert expected in failure["error"]
    # the fault hit round 4 (step 9 of 40); the last checkpoint was taken after round 3, so
    # partition 1 ran steps 7 to 9 twice
    assert failure["restart_at"] == "round 3"
    assert_sync_recovery(result, tmp_path, at_call=9, steps_per_round=2, total_steps=STEPS)
    assert len(reference.history) == STEPS // 2
    assert same_parameters(result.model, reference.model)
    run = mlflow_client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["restarts"] == 1


def test_more_failures_than_max_failures_fail_the_fit_naming_the_task(data, mlflow_client):
    with pytest.raises(TrainingError) as info:
        fit(data, always_fails, TrainConfig(**{**BASE, "max_failures": 1}))
    message = str(info.value)
    assert "failed 2 time(s), more than max_failures=1" in message
    assert "partition 1 on executor driver" in message
    assert "ValueError: injected failure in forward" in message
    runs = mlflow_client.search_runs([mlflow_client.get_experiment_by_name("faults")
                                      .experiment_id], order_by=["attributes.start_time DESC"],
                                     max_results=1)
    assert runs[0].info.status == "FAILED"


def test_resume_from_a_directory_trains_further_bit_identically(data, tmp_path):
    folder = str(tmp_path / "ckpt")
    fit(data, FaultyMLP, TrainConfig(**{**BASE, "epochs": 1}, checkpoint_dir=folder))
    resumed = fit(data, FaultyMLP, TrainConfig(**{**BASE, "epochs": 3}, checkpoint_dir=folder),
                  resume_from=folder)
    straight = fit(data, FaultyMLP, TrainConfig(**{**BASE, "epochs": 3}))
    assert same_parameters(resumed.model, straight.model)
    assert resumed.history[0]["round"] == 1  # the first fit's rounds come with the checkpoint
    assert [h["train_loss"] for h in resumed.history] == \
        [h["train_loss"] for h in straight.history]


def test_resume_refuses_a_different_fit_before_training(data, tmp_path):
    folder = str(tmp_path / "ckpt")
    fit(data, FaultyMLP, TrainConfig(**{**BASE, "epochs": 1}, checkpoint_dir=folder))
    with pytest.raises(ConfigError, match=r"lr: checkpoint 0.01, this fit 0.02"):
        fit(data, FaultyMLP, TrainConfig(**{**BASE, "epochs": 2, "lr": 0.02}),
            resume_from=folder)
    with pytest.raises(ConfigError, match="raise epochs to train further"):
        fit(data, FaultyMLP, TrainConfig(**{**BASE, "epochs": 1}), resume_from=folder)
    with pytest.raises(ConfigError, match="already holds checkpoints of another fit"):
        fit(data, FaultyMLP, TrainConfig(**BASE, checkpoint_dir=folder))  # would prune them
    with pytest.raises(ConfigError, match="neither an existing directory nor an MLflow run"):
        fit(data, FaultyMLP, TrainConfig(**BASE), resume_from=str(tmp_path / "nothing"))


def test_deterministic_resume_refuses_devices_other_than_the_checkpoints(data, tmp_path,
                                                                         mlflow_client):
    folder = tmp_path / "ckpt"
    first = fit(data, FaultyMLP, TrainConfig(**{**BASE, "epochs": 1}, deterministic=True,
                                             checkpoint_dir=str(folder)))
    assert mlflow_client.get_run(first.run_id).data.tags["sparkdl_avg.devices"] == "cpu"
    for meta_file in folder.glob("round-*/checkpoint.json"):
        meta = json.loads(meta_file.read_text())
        assert meta["fingerprint"]["devices"] == ["cpu", "cpu"]  # each partition's device
        meta["fingerprint"]["devices"] = ["cpu", "cuda/NVIDIA H100 80GB HBM3"]  # as if it had
        meta_file.write_text(json.dumps(meta))
    more = {**BASE, "epochs": 2, "checkpoint_dir": str(folder)}
    with pytest.raises(ClusterError, match="partition 1: cuda/NVIDIA H100 80GB HBM3 then, "
                                           "cpu now") as info:
        fit(data, FaultyMLP, TrainConfig(**more, deterministic=True), resume_from=str(folder))
    assert "deterministic=False" in str(info.value)
    assert latest_run(mlflow_client, "faults").info.status == "FAILED"
    fit(data, FaultyMLP, TrainConfig(**more), resume_from=str(folder))  # not asked: it resumes


def test_resume_after_the_driver_process_was_killed(data, reference, mlflow_client, tmp_path):
    """SIGKILL a driver (its whole process group: JVM, Python workers) once its MLflow run has a
    checkpoint, then resume from that run: same parameters as a fit never interrupted."""
    config = {**BASE, "checkpoint_every": 2, "experiment_name": "killed-driver"}
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__),
                                                        os.environ.get("PYTHONPATH", "")])}
    script = os.path.join(os.path.dirname(__file__), "driver_to_kill.py")
    with open(tmp_path / "driver.log", "w") as log:
        proc = subprocess.Popen([sys.executable, script, json.dumps(config)], env=env,
                                start_new_session=True, stdout=log, stderr=log)
        try:
            run_id = _wait_for_checkpoint(mlflow_client, "killed-driver", at_least_round=4,
                                          proc=proc, log=tmp_path / "driver.log")
        finally:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert mlflow_client.get_run(run_id).info.status == "RUNNING"  # died without a word
    resumed = fit(data, FaultyMLP, TrainConfig(**config), resume_from=run_id)
    assert same_parameters(resumed.model, reference.model)  # checkpoint_every: no numerics
    params = mlflow_client.get_run(resumed.run_id).data.params
    assert int(params["resumed_at_round"]) >= 4
    assert int(params["resumed_at_round"]) < len(reference.history)  # killed mid-fit
    assert mlflow_client.get_run(run_id).info.status == "KILLED"


def _wait_for_checkpoint(client, experiment: str, *, at_least_round: int, proc, log,
                         timeout: float = 180.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the driver exited early: {log.read_text()[-3000:]}"
        exp = client.get_experiment_by_name(experiment)
        runs = client.search_runs([exp.experiment_id]) if exp else []
        for run in runs:
            if run.info.status != "RUNNING":
                continue
            done = [f.path for f in client.list_artifacts(run.info.run_id, "checkpoints")]
            rounds = [int(p.rsplit("-", 1)[1]) for p in done
                      if any(a.path.endswith("checkpoint.json")
                             for a in client.list_artifacts(run.info.run_id, p))]
            if rounds and max(rounds) >= at_least_round:
                return run.info.run_id
        time.sleep(0.1)
    raise AssertionError(f"no checkpoint in {timeout}s: {log.read_text()[-3000:]}")


def test_a_dataframe_that_changes_under_the_fit_fails_at_once_not_retried(spark,
                                                                          mlflow_client):
    """A task's own check (here: it got other rows than validation counted) would fail the
    same way on every restart: the fit fails at once, naming the partition and the cause."""
    import random

    from pyspark.sql import functions as F

    keep = F.udf(lambda _: random.random() < 0.7, "boolean").asNondeterministic()
    changing = dataset(spark).filter(keep(F.col("label")))
    # the task's DataError reaches the caller as a DataError, not retried
    with pytest.raises(DataError, match=r"partition \d failed: partition \d: "
                                        r".* the DataFrame changed"):
        fit(changing, FaultyMLP, TrainConfig(**{**BASE, "experiment_name": "final-sync"}))
    run = latest_run(mlflow_client, "final-sync")
    assert run.info.status == "FAILED" and "restarts" not in run.data.metrics
