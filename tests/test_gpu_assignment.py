"""GPU scheduling without a GPU: fake GPUs on the standalone cluster (discovered, and faked in
the executors' torch to disagree with discovery), and refusal in local mode; on the same
cluster, a fit that survives losing an executor."""

from __future__ import annotations

import json
import math
import re

import early
import pytest
import torch

from sparkdl_avg import ClusterError, TrainConfig, fit


@pytest.fixture(scope="module")
def cluster_fits():
    """cluster_fits.py's fits, on a standalone cluster of its own (two workers, one fake GPU
    each), started by conftest as collection ended (`early`), beside the rest of the suite."""
    run = early.start("test_gpu_assignment.py")
    done = run.wait(timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((run.folder / "fits.json").read_text())


@pytest.mark.cluster
def test_each_task_is_given_its_own_gpu_and_without_cuda_trains_on_the_cpu_saying_so(
        cluster_fits):
    """With GPUs on the executors but none asked for tasks in general, the fit's training
    stage alone gets one a task (a stage-level resource profile). The cluster's GPUs are
    fake and no task can use CUDA: every task trains on the CPU (one kind of device: not
    refused) and the run says so per partition. That each task trains on its own GPU is
    checked by the fake-CUDA fits below, not here."""
    workers = cluster_fits["workers"]
    assert sorted(w["gpu"] for w in workers) == ["0", "1"]
    for w in workers:
        assert w["device"] == "cpu"
        assert "CUDA is not available" in w["warning"]
    assert sorted(cluster_fits["cpu_fallbacks"]) == [
        "sparkdl_avg.cpu_fallback.0", "sparkdl_avg.cpu_fallback.1"]


@pytest.mark.cluster
def test_a_gpu_hidden_by_cuda_visible_devices_is_refused_before_any_device_is_used(
        cluster_fits):
    """Discovery says "0" and "1", CUDA_VISIBLE_DEVICES says "1,2": the old rule put both
    tasks on cuda:0; now the task given GPU 0 stops the fit before anyone touches a GPU."""
    hidden = cluster_fits["fake_gpus"]["hidden"]
    assert "Spark assigned GPU 0, but CUDA_VISIBLE_DEVICES='1,2' hides it" in hidden["error"]
    assert hidden["error"].startswith("ClusterError: partition ")  # final: not retried
    assert hidden["set_device"] == []


@pytest.mark.cluster
def test_a_fit_refused_on_its_devices_leaves_every_executor_alive(cluster_fits):
    """The task that finds no device still joins the barrier's all-gather, so no peer is left
    waiting there when the stage is cancelled: Spark would kill that peer's whole executor
    (a TaskKilledException escapes `barrierAndServe`, exit code 50), and the next fit could be
    scheduled on the dying executor."""
    executors = cluster_fits["executors"]
    assert len(executors["before_fake_gpus"]) == 2
    assert executors["after_fake_gpus"] == executors["before_fake_gpus"]


@pytest.mark.cluster
def test_gpus_listed_out_of_order_are_each_found_by_their_id(cluster_fits):
    """CUDA_VISIBLE_DEVICES="1,0": GPU 0 is cuda:1 and GPU 1 is cuda:0, one task each; the
    fake devices then refuse to run, which stops the fit as a final device error."""
    reordered = cluster_fits["fake_gpus"]["reordered"]
    assert re.search(r"could not start on (cuda:1 \(GPU 0\)|cuda:0 \(GPU 1\)): CUDA error",
                     reordered["error"]), reordered["error"]
    devices = [line.split()[1] for line in reordered["set_device"]]
    assert devices and set(devices) <= {"cuda:0", "cuda:1"}
    assert len(devices) == len(set(devices))  # never two tasks on one device


@pytest.mark.cluster
def test_a_fit_survives_losing_its_executor(cluster_fits):
    """The model SIGKILLs its executor's JVM (and its own Python worker) in a middle round; the
    standalone worker starts a new executor, the driver waits for its slots, restarts from the
    last checkpoint before the fault and recomputes the rounds since, to the same parameters."""
    assert cluster_fits["killed"]
    [failure] = cluster_fits["failures"]
    assert failure["executor"] in ("0", "1")  # partition 1's executor; a new one replaced it
    assert failure["partition"] == cluster_fits["schedule"]["fault_partition"]
    assert "ExecutorLostFailure" in failure["error"] or "exited" in failure["error"]

    s = cluster_fits["schedule"]
    total_steps = s["steps_per_epoch"] * s["epochs"]
    num_rounds = math.ceil(total_steps / s["averaging_frequency"])
    fault_round = (s["at_call"] - 1) // s["averaging_frequency"]  # the at_call-th step's round
    restart = int(failure["restart_at"].removeprefix("round "))
    # the fault fired mid-training; the restart point is the last checkpoint before it, at
    # least one completed round earlier (a fault in the last round would recompute nothing)
    assert 0 < restart < fault_round < num_rounds - 1
    assert restart == fault_round - fault_round % s["checkpoint_every"]
    # so the rounds from the restart point on ran twice: partition 1 trained at_call steps,
    # the last one cut short, then every step from the restart point to the end
    redone = s["at_call"] - restart * s["averaging_frequency"]
    assert redone > s["averaging_frequency"]  # more than the fault's round: a whole round
    assert cluster_fits["fault_partition_steps"] == total_steps + redone
    assert cluster_fits["rounds"] == list(range(1, num_rounds + 1))  # each logged once
    assert cluster_fits["same_parameters"]  # bit-identical to the fit that lost nothing


@pytest.mark.spark
def test_local_mode_with_gpu_tasks_is_refused_not_hung(spark, monkeypatch):
    from sparkdl_avg.driver import session

    real = session.conf
    monkeypatch.setattr(session, "conf", lambda s, key, default=None: "1"
                        if key == "spark.task.resource.gpu.amount" else real(s, key, default))
    df = spark.createDataFrame([([1.0], 0)] * 8, "features array<double>, label int")
    with pytest.raises(ClusterError, match="local mode cannot schedule GPU tasks"):
        fit(df, lambda: torch.nn.Linear(1, 2), TrainConfig(batch_size=2, log_model=False))


@pytest.mark.spark
@pytest.mark.parametrize("gpu_amount, compared", [(None, False), ("1", True)])
def test_tasks_compare_their_gpus_in_a_barrier_only_where_spark_gives_them_gpus(
        spark, monkeypatch, gpu_amount, compared):
    """The comparison is a barrier all-gather, which costs about a second (Spark polls its
    barrier once a second): tasks that Spark gives no GPU cannot share one, and skip it."""
    from sparkdl_avg.driver import session
    from sparkdl_avg.driver.barrier import BarrierJob
    from sparkdl_avg.task.spec import WorkerSpec

    if gpu_amount is not None:
        real = session.conf
        monkeypatch.setattr(session, "conf", lambda s, key, default=None: gpu_amount
                            if key == "spark.task.resource.gpu.amount"
                            else real(s, key, default))
    spec = WorkerSpec(address=("127.0.0.1", 1), config=b"", model_fn=b"",
                      loss=b"", schedule=None, schema=None, train_rows=[1], eval_rows=[0])
    job = BarrierJob.training(spark.range(1), spec, "gpu check", TrainConfig(),
                              secret=b"s" * 32)
    try:
        assert job._fn.args[0].gpu_tasks is compared
    finally:
        job._monitor.close()


@pytest.mark.cluster
def test_an_elastic_fit_trains_on_through_a_lost_executor_and_takes_its_task_back(
        cluster_fits):
    """The same executor kill in an elastic fit (min_workers=1): no restart; the other worker
    trains on alone (workers = 1), Spark runs the lost task again on the executor the
    standalone worker starts in the dead one's place, and it joins a later round (workers =
    2 again) with the global parameters. The executor took shuffle output with it, so Spark
    reruns the stage's unfinished tasks, partition 0's too: that newer attempt takes the
    running one's place (a record of its own), never two at once."""
    elastic = cluster_fits["elastic"]
    assert elastic["killed"]
    assert all(f["restart_at"] is None for f in elastic["failures"]), elastic["failures"]
    [failure] = [f for f in elastic["failures"] if f["partition"] == 1]
    assert failure["round_back"] is not None and failure["round_back"] > failure["round_lost"]
    assert failure["attempt_back"] > failure["attempt"]
    workers = elastic["workers"]
    assert workers[:failure["round_lost"] - 1] == [2] * (failure["round_lost"] - 1), workers
    assert 1 in workers and workers[-1] == 2, workers
