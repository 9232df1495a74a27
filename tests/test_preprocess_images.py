"""Image files through `fit(preprocess=)` (issue 39): a preprocess that returns uint8 pixels
gives the model uint8 (a float CNN that converts them, `x.float() / 255`, trains and scores
as an eager computation; one that does not is refused before training, the error saying
what it received and what to do); and a corrupt PNG among good ones fails every path that
preprocesses (the driver's sample check, the training feed, evaluation's feed, scoring)
with a PreprocessError naming the row: its `path`, else its position. The search for the
row that fails alone is tested without Spark first."""

from __future__ import annotations

import io
import re

import numpy as np
import pytest
import torch

from sparkdl_avg import ModelError, PreprocessError, TrainConfig, fit
from sparkdl_avg.data.feed import Preprocessor, model_schema, step_rng
from sparkdl_avg.data.raw_rows import call
from sparkdl_avg.data.schema import DataSchema, FieldSpec

SIDE, ROWS = 8, 24
CONFIG = dict(num_workers=2, epochs=1, batch_size=4, optimizer="sgd", lr=0.05, seed=3,
              log_model=False, experiment_name="preprocess-images")


def _png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(pixels, "L").save(out, "PNG")
    return out.getvalue()


def decode(batch, *, training, rng):
    """PNG bytes -> uint8 [B, 1, H, W], as a decoder gives them."""
    from PIL import Image

    return {"content": np.stack([np.asarray(Image.open(io.BytesIO(b)).convert("L"))
                                 for b in batch["content"]])[:, None]}


class Converts(torch.nn.Module):
    """A float CNN that takes uint8 pixels and converts them itself."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(1, 4, 3)
        self.head = torch.nn.Linear(4 * (SIDE - 2) ** 2, 2)

    def forward(self, x):
        if x.dtype != torch.uint8:
            raise TypeError(f"expected the pixels as uint8, got {x.dtype}")
        return self.head(torch.relu(self.conv(x.float() / 255)).flatten(1))


class Forgets(Converts):
    """The same CNN fed the pixels as they come."""

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).flatten(1))


# --- without Spark: which row fails -------------------------------------------------------

CONTENT = FieldSpec("input", "content", "content", "_x0", "uint8", (-1,), "binary", True)
LABEL = FieldSpec("label", "label", "label", "_y0", "int64", ())
PATH = FieldSpec("ident", "path", "path", "_id0", "uint8", (-1,), "string", True)


def _rows(records: list[bytes], paths: list[str] | None):
    """A raw batch's `joined` form: content, label, and the paths where given."""
    def ragged(items):
        return (np.frombuffer(b"".join(items), np.uint8), np.array(list(map(len, items))))

    joined = [ragged(records), np.arange(len(records)) % 2]
    if paths is not None:
        joined.append(ragged([p.encode() for p in paths]))
    schema = DataSchema(inputs=(CONTENT,), binding="single", labels=(LABEL,),
                        label_list=False, idents=(PATH,) if paths is not None else ())
    return schema, joined


def _strict(batch, *, training, rng):
    """Fails a batch holding any record starting with b"bad"."""
    if any(r.startswith(b"bad") for r in batch["content"]):
        raise ValueError("cannot identify image file")
    return {"content": np.zeros((len(batch["content"]), 1), np.float32)}


def _where(k, rows):
    return f"a batch of {rows}" if k is None else f"row {k} of a batch of {rows}"


def test_a_failing_batch_names_the_row_that_fails_alone():
    records = [b"ok"] * 8
    records[5] = b"bad png"
    schema, joined = _rows(records, [f"/img/{i}.png" for i in range(8)])
    with pytest.raises(PreprocessError, match=re.escape(
            "preprocess failed on the row whose path is '/img/5.png' (row 5 of a batch of "
            "8): ValueError('cannot identify image file')")) as caught:
        call(_strict, schema, joined, training=True, rng=step_rng(0, 0, 0, 0), where=_where)
    assert "other rows" not in str(caught.value)


def test_without_an_ident_the_row_is_named_by_its_position():
    records = [b"ok", b"ok", b"bad", b"ok"]
    schema, joined = _rows(records, None)
    with pytest.raises(PreprocessError, match=r"failed on row 2 of a batch of 4 \(no path, "
                                              r"id, uri, key or file column names it\)"):
        call(_strict, schema, joined, training=False, rng=step_rng(0, 0, 0, 0), where=_where)
    # an eval_df without the ident carries it empty: the position again
    schema, joined = _rows(records, ["", "", "", ""])
    with pytest.raises(PreprocessError, match="failed on row 2 of a batch of 4 .no path"):
        call(_strict, schema, joined, training=False, rng=step_rng(0, 0, 0, 0), where=_where)


def test_the_error_says_when_more_than_one_row_fails_or_none_alone():
    schema, joined = _rows([b"ok", b"bad", b"ok", b"bad"], [f"/{i}" for i in range(4)])
    with pytest.raises(PreprocessError, match="whose path is '/1'.*other rows fail without "
                                              "it too"):
        call(_strict, schema, joined, training=True, rng=step_rng(0, 0, 0, 0), where=_where)

    def whole(batch, *, training, rng):  # fails on a batch of four only
        if len(batch["content"]) == 4:
            raise MemoryError("too many at once")
        return {"content": np.zeros((len(batch["content"]), 1), np.float32)}

    schema, joined = _rows([b"ok"] * 4, [f"/{i}" for i in range(4)])
    with pytest.raises(PreprocessError, match=r"on a batch of 4 and on none of its rows alone"):
        call(whole, schema, joined, training=True, rng=None, where=_where)


def test_the_search_replays_the_batch_s_random_draws():
    """An augmentation that fails on some draws fails the same way on the row alone: the
    search hands fn the batch's rng as it was, not one drawn further."""
    first = step_rng(0, 0, 0, 0).random()

    def unlucky(batch, *, training, rng):
        if rng.random() == first and b"bad" in batch["content"]:
            raise ValueError("corrupt under this draw")
        return {"content": np.zeros((len(batch["content"]), 1), np.float32)}

    schema, joined = _rows([b"ok", b"ok", b"bad", b"ok"], [f"/{i}" for i in range(4)])
    with pytest.raises(PreprocessError, match="whose path is '/2'"):
        call(unlucky, schema, joined, training=True, rng=step_rng(0, 0, 0, 0), where=_where)


def test_scoring_names_a_row_by_its_place_among_the_rows_scored():
    schema, joined = _rows([b"ok", b"bad", b"ok"], None)
    raw = DataSchema(inputs=(CONTENT,), binding="single", labels=(), label_list=False)
    model = model_schema(raw, {"content": np.zeros((1, 1), np.float32)}, 1)
    prep = Preprocessor(_strict, raw, model, torch.float32, seed=0, partition=0)
    with pytest.raises(PreprocessError, match="failed on row 11 of the 20 scored"):
        prep([[joined[0]]], training=False, rng=step_rng(0, 0, 0, 0), offset=10, total=20)


def test_the_probe_says_what_a_model_refusing_its_dtype_received_and_what_to_do():
    """What `fit` raises before training for a float CNN given uint8 (and for a float layer
    given an integer column, and an Embedding given uint8), from the probe's forward."""
    from sparkdl_avg._losses import make_objective
    from sparkdl_avg._model import check_model_takes_data

    raw = DataSchema(inputs=(CONTENT,), binding="single", labels=(LABEL,), label_list=False)
    pixels = np.zeros((2, 1, SIDE, SIDE), np.uint8)
    schema = model_schema(raw, {"content": pixels}, 2)
    assert schema.inputs[0].dtype == "uint8" and schema.labels[0].dtype == "int64"
    sample = Preprocessor(lambda b, **_: {"content": pixels}, raw, schema, torch.float32,
                          seed=0, partition=0)([[(np.zeros(2, np.uint8), np.ones(2, int)),
                                                 np.zeros(2, np.int64)]], training=False,
                                               rng=None)
    assert sample.inputs[0].dtype == torch.uint8
    objective = make_objective("cross_entropy", num_outputs=1, weighted=False, inputs=None)
    probe = dict(objective=objective, dtype=torch.float32, ranges={}, longest={})
    check_model_takes_data(Converts(), schema, batch=sample, **probe)  # converts: fine
    with pytest.raises(ModelError, match=r"Input type \(unsigned char\).*column 'content' "
                                         r"\(input\) reaches the model as uint8 \(what "
                                         r"preprocess returned\): a float layer takes it as "
                                         r"x\.float\(\) / 255 in forward"):
        check_model_takes_data(Forgets(), schema, batch=sample, **probe)

    class Ids(torch.nn.Module):  # uint8 as ids
        def forward(self, x):
            return torch.nn.Embedding(256, 2)(x.flatten(1)).sum(1)

    with pytest.raises(ModelError, match=r"torch\.ByteTensor.*an nn\.Embedding takes int64 "
                                         r"ids"):
        check_model_takes_data(Ids(), schema, batch=sample, **probe)
    # no preprocess: an integer column given to a float layer
    counts = DataSchema(inputs=(FieldSpec("input", "counts", "counts", "_x0", "int32", (8,)),),
                        binding="single", labels=(LABEL,), label_list=False)
    with pytest.raises(ModelError, match=r"Long and Float.*column 'counts' \(input\) reaches "
                                         r"the model as int64: a float layer takes it as "
                                         r"x\.float\(\)"):
        check_model_takes_data(torch.nn.Linear(8, 2), counts, **probe)


# --- fits over image files ----------------------------------------------------------------


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """good/<label>/<i>.png: 24 8x8 greys, class 1 brighter; bad/: 3 good and one file that
    is no PNG; tail/zz_bad.png: the corrupt one alone, sorted after every good path."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for i in range(ROWS):
        label = i % 2
        pixels = rng.integers(0, 128, (SIDE, SIDE)) + 100 * label
        (root / "good" / str(label)).mkdir(parents=True, exist_ok=True)
        (root / "good" / str(label) / f"{i}.png").write_bytes(_png(pixels.astype(np.uint8)))
    (root / "bad" / "0").mkdir(parents=True)
    for i in range(3):
        (root / "bad" / "0" / f"{i}.png").write_bytes((root / "good" / "0" / f"{2 * i}.png")
                                                      .read_bytes())
    (root / "bad" / "0" / "broken.png").write_bytes(b"not a png at all")
    (root / "tail" / "1").mkdir(parents=True)
    (root / "tail" / "1" / "zz_bad.png").write_bytes(b"\x89PNG truncated")
    return root


def _images(spark, *dirs):
    from pyspark.sql import functions as F

    df = None
    for d in dirs:
        part = spark.read.format("binaryFile").option("pathGlobFilter", "*.png") \
            .option("recursiveFileLookup", "true").load(str(d))
        df = part if df is None else df.unionByName(part)
    return df.withColumn("label", F.regexp_extract("path", r"/(\d+)/[^/]+$", 1)
                         .cast("long")).select("path", "content", "label").orderBy("path")


def _fit(df, model_fn=Converts, eval_df=None, **fields):
    return fit(df, model_fn, TrainConfig(**{**CONFIG, **fields}), features_col="content",
               preprocess=decode, eval_df=eval_df)


@pytest.mark.spark
def test_a_float_cnn_fed_uint8_is_refused_before_training_saying_what_to_do(spark, folders):
    with pytest.raises(ModelError, match=r"Input type \(unsigned char\).*column 'content' "
                                         r"\(input\) reaches the model as uint8.*"
                                         r"x\.float\(\) / 255"):
        _fit(_images(spark, folders / "good"), Forgets)


@pytest.fixture(scope="module")
def fitted(spark, folders):
    return _fit(_images(spark, folders / "good"), log_model=True)


@pytest.mark.spark
def test_uint8_pixels_reach_the_model_as_uint8_and_score_as_eager(spark, folders, fitted):
    """`Converts` refuses anything but uint8: it trained (probe, steps) and scores on the
    pixels as preprocess returned them; transform's logits are the eager model's on the
    same decoded files."""
    df = _images(spark, folders / "good")
    scored = fitted.transform(df, output="raw").select("content", "prediction").toPandas()
    pixels = decode({"content": list(scored["content"])}, training=False, rng=None)
    with torch.no_grad():
        eager = fitted.model(torch.from_numpy(pixels["content"]))
    got = torch.tensor(np.stack(scored["prediction"].to_numpy()), dtype=torch.float32)
    # the same float32 layers on the same rows, in batches of another size: a few ulps of
    # the logits (about 1) apart at most
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
    assert not torch.equal(fitted.model.head.weight, Converts().head.weight)  # it trained
    # the logged model: exported (pt2) with a uint8 input, scoring the PNG bytes
    import mlflow
    import pandas as pd

    uri = f"runs:/{fitted.run_id}/model"
    assert mlflow.artifacts.download_artifacts(f"{uri}/data/model.pt2")
    frame = pd.DataFrame({"content": [bytes(b) for b in scored["content"]]})
    logged = mlflow.pyfunc.load_model(uri).predict(frame, params={"output": "raw"})
    torch.testing.assert_close(torch.tensor(np.asarray(logged), dtype=torch.float32), eager,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.spark
def test_a_corrupt_png_in_the_driver_s_sample_is_named(spark, folders):
    with pytest.raises(PreprocessError, match=r"failed on the row whose path is '[^']*/bad/0/"
                                              r"broken\.png' \(row \d of train_df's first 4 "
                                              r"rows\): UnidentifiedImageError"):
        _fit(_images(spark, folders / "bad"), batch_size=1)


@pytest.mark.spark
def test_a_corrupt_png_met_in_training_is_named(spark, folders):
    """Sorted last, the corrupt file is not in the driver's sample: a training step meets
    it, in a batch of 4, and the fit fails naming it, not the batch's first row."""
    with pytest.raises(PreprocessError, match=r"failed on the row whose path is '[^']*/tail/1/"
                                              r"zz_bad\.png' \(row \d of a batch of 4 rows of "
                                              r"partition \d\): UnidentifiedImageError"):
        _fit(_images(spark, folders / "good", folders / "tail"))


@pytest.mark.spark
def test_a_corrupt_png_met_in_evaluation_is_named(spark, folders):
    with pytest.raises(PreprocessError, match=r"failed on the row whose path is '[^']*/tail/1/"
                                              r"zz_bad\.png' \(row \d+ of a batch of \d+ rows "
                                              r"of partition \d\): UnidentifiedImageError"):
        _fit(_images(spark, folders / "good"),
             eval_df=_images(spark, folders / "good", folders / "tail"))


@pytest.mark.spark
def test_a_corrupt_png_met_in_scoring_is_named(spark, folders, fitted):
    """transform carries the path to name the row; predict_udf, given the content alone,
    names it by its place among the rows it scored. The executors raise the
    PreprocessError; the driver gets Spark's exception carrying it."""
    df = _images(spark, folders / "good", folders / "tail")
    with pytest.raises(Exception, match=r"PreprocessError: preprocess failed on the row whose "
                                        r"path is '[^']*/tail/1/zz_bad\.png' \(row \d+ of the "
                                        r"\d+ scored\)"):
        fitted.transform(df).collect()
    with pytest.raises(Exception, match=r"PreprocessError: preprocess failed on row \d+ of "
                                        r"the \d+ scored \(no path"):
        df.select(fitted.predict_udf()("content")).collect()
