"""Spark's `image` source struct (issue 31) as an input with `fit(preprocess=)`: it reaches
the preprocess as {"data": list of bytes, "height", "width", "nChannels", "mode": int32
arrays} (`origin` left out), carried and cached as one binary value. PNG files of two sizes
and two modes are written in the test and read with `spark.read.format("image")`; `transform`
(preprocess with training=False, then the model) equals the returned model on features
computed on the driver from the rows Spark read. The struct as Spark gives it (not packed)
scores alike through `predict_udf`, the logged pyfunc (pandas rows, `spark_udf`) and the
Spark ML model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pyspark.sql import functions as F
from rounding import classes_agree, linear_magnitude, outputs_tolerance

from sparkdl_avg import DataError, TrainConfig, fit

pytestmark = pytest.mark.spark
SHAPES = [((3, 4), "RGB"), ((5, 2), "L")]  # (height, width), PIL mode


def _features(data, height, width, channels, mode) -> np.ndarray:
    """What the model sees of one image: its size, mode and mean pixel (from the bytes, so a
    wrong header or wrong bytes changes it)."""
    from PIL import Image  # the logged model requires Pillow: its requirements say so

    size = (int(width), int(height))
    pixels = np.asarray(Image.frombytes("RGB" if channels == 3 else "L", size, data))
    return np.array([height / 5, width / 4, channels / 3, mode / 16,
                     4 * (pixels.mean() / 255 - 0.5)], np.float32)


def _decode(batch, *, training, rng):
    image = batch["image"]
    assert set(image) == {"data", "height", "width", "nChannels", "mode"}
    assert all(image[k].dtype == np.int32 for k in ("height", "width", "nChannels", "mode"))
    rows = zip(image["data"], image["height"], image["width"], image["nChannels"],
               image["mode"], strict=True)
    return {"image": np.stack([_features(*row) for row in rows])}


@pytest.fixture(scope="module")
def images(spark, tmp_path_factory):
    from PIL import Image

    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(3)
    for label in (0, 1):
        (root / str(label)).mkdir()
        for i in range(8):
            (height, width), mode = SHAPES[i % 2]
            pixels = rng.integers(0, 128, (height, width, 3)) + 127 * label
            image = Image.fromarray(pixels.astype(np.uint8), "RGB").convert(mode)
            image.save(root / str(label) / f"{i}.png")
    df = spark.read.format("image").load(str(root / "*"))
    label = F.regexp_extract("image.origin", r"/(\d)/[^/]+$", 1).cast("long")
    return df.withColumn("label", label).cache()


CONFIG = dict(num_workers=2, epochs=2, batch_size=4, lr=0.5, seed=2,
              experiment_name="image-source")


def logits_here(model: torch.nn.Linear, images) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's logits for `images` (Rows with an `image` struct) from features computed
    here, and how far scoring elsewhere (other chunks, the exported program) may round them
    (`rounding.outputs_tolerance`: one Linear layer of 5 inputs)."""
    x = torch.tensor(np.stack([_features(r.image.data, r.image.height, r.image.width,
                                         r.image.nChannels, r.image.mode) for r in images]))
    with torch.no_grad():
        logits = model(x)
    return logits, outputs_tolerance(torch.float32, 6, linear_magnitude(model, x.abs()))


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(5, 2)


@pytest.fixture(scope="module")
def fitted(images):
    return fit(images, _model, TrainConfig(**CONFIG), features_col="image", preprocess=_decode)


@pytest.mark.exact
def test_the_image_struct_reaches_preprocess_as_a_dict_and_scores_alike(images, fitted):
    raw = [(r.image.data, r.image.height, r.image.width, r.image.nChannels, r.image.mode)
           for r in images.collect()]
    assert {(h, w, c, m) for _, h, w, c, m in raw} == {(3, 4, 3, 16), (5, 2, 1, 0)}
    scored = fitted.transform(images).select("image", "prediction").collect()
    logits, apart = logits_here(fitted.model, scored)
    assert classes_agree([r.prediction for r in scored], logits, apart)
    assert len(set(logits.argmax(1).tolist())) > 1  # not one class for every image


@pytest.mark.exact
def test_predict_udf_and_the_logged_model_score_image_structs_as_transform_does(
        spark, images, fitted):
    """The struct as Spark gives it (not packed as the fit carries it): predict_udf's Arrow
    struct, the pyfunc's pandas rows (dicts, or the Rows of toPandas) and spark_udf."""
    import mlflow
    import pandas as pd

    scored = fitted.transform(images).withColumn("udf", fitted.predict_udf()("image"))
    rows = scored.select("image", "prediction", "udf").collect()
    expected = [r.prediction for r in rows]
    assert [r.udf for r in rows] == expected and len(set(expected)) > 1
    uri = f"runs:/{fitted.run_id}/model"
    loaded = mlflow.pyfunc.load_model(uri)
    [spec] = loaded.metadata.get_input_schema().inputs
    assert spec.name == "image" and type(spec.type).__name__ == "Object"
    # the exported program's kernels against transform's: both within rounding of these
    logits, apart = logits_here(fitted.model, rows)
    assert classes_agree(expected, logits, apart)
    dicts = pd.DataFrame({"image": [r.image.asDict() for r in rows]})
    assert classes_agree(loaded.predict(dicts), logits, apart)
    assert loaded.predict(pd.DataFrame({"image": [r.image for r in rows]})).tolist() == \
        loaded.predict(dicts).tolist()  # the same program on the same rows
    udf = mlflow.pyfunc.spark_udf(spark, uri, result_type="long", env_manager="local")
    served = scored.select("image", udf(F.struct("image")).alias("served")).collect()
    logits, apart = logits_here(fitted.model, served)
    assert classes_agree([r.served for r in served], logits, apart)


def test_the_logged_model_requires_what_the_preprocess_imports(fitted):
    import importlib.metadata

    import mlflow

    path = mlflow.artifacts.download_artifacts(f"runs:/{fitted.run_id}/model/requirements.txt")
    with open(path) as f:
        lines = f.read().split()
    assert f"pillow=={importlib.metadata.version('pillow')}" in lines
    assert f"numpy=={np.__version__}" in lines and lines[0].startswith("torch==")


def test_a_model_fixing_a_width_is_logged_exported_not_pickled(fitted):
    """The Linear fixes the returned features' width (5): the export check grows it, the model
    itself refuses that, so the width is the model's own and the pt2 export is kept."""
    import mlflow

    data = {a.path.rsplit("/", 1)[-1] for a in
            mlflow.MlflowClient().list_artifacts(fitted.run_id, "model/data")}
    assert "model.pt2" in data and "model.pth" not in data


def test_the_spark_ml_model_scores_image_structs(images, fitted, tmp_path):
    """As `AveragingEstimator(preprocess=)` builds it from the fit (its fit with a
    preprocess: tests/test_preprocess.py), saved and loaded: predict_udf's classes, which
    the test above holds equal to transform's."""
    from sparkdl_avg.ml import AveragingModel

    model = AveragingModel(torch_model=fitted.model, schema=fitted.schema, heads=fitted.heads,
                           classify=fitted.classify, preprocess=fitted.preprocess,
                           model_schema=fitted.model_schema)
    model.save(str(tmp_path / "model"))
    loaded = AveragingModel.load(str(tmp_path / "model"))
    rows = loaded.transform(images).withColumn("expected", fitted.predict_udf()("image"))
    rows = rows.select("prediction", "expected").collect()
    assert [r.prediction for r in rows] == [float(r.expected) for r in rows]


def test_the_image_struct_without_preprocess_is_refused_saying_so(images):
    config = TrainConfig(num_workers=2, epochs=1, log_model=False,
                         experiment_name="image-source")
    with pytest.raises(DataError, match=r"image.*fit\(preprocess=fn\)"):
        fit(images, lambda: torch.nn.Linear(5, 2), config, features_col="image")
