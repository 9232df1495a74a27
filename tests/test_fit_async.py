"""Async mode end to end on Spark: a sidecar parameter server per fit."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
from faulty import server_stats
from rounding import evaluation_here
from test_fit_sync import (
    frame,
    make_data,
    make_model_f32,
    make_model_f64,
    max_param_diff,
    sync_and_lockstep,
)

from sparkdl_avg import ConfigError, TrainConfig, fit

pytestmark = pytest.mark.spark


@pytest.mark.core
@pytest.mark.exact
def test_staleness_bound_zero_reproduces_synchronous_averaging(spark):
    sync, lockstep = sync_and_lockstep(spark, rows=400, epochs=3)
    assert max_param_diff(sync, lockstep) < 1e-10
    assert max_param_diff(sync, make_model_f64()) > 1e-2


@pytest.mark.parametrize("algorithm", ["downpour", "dcasgd-adaptive"])
def test_async_learns_and_logs_the_servers_view(spark, mlflow_client, algorithm):
    x, y = make_data(2000, seed=2)
    train = frame(spark, x[:1600].astype(np.float32), y[:1600])
    test = frame(spark, x[1600:].astype(np.float32), y[1600:])
    cfg = TrainConfig(mode="async", algorithm=algorithm, num_workers=2, epochs=4,
                      batch_size=32, push_every=4, optimizer="adam", lr=1e-2,
                      eval_interval_s=0.5, log_model=False, experiment_name="async-tests")
    result = fit(train, make_model_f32, cfg, eval_df=test)
    final = result.history[-1]
    assert final["eval_accuracy"] > 0.85
    # the returned model is the server's final parameters
    _, _, accuracy, apart = evaluation_here(result.model, torch.from_numpy(
        x[1600:].astype(np.float32)), torch.from_numpy(y[1600:]))
    assert abs(final["eval_accuracy"] - accuracy) <= apart
    # every push was applied: 2 workers x (4 epochs x 25 steps) / 4 steps per push = 50
    assert final["updates_applied"] == 50
    run = mlflow_client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["mode"] == "async" and run.data.params["algorithm"] == algorithm
    for key in ("updates_per_s", "staleness_mean", "staleness_mean_worker_0", "eval_accuracy"):
        assert mlflow_client.get_metric_history(result.run_id, key), key


def test_fit_uses_a_standalone_server_given_by_address(spark, tmp_path, mlflow_client):
    import os

    from sparkdl_avg.ps.settings import ServerSettings
    from sparkdl_avg.ps.sidecar import Sidecar

    secret = os.urandom(32)
    (tmp_path / "secret").write_text(secret.hex())
    x, y = make_data(400, seed=3)
    settings = ServerSettings(algorithm="downpour", lr=0.05, update_scale=0.5, timeout=60)
    with Sidecar(settings, host="127.0.0.1", secret=secret) as server:  # a user's server
        result = fit(frame(spark, x, y), make_model_f64, TrainConfig(
            mode="async", num_workers=2, epochs=2, batch_size=8, push_every=2, lr=0.05,
            ps_address=f"127.0.0.1:{server.port}", ps_secret_file=str(tmp_path / "secret"),
            log_model=False))
        assert result.history[-1]["updates_applied"] == 2 * (2 * 25) // 2
        tags = mlflow_client.get_run(result.run_id).data.tags  # the server's own report
        assert tags["sparkdl_avg.ps.lr"] == "0.05"
        assert tags["sparkdl_avg.ps.update_scale"] == "0.5"
        # A fit that needs other settings than the server has is refused before any task.
        with pytest.raises(ConfigError, match="lr: the fit has 0.01, the server 0.05"):
            fit(frame(spark, x, y), make_model_f64, TrainConfig(
                mode="async", num_workers=2, batch_size=8, lr=0.01,
                ps_address=f"127.0.0.1:{server.port}", ps_secret_file=str(tmp_path / "secret"),
                log_model=False, experiment_name="ps-mismatch"))
    failed = mlflow_client.search_runs(
        [mlflow_client.get_experiment_by_name("ps-mismatch").experiment_id])
    assert [r.info.status for r in failed] == ["FAILED"]


def test_async_with_a_user_optimizer_factory(spark):
    from test_fit_sync import sgd_factory  # a user module the executors do not have

    x, y = make_data(200, seed=6)
    result = fit(frame(spark, x, y), make_model_f64, TrainConfig(
        mode="async", num_workers=2, epochs=1, batch_size=10, push_every=2,
        optimizer=sgd_factory, log_model=False))
    assert result.history[-1]["updates_applied"] == 2 * 10 // 2


def test_the_workers_evaluate_on_their_own_rows_up_to_the_final_parameters(spark,
                                                                           mlflow_client):
    """eval_df never comes to the driver: when the driver asks, each task evaluates the
    server's parameters of that moment on its own evaluation partition and the server adds
    the sums up; the last evaluation is of the very parameters the fit returns."""
    from faulty import FaultyMLP

    rng = np.random.default_rng(9)
    x = rng.normal(size=(901, 5)).astype(np.float32)  # 301 evaluation rows: 151 and 150
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.3).astype(np.int64)
    result = fit(frame(spark, x[:600], y[:600]), partial(FaultyMLP, delay_s=0.005),
                 TrainConfig(mode="async", num_workers=2, epochs=4, batch_size=10,
                             push_every=2, optimizer="adam", lr=0.01, eval_interval_s=0.1,
                             log_model=False), eval_df=frame(spark, x[600:], y[600:]))
    # the returned model, evaluated here, independently
    loss, loss_apart, accuracy, accuracy_apart = evaluation_here(
        result.model, torch.from_numpy(x[600:]), torch.from_numpy(y[600:]))
    final = result.history[-1]
    assert final["updates_applied"] == 2 * (4 * 30) // 2
    assert abs(final["eval_loss"] - loss) <= loss_apart
    assert abs(final["eval_accuracy"] - accuracy) <= accuracy_apart
    evaluated = [h for h in result.history if "eval_loss" in h]
    # round 0, then asked while training, not only at the end
    assert len(evaluated) >= 4 and evaluated[0]["round"] == 0, result.history
    assert [h["eval_loss"] for h in evaluated] != [final["eval_loss"]] * len(evaluated)
    # each result is logged at the step of the parameters it evaluated
    history = mlflow_client.get_metric_history(result.run_id, "eval_loss")
    assert sorted((m.step, m.value) for m in history) == \
        sorted((h["round"], h["eval_loss"]) for h in evaluated)
    stats = server_stats(mlflow_client, result.run_id)["evaluations"]
    assert stats["pending"] is None and stats["results"][-1]["final"]
    assert stats["results"][-1]["count"] == 301 and stats["finished"] == [0, 1]


def test_fetch_every_beyond_a_tight_staleness_bound_does_not_stall(spark):
    """Issue 28: with a fetch every 2 pushes and staleness_bound=0, each worker's second
    push waited for the other's next fetch, which came only after the other's second push:
    both waited until round_timeout, and every restart stalled again. A worker now fetches
    at least every bound + 1 pushes: here after each push, which is synchronous averaging."""
    sync, lockstep = sync_and_lockstep(spark, rows=120, epochs=2, fetch_every=10,
                                       round_timeout=10, max_failures=0)
    assert max_param_diff(sync, lockstep) < 1e-10


@pytest.fixture(scope="module")
def one_worker_fits(spark, mlflow_store):
    """One worker, a push every step and a fetch every 4 (float64 SGD, no shuffle), under
    Downpour and under DC-ASGD with a large lambda: (model, server stats) of each."""
    from mlflow.tracking import MlflowClient

    mlflow_client = MlflowClient(mlflow_store)
    df = frame(spark, *make_data(48, seed=4))  # 12 steps an epoch
    out = {}
    for algorithm, extra in (("downpour", {}), ("dcasgd", {"dc_lambda": 1.0})):
        result = fit(df, make_model_f64, TrainConfig(
            mode="async", algorithm=algorithm, num_workers=1, epochs=2, batch_size=4,
            push_every=1, fetch_every=4, optimizer="sgd", lr=0.1, shuffle=False, seed=1,
            log_model=False, **extra))
        out[algorithm] = result.model, server_stats(mlflow_client, result.run_id)
    return out


def test_fetch_every_sets_the_pushes_between_fetches(one_worker_fits):
    """Between two fetches the one worker's k-th push finds k-1 of its own applied since
    its fetch: 24 pushes, a fetch every 4, staleness 0, 1, 2, 3 six times each (were
    fetch_every ignored, every push would be fresh)."""
    for _, stats in one_worker_fits.values():
        assert stats["staleness"]["0"]["histogram"] == {"0": 6, "1": 6, "2": 6, "3": 6}


def test_dcasgd_counts_no_delay_for_a_workers_own_pushes(one_worker_fits):
    """One worker computes every update at the server's parameters, fetched or not, so
    DC-ASGD's compensation is zero and the fit is Downpour's (before, the pushes since its
    fetch counted as delay, and lambda 1 moved the result)."""
    (downpour, _), (dcasgd, _) = one_worker_fits["downpour"], one_worker_fits["dcasgd"]
    assert max_param_diff(downpour, dcasgd) < 1e-12
    assert max_param_diff(downpour, make_model_f64()) > 1e-2


def test_dcasgd_and_dc_lambda_change_a_lockstep_fit(spark):
    """Two workers in lockstep: each round, the second push to arrive was computed before
    the first was applied, so DC-ASGD compensates it. Lambda 0 is Downpour (to rounding;
    the default 0.04 differed by 7e-6 to 1e-5 here, so a dc_lambda ignored fails); lambda
    1 is not (an algorithm ignored fails)."""
    df = frame(spark, *make_data(80, seed=5))
    models = {}
    for name, fields in (("downpour", {}), ("lambda 0", {"algorithm": "dcasgd",
                                                         "dc_lambda": 0.0}),
                         ("lambda 1", {"algorithm": "dcasgd", "dc_lambda": 1.0})):
        models[name] = fit(df, make_model_f64, TrainConfig(
            mode="async", num_workers=2, epochs=2, batch_size=4, push_every=1,
            staleness_bound=0, optimizer="sgd", lr=0.2, shuffle=False, seed=1,
            log_model=False, **fields)).model
    assert max_param_diff(models["downpour"], models["lambda 0"]) < 1e-10
    assert max_param_diff(models["downpour"], models["lambda 1"]) > 1e-5


def _batch_norm_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16),
                               torch.nn.ReLU(), torch.nn.Linear(16, 3))


def test_dcasgd_moves_batch_norm_statistics_as_measured_not_as_gradients(spark):
    """The fit tells the server which values are BatchNorm's statistics: read as lr x a
    gradient, DC-ASGD's compensation grows as 1/lr and, at lr 1e-3, drove running variances
    negative (the model's eval output NaN). In lockstep, so that pushes are compensated."""
    x, y = make_data(160, seed=4)
    df = frame(spark, (x * 3 + 5).astype(np.float32), y)
    result = fit(df, _batch_norm_model, TrainConfig(
        mode="async", algorithm="dcasgd", num_workers=2, epochs=2, batch_size=8,
        push_every=4, staleness_bound=0, optimizer="sgd", lr=1e-3, seed=1, log_model=False))
    norm = result.model[1]
    assert (norm.running_var > 0).all(), norm.running_var
    assert torch.isfinite(result.model(torch.from_numpy(x[:8].astype(np.float32)))).all()
