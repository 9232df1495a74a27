"""Spark ML: the estimator in a Pipeline, saved and loaded, tuned by CrossValidator with
nested MLflow runs."""

from __future__ import annotations

import mlflow
import numpy as np
import pandas as pd
import pytest
import torch
from faulty import FaultyMLP
from rounding import classes_agree, forward_tolerance, sum_tolerance, unit_roundoff, within

from sparkdl_avg import ConfigError, TrainConfig, fit
from sparkdl_avg.ml import AveragingEstimator, AveragingModel

pytestmark = pytest.mark.spark
CONFIG = TrainConfig(num_workers=2, epochs=2, batch_size=16, averaging_frequency=2,
                     optimizer="adam", lr=0.01, log_model=False, experiment_name="ml")


@pytest.fixture(scope="module")
def columns(spark):
    """Five numeric columns and a label, as a pipeline starts from."""
    rng = np.random.default_rng(8)
    x = rng.normal(size=(160, 5))
    y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.3).astype(np.int64)
    frame = pd.DataFrame(x, columns=[f"c{i}" for i in range(5)])
    frame["label"] = y
    return spark.createDataFrame(frame).cache()


def pipeline(**params):
    from pyspark.ml import Pipeline
    from pyspark.ml.feature import VectorAssembler

    return Pipeline(stages=[
        VectorAssembler(inputCols=[f"c{i}" for i in range(5)], outputCol="features"),
        AveragingEstimator(model_fn=FaultyMLP, config=CONFIG, **params)])


@pytest.mark.core
def test_a_pipeline_fits_saves_loads_and_predicts_the_same(columns, tmp_path):
    from pyspark.ml import PipelineModel

    fitted = pipeline(lr=0.02, epochs=3).fit(columns)
    stage = fitted.stages[-1]
    assert isinstance(stage, AveragingModel)
    run = mlflow.get_run(stage.run_id)
    assert run.data.params["lr"] == "0.02" and run.data.params["epochs"] == "3"  # Params win
    before = fitted.transform(columns).select("prediction").toPandas()["prediction"]
    path = str(tmp_path / "pipeline")
    fitted.write().save(path)
    loaded = PipelineModel.load(path)
    after = loaded.transform(columns).select("prediction").toPandas()["prediction"]
    assert before.tolist() == after.tolist()
    assert sorted((tmp_path / "pipeline" / "stages").glob("*Averaging*/model/model.*"))
    accuracy = (after.to_numpy() == columns.toPandas()["label"].to_numpy()).mean()
    assert accuracy > 0.6


def test_cross_validation_over_lr_nests_every_fold_under_the_callers_run(columns):
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.feature import VectorAssembler
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

    assembled = VectorAssembler(inputCols=[f"c{i}" for i in range(5)],
                                outputCol="features").transform(columns)
    estimator = AveragingEstimator(model_fn=FaultyMLP, config=CONFIG)
    grid = ParamGridBuilder().addGrid(estimator.lr, [0.003, 0.03]).build()
    cv = CrossValidator(estimator=estimator, estimatorParamMaps=grid, numFolds=2,
                        evaluator=MulticlassClassificationEvaluator(metricName="accuracy"),
                        parallelism=1)
    mlflow.set_experiment("ml")
    with mlflow.start_run(run_name="tuning") as parent:
        best = cv.fit(assembled)
    children = mlflow.search_runs(
        experiment_names=["ml"], output_format="list",
        filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert len(children) == 2 * 2 + 1  # every fold of every lr, and the refit on all rows
    assert {c.data.params["lr"] for c in children} == {"0.003", "0.03"}
    assert all(c.info.status == "FINISHED" for c in children)
    assert len(best.avgMetrics) == 2 and isinstance(best.bestModel, AveragingModel)


def test_cross_validation_over_a_pipeline_nests_every_fold_under_the_callers_run(columns):
    """The guide's shape: CrossValidator over a Pipeline, whose own fitMultiple fits the
    estimator on CrossValidator's pool thread, where the caller's run is not active."""
    from pyspark.ml.evaluation import MulticlassClassificationEvaluator
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

    stages = pipeline(epochs=1)
    estimator = stages.getStages()[-1]
    grid = ParamGridBuilder().addGrid(estimator.lr, [0.03]).build()
    cv = CrossValidator(estimator=stages, estimatorParamMaps=grid, numFolds=2,
                        evaluator=MulticlassClassificationEvaluator(metricName="accuracy"))
    mlflow.set_experiment("ml")
    with mlflow.start_run(run_name="pipeline tuning") as parent:
        cv.fit(columns)
    children = mlflow.search_runs(
        experiment_names=["ml"], output_format="list",
        filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert len(children) == 2 + 1  # each fold, and the refit on all rows


def test_a_copy_carries_the_callers_run_to_other_threads_only_while_it_runs():
    import threading

    from sparkdl_avg.tracking.parent import inherited, named_parent

    estimator = AveragingEstimator(model_fn=FaultyMLP, config=CONFIG)
    seen = {}

    def elsewhere(copy, key):  # a pool thread: no active run of its own
        with inherited(copy._callers_run):
            seen[key] = named_parent()

    mlflow.set_experiment("ml")
    with mlflow.start_run() as parent:
        copy = estimator.copy()
        thread = threading.Thread(target=elsewhere, args=(copy, "while running"))
        thread.start()
        thread.join()
    elsewhere(copy, "after it ended")
    assert seen == {"while running": parent.info.run_id, "after it ended": None}
    assert estimator._callers_run is None  # the original was not copied under a run


def test_a_fit_inside_an_active_run_is_its_child_and_a_thread_may_name_the_parent(columns):
    import threading

    from sparkdl_avg.tracking.run import parent_run

    df = columns.selectExpr("array(c0, c1, c2, c3, c4) AS features", "label")
    config = TrainConfig(num_workers=2, epochs=1, batch_size=16, log_model=False)
    mlflow.set_experiment("ml")
    with mlflow.start_run() as parent:
        child = fit(df, FaultyMLP, config)
        seen = {}

        def elsewhere():  # another thread sees no active run, unless it is named
            with parent_run(parent.info.run_id):
                seen["id"] = fit(df, FaultyMLP, config).run_id

        thread = threading.Thread(target=elsewhere)
        thread.start()
        thread.join()
    for run_id in (child.run_id, seen["id"]):
        assert mlflow.get_run(run_id).data.tags["mlflow.parentRunId"] == parent.info.run_id


def test_an_estimator_without_a_model_fn_is_refused():
    with pytest.raises(ConfigError, match="needs model_fn"):
        AveragingEstimator(config=CONFIG)
    with pytest.raises(ConfigError, match="averaging_frequency=.*applies to mode='sync'"):
        AveragingEstimator(model_fn=FaultyMLP, config=TrainConfig(mode="async"),
                           averagingFrequency=4).train_config()
    assert torch.nn.Module  # the module imports torch lazily through fit


@pytest.mark.exact
def test_a_registered_fit_loads_from_the_registry_and_predicts_as_the_result(columns):
    df = columns.selectExpr("array(c0, c1, c2, c3, c4) AS features", "label")
    result = fit(df, FaultyMLP, TrainConfig(num_workers=2, epochs=1, batch_size=16,
                                            experiment_name="ml",
                                            registered_model_name="sparkdl-avg-test-model"),
                 eval_df=df)
    run = mlflow.get_run(result.run_id)
    assert run.info.status == "FINISHED"  # fit returned after logging and registering
    versions = mlflow.MlflowClient().search_model_versions("name='sparkdl-avg-test-model'")
    [version] = [v for v in versions if v.run_id == result.run_id]
    assert version.status == "READY"
    uri = f"models:/sparkdl-avg-test-model/{version.version}"
    assert mlflow.models.get_model_info(uri).signature is not None
    x = torch.from_numpy(np.random.default_rng(0).normal(size=(7, 5)).astype(np.float32))
    with torch.no_grad():
        expected = result.model.eval()(x).numpy()
    apart = forward_tolerance(result.model, x)  # the exported program's kernels against ours
    loaded = mlflow.pyfunc.load_model(uri)
    assert within(loaded.predict(x.numpy(), params={"output": "raw"}), expected, apart)
    assert classes_agree(loaded.predict(x.numpy()), expected, apart)  # transform's output


def test_runs_are_named_sourced_and_list_their_datasets(spark, columns, tmp_path):
    columns.selectExpr("array(c0, c1, c2, c3, c4) AS features", "label") \
        .write.parquet(str(tmp_path / "shapes"))
    df = spark.read.parquet(str(tmp_path / "shapes"))
    result = fit(df, FaultyMLP, CONFIG, eval_df=df.limit(40))
    run = mlflow.get_run(result.run_id)
    assert run.info.run_name == "sync-2w-k2"
    assert run.data.tags["mlflow.source.name"] and run.data.tags["mlflow.user"]
    inputs = {i.tags[0].value: i.dataset for i in run.inputs.dataset_inputs}
    assert set(inputs) == {"training", "evaluation"}
    assert inputs["training"].name == "shapes"
    assert '"num_rows": 160' in inputs["training"].profile
    assert '"num_rows": 40' in inputs["evaluation"].profile
    assert "features" in inputs["training"].schema


def linear_regressor() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(5, 1)


@pytest.mark.exact
def test_every_estimator_param_reaches_the_fit(spark, mlflow_client):
    """One fit, each Param checked by an effect that ignoring it would change: the config says
    1 worker, batches of 4, averaging every step, cross_entropy, columns features/label; the
    Params say otherwise, and the data has only the Params' columns."""
    rng = np.random.default_rng(1)
    x = rng.normal(size=(80, 5))
    y = x @ np.array([1.0, -2.0, 0.5, 0.0, 1.5])
    rows = pd.DataFrame({"feats": list(x), "target": y})
    train = spark.createDataFrame(rows[:60])
    held_out = spark.createDataFrame(rows[60:])
    config = TrainConfig(num_workers=1, epochs=1, batch_size=4, averaging_frequency=1,
                         optimizer="sgd", lr=0.05, shuffle=False, log_model=False,
                         experiment_name="ml")
    estimator = AveragingEstimator(
        model_fn=linear_regressor, config=config, loss="mse", eval_df=held_out,
        featuresCol="feats", labelCol="target", predictionCol="pred", numWorkers=2,
        batchSize=6, averagingFrequency=2, metrics=[abs_error])
    model = estimator.fit(train)
    run = mlflow_client.get_run(model.run_id)
    # 2 workers x 30 rows, 5 steps of 6 each, averaged every 2: 3 rounds (1 worker: 5 rounds;
    # batches of 4: 4 rounds; averaging every step: 5 rounds)
    assert len(mlflow_client.get_metric_history(model.run_id, "train_loss")) == 3
    assert sorted(k for k in run.data.tags if k.endswith(".device")) == \
        ["worker.0.device", "worker.1.device"]
    assert run.data.params["loss"] == "mse" and not model.classify
    # eval_df was evaluated, with the mean squared error, by the returned model
    features = torch.from_numpy(np.stack(rows["feats"][60:])).float()
    with torch.no_grad():
        out = model.torch_model(features).squeeze(1).double()
    # the tasks' float32 forward may round otherwise (other chunks, other kernels): each
    # output within `apart` of ours; the task then forms (out - y)^2 in float32 (y and the
    # difference rounded once each, the square once more) and sums in float64
    apart = forward_tolerance(torch.nn.Sequential(model.torch_model), features)
    apart = apart.squeeze(1).double().numpy()
    residual = np.abs(out.numpy() - y[60:])
    mse = float(np.mean(residual ** 2))
    u = unit_roundoff(torch.float32)
    off = apart + u * (np.abs(y[60:]) + residual)
    assert abs(run.data.metrics["eval_loss"] - mse) <= \
        np.mean(2 * residual * off + off ** 2 + u * residual ** 2) + \
        sum_tolerance(torch.float64, len(residual) + 1) * mse
    mae = float(np.mean(residual))
    # each |error| within off of ours (a float32 difference, rounded once), summed in float64
    assert abs(run.data.metrics["eval_abs_error"] - mae) <= \
        np.mean(off) + sum_tolerance(torch.float64, len(residual) + 1) * mae
    # and before training, at step 0 (round 0: eval_df given)
    assert min(m.step for m in mlflow_client.get_metric_history(model.run_id,
                                                                "eval_abs_error")) == 0
    scored = model.transform(held_out).toPandas()
    assert "prediction" not in scored.columns
    assert np.all(np.abs(scored["pred"].to_numpy() - out.numpy()) <= apart)


def abs_error(output, label, weights):  # fit(metrics=): sum |error| / rows
    return (output.squeeze(-1).double() - label).abs().sum(), label.numel()


def test_the_model_scores_eval_batch_size_rows_at_a_time_also_once_saved_and_loaded(
        spark, tmp_path):
    """RowsSeen predicts the size of the batch it was given: one Arrow batch of 30 rows goes
    as 7 x 4 + 2 under eval_batch_size=7 (8192 rows at once would give 30s)."""
    from test_inference import RowsSeen

    rng = np.random.default_rng(1)
    df = spark.createDataFrame(pd.DataFrame({"features": list(rng.normal(size=(30, 3))),
                                             "label": 0.0})).coalesce(1)
    config = TrainConfig(num_workers=2, epochs=1, batch_size=4, eval_batch_size=7,
                         log_model=False, experiment_name="ml")
    fitted = AveragingEstimator(model_fn=RowsSeen, config=config, loss="mse").fit(df)
    path = str(tmp_path / "model")
    fitted.write().save(path)
    for model in (fitted, AveragingModel.load(path)):
        seen = sorted(r.prediction for r in model.transform(df).collect())
        assert seen == [2.0] * 2 + [7.0] * 28
