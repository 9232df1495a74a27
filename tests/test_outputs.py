"""Tensors out: every output shape and kind as scored by `transform`, `predict_udf`, the Spark ML
model and the MLflow model, each against the model run by hand. No fit: the results are built
from a torch model and a hand-made DataSchema, as a fit would return them."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch
from rounding import (
    classes_agree,
    linear_magnitude,
    outputs_tolerance,
    probabilities_tolerance,
    signs_agree,
    within,
)

from sparkdl_avg import ConfigError, DataError, ModelError
from sparkdl_avg._fit import FitResult
from sparkdl_avg.data.probe_batch import probe_batch
from sparkdl_avg.data.schema import DataSchema, FieldSpec
from sparkdl_avg.scoring import columns as cols
from sparkdl_avg.scoring.outputs import describe_outputs, output_heads
from sparkdl_avg.scoring.udf import Scorer


def field(name, dtype, shape, role="input", wire=None, source=""):
    return FieldSpec(role=role, name=name, column=name, wire=wire or f"_{name}", dtype=dtype,
                     shape=tuple(shape), source=source)


def schema(*inputs, binding="keyword", labels=()):
    return DataSchema(inputs=tuple(inputs), binding=binding, labels=tuple(labels),
                      label_list=len(labels) > 1)


class Recommender(torch.nn.Module):
    """user id (int scalar) + dense features -> 3 class logits."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.users, self.out = torch.nn.Embedding(10, 4), torch.nn.Linear(7, 3)

    def forward(self, user, dense):
        return self.out(torch.cat([self.users(user), dense], 1))


class Tagger(torch.nn.Module):
    """Token ids [B, T] -> per-token logits [B, T, 3]; pads (0) give logits of 0, whatever
    the padded length."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.emb, self.out = torch.nn.Embedding(10, 4, padding_idx=0), torch.nn.Linear(4, 3)

    def forward(self, tokens):
        return self.out(self.emb(tokens)) * (tokens != 0)[..., None]


class TwoHeads(torch.nn.Module):
    """A value [B, 1] and 4 labels' logits [B, 4] from one vector."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.value, self.labels = torch.nn.Linear(5, 1), torch.nn.Linear(5, 4)

    def forward(self, x):
        return self.value(x), self.labels(x)


# How far the model run here and the model scored (in other chunks, maybe on other kernels)
# may lie apart, per output: each a Linear layer over embedded rows and features
# (`rounding.outputs_tolerance`; an embedding is an exact lookup).

def rec_tolerance(model: Recommender, user, dense) -> torch.Tensor:
    with torch.no_grad():
        terms = torch.cat([model.users(torch.as_tensor(user).long()).abs(),
                           torch.as_tensor(dense).abs()], 1)
    return outputs_tolerance(torch.float32, 8, linear_magnitude(model.out, terms))


def tag_tolerance(model: Tagger, tokens) -> torch.Tensor:
    with torch.no_grad():
        terms = model.emb(torch.as_tensor(tokens).long()).abs()
    return outputs_tolerance(torch.float32, 5, linear_magnitude(model.out, terms))


def two_tolerance(model: TwoHeads, x) -> tuple[torch.Tensor, torch.Tensor]:
    terms = torch.as_tensor(x).abs()
    return (outputs_tolerance(torch.float32, 6, linear_magnitude(model.value, terms)),
            outputs_tolerance(torch.float32, 6, linear_magnitude(model.labels, terms)))


REC = schema(field("user", "int32", (), source="int"),
             field("dense", "float32", (3,), source="array<float>"))
TAG = schema(field("tokens", "int32", (-1,)), binding="single")
TWO = schema(field("x", "float32", (5,)), binding="single",
             labels=[field("price", "float32", (), "label"), field("tags", "int64", (4,), "label")])
TOKENS = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 1, 2]]


def score(model, data_schema, heads, mode, arrays, batch_size=2):
    outputs = describe_outputs(model.eval(), data_schema.without_targets(), heads, (mode,))
    scorer = Scorer(model, data_schema.without_targets(), outputs, torch.device("cpu"),
                    batch_size)
    return outputs, scorer.score(cols.read_arrow(arrays, data_schema.without_targets()))


def test_probe_batch_holds_each_fields_dtype_shape_and_range():
    s = schema(field("ids", "int32", (-1, 2)), field("img", "float32", (1, 2, 2)),
               field("flag", "bool", ()))
    batch = probe_batch(s, torch.float64, low={"_ids": 3}, high={"_ids": 9},
                        lengths={"_ids": 5})
    ids, img, flag = batch.inputs
    assert ids.shape == (2, 5, 2) and ids.dtype == torch.int64
    assert ids[0].unique().tolist() == [3] and ids[1].unique().tolist() == [9]
    assert img.shape == (2, 1, 2, 2) and img.dtype == torch.float64 and not img.any()
    assert flag.dtype == torch.bool and batch.labels == () and batch.weights is None


@pytest.mark.exact
def test_a_per_token_classifier_gives_each_row_its_tokens_classes_whatever_the_batching():
    arrays = [pa.array(TOKENS, pa.list_(pa.int32()))]
    model = Tagger().eval()
    with torch.no_grad():  # row by row: no padding at all
        logits = [model(torch.tensor([row]))[0] for row in TOKENS]
    outputs, got = score(model, TAG, ("class",), "prediction", arrays, batch_size=3)
    assert outputs.spark_type().simpleString() == "array<bigint>"
    assert all(len(g) == len(row) and classes_agree(g, lg, tag_tolerance(model, [row])[0])
               for g, lg, row in zip(got.to_pylist(), logits, TOKENS, strict=True))
    outputs, got = score(model, TAG, ("class",), "probability", arrays, batch_size=1)
    assert outputs.spark_type().simpleString() == "array<array<double>>"
    for row, lg in zip(got.to_pylist(), logits, strict=True):  # batches of 1: the same calls
        np.testing.assert_allclose(row, torch.softmax(lg.double(), -1).numpy(), rtol=1e-12)


class TokenValues(torch.nn.Module):
    """A value a token: [B, T]."""

    def forward(self, tokens):
        return tokens.double() * 0.5


def test_a_per_token_value_of_rows_one_token_long_stays_a_list_per_row():
    arrays = [pa.array([[4], [2], [6, 8]], pa.list_(pa.int32()))]
    outputs, got = score(TokenValues(), TAG, ("value",), "prediction", arrays, batch_size=2)
    assert outputs.spark_type().simpleString() == "array<double>"
    assert got.to_pylist() == [[2.0], [1.0], [3.0, 4.0]]  # the first chunk: rows of 1 token


class PerTagValue(torch.nn.Module):
    """A value for each position of its second input: [B, T_tags]."""

    def forward(self, tokens, tags):
        return tags.double() * 10


def test_a_per_token_output_is_cut_to_the_rows_of_the_input_it_follows():
    """Not the first ragged input's: the probe lengthens each alone to tell which."""
    two = schema(field("tokens", "int32", (-1,)), field("tags", "int32", (-1,)),
                 binding="positional")
    ragged = pa.list_(pa.int32())
    for tokens, tags in (([[1, 2], [3]], [[1, 2, 3], [4, 5, 6]]),
                         ([[1, 2, 3, 4, 5], [3]], [[1, 2], [4]])):
        _, got = score(PerTagValue(), two, ("value",), "prediction",
                       [pa.array(tokens, ragged), pa.array(tags, ragged)], batch_size=8)
        assert got.to_pylist() == [[10.0 * t for t in row] for row in tags]


class MaskedValues(torch.nn.Module):
    """Ids and their mask, which must share a length (as a tokenizer's do)."""

    def forward(self, tokens, mask):
        return tokens.double() * mask  # fails unless both are [B, T] alike


def test_inputs_that_must_share_a_length_are_still_probed_and_cut_together():
    """Lengthening one ragged input alone fails such a model: the probe takes the outputs
    as following the first, and scores as before."""
    two = schema(field("tokens", "int32", (-1,)), field("mask", "int32", (-1,)),
                 binding="positional")
    ragged = pa.list_(pa.int32())
    tokens, mask = [[1, 2, 3], [4]], [[1, 1, 0], [1]]
    outputs, got = score(MaskedValues(), two, ("value",), "prediction",
                         [pa.array(tokens, ragged), pa.array(mask, ragged)], batch_size=8)
    assert outputs.specs[0][0].cut_to == 0
    assert got.to_pylist() == [[1.0, 2.0, 0.0], [4.0]]


class Truncates(torch.nn.Module):
    def forward(self, tokens):
        return tokens[:, :4].double()  # per token, up to 4 of them


def test_a_per_token_output_shorter_than_its_input_is_a_model_error_naming_both():
    arrays = [pa.array([[1, 2, 3, 4, 5, 6], [7]], pa.list_(pa.int32()))]
    with pytest.raises(ModelError, match=r"output 'output_0' follows the length of input "
                                         r"'tokens', but has 4 positions where a row of it "
                                         r"has 6"):
        score(Truncates(), TAG, ("value",), "prediction", arrays, batch_size=8)
    _, got = score(Truncates(), TAG, ("value",), "prediction",  # rows it keeps whole
                   [pa.array([[1, 2, 3], [7]], pa.list_(pa.int32()))], batch_size=8)
    assert got.to_pylist() == [[1.0, 2.0, 3.0], [7.0]]


@pytest.mark.parametrize(("mode", "expected_type"), [
    ("prediction", "struct<price:double,tags:array<bigint>>"),
    ("probability", "struct<price:double,tags:array<double>>"),
    ("raw", "struct<price:double,tags:array<double>>")])
@pytest.mark.exact
def test_two_outputs_are_a_struct_named_after_the_label_columns(mode, expected_type):
    x = np.random.default_rng(0).normal(size=(5, 5)).astype(np.float32)
    model = TwoHeads().eval()
    heads = output_heads(["mse", "bce_with_logits"])
    assert heads == ("value", "multilabel")
    outputs = describe_outputs(model, TWO.without_targets(), heads, (mode,),
                               names=("price", "tags"))
    assert outputs.spark_type().simpleString() == expected_type
    got = Scorer(model, TWO, outputs, torch.device("cpu"), 2).score(
        cols.read_arrow([pa.array(list(x))], TWO)).to_pylist()
    with torch.no_grad():
        value, logits = model(torch.from_numpy(x))
    value_apart, logits_apart = two_tolerance(model, x)  # chunks of 2 against all 5 rows
    assert within([r["price"] for r in got], value[:, 0], value_apart[:, 0])
    tags = [r["tags"] for r in got]
    if mode == "prediction":
        assert signs_agree(tags, logits, logits_apart)
    elif mode == "raw":
        assert within(tags, logits, logits_apart)
    else:
        sigmoid = torch.sigmoid(logits.double())
        assert within(tags, sigmoid, probabilities_tolerance(sigmoid, logits_apart))


@pytest.mark.exact
def test_nested_outputs_and_refusals_are_decided_on_the_driver():
    image = schema(field("img", "float32", (1, 2, 2)), binding="single")
    conv = torch.nn.Conv2d(1, 2, 1)
    outputs = describe_outputs(conv, image, ("value",), ("prediction",))
    assert outputs.spark_type().simpleString() == "array<array<array<double>>>"
    x = np.arange(12, dtype=np.float32).reshape(3, 1, 2, 2)
    column = pa.array([r.tolist() for r in x])
    got = Scorer(conv, image, outputs, torch.device("cpu"), 2).score(
        cols.read_arrow([column], image))
    with torch.no_grad():  # a 1x1 convolution of one channel: w x + b, 2 terms a value
        magnitude = conv.weight.abs().reshape(1, 2, 1, 1) * torch.from_numpy(x).abs() + \
            conv.bias.abs().reshape(1, 2, 1, 1)
        assert within(got.to_pylist(), conv(torch.from_numpy(x)),
                      outputs_tolerance(torch.float32, 2, magnitude))
    with pytest.raises(ConfigError, match="output='probability' needs a classifier"):
        describe_outputs(conv, image, ("value",), ("probability",))
    with pytest.raises(ModelError, match=r"returns 1 output\(s\), but the fit's loss describes"):
        describe_outputs(conv, image, ("value", "value"), ("prediction",))
    with pytest.raises(ModelError, match="forward failed on a probe batch"):
        describe_outputs(torch.nn.Linear(3, 1), image, ("value",), ("prediction",))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nan_in_a_ragged_float_input_is_refused_naming_its_column(bad):
    s = schema(field("seq", "float32", (-1, 2)), binding="single")
    rows = [[[0.0, 1.0]], [[1.0, bad], [bad, 0.0], [1.0, 1.0]], [[2.0, bad]]]  # 3 values
    with pytest.raises(DataError, match=r"column 'seq' \(input\) holds NaN or infinite values "
                                        r"in 2 of 3 rows"):
        cols.read_arrow([pa.array(rows)], s)


# Spark: transform, predict_udf and the Spark ML model on the executors.

@pytest.fixture(scope="module")
def frames(spark):
    rng = np.random.default_rng(3)
    dense = rng.normal(size=(40, 3)).astype(np.float32)
    rec = spark.createDataFrame(pd.DataFrame({"id": range(40), "user": rng.integers(0, 10, 40),
                                              "dense": list(dense)})) \
        .selectExpr("id", "CAST(user AS INT) AS user", "dense")
    tag = spark.createDataFrame([(i, t) for i, t in enumerate(TOKENS)],
                                "id int, tokens array<int>")
    return rec, tag


def local(model, rec_pdf):
    with torch.no_grad():
        return model(torch.tensor(rec_pdf["user"].to_numpy(), dtype=torch.int64),
                     torch.from_numpy(np.stack(rec_pdf["dense"]).astype(np.float32)))


@pytest.mark.spark
@pytest.mark.exact
def test_transform_reads_every_input_by_name_and_writes_each_output_kind(frames):
    rec, tag = frames
    result = FitResult(model=Recommender().eval(), run_id="", schema=REC, heads=("class",))
    out = result.transform(rec, output=["prediction", "probability"]).orderBy("id").toPandas()
    logits = local(result.model, out)
    apart = rec_tolerance(result.model, out["user"].to_numpy(), np.stack(out["dense"]))
    assert classes_agree([r["prediction"] for r in out["prediction"]], logits, apart)
    softmax = torch.softmax(logits.double(), 1)
    assert within(np.stack([r["probability"] for r in out["prediction"]]), softmax,
                  probabilities_tolerance(softmax, apart))
    rec.createOrReplaceTempView("recs")
    rec.sparkSession.udf.register("recommend", result.predict_udf(output="raw"))
    sql = rec.sparkSession.sql("SELECT id, recommend(user, dense) AS r FROM recs ORDER BY id")
    assert within(np.stack(sql.toPandas()["r"]), logits, apart)
    tagger = FitResult(model=Tagger().eval(), run_id="", schema=TAG, heads=("class",))
    tags = tagger.transform(tag, batch_size=3).orderBy("id").toPandas()["prediction"]
    with torch.no_grad():
        expected = [tagger.model(torch.tensor([row]))[0] for row in TOKENS]
    assert all(len(t) == len(row) and classes_agree(t, lg, tag_tolerance(tagger.model, [row])[0])
               for t, lg, row in zip(tags, expected, TOKENS, strict=True))
    with pytest.raises(DataError, match=r"column 'dense' is array<array<float>> in df but "
                                        r"array<float> in train_df"):
        result.transform(rec.selectExpr("user", "array(dense) AS dense"))


@pytest.mark.spark
@pytest.mark.exact
def test_ids_wider_than_the_fit_s_are_range_checked_with_ansi_off(ansi_off):
    """Issue 39: bigint ids scored by a fit of int ids were cast by Spark, which with ANSI off
    wraps 2**32 + 3 into the id 3, silently; scoring's reader now narrows them, checked."""
    rows = [(i, u, [0.5, -1.0, 2.0]) for i, u in enumerate([3, 9, 0, 2**32 + 3])]
    wide = ansi_off.createDataFrame(rows, "id int, user bigint, dense array<float>")
    result = FitResult(model=Recommender().eval(), run_id="", schema=REC, heads=("class",))
    fits = result.transform(wide.where("user < 10"), output="raw").orderBy("id").toPandas()
    assert within(np.stack(fits["prediction"]), local(result.model, fits),  # two batchings
                  rec_tolerance(result.model, fits["user"].to_numpy(), np.stack(fits["dense"])))
    with pytest.raises(Exception, match=r"DataError: column 'user' \(input\) holds -?\d+ to "
                                        r"4294967299, beyond the int32 the fit read it as "
                                        r"\(-2147483648 to 2147483647\)"):
        result.transform(wide).collect()


@pytest.mark.spark
@pytest.mark.exact
def test_several_outputs_are_one_struct_column_named_after_the_label_columns(spark):
    x = np.random.default_rng(9).normal(size=(6, 5)).astype(np.float32)
    df = spark.createDataFrame(pd.DataFrame({"id": range(6), "x": list(x)}))
    result = FitResult(model=TwoHeads().eval(), run_id="", schema=TWO,
                       heads=output_heads(["mse", "bce_with_logits"]))
    scored = result.transform(df)
    assert scored.schema["prediction"].dataType.simpleString() == \
        "struct<price:double,tags:array<bigint>>"
    rows = scored.orderBy("id").collect()
    with torch.no_grad():
        value, logits = result.model(torch.from_numpy(x))
    value_apart, logits_apart = two_tolerance(result.model, x)
    assert within([r.prediction.price for r in rows], value[:, 0], value_apart[:, 0])
    assert signs_agree([r.prediction.tags for r in rows], logits, logits_apart)


def evaluator_data(spark, rng, classes):
    x = rng.normal(size=(60, 4)).astype(np.float32)
    label = (x[:, 0] > 0).astype(np.float64) + ((x[:, 1] > 0.5) if classes == 3 else 0)
    return x, spark.createDataFrame(pd.DataFrame({"features": list(x), "label": label}))


def auc(scores, labels) -> float:
    """The area under the ROC curve by ranks (Mann-Whitney; the scores have no ties)."""
    ranks = np.argsort(np.argsort(scores)) + 1
    pos = labels == 1
    return (ranks[pos].sum() - pos.sum() * (pos.sum() + 1) / 2) / (pos.sum() * (~pos).sum())


@pytest.mark.spark
@pytest.mark.parametrize("kind", ["softmax of 2", "one logit", "softmax of 3"])
@pytest.mark.exact
def test_spark_evaluators_read_the_classifier_columns_with_their_defaults(spark, kind):
    from pyspark.ml.evaluation import (
        BinaryClassificationEvaluator,
        MulticlassClassificationEvaluator,
    )
    from pyspark.ml.linalg import DenseVector

    from sparkdl_avg.ml import AveragingModel
    from sparkdl_avg.scoring.columns import vector_schema

    classes = 3 if kind == "softmax of 3" else 2
    x, df = evaluator_data(spark, np.random.default_rng(5), classes)
    torch.manual_seed(6)
    net = torch.nn.Linear(4, 1 if kind == "one logit" else classes)
    head = "multilabel" if kind == "one logit" else "class"
    model = AveragingModel(torch_model=net.eval(), schema=vector_schema("features", 4,
                                                                        "float32"),
                           heads=(head,))
    out = model.transform(df).toPandas()
    assert {"prediction", "rawPrediction", "probability"} <= set(out.columns)
    assert isinstance(out["probability"][0], DenseVector)
    features = torch.from_numpy(np.stack(out["features"]))
    with torch.no_grad():
        logits = net(features).double()
    apart = outputs_tolerance(torch.float32, 5, linear_magnitude(net, features.abs()))
    # Spark's chunks may round a logit within `apart` of a tie either way: none is here, so
    # the evaluators' numbers below are the ones these logits give
    if head == "multilabel":
        margin = logits[:, :1].abs()
    else:
        margin = logits.max(1, keepdim=True).values - logits.topk(2).values[:, 1:]
    assert (2 * apart < margin).all(), "a tie within rounding: choose another seed"
    probability = torch.sigmoid(logits) if head == "multilabel" else torch.softmax(logits, 1)
    predicted = (logits[:, 0] > 0).double() if head == "multilabel" else logits.argmax(1)
    label = out["label"].to_numpy()
    accuracy = MulticlassClassificationEvaluator(metricName="accuracy").evaluate(
        model.transform(df))
    assert accuracy == pytest.approx((predicted.numpy() == label).mean())
    if classes == 2:  # rawPrediction[1] ranks the rows as the probability of class 1
        p1 = probability[:, -1].numpy()
        assert BinaryClassificationEvaluator().evaluate(model.transform(df)) == \
            pytest.approx(auc(p1, label), abs=1e-9)  # ranks: no two scores within rounding
        assert within(np.stack(out["probability"])[:, 1], p1,
                      probabilities_tolerance(probability, apart)[:, -1])


@pytest.mark.spark
@pytest.mark.exact
def test_saved_models_load_today_s_and_before_typed_inputs(frames, tmp_path):
    from sparkdl_avg.ml import AveragingModel

    rec, _ = frames
    model = AveragingModel(torch_model=Recommender().eval(), schema=REC, heads=("class",),
                           score_rows=7)
    before = model.transform(rec).orderBy("id").toPandas()
    model.write().save(str(tmp_path / "typed"))
    saved = json.loads((tmp_path / "typed" / "model" / "model.json").read_text())
    assert DataSchema.from_dict(saved["schema"]) == REC and saved["heads"] == ["class"]
    after = AveragingModel.load(str(tmp_path / "typed")).transform(rec).orderBy("id").toPandas()
    assert after["prediction"].tolist() == before["prediction"].tolist()
    np.testing.assert_allclose(np.stack(after["probability"]), np.stack(before["probability"]))
    # A model saved by the previous version: model.json with num_features and classify.
    old = AveragingModel(torch_model=torch.nn.Linear(3, 2).eval(), score_rows=5)
    old._set(featuresCol="dense")
    old.write().save(str(tmp_path / "old"))
    (tmp_path / "old" / "model" / "model.json").write_text(json.dumps(
        {"num_features": 3, "classify": True, "dtype": "float32", "score_rows": 5,
         "run_id": "r0", "sparkdl_avg": "0.1.0"}))
    loaded = AveragingModel.load(str(tmp_path / "old"))
    assert loaded.schema is None and loaded.run_id == "r0"
    scored = loaded.transform(rec).orderBy("id").toPandas()
    dense = torch.from_numpy(np.stack(scored["dense"]))
    with torch.no_grad():
        logits = loaded.torch_model(dense)
    apart = outputs_tolerance(torch.float32, 4, linear_magnitude(loaded.torch_model,
                                                                 dense.abs()))
    assert classes_agree(scored["prediction"], logits, apart)
    # log_softmax moves by at most twice a row's largest logit's move (and rounds in float64)
    assert within(np.stack(scored["rawPrediction"]), torch.log_softmax(logits.double(), 1),
                  2 * apart.max(1, keepdim=True).values.double() + 1e-15)


def test_input_cols_and_weight_col_reach_the_fit(monkeypatch):
    import sparkdl_avg._fit
    from sparkdl_avg.ml import AveragingEstimator

    seen = {}

    def fake_fit(df, model_fn, config, **kwargs):
        seen.update(kwargs)
        return FitResult(model=Recommender(), run_id="r", schema=REC, heads=("class",))

    monkeypatch.setattr(sparkdl_avg._fit, "fit", fake_fit)
    estimator = AveragingEstimator(model_fn=Recommender, loss="cross_entropy",
                                   inputCols={"user": "u", "dense": "d"}, weightCol="w")
    fitted = estimator.fit(object())
    assert seen["inputs"] == {"user": "u", "dense": "d"} and seen["weight_col"] == "w"
    assert fitted.schema == REC and fitted.heads == ("class",)
    AveragingEstimator(model_fn=Recommender, inputCols=["u", "d"]).fit(object())
    assert seen["inputs"] == ["u", "d"]
    seen.clear()
    AveragingEstimator(model_fn=Recommender).fit(object())
    assert "inputs" not in seen and "weight_col" not in seen
    with pytest.raises(TypeError, match="inputCols must be a non-empty list"):
        AveragingEstimator(model_fn=Recommender, inputCols=[1, 2])


# MLflow: the logged model's signature and its pyfunc on pandas.

@pytest.mark.spark
@pytest.mark.exact
def test_the_mlflow_model_on_pandas_predicts_as_transform(frames):
    import mlflow

    from sparkdl_avg.tracking.model import log_model

    rec, tag = frames
    mlflow.set_experiment("outputs")
    for data_schema, model, df in ((REC, Recommender(), rec), (TAG, Tagger(), tag)):
        result = FitResult(model=model.eval(), run_id="", schema=data_schema, heads=("class",))
        with mlflow.start_run() as run:
            log_model(result.model, schema=data_schema, heads=("class",),
                      pip_requirements=["torch"])
        uri = f"runs:/{run.info.run_id}/model"
        info = mlflow.models.get_model_info(uri)
        assert isinstance(mlflow.pytorch.load_model(uri), torch.fx.GraphModule)  # pt2
        assert info.metadata["inputs"] == [{"name": f.key, "dtype": f.dtype,
                                            "shape": [-1, *f.shape]} for f in data_schema.inputs]
        pyfunc = mlflow.pyfunc.load_model(uri)
        scored = result.transform(df, output=["prediction", "probability"], output_col="s") \
            .orderBy("id").toPandas()
        inputs = scored.drop(columns=["id", "s"])
        got = pyfunc.predict(inputs)
        # the exported program's kernels against transform's: each row's classes and
        # probabilities within rounding of the logits run here (`rounding`)
        if data_schema is REC:
            logits = local(model, scored)
            apart = rec_tolerance(model, scored["user"].to_numpy(), np.stack(scored["dense"]))
            got_rows = np.asarray(got).reshape(-1, 1)
        else:
            with torch.no_grad():
                logits = [model(torch.tensor([list(t)]))[0] for t in scored["tokens"]]
            apart = [tag_tolerance(model, [list(t)])[0] for t in scored["tokens"]]
            got_rows = got
        for g, lg, d, r in zip(got_rows, logits, apart, scored["s"], strict=True):
            lg, d = lg.reshape(-1, lg.shape[-1]), d.reshape(-1, d.shape[-1])
            assert classes_agree(np.ravel(g), lg, d)
            assert classes_agree(np.ravel(r["prediction"]), lg, d)
        if data_schema is TAG:  # a frame built by hand: Python ints, lists of any length
            hand = pd.DataFrame({"tokens": [list(map(int, t)) for t in TOKENS]})
            assert [np.asarray(r).tolist() for r in pyfunc.predict(hand)] == \
                [np.asarray(r).tolist() for r in got]
        probability = pyfunc.predict(inputs, params={"output": "probability"})
        for a, b, d in zip(probability, scored["s"], apart, strict=True):
            a, b = np.stack(a), np.stack(b["probability"])
            assert within(a, b, probabilities_tolerance(np.maximum(a, b), d))
        inputs_spec = json.loads(info.signature.to_dict()["inputs"])
        if data_schema is REC:
            assert inputs_spec == [
                {"type": "tensor", "tensor-spec": {"dtype": "int32", "shape": [-1]},
                 "name": "user"},
                {"type": "tensor", "tensor-spec": {"dtype": "float32", "shape": [-1, 3]},
                 "name": "dense"}]
        else:
            assert inputs_spec == [{"type": "array", "items": {"type": "long"},
                                        "name": "tokens", "required": True}]
        assert info.signature.params.to_dict()[0]["name"] == "output"


class BiasedTagger(torch.nn.Module):
    """(bias [B, 3], tokens [B, T]) -> per-token logits [B, T, 3]. Nothing masks the pads:
    a pad (0, a real token here too) gets a token's logits, so only the rows' lengths say
    where each row ends."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.emb, self.out = torch.nn.Embedding(10, 4), torch.nn.Linear(4, 3)

    def forward(self, bias, tokens):
        return self.out(self.emb(tokens)) + bias[:, None, :]


def _shift(batch, *, training, rng):
    """Decodes one input and lets the ragged tokens pass through unchanged."""
    return {"bias": batch["bias"] + 1.0}


BIASED = schema(field("bias", "float32", (3,), source="array<float>"),
                field("tokens", "int32", (-1,), source="array<int>"), binding="positional")


@pytest.mark.spark
@pytest.mark.parametrize("preprocess", [None, _shift], ids=["plain", "preprocess"])
def test_a_tagger_writes_each_row_as_many_predictions_as_it_has_tokens(spark, preprocess):
    """Issue 39: with a preprocess, transform and the logged pyfunc wrote each row at its
    chunk's padded length ([0, 7, 0] gave 5 predictions). Both paths, each row against the
    model run on that row alone (no padding at all); the tokens are the second input, after
    one the preprocess returns."""
    import mlflow

    from sparkdl_avg._model import pickle_for_executors
    from sparkdl_avg.data.feed import model_schema
    from sparkdl_avg.tracking.model import log_model

    rng = np.random.default_rng(39)
    tokens = [rng.integers(0, 10, n).tolist() for n in rng.integers(1, 7, 40)]
    bias = rng.normal(size=(40, 3)).astype(np.float32)
    df = spark.createDataFrame(pd.DataFrame({"id": range(40), "bias": list(bias),
                                             "tokens": tokens})) \
        .selectExpr("id", "CAST(bias AS array<float>) AS bias",
                    "CAST(tokens AS array<int>) AS tokens")
    decoded = bias if preprocess is None else preprocess({"bias": bias}, training=False,
                                                         rng=None)["bias"]
    model = BiasedTagger().eval()
    with torch.no_grad():
        eager = [model(torch.from_numpy(b[None]), torch.tensor([t]))[0].double()
                 for b, t in zip(decoded, tokens, strict=True)]
    top2 = [torch.topk(e, 2, -1).values for e in eager]
    # argmax is one answer whichever kernel sums the logits: no two within float32's reach
    assert min(float((v[:, 0] - v[:, 1]).min()) for v in top2) > 1e-3
    # as a fit learns it: what the preprocess returns for a sample, the rest as carried
    inputs = None if preprocess is None else \
        model_schema(BIASED, preprocess({"bias": bias[:2]}, training=False, rng=None), 2)
    result = FitResult(model=model, run_id="", schema=BIASED, heads=("class",),
                       preprocess=preprocess, model_schema=inputs)
    scored = result.transform(df, output=["prediction", "raw"], batch_size=4) \
        .orderBy("id").toPandas()["prediction"]
    mlflow.set_experiment("outputs")
    with mlflow.start_run() as run:
        log_model(model, schema=BIASED, heads=("class",), pip_requirements=["torch"],
                  model_schema=inputs, preprocess=None if preprocess is None else
                  pickle_for_executors("preprocess", preprocess))
    pyfunc = mlflow.pyfunc.load_model(f"runs:/{run.info.run_id}/model")
    frame = pd.DataFrame({"bias": [b.tolist() for b in bias], "tokens": tokens})
    served, served_raw = pyfunc.predict(frame), pyfunc.predict(frame, params={"output": "raw"})
    # float32 logits of a 4-wide product and a bias: a batched kernel may sum in another
    # order than the row's own, a few ulps (1.2e-7 each) of values near 1
    close = {"rtol": 1e-5, "atol": 1e-5}
    for i, (t, e) in enumerate(zip(tokens, eager, strict=True)):
        expected = e.argmax(-1).tolist()
        assert list(scored[i]["prediction"]) == expected, (i, t)
        assert list(served[i]) == expected, (i, t)
        np.testing.assert_allclose(np.stack(scored[i]["raw"]), e, **close)
        np.testing.assert_allclose(np.stack(served_raw[i]), e, **close)


class Branchy(torch.nn.Module):
    """A branch on the data: torch.export cannot trace it."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.out = torch.nn.Linear(3, 2)

    def forward(self, user, dense):
        if dense.sum().item() > 0:
            return self.out(dense) + user[:, None]
        return self.out(dense)


def test_a_model_torch_export_cannot_trace_is_logged_pickled_and_still_predicts(
        monkeypatch, caplog):
    import mlflow

    from sparkdl_avg.tracking.model import log_model

    mlflow.set_experiment("outputs")
    with mlflow.start_run() as run:
        log_model(Branchy().eval(), schema=REC, heads=("class",), pip_requirements=["torch"])
    assert "torch.export could not export the model" in caplog.text
    monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "true")
    pyfunc = mlflow.pyfunc.load_model(f"runs:/{run.info.run_id}/model")
    user = np.array([1, 2, 3], np.int32)
    dense = np.array([[1, 1, 1], [-1, 0, 0], [2, 0, 1]], np.float32)
    got = pyfunc.predict({"user": user, "dense": dense}, params={"output": "raw"})
    with torch.no_grad():
        expected = Branchy().eval()(torch.from_numpy(user).long(), torch.from_numpy(dense))
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)


# End to end: a fit of typed inputs, its Spark ML model and its logged MLflow model.

def make_recommender() -> torch.nn.Module:
    return Recommender()


@pytest.mark.spark
@pytest.mark.exact
def test_a_fit_of_named_inputs_scores_alike_in_spark_ml_and_mlflow(spark, mlflow_client):
    import mlflow

    from sparkdl_avg import TrainConfig
    from sparkdl_avg.ml import AveragingEstimator

    rng = np.random.default_rng(11)
    user, dense = rng.integers(0, 10, 48), rng.normal(size=(48, 3)).astype(np.float32)
    label = (dense[:, 0] > 0).astype(np.int64) + (user > 6)
    df = spark.createDataFrame(pd.DataFrame({"id": range(48), "u": user, "d": list(dense),
                                             "label": label, "w": 1.0})) \
        .selectExpr("id", "CAST(u AS INT) AS u", "d", "label", "w")
    config = TrainConfig(num_workers=2, epochs=1, batch_size=8, experiment_name="outputs")
    model = AveragingEstimator(model_fn=make_recommender, config=config,
                               inputCols={"user": "u", "dense": "d"}, weightCol="w").fit(df)
    assert mlflow_client.get_run(model.run_id).data.params["weight_col"] == "w"
    assert [(f.name, f.column, f.dtype) for f in model.schema.inputs] == \
        [("user", "u", "int32"), ("dense", "d", "float32")]
    scored = model.transform(df).orderBy("id").toPandas()
    logits = model.torch_model(torch.from_numpy(user), torch.from_numpy(dense)).detach()
    apart = rec_tolerance(model.torch_model, user, dense)
    assert classes_agree(scored["prediction"], logits, apart)
    pyfunc = mlflow.pyfunc.load_model(f"runs:/{model.run_id}/model")
    # the signature names the inputs by the columns the fit read, as the DataFrame has them
    got = pyfunc.predict(pd.DataFrame({"u": user.astype(np.int32), "d": list(dense)}),
                         params={"output": "probability"})
    softmax = torch.softmax(logits.double(), 1)  # both within rounding of it
    assert within(got, np.stack(scored["probability"]),
                  2 * probabilities_tolerance(softmax, apart))
