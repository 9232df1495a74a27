"""Bad input fails fast, before any training task starts, with a typed error naming the problem;
the fit's MLflow run is left FAILED with that error."""

from __future__ import annotations

import dataclasses
import threading
import time

import mlflow
import numpy as np
import pandas as pd
import pytest
import torch

from sparkdl_avg import (
    ClusterError,
    ConfigError,
    DataError,
    ModelError,
    TrainConfig,
    TrainingError,
    fit,
)

pytestmark = pytest.mark.spark

CFG = TrainConfig(num_workers=2, epochs=1, batch_size=4, log_model=False,
                  experiment_name="bad-input")


def model() -> torch.nn.Module:
    return torch.nn.Linear(3, 2)


@pytest.fixture(scope="module")
def good(spark):
    rng = np.random.default_rng(0)
    pdf = pd.DataFrame({"features": list(rng.normal(size=(40, 3))),
                        "label": rng.integers(0, 2, 40), "name": ["x"] * 40})
    return spark.createDataFrame(pdf)


def last_run(client):
    exp = client.get_experiment_by_name("bad-input")
    return client.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])[0]


def assert_failed_run(client, fragment: str):
    run = last_run(client)
    assert run.info.status == "FAILED"
    assert fragment in run.data.tags["error"]


def test_misnamed_feature_column_is_named_with_a_suggestion(good, mlflow_client):
    with pytest.raises(DataError, match=r"no column 'feature'.*did you mean 'features'"):
        fit(good, model, CFG, features_col="feature")
    assert_failed_run(mlflow_client, "no column 'feature'")


def test_missing_label_column(good):
    with pytest.raises(DataError, match="no column 'target'"):
        fit(good, model, CFG, label_col="target")


def test_missing_column_in_eval_df(good):
    with pytest.raises(DataError, match="eval_df has no column 'label'"):
        fit(good, model, CFG, eval_df=good.drop("label"))


def test_unsupported_feature_type(good):
    with pytest.raises(DataError, match="column 'name' has type string"):
        fit(good, model, CFG, features_col="name")


def test_a_string_in_a_feature_list_says_what_to_do(good):
    with pytest.raises(DataError, match=r"feature column 'name' has type string, but the "
                                        r"columns of features_col are assembled into one "
                                        r"vector of numbers: turn it into numbers on the "
                                        r"Spark side first .*, or pass text as an input of its "
                                        r"own \(inputs=\) with fit\(preprocess=fn\).*, or "
                                        r"leave it out of the list"):
        fit(good, model, CFG, features_col=["label", "name"])


def test_unsupported_label_type(good):
    with pytest.raises(DataError, match="label column 'name' has type string"):
        fit(good, model, CFG, label_col="name")


@pytest.mark.parametrize(
    ("features", "label", "message"),
    [
        ([1.0, None, 2.0], 0, "features.*null"),
        ([1.0, float("nan"), 2.0], 0, "features.*NaN"),
        (None, 0, "features.*null"),
        ([1.0, float("inf"), 2.0], 0, "features.*infinite"),
        ([float("-inf"), 1.0, 2.0], 0, "features.*infinite"),
        ([1.0, 2.0, 3.0], None, "label.*null"),
    ],
)
def test_nulls_and_nans_are_refused(spark, features, label, message, mlflow_client):
    rows = [([0.0, 1.0, 2.0], 1)] * 20 + [(features, label)]
    df = spark.createDataFrame(rows, "features array<double>, label int")
    with pytest.raises(DataError, match=message):
        fit(df, model, CFG)
    assert_failed_run(mlflow_client, "DataError")


@pytest.mark.parametrize("element", ["float", "double"])
def test_the_bad_feature_check_agrees_with_numpy(spark, element):
    """The validation's one expression for null, NaN and infinite features (`array_contains`,
    which Spark compiles, in place of an interpreted lambda), against numpy row by row, in
    both precisions a fit casts features to."""
    from pyspark.sql import functions as F
    from pyspark.sql import types as T

    from sparkdl_avg.data.validate import bad_features

    nan, inf = float("nan"), float("inf")
    rows = [[1.0, 2.0], [nan, 1.0], [1.0, inf], [-inf, 0.0], [None, 1.0], None, [],
            [None, nan], [0.0, -0.0], [3.4e38, -3.4e38], [1e-45, 5e-324], [nan, nan, inf]]
    expected = [row is None or any(x is None or not np.isfinite(x) for x in row)
                for row in rows]
    element_type = T.FloatType() if element == "float" else T.DoubleType()
    df = spark.createDataFrame([(i, row) for i, row in enumerate(rows)],
                               "i int, features array<double>")
    cast = df.select("i", F.col("features").cast(T.ArrayType(element_type)).alias("features"))
    got = {r.i: r.bad for r in cast.select("i", bad_features(element_type).alias("bad"))
           .collect()}
    assert [got[i] for i in range(len(rows))] == expected


def test_nan_label(spark):
    rows = [([0.0, 1.0, 2.0], 1.0)] * 20 + [([0.0, 1.0, 2.0], float("nan"))]
    df = spark.createDataFrame(rows, "features array<double>, label double")
    with pytest.raises(DataError, match="label.*NaN"):
        fit(df, model, CFG, loss="mse")


def test_ragged_features_are_padded_not_refused(spark, mlflow_client):
    """Rows of 2 and 3 features: a ragged input (issue 29), padded per minibatch to its
    longest row, which the run reports as padding; arrays whose inner lengths vary are
    refused (tests/test_data_schema.py)."""
    rows = [([0.0, 1.0, 2.0], 1)] * 20 + [([0.0, 1.0], 0)] * 4
    df = spark.createDataFrame(rows, "features array<double>, label int")
    result = fit(df, model, CFG)
    padding = [w["pad_fraction"] for w in result.workers]
    assert all(p is not None for p in padding) and 0 < sum(padding) / 2 < 1 / 3
    padded = sum(w["pad_positions"] for w in result.workers)
    positions = sum(w["ragged_positions"] for w in result.workers)
    assert positions >= 24 * 2 and 0 < padded < positions  # every row, 2 or 3 wide
    metrics = mlflow_client.get_run(result.run_id).data.metrics
    assert metrics["pad_fraction"] == pytest.approx(padded / positions, rel=1e-12)


def test_labels_out_of_range_for_the_model(spark):
    rows = [([0.0, 1.0, 2.0], i % 5) for i in range(40)]
    df = spark.createDataFrame(rows, "features array<double>, label int")
    with pytest.raises(ModelError, match=r"^label column 'label': labels range from 0 to 4 "
                                         r"but the model outputs 2 classes"):
        fit(df, model, CFG)


def test_fractional_labels_with_cross_entropy(spark):
    rows = [([0.0, 1.0, 2.0], 0.5)] * 40
    df = spark.createDataFrame(rows, "features array<double>, label double")
    with pytest.raises(DataError, match="integer class labels"):
        fit(df, model, CFG)


def test_empty_dataframe(good):
    with pytest.raises(DataError, match="train_df is empty"):
        fit(good.limit(0), model, CFG)


def test_dataset_too_small_for_workers_and_batch(good):
    with pytest.raises(DataError, match=r"40 rows: 20 per worker, fewer than batch_size=32"):
        fit(good, model, TrainConfig(num_workers=2, batch_size=32, log_model=False))


def test_more_workers_than_slots_fails_in_seconds(good, mlflow_client):
    started = time.monotonic()
    with pytest.raises(ClusterError, match=r"num_workers=3 but the cluster runs only 2 tasks"):
        fit(good, model, TrainConfig(num_workers=3, batch_size=4, log_model=False,
                                     experiment_name="bad-input"))
    assert time.monotonic() - started < 30
    assert_failed_run(mlflow_client, "ClusterError")


def test_model_fn_that_fails_to_build(good):
    def broken() -> torch.nn.Module:
        raise RuntimeError("no such layer")

    with pytest.raises(ModelError, match="model_fn.. failed to build the model.*no such layer"):
        fit(good, broken, CFG)


def test_a_built_model_as_model_fn_is_refused_saying_what_to_pass(good):
    built = torch.nn.Sequential(torch.nn.Linear(4, 3))  # callable: its call is forward()
    with pytest.raises(ModelError, match=r"must be a zero-argument callable that builds the "
                                         r"model \(its class, or a function\), got a "
                                         r"Sequential object"):
        fit(good, built, CFG)


def test_model_fn_that_cannot_be_pickled(good):
    lock = threading.Lock()

    def captures_a_lock() -> torch.nn.Module:
        with lock:
            return torch.nn.Linear(3, 2)

    with pytest.raises(ModelError, match="model_fn cannot be pickled"):
        fit(good, captures_a_lock, CFG)


def test_model_that_does_not_accept_the_features(good):
    with pytest.raises(ModelError, match=r"forward failed.*3 features"):
        fit(good, lambda: torch.nn.Linear(7, 2), CFG)


def test_a_pure_float16_model_is_refused_before_training(good):
    """The message points to what the user wanted: training in float16, done right."""
    with pytest.raises(ModelError, match="parameters are float16.*Keep the parameters in float32 "
                                         r"in model_fn and set TrainConfig\(precision=\"fp16\"\)"):
        fit(good, lambda: torch.nn.Linear(3, 2).half(), CFG)


def test_more_shards_than_parameters_is_refused_before_any_spark_job(good, mlflow_client,
                                                                     monkeypatch):
    from sparkdl_avg.driver import plan

    def no_job(*_, **__):
        raise AssertionError("a Spark job ran before the shard check")

    monkeypatch.setattr(plan, "check_cluster", no_job)
    with pytest.raises(ConfigError, match="ps_shards=5 needs a model of at least 5 parameters "
                       r"\(this one has 4\)"):
        fit(good, lambda: torch.nn.Linear(3, 1),
            dataclasses.replace(CFG, mode="async", ps_shards=5))
    assert_failed_run(mlflow_client, "ps_shards=5")


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"metrics": ["auc"], "loss": "mse"}, r"auc.*binary classifier.*loss='mse'"),
    ({"metrics": ["f1"]}, "'f1' is not a known metric; use one of 'auc', 'perplexity'"),
    ({"metrics": ["perplexity"], "eval_df": None}, "give fit an eval_df"),
])
def test_bad_metrics_are_refused_before_any_spark_job(good, mlflow_client, monkeypatch,
                                                      kwargs, message):
    from sparkdl_avg.driver import plan

    def no_job(*_, **__):
        raise AssertionError("a Spark job ran before the metrics' check")

    monkeypatch.setattr(plan, "check_cluster", no_job)
    with pytest.raises(ConfigError, match=message):
        fit(good, model, CFG, **{"eval_df": good, **kwargs})
    assert_failed_run(mlflow_client, "ConfigError")


def test_a_metric_that_cannot_score_the_model_fails_its_probe(good):
    with pytest.raises(ModelError, match=r"auc.*the model outputs \(2, 5\)"):
        fit(good, lambda: torch.nn.Linear(3, 5), CFG, eval_df=good, metrics=["auc"])


def test_not_a_dataframe(mlflow_client):
    with pytest.raises(DataError, match="train_df must be a pyspark DataFrame, got DataFrame"):
        fit(pd.DataFrame({"features": [[1.0]], "label": [0]}), model, CFG)
    assert_failed_run(mlflow_client, "DataError: train_df must be a pyspark DataFrame")


def test_a_config_that_is_no_train_config(good, mlflow_client):
    # no TrainConfig, no experiment name: the run goes to MLflow's active experiment
    mlflow.set_experiment("bad-input")
    with pytest.raises(ConfigError, match="config must be a TrainConfig, got str"):
        fit(good, model, config="oops")
    assert_failed_run(mlflow_client, "ConfigError: config must be a TrainConfig, got str")


def test_unknown_loss(good):
    with pytest.raises(ConfigError, match="loss='hinge'"):
        fit(good, model, CFG, loss="hinge")


def test_error_on_an_executor_fails_the_fit_and_names_the_worker(good, mlflow_client):
    class Exploding(torch.nn.Linear):
        def forward(self, x):
            if self.training:
                raise ValueError("boom in forward")
            return super().forward(x)

    with pytest.raises(TrainingError, match=r"max_failures=0.*partition \d on executor driver "
                       r"\(host .*\): ValueError: boom in forward"):
        fit(good, lambda: Exploding(3, 2), dataclasses.replace(CFG, max_failures=0))
    assert_failed_run(mlflow_client, "boom in forward")


def test_diverging_training_stops_with_a_clear_error(good, mlflow_client):
    cfg = TrainConfig(num_workers=2, batch_size=4, epochs=3, averaging_frequency=1,
                      optimizer="sgd", lr=1e30, log_model=False, experiment_name="bad-input")
    with pytest.raises(TrainingError, match=r"NaN/Inf parameters in round \d+.*diverged"):
        fit(good, lambda: torch.nn.Linear(3, 1), cfg, loss="mse")  # squares explode
    assert_failed_run(mlflow_client, "diverged")


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    ({"features_col": "name"}, DataError, "column 'name' has type string"),
    ({"inputs": ["features"], "features_col": "name"}, ConfigError, "either inputs= or"),
    ({"inputs": {"x": "features"}, "weight_col": "name"}, DataError,
     "weight column 'name' has type string"),
    ({"label_col": ["label", "label"]}, ConfigError, "loss lists|one loss per label"),
    ({"loss": "mse", "loss_weights": [-1.0]}, ConfigError, "loss_weights"),
    ({"loss": ["cross_entropy", "mse"]}, ConfigError, "2 losses for 1 output"),
])
def test_typed_arguments_are_refused_before_training_with_a_failed_run(
        good, kwargs, error, message, mlflow_client):
    with pytest.raises(error, match=message):
        fit(good, model, CFG, **kwargs)
    assert_failed_run(mlflow_client, error.__name__)
