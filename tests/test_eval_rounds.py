"""Round 0 and evaluation metrics in real fits, both modes and both sync transports: round 0
is an evaluation of the initial parameters, equal to an eager evaluation of model_fn()'s
model on eval_df, logged at MLflow step 0 before any training; every evaluation's auc,
perplexity and custom metrics, computed by 2 workers over chunks of 16 rows, equal sklearn's
and an eager computation over all of eval_df at once."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score

from sparkdl_avg import EarlyStopping, Metric, TrainConfig, fit
from sparkdl_avg.driver.early_stop import Stopping
from sparkdl_avg.driver.sync import _Attempt

pytestmark = pytest.mark.spark

FEATURES = 6
# float32 logits, computed in chunks of 16 on the workers and at once here: each within a
# few float32 ulps of the other, and so is a mean of positive per-row losses
LOSS_REL = 16 * float(np.finfo(np.float32).eps)


def make_data(n: int, seed: int):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    y = (x[:, 0] + 0.5 * x[:, 1] + rng.normal(scale=0.7, size=n) > 0).astype(np.int64)
    return x, y


def frame(spark, x, y):
    return spark.createDataFrame(pd.DataFrame({"features": [r.tolist() for r in x],
                                               "label": y}))


def one_logit() -> torch.nn.Module:
    torch.manual_seed(7)  # the eager reference builds the same initial weights
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 1))


def two_classes() -> torch.nn.Module:
    torch.manual_seed(8)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 2))


def logits_of(model, x) -> np.ndarray:
    with torch.no_grad():
        return model.eval()(torch.from_numpy(x)).double().numpy()


def auc_close(got: float, scores: np.ndarray, y: np.ndarray) -> None:
    """sklearn's auc of `scores`, allowing the pairs whose scores are so close that float32
    rounding on the workers could order them the other way."""
    pos, neg = scores[y == 1], scores[y == 0]
    close = np.abs(pos[:, None] - neg[None, :]) <= 1e-5 * (1 + np.abs(pos[:, None]))
    assert got == pytest.approx(roc_auc_score(y, scores),
                                abs=close.sum() / (len(pos) * len(neg)) + 1e-12)


def brier_sums(output, label, weights):
    return ((torch.sigmoid(output.reshape(-1)) - label.float()) ** 2).sum(), label.numel()


BRIER = Metric("brier", brier_sums)


def eager_binary(model, x, y) -> dict:
    logit = torch.from_numpy(logits_of(model, x)[:, 0]).float()
    label = torch.from_numpy(y).float()
    per_row = F.binary_cross_entropy_with_logits(logit, label, reduction="none").double()
    return {"eval_loss": float(per_row.mean()),
            "eval_accuracy": float(((logit > 0) == (label > 0.5)).double().mean()),
            "eval_brier": float(((torch.sigmoid(logit) - label) ** 2).double().mean()),
            "scores": logit.double().numpy()}


def test_sync_round_0_is_the_initial_model_and_metrics_are_exact(spark, mlflow_client):
    x, y = make_data(600, seed=1)
    xe, ye = make_data(150, seed=2)
    seen: list[int] = []
    cfg = TrainConfig(num_workers=2, epochs=2, batch_size=16, averaging_frequency=10,
                      eval_batch_size=16, eval_every=2, lr=0.2, log_model=False,
                      experiment_name="eval-rounds")
    result = fit(frame(spark, x, y), one_logit, cfg, loss="bce_with_logits",
                 eval_df=frame(spark, xe, ye), metrics=["auc", BRIER],
                 on_round=lambda row: seen.append(row["round"]))
    run = mlflow_client.get_run(result.run_id)
    rounds = int(run.data.params["num_rounds"])
    assert [h["round"] for h in result.history] == seen == list(range(rounds + 1))
    first, last = result.history[0], result.history[-1]
    assert set(first) == {"round", "eval_loss", "eval_accuracy", "eval_auc", "eval_brier",
                          "time_eval_s"}
    for row, model in ((first, one_logit()), (last, result.model)):
        eager = eager_binary(model, xe, ye)
        assert row["eval_loss"] == pytest.approx(eager["eval_loss"], rel=LOSS_REL)
        assert row["eval_brier"] == pytest.approx(eager["eval_brier"], rel=LOSS_REL)
        assert row["eval_accuracy"] == pytest.approx(eager["eval_accuracy"], abs=1 / 150)
        auc_close(row["eval_auc"], eager["scores"], ye)
    assert last["eval_auc"] > first["eval_auc"]
    evaluated = sorted({0, rounds} | set(range(2, rounds, 2)))  # every other round, the last
    for key in ("eval_loss", "eval_auc", "eval_brier"):
        steps = sorted(m.step for m in mlflow_client.get_metric_history(result.run_id, key))
        assert steps == evaluated, key
    train = mlflow_client.get_metric_history(result.run_id, "train_loss")
    assert sorted(m.step for m in train) == list(range(1, rounds + 1))
    assert run.data.params["metrics"] == "['auc', 'brier']"


def test_sync_collective_without_round_0_logs_auc_and_perplexity(spark, mlflow_client):
    x, y = make_data(400, seed=3)
    xe, ye = make_data(120, seed=4)
    cfg = TrainConfig(num_workers=2, epochs=1, batch_size=20, averaging_frequency=5,
                      eval_batch_size=16, lr=0.1, transport="collective",
                      eval_before_training=False, log_model=False)
    result = fit(frame(spark, x, y), two_classes, cfg, eval_df=frame(spark, xe, ye),
                 metrics=("auc", "perplexity"))
    assert [h["round"] for h in result.history] == [1, 2]  # no round 0
    assert "train_loss" in result.history[0]
    assert min(m.step for m in mlflow_client.get_metric_history(result.run_id,
                                                                 "eval_auc")) == 2
    logits = logits_of(result.model, xe)
    eager = F.cross_entropy(torch.from_numpy(logits).float(), torch.from_numpy(ye))
    last = result.history[-1]
    assert last["eval_perplexity"] == pytest.approx(math.exp(float(eager)),
                                                    rel=LOSS_REL * max(1.0, float(eager)))
    auc_close(last["eval_auc"], logits[:, 1] - logits[:, 0], ye)


def test_async_round_0_and_metrics_through_a_sharded_server(spark, mlflow_client):
    x, y = make_data(600, seed=5)
    xe, ye = make_data(150, seed=6)

    def wrong(output, label, weights):  # a plain callable: sum(numerator) / sum(denominator)
        return (output.argmax(-1) != label).sum(), label.numel()

    cfg = TrainConfig(mode="async", ps_shards=2, num_workers=2, epochs=2, batch_size=16,
                      push_every=4, lr=0.2, eval_batch_size=16, eval_interval_s=0.5,
                      log_model=False)
    result = fit(frame(spark, x, y), two_classes, cfg, eval_df=frame(spark, xe, ye),
                 metrics=["auc", "perplexity", wrong])
    first, last = result.history[0], result.history[-1]
    assert first["round"] == 0 and "train_loss" not in first and "interval" not in first
    for row, model in ((first, two_classes()), (last, result.model)):
        logits = logits_of(model, xe)
        eager = float(F.cross_entropy(torch.from_numpy(logits).float(), torch.from_numpy(ye)))
        assert row["eval_loss"] == pytest.approx(eager, rel=LOSS_REL)
        assert row["eval_perplexity"] == pytest.approx(math.exp(eager),
                                                       rel=LOSS_REL * max(1.0, eager))
        assert row["eval_wrong"] == pytest.approx(1 - row["eval_accuracy"], abs=1e-12)
        auc_close(row["eval_auc"], logits[:, 1] - logits[:, 0], ye)
    steps = [m.step for m in mlflow_client.get_metric_history(result.run_id, "eval_auc")]
    assert min(steps) == 0 and len(steps) >= 2


def _attempt(point_round: int, history: list[dict], rule=None):
    """A sync attempt's round-0 logic alone, around a fake plan."""
    attempt = SimpleNamespace(
        point=SimpleNamespace(round=point_round, params=np.zeros(3)), history=history,
        plan=SimpleNamespace(config=TrainConfig(), data=SimpleNamespace(eval_sizes=[5, 5]),
                             objective=SimpleNamespace(metrics=())),
        run_logger=SimpleNamespace(log_metrics=lambda metrics, step: None),
        progress=SimpleNamespace(first=lambda metrics: None),
        stopper=Stopping(rule), stop_round=None)
    return attempt


def test_round_0_is_evaluated_once_a_fit_and_never_on_resume():
    assert _Attempt._evaluates_first(_attempt(0, []))
    assert not _Attempt._evaluates_first(_attempt(0, [{"round": 0}]))  # a restarted attempt
    assert not _Attempt._evaluates_first(_attempt(3, [{"round": 0}, {"round": 3}]))  # resumed
    off = _attempt(0, [])
    off.plan.config = TrainConfig(eval_before_training=False)
    assert not _Attempt._evaluates_first(off)


def test_early_stopping_can_keep_the_start_when_training_only_hurts():
    attempt = _attempt(0, [], EarlyStopping(patience=1))
    sums = {"loss_sum": 1.0, "loss_weight": 2.0, "correct": None, "scored": None, "count": 2,
            "eval_s": 0.1}
    _Attempt._log_first(attempt, sums)
    assert attempt.history == [{"round": 0, "eval_loss": 0.5, "time_eval_s": 0.1}]
    worse = {"round": 1, "eval_loss": 0.9}
    attempt.history.append(worse)
    assert attempt.stopper.judge(attempt.history, worse, np.ones(3))
    assert attempt.stopper.result().tolist() == [0.0] * 3  # round 0's parameters
