"""End-to-end synchronous fits on a local[2] session, checked against independent computations."""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd
import pytest
import torch
from rounding import forward_tolerance, near_ties, within

from sparkdl_avg import TrainConfig, fit

pytestmark = pytest.mark.spark

N_FEATURES, N_CLASSES = 6, 3


def make_model_f64() -> torch.nn.Module:
    torch.manual_seed(123)  # the reference builds the very same initial weights
    return torch.nn.Sequential(
        torch.nn.Linear(N_FEATURES, 16), torch.nn.Tanh(), torch.nn.Linear(16, N_CLASSES)
    ).double()


def make_model_f32() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(N_FEATURES, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(32, N_CLASSES),
    )


def make_data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, N_FEATURES))
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5).astype(np.int64)
    return x, y


def frame(spark, x, y):
    return spark.createDataFrame(pd.DataFrame({"features": [row.tolist() for row in x],
                                               "label": y}))


def padded_epoch(rows: int, workers: int) -> list[int]:
    """The global order of an unshuffled epoch as `workers` workers pad it: worker w's
    position p is row p * workers + w, and a partition one row short fills its last position
    with its first row (as torch's DistributedSampler pads)."""
    length = -(-rows // workers)
    return [g if g < rows else g % workers for g in range(length * workers)]


def reference_large_batch_sgd(x, y, global_batch, epochs, lr, momentum,
                              workers: int = 1) -> torch.nn.Module:
    """Single-process SGD over the rows in DataFrame order (padded for `workers`), one global
    batch per step."""
    model = make_model_f64()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
    order = padded_epoch(len(x), workers)
    xt, yt = torch.from_numpy(x[order]), torch.from_numpy(y[order])
    for _ in range(epochs):
        for start in range(0, len(order), global_batch):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(xt[start:start + global_batch]),
                                                     yt[start:start + global_batch])
            loss.backward()
            opt.step()
    return model


def max_param_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((pa - pb).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters(),
                                                                  strict=True))


def sync_and_lockstep(spark, rows: int, epochs: int, **async_fields):
    """The models of a sync fit averaging every 5 steps and of an async one in lockstep
    (staleness_bound=0, a push every 5 steps), on the same float64 data and settings."""
    df = frame(spark, *make_data(rows))
    common = {"num_workers": 2, "epochs": epochs, "batch_size": 4, "optimizer": "sgd",
              "lr": 0.05, "momentum": 0.9, "shuffle": False, "seed": 2, "log_model": False}
    sync = fit(df, make_model_f64, TrainConfig(averaging_frequency=5, **common))
    lockstep = fit(df, make_model_f64, TrainConfig(
        mode="async", push_every=5, staleness_bound=0, **async_fields, **common))
    return sync.model, lockstep.model


@pytest.mark.parametrize(("momentum", "rows", "shared_memory"),
                         [(0.0, 411, True), (0.9, 400, False)])
@pytest.mark.core
@pytest.mark.exact
def test_averaging_every_step_equals_large_batch_sgd(spark, caplog, momentum, rows,
                                                     shared_memory):
    # Plain SGD on 411 rows: shards of 206 and 205 rows (the short one pads its epoch with its
    # first row) and a partial last batch. Momentum on equal shards (400 rows), where the
    # equivalence holds without averaging the momentum buffers. >= 200 steps either way.
    # The workers share the driver's host: the parameters move through shared memory, or
    # (shared_memory=False) over loopback TCP, as between hosts.
    x, y = make_data(rows)
    cfg = TrainConfig(num_workers=2, epochs=4, batch_size=4, averaging_frequency=1,
                      optimizer="sgd", lr=0.05, momentum=momentum, shuffle=False, seed=7,
                      log_model=False, shared_memory=shared_memory)
    with caplog.at_level(logging.INFO, logger="sparkdl_avg"):
        result = fit(frame(spark, x, y), make_model_f64, cfg)
    shared = [r.getMessage() for r in caplog.records if "shared memory" in r.getMessage()]
    assert len(shared) == (4 if shared_memory else 0), shared  # pushes, averages: 2 workers
    reference = reference_large_batch_sgd(x, y, global_batch=8, epochs=4, lr=0.05,
                                          momentum=momentum, workers=2)
    assert len(result.history) == 4 * -(-rows // 8)
    assert max_param_diff(result.model, reference) < 1e-10
    # and it really trained: the parameters moved far from their initial values
    assert max_param_diff(result.model, make_model_f64()) > 1e-2


@pytest.mark.exact
def test_averaging_optimizer_state_keeps_momentum_equivalence(spark):
    # With the momentum buffers averaged (sample-weighted), momentum SGD matches the large
    # batch even on unequal shards with a partial last batch.
    x, y = make_data(411)
    cfg = TrainConfig(num_workers=2, epochs=4, batch_size=4, averaging_frequency=1,
                      optimizer="sgd", lr=0.05, momentum=0.9, shuffle=False,
                      average_optimizer_state=True, log_model=False)
    result = fit(frame(spark, x, y), make_model_f64, cfg)
    reference = reference_large_batch_sgd(x, y, 8, 4, 0.05, 0.9, workers=2)
    assert max_param_diff(result.model, reference) < 1e-10


def test_adamw_is_torchs_adamw_with_its_weight_decay(spark):
    """optimizer="adamw" on one worker averaging every step is torch's AdamW stepped by hand
    over the same batches: decoupled weight decay, not Adam's L2 (which moves the weights
    orders of magnitude more differently than the tolerance)."""
    x, y = make_data(64, seed=5)
    cfg = TrainConfig(num_workers=1, epochs=2, batch_size=8, averaging_frequency=1,
                      optimizer="adamw", lr=0.01, weight_decay=0.5, shuffle=False,
                      log_model=False)
    result = fit(frame(spark, x, y), make_model_f64, cfg)

    def by_hand(kind) -> torch.nn.Module:
        model = make_model_f64()
        opt = kind(model.parameters(), lr=0.01, weight_decay=0.5)
        xt, yt = torch.from_numpy(x), torch.from_numpy(y)
        for _ in range(2):
            for start in range(0, 64, 8):
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(xt[start:start + 8]),
                                                  yt[start:start + 8]).backward()
                opt.step()
        return model

    # float64, 16 steps: the fit's fused kernel and the reference's loop round differently,
    # by ulps of the ~1e-2 steps: far below 1e-10
    assert max_param_diff(result.model, by_hand(torch.optim.AdamW)) < 1e-10
    assert max_param_diff(result.model, by_hand(torch.optim.Adam)) > 1e-4


def test_same_seed_gives_bit_identical_parameters(spark):
    x, y = make_data(600, seed=1)
    df = frame(spark, x.astype(np.float32), y)
    cfg = TrainConfig(num_workers=2, epochs=2, batch_size=16, averaging_frequency=3,
                      optimizer="adam", lr=1e-2, seed=3, log_model=False)
    a = fit(df, make_model_f32, cfg)
    b = fit(df, make_model_f32, cfg)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)
    c = fit(df, make_model_f32, TrainConfig(**{**_fields(cfg), "seed": 4}))
    assert any(not torch.equal(pa, pc) for pa, pc in zip(a.model.parameters(),
                                                         c.model.parameters(), strict=True))


def _fields(cfg: TrainConfig) -> dict:
    import dataclasses

    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def test_fit_learns_and_logs_everything_to_mlflow(spark, mlflow_client):
    import mlflow

    x, y = make_data(2000, seed=2)
    train, test = frame(spark, x[:1600].astype(np.float32), y[:1600]), \
        frame(spark, x[1600:].astype(np.float32), y[1600:])
    cfg = TrainConfig(num_workers=2, epochs=4, batch_size=32, averaging_frequency=5,
                      optimizer="adam", lr=1e-2, average_optimizer_state=True,
                      experiment_name="sparkdl-avg-tests", run_name="learns")
    result = fit(train, make_model_f32, cfg, eval_df=test)

    assert result.history[-1]["eval_accuracy"] > 0.9
    assert result.history[-1]["train_loss"] < result.history[1]["train_loss"]
    assert "train_loss" not in result.history[0]  # round 0: evaluated before training
    assert {w["partition"] for w in result.workers} == {0, 1}
    assert [w["train_rows"] for w in result.workers] == [800, 800]
    assert [w["eval_rows"] for w in result.workers] == [200, 200]

    run = mlflow_client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["num_workers"] == "2"
    assert run.data.params["averaging_frequency"] == "5"
    assert run.data.params["optimizer"] == "adam"
    for key in ("train_loss", "samples_per_s", "time_compute_s", "time_communication_s",
                "time_averaging_s", "replica_divergence"):
        series = mlflow_client.get_metric_history(result.run_id, key)
        assert [m.step for m in sorted(series, key=lambda m: m.step)] == list(
            range(1, len(result.history))), key
    # before training (round 0), then once an epoch by default: 25 steps an epoch, 5 rounds
    # of 5 steps
    for key in ("eval_loss", "eval_accuracy"):
        series = mlflow_client.get_metric_history(result.run_id, key)
        assert sorted(m.step for m in series) == [0, 5, 10, 15, 20], key
    divergence = [h["replica_divergence"] for h in result.history[1:]]  # trained rounds
    assert all(d > 0 for d in divergence)  # replicas do drift apart within a round
    # what each task's data cost (a small partition: kept in memory under "auto")
    for w in result.workers:
        p = w["partition"]
        assert w["cache"] == "memory" and w["spilled_mb"] == 0
        assert run.data.tags[f"worker.{p}.data_cache"] == "memory"
        assert run.data.metrics[f"worker_{p}_peak_rss_mb"] == w["peak_rss_mb"] > 100
        assert run.data.metrics[f"worker_{p}_load_mb_s"] == w["load_mb_s"] > 0
    assert run.data.metrics["peak_rss_mb_max"] == max(w["peak_rss_mb"] for w in result.workers)

    # The logged model predicts like the returned one.
    loaded = mlflow.pyfunc.load_model(f"runs:/{result.run_id}/model")
    batch = torch.from_numpy(x[1600:1632].astype(np.float32))
    expected = result.model.eval()(batch).detach().numpy()
    assert within(loaded.predict(batch.numpy(), params={"output": "raw"}), expected,
                  forward_tolerance(result.model, batch))  # the exported program's kernels

    # And the final accuracy is what an independent evaluation of result.model says (up to
    # rows whose two largest logits the tasks' chunks may round the other way: none here).
    held_out = torch.from_numpy(x[1600:].astype(np.float32))
    with torch.no_grad():
        logits = result.model(held_out)
    ties = near_ties(logits, forward_tolerance(result.model, held_out))
    assert abs(result.history[-1]["eval_accuracy"] -
               (logits.argmax(1).numpy() == y[1600:]).mean()) <= ties / 400 + 1e-12


@pytest.mark.exact
def test_feature_columns_of_every_supported_kind_give_the_same_model(spark):
    from pyspark.ml.linalg import Vectors

    x, y = make_data(300, seed=5)
    cfg = TrainConfig(num_workers=2, epochs=1, batch_size=10, averaging_frequency=2,
                      shuffle=False, log_model=False)
    as_array = frame(spark, x, y)
    as_vector = spark.createDataFrame(
        [(Vectors.dense(row.tolist()), int(label)) for row, label in zip(x, y, strict=True)],
        ["features", "label"],
    )
    columns = [f"f{i}" for i in range(N_FEATURES)]
    as_columns = spark.createDataFrame(pd.DataFrame(x, columns=columns).assign(label=y))
    models = [
        fit(as_array, make_model_f64, cfg).model,
        fit(as_vector, make_model_f64, cfg).model,
        fit(as_columns, make_model_f64, cfg, features_col=columns).model,
    ]
    for other in models[1:]:
        assert max_param_diff(models[0], other) < 1e-12


def test_mse_regression_with_float_labels(spark):
    rng = np.random.default_rng(9)
    x = rng.normal(size=(400, N_FEATURES)).astype(np.float32)
    y = (x @ np.arange(1, N_FEATURES + 1)).astype(np.float32)
    df = spark.createDataFrame(pd.DataFrame({"features": list(x), "target": y}))
    cfg = TrainConfig(num_workers=2, epochs=30, batch_size=20, averaging_frequency=4,
                      optimizer="adam", lr=0.05, log_model=False)
    result = fit(df, lambda: torch.nn.Linear(N_FEATURES, 1), cfg, label_col="target",
                 loss="mse", eval_df=df)
    assert result.history[-1]["eval_loss"] < 0.05 * float(np.var(y))
    assert "eval_accuracy" not in result.history[-1]  # no accuracy for a regressor


def sgd_factory(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def my_cross_entropy(outputs, labels):
    return torch.nn.functional.cross_entropy(outputs, labels)


@pytest.mark.exact
def test_user_optimizer_and_loss_callables_match_the_built_ins(spark):
    x, y = make_data(200, seed=4)
    df = frame(spark, x, y)
    common = {"num_workers": 2, "epochs": 2, "batch_size": 8, "averaging_frequency": 2,
              "seed": 1, "log_model": False}
    builtin = fit(df, make_model_f64, TrainConfig(optimizer="sgd", lr=0.05, momentum=0.9,
                                                  **common))
    custom = fit(df, make_model_f64, TrainConfig(optimizer=sgd_factory, **common),
                 loss=my_cross_entropy)
    for a, b in zip(builtin.model.parameters(), custom.model.parameters(), strict=True):
        assert torch.equal(a, b)


def make_batchnorm_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(N_FEATURES, 8), torch.nn.BatchNorm1d(8),
                               torch.nn.ReLU(), torch.nn.Linear(8, N_CLASSES))


@pytest.mark.parametrize("checkpoint_every", [0, 3])
def test_the_result_carries_the_replicas_integer_buffers(spark, checkpoint_every):
    """BatchNorm's num_batches_tracked is never averaged; the result takes worker 0's (every
    replica took the same steps), whether or not checkpoints carried it along."""
    x, y = make_data(240, seed=12)
    cfg = TrainConfig(num_workers=2, epochs=3, batch_size=10, averaging_frequency=4,
                      checkpoint_every=checkpoint_every, log_model=False)
    result = fit(frame(spark, x.astype(np.float32), y), make_batchnorm_model, cfg)
    steps = 3 * (120 // 10)
    assert int(result.model[1].num_batches_tracked) == steps
    assert result.history[-1]["round"] == -(-steps // 4)  # rounds done


class ChecksDeterminism(torch.nn.Module):
    """Raises in a task's training step unless torch's deterministic mode is as expected."""

    def __init__(self, expected: bool) -> None:
        super().__init__()
        self.expected = expected
        self.lin = torch.nn.Linear(N_FEATURES, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.are_deterministic_algorithms_enabled() != self.expected:
            raise ValueError(f"deterministic mode is {not self.expected}")
        return self.lin(x.float())


def test_deterministic_mode_is_set_in_each_task_and_reset_after(spark):
    x, y = make_data(200, seed=1)
    df = frame(spark, x, y)
    base = dict(num_workers=2, epochs=1, batch_size=20, max_failures=0, log_model=False)
    fit(df, lambda: ChecksDeterminism(True), TrainConfig(**base, deterministic=True))
    # the same (reused) Python workers: the last fit's mode must not leak
    fit(df, lambda: ChecksDeterminism(False), TrainConfig(**base))
    assert not torch.are_deterministic_algorithms_enabled()  # the driver's is untouched


def model_where_fused_adam_fails() -> torch.nn.Module:
    """In a Spark task, the next fused Adam built fails as it does where torch lacks the
    kernel (once: it puts Adam back as it was, so the worker stays as it found it)."""
    from pyspark import TaskContext

    if TaskContext.get() is not None:
        adam = torch.optim.Adam
        original = adam.__init__

        def once(self, params, *args, fused=None, **kwargs):
            adam.__init__ = original
            if fused:
                raise RuntimeError("fused=True is not supported here")
            original(self, params, *args, fused=fused, **kwargs)

        adam.__init__ = once
    return make_model_f32()


def test_a_fallback_from_fused_adam_reaches_the_driver(spark, caplog, mlflow_client):
    import logging

    x, y = make_data(64)
    config = TrainConfig(num_workers=2, epochs=1, batch_size=8, optimizer="adam",
                         log_model=False, experiment_name="fused-fallback")
    with caplog.at_level(logging.WARNING, logger="sparkdl_avg"):
        result = fit(frame(spark, x.astype(np.float32), y), model_where_fused_adam_fails,
                     config)
    for worker in result.workers:
        assert "fused Adam is unavailable for torch.float32 parameters on cpu" in \
            worker["warning"]
        assert f"partition {worker['partition']}: fused Adam is unavailable" in caplog.text
    tags = mlflow_client.get_run(result.run_id).data.tags
    assert "the per-tensor Adam trains instead" in tags["worker.0.warning"]
