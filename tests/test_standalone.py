"""The main job submitted to a real Spark standalone cluster (a master and two workers on
loopback, each with its own fake GPU), the library shipped as a user ships it: --py-files
with a .zip (a wheel would silently not import)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.cluster

ROOT = Path(__file__).resolve().parents[1]


def test_spark_submit_with_py_files_zip_runs_on_the_cluster(standalone, tmp_path, mlflow_store,
                                                             mlflow_client):
    library = shutil.make_archive(str(tmp_path / "sparkdl_avg"), "zip", root_dir=ROOT,
                                  base_dir="sparkdl_avg")
    submit = Path(sys.executable).with_name("spark-submit")
    cmd = [str(submit), "--master", standalone.url, "--py-files", library,
           "--conf", "spark.executor.cores=1", "--conf", "spark.executor.memory=1g",
           "--conf", "spark.executor.resource.gpu.amount=1",
           "--conf", "spark.task.resource.gpu.amount=1",
           "--conf", "spark.ui.enabled=false", "--conf", "spark.driver.host=127.0.0.1",
           str(ROOT / "jobs" / "train_mnist1d.py"), "--num-workers", "2",
           "--samples", "3000", "--epochs", "2", "--hidden", "64", "--lr", "3e-3",
           "--no-log-model", "--data-dir", str(tmp_path / "data"),
           # partitions spilled to the executors' local directories, windows of 1 MiB
           "--data-cache", "disk", "--cache-budget-mb", "1", "--shuffle-buffer-mb", "1"]
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1",
           "MLFLOW_TRACKING_URI": mlflow_store}
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    tasks = re.findall(r"task (\d): host \S+ device (\S+) gpu (\S+) sparkdl-avg \S+ from (\S+) "
                       r"cache disk spilled ([\d.]+) MB", proc.stdout)
    assert len(tasks) == 2, proc.stdout
    assert sorted(gpu for _, _, gpu, *_ in tasks) == ["0", "1"]  # one fake GPU per worker
    assert all(float(spilled) > 0 for *_, spilled in tasks)
    for _, device, _, library_path, _ in tasks:
        assert device == "cpu"  # this machine's torch has no CUDA; the GPU is only assigned
        assert ".zip" in library_path or "userFiles" in library_path, library_path
    run_id = re.search(r"MLflow run (\w+)", proc.stdout).group(1)
    run = mlflow_client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["worker.0.device"].endswith("/cpu")
