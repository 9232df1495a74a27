"""Spark's `image` source struct (issue 31) as an input with `fit(preprocess=)`: it reaches
the preprocess as {"data": list of bytes, "height", "width", "nChannels", "mode": int32
arrays} (`origin` left out), carried and cached as one binary value. PNG files of two sizes
and two modes are written in the test and read with `spark.read.format("image")`; `transform`
(preprocess with training=False, then the model) equals the returned model on features
computed on the driver from the rows Spark read."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pyspark.sql import functions as F

from sparkdl_avg import DataError, TrainConfig, fit
from sparkdl_avg.data.feed import raw_batch
from sparkdl_avg.data.schema import DataSchema, FieldSpec

pytestmark = pytest.mark.spark
SHAPES = [((3, 4), "RGB"), ((5, 2), "L")]  # (height, width), PIL mode


def _features(data, height, width, channels, mode) -> np.ndarray:
    """What the model sees of one image: its size, mode and mean pixel (from the bytes, so a
    wrong header or wrong bytes changes it)."""
    pixels = np.frombuffer(data, np.uint8).reshape(height, width, channels)
    return np.array([height, width, channels, mode, pixels.mean() / 255], np.float32)


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


def test_the_image_struct_reaches_preprocess_as_a_dict_and_scores_alike(images):
    config = TrainConfig(num_workers=2, epochs=2, batch_size=4, lr=0.05, log_model=False,
                         experiment_name="image-source")
    result = fit(images, lambda: torch.nn.Linear(5, 2), config, features_col="image",
                 preprocess=_decode)
    raw = [(r.image.data, r.image.height, r.image.width, r.image.nChannels, r.image.mode)
           for r in images.collect()]
    assert {(h, w, c, m) for _, h, w, c, m in raw} == {(3, 4, 3, 16), (5, 2, 1, 0)}
    scored = result.transform(images).select("image", "prediction").collect()
    x = torch.tensor(np.stack([_features(r.image.data, r.image.height, r.image.width,
                                         r.image.nChannels, r.image.mode) for r in scored]))
    with torch.no_grad():
        expected = result.model(x).argmax(1)
    assert [r.prediction for r in scored] == expected.tolist()


def test_the_image_struct_without_preprocess_is_refused_saying_so(images):
    config = TrainConfig(num_workers=2, epochs=1, log_model=False,
                         experiment_name="image-source")
    with pytest.raises(DataError, match=r"image.*fit\(preprocess=fn\)"):
        fit(images, lambda: torch.nn.Linear(5, 2), config, features_col="image")


def test_a_packed_header_is_split_without_a_row_loop():
    field = FieldSpec(role="input", name="image", column="image", wire="_x0", dtype="uint8",
                      shape=(-1,), source="struct<origin:string,...>", encoded=True)
    schema = DataSchema(inputs=(field,), binding="single", labels=(), label_list=False,
                        weight=None, float_dtype="float32")
    rows = [((2, 3, 1, 0), b"abcdef"), ((1, 1, 3, 16), b"xyz")]
    packed = [np.array(ints, ">i4").tobytes() + data for ints, data in rows]
    values = np.frombuffer(b"".join(packed), np.uint8)
    image = raw_batch(schema, [(values, np.array([len(p) for p in packed]))])["image"]
    assert image["data"] == [b"abcdef", b"xyz"]
    assert image["height"].tolist() == [2, 1] and image["nChannels"].tolist() == [1, 3]
    assert image["width"].tolist() == [3, 1] and image["mode"].tolist() == [0, 16]
