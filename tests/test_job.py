"""The main job under plain python (spark-submit to a standalone cluster: test_standalone)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

JOB = Path(__file__).resolve().parents[1] / "jobs" / "train_mnist1d.py"
SMALL = ["--samples", "3000", "--epochs", "3", "--hidden", "64", "--lr", "3e-3",
         "--no-log-model"]


def run_job(cmd: list[str], tmp_path: Path, tracking_uri: str) -> str:
    env = {**os.environ, "PYSPARK_PYTHON": sys.executable, "SPARK_LOCAL_IP": "127.0.0.1",
           "MLFLOW_TRACKING_URI": tracking_uri}
    proc = subprocess.run(cmd + SMALL + ["--data-dir", str(tmp_path.parent / "data")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def check_output(stdout: str, client, **params: str) -> None:
    match = re.search(r"test accuracy (\S+) .* MLflow run (\w+)", stdout)
    assert match, stdout
    assert float(match.group(1)) > 0.3  # 10 classes: well above chance after 3 epochs
    run = client.get_run(match.group(2))
    assert run.info.status == "FINISHED"
    assert run.data.params["epochs"] == "3"
    for name, value in params.items():
        assert run.data.params[name] == value


@pytest.mark.cluster
def test_job_runs_with_plain_python(tmp_path, mlflow_store, mlflow_client):
    ckpt = tmp_path / "ckpt"
    # overlapped rounds (checkpoint rounds wait): the job's flag reaches the fit
    cmd = [sys.executable, str(JOB), "--checkpoint-dir", str(ckpt), "--checkpoint-every", "5",
           "--overlap-averaging"]
    check_output(run_job(cmd, tmp_path, mlflow_store), mlflow_client,
                 overlap_averaging="True")
    rounds = sorted(p.name for p in ckpt.glob("round-*"))
    assert len(rounds) == 2  # the newest two are kept
    assert all((ckpt / r / "checkpoint.json").exists() for r in rounds)
