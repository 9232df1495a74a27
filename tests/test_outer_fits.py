"""Sync fits with an outer optimizer, an averaging warm-up and compressed deltas, against
independent computations: DiLoCo's Nesterov against torch's own on the full-batch gradient,
SGD with lr 1 against plain averaging, the collective transport against the driver's,
restarts and resumes against unbroken fits."""

from __future__ import annotations

import dataclasses
from functools import partial

import numpy as np
import pytest
import torch
from faulty import FaultyMLP, dataset, latest_run, same_parameters
from test_fit_sync import N_CLASSES, N_FEATURES, frame, make_model_f64, max_param_diff

from sparkdl_avg import ConfigError, TrainConfig, fit
from sparkdl_avg.averaging.compression import encoded_nbytes

pytestmark = pytest.mark.spark

BASE = dict(num_workers=2, epochs=2, batch_size=15, averaging_frequency=2, optimizer="adam",
            lr=0.01, seed=5, checkpoint_every=3, log_model=False, experiment_name="outer")
LOCAL_SGD = dict(outer_optimizer="nesterov", delta_compression="int4",
                 averaging_warmup_steps=3)


def sgd_lr_one(params):
    """An outer optimizer that steps G onto the average: plain averaging, written out."""
    return torch.optim.SGD(params, lr=1.0)


@pytest.fixture(scope="module")
def data(spark):
    return dataset(spark).cache()


def full_batch_nesterov(x, y, inner_lr: float, steps: int) -> torch.nn.Module:
    """One model, full-batch gradient descent: torch's SGD(lr=0.7, momentum=0.9,
    nesterov=True) stepped on inner_lr x the mean gradient over every row."""
    model = make_model_f64()
    opt = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xt), yt).backward()
        for p in model.parameters():
            p.grad.mul_(inner_lr)
        opt.step()
    return model


@pytest.mark.exact
@pytest.mark.parametrize("transport", ["driver", "collective"])
def test_nesterov_averaging_every_step_is_full_batch_nesterov(spark, transport):
    """Each worker's shard is exactly one batch, so every step's average is one step of
    full-batch SGD at any order: G - average = lr x the full-batch gradient, and the outer
    Nesterov steps on it are torch's own, to 1e-10 in float64 (30 steps)."""
    rng = np.random.default_rng(4)
    x = rng.normal(size=(32, N_FEATURES))
    y = rng.integers(0, N_CLASSES, size=32)
    config = TrainConfig(num_workers=2, epochs=30, batch_size=16, averaging_frequency=1,
                         optimizer="sgd", lr=0.1, outer_optimizer="nesterov", seed=3,
                         transport=transport, log_model=False, experiment_name="outer")
    result = fit(frame(spark, x, y), make_model_f64, config)
    reference = full_batch_nesterov(x, y, inner_lr=0.1, steps=30)
    assert max_param_diff(result.model, reference) < 1e-10
    assert max_param_diff(result.model, make_model_f64()) > 1e-2  # it trained
    # and the plain average would have landed elsewhere
    plain = fit(frame(spark, x, y), make_model_f64,
                dataclasses.replace(config, outer_optimizer="average"))
    assert max_param_diff(plain.model, reference) > 1e-3


@pytest.mark.exact
def test_an_outer_sgd_with_lr_one_is_bit_identical_to_plain_averaging(data):
    plain = fit(data, FaultyMLP, TrainConfig(**BASE))
    written_out = fit(data, FaultyMLP, TrainConfig(**BASE, outer_optimizer=sgd_lr_one))
    assert same_parameters(plain.model, written_out.model)
    assert [h["train_loss"] for h in plain.history] == \
        [h["train_loss"] for h in written_out.history]


@pytest.mark.exact
def test_the_collective_transport_computes_what_the_driver_computes(data):
    """Outer Nesterov on int4 deltas after a warm-up: each task's own copy of the round's
    arithmetic ends where the driver's does, bit for bit; only the wire differs."""
    by_driver = fit(data, FaultyMLP, TrainConfig(**BASE, **LOCAL_SGD))
    by_tasks = fit(data, FaultyMLP, TrainConfig(**BASE, **LOCAL_SGD, transport="collective"))
    assert same_parameters(by_driver.model, by_tasks.model)
    assert [h["train_loss"] for h in by_driver.history] == \
        [h["train_loss"] for h in by_tasks.history]
    numel = sum(p.numel() for p in FaultyMLP().parameters())
    payload = encoded_nbytes("int4", numel) / 1e6
    # 2 workers: each pushes its delta and gets the update (driver), or sends its delta to
    # the other (an all-gather of 2)
    assert [h["wire_mb"] for h in by_driver.history] == \
        pytest.approx([4 * payload] * len(by_driver.history))
    assert [h["wire_mb"] for h in by_tasks.history] == \
        pytest.approx([2 * payload] * len(by_tasks.history))


@pytest.mark.exact
@pytest.mark.parametrize("transport", ["driver", "collective"])
def test_a_restart_with_outer_state_and_residuals_is_bit_identical(data, tmp_path, transport):
    """A task fails in round 4; the fit takes up the checkpoint of round 3: the outer
    momentum, the update's residual and each worker's residual come back with it, so the
    result is an unbroken fit's to the bit."""
    config = TrainConfig(**BASE, **LOCAL_SGD, transport=transport)
    straight = fit(data, FaultyMLP, config)
    faulty = partial(FaultyMLP, fault="raise", marker=str(tmp_path / "fired"), at_call=11)
    restarted = fit(data, faulty, config)
    assert (tmp_path / "fired").exists() and len(restarted.failures) == 1
    assert restarted.failures[0]["restart_at"] == "round 6"  # warm-up 3, then checkpoints
    assert same_parameters(restarted.model, straight.model)


def test_resume_takes_up_the_outer_state_and_refuses_another_outer_optimizer(data, tmp_path):
    folder = str(tmp_path / "ckpt")
    # a warm-up of 4 steps: the first fit's 20 steps end with a whole round of 2
    first = {**BASE, **LOCAL_SGD, "averaging_warmup_steps": 4, "epochs": 1,
             "checkpoint_dir": folder}
    fit(data, FaultyMLP, TrainConfig(**first))
    longer = {**first, "epochs": 2}
    with pytest.raises(ConfigError, match="outer_optimizer: checkpoint 'nesterov', this "
                                          "fit 'momentum'"):
        fit(data, FaultyMLP, TrainConfig(**{**longer, "outer_optimizer": "momentum"}),
            resume_from=folder)
    with pytest.raises(ConfigError, match="delta_compression: checkpoint 'int4', this fit"):
        fit(data, FaultyMLP, TrainConfig(**{**longer, "delta_compression": "int8"}),
            resume_from=folder)
    resumed = fit(data, FaultyMLP, TrainConfig(**longer), resume_from=folder)
    straight = fit(data, FaultyMLP, TrainConfig(**{**longer, "checkpoint_dir": None}))
    assert same_parameters(resumed.model, straight.model)


def test_rounds_log_the_wire_the_outer_step_and_the_warm_up(data, mlflow_client):
    config = TrainConfig(**{**BASE, "checkpoint_every": 0}, outer_optimizer="nesterov",
                         averaging_warmup_steps=5)
    result = fit(data, FaultyMLP, config)
    # 20 steps an epoch, 2 epochs: 5 rounds of one step, then 18 of 2, the last of 1
    assert len(result.history) == 5 + 18
    warm, after = result.history[:5], result.history[5:]
    assert all("outer_update_norm" not in h for h in warm)
    assert all(h["outer_update_norm"] > 0 for h in after)
    numel = sum(p.numel() for p in FaultyMLP().parameters())
    assert [h["wire_mb"] for h in result.history] == \
        pytest.approx([2 * 2 * 4 * numel / 1e6] * len(result.history))
    run = mlflow_client.get_run(result.run_id)
    params = run.data.params
    assert (params["outer_optimizer"], params["outer_lr"], params["outer_momentum"]) == \
        ("nesterov", "0.7", "0.9")
    assert params["averaging_warmup_steps"] == "5"
    history = mlflow_client.get_metric_history(result.run_id, "outer_update_norm")
    assert sorted(m.step for m in history) == list(range(6, 24))  # rounds done
    assert len(mlflow_client.get_metric_history(result.run_id, "wire_mb")) == 23


def test_compressing_a_float64_model_is_refused_before_any_spark_job(spark, mlflow_client,
                                                                     monkeypatch):
    from sparkdl_avg.driver import plan

    def no_cluster(*args, **kwargs):
        raise AssertionError("a Spark job ran")

    monkeypatch.setattr(plan, "check_cluster", no_cluster)
    rng = np.random.default_rng(0)
    df = frame(spark, rng.normal(size=(40, N_FEATURES)), rng.integers(0, N_CLASSES, 40))
    with pytest.raises(ConfigError, match="delta_compression='int8' with a float64 model"):
        fit(df, make_model_f64, TrainConfig(delta_compression="int8", log_model=False,
                                            experiment_name="outer-refused"))
    with pytest.raises(ConfigError, match="outer_optimizer must return a torch.optim"):
        fit(df, make_model_f64, TrainConfig(outer_optimizer=lambda p: None, log_model=False,
                                            experiment_name="outer-refused"))
    assert latest_run(mlflow_client, "outer-refused").info.status == "FAILED"


@pytest.mark.exact
@pytest.mark.parametrize("fields", [
    {"outer_optimizer": "nesterov", "overlap_averaging": True,
     "average_optimizer_state": True},
    {"delta_compression": "int8", "outer_optimizer": "momentum", "overlap_averaging": True},
], ids=["outer+overlap+state", "int8+outer+overlap"])
# outer_momentum 0.5: DiLoCo's 0.9 (tuned for hundreds of inner steps a round) multiplies a
# steady pseudo-gradient by lr / (1 - momentum) = 7 and, at 2 steps a round with a round's
# delay, overshoots here: the loss fell to 0.40 by round 11, then climbed to 0.96-1.35 (0.5:
# 1.085 to 0.53-0.54, as plain overlapped averaging's 0.57)
def test_outer_steps_and_compression_compose_with_overlap_and_optimizer_state(data, fields):
    """The outer step covers the trainable parameters while Adam's moments ride along
    plainly averaged, and an overlapped round takes the outer step's result (x - sent +
    G_new): both transports compute it to the same bits, and the fit trains."""
    fields = {**fields, "outer_momentum": 0.5}
    by_driver = fit(data, FaultyMLP, TrainConfig(**BASE, **fields))
    by_tasks = fit(data, FaultyMLP, TrainConfig(**BASE, **fields, transport="collective"))
    assert same_parameters(by_driver.model, by_tasks.model)
    losses = [h["train_loss"] for h in by_driver.history]
    assert losses[-1] < 0.8 * losses[0]
