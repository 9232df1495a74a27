"""Runs logged over HTTP to a real `mlflow server` on loopback: sync and async fits compare
column by column (the same param keys, metrics stepped by round), carry their pictures and
their model (which reloads through the server and predicts like the fit's), and MLflow's
system metrics when they are switched on."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import mlflow
import numpy as np
import pandas as pd
import pytest
import torch
from mlflow.tracking import MlflowClient
from rounding import forward_tolerance, within

from sparkdl_avg import TrainConfig, fit

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def server_uri(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow-server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(root / "server.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
         "--backend-store-uri", f"sqlite:///{root}/mlflow.db",
         "--artifacts-destination", str(root / "artifacts")],
        stdout=log, stderr=log, start_new_session=True, cwd=root)
    uri = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert proc.poll() is None, (root / "server.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "mlflow server did not come up in 90 s"
            time.sleep(0.5)
        old = mlflow.get_tracking_uri()
        mlflow.set_tracking_uri(uri)
        yield uri
        mlflow.set_tracking_uri(old)
        mlflow.set_experiment("Default")  # not the server's active experiment id
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def test_sync_and_async_runs_compare_column_by_column(spark, server_uri):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(400, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    df = spark.createDataFrame(pd.DataFrame({"features": list(x), "label": y}))
    common = dict(num_workers=2, epochs=2, batch_size=20, optimizer="adam", lr=0.01,
                  experiment_name="compare-modes", log_model=True)
    mlflow.enable_system_metrics_logging()
    mlflow.set_system_metrics_sampling_interval(1)
    try:
        runs = [fit(df, lambda: torch.nn.Linear(4, 2), TrainConfig(**common, **extra),
                    eval_df=df)
                for extra in ({"mode": "sync", "averaging_frequency": 2},
                              {"mode": "async", "push_every": 2, "eval_interval_s": 0.5})]
    finally:
        mlflow.disable_system_metrics_logging()
        mlflow.set_system_metrics_sampling_interval(None)
    client = MlflowClient(server_uri)
    sync, asynchronous = (client.get_run(r.run_id) for r in runs)
    assert sync.data.params.keys() == asynchronous.data.params.keys()
    for result, run in zip(runs, (sync, asynchronous), strict=True):
        assert run.info.status == "FINISHED"
        steps = sorted(m.step for m in
                       client.get_metric_history(run.info.run_id, "eval_accuracy"))
        mode = run.data.tags["sparkdl_avg.mode"]
        assert steps == _eval_rounds(result.history, mode), mode
        artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
        assert "plots/learning_curves.png" in artifacts
        assert any(k.startswith("system/cpu") for k in run.data.metrics), run.data.metrics
        _assert_reloaded_model_predicts_like(result, x[:8])
    # round 0 (before training), then 200 rows a worker, 20 a batch, 2 epochs: 20 steps, 10
    # rounds of 2, each evaluated
    assert len(runs[0].history) == 11
    assert "plots/worker_timeline.png" in {
        a.path for a in client.list_artifacts(sync.info.run_id, "plots")}


def _eval_rounds(history: list[dict], mode: str) -> list[int]:
    """The MLflow steps the eval metrics must have: the rounds that were evaluated. Sync:
    every `eval_every` rounds. Async: the intervals whose evaluation request the workers
    answered, stepped by the rounds' worth of pushes applied then (several may share one),
    and the last interval, of the final parameters."""
    rounds = [h["round"] for h in history if "eval_accuracy" in h]
    if mode == "async":
        assert "eval_accuracy" in history[-1], history
    assert rounds and rounds == sorted(rounds), rounds
    return rounds


def _assert_reloaded_model_predicts_like(result, rows: np.ndarray) -> None:
    """The model logged to the run, fetched back through the server's artifact proxy (the
    tracking URI is the server's), predicts what `result.model` predicts."""
    assert mlflow.get_tracking_uri().startswith("http://")
    loaded = mlflow.pyfunc.load_model(f"runs:/{result.run_id}/model")
    with torch.no_grad():
        expected = result.model(torch.from_numpy(rows)).numpy()
    apart = forward_tolerance(torch.nn.Sequential(result.model), torch.from_numpy(rows))
    assert within(loaded.predict(rows, params={"output": "raw"}), expected, apart)


def test_the_runs_table_shows_the_fits_names_and_datasets_in_a_browser(server_uri, tmp_path):
    """The MLflow UI's runs table, rendered by headless Chromium: each run under its
    descriptive name, and its datasets in the Datasets column. Runs after the fits above
    (same server); a screenshot stays in tests/artifacts/ for people to look at."""
    import shutil
    from pathlib import Path

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser, "headless Chromium is needed: apt-get install chromium (.ci/run does)"
    experiment = MlflowClient(server_uri).get_experiment_by_name("compare-modes")
    assert experiment is not None, "run test_sync_and_async_runs_compare_column_by_column first"
    url = f"{server_uri}/#/experiments/{experiment.experiment_id}/runs"
    common = [browser, "--headless", "--no-sandbox", "--disable-gpu",
              "--disable-dev-shm-usage", f"--user-data-dir={tmp_path / 'profile'}",
              "--virtual-time-budget=20000", "--window-size=1600,1000"]
    dom = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True,
                         timeout=120).stdout
    shots = Path(__file__).parent / "artifacts"
    shots.mkdir(exist_ok=True)
    subprocess.run([*common, f"--screenshot={shots / 'mlflow_runs_table.png'}", url],
                   capture_output=True, timeout=120)
    assert "sync-2w-k2" in dom and "async-downpour-2w" in dom, dom[-3000:]
    assert "train_df" in dom and "eval_df" in dom, "the Datasets column shows no dataset"
    assert (shots / "mlflow_runs_table.png").stat().st_size > 10_000
