"""Scoring DataFrames on the executors with a trained model: `transform`, `predict_udf` (also
from SQL) and the logged model through `mlflow.pyfunc.spark_udf`, each checked against the
model run locally."""

from __future__ import annotations

import threading

import numpy as np
import pandas as pd
import pytest
import torch
from pyspark.ml.linalg import Vectors
from rounding import classes_agree, forward_tolerance

from sparkdl_avg import DataError, TrainConfig, fit

pytestmark = pytest.mark.spark

CONFIG = TrainConfig(num_workers=2, epochs=2, batch_size=16, optimizer="adam", lr=0.01,
                     experiment_name="inference")


def data(rows: int = 300):
    rng = np.random.default_rng(4)
    x = rng.normal(size=(rows, 3)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int64) + (x[:, 2] > 0.5).astype(np.int64)
    return x, y


EXPORTS: list[str] = []
"""The thread of each torch.export call while `classifier` fitted."""


@pytest.fixture(scope="module")
def classifier(spark):
    x, y = data()
    df = spark.createDataFrame(pd.DataFrame({"features": list(x), "label": y}))
    export = torch.export.export
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.export, "export", lambda *a, **k: EXPORTS.append(
            threading.current_thread().name) or export(*a, **k))
        return fit(df, lambda: torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.ReLU(),
                                                   torch.nn.Linear(16, 3)), CONFIG)


def test_the_model_is_traced_while_the_fit_trains_not_after(classifier):
    """The logged model's export is the one made before training (`tracking/model_ahead`),
    with the trained values put in (the next test scores it): nothing is traced on the
    fit's own thread once it has trained."""
    assert "sparkdl-avg-model-ahead" in EXPORTS
    assert set(EXPORTS) <= {"sparkdl-avg-model-ahead", "sparkdl-avg-warm-up"}


def classes_as_local(model, x: np.ndarray, predicted) -> bool:
    """Whether `predicted` are the classes of `x` by the model run here, a row whose two
    largest logits lie within rounding of each other counting either (Spark scores other
    chunks, which may round otherwise: `rounding.classes_agree`)."""
    xt = torch.from_numpy(x)
    with torch.no_grad():
        logits = model(xt)
    return len(predicted) == len(x) and \
        classes_agree(predicted, logits, forward_tolerance(model, xt))


@pytest.mark.exact
def test_transform_adds_the_class_index_computed_on_the_executors(spark, classifier):
    x, _ = data(200)
    df = spark.createDataFrame(pd.DataFrame({"id": range(200), "features": list(x)}))
    out = classifier.transform(df).orderBy("id").toPandas()
    assert list(out.columns) == ["id", "features", "prediction"]
    assert classes_as_local(classifier.model, x, out["prediction"].tolist())


@pytest.mark.exact
def test_predict_udf_in_select_and_sql_and_on_other_feature_kinds(spark, classifier):
    x, _ = data(50)
    def scored_alike(predicted) -> bool:
        return classes_as_local(classifier.model, x, predicted)

    vectors = spark.createDataFrame([(i, Vectors.dense(r.tolist())) for i, r in enumerate(x)],
                                    ["id", "v"])
    got = classifier.transform(vectors, features_col="v", output_col="cls")
    assert scored_alike([r.cls for r in got.orderBy("id").collect()])
    columns = spark.createDataFrame(pd.DataFrame({"id": range(50), "a": x[:, 0],
                                                  "b": x[:, 1], "c": x[:, 2]}))
    got = classifier.transform(columns, features_col=["a", "b", "c"])
    assert scored_alike([r.prediction for r in got.orderBy("id").collect()])
    spark.udf.register("predict_cls", classifier.predict_udf())
    spark.createDataFrame(pd.DataFrame({"id": range(50), "features": list(x)})) \
        .createOrReplaceTempView("to_score")
    rows = spark.sql("SELECT id, predict_cls(features) AS p FROM to_score ORDER BY id").collect()
    assert scored_alike([r.p for r in rows])


@pytest.mark.exact
def test_a_regressor_predicts_values_and_several_outputs_arrays(spark):
    x, _ = data()
    y = x[:, 0] * 2.0 - x[:, 1]
    df = spark.createDataFrame(pd.DataFrame({"features": list(x), "label": y}))
    result = fit(df, lambda: torch.nn.Linear(3, 1), CONFIG, loss="mse")
    out = result.transform(df.limit(20)).toPandas()
    features = torch.from_numpy(np.stack(out["features"]).astype(np.float32))
    with torch.no_grad():
        local = result.model(features).reshape(-1).numpy()
    apart = forward_tolerance(torch.nn.Sequential(result.model), features).reshape(-1)
    assert np.all(np.abs(out["prediction"].to_numpy() - local) <= apart.numpy())
    result.model = torch.nn.Linear(3, 2)  # two outputs: an array per row
    two = result.transform(df.limit(5)).toPandas()
    assert [len(p) for p in two["prediction"]] == [2] * 5


def test_transform_refuses_bad_input_before_running(spark, classifier):
    df = spark.createDataFrame(pd.DataFrame({"features": [[0.0, 1.0, 2.0]], "prediction": [1]}))
    with pytest.raises(DataError, match="already has a column 'prediction'"):
        classifier.transform(df)
    with pytest.raises(DataError, match="no column 'feature'"):
        classifier.transform(df, features_col="feature", output_col="p")
    holes = spark.createDataFrame(pd.DataFrame({"a": [1.0, None], "b": [2.0, 3.0],
                                                "c": [0.0, 1.0]}))
    with pytest.raises(Exception, match=r"DataError: column \['a', 'b', 'c'\] \(input "
                                        r"'features'\) holds nulls"):  # not a guessed class
        classifier.transform(holes, features_col=["a", "b", "c"]).collect()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_infinite_features_are_refused_not_scored(bad):
    """A classifier's argmax returns a class for NaN too: a batch holding NaN or an infinity
    is refused with a DataError naming the column, as training's validation refuses it."""
    import pyarrow as pa

    from sparkdl_avg._model import pickle_for_executors
    from sparkdl_avg.scoring.columns import vector_schema
    from sparkdl_avg.scoring.outputs import describe_outputs
    from sparkdl_avg.scoring.udf import _predict_batches

    model, schema = torch.nn.Linear(3, 2), vector_schema("x", 3, "float32")

    def score(rows):
        return list(_predict_batches(
            pickle_for_executors("model", model), iter([pa.array(rows)]), schema=schema,
            outputs=describe_outputs(model, schema, ("class",), ("prediction",)),
            device="cpu", batch_size=2))

    assert len(score([[0.0, 1.0, 2.0], [1.0, 0.5, 0.0]])[0]) == 2
    with pytest.raises(DataError, match=r"column 'x' \(input\) holds NaN or infinite values "
                                        r"in 1 of 3 rows"):
        score([[0.0, 1.0, 2.0], [1.0, bad, 0.0], [2.0, 0.0, 1.0]])


@pytest.mark.parametrize("how", ["transform", "predict_udf"])
def test_transform_and_predict_udf_refuse_nan_and_infinite_features(spark, classifier, how):
    """One row each of NaN, +inf and -inf: all three counted, in one Arrow batch."""
    bad = [float("nan"), float("inf"), float("-inf")]
    df = spark.createDataFrame([([0.0, 1.0, 2.0],)] + [([1.0, b, 0.0],) for b in bad],
                               "x array<double>").coalesce(1)  # pandas would make NaN null
    with pytest.raises(Exception, match=r"DataError: column '(x|features)' \(input\) holds NaN "
                                        r"or infinite values in 3 of 4 rows"):
        if how == "transform":
            classifier.transform(df, features_col="x").collect()
        else:
            df.select(classifier.predict_udf()("x")).collect()


@pytest.mark.exact
def test_the_logged_model_scores_through_mlflow_spark_udf(spark, classifier):
    import mlflow

    x, _ = data(40)
    uri = f"runs:/{classifier.run_id}/model"
    udf = mlflow.pyfunc.spark_udf(spark, uri, result_type="long", env_manager="local")
    df = spark.createDataFrame(pd.DataFrame({"id": range(40), "features": list(x)}))
    rows = df.select("id", udf("features").alias("out")).orderBy("id").collect()
    assert classes_as_local(classifier.model, x, [r.out for r in rows])  # transform's output
    raw = mlflow.pyfunc.spark_udf(spark, uri, result_type="array<double>", env_manager="local",
                                  params={"output": "raw"})
    rows = df.select("id", raw("features").alias("out")).orderBy("id").collect()
    assert classes_as_local(classifier.model, x, [int(np.argmax(r.out)) for r in rows])


class RowsSeen(torch.nn.Module):
    """Trains as a linear model; in eval mode predicts how many rows its call was given."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            return self.lin(x)
        return torch.full((x.shape[0], 1), float(x.shape[0]), dtype=x.dtype) + 0 * self.lin(x)


@pytest.fixture(scope="module")
def rows_seen(spark):
    x, _ = data(100)
    frame = spark.createDataFrame(pd.DataFrame({"features": list(x), "label": 0.0}))
    train, test = frame.limit(50), frame.subtract(frame.limit(50))
    config = TrainConfig(num_workers=2, epochs=1, batch_size=4, eval_batch_size=7,
                         log_model=False, experiment_name="inference")
    return fit(train, RowsSeen, config, loss="mse", eval_df=test.coalesce(1))


def test_evaluation_runs_eval_batch_size_rows_at_a_time(rows_seen):
    # each worker's 25 evaluation rows go as 7 + 7 + 7 + 4: the loss of a row is its
    # chunk's size squared (label 0), so eval_loss tells the chunks apart
    assert rows_seen.history[-1]["eval_loss"] == pytest.approx(2 * (3 * 7**3 + 4**3) / 50)


def test_scoring_runs_eval_batch_size_rows_at_a_time_unless_told(spark, rows_seen):
    x, _ = data(30)
    df = spark.createDataFrame(pd.DataFrame({"features": list(x)})).coalesce(1)
    seen = [r["p"] for r in rows_seen.transform(df, output_col="p").collect()]
    assert sorted(seen) == [2.0] * 2 + [7.0] * 28  # one Arrow batch of 30: 7 x 4 + 2
    seen = [r["p"] for r in rows_seen.transform(df, output_col="p", batch_size=16).collect()]
    assert sorted(seen) == [14.0] * 14 + [16.0] * 16
