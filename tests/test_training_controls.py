"""The training controls (schedules, warmup, clipping, accumulation, precision, early
stopping), checked against independent computations on a local[2] session."""

from __future__ import annotations

import math
from dataclasses import replace
from functools import partial

import numpy as np
import pandas as pd
import pytest
import torch
from faulty import (
    FaultyMLP,
    assert_sync_recovery,
    dataset,
    halving_every_3_steps,
    latest_run,
    same_parameters,
)
from rounding import evaluation_here

from sparkdl_avg import ConfigError, EarlyStopping, TrainConfig, TrainingError, fit
from sparkdl_avg._controls import lr_factor

pytestmark = pytest.mark.spark
N_FEATURES = 6


def f64_model() -> torch.nn.Module:
    torch.manual_seed(11)
    return torch.nn.Sequential(torch.nn.Linear(N_FEATURES, 12), torch.nn.Tanh(),
                               torch.nn.Linear(12, 3)).double()


@pytest.mark.exact
def test_accumulated_micro_batches_under_cosine_equal_full_batch_sgd(spark):
    """Each worker's shard is one optimizer step of 4 micro-batches of 8 rows, averaged every
    step: full-batch SGD on all 64 rows under torch's CosineAnnealingLR, to 1e-10."""
    rng = np.random.default_rng(2)
    x = rng.normal(size=(64, N_FEATURES))
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5).astype(np.int64)
    df = spark.createDataFrame(pd.DataFrame({"features": [r.tolist() for r in x], "label": y}))
    steps, lr = 25, 0.3
    config = TrainConfig(num_workers=2, epochs=steps, batch_size=8, grad_accumulation=4,
                         averaging_frequency=1, optimizer="sgd", lr=lr,
                         lr_schedule="cosine", seed=3, log_model=False,
                         experiment_name="controls")
    result = fit(df, f64_model, config)
    reference = f64_model()
    opt = torch.optim.SGD(reference.parameters(), lr=lr)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    lrs = []
    for _ in range(steps):
        lrs.append(opt.param_groups[0]["lr"])
        opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(torch.from_numpy(x)),
                                          torch.from_numpy(y)).backward()
        opt.step()
        cosine.step()
    diff = max((a - b).abs().max().item()
               for a, b in zip(result.model.parameters(), reference.parameters(), strict=True))
    assert diff < 1e-10
    assert max((a - b).abs().max().item() for a, b in zip(
        result.model.parameters(), f64_model().parameters(), strict=True)) > 1e-2  # it moved
    assert len(result.history) == steps  # one optimizer step a round
    assert np.allclose([h["lr"] for h in result.history], lrs, rtol=0, atol=1e-12)


def test_warmup_then_the_schedule_in_closed_form():
    cfg = TrainConfig(lr_schedule="linear", warmup_steps=4)
    assert [lr_factor(cfg, t, 12) for t in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert lr_factor(cfg, 8, 12) == 0.5 and lr_factor(cfg, 11, 12) == 0.125
    cos = TrainConfig(lr_schedule="cosine", warmup_steps=2)
    assert lr_factor(cos, 2, 12) == 1.0  # the first step after warmup has the full lr
    assert lr_factor(cos, 7, 12) == pytest.approx((1 + math.cos(math.pi * 5 / 10)) / 2)
    assert lr_factor(TrainConfig(warmup_steps=3), 10, 12) == 1.0  # warmup, then constant


@pytest.fixture(scope="module")
def data(spark):
    return dataset(spark).cache()


CONTROLLED = TrainConfig(num_workers=2, epochs=3, batch_size=10, grad_accumulation=3,
                         averaging_frequency=2, optimizer="adam", lr=0.02,
                         lr_schedule="cosine", warmup_steps=3, grad_clip_norm=0.5, seed=4,
                         checkpoint_every=2, log_model=False, experiment_name="controls")


@pytest.mark.parametrize("schedule", ["cosine", halving_every_3_steps],
                         ids=["cosine-warmup", "user-steplr"])
def test_a_restart_with_every_control_on_is_bit_identical(data, tmp_path, schedule):
    config = replace(CONTROLLED, lr_schedule=schedule,
                     warmup_steps=3 if schedule == "cosine" else 0)
    straight = fit(data, FaultyMLP, config)
    faulty = fit(data, partial(FaultyMLP, fault="raise", marker=str(tmp_path / "m"),
                               at_call=40, steps_dir=str(tmp_path)), config)
    [failure] = faulty.failures
    assert failure["restart_at"] not in ("round 0",)  # from a checkpoint, mid-schedule
    # 300 rows a worker: 30 micro-batches of 10 an epoch, 3 epochs; 6 a round (2 steps of 3)
    assert_sync_recovery(faulty, tmp_path, at_call=40, steps_per_round=6, total_steps=90)
    assert same_parameters(faulty.model, straight.model)
    assert [h["lr"] for h in faulty.history] == [h["lr"] for h in straight.history]


def test_resume_continues_bit_identically_and_refuses_a_changed_schedule(data, tmp_path):
    folder = str(tmp_path / "ckpt")
    config = replace(CONTROLLED, checkpoint_dir=folder, max_failures=0)
    with pytest.raises(TrainingError):  # dies mid-fit, after a checkpoint
        fit(data, partial(FaultyMLP, fault="raise", at_call=40), config)
    with pytest.raises(ConfigError, match=r"lr_schedule: checkpoint 'cosine', this fit "
                                          r"'linear'"):
        fit(data, FaultyMLP, replace(config, lr_schedule="linear"), resume_from=folder)
    with pytest.raises(ConfigError, match=r"lr_schedule: checkpoint 'cosine', this fit "
                                          r"'sha256:[0-9a-f]{64}'"):
        fit(data, FaultyMLP, replace(config, lr_schedule=halving_every_3_steps,
                                     warmup_steps=0), resume_from=folder)
    with pytest.raises(ConfigError, match=r"schedule_steps: checkpoint \d+, this fit \d+"):
        fit(data, FaultyMLP, replace(config, epochs=5), resume_from=folder)  # decays anew
    resumed = fit(data, FaultyMLP, config, resume_from=folder)
    assert same_parameters(resumed.model, fit(data, FaultyMLP, CONTROLLED).model)


def overfitting_data(spark, rows: int, seed: int):
    """Labels that are pure noise: any fit overfits, and its eval loss soon rises."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 5)).astype(np.float32)
    y = rng.integers(0, 3, rows)
    return spark.createDataFrame(pd.DataFrame({"features": [r.tolist() for r in x],
                                               "label": y}))


def wide() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(5, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 3))


def eval_loss(model, df) -> tuple[float, float]:
    """The model's loss on `df` computed here, and how far a fit's evaluation of it may lie
    from that (`rounding.evaluation_here`)."""
    rows = df.toPandas()
    loss, apart, _, _ = evaluation_here(
        model, torch.tensor(np.stack(rows["features"]), dtype=torch.float32),
        torch.tensor(rows["label"]))
    return loss, apart


def test_early_stopping_stops_and_returns_the_best_evaluation(spark, mlflow_client):
    train, test = overfitting_data(spark, 40, 1), overfitting_data(spark, 200, 2)
    config = TrainConfig(num_workers=2, epochs=60, batch_size=10, averaging_frequency=2,
                         optimizer="adam", lr=0.01, log_model=False,
                         experiment_name="controls", early_stopping=EarlyStopping(patience=2))
    result = fit(train, wide, config, eval_df=test)
    rounds = 60 * 2 // 2
    assert len(result.history) < rounds  # stopped early
    losses = [h["eval_loss"] for h in result.history if "eval_loss" in h]
    best = int(np.argmin(losses))
    assert len(losses) - 1 - best == 2  # two evaluations without improvement, then stop
    loss, apart = eval_loss(result.model, test)
    assert abs(loss - losses[best]) <= apart
    assert loss < losses[-1] - apart  # not the last parameters
    run = mlflow_client.get_run(result.run_id)
    assert run.data.tags["sparkdl_avg.stopped_by"] == "early_stopping"
    assert "did not improve" in run.data.tags["sparkdl_avg.stop_reason"]
    assert run.data.metrics["best_eval_loss"] == pytest.approx(losses[best])


def test_async_early_stopping_stops_the_workers_and_keeps_the_best_server_parameters(
        spark, mlflow_client):
    train, test = overfitting_data(spark, 40, 1), overfitting_data(spark, 200, 2)
    config = TrainConfig(mode="async", num_workers=2, epochs=400, batch_size=10,
                         optimizer="adam", lr=0.01, lr_schedule="linear",
                         eval_interval_s=0.3, log_model=False, experiment_name="controls",
                         early_stopping=EarlyStopping(patience=2))
    result = fit(train, partial(_slow_wide), config, eval_df=test)
    # the workers' newest pushes' mean rate, by interval (a worker joining late raises it)
    lrs = [h["lr"] for h in result.history if "lr" in h]
    assert len(lrs) >= 3 and lrs[-1] < lrs[0] < 0.01
    run = mlflow_client.get_run(result.run_id)
    assert run.data.tags["sparkdl_avg.stopped_by"] == "early_stopping"
    assert run.data.metrics["updates_applied"] < 2 * 400 * 2  # fewer than all the steps
    loss, apart = eval_loss(result.model, test)
    assert abs(loss - run.data.metrics["best_eval_loss"]) <= apart


def _slow_wide() -> torch.nn.Module:
    return _Slow()


class _Slow(torch.nn.Module):
    """`wide`, a little slower a step, so the server evaluates many times."""

    def __init__(self) -> None:
        super().__init__()
        self.net = wide()

    def forward(self, x):
        import time

        if self.training:
            time.sleep(0.002)
        return self.net(x)


def test_fp16_on_a_task_without_cuda_is_a_final_error(data, mlflow_client):
    with pytest.raises(ConfigError, match=r"partition \d failed: precision='fp16' needs CUDA") \
            as info:
        fit(data, FaultyMLP, replace(CONTROLLED, precision="fp16", checkpoint_every=0))
    assert "failed 1 time" not in str(info.value)  # not retried
    assert latest_run(mlflow_client, "controls").info.status == "FAILED"


class RecordsAutocast(FaultyMLP):
    """Leaves a file in `folder` naming the autocast state each training forward ran in."""

    def __init__(self, folder: str) -> None:
        super().__init__()
        self.folder = folder

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import os

        if self.training:
            kind = x.device.type  # torch >= 2.4 asks which device's autocast
            state = f"{torch.is_autocast_enabled(kind)}-{torch.get_autocast_dtype(kind)}"
            os.close(os.open(os.path.join(self.folder, state), os.O_CREAT))
        return super().forward(x)


def test_bf16_autocast_trains_a_float32_model(data, tmp_path):
    """Every training step runs under bfloat16 autocast (a fit that ignored `precision`
    would train as well), while the parameters stay float32."""
    result = fit(data, partial(RecordsAutocast, str(tmp_path)),
                 replace(CONTROLLED, precision="bf16", epochs=4), eval_df=data)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["True-torch.bfloat16"]
    assert next(result.model.parameters()).dtype == torch.float32  # parameters keep theirs
    assert result.history[-1]["eval_accuracy"] > 0.6


@pytest.mark.parametrize(("fields", "message"), [
    ({"lr_schedule": "step"}, r"lr_schedule='step' is not supported"),
    ({"warmup_steps": -1}, r"warmup_steps must be at least 0"),
    ({"grad_accumulation": 0}, r"grad_accumulation must be at least 1"),
    ({"grad_clip_norm": 0.0}, r"grad_clip_norm must be positive"),
    ({"grad_clip_norm": -1.0}, r"grad_clip_norm must be positive"),
    ({"precision": "fp8"}, r"precision='fp8' is not supported"),
    ({"precision": "fp16", "device": "cpu"}, r"precision='fp16' needs CUDA"),
    ({"lr_schedule": halving_every_3_steps, "warmup_steps": 2}, r"built-in schedules only"),
    ({"early_stopping": "yes"}, r"early_stopping must be an EarlyStopping"),
])
def test_bad_controls_are_config_errors_naming_the_setting(fields, message):
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**fields)


def test_bad_early_stopping_settings_are_config_errors():
    with pytest.raises(ConfigError, match=r"metric='val_acc'\) is not a metric the fit logs"):
        EarlyStopping(metric="val_acc")
    with pytest.raises(ConfigError, match=r"use mode='max'"):
        EarlyStopping(metric="eval_accuracy")
    with pytest.raises(ConfigError, match=r"patience must be at least 1"):
        EarlyStopping(patience=0)


def test_plan_checks_refuse_before_training(data, mlflow_client):
    with pytest.raises(ConfigError, match="early_stopping needs eval_df.*restore_best"):
        fit(data, FaultyMLP, replace(CONTROLLED, early_stopping=EarlyStopping()))
    assert latest_run(mlflow_client, "controls").info.status == "FAILED"
    with pytest.raises(ConfigError, match=r"warmup_steps=500 is longer than training \(\d+ "):
        fit(data, FaultyMLP, replace(CONTROLLED, warmup_steps=500))
    with pytest.raises(ConfigError, match=r"averaging_warmup_steps=500 is longer than "
                                          r"training \(\d+ optimizer steps\): every round"):
        fit(data, FaultyMLP, replace(CONTROLLED, averaging_warmup_steps=500))
    assert latest_run(mlflow_client, "controls").info.status == "FAILED"
    with pytest.raises(ConfigError, match=r"metric='eval_accuracy'\) needs a classifier"):
        fit(data, FaultyMLP, replace(CONTROLLED, early_stopping=EarlyStopping(
            metric="eval_accuracy", mode="max")), eval_df=data, loss="mse")


def test_on_round_stops_a_sync_fit_at_the_round_it_says(data, mlflow_client):
    seen = []

    def stop_at_2(metrics: dict) -> bool:
        seen.append(metrics["round"])
        assert "train_loss" in metrics and "lr" in metrics
        return metrics["round"] == 2  # rounds done: no eval_df, so no round 0

    result = fit(data, FaultyMLP, replace(CONTROLLED, checkpoint_every=0), on_round=stop_at_2)
    assert [h["round"] for h in result.history] == [1, 2] and seen == [1, 2]
    run = mlflow_client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["sparkdl_avg.stopped_by"] == "on_round"
    assert run.data.tags["sparkdl_avg.stopped_at_round"] == "2"


def test_an_on_round_that_raises_fails_the_fit(data, mlflow_client):
    def broken(metrics: dict) -> bool:
        raise KeyError("val_loss")

    with pytest.raises(TrainingError, match=r"on_round raised at round 1: KeyError"):
        fit(data, FaultyMLP, CONTROLLED, on_round=broken)
    assert latest_run(mlflow_client, "controls").info.status == "FAILED"


def test_on_round_stops_an_async_fit_once_an_interval(data, mlflow_client):
    calls = []
    config = TrainConfig(mode="async", num_workers=2, epochs=200, batch_size=10,
                         eval_interval_s=0.3, log_model=False, experiment_name="controls")
    result = fit(data, _slow_wide_data, config,
                 on_round=lambda m: calls.append(m["round"]) or len(calls) == 3)
    run = mlflow_client.get_run(result.run_id)
    assert run.data.tags["sparkdl_avg.stopped_by"] == "on_round"
    assert run.info.status == "FINISHED"
    assert run.data.metrics["updates_applied"] < 2 * 200 * 6  # stopped before the end


def _slow_wide_data() -> torch.nn.Module:
    return _SlowFaulty()


class _SlowFaulty(FaultyMLP):
    def forward(self, x):
        import time

        if self.training:
            time.sleep(0.002)
        return super().forward(x)


def test_on_round_takes_numpy_booleans_and_refuses_other_answers():
    from sparkdl_avg.driver.early_stop import Stopping

    stopping = Stopping(None, lambda m: np.float64(m["train_loss"]) < 1.0)
    assert not stopping.ask({"round": 0, "train_loss": 2.0}, None)
    assert stopping.ask({"round": 1, "train_loss": 0.5}, None)  # np.True_
    assert stopping.stopped_by == "on_round"
    with pytest.raises(TrainingError, match="must return True, False or None, got str"):
        Stopping(None, lambda m: "stop").ask({"round": 0}, None)


def test_a_decided_stop_travels_in_checkpoints(tmp_path):
    from sparkdl_avg.driver.checkpoints import Checkpoint, read_folder, write_folder
    from sparkdl_avg.driver.early_stop import Stopping

    decided = Stopping(None, lambda m: m["round"] == 3)
    decided.ask({"round": 3}, np.ones(2))
    point = Checkpoint(round=4, steps=8, params=np.ones(2, np.float32), states=None,
                       fingerprint={}, history=[{"round": 3}], stop=decided.state())
    write_folder(point, tmp_path / "c")
    resumed = Stopping(None, None)
    read = read_folder(tmp_path / "c")
    resumed.take_up(read.stop, read.history, read.params)
    assert (resumed.stopped_by, resumed.stopped_at["round"]) == ("on_round", 3)
    assert resumed.result().tolist() == [1.0, 1.0]  # the stopping round's parameters


def test_a_schedule_that_is_not_step_driven_is_refused_before_any_job(data, mlflow_client):
    def plateau(optimizer):
        return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)

    with pytest.raises(ConfigError, match="returned ReduceLROnPlateau"):
        fit(data, FaultyMLP, replace(CONTROLLED, lr_schedule=plateau, warmup_steps=0))
    assert latest_run(mlflow_client, "controls").info.status == "FAILED"
