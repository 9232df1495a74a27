"""GPU scheduling without a GPU: fake GPUs on a local-cluster, and refusal in local mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparkdl_avg import ClusterError, TrainConfig, fit


@pytest.mark.cluster
def test_each_task_trains_on_its_own_spark_assigned_gpu(tmp_path):
    out = tmp_path / "workers.json"
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1"}
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("fake_gpu_fit.py")), str(out)],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    workers = json.loads(out.read_text())
    assert sorted(w["gpu"] for w in workers) == ["0", "1"]
    for w in workers:
        if torch.cuda.is_available():
            assert w["device"] == f"cuda:{w['gpu']}"
        else:  # this machine's torch has no CUDA: the task says so and trains on the CPU
            assert w["device"] == "cpu"
            assert "CUDA is not available" in w["warning"]


@pytest.mark.spark
def test_local_mode_with_gpu_tasks_is_refused_not_hung(spark, monkeypatch):
    conf = spark.sparkContext.getConf()
    conf.set("spark.task.resource.gpu.amount", "1")
    monkeypatch.setattr(type(spark.sparkContext), "getConf", lambda self: conf)
    df = spark.createDataFrame([([1.0], 0)] * 8, "features array<double>, label int")
    with pytest.raises(ClusterError, match="local mode cannot schedule GPU tasks"):
        fit(df, lambda: torch.nn.Linear(1, 2), TrainConfig(batch_size=2, log_model=False))
