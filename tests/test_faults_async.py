"""Faults in async mode: a worker task that fails, and the parameter server process killed
mid-fit. Either way the fit finishes with every step applied exactly once, and the workers'
evaluation of the final parameters is still there at the end."""

from __future__ import annotations

import math
import threading
from functools import partial

import numpy as np
import pytest
import torch
from faulty import (
    FaultyMLP,
    dataset,
    diverges,
    kill_server_after_a_checkpoint,
    latest_run,
    server_stats,
    steps_run,
)
from rounding import evaluation_here

from sparkdl_avg import TrainConfig, TrainingError, fit

pytestmark = pytest.mark.spark

BASE = dict(mode="async", num_workers=2, epochs=2, batch_size=15, push_every=2,
            optimizer="adam", lr=0.01, seed=5, eval_interval_s=0.3, log_model=False)
STEPS = 2 * 20  # 300 rows per worker, 15 a batch, 2 epochs


@pytest.fixture(scope="module")
def data(spark):
    return dataset(spark).cache()


def expected_pushes() -> int:
    return 2 * math.ceil(STEPS / BASE["push_every"])


def test_a_failed_worker_task_is_restarted_where_the_server_says(data, tmp_path,
                                                                 mlflow_client):
    # partition 1 fails in its 16th step of 40, its 7th push (steps 1..14) applied: the
    # restarted task takes up at step 15, so steps 15 and 16 (the 8th push) run twice
    model_fn = partial(FaultyMLP, fault="raise", marker=str(tmp_path / "fired"), at_call=16,
                       steps_dir=str(tmp_path))
    result = fit(data, model_fn, TrainConfig(**BASE, staleness_bound=2), eval_df=data)
    assert (tmp_path / "fired").exists()
    assert steps_run(tmp_path, 1) == STEPS + 2
    assert len(result.failures) == 1
    assert result.failures[0]["partition"] == 1
    assert "ValueError: injected failure in forward" in result.failures[0]["error"]
    # each worker's steps were applied exactly once: none lost, none pushed twice
    assert result.history[-1]["updates_applied"] == expected_pushes()
    stats = server_stats(mlflow_client, result.run_id)
    assert stats["progress"] == {"0": STEPS, "1": STEPS}
    # the job was relaunched, not the parameter server: it kept every applied push
    metrics = mlflow_client.get_run(result.run_id).data.metrics
    assert metrics["restarts"] == 1 and "ps_restarts" not in metrics
    _assert_final_evaluation_is_of_the_model(result, data)


def test_a_killed_parameter_server_is_restarted_from_its_checkpoint(data, tmp_path,
                                                                    mlflow_client):
    """Killed after a push its checkpoint (every 10 updates) lacks: the workers redo it."""
    checkpoint = tmp_path / "parameter-server.npz"
    killer = threading.Thread(target=kill_server_after_a_checkpoint, args=(checkpoint,),
                              kwargs={"steps_dir": str(tmp_path),
                                      "push_every": BASE["push_every"]}, daemon=True)
    killer.start()
    result = fit(data, partial(FaultyMLP, delay_s=0.03, steps_dir=str(tmp_path)),
                 TrainConfig(**BASE, ps_checkpoint_every=5, checkpoint_dir=str(tmp_path)),
                 eval_df=data)
    killer.join(timeout=5)
    assert getattr(killer, "killed_at", None) is not None, "the server was not killed mid-fit"
    assert 0 < killer.killed_at < expected_pushes()
    # every step begun since the checkpoint, an acknowledged push among them, was lost with
    # the server and done again
    lost = {w: killer.steps_at_kill[w] - steps for w, steps in
            killer.checkpoint_progress.items()}
    assert max(lost.values()) > BASE["push_every"]
    assert all(steps_run(tmp_path, int(w)) - STEPS >= n for w, n in lost.items()), lost
    assert mlflow_client.get_metric_history(result.run_id, "ps_restarts")[-1].value == 1
    assert result.history[-1]["updates_applied"] == expected_pushes()
    assert server_stats(mlflow_client, result.run_id)["progress"] == {"0": STEPS, "1": STEPS}
    _assert_final_evaluation_is_of_the_model(result, data)


def _assert_final_evaluation_is_of_the_model(result, data) -> None:
    """The workers' last evaluation (on their own partitions, after the restart) is that of
    the returned model over the evaluation rows, computed here on the driver."""
    rows = data.toPandas()
    x = torch.from_numpy(np.stack(rows["features"].to_numpy()).astype(np.float32))
    y = torch.from_numpy(rows["label"].to_numpy())
    loss, loss_apart, accuracy, accuracy_apart = evaluation_here(result.model, x, y)
    final = result.history[-1]
    assert abs(final["eval_loss"] - loss) <= loss_apart
    assert abs(final["eval_accuracy"] - accuracy) <= accuracy_apart


def test_a_refused_update_fails_the_fit_at_once_not_retried(data, mlflow_client):
    """The async loop's final-error path: the server refuses a NaN update, and a restart would
    only diverge again, so the fit fails at once naming the partition."""
    with pytest.raises(TrainingError, match=r"partition \d failed: PeerRefused: .*NaN or Inf"):
        fit(data, diverges, TrainConfig(**BASE, experiment_name="final-async"))
    run = latest_run(mlflow_client, "final-async")
    assert run.info.status == "FAILED" and "restarts" not in run.data.metrics
