"""GPU scheduling without a GPU: fake GPUs on the standalone cluster, and refusal in local
mode; on the same cluster, a fit that survives losing an executor."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparkdl_avg import ClusterError, TrainConfig, fit


@pytest.fixture(scope="module")
def cluster_fits(tmp_path_factory, standalone):
    """Runs cluster_fits.py once, on the session's standalone cluster, for both tests."""
    out = tmp_path_factory.mktemp("cluster") / "fits.json"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("cluster_fits.py")), str(out),
         standalone.url], env=env, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.cluster
def test_each_task_trains_on_its_own_spark_assigned_gpu(cluster_fits):
    workers = cluster_fits["workers"]
    assert sorted(w["gpu"] for w in workers) == ["0", "1"]
    for w in workers:
        if torch.cuda.is_available():
            assert w["device"] == f"cuda:{w['gpu']}"
        else:  # this machine's torch has no CUDA: the task says so and trains on the CPU
            assert w["device"] == "cpu"
            assert "CUDA is not available" in w["warning"]


@pytest.mark.cluster
def test_a_fit_survives_losing_its_executor(cluster_fits):
    """The model SIGKILLs its executor's JVM mid-fit; the standalone worker starts a new
    executor, the driver waits for its slots and restarts from the last checkpoint."""
    assert cluster_fits["killed"]
    [failure] = cluster_fits["failures"]
    # a checkpoint round (every 2 of 6): the Python workers outlive their JVM for a moment
    # and may finish more rounds, even all, before Spark reports the executor lost
    assert failure["restart_at"] in ("round 2", "round 4", "round 6")
    assert failure["executor"] in ("0", "1")  # partition 1's executor; a new one replaced it
    assert "ExecutorLostFailure" in failure["error"] or "exited" in failure["error"]
    assert cluster_fits["same_parameters"]  # bit-identical to the fit that lost nothing


@pytest.mark.spark
def test_local_mode_with_gpu_tasks_is_refused_not_hung(spark, monkeypatch):
    conf = spark.sparkContext.getConf()
    conf.set("spark.task.resource.gpu.amount", "1")
    monkeypatch.setattr(type(spark.sparkContext), "getConf", lambda self: conf)
    df = spark.createDataFrame([([1.0], 0)] * 8, "features array<double>, label int")
    with pytest.raises(ClusterError, match="local mode cannot schedule GPU tasks"):
        fit(df, lambda: torch.nn.Linear(1, 2), TrainConfig(batch_size=2, log_model=False))
